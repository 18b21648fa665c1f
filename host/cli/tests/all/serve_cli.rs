//! `wasmcsi serve` as an operator debugs it: the real binary, reached with a gRPC client that
//! is not Go's (Python's grpcio, which sends the socket path as `:authority`), and its log read
//! back (one line per CSI call, at its end, with method, volume, code and duration), and its
//! `/metrics` scraped (the request latency histogram, `wasmcsi_build_info`).
//!
//! grpcio comes from the tools environment `scripts/setup` makes (`WASMCSI_TOOLS_PYTHON`,
//! default `/var/cache/wasmcsi-tools/venv/bin/python`). Without it the test is skipped, except
//! in CI (`CI` set), where it fails.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn tools_python() -> Option<PathBuf> {
    let path = std::env::var_os("WASMCSI_TOOLS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/wasmcsi-tools/venv/bin/python"));
    let usable = Command::new(&path).args(["-c", "import grpc, grpc_tools"]).output().is_ok_and(|o| o.status.success());
    if usable {
        return Some(path);
    }
    assert!(std::env::var_os("CI").is_none(), "CI: {} with grpcio is missing (scripts/setup makes it)", path.display());
    eprintln!("skipped: no {} with grpcio (run scripts/setup)", path.display());
    None
}

/// The CSI stubs for Python, generated from the workspace's csi.proto.
fn python_stubs(python: &Path, dir: &Path) {
    let proto = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let status = Command::new(python)
        .args(["-m", "grpc_tools.protoc", "-I"])
        .arg(&proto)
        .arg(format!("--python_out={}", dir.display()))
        .arg(format!("--grpc_python_out={}", dir.display()))
        .arg(proto.join("csi.proto"))
        .status()
        .unwrap();
    assert!(status.success(), "grpc_tools.protoc failed");
}

/// Probe, then a ControllerExpandVolume and a CreateVolume that must fail; prints one line
/// per call.
const CLIENT: &str = r#"
import sys, grpc
sys.path.insert(0, sys.argv[1])
import csi_pb2, csi_pb2_grpc
# No authority option: grpcio sends the socket path, as it does for any operator.
channel = grpc.insecure_channel("unix:" + sys.argv[2])
probe = csi_pb2_grpc.IdentityStub(channel).Probe(csi_pb2.ProbeRequest(), timeout=30, wait_for_ready=True)
print("probe", probe.ready.value)
try:
    csi_pb2_grpc.ControllerStub(channel).ControllerExpandVolume(
        csi_pb2.ControllerExpandVolumeRequest(volume_id="gone:vol-7", capacity_range=csi_pb2.CapacityRange(required_bytes=1 << 20)),
        timeout=30)
    print("expand ok")
except grpc.RpcError as e:
    print("expand", e.code().name)
try:
    csi_pb2_grpc.ControllerStub(channel).CreateVolume(
        csi_pb2.CreateVolumeRequest(name="pvc-1", parameters={"backend": "gone"}), timeout=30)
    print("create ok")
except grpc.RpcError as e:
    print("create", e.code().name)
"#;

