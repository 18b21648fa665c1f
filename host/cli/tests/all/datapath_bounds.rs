//! The data-path process's own bounds and metrics, on the real binary (`wasmcsi datapath`):
//! another process on the node holding 500 idle connections to the data-path socket while the
//! node plugin's client (this test process, another pid) is still answered at once; the idle
//! connections closed after the idle timeout; the data path's descriptors and memory bounded
//! meanwhile; and `/metrics` of a data path in `--tls-mode required` (credentials from `wasmcsi
//! pki`) showing its replica listener's counters and its certificate's remaining life.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use wasmcsi_datapath::client::DataPathClient;
use wasmcsi_datapath::wire::{self, ErrorKind, Reply};

use crate::support::process::Proc;

/// Idle connections the hostile process opens.
const IDLE: usize = 500;
/// The data path's idle timeout in these tests, seconds.
const IDLE_TIMEOUT: u64 = 3;

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// `wasmcsi datapath` in `dir` with `extra` arguments; the line it logs once it serves.
fn datapath(dir: &Path, extra: &[String]) -> (Proc, String) {
    let args: Vec<String> = [
        "datapath",
        "--socket",
        &path(&dir.join("datapath.sock")),
        "--state-dir",
        &path(&dir.join("state")),
        "--node-id",
        "bounds-node",
        "--replica-listen",
        "127.0.0.1:0",
        "--replica-root",
        &path(&dir.join("replicas")),
    ]
    .iter()
    .map(|s| (*s).to_string())
    .chain(extra.iter().cloned())
    .collect();
    let mut proc = Proc::spawn("datapath", None, &args);
    let line = proc.wait_line("serving the data path", |l| l.contains("serving the data path"));
    (proc, line)
}

/// Sockets the process `pid` holds open.
fn open_sockets(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .filter(|target| target.to_string_lossy().starts_with("socket:"))
        .count()
}

/// Resident memory, KiB.
fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Waits up to `within` for `check`; whether it held.
fn eventually(within: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A process other than this one holding `count` connections to `socket`, opened and left idle
/// (never a byte sent). Killed and reaped when dropped.
struct IdleHolder(Child);

impl IdleHolder {
    #[allow(unsafe_code, reason = "the connections must be made by the child, so the kernel names it their client")]
    fn start(socket: &Path, count: usize) -> Self {
        let addr = nix::sys::socket::UnixAddr::new(socket).unwrap();
        let mut cmd = Command::new("sleep");
        cmd.arg("3600").stdin(Stdio::null());
        // SAFETY: the hook runs in the forked child before exec; it allocates nothing and only
        // makes the socket(2) and connect(2) system calls (async-signal-safe). The sockets are
        // made without CLOEXEC, so `sleep` inherits and holds them; `forget` keeps them open.
        unsafe {
            cmd.pre_exec(move || {
                use nix::sys::socket::{AddressFamily, SockFlag, SockType, connect, socket};
                for _ in 0..count {
                    let fd = socket(AddressFamily::Unix, SockType::Stream, SockFlag::empty(), None)?;
                    connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr)?;
                    std::mem::forget(fd);
                }
                Ok(())
            });
        }
        IdleHolder(cmd.spawn().unwrap())
    }
}

