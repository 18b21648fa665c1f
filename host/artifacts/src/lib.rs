//! The components this workspace builds: the bundled backends, the example backend and the
//! test fixtures (hostile, and backends built against the previous contract), as bytes. `ALL`
//! lists them with the file stem the host would load them as (`hostpath.wasm` → backend
//! `hostpath`); `bundled` is what an operator gets (the image's backends directory, `wasmcsi
//! backend export`). `TESTKIT_CAPABILITIES` and `TESTKIT_CHECKS` are the test kit's parts that
//! `wasmcsi backend compose` wraps around a backend: not backends, so not in `ALL`. Building
//! them is `build.rs`'s job; this crate holds no logic.
include!(concat!(env!("OUT_DIR"), "/artifacts.rs"));

/// Components built only to test the host: never shipped to an operator.
pub const FIXTURES: &[&str] = &["hostile", "hostpath-v0-1", "block-v0-1", "rbd-v0-2"];

/// The components an operator gets, as (file stem, bytes): every entry of `ALL` that is not a
/// test fixture, so a backend added to the build is shipped without another list to update.
pub fn bundled() -> impl Iterator<Item = (&'static str, &'static [u8])> {
    ALL.iter().copied().filter(|(name, _)| !FIXTURES.contains(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundled_has_every_backend_and_no_fixture() {
        let names: Vec<&str> = bundled().map(|(n, _)| n).collect();
        for shipped in ["hostpath", "nfs", "ceph-rbd-shim"] {
            assert!(names.contains(&shipped), "{shipped} missing from {names:?}");
        }
        assert!(!names.iter().any(|n| FIXTURES.contains(n)), "a fixture is shipped: {names:?}");
        assert!(FIXTURES.iter().all(|f| ALL.iter().any(|(n, _)| n == f)), "a fixture name matches nothing in ALL");
    }
}