struct Served(std::process::Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_grpcio_client_is_served_and_every_call_is_logged_once_at_its_end() {
    let Some(python) = tools_python() else { return };
    let d = tempfile::tempdir().unwrap();
    let stubs = d.path().join("stubs");
    std::fs::create_dir_all(&stubs).unwrap();
    python_stubs(&python, &stubs);
    std::fs::create_dir_all(d.path().join("backends")).unwrap();
    let socket = d.path().join("sock/csi.sock");
    let log = d.path().join("serve.log");
    let child = Command::new(env!("CARGO_BIN_EXE_wasmcsi"))
        .args(["--log", "info", "--log-format", "json", "serve", "--mode", "controller", "--node-id", "t"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .arg("--socket")
        .arg(&socket)
        .arg("--state-dir")
        .arg(d.path().join("state"))
        .arg("--backends-dir")
        .arg(d.path().join("backends"))
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut served = Served(child);

    let out = Command::new(&python).arg("-c").arg(CLIENT).arg(&stubs).arg(&socket).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let metrics = scrape(&std::fs::read_to_string(&log).unwrap());
    let _ = served.0.kill();
    let _ = served.0.wait();
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(out.status.success(), "client failed:\n{stdout}\n{stderr}\nserver log:\n{log}");
    assert!(stdout.lines().any(|l| l.starts_with("probe ")), "{stdout}");
    // No backend named `gone` is loaded: UNAVAILABLE, never NOT_FOUND (docs/operating.md).
    assert!(stdout.contains("expand UNAVAILABLE"), "{stdout}\nserver log:\n{log}");

    let lines: Vec<serde_json::Value> = log.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let calls = |method: &str| -> Vec<&serde_json::Value> {
        lines.iter().filter(|l| l["fields"]["method"] == method).collect()
    };
    let expand = calls("ControllerExpandVolume");
    assert_eq!(expand.len(), 1, "one line per call:\n{log}");
    let line = expand[0];
    assert_eq!(line["level"], "WARN", "{line}");
    assert_eq!(line["fields"]["code"], "Unavailable", "{line}");
    assert!(line["fields"]["duration_ms"].as_f64().is_some_and(|ms| ms >= 0.0), "{line}");
    assert!(line["fields"]["error"].as_str().is_some_and(|e| e.contains("gone")), "{line}");
    assert_eq!(line["span"]["volume.id"], "gone:vol-7", "the volume is on the line: {line}");
    // JSON without duplicate keys: the PV name is its own field, not the span's `name`.
    let create = calls("CreateVolume");
    assert_eq!(create.len(), 1, "{log}");
    assert_eq!(create[0]["span"]["name"], "csi.create_volume", "{}", create[0]);
    assert_eq!(create[0]["span"]["volume.name"], "pvc-1", "{}", create[0]);
    for raw in log.lines() {
        let parsed: serde_json::Value = serde_json::from_str(raw).unwrap();
        // A duplicate key collapses when parsed: the re-encoded line has fewer keys.
        let keys = |text: &str| text.matches("\":").count();
        assert_eq!(keys(raw), keys(&parsed.to_string()), "duplicate key in {raw}");
    }
    // Probe succeeded: polled, so DEBUG, not in an INFO log.
    assert!(calls("Probe").is_empty(), "{log}");

    // Both calls are in the latency histogram, by method and code; the build is named.
    for (method, code) in [("Probe", "OK"), ("ControllerExpandVolume", "Unavailable")] {
        let count = format!("wasmcsi_csi_request_duration_seconds_count{{method=\"{method}\",code=\"{code}\"}} 1");
        assert!(metrics.lines().any(|l| l == count), "no `{count}`:\n{metrics}");
    }
    let build = format!("wasmcsi_build_info{{version=\"{}\"}} 1", env!("CARGO_PKG_VERSION"));
    assert!(metrics.lines().any(|l| l == build), "no `{build}`:\n{metrics}");
}

/// GET /metrics from the address the server logged it listens on.
fn scrape(log: &str) -> String {
    use std::io::{Read as _, Write as _};
    let serving = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["fields"]["message"] == "serving CSI")
        .unwrap_or_else(|| panic!("no `serving CSI` line:\n{log}"));
    // Logged as `Some(127.0.0.1:PORT)`.
    let field = serving["fields"]["metrics"].as_str().unwrap();
    let addr = field.trim_start_matches("Some(").trim_end_matches(')');
    let mut conn = std::net::TcpStream::connect(addr).unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut reply = String::new();
    conn.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    reply
}

/// `wasmcsi backend ARGS` with only `env` set from the environment this test controls.
fn backend(args: &[&str], env: &[(&str, &Path)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmcsi"));
    cmd.arg("backend").args(args).env_remove("WASMCSI_CONFIG").env_remove("WASMCSI_BACKENDS_DIR");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code(), text)
}

#[test]
fn backend_ls_reads_the_config_serve_reads_and_fails_when_a_file_is_rejected() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("backends");
    let (code, text) = backend(&["export", dir.to_str().unwrap()], &[]);
    assert_eq!(code, Some(0), "{text}");
    // Only hostpath stays: the others need grants for servers this test has none of.
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.file_stem().is_some_and(|s| s != "hostpath") {
            std::fs::remove_file(path).unwrap();
        }
    }
    let config = d.path().join("config.toml");
    std::fs::write(&config, format!("[backends.hostpath.grants]\ndir = {{ default = {:?} }}\n", d.path().join("root")))
        .unwrap();

    // Without a configuration nothing beyond log and kv is granted, and it says so.
    let (code, text) = backend(&["ls"], &[("WASMCSI_BACKENDS_DIR", &dir)]);
    assert_eq!(code, Some(1), "hostpath is not granted `dir`: {text}");
    assert!(text.contains("config: none"), "{text}");
    // The configuration from the environment variable serve reads: hostpath loads.
    let (code, text) = backend(&["ls"], &[("WASMCSI_BACKENDS_DIR", &dir), ("WASMCSI_CONFIG", &config)]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains(&format!("config: {}", config.display())), "{text}");
    assert!(text.lines().any(|l| l.starts_with("hostpath ") && l.contains(" ok ")), "{text}");

    // A file that is not WebAssembly, and a core module: rejected, each in one line that
    // says what it is, and ls exits 1.
    std::fs::write(dir.join("notes.wasm"), b"hello, world").unwrap();
    std::fs::write(dir.join("core.wasm"), b"\0asm\x01\0\0\0").unwrap();
    let (code, text) =
        backend(&["ls", "--config", config.to_str().unwrap(), "--backends-dir", dir.to_str().unwrap()], &[]);
    assert_eq!(code, Some(1), "{text}");
    let line = |name: &str| text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name}: {text}"));
    assert!(line("notes ").contains("rejected") && line("notes ").contains("[68 65 6c 6c 6f 2c 20 77]"), "{text}");
    assert!(line("core ").contains("rejected") && line("core ").contains("wasm32-wasip2"), "{text}");
    assert!(line("hostpath ").contains(" ok "), "{text}");
    // `backend check` says the same about the core module, in one line.
    let (code, text) = backend(&["check", dir.join("core.wasm").to_str().unwrap()], &[]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("core WebAssembly module") && text.lines().count() == 1, "{text}");
}

