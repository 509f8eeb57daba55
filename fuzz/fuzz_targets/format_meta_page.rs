//! See docs/fuzzing.md and `ssdcache_fuzz::format_meta_page` for what this target checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ssdcache_fuzz::format_meta_page::check(data));
