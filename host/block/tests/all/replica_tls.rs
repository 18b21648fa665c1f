//! The replica server in `--tls-mode required` over real mutual TLS on loopback, with
//! certificates of a CA made for the test (`wasmcsi_trust::pki::Authority`): who is let in, what
//! a node may do (an engine session only with a grant the controller signed for it; none of the
//! controller's requests), that a refused peer changes nothing (dirty flag, epoch, data), and
//! what idle connections cost before and after they authenticated.
//!
//! Every attack here would succeed against a plaintext server: each test checks the outcome the
//! attacker wanted did not happen, not only that an error came back.
#![allow(clippy::unwrap_used, reason = "tests")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use wasmcsi_block::protocol::{
    DEFAULT_MAX_PAYLOAD, Frame, FrameDecoder, Message, PROTOCOL_VERSION, RecordInfo, Status, encode,
};
use wasmcsi_block::replica::{NodeIdentity, ReplicaNode, ReplicaServer, ServerConfig};
use wasmcsi_block::transport::{Transport, dial};
use wasmcsi_trust::credentials::Credentials;
use wasmcsi_trust::pki::{Authority, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Validity};
use wasmcsi_trust::{ExpectedRole, Grant, Limits, LiveCredentials, Role};

const SIZE: u64 = 16 << 20;
const VOLUME: &str = "vol-a";
/// The node serving the replica, and the node the volume is attached to.
const NODE_A: &str = "node-a";
const NODE_B: &str = "node-b";
/// The replica's epoch when each test starts.
const EPOCH: u64 = 3;
const WAIT: Duration = Duration::from_secs(10);

/// The cluster's CA and credentials directories issued by it.
struct Pki {
    ca: Authority,
    dirs: Vec<tempfile::TempDir>,
}

impl Pki {
    fn new() -> Pki {
        Pki { ca: Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).unwrap(), dirs: Vec::new() }
    }

    /// Credentials for `role` issued by the cluster's CA.
    fn live(&mut self, role: &Role) -> LiveCredentials {
        let trust = [self.ca.certificate().clone()];
        let (dir, credentials) = issue(&self.ca, role, &trust);
        self.dirs.push(dir);
        credentials
    }

    /// Credentials for `role` issued by a CA the attacker made itself (the cluster does not
    /// trust it); they trust the cluster's CA too, so only the server's check can refuse them.
    fn forged(&mut self, role: &Role) -> LiveCredentials {
        let own = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).unwrap();
        let trust = [own.certificate().clone(), self.ca.certificate().clone()];
        let (dir, credentials) = issue(&own, role, &trust);
        self.dirs.push(dir);
        credentials
    }
}

fn issue(
    ca: &Authority,
    role: &Role,
    trust: &[rustls::pki_types::CertificateDer<'static>],
) -> (tempfile::TempDir, LiveCredentials) {
    let dir = tempfile::tempdir().unwrap();
    ca.issue(role, Validity::starting_now(DEFAULT_LEAF_VALIDITY)).unwrap().write(dir.path(), trust).unwrap();
    let credentials = Credentials::load(dir.path()).unwrap();
    (dir, LiveCredentials::new(credentials))
}

/// Something a client speaks the protocol over (plaintext or TLS).
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// A bare protocol client, as in `replica_server`, over any stream.
struct Client {
    stream: Box<dyn Io>,
    decoder: FrameDecoder,
    next_id: u64,
}

impl Client {
    fn over(stream: Box<dyn Io>) -> Client {
        Client { stream, decoder: FrameDecoder::new(DEFAULT_MAX_PAYLOAD), next_id: 1 }
    }

    /// Sends every message at once (a pipelining attacker does not wait for answers).
    async fn send_all(&mut self, messages: Vec<Message>) {
        let mut out = Vec::new();
        for message in messages {
            encode(&Frame { request_id: self.next_id, message }, &mut out).unwrap();
            self.next_id += 1;
        }
        // The server may already have closed: what it read is what the test checks.
        let _ = self.stream.write_all(&out).await;
        let _ = self.stream.flush().await;
    }

    /// The next frame, `None` once the server closed the connection.
    async fn recv(&mut self) -> Option<Message> {
        let mut buf = vec![0; 64 * 1024];
        tokio::time::timeout(WAIT, async {
            loop {
                match self.decoder.next_frame() {
                    Ok(Some(f)) => return Some(f.message),
                    Ok(None) => {}
                    Err(_) => return None,
                }
                match self.stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => self.decoder.push(&buf[..n]),
                }
            }
        })
        .await
        .expect("the server neither answered nor closed")
    }

    async fn call(&mut self, message: Message) -> Message {
        self.send_all(vec![message]).await;
        self.recv().await.expect("a reply")
    }
}

