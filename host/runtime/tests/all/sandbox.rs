//! The sandbox against real components: the hostpath example and the hostile fixture,
//! built by `wasmcsi-artifacts`. Each limit has an "obeyed" and a "violated" case, and a
//! misbehaving backend never disturbs another one in the same runtime.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::driver::{CapacityRange, CreateVolumeRequest, Pair};
use wasmcsi_runtime::registry::ConfigChange;
use wasmcsi_runtime::wasm_engine::WasmEngineSettings;
use wasmcsi_runtime::{CallError, LoadError, Registry, Runtime, RuntimeOptions, WitError};

const DEADLINE_MS: u64 = 500;
/// What a loaded 2-core machine may add between a deadline and the answer. The bounds only have
/// to tell a call stopped at its deadline from one that is not (a spinning guest never ends);
/// how late the answers come is measured by
/// `cargo bench --workspace --bench backend_call -- neighbour`.
const SLACK: Duration = Duration::from_secs(1);

fn config(root: &Path, hostile_gets_dir: bool) -> HostConfig {
    let hostile_dir = if hostile_gets_dir {
        format!("[backends.hostile.grants]\ndir = {{ default = \"{}/hostile\" }}\n", root.display())
    } else {
        String::new()
    };
    let text = format!(
        "[runtime]\nmemory_limit_mib = 32\ncall_deadline_ms = {DEADLINE_MS}\nimport_timeout_ms = 400\n\
         [backends.hostpath]\ncall_deadline_ms = 10000\n\
         [backends.hostpath.grants]\ndir = {{ default = \"{}/hostpath\" }}\n{hostile_dir}",
        root.display()
    );
    HostConfig::parse(&text, Path::new("test")).unwrap()
}

fn runtime(dir: &Path, hostile_gets_dir: bool) -> Arc<Runtime> {
    std::fs::create_dir_all(dir.join("hostpath")).unwrap();
    std::fs::create_dir_all(dir.join("hostile")).unwrap();
    Runtime::new(RuntimeOptions {
        config: config(dir, hostile_gets_dir),
        cache_dir: Some(dir.join("cache")),
        store_path: dir.join("state/meta.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 64, max_memory_bytes: 256 << 20 },
    })
    .unwrap()
}

fn request(name: &str, params: &[(&str, &str)]) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity: CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 },
        capabilities: vec![],
        parameters: params.iter().map(|(k, v)| Pair { key: (*k).into(), value: (*v).into() }).collect(),
        secrets: vec![],
        content_source: None,
        accessibility: None,
        mutable_parameters: vec![],
    }
}

