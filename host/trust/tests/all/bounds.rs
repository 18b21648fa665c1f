//! The listener's bounds, measured on a server in a child process: 500 idle pre-auth
//! connections (per-source cap, memory per connection) and an accept loop out of descriptors
//! (back-off, not a spin).
//!
//! Each `*_child` test is the server half of the test above it: it does nothing unless its
//! parent started it (with `ROLE_VAR` set), and is ignored in a normal run.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt as _;
use tokio::net::{TcpSocket, TcpStream};
use wasmcsi_trust::{Credentials, ExpectedRole, Limits, Listener, Role};

use crate::support::child::{self, ChildProcess, field};
use crate::support::{Pki, round_trip};

const IDLE: usize = 500;
const PER_SOURCE: usize = 64;
/// The design's bound on what a connection may cost before it authenticates.
const MAX_BYTES_PER_PREAUTH_CONNECTION: u64 = 64 * 1024;
const DIR_VAR: &str = "WASMCSI_TRUST_TEST_DIR";

async fn try_connect_from(source: Ipv4Addr, addr: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((source, 0)))?;
    socket.connect(addr).await
}

async fn connect_from(source: Ipv4Addr, addr: SocketAddr) -> TcpStream {
    try_connect_from(source, addr).await.expect("connect")
}

fn wait_for_open(server: &mut ChildProcess, open: u64) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats = server.ask("STATS", "STATS");
        if field(&stats, "open") == open {
            return stats;
        }
        assert!(Instant::now() < deadline, "the server never held {open} connections: {stats}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn idle_preauth_connections_are_capped_per_source_and_cost_little_memory() {
    let mut pki = Pki::new();
    let dir = pki.dir(&Role::Node("n1".into()));
    let dir_text = dir.to_str().expect("utf-8 path");
    let mut server = ChildProcess::run("bounds::idle_server_child", "idle-server", &[(DIR_VAR, dir_text)], None);
    let port: u16 = server.expect_line("PORT").parse().expect("port");
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let controller = pki.credentials(&Role::Controller);
    let config = controller.client_config(ExpectedRole::Node("n1".into())).expect("config");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");

    rt.block_on(async {
        // Warm the server up (allocator arenas, lazily built state) with full handshakes, so the
        // measurement sees what idle connections add.
        for _ in 0..8 {
            let mut conn = crate::support::dial(config.clone(), addr).await.expect("warm-up handshake");
            round_trip(&mut conn, b"warm").await.expect("echo");
        }
        let before = field(&wait_for_open(&mut server, 0), "rss");

        // 500 idle connections that never start a handshake, from 8 sources (≤ 63 each).
        let mut idle = Vec::with_capacity(IDLE);
        for i in 0..IDLE {
            let source = Ipv4Addr::new(127, 0, 0, 1 + (i / (PER_SOURCE - 1)) as u8);
            idle.push(connect_from(source, addr).await);
        }
        let after = field(&wait_for_open(&mut server, IDLE as u64), "rss");
        let per_connection = after.saturating_sub(before) / IDLE as u64;
        eprintln!(
            "RSS {} KiB -> {} KiB with {IDLE} idle pre-auth connections: {per_connection} bytes each",
            before / 1024,
            after / 1024
        );
        assert!(
            per_connection <= MAX_BYTES_PER_PREAUTH_CONNECTION,
            "{per_connection} bytes per idle pre-auth connection, more than {MAX_BYTES_PER_PREAUTH_CONNECTION}"
        );

        // 127.0.0.1 holds 63: the 64th is admitted, the 65th is reset at once.
        idle.push(connect_from(Ipv4Addr::LOCALHOST, addr).await);
        wait_for_open(&mut server, IDLE as u64 + 1);
        let started = Instant::now();
        // The reset can arrive before the client's connect completes, or after.
        if let Ok(mut refused) = try_connect_from(Ipv4Addr::LOCALHOST, addr).await {
            let mut byte = [0u8; 1];
            let read =
                tokio::time::timeout(Duration::from_secs(5), refused.read(&mut byte)).await.expect("closed at once");
            assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        }
        assert!(started.elapsed() < Duration::from_secs(1), "refused after {:?}", started.elapsed());
        let stats = server.ask("STATS", "STATS");
        assert_eq!(field(&stats, "refused"), 1, "{stats}");
        assert_eq!(field(&stats, "open"), IDLE as u64 + 1, "{stats}");

        // Another source is still served, handshake and all.
        let socket = connect_from(Ipv4Addr::new(127, 0, 0, 100), addr).await;
        let mut conn = tokio_rustls::TlsConnector::from(config.clone())
            .connect(wasmcsi_trust::credentials::server_name(), socket)
            .await
            .expect("handshake from another source");
        round_trip(&mut conn, b"still serving").await.expect("echo");
    });
}