#[test]
fn a_text_log_that_is_not_a_terminal_has_no_colour() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(d.path().join("backends")).unwrap();
    let log = d.path().join("serve.log");
    let child = Command::new(env!("CARGO_BIN_EXE_wasmcsi"))
        .args(["--log", "info", "--log-format", "text", "serve", "--mode", "controller", "--node-id", "t"])
        .arg("--socket")
        .arg(d.path().join("csi.sock"))
        .arg("--state-dir")
        .arg(d.path().join("state"))
        .arg("--backends-dir")
        .arg(d.path().join("backends"))
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let served = Served(child);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        if text.contains("serving CSI") || std::time::Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    drop(served);
    assert!(text.contains("serving CSI"), "{text}");
    assert!(!text.contains('\u{1b}'), "ANSI escape codes in a log file: {text:?}");
}

/// A peer endpoint, or forwarding to one, with neither credentials (`--tls-dir`) nor an explicit
/// `--tls-mode off`: the plugin does not start, and says what to give; `--tls-mode off` starts.
#[test]
fn the_peer_channel_is_plaintext_only_when_chosen() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(d.path().join("backends")).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let serve = |mode: &str, extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmcsi"));
        cmd.args(["serve", "--mode", mode, "--node-id", "n1"])
            .arg("--socket")
            .arg(d.path().join(format!("{mode}.sock")))
            .arg("--state-dir")
            .arg(d.path().join(format!("state-{mode}")))
            .arg("--backends-dir")
            .arg(d.path().join("backends"))
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null());
        cmd
    };
    let listen = format!("127.0.0.1:{port}");
    let forward = format!("n1=127.0.0.1:{port}");
    for (mode, flag, value) in [("node", "--peer-listen", listen.as_str()), ("controller", "--peer", forward.as_str())]
    {
        let out = serve(mode, &[flag, value]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{mode}: {err}");
        assert!(err.contains("--tls-dir") && err.contains("--tls-mode off"), "{mode}: {err}");
    }
    // Chosen: the node plugin serves its peer endpoint in plaintext.
    let log = d.path().join("off.log");
    let child = serve("node", &["--peer-listen", &listen, "--tls-mode", "off"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let served = Served(child);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        if text.contains("serving CSI") || std::time::Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    drop(served);
    assert!(text.contains("serving node-local calls") && text.contains("tls_mode=off"), "{text}");
}

/// `serve --mode node --kubelet-dir DIR` in a mount namespace of its own: refused with a
/// message saying what to fix when DIR's mount is private (the mounts a node plugin makes
/// would never reach kubelet), past the check when it is shared.
#[test]
fn a_node_plugin_refuses_a_kubelet_dir_that_is_not_a_shared_mount() {
    let d = tempfile::tempdir().unwrap();
    let kubelet = d.path().join("kubelet");
    std::fs::create_dir_all(&kubelet).unwrap();
    let run = |propagation: &str| {
        let out = Command::new("unshare")
            .args(["--mount", "--propagation", propagation])
            .arg(env!("CARGO_BIN_EXE_wasmcsi"))
            .args(["serve", "--mode", "node", "--node-id", "n1", "--kubelet-dir"])
            .arg(&kubelet)
            .arg("--state-dir")
            .arg(d.path().join(format!("state-{propagation}")))
            .arg("--backends-dir")
            .arg(d.path().join("no-backends"))
            .arg("--socket")
            .arg(d.path().join("csi.sock"))
            // A configuration file that is not there: a plugin past the check stops at it.
            .arg("--config")
            .arg(d.path().join("missing.toml"))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, err) = run("private");
    assert!(!ok, "{err}");
    assert!(err.contains("is not a shared mount") && err.contains("Bidirectional"), "{err}");
    let (ok, err) = run("shared");
    assert!(!ok && err.contains("missing.toml"), "stopped at the configuration: {err}");
    assert!(!err.contains("is not a shared mount"), "{err}");
    assert!(err.contains("kubelet's directory is a shared mount"), "the check passed: {err}");
}

/// `datapath --shared-state-dir` in a mount namespace of its own, its state dir a bind mount
/// made there: refused, saying what to fix, when that mount is private (the FUSE and rbd-fuse
/// mounts it makes would never reach the node plugin), past the check when it is shared. The
/// namespace and its mounts end with the process.
#[test]
fn a_data_path_refuses_a_state_dir_that_is_not_a_shared_mount() {
    let d = tempfile::tempdir().unwrap();
    // Taken, so a data path past the check stops at its replica listener, having served nothing.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let run = |propagation: &str| {
        let state = d.path().join(format!("state-{propagation}"));
        std::fs::create_dir_all(&state).unwrap();
        let script = format!("mount --bind \"$1\" \"$1\" && mount --make-{propagation} \"$1\" && shift && exec \"$@\"");
        let out = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script, "sh"])
            .arg(&state)
            .arg(env!("CARGO_BIN_EXE_wasmcsi"))
            .args(["datapath", "--node-id", "n1", "--shared-state-dir", "--state-dir"])
            .arg(&state)
            .arg("--socket")
            .arg(d.path().join(format!("datapath-{propagation}.sock")))
            .arg("--replica-root")
            .arg(d.path().join(format!("replicas-{propagation}")))
            .arg("--replica-listen")
            .arg(taken.local_addr().unwrap().to_string())
            .args(["--tls-mode", "off"])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, err) = run("private");
    assert!(!ok, "{err}");
    assert!(err.contains("--state-dir") && err.contains("is not a shared mount (private"), "{err}");
    assert!(err.contains("Bidirectional"), "says what to fix: {err}");
    let (ok, err) = run("shared");
    assert!(!ok, "stopped at the taken replica port: {err}");
    assert!(!err.contains("is not a shared mount"), "{err}");
    assert!(err.contains("the data path's state directory is a shared mount"), "the check passed: {err}");
    // Nothing of either namespace is left on this one.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&*d.path().to_string_lossy()), "{mounts}");
}