/// A server of node A in `required` mode holding `VOLUME` at `EPOCH`.
struct Fixture {
    pki: Pki,
    server: ReplicaServer,
    controller: LiveCredentials,
    _root: tempfile::TempDir,
}

impl Fixture {
    async fn new() -> Fixture {
        Self::with(|_| {}).await
    }

    async fn with(adjust: impl FnOnce(&mut ServerConfig)) -> Fixture {
        let mut pki = Pki::new();
        let root = tempfile::tempdir().unwrap();
        let node = ReplicaNode::open(root.path()).unwrap();
        node.create_replica(VOLUME, SIZE).unwrap();
        node.set_record(VOLUME, RecordInfo { version: 1, epoch: EPOCH, data: b"{}".to_vec() }).unwrap();
        let mut config = ServerConfig {
            identity: NodeIdentity { node: NODE_A.into(), labels: Vec::new() },
            transport: Transport::Required(pki.live(&Role::Node(NODE_A.into()))),
            ..ServerConfig::plaintext()
        };
        adjust(&mut config);
        let server = ReplicaServer::serve("127.0.0.1:0", Arc::new(node), config).await.unwrap();
        let controller = pki.live(&Role::Controller);
        Fixture { pki, server, controller, _root: root }
    }

    fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// A TLS client with `credentials`, checking the server is node A.
    async fn client(&self, credentials: &LiveCredentials) -> Client {
        let dialed =
            dial(self.addr(), &Transport::Required(credentials.clone()), &ExpectedRole::Node(NODE_A.into()), WAIT)
                .await
                .unwrap();
        assert_eq!(dialed.server, Some(Role::Node(NODE_A.into())));
        Client::over(Box::new(dialed.stream))
    }

    async fn node_client(&mut self, node: &str) -> Client {
        let credentials = self.pki.live(&Role::Node(node.into()));
        self.client(&credentials).await
    }

    /// A grant for (`VOLUME`, `node`, `epoch`) signed by the controller, valid for an hour.
    fn grant(&self, node: &str, epoch: u64) -> Vec<u8> {
        Grant::starting_now(VOLUME, node, epoch, Duration::from_secs(3600))
            .sign(&self.controller.current())
            .unwrap()
            .encoded
    }

    /// What an attacker wants to change: the dirty flag, the epoch, the revision.
    fn state(&self) -> (bool, u64, u64) {
        let (header, record) = self.server.node().describe(VOLUME).unwrap();
        (header.dirty, record.epoch, header.revision)
    }

    /// The replica's first 4 KiB, read by the controller (after `state` was checked: its
    /// session marks the replica dirty).
    async fn first_block(&self) -> Vec<u8> {
        let mut c = self.client(&self.controller.clone()).await;
        let hello = Message::Hello {
            volume_id: VOLUME.into(),
            protocol_version: PROTOCOL_VERSION,
            revision: 0,
            disk: wasmcsi_block::protocol::DEFAULT_DISK.into(),
        };
        assert!(matches!(c.call(hello).await, Message::HelloReply { status: Status::Ok, .. }));
        match c.call(Message::Read { offset: 0, len: 4096 }).await {
            Message::ReadReply { status: Status::Ok, data } => data,
            other => panic!("{other:?}"),
        }
    }
}

fn hello() -> Message {
    Message::Hello {
        volume_id: VOLUME.into(),
        protocol_version: PROTOCOL_VERSION,
        revision: 0,
        disk: wasmcsi_block::protocol::DEFAULT_DISK.into(),
    }
}

fn write() -> Message {
    Message::Write { offset: 0, revision: 1, data: vec![0xee; 4096].into() }
}

