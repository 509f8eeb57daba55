//! See docs/fuzzing.md and `ssdcache_fuzz::format_journal_block` for what this target checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ssdcache_fuzz::format_journal_block::check(data));
