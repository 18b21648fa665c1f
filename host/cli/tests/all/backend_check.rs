//! `wasmcsi backend check` and `backend ls`, run as an operator would: the real binary.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::process::Command;

fn wasmcsi(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wasmcsi")).args(args).env("RUST_LOG", "warn").output().unwrap();
    let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
    (out.status.code().unwrap_or(-1), text(out.stdout), text(out.stderr))
}

#[test]
fn check_passes_the_hostpath_example_and_names_what_it_needs() {
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("hostpath.wasm");
    std::fs::write(&file, wasmcsi_artifacts::HOSTPATH).unwrap();
    let (code, out, err) = wasmcsi(&["backend", "check", file.to_str().unwrap()]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("wasmcsi:backend/dir"), "{out}");
    assert!(out.contains("grants needed: dir"), "{out}");
    assert!(out.contains("wasmcsi:backend/driver@0.3.0"), "exports listed: {out}");
    assert!(out.lines().any(|l| l.ends_with(" 0 failed, 0 skipped") || l.contains(" 0 failed")), "{out}");
}

#[test]
fn check_runs_a_backend_built_against_0_1_and_names_its_contract() {
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("hostpath-v0-1.wasm");
    std::fs::write(&file, wasmcsi_artifacts::HOSTPATH_V0_1).unwrap();
    let (code, out, err) = wasmcsi(&["backend", "check", file.to_str().unwrap()]);
    assert!(out.contains("wasmcsi:backend/driver@0.1.0"), "exports listed: {out}");
    assert!(out.contains("contract: wasmcsi:backend@0.1.0 (previous version"), "{out}");
    assert!(out.contains("grants needed: dir"), "{out}");
    // The frozen 0.1.0 hostpath refuses names CSI allows (1-80 of [A-Za-z0-9._-]): exactly the
    // two any-name checks fail, by its own policy; everything else passes.
    let failed: Vec<&str> = out.lines().filter(|l| l.starts_with("FAIL ")).collect();
    assert_eq!(failed.len(), 2, "stdout:\n{out}\nstderr:\n{err}");
    assert!(failed.iter().all(|l| l.contains("128-byte Unicode name")), "{failed:?}");
    assert_eq!(code, 1, "a failed check fails the command");
}

#[test]
fn check_names_the_contract_of_a_current_backend_and_refuses_block_at_0_1() {
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("hostile.wasm");
    std::fs::write(&file, wasmcsi_artifacts::HOSTILE).unwrap();
    let (_, out, _) = wasmcsi(&["backend", "check", "--no-node", file.to_str().unwrap()]);
    assert!(out.lines().any(|l| l == "contract: wasmcsi:backend@0.3.0"), "{out}");

    let file = d.path().join("block-v0-1.wasm");
    std::fs::write(&file, wasmcsi_artifacts::BLOCK_V0_1).unwrap();
    let (code, out, err) = wasmcsi(&["backend", "check", "--no-node", file.to_str().unwrap()]);
    assert_eq!(code, 1, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("contract: wasmcsi:backend@0.1.0"), "{out}");
    assert!(out.contains("does not load"), "{out}");
    assert!(err.contains("wasmcsi:backend/block@0.1.0") && err.contains("needs wasmcsi:backend@0.2.0"), "{err}");
}

#[test]
fn check_fails_a_backend_that_breaks_csi_semantics_with_a_readable_report() {
    let d = tempfile::tempdir().unwrap();
    // The hostile fixture answers every CreateVolume with an error: not a usable backend.
    let file = d.path().join("hostile.wasm");
    std::fs::write(&file, wasmcsi_artifacts::HOSTILE).unwrap();
    let (code, out, err) = wasmcsi(&["backend", "check", "--no-node", file.to_str().unwrap()]);
    assert_eq!(code, 1, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("FAIL"), "{out}");
}

/// The replicated-block component with no block grant: the check gives it scratch replica
/// nodes (its own host's and two more) and runs the whole suite, the node flow included when
/// root (the engine's FUSE + loop device, ext4).
#[test]
fn check_passes_the_replicated_block_component_on_scratch_replica_nodes() {
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("replicated-block.wasm");
    std::fs::write(&file, wasmcsi_artifacts::REPLICATED_BLOCK).unwrap();
    let (code, out, err) = wasmcsi(&["backend", "check", file.to_str().unwrap()]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("wasmcsi:backend/block"), "{out}");
    assert!(out.contains("replica nodes: 127.0.0.1:"), "{out}");
    if nix::unistd::geteuid().is_root() {
        assert!(out.contains("PASS NodePublishVolume publishes the volume"), "the node flow ran: {out}");
    }
    assert!(out.lines().any(|l| l.contains(" 0 failed")), "{out}");
}