/// Asserts the attack changed nothing: clean, at `EPOCH`, revision 0, no data written.
async fn assert_untouched(f: &Fixture) {
    assert_eq!(f.state(), (false, EPOCH, 0), "(dirty, epoch, revision)");
    assert_eq!(f.first_block().await, vec![0; 4096]);
}

#[tokio::test]
async fn plaintext_to_a_required_server_is_dropped_before_any_frame_is_read() {
    let f = Fixture::new().await;
    let mut plain = TcpStream::connect(f.addr()).await.unwrap();
    let mut out = Vec::new();
    for (i, message) in [hello(), Message::Claim { epoch: EPOCH + 1 }, write()].into_iter().enumerate() {
        encode(&Frame { request_id: i as u64 + 1, message }, &mut out).unwrap();
    }
    let _ = plain.write_all(&out).await;
    let mut back = Vec::new();
    let read = tokio::time::timeout(WAIT, plain.read_to_end(&mut back)).await.expect("the server closed");
    // At most a TLS alert comes back (a record starting 0x15), never a frame.
    assert!(read.is_err() || back.first() != Some(&b'W'), "{back:02x?}");
    assert_eq!(f.server.stats().handshakes_completed.load(Ordering::Relaxed), 0);
    assert_untouched(&f).await;
}

#[tokio::test]
async fn a_certificate_of_a_ca_the_cluster_does_not_trust_is_refused() {
    let mut f = Fixture::new().await;
    // It even names node A, and carries a grant the controller really signed for node A.
    let forged = f.pki.forged(&Role::Node(NODE_A.into()));
    let grant = f.grant(NODE_A, EPOCH);
    let dialed = dial(f.addr(), &Transport::Required(forged), &ExpectedRole::Node(NODE_A.into()), WAIT).await;
    // TLS 1.3: the client may finish its side before the server read its certificate, so the
    // refusal shows either in the handshake or as the end of the stream.
    if let Ok(dialed) = dialed {
        let mut c = Client::over(Box::new(dialed.stream));
        c.send_all(vec![Message::Grant { grant }, hello(), write()]).await;
        assert_eq!(c.recv().await, None);
    }
    assert_eq!(f.server.stats().handshakes_completed.load(Ordering::Relaxed), 0);
    assert_untouched(&f).await;
}

#[tokio::test]
async fn node_b_opens_no_session_of_a_volume_granted_to_a_neither_without_a_grant_nor_with_as() {
    let mut f = Fixture::new().await;
    let mut c = f.node_client(NODE_B).await;
    c.send_all(vec![hello(), Message::Claim { epoch: EPOCH }, write()]).await;
    assert!(matches!(c.recv().await, Some(Message::HelloReply { status: Status::Denied, .. })));
    assert_eq!(c.recv().await, None, "closed after the refusal");

    // A's grant, captured: it names node A, the peer is B.
    let captured = f.grant(NODE_A, EPOCH);
    let mut c = f.node_client(NODE_B).await;
    c.send_all(vec![Message::Grant { grant: captured }, hello(), Message::Claim { epoch: EPOCH }, write()]).await;
    assert_eq!(c.recv().await, Some(Message::Reply { status: Status::Denied }));
    assert_eq!(c.recv().await, None, "closed after the refusal");
    assert_untouched(&f).await;
}

#[tokio::test]
async fn node_a_with_its_grant_opens_a_session_that_may_claim_only_the_grants_epoch() {
    let mut f = Fixture::new().await;
    let grant = f.grant(NODE_A, EPOCH);
    // Claiming a newer epoch than granted would fence the rightful engine: refused.
    let mut c = f.node_client(NODE_A).await;
    c.send_all(vec![Message::Grant { grant: grant.clone() }, hello(), Message::Claim { epoch: EPOCH + 1 }, write()])
        .await;
    assert_eq!(c.recv().await, Some(Message::Reply { status: Status::Ok }));
    assert!(matches!(c.recv().await, Some(Message::HelloReply { status: Status::Ok, .. })));
    assert_eq!(c.recv().await, Some(Message::Reply { status: Status::Denied }));
    assert_eq!(c.recv().await, None, "closed after the refusal");
    assert_eq!(f.state().1, EPOCH, "the epoch was not raised");

    let mut c = f.node_client(NODE_A).await;
    assert_eq!(c.call(Message::Grant { grant }).await, Message::Reply { status: Status::Ok });
    assert!(matches!(c.call(hello()).await, Message::HelloReply { status: Status::Ok, .. }));
    assert_eq!(c.call(Message::Claim { epoch: EPOCH }).await, Message::Reply { status: Status::Ok });
    assert_eq!(c.call(write()).await, Message::Reply { status: Status::Ok });
    assert_eq!(c.call(Message::Flush).await, Message::Reply { status: Status::Ok });
    drop(c);
    assert_eq!(f.first_block().await, vec![0xee; 4096]);
}

