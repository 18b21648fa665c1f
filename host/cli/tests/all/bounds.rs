//! The bounds of a process's listeners outside the replica port, on the real binary (`wasmcsi
//! serve --mode all` with hostpath): `/metrics` held by 500 idle connections and flooded past
//! the process's descriptor limit while the CSI socket keeps answering Probe and CreateVolume,
//! with memory and CPU measured; 500 idle TLS connections to the authority endpoint, memory per
//! connection measured, the CSI socket answering; the CSI socket itself at the descriptor limit
//! (its accept loop waits instead of spinning, and answers again once descriptors are free); and
//! the soft descriptor limit raised to the hard one at start.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt as _;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::controller_client::ControllerClient;
use wasmcsi_proto::csi::v1::identity_client::IdentityClient;

use crate::support::process::{BIN, Proc};

/// The measurements below are of one process; tests of this file run one at a time so neither
/// disturbs the other's.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Served {
    proc: Proc,
    socket: PathBuf,
    metrics: SocketAddr,
    /// The authority endpoint, when `extra` asked for one.
    authority: Option<SocketAddr>,
    _dir: tempfile::TempDir,
}

/// `wasmcsi serve --mode all` with hostpath granted a directory, `/metrics` on a free port.
fn serve() -> Served {
    serve_with(&[])
}

/// [`serve`] with `extra` arguments.
fn serve_with(extra: &[String]) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for sub in ["backends", "root", "state"] {
        std::fs::create_dir_all(d.join(sub)).unwrap();
    }
    std::fs::write(d.join("backends/hostpath.wasm"), wasmcsi_artifacts::HOSTPATH).unwrap();
    std::fs::write(
        d.join("config.toml"),
        format!("[backends.hostpath.grants]\ndir = {{ default = {:?} }}\n", d.join("root")),
    )
    .unwrap();
    let socket = d.join("csi.sock");
    let path = |p: &Path| p.display().to_string();
    let args: Vec<String> = [
        "--log",
        "info",
        "serve",
        "--mode",
        "all",
        "--node-id",
        "n1",
        "--metrics-addr",
        "127.0.0.1:0",
        "--reload-interval-ms",
        "3600000",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(["--socket".into(), path(&socket)])
    .chain(["--state-dir".into(), path(&d.join("state"))])
    .chain(["--backends-dir".into(), path(&d.join("backends"))])
    .chain(["--config".into(), path(&d.join("config.toml"))])
    .chain(extra.iter().cloned())
    .collect();
    let mut proc = Proc::spawn("serve", None, &args);
    let line = proc.wait_line("serving CSI", |l| l.contains("serving CSI"));
    // `NAME=Some(ADDR)` in the line.
    let addr = |name: &str| -> Option<SocketAddr> {
        line.split(&format!("{name}=Some(")).nth(1).and_then(|rest| rest.split(')').next()).map(|a| a.parse().unwrap())
    };
    let metrics = addr("metrics").unwrap_or_else(|| panic!("no metrics address in {line}"));
    Served { proc, socket, metrics, authority: addr("authority"), _dir: dir }
}

fn pid(s: &Served) -> i32 {
    s.proc.pid().as_raw()
}

