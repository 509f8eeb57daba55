//! Whether the shared block traces are there for the tests: `SSDCACHE_TRACES` set at build
//! time turns `cfg(ssdcache_traces)` on, and the tests that read those traces run; without it
//! (a bare clone has no traces folder) they are built `#[ignore]`d, so `cargo test` counts them
//! as ignored rather than as passed tests that checked nothing. The tests read the folder
//! from the same variable at run time.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(ssdcache_traces)");
    println!("cargo::rerun-if-env-changed=SSDCACHE_TRACES");
    if std::env::var_os("SSDCACHE_TRACES").is_some_and(|dir| !dir.is_empty()) {
        println!("cargo::rustc-cfg=ssdcache_traces");
    }
}