#[tokio::test]
async fn a_grant_of_an_older_epoch_opens_no_session_after_a_republish() {
    let mut f = Fixture::new().await;
    let old = f.grant(NODE_A, EPOCH);
    // The volume was published again (to whichever node): the controller raised the epoch.
    let mut controller = f.client(&f.controller.clone()).await;
    let raise = Message::SetRecord {
        volume_id: VOLUME.into(),
        version: 2,
        epoch: EPOCH + 1,
        data: b"{}".to_vec(),
        disk: wasmcsi_block::protocol::DEFAULT_DISK.into(),
    };
    assert_eq!(controller.call(raise).await, Message::Reply { status: Status::Ok });
    drop(controller);

    let mut c = f.node_client(NODE_A).await;
    c.send_all(vec![Message::Grant { grant: old }, hello(), Message::Claim { epoch: EPOCH }, write()]).await;
    // The grant itself verifies; the replica's epoch is checked when the session would open.
    assert_eq!(c.recv().await, Some(Message::Reply { status: Status::Ok }));
    assert!(matches!(c.recv().await, Some(Message::HelloReply { status: Status::Denied, .. })));
    assert_eq!(c.recv().await, None, "closed after the refusal");
    assert_eq!(f.state(), (false, EPOCH + 1, 0), "(dirty, epoch, revision)");
    assert_eq!(f.first_block().await, vec![0; 4096]);
}

#[tokio::test]
async fn an_expired_grant_is_refused() {
    let mut f = Fixture::new().await;
    let now = SystemTime::now();
    let expired = Grant {
        volume: VOLUME.into(),
        node: NODE_A.into(),
        epoch: EPOCH,
        not_before: now - Duration::from_secs(7200),
        not_after: now - Duration::from_secs(3600),
    }
    .sign(&f.controller.current())
    .unwrap()
    .encoded;
    let mut c = f.node_client(NODE_A).await;
    c.send_all(vec![Message::Grant { grant: expired }, hello(), write()]).await;
    assert_eq!(c.recv().await, Some(Message::Reply { status: Status::Denied }));
    assert_eq!(c.recv().await, None, "closed after the refusal");
    assert_untouched(&f).await;
}

#[tokio::test]
async fn a_node_reads_what_the_node_knows_and_makes_none_of_the_controllers_requests() {
    let mut f = Fixture::new().await;
    let refused = [
        Message::CreateReplica { volume_id: "vol-new".into(), size: SIZE },
        Message::DeleteReplica { volume_id: VOLUME.into(), disk: wasmcsi_block::protocol::DEFAULT_DISK.into() },
        Message::SetRecord {
            volume_id: VOLUME.into(),
            version: 2,
            epoch: EPOCH + 5,
            data: b"{}".to_vec(),
            disk: wasmcsi_block::protocol::DEFAULT_DISK.into(),
        },
        Message::EngineCall { volume_id: VOLUME.into(), request: b"{}".to_vec() },
    ];
    for request in refused {
        let mut c = f.node_client(NODE_A).await;
        let name = format!("{request:?}");
        // A second request behind it must not run either.
        c.send_all(vec![
            request,
            Message::DeleteReplica { volume_id: VOLUME.into(), disk: wasmcsi_block::protocol::DEFAULT_DISK.into() },
        ])
        .await;
        match c.recv().await {
            Some(Message::Reply { status: Status::Denied } | Message::EngineReply { status: Status::Denied, .. }) => {}
            other => panic!("{name}: {other:?}"),
        }
        assert_eq!(c.recv().await, None, "{name}: closed after the refusal");
    }
    assert!(f.server.node().describe("vol-new").is_err(), "no replica was created");

    let mut c = f.node_client(NODE_B).await;
    assert!(matches!(c.call(Message::Identify).await, Message::Identity { status: Status::Ok, .. }));
    assert!(matches!(c.call(Message::NodeInfo).await, Message::NodeInfoReply { status: Status::Ok, .. }));
    match c
        .call(Message::Describe { volume_id: VOLUME.into(), disk: wasmcsi_block::protocol::DEFAULT_DISK.into() })
        .await
    {
        Message::Description { status: Status::Ok, record, .. } => assert_eq!(record.epoch, EPOCH),
        other => panic!("{other:?}"),
    }
    drop(c);
    assert_untouched(&f).await;
}