/// Resident memory, KiB.
fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// User + system CPU time so far.
fn cpu(pid: i32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // After the command name's closing parenthesis: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).unwrap().unwrap() as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

/// CPU the process used during `window`.
fn cpu_during(pid: i32, window: Duration) -> Duration {
    let before = cpu(pid);
    std::thread::sleep(window);
    cpu(pid) - before
}

fn open_descriptors(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

/// `prlimit --pid PID --nofile=SOFT:HARD`.
fn set_descriptor_limit(pid: i32, soft: usize, hard: usize) {
    let status =
        Command::new("prlimit").arg(format!("--pid={pid}")).arg(format!("--nofile={soft}:{hard}")).status().unwrap();
    assert!(status.success(), "prlimit");
}

/// Probe, then a CreateVolume of hostpath; each must answer within 10 s.
async fn csi_answers(socket: &Path, name: &str) {
    let channel = tokio::time::timeout(Duration::from_secs(10), wasmcsi::host::connect(socket))
        .await
        .expect("the CSI socket accepts within 10 s")
        .unwrap();
    let probe =
        tokio::time::timeout(Duration::from_secs(10), IdentityClient::new(channel.clone()).probe(csi::ProbeRequest {}))
            .await
            .expect("Probe answers within 10 s");
    probe.unwrap();
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    let request = csi::CreateVolumeRequest {
        name: name.into(),
        volume_capabilities: vec![csi::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
        }],
        parameters: [("backend".to_string(), "hostpath".to_string())].into(),
        ..Default::default()
    };
    let created = tokio::time::timeout(Duration::from_secs(10), ControllerClient::new(channel).create_volume(request))
        .await
        .expect("CreateVolume answers within 10 s");
    assert!(created.unwrap().into_inner().volume.is_some());
}

/// A TCP connection to `to` from `from` (any loopback address), or `None` when it cannot be
/// made within a second.
async fn connect_from(from: Ipv4Addr, to: SocketAddr) -> Option<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4().ok()?;
    socket.bind(SocketAddr::from((from, 0))).ok()?;
    tokio::time::timeout(Duration::from_secs(1), socket.connect(to)).await.ok()?.ok()
}

/// Whether the server still holds `conn` open (nothing to read, no reset, no end).
async fn held(conn: &mut tokio::net::TcpStream) -> bool {
    let mut byte = [0u8; 1];
    // Timed out: nothing came, the connection is open.
    tokio::time::timeout(Duration::from_millis(20), conn.read(&mut byte)).await.is_err()
}

/// Connections to the listener on `port` the server has not accepted: those in the kernel's
/// accept queue, and those still half-open on the server's side (SYN_RECV: the client saw the
/// handshake complete, the server dropped its last ACK because the queue was full). A client
/// cannot tell them from connections the server holds (neither sends nor resets), so the cap is
/// judged on the rest.
fn not_accepted(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = u16::from_str_radix(fields.get(1)?.rsplit(':').next()?, 16).ok()?;
            if local_port != port {
                return None;
            }
            match *fields.get(3)? {
                // LISTEN: for a listener rx_queue is its accept-queue length.
                "0A" => usize::from_str_radix(fields.get(4)?.rsplit(':').next()?, 16).ok(),
                "03" => Some(1),
                _ => None,
            }
        })
        .sum()
}