#[test]
fn check_rejects_a_file_that_is_not_a_component() {
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("broken.wasm");
    std::fs::write(&file, b"\0asm\x0d\0\x01\0 not really").unwrap();
    let (code, _, err) = wasmcsi(&["backend", "check", file.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a valid component"), "{err}");
}

#[test]
fn ls_reports_loaded_and_rejected_backends_with_their_contract_version() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("hostpath.wasm"), wasmcsi_artifacts::HOSTPATH).unwrap();
    std::fs::write(d.path().join("hostpath-v0-1.wasm"), wasmcsi_artifacts::HOSTPATH_V0_1).unwrap();
    std::fs::write(d.path().join("broken.wasm"), b"nope").unwrap();
    let config = d.path().join("config.toml");
    let root = d.path().display().to_string();
    std::fs::write(
        &config,
        format!(
            "[backends.hostpath.grants]\ndir = {{ default = {root:?} }}\n\
             [backends.hostpath-v0-1.grants]\ndir = {{ default = {root:?} }}\n"
        ),
    )
    .unwrap();
    let (code, out, err) =
        wasmcsi(&["backend", "ls", "--backends-dir", d.path().to_str().unwrap(), "--config", config.to_str().unwrap()]);
    // A rejected file makes `ls` exit 1: scripts and probes must see it.
    assert_eq!(code, 1, "{err}");
    let columns = |name: &str| -> Vec<String> {
        let line = out.lines().find(|l| l.split_whitespace().next() == Some(name)).unwrap_or_default();
        line.split_whitespace().map(str::to_string).collect()
    };
    assert_eq!(columns("NAME")[3..5], ["STATUS", "CONTRACT"], "{out}");
    assert_eq!(columns("hostpath")[3..5], ["ok", "0.3.0"], "{out}");
    assert_eq!(columns("hostpath-v0-1")[3..5], ["ok", "0.1.0"], "{out}");
    assert_eq!(columns("broken")[3..5], ["rejected", "-"], "{out}");
}

/// The ceph-rbd-shim component against a real Ceph cluster (1 mon, 1 mgr, 2 memstore OSDs in a
/// private namespace; `wasmcsi_ceph`), with a cephx user limited to the test's pool
/// passed as ceph-csi's `userID`/`userKey` secrets through `--secret`. The node checks need
/// krbd or rbd-nbd (or the rbd-fuse executor); here the controller part of the suite, the group
/// snapshot flow included.
#[test]
fn check_passes_the_ceph_rbd_shim_component_against_ceph() {
    let Some(ceph) = wasmcsi_ceph::Ceph::shared() else { return };
    let pool = "check";
    ceph.create_pool(pool).unwrap();
    let key = ceph.create_user("csi-check", pool).unwrap();
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("ceph-rbd-shim.wasm");
    std::fs::write(&file, wasmcsi_artifacts::CEPH_RBD_SHIM).unwrap();
    let config = d.path().join("config.toml");
    let cluster = wasmcsi_ceph::CLUSTER;
    std::fs::write(
        &config,
        format!(
            "[runtime]\ncall_deadline_ms = 30000\nimport_timeout_ms = 20000\n\
             [clusters.{cluster}]\nmonitors = {:?}\n\
             [backends.ceph-rbd-shim.grants]\nrbd = [{{ cluster = {cluster:?}, pools = [{pool:?}] }}]\n",
            ceph.monitors()
        ),
    )
    .unwrap();
    let (cluster_param, pool_param) = (format!("clusterID={cluster}"), format!("pool={pool}"));
    let user_key = format!("userKey={key}");
    let started = std::time::Instant::now();
    let (code, out, err) = wasmcsi(&[
        "backend",
        "check",
        "--no-node",
        "--config",
        config.to_str().unwrap(),
        "--param",
        &cluster_param,
        "--param",
        &pool_param,
        "--secret",
        "userID=csi-check",
        "--secret",
        &user_key,
        file.to_str().unwrap(),
    ]);
    eprintln!("backend check took {:?}", started.elapsed());
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("wasmcsi:backend/rbd"), "{out}");
    assert!(out.contains("grants needed: rbd"), "{out}");
    assert!(out.lines().any(|l| l.contains(" 0 failed")), "{out}");
    // The group snapshot flow ran (the host takes them at one point under the images' locks).
    for check in [
        "PASS CreateVolumeGroupSnapshot snapshots every source, each snapshot naming the group",
        "PASS CreateVolumeGroupSnapshot repeated returns the same group snapshot",
        "PASS GetVolumeGroupSnapshot returns the group snapshot",
        "PASS DeleteVolumeGroupSnapshot deletes it, and again succeeds",
        "PASS GetVolumeGroupSnapshot of a deleted group snapshot is NotFound",
    ] {
        assert!(out.contains(check), "no {check:?} in\n{out}");
    }
    assert!(!out.contains(&key) && !err.contains(&key), "the key was printed");
    // What the suite created it deleted.
    let left = ceph.rbd(&["ls", pool]).unwrap();
    assert!(left.trim().is_empty(), "left in the pool: {left}");
}