impl Drop for IdleHolder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Hello, List and Status from this process, each answered within 2 s.
async fn plugin_is_answered(client: &DataPathClient) {
    let within = Duration::from_secs(2);
    let hello = tokio::time::timeout(within, client.hello()).await.expect("hello answers within 2 s");
    hello.unwrap();
    let engines = wasmcsi_datapath::client::Engines::Remote(client.clone());
    let listed = tokio::time::timeout(within, engines.list()).await.expect("list answers within 2 s");
    assert!(listed.unwrap().is_empty());
    let status = tokio::time::timeout(within, engines.view("no-such-volume")).await.expect("status answers");
    assert!(status.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_of_one_process_leave_the_plugin_answered_and_are_closed_after_the_idle_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let socket: PathBuf = dir.path().join("datapath.sock");
    let timeout = IDLE_TIMEOUT.to_string();
    let (proc, _) = datapath(dir.path(), &["--tls-mode".into(), "off".into(), "--socket-idle-timeout".into(), timeout]);
    let pid = proc.pid().as_raw();
    let client = DataPathClient::new(&socket);
    plugin_is_answered(&client).await;
    // The data path's ends of those requests' connections close as it reads their end.
    std::thread::sleep(Duration::from_millis(200));
    let (sockets_before, rss_before) = (open_sockets(pid), rss_kib(pid));

    let started = Instant::now();
    let holder = IdleHolder::start(&socket, IDLE);
    let per_client = wasmcsi_datapath::socket::slots::DEFAULT_MAX_PER_CLIENT;
    // Every connection is accepted and either given one of the holder's slots or answered busy
    // and closed: the data path holds at most its cap of them.
    assert!(
        eventually(Duration::from_secs(5), || open_sockets(pid) == sockets_before + per_client),
        "the data path holds {} sockets, {sockets_before} before {IDLE} idle connections of one process (cap {per_client})",
        open_sockets(pid)
    );
    plugin_is_answered(&client).await;
    let rss_during = rss_kib(pid);
    println!(
        "{IDLE} idle connections of one process: the data path holds {} of them, RSS {rss_before} -> {rss_during} KiB",
        open_sockets(pid) - sockets_before
    );
    assert!(rss_during < rss_before + 8 * 1024, "RSS grew from {rss_before} to {rss_during} KiB");

    // This process past its own cap: the connection over it is answered busy at once, without
    // a request, and closed.
    let mut mine = Vec::new();
    for _ in 0..per_client {
        mine.push(tokio::net::UnixStream::connect(&socket).await.unwrap());
    }
    let mut over = tokio::net::UnixStream::connect(&socket).await.unwrap();
    let refused: Reply = tokio::time::timeout(Duration::from_secs(2), wire::read_frame(&mut over))
        .await
        .expect("the connection over the cap is answered at once")
        .unwrap();
    let error = refused.error.expect("a busy reply");
    assert_eq!(error.kind, ErrorKind::Busy, "{}", error.message);
    assert!(error.message.contains(&format!("pid {}", std::process::id())), "names the client: {}", error.message);
    drop((mine, over));

    // Past the idle timeout, the holder's connections are closed; the holder still runs.
    assert!(
        eventually(Duration::from_secs(IDLE_TIMEOUT + 3), || open_sockets(pid) == sockets_before),
        "{} sockets held {}s after the flood began, {sockets_before} before",
        open_sockets(pid),
        started.elapsed().as_secs()
    );
    assert!(started.elapsed() >= Duration::from_secs(IDLE_TIMEOUT), "closed only after the idle timeout");
    drop(holder);
    plugin_is_answered(&client).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_sent_slowly_is_cut_at_the_idle_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("datapath.sock");
    let (proc, _) =
        datapath(dir.path(), &["--tls-mode".into(), "off".into(), "--socket-idle-timeout".into(), "1".into()]);
    let pid = proc.pid().as_raw();
    let before = open_sockets(pid);
    let mut slow = tokio::net::UnixStream::connect(&socket).await.unwrap();
    // A frame that announces the largest size and then sends a byte at a time.
    slow.write_all(&(wire::MAX_FRAME as u32).to_be_bytes()).await.unwrap();
    let started = Instant::now();
    let mut closed = false;
    while started.elapsed() < Duration::from_secs(5) {
        if slow.write_all(b" ").await.is_err() {
            closed = true;
            break;
        }
        let mut byte = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(200), slow.read(&mut byte)).await {
            closed = true;
            break;
        }
    }
    assert!(closed, "a request dripping in is closed");
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(900) && elapsed < Duration::from_secs(3), "closed after {elapsed:?}");
    assert!(eventually(Duration::from_secs(2), || open_sockets(pid) == before));
}

/// `GET /metrics` of `addr`: the body.
async fn scrape(addr: std::net::SocketAddr) -> String {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut reply = String::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_string(&mut reply)).await.unwrap().unwrap();
    reply
}

/// `wasmcsi pki ARGS`, which must succeed.
fn pki(args: &[&str]) {
    let out = Command::new(crate::support::process::BIN).arg("pki").args(args).output().unwrap();
    assert!(out.status.success(), "pki {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_metrics_of_a_data_path_in_required_mode_show_its_replica_listener_and_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, tls) = (dir.path().join("ca"), dir.path().join("tls"));
    pki(&["init", "--dir", &path(&ca)]);
    pki(&["issue", "--ca", &path(&ca), "--node", "bounds-node", "--out", &path(&tls), "--validity", "2h"]);
    let (_proc, line) = datapath(
        dir.path(),
        &[
            "--tls-dir".into(),
            path(&tls),
            "--tls-mode".into(),
            "required".into(),
            "--metrics-addr".into(),
            "127.0.0.1:0".into(),
        ],
    );
    let metrics: std::net::SocketAddr = line
        .split("metrics=Some(")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .unwrap_or_else(|| panic!("no metrics address in {line}"))
        .parse()
        .unwrap();
    let replicas: std::net::SocketAddr = line
        .split("replicas=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no replica address in {line}"))
        .parse()
        .unwrap();
    // A plaintext peer on the replica port in required mode: refused, and counted.
    let mut plain = tokio::net::TcpStream::connect(replicas).await.unwrap();
    plain.write_all(b"WCSI plaintext").await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), plain.read_to_end(&mut rest)).await;

    let body = scrape(metrics).await;
    let series = |name: &str| -> Vec<&str> { body.lines().filter(|l| l.starts_with(name)).collect() };
    let expiry = series("wasmcsi_tls_certificate_expiry_seconds{role=\"node\"}");
    assert_eq!(expiry.len(), 1, "{body}");
    let seconds: i64 = expiry[0].rsplit(' ').next().unwrap().parse().unwrap();
    assert!((7000..=7200).contains(&seconds), "a 2 h certificate: {}", expiry[0]);
    for name in ["wasmcsi_listener_connections", "wasmcsi_listener_accepted_total"] {
        let replica: Vec<_> = series(name).into_iter().filter(|l| l.contains("listener=\"replica\"")).collect();
        assert_eq!(replica.len(), 1, "{name} of the replica listener in {body}");
    }
    let accepted = series("wasmcsi_listener_accepted_total{listener=\"replica\"}");
    assert!(accepted[0].ends_with(" 1"), "the plaintext peer was accepted from the kernel once: {}", accepted[0]);
    let refusals: u64 = series("wasmcsi_listener_refusals_total")
        .into_iter()
        .filter(|l| l.contains("listener=\"replica\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(refusals, 1, "the plaintext peer counted as a refusal: {body}");
}