/// GET /metrics from `from`: the status line.
async fn scrape_from(from: Ipv4Addr, to: SocketAddr) -> String {
    use tokio::io::AsyncWriteExt as _;
    let mut conn = connect_from(from, to).await.expect("connect");
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut reply = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), conn.read_to_string(&mut reply)).await;
    reply.lines().next().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_metrics_flood_past_the_descriptor_limit_leaves_the_csi_socket_answering() {
    let _serial = SERIAL.lock().await;
    let s = serve();
    let pid = pid(&s);
    csi_answers(&s.socket, "before").await;
    assert!(scrape_from(Ipv4Addr::LOCALHOST, s.metrics).await.contains("200"));
    // Few enough descriptors that the flood below is more connections than the process may
    // open at all.
    let limit = 256;
    set_descriptor_limit(pid, limit, limit);
    let (rss_before, fds_before) = (rss_kib(pid), open_descriptors(pid));

    // 500 idle connections from 50 sources (10 each), then 1000 more at once from 100 others.
    let mut idle = Vec::new();
    for i in 0..500u32 {
        if let Some(c) = connect_from(Ipv4Addr::from(0x7f00_0001 + i / 10), s.metrics).await {
            idle.push(c);
        }
    }
    let mut connecting = tokio::task::JoinSet::new();
    for i in 0..1000u32 {
        connecting.spawn(connect_from(Ipv4Addr::from(0x7f00_0101 + i / 10), s.metrics));
    }
    let mut flood: Vec<_> = connecting.join_all().await.into_iter().flatten().collect();
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The CSI socket answers throughout; the metrics listener holds at most its cap.
    csi_answers(&s.socket, "during").await;
    let cpu = cpu_during(pid, Duration::from_secs(2));
    let (rss_during, fds_during) = (rss_kib(pid), open_descriptors(pid));
    let mut open = 0;
    for conn in idle.iter_mut().chain(flood.iter_mut()) {
        open += usize::from(held(conn).await);
    }
    // Under load (CI runs other test binaries beside this one) the accept loop may not have
    // drained the queue yet; those connections are not held by the server.
    let queued = not_accepted(s.metrics.port());
    let kept = open.saturating_sub(queued);
    let per_held = rss_during.saturating_sub(rss_before) * 1024 / kept.max(1) as u64;
    println!(
        "flood: {} + {} connections made, {open} open ({queued} not accepted yet, {kept} held by the server); descriptors {fds_before} -> {fds_during} \
         (limit {limit}); RSS {rss_before} -> {rss_during} KiB ({per_held} bytes per held connection); CPU {cpu:?} \
         in 2 s",
        idle.len(),
        flood.len()
    );
    assert!(kept <= wasmcsi::metrics_http::LIMITS.max_connections, "{kept} connections held");
    assert!(fds_during <= fds_before + wasmcsi::metrics_http::LIMITS.max_connections + 8, "{fds_during} descriptors");
    assert!(rss_during < rss_before + 32 * 1024, "RSS {rss_before} -> {rss_during} KiB");
    assert!(cpu < Duration::from_millis(600), "the process spins: {cpu:?} of CPU in 2 s");

    // Idle connections are closed after the read timeout: a scraper gets through again while
    // the flood's sockets are still open on this side.
    tokio::time::sleep(wasmcsi::metrics_http::READ_TIMEOUT + Duration::from_secs(2)).await;
    let status = scrape_from(Ipv4Addr::new(127, 0, 2, 1), s.metrics).await;
    assert!(status.contains("200"), "a scrape after the idle connections timed out: {status:?}");
    csi_answers(&s.socket, "after").await;
    drop((idle, flood));
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_tls_connections_to_the_authority_endpoint_cost_little_and_leave_the_csi_socket_answering() {
    use wasmcsi_trust::pki::{DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY};
    use wasmcsi_trust::{Authority, ExpectedRole, Role, TrustAnchors, Validity};
    let _serial = SERIAL.lock().await;
    let pki = tempfile::tempdir().unwrap();
    let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).unwrap();
    let tls = pki.path().join("controller");
    ca.issue(&Role::Controller, Validity::starting_now(DEFAULT_LEAF_VALIDITY))
        .unwrap()
        .write(&tls, ca.bundle())
        .unwrap();
    let s =
        serve_with(&["--tls-dir".into(), tls.display().to_string(), "--authority-listen".into(), "127.0.0.1:0".into()]);
    let authority = s.authority.expect("the authority endpoint's address");
    let pid = pid(&s);
    csi_answers(&s.socket, "before").await;
    // Clients without a certificate: the endpoint admits them to the handshake (a node asks for
    // its first certificate so), and each then holds an authenticated-server TLS session open
    // without sending a byte of HTTP/2.
    let anchors = std::sync::Arc::new(TrustAnchors::new(ca.bundle().to_vec()).unwrap());
    let config = wasmcsi_trust::credentials::anonymous_client_config(anchors, ExpectedRole::Controller).unwrap();
    let handshake = |i: u32| {
        let config = config.clone();
        async move {
            let tcp = connect_from(Ipv4Addr::from(0x7f00_0001 + i / 10), authority).await.expect("connect");
            let server_name = wasmcsi_trust::credentials::server_name();
            let (writer, reader, role) =
                wasmcsi_trust::stream::connect(tcp, config, server_name, Duration::from_secs(10)).await.unwrap();
            assert_eq!(role, Role::Controller);
            (writer, reader)
        }
    };
    // One first, so what the first connection sets up once is not counted per connection.
    let warm = handshake(0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (rss_before, fds_before) = (rss_kib(pid), open_descriptors(pid));
    const IDLE: u32 = 500;
    let mut held = Vec::new();
    for i in 1..=IDLE {
        held.push(handshake(i).await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss_during, fds_during) = (rss_kib(pid), open_descriptors(pid));
    let cpu = cpu_during(pid, Duration::from_secs(2));
    csi_answers(&s.socket, "during").await;
    let per_connection = rss_during.saturating_sub(rss_before) * 1024 / u64::from(IDLE);
    println!(
        "authority endpoint: {IDLE} idle TLS connections; descriptors {fds_before} -> {fds_during}; RSS \
         {rss_before} -> {rss_during} KiB ({per_connection} bytes per connection); CPU {cpu:?} in 2 s"
    );
    assert!(fds_during >= fds_before + IDLE as usize, "the server holds every one: {fds_before} -> {fds_during}");
    assert!(per_connection < 64 * 1024, "{per_connection} bytes of RSS per idle connection");
    assert!(cpu < Duration::from_millis(600), "idle connections cost CPU: {cpu:?} in 2 s");
    drop((warm, held));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_csi_socket_waits_out_descriptor_exhaustion_and_answers_again() {
    let _serial = SERIAL.lock().await;
    let mut s = serve();
    let pid = pid(&s);
    csi_answers(&s.socket, "before").await;
    // 24 descriptors to spare: idle clients of the CSI socket take them all.
    let limit = open_descriptors(pid) + 24;
    set_descriptor_limit(pid, limit, limit);
    let mut clients = Vec::new();
    for _ in 0..200 {
        match tokio::time::timeout(Duration::from_millis(200), tokio::net::UnixStream::connect(&s.socket)).await {
            Ok(Ok(c)) => clients.push(c),
            _ => break,
        }
    }
    s.proc.wait_line("the accept back-off", |l| l.contains("out of descriptors") && l.contains("CSI socket"));
    let cpu = cpu_during(pid, Duration::from_secs(2));
    println!("{} idle clients at a limit of {limit} descriptors: CPU {cpu:?} in 2 s", clients.len());
    assert!(cpu < Duration::from_millis(600), "the accept loop spins at the limit: {cpu:?} of CPU in 2 s");

    drop(clients);
    let started = Instant::now();
    csi_answers(&s.socket, "after").await;
    assert!(started.elapsed() < Duration::from_secs(5), "answered again in {:?}", started.elapsed());
}

#[test]
fn every_process_raises_its_soft_descriptor_limit_to_the_hard_one() {
    let dir = tempfile::tempdir().unwrap();
    // `datapath --help` would exit at once; `serve` stays, with nothing to load.
    let mut child = Command::new("prlimit")
        .args(["--nofile=256:4096", "--", BIN, "serve", "--mode", "controller", "--node-id", "n1"])
        .arg("--socket")
        .arg(dir.path().join("csi.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--backends-dir")
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // prlimit execs the binary: the child's pid is wasmcsi's.
    let limits = format!("/proc/{}/limits", child.id());
    let deadline = Instant::now() + Duration::from_secs(30);
    let line = loop {
        let text = std::fs::read_to_string(&limits).unwrap_or_default();
        let line = text.lines().find(|l| l.starts_with("Max open files")).unwrap_or_default().to_owned();
        if line.split_whitespace().nth(3) == Some("4096") || Instant::now() > deadline {
            break line;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = child.kill();
    let _ = child.wait();
    let numbers: Vec<&str> = line.split_whitespace().skip(3).take(2).collect();
    assert_eq!(numbers, ["4096", "4096"], "soft and hard: {line}");
}