#[tokio::test]
async fn an_idle_control_connection_is_closed() {
    let f = Fixture::with(|c| c.idle_timeout = Duration::from_millis(300)).await;
    let mut c = f.client(&f.controller.clone()).await;
    assert!(matches!(c.call(Message::Identify).await, Message::Identity { status: Status::Ok, .. }));
    let started = std::time::Instant::now();
    assert_eq!(c.recv().await, None);
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
}

/// This process's resident memory, KiB.
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + WAIT;
    while !done() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Idle connections before authentication cost at most 64 KiB each (the frame buffers come
/// only after the handshake), authenticated idle control connections are measured too, and a
/// real engine session still serves meanwhile. The numbers are printed (`--nocapture`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cost_little_and_an_engine_still_serves_meanwhile() {
    const PRE_AUTH: usize = 500;
    const AUTHENTICATED: usize = 100;
    let mut f = Fixture::with(|c| {
        c.limits =
            Limits { max_connections: 2048, max_per_source: 2048, handshake_timeout: WAIT * 6, ..Limits::default() }
    })
    .await;
    let controller = f.controller.clone();
    // Warm up allocator and runtime with one full session first.
    let _ = f.first_block().await;

    let before = rss_kib();
    let mut idle = Vec::new();
    for _ in 0..PRE_AUTH {
        idle.push(TcpStream::connect(f.addr()).await.unwrap());
    }
    let open = f.server.stats().open.load(Ordering::Relaxed);
    wait_until("every idle connection admitted", || {
        f.server.stats().open.load(Ordering::Relaxed) >= open.max(PRE_AUTH as u64)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pre_auth = rss_kib().saturating_sub(before) as f64 / PRE_AUTH as f64;

    let before = rss_kib();
    let mut authenticated = Vec::new();
    for _ in 0..AUTHENTICATED {
        let mut c = f.client(&controller).await;
        assert!(matches!(c.call(Message::Identify).await, Message::Identity { status: Status::Ok, .. }));
        authenticated.push(c);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Both ends live in this process: the figure is the client's and the server's together.
    let after_auth = rss_kib().saturating_sub(before) as f64 / AUTHENTICATED as f64;

    let grant = f.grant(NODE_A, EPOCH);
    let engine = f.pki.live(&Role::Node(NODE_A.into()));
    let started = std::time::Instant::now();
    let mut c = f.client(&engine).await;
    let handshake = started.elapsed();
    assert_eq!(c.call(Message::Grant { grant }).await, Message::Reply { status: Status::Ok });
    assert!(matches!(c.call(hello()).await, Message::HelloReply { status: Status::Ok, .. }));
    assert_eq!(c.call(Message::Claim { epoch: EPOCH }).await, Message::Reply { status: Status::Ok });
    assert_eq!(c.call(write()).await, Message::Reply { status: Status::Ok });
    assert!(
        matches!(c.call(Message::Read { offset: 0, len: 4096 }).await, Message::ReadReply { status: Status::Ok, data } if data == vec![0xee; 4096])
    );
    eprintln!(
        "replica port, required mode: {pre_auth:.1} KiB per idle pre-auth connection ({PRE_AUTH}), \
         {after_auth:.1} KiB per idle authenticated control connection ({AUTHENTICATED}, client + server), \
         engine connect + handshake {handshake:?} with {PRE_AUTH} idle connections open"
    );
    assert!(pre_auth <= 64.0, "{pre_auth} KiB per pre-auth connection");
    drop(idle);
    drop(authenticated);
}
