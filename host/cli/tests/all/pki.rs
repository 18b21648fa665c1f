//! `wasmcsi pki` as an operator runs it: the real binary makes a CA, issues a node's and the
//! controller's credentials, and shows them; what it writes loads as the credentials every
//! process reads (`--tls-dir`), and what `show` reports is checked against a broken set too.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime};

use wasmcsi_trust::{Credentials, Role};

/// `wasmcsi pki ARGS`: exit code and everything printed.
fn pki(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wasmcsi")).arg("pki").args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code(), text)
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn a_ca_issues_node_and_controller_credentials_that_load_and_show_their_role() {
    let d = tempfile::tempdir().unwrap();
    let (ca, node, controller) = (d.path().join("ca"), d.path().join("worker-1"), d.path().join("controller"));
    let (code, text) = pki(&["init", "--dir", path(&ca)]);
    assert_eq!(code, Some(0), "{text}");
    let mode = |p: &Path| std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(p).unwrap().permissions()) & 0o777;
    assert_eq!(mode(&ca.join("ca.key")), 0o600, "the CA key is private");

    let (code, text) =
        pki(&["issue", "--ca", path(&ca), "--node", "worker-1", "--out", path(&node), "--validity", "30m"]);
    assert_eq!(code, Some(0), "{text}");
    let (code, text) = pki(&["issue", "--ca", path(&ca), "--controller", "--out", path(&controller)]);
    assert_eq!(code, Some(0), "{text}");

    // What every process loads from --tls-dir.
    let loaded = Credentials::load(&node).unwrap();
    assert_eq!(loaded.role(), &Role::Node("worker-1".into()));
    let left = loaded.not_after().duration_since(SystemTime::now()).unwrap();
    assert!(left <= Duration::from_secs(1800) && left > Duration::from_secs(1700), "--validity 30m: {left:?}");
    assert_eq!(Credentials::load(&controller).unwrap().role(), &Role::Controller);

    let (code, text) = pki(&["show", path(&node)]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("role:         node \"worker-1\" (spiffe://wasmcsi/node/worker-1)"), "{text}");
    assert!(text.contains("key matches:  yes") && text.contains("verifies:     yes"), "{text}");
    assert!(text.contains("issuer:") && text.contains("wasmcsi CA"), "{text}");
    assert!(text.contains("(in 29m") || text.contains("(in 30m"), "expiry in 30 minutes: {text}");
    let (code, text) = pki(&["show", path(&controller)]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("role:         controller (spiffe://wasmcsi/controller)"), "{text}");
    assert!(text.contains("(in 23h") || text.contains("(in 1d0h"), "the default validity is 24h: {text}");
}

#[test]
fn init_refuses_to_replace_a_ca() {
    let d = tempfile::tempdir().unwrap();
    let ca = d.path().join("ca");
    assert_eq!(pki(&["init", "--dir", path(&ca)]).0, Some(0));
    let key = std::fs::read(ca.join("ca.key")).unwrap();
    let (code, text) = pki(&["init", "--dir", path(&ca)]);
    assert_ne!(code, Some(0), "{text}");
    assert!(text.contains("refusing to replace a CA"), "{text}");
    assert_eq!(std::fs::read(ca.join("ca.key")).unwrap(), key, "the first CA's key is untouched");
}

#[test]
fn show_reports_a_key_of_another_certificate_and_exits_1() {
    let d = tempfile::tempdir().unwrap();
    let (ca, a, b) = (d.path().join("ca"), d.path().join("a"), d.path().join("b"));
    assert_eq!(pki(&["init", "--dir", path(&ca)]).0, Some(0));
    for dir in [&a, &b] {
        assert_eq!(pki(&["issue", "--ca", path(&ca), "--node", "n1", "--out", path(dir)]).0, Some(0));
    }
    // a's certificate with b's key, as a botched copy would leave it.
    let mut files = wasmcsi_trust::secret_dir::read(&a).unwrap();
    files.key = wasmcsi_trust::secret_dir::read(&b).unwrap().key;
    wasmcsi_trust::secret_dir::write(&a, &files).unwrap();
    let (code, text) = pki(&["show", path(&a)]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("key matches:  NO"), "{text}");
    assert!(text.contains("verifies:     yes"), "the chain itself is fine: {text}");
}

#[test]
fn issue_needs_exactly_one_role_and_a_valid_node_name() {
    let d = tempfile::tempdir().unwrap();
    let ca = d.path().join("ca");
    let out = d.path().join("out");
    assert_eq!(pki(&["init", "--dir", path(&ca)]).0, Some(0));
    let (code, text) = pki(&["issue", "--ca", path(&ca), "--out", path(&out)]);
    assert_eq!(code, Some(2), "no role: {text}");
    let (code, text) = pki(&["issue", "--ca", path(&ca), "--node", "n", "--controller", "--out", path(&out)]);
    assert_eq!(code, Some(2), "two roles: {text}");
    let (code, text) = pki(&["issue", "--ca", path(&ca), "--node", "", "--out", path(&out)]);
    assert_ne!(code, Some(0), "an empty node id: {text}");
    assert!(!out.join("tls.crt").exists(), "nothing issued: {text}");
}
