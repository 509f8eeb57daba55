//! See docs/fuzzing.md and `ssdcache_fuzz::nbd_request` for what this target checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ssdcache_fuzz::nbd_request::check(data));