/// The nfs component against a real nfs-ganesha (private namespace, NFSv3 through the host's
/// userspace client). The node checks need a kernel NFS client, which this machine lacks: they
/// run in the kernel-VM tier (`nfs_flow_vm`); here the controller part of the suite.
#[test]
fn check_passes_the_nfs_component_against_ganesha() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: not root (ganesha runs in a private namespace)");
        return;
    }
    let g = wasmcsi_ganesha::Ganesha::start().unwrap();
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("nfs.wasm");
    std::fs::write(&file, wasmcsi_artifacts::NFS).unwrap();
    let config = d.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[backends.nfs.grants]\nnfs = [{{ server = {:?}, share = {:?} }}]\n",
            g.server(),
            wasmcsi_ganesha::SHARE
        ),
    )
    .unwrap();
    let server = format!("server={}", g.server());
    let share = format!("share={}", wasmcsi_ganesha::SHARE);
    let (code, out, err) = wasmcsi(&[
        "backend",
        "check",
        "--no-node",
        "--config",
        config.to_str().unwrap(),
        "--param",
        &server,
        "--param",
        &share,
        file.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("wasmcsi:backend/nfs"), "{out}");
    assert!(out.contains("grants needed: nfs"), "{out}");
    assert!(out.lines().any(|l| l.contains(" 0 failed")), "{out}");
    // What the suite created it deleted: the export holds only the backend's own bookkeeping.
    let left: Vec<String> = std::fs::read_dir(g.export_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "left on the export: {left:?}");
}