#[test]
#[ignore = "the server half of idle_preauth_connections_are_capped_per_source_and_cost_little_memory"]
fn idle_server_child() {
    if std::env::var(child::ROLE_VAR).as_deref() != Ok("idle-server") {
        return;
    }
    let dir = std::env::var(DIR_VAR).expect("credentials dir");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        let credentials = Arc::new(Credentials::load(Path::new(&dir)).expect("load"));
        // A long handshake deadline: the idle connections must still be there when measured.
        let limits = Limits {
            max_connections: 1024,
            max_per_source: PER_SOURCE,
            handshake_timeout: Duration::from_secs(300),
            ..Limits::default()
        };
        let listener = Listener::bind("127.0.0.1:0", limits).await.expect("bind");
        let stats = listener.stats();
        println!("PORT {}", listener.local_addr().expect("addr").port());
        tokio::spawn(listener.serve_tls(credentials, |conn| async move {
            let (mut rd, mut wr) = tokio::io::split(conn.stream);
            let _ = tokio::io::copy(&mut rd, &mut wr).await;
        }));
        tokio::task::spawn_blocking(move || {
            for command in child::commands() {
                if command == "STATS" {
                    println!(
                        "STATS rss {} open {} refused {}",
                        rss_bytes(),
                        stats.open.load(Ordering::Relaxed),
                        stats.refused_per_source_cap.load(Ordering::Relaxed)
                    );
                }
            }
        })
        .await
        .expect("commands");
    });
}

#[test]
fn an_accept_loop_out_of_descriptors_backs_off_instead_of_spinning() {
    // The server may hold 64 descriptors; the flood is three times that.
    let mut server =
        ChildProcess::run("bounds::exhausted_server_child", "exhausted-server", &[], Some("ulimit -n 64;"));
    let port: u16 = server.expect_line("PORT").parse().expect("port");
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let flood: Vec<std::net::TcpStream> =
        (0..192).filter_map(|_| std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()).collect();
    assert!(flood.len() > 64, "only {} connections got through", flood.len());
    // Let the server run into the limit before measuring.
    std::thread::sleep(Duration::from_millis(300));
    let measured = server.ask("MEASURE", "MEASURE");
    eprintln!("out of descriptors for 2 s: {measured}");
    let open = field(&measured, "open");
    assert!(open > 10 && open < 64, "the descriptor limit did not bind: {measured}");
    // A loop retrying at once burns a whole core (~2000 ms of CPU in 2 s) and fails accept
    // hundreds of thousands of times; backing off up to 1 s fails it about a dozen times.
    assert!(field(&measured, "cpu_ms") < 300, "{measured}");
    assert!(field(&measured, "accept_errors") < 100, "{measured}");
    drop(flood);
}

#[test]
#[ignore = "the server half of an_accept_loop_out_of_descriptors_backs_off_instead_of_spinning"]
fn exhausted_server_child() {
    if std::env::var(child::ROLE_VAR).as_deref() != Ok("exhausted-server") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        // Opened before the port is announced: once the flood has taken every descriptor,
        // nothing can be opened (opened after, it raced the flood and lost on a busy machine).
        let stat = std::fs::File::open("/proc/self/stat").expect("/proc/self/stat");
        let limits = Limits { max_connections: 100_000, max_per_source: 100_000, ..Limits::default() };
        let listener = Listener::bind("127.0.0.1:0", limits).await.expect("bind");
        let stats = listener.stats();
        println!("PORT {}", listener.local_addr().expect("addr").port());
        // Plaintext, connections held forever: every accepted one keeps its descriptor.
        tokio::spawn(listener.serve_plain(|conn| async move {
            let _held = conn;
            std::future::pending::<()>().await
        }));
        tokio::task::spawn_blocking(move || {
            for command in child::commands() {
                if command == "MEASURE" {
                    let (cpu, errors) = (cpu_ms(&stat), stats.accept_errors.load(Ordering::Relaxed));
                    std::thread::sleep(Duration::from_secs(2));
                    println!(
                        "MEASURE cpu_ms {} accept_errors {} open {}",
                        cpu_ms(&stat) - cpu,
                        stats.accept_errors.load(Ordering::Relaxed) - errors,
                        stats.open.load(Ordering::Relaxed)
                    );
                }
            }
        })
        .await
        .expect("commands");
    });
}

/// Resident set size of this process (`VmRSS`).
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS");
    kib * 1024
}

/// User + system CPU time of this process, in milliseconds (`/proc/self/stat` counts in
/// USER_HZ, 100 per second on Linux).
fn cpu_ms(file: &std::fs::File) -> u64 {
    use std::os::unix::fs::FileExt as _;
    let mut buf = vec![0u8; 4096];
    let n = file.read_at(&mut buf, 0).expect("/proc/self/stat");
    let stat = String::from_utf8_lossy(&buf[..n]);
    // Fields after the command name (which may hold spaces) start at field 3 (state).
    let after_name = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks = |i: usize| fields[i].parse::<u64>().expect("ticks");
    // utime and stime are fields 14 and 15, i.e. 11 and 12 after the state.
    (ticks(11) + ticks(12)) * 10
}