async fn hostile_call(rt: &Runtime, mode: &str) -> (Result<wasmcsi_runtime::driver::Volume, CallError>, Duration) {
    let b = rt.load("hostile", wasmcsi_artifacts::HOSTILE, None).await.unwrap();
    let start = Instant::now();
    let r = b.create_volume(request("v", &[("mode", mode)]), vec![]).await;
    (r, start.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostpath_creates_a_volume_directory_through_the_dir_capability() {
    let d = tempfile::tempdir().unwrap();
    let rt = runtime(d.path(), false);
    let b = rt.load("hostpath", wasmcsi_artifacts::HOSTPATH, None).await.unwrap();
    assert_eq!(b.info.name, "hostpath");
    let v = b.create_volume(request("pvc-1", &[]), vec![]).await.unwrap();
    assert_eq!(v.volume_id, "default.pvc-1");
    assert!(d.path().join("hostpath/volumes/pvc-1").is_dir());
    // Same name, same request: same volume. Same name, larger size: AlreadyExists.
    assert_eq!(b.create_volume(request("pvc-1", &[]), vec![]).await.unwrap().volume_id, v.volume_id);
    let mut bigger = request("pvc-1", &[]);
    bigger.capacity.required_bytes = 1 << 40;
    let e = b.create_volume(bigger, vec![]).await.unwrap_err();
    assert!(matches!(e, CallError::Backend { error: WitError::AlreadyExists(_), .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spinning_guest_is_stopped_at_its_deadline_while_another_backend_serves() {
    let d = tempfile::tempdir().unwrap();
    let rt = runtime(d.path(), true);
    let hostpath = rt.load("hostpath", wasmcsi_artifacts::HOSTPATH, None).await.unwrap();
    let rt2 = rt.clone();
    let spinning = tokio::spawn(async move { hostile_call(&rt2, "loop").await });
    // While the hostile guest spins, hostpath keeps answering.
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Count the answers that arrived while the spinner was still running (how many depends on
    // the machine's load; at least one proves the other backend is not blocked by it).
    let mut answered_while_spinning = 0;
    for i in 0..50 {
        hostpath.create_volume(request(&format!("pvc-{i}"), &[]), vec![]).await.unwrap();
        if spinning.is_finished() {
            break;
        }
        answered_while_spinning += 1;
    }
    assert!(answered_while_spinning >= 1, "hostpath answered nothing while the other backend spun");
    let (r, took) = spinning.await.unwrap();
    assert!(matches!(r, Err(CallError::Timeout { .. })), "{r:?}");
    assert!(took >= Duration::from_millis(DEADLINE_MS), "stopped early: {took:?}");
    assert!(took <= Duration::from_millis(DEADLINE_MS) + SLACK, "stopped late: {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocating_past_the_memory_cap_is_an_out_of_memory_error() {
    let d = tempfile::tempdir().unwrap();
    let rt = runtime(d.path(), true);
    let (r, took) = hostile_call(&rt, "oom").await;
    assert!(matches!(r, Err(CallError::OutOfMemory { limit_mib: 32, .. })), "{r:?}");
    assert!(took <= Duration::from_millis(DEADLINE_MS) + SLACK, "{took:?}");
}

/// A cap above the engine's ceiling (256 MiB here): the engine, not the backend's limiter,
/// refuses the growth. Still an out-of-memory, and counted under that label in `/metrics`,
/// not as a trap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_growth_the_engine_refuses_is_an_out_of_memory_error_too() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(d.path().join("hostile")).unwrap();
    let text = format!(
        "[backends.hostile]\nmemory_limit_mib = 1024\ncall_deadline_ms = 2000\nimport_timeout_ms = 400\n\
         [backends.hostile.grants]\ndir = {{ default = \"{}/hostile\" }}\n",
        d.path().display()
    );
    let rt = Runtime::new(RuntimeOptions {
        config: HostConfig::parse(&text, Path::new("test")).unwrap(),
        cache_dir: Some(d.path().join("cache")),
        store_path: d.path().join("state/meta.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 8, max_memory_bytes: 256 << 20 },
    })
    .unwrap();
    let (r, _) = hostile_call(&rt, "oom").await;
    assert!(matches!(r, Err(CallError::OutOfMemory { limit_mib: 1024, .. })), "{r:?}");
    let metrics = rt.metrics.encode();
    let series = |code: &str, kind: &str| {
        format!(r#"wasmcsi_backend_errors_total{{backend="hostile",op="create_volume",code="{code}",kind="{kind}"}} 1"#)
    };
    assert!(metrics.contains(&series("ResourceExhausted", "out-of-memory")), "{metrics}");
    assert!(!metrics.contains(&series("Internal", "trap")), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_guest_is_a_trap_for_that_call_only() {
    let d = tempfile::tempdir().unwrap();
    let rt = runtime(d.path(), true);
    let (r, _) = hostile_call(&rt, "trap").await;
    assert!(matches!(&r, Err(CallError::Trap { message, .. }) if message.contains("unreachable")), "{r:?}");
    // The next call on the same backend gets a fresh instance and works.
    let (r, _) = hostile_call(&rt, "bogus-mode").await;
    assert!(matches!(r, Err(CallError::Backend { error: WitError::InvalidArgument(_), .. })), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_the_canonical_abi_cannot_lift_is_bad_output_not_a_crash() {
    let d = tempfile::tempdir().unwrap();
    let rt = runtime(d.path(), true);
    let (r, _) = hostile_call(&rt, "bad-utf8").await;
    assert!(matches!(&r, Err(CallError::BadOutput { message, .. }) if message.contains("utf-8")), "{r:?}");
    // The same backend keeps answering.
    let (r, _) = hostile_call(&rt, "bogus-mode").await;
    assert!(matches!(r, Err(CallError::Backend { error: WitError::InvalidArgument(_), .. })), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasi_is_deny_by_default_for_files_sockets_and_env() {
    let d = tempfile::tempdir().unwrap();
    let rt = runtime(d.path(), true);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    for (mode, extra) in [("files", None), ("env", None), ("sockets", Some(("port", port.as_str())))] {
        let b = rt.load("hostile", wasmcsi_artifacts::HOSTILE, None).await.unwrap();
        let mut params = vec![("mode", mode)];
        params.extend(extra);
        let r = b.create_volume(request("v", &params), vec![]).await;
        assert!(
            matches!(&r, Err(CallError::Backend { error: WitError::PermissionDenied(m), .. }) if m.starts_with("denied")),
            "{mode}: {r:?}"
        );
    }
    assert!(!Path::new("/tmp/hostile").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ungranted_import_fails_the_load_naming_it() {
    let d = tempfile::tempdir().unwrap();
    // hostile imports `dir`; this config grants it to hostpath only.
    let e = runtime(d.path(), false).load("hostile", wasmcsi_artifacts::HOSTILE, None).await.err();
    match e {
        Some(LoadError::NotGranted { violations, .. }) => {
            assert_eq!(violations.len(), 1, "{violations:?}");
            assert!(violations[0].contains("wasmcsi:backend/dir"), "{violations:?}");
        }
        other => panic!("expected NotGranted, got {other:?}"),
    }
    // Granted, the same bytes load.
    runtime(d.path(), true).load("hostile", wasmcsi_artifacts::HOSTILE, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dir_paths_cannot_escape_the_granted_root() {
    let d = tempfile::tempdir().unwrap();
    let rt = runtime(d.path(), true);
    let (r, _) = hostile_call(&rt, "escape").await;
    assert!(
        matches!(&r, Err(CallError::Backend { error: WitError::PermissionDenied(m), .. }) if m.starts_with("denied")),
        "{r:?}"
    );
    assert!(!d.path().join("escape").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compiled_components_are_cached_across_restarts() {
    let d = tempfile::tempdir().unwrap();
    let first = runtime(d.path(), false).load("hostpath", wasmcsi_artifacts::HOSTPATH, None).await.unwrap();
    assert!(!first.cache_hit);
    drop(first); // releases the metadata store's file lock, as a process exit would
    let second = runtime(d.path(), false).load("hostpath", wasmcsi_artifacts::HOSTPATH, None).await.unwrap();
    assert!(second.cache_hit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_reload_swaps_good_files_and_keeps_serving_through_broken_ones() {
    let d = tempfile::tempdir().unwrap();
    let rt = runtime(d.path(), false);
    let dir = d.path().join("backends");
    std::fs::create_dir_all(&dir).unwrap();
    let registry = Registry::new(rt, Some(dir.clone()), None);
    assert!(registry.scan().await.loaded.is_empty());
    std::fs::write(dir.join("hostpath.wasm"), wasmcsi_artifacts::HOSTPATH).unwrap();
    assert_eq!(registry.scan().await.loaded, ["hostpath"]);
    let serving = registry.get("hostpath").unwrap();

    std::fs::write(dir.join("hostpath.wasm"), b"\0asm garbage").unwrap();
    let report = registry.scan().await;
    assert_eq!(report.rejected.len(), 1, "{report:?}");
    assert!(Arc::ptr_eq(&registry.get("hostpath").unwrap(), &serving), "previous version keeps serving");
    serving.create_volume(request("pvc-r", &[]), vec![]).await.unwrap();

    std::fs::remove_file(dir.join("hostpath.wasm")).unwrap();
    assert_eq!(registry.scan().await.removed, ["hostpath"]);
    assert!(registry.get("hostpath").is_none());
}

/// Config reload: the configuration file is re-read on change like the backends
/// directory. A good file is put in force and every backend is loaded again under it (a grant
/// added lets a refused backend load, a limit changed reaches the serving one); a file that does
/// not parse, or that would take a grant from a backend serving now, is refused and the
/// configuration in force keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_configuration_file_is_reloaded_on_change_and_a_bad_one_keeps_the_old_in_force() {
    let d = tempfile::tempdir().unwrap();
    let (dir, root, file) = (d.path().join("backends"), d.path().join("root"), d.path().join("config.toml"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(dir.join("hostpath.wasm"), wasmcsi_artifacts::HOSTPATH).unwrap();
    let granted = |deadline_ms: u64| {
        format!(
            "[backends.hostpath]\ncall_deadline_ms = {deadline_ms}\n\
             [backends.hostpath.grants]\ndir = {{ default = \"{}\" }}\n",
            root.display()
        )
    };
    // Each write is followed by a scan, and each content differs in length from the one before:
    // a change is seen even where two writes share a modification time.
    std::fs::write(&file, "# no grants yet\n").unwrap();
    let rt = Runtime::new(RuntimeOptions {
        config: HostConfig::load(&file).unwrap(),
        cache_dir: Some(d.path().join("cache")),
        store_path: d.path().join("state/meta.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 64, max_memory_bytes: 256 << 20 },
    })
    .unwrap();
    let registry = Registry::new(rt.clone(), Some(dir.clone()), Some(file.clone()));
    let report = registry.scan().await;
    assert_eq!(report.config, None, "the file the runtime started with is not a change");
    assert!(report.rejected.iter().any(|(n, why)| n == "hostpath" && why.contains("not granted")), "{report:?}");

    // The operator grants hostpath its root: in force at the next scan, hostpath loads under it.
    std::fs::write(&file, granted(4000)).unwrap();
    let report = registry.scan().await;
    assert_eq!(report.config, Some(ConfigChange::Applied), "{report:?}");
    assert_eq!(report.loaded, ["hostpath"]);
    let serving = registry.get("hostpath").unwrap();
    assert_eq!(serving.limits.call_deadline_ms, 4000);
    let v = serving.create_volume(request("pvc-c", &[]), vec![]).await.unwrap();
    assert!(root.join("volumes/pvc-c").is_dir());
    let quiet = registry.scan().await;
    assert!(quiet.config.is_none() && quiet.loaded.is_empty(), "nothing changed: {quiet:?}");

    // A file that does not parse: refused once, and what was in force keeps serving.
    std::fs::write(&file, "[backends.hostpath.grants\n").unwrap();
    let report = registry.scan().await;
    assert!(
        matches!(&report.config, Some(ConfigChange::Rejected(why)) if why.contains("parsing config")),
        "{report:?}"
    );
    assert!(report.loaded.is_empty() && report.rejected.is_empty(), "{report:?}");
    assert!(Arc::ptr_eq(&registry.get("hostpath").unwrap(), &serving));
    assert_eq!(rt.config().grants_for("hostpath").dir.get("default"), Some(&root));
    assert!(registry.scan().await.config.is_none(), "a refused file is refused once");
    serving.get_volume(v.volume_id.clone()).await.unwrap();

    // A valid file that takes the dir grant from hostpath, which serves now: refused too.
    std::fs::write(&file, "").unwrap();
    let report = registry.scan().await;
    let Some(ConfigChange::Rejected(why)) = &report.config else { panic!("{report:?}") };
    assert!(why.contains("backend hostpath serving now") && why.contains("wasmcsi:backend/dir"), "{why}");
    assert!(Arc::ptr_eq(&registry.get("hostpath").unwrap(), &serving));

    // A limit changed: hostpath is loaded again under it, the same component.
    std::fs::write(&file, granted(60000)).unwrap();
    let report = registry.scan().await;
    assert_eq!((report.config, report.loaded), (Some(ConfigChange::Applied), vec!["hostpath".to_string()]));
    let reloaded = registry.get("hostpath").unwrap();
    assert!(!Arc::ptr_eq(&reloaded, &serving) && reloaded.digest == serving.digest);
    assert_eq!(reloaded.limits.call_deadline_ms, 60000);
    reloaded.delete_volume(v.volume_id, vec![]).await.unwrap();
}

/// One backend call writing 64 KiB values in a loop stops at the backend's kv
/// quota with RESOURCE_EXHAUSTED; the store does not grow past it, the usage shows in the
/// metrics, and another backend's namespace is not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_cannot_write_past_its_kv_quota() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(d.path().join("hostile")).unwrap();
    let text = format!(
        "[runtime]\ncall_deadline_ms = 5000\nkv_quota_bytes = 1048576\nkv_quota_keys = 1000\n\
         [backends.hostile.grants]\ndir = {{ default = \"{}/hostile\" }}\n",
        d.path().display()
    );
    let rt = Runtime::new(RuntimeOptions {
        config: HostConfig::parse(&text, Path::new("test")).unwrap(),
        cache_dir: Some(d.path().join("cache")),
        store_path: d.path().join("state/meta.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 64, max_memory_bytes: 256 << 20 },
    })
    .unwrap();
    let (r, took) = hostile_call(&rt, "kv-flood").await;
    assert!(
        matches!(&r, Err(CallError::Backend { error: WitError::ResourceExhausted(m), .. }) if m.contains("quota")),
        "{r:?}"
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
    let metrics = rt.metrics.encode();
    let used = metrics
        .lines()
        .find_map(|l| l.strip_prefix("wasmcsi_backend_kv_bytes{backend=\"hostile\"} "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no kv gauge in:\n{metrics}"));
    assert!((1 << 20) - (65 << 10) < used && used <= 1 << 20, "{used}");
    let db = std::fs::metadata(d.path().join("state/meta.redb")).unwrap().len();
    assert!(db < 16 << 20, "the store grew to {db} bytes");
    // Full for another 64 KiB value, not broken: a small write still fits in the next call.
    let (r, _) = hostile_call(&rt, "kv").await;
    assert!(
        matches!(&r, Err(CallError::Backend { error: WitError::Unimplemented(m), .. }) if m == "kv works"),
        "{r:?}"
    );
}

/// An answer naming one 1 MiB guest buffer 4096 times lifts as 4 GiB unless the host bounds it:
/// the call fails as bad output and the host's peak memory grows by at most the transfer limit
/// (16 MiB) plus the guest's own memory (32 MiB). Measured in a child process running
/// [`lift_cost_child`]: peak RSS is per process, and the other tests of this binary run beside
/// this one. Wasmtime's own default bound (128 MiB) cost the host ~130 MiB here.
#[test]
fn an_answer_naming_one_buffer_thousands_of_times_costs_the_host_at_most_its_transfer_limit() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "sandbox::lift_cost_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env(LIFT_CHILD, "aliased-strings")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    // libtest prints the test's name on the same line, before the child's output.
    let line =
        stdout.lines().find_map(|l| l.split_once("LIFT-COST ")).map(|(_, l)| l).unwrap_or_else(|| panic!("{stdout}"));
    let (kib, outcome) = line.split_once(' ').unwrap();
    let kib: u64 = kib.parse().unwrap();
    assert!(outcome.contains("invalid output"), "{outcome}");
    assert!(kib <= (16 + 32) << 10, "lifting one answer grew the host's peak by {kib} KiB");
}

const LIFT_CHILD: &str = "WASMCSI_LIFT_CHILD";

/// The child of the test above: one hostile call in a fresh runtime, between two readings of the
/// process's peak RSS (reset before the call); prints `LIFT-COST <KiB> <outcome>`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a child process by the lift-cost test"]
async fn lift_cost_child() {
    let Ok(mode) = std::env::var(LIFT_CHILD) else { return };
    let d = tempfile::tempdir().unwrap();
    let rt = runtime(d.path(), true);
    let b = rt.load("hostile", wasmcsi_artifacts::HOSTILE, None).await.unwrap();
    // Instantiated once before the measurement, so only the call's own cost is counted.
    let _ = b.create_volume(request("warm", &[("mode", "ok")]), vec![]).await;
    let peak_kib = || {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap()
    };
    // "5" resets the peak to the current RSS (proc(5), clear_refs).
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let before = peak_kib();
    let outcome = b.create_volume(request("v", &[("mode", &mode)]), vec![]).await;
    let grown = peak_kib().saturating_sub(before);
    let outcome = match outcome {
        Ok(v) => format!("created {}", v.volume_id),
        Err(e) => e.to_string().chars().take(200).collect(),
    };
    println!("LIFT-COST {grown} {outcome}");
}
