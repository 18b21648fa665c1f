//! `wasmcsi backend keygen | push | sign | pull`, the real binary against a real registry
//! (distribution v2 with TLS and basic auth): a pushed backend pulls back byte-exact with its
//! info() and contract in annotations, verified by the signer's key and refused with another.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::path::Path;
use std::process::{Command, Output};
use wasmcsi_oci_registry::TestRegistry;

fn wasmcsi(args: &[&str], reg: &TestRegistry, dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_wasmcsi"))
        .args(args)
        .arg("--docker-config")
        .arg(&reg.docker_config)
        .arg("--ca-file")
        .arg(&reg.ca_file)
        .current_dir(dir)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_pushed_and_signed_backend_pulls_back_byte_exact_and_another_key_is_refused() {
    let Some(reg) = TestRegistry::start_or_skip() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("hostpath.wasm"), wasmcsi_artifacts::HOSTPATH).unwrap();
    for name in ["team", "other"] {
        let out = Command::new(env!("CARGO_BIN_EXE_wasmcsi"))
            .args(["backend", "keygen", name])
            .current_dir(d)
            .output()
            .unwrap();
        stdout(&out);
    }
    let target = format!("oci://{}/backends/hostpath:v1", reg.addr);
    let pushed = stdout(&wasmcsi(&["backend", "push", "hostpath.wasm", &target], &reg, d));
    let pinned = pushed.lines().find(|l| l.starts_with("oci://")).unwrap().to_string();
    assert!(pinned.contains("@sha256:"), "{pushed}");
    stdout(&wasmcsi(&["backend", "sign", &pinned, "--key", "team.key"], &reg, d));

    let pulled = stdout(&wasmcsi(&["backend", "pull", &pinned, "--public-key", "team.pub", "-o", "out.wasm"], &reg, d));
    assert_eq!(std::fs::read(d.join("out.wasm")).unwrap(), wasmcsi_artifacts::HOSTPATH);
    assert!(pulled.contains("io.wasmcsi.backend.contract: wasmcsi:backend@0."), "{pulled}");
    assert!(pulled.contains("io.wasmcsi.backend.info: {") && pulled.contains("\"name\":\"hostpath\""), "{pulled}");
    assert!(pulled.contains("signature verified with team.pub"), "{pulled}");

    let refused = wasmcsi(&["backend", "pull", &pinned, "--public-key", "other.pub", "-o", "no.wasm"], &reg, d);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("signature refused"), "{stderr}");
    assert!(!d.join("no.wasm").exists());
    // A tag is refused without --allow-tag.
    let tag = wasmcsi(&["backend", "pull", &target], &reg, d);
    assert!(String::from_utf8_lossy(&tag.stderr).contains("allow_tag"), "{}", String::from_utf8_lossy(&tag.stderr));
}