/// The guest SDK declares every capability; a component must still import only those its code
/// calls, or an operator would have to grant (and the host to link) what it never uses.
#[test]
fn bundled_components_import_only_the_capabilities_they_call() {
    use wasmcsi_runtime::capabilities::Capability::{Backup, Block, Dir, Kv, Log, Nfs, Rbd};
    use wasmcsi_runtime::{Runtime, RuntimeOptions, config::HostConfig, wasm_engine::WasmEngineSettings};
    let d = tempfile::tempdir().unwrap();
    let runtime = Runtime::new(RuntimeOptions {
        config: HostConfig::default(),
        cache_dir: None,
        store_path: d.path().join("inspect.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 8, ..Default::default() },
    })
    .unwrap();
    for (name, wasm, expected) in [
        ("hostpath", wasmcsi_artifacts::HOSTPATH, vec![Log, Dir]),
        ("nfs", wasmcsi_artifacts::NFS, vec![Log, Kv, Nfs]),
        ("ceph-rbd-shim", wasmcsi_artifacts::CEPH_RBD_SHIM, vec![Log, Kv, Rbd]),
        ("hostile", wasmcsi_artifacts::HOSTILE, vec![Log, Kv, Dir]),
        // `backup`: its snapshot classes may ask for backups (linked without a grant, reaching nothing).
        ("replicated-block", wasmcsi_artifacts::REPLICATED_BLOCK, vec![Log, Block, Backup]),
    ] {
        let (imports, exports) = runtime.inspect(name, wasm).unwrap();
        assert_eq!(imports.capabilities, expected, "{name}");
        assert!(imports.unknown.is_empty(), "{name}: {:?}", imports.unknown);
        assert_eq!(exports, ["wasmcsi:backend/driver@0.3.0"], "{name}");
    }
}

/// `wasmcsi backend new` for every capability, as an author would use it: the crate it writes
/// (outside any workspace, the SDK a path dependency) passes its own unit tests, builds with its
/// one documented command, and the component passes `backend check` unedited: dir and block on
/// the check's scratch root and replica nodes, nfs against ganesha (root only), rbd against
/// Ceph (where it runs). The crates share one target dir under the workspace's, kept between
/// runs: the SDK's dependencies are built once.
#[test]
fn backend_new_writes_crates_that_build_and_pass_check_for_every_capability() {
    let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("backend-new");
    let (crates, target) = (base.join("crates"), base.join("target"));
    let _ = std::fs::remove_dir_all(&crates);
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let rustc = Command::new("rustc").arg("-vV").output().unwrap();
    let rustc = String::from_utf8_lossy(&rustc.stdout).into_owned();
    let host = rustc.lines().find_map(|l| l.strip_prefix("host: ")).unwrap();
    let cargo_in = |dir: &std::path::Path, args: &[&str]| {
        let started = std::time::Instant::now();
        let out = Command::new(&cargo)
            .current_dir(dir)
            .args(args)
            .env("CARGO_TARGET_DIR", &target)
            // The outer build's flags (coverage, clippy, a target) are not the author's.
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("RUSTC_WORKSPACE_WRAPPER")
            .env_remove("CARGO_BUILD_TARGET")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "cargo {args:?} in {}:\n{err}", dir.display());
        eprintln!("cargo {} in {}: {:?}", args[0], dir.display(), started.elapsed());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let mut components = vec![];
    for capability in ["dir", "nfs", "rbd", "block"] {
        let name = format!("new-{capability}");
        let dir = crates.join(&name);
        let (code, out, err) =
            wasmcsi(&["backend", "new", &name, "--capability", capability, "--dir", dir.to_str().unwrap()]);
        assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
        assert!(out.contains("cargo build --release --target wasm32-wasip2"), "{out}");
        // `--target` the host's: its build scripts and proc macros are the wasm build's.
        let tests = cargo_in(&dir, &["test", "--release", "--target", host]);
        let ran = |l: &str| l.starts_with("test result: ok.") && !l.starts_with("test result: ok. 0 passed");
        assert!(tests.lines().any(ran), "{tests}");
        cargo_in(&dir, &["build", "--release", "--target", "wasm32-wasip2"]);
        let component = target.join(format!("wasm32-wasip2/release/new_{capability}.wasm"));
        assert!(component.is_file(), "{} not built", component.display());
        components.push((capability, component));
    }
    let check = |args: &[&str]| {
        let started = std::time::Instant::now();
        let (code, out, err) = wasmcsi(&[&["backend", "check"], args].concat());
        // The file only: the arguments hold a key.
        eprintln!("backend check {}: {:?}", args.last().unwrap(), started.elapsed());
        assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
        assert!(out.lines().any(|l| l.contains(" 0 failed")), "{out}");
        out
    };
    let file = |capability: &str| components.iter().find(|(c, _)| *c == capability).unwrap().1.to_str().unwrap();
    let out = check(&[file("dir")]);
    assert!(out.contains("backend name: new-dir (the host loads it as new-dir.wasm)"), "{out}");
    assert!(out.contains("grants needed: dir\n"), "{out}");
    if nix::unistd::geteuid().is_root() {
        assert!(out.contains("conformance (controller + node)"), "the node flow ran too: {out}");
    }
    let out = check(&["--no-node", file("block")]);
    assert!(out.contains("grants needed: block\n"), "{out}");

    let d = tempfile::tempdir().unwrap();
    if nix::unistd::geteuid().is_root() {
        let g = wasmcsi_ganesha::Ganesha::start().unwrap();
        let config = d.path().join("nfs.toml");
        let grant = format!("nfs = [{{ server = {:?}, share = {:?} }}]", g.server(), wasmcsi_ganesha::SHARE);
        std::fs::write(&config, format!("[backends.new-nfs.grants]\n{grant}\n")).unwrap();
        let (server, share) = (format!("server={}", g.server()), format!("share={}", wasmcsi_ganesha::SHARE));
        let config = config.to_str().unwrap();
        let out = check(&["--no-node", "--config", config, "--param", &server, "--param", &share, file("nfs")]);
        assert!(out.contains("grants needed: nfs\n"), "{out}");
    } else {
        eprintln!("SKIPPED the nfs template's check: not root (ganesha runs in a private namespace)");
    }
    if let Some(ceph) = wasmcsi_ceph::Ceph::shared() {
        let pool = "newrbd";
        ceph.create_pool(pool).unwrap();
        let key = ceph.create_user("csi-new", pool).unwrap();
        let config = d.path().join("rbd.toml");
        let cluster = wasmcsi_ceph::CLUSTER;
        let monitors = ceph.monitors();
        std::fs::write(
            &config,
            format!(
                "[runtime]\ncall_deadline_ms = 30000\nimport_timeout_ms = 20000\n[clusters.{cluster}]\nmonitors = {monitors:?}\n\
                 [backends.new-rbd.grants]\nrbd = [{{ cluster = {cluster:?}, pools = [{pool:?}] }}]\n"
            ),
        )
        .unwrap();
        let (cluster, pool_param, key) =
            (format!("clusterID={cluster}"), format!("pool={pool}"), format!("userKey={key}"));
        let config = config.to_str().unwrap();
        let args = ["--no-node", "--config", config, "--param", &cluster, "--param", &pool_param];
        let out = check(&[&args[..], &["--secret", "userID=csi-new", "--secret", &key, file("rbd")]].concat());
        assert!(out.contains("grants needed: rbd\n"), "{out}");
        assert!(ceph.rbd(&["ls", pool]).unwrap().trim().is_empty(), "the check left images in the pool");
    }
}
