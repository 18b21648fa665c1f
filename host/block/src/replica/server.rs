//! Serves every replica of a node's disks ([`ReplicaDisks`]: one or more replica roots) over TCP
//! with the replica protocol: one listener per node, bounded by `wasmcsi_trust::Listener` (total
//! and per-source connection caps, handshake deadline and byte budget, back-off when descriptors
//! run out) and carried as
//! [`ServerConfig::transport`] says: mutual TLS (`required`), TLS beside legacy plaintext
//! (`permissive`) or plaintext (`off`). Nothing of the protocol is read from a TLS peer before its
//! handshake completed, and a connection's buffers are allocated only once it has: what a peer
//! costs before it authenticated is the listener's permit, a task and rustls' handshake state.
//!
//! Who may do what is `authorize`'s decision: the peer's certificate names its role, a node opens
//! an engine session only with a grant the controller signed for it (a `Grant` frame before
//! `Hello`), and only the controller changes replicas and records or calls engines. A refused
//! request is answered `Denied`, changes nothing, is logged once with the peer and why, and
//! closes the connection.
//!
//! A connection is either an engine session or a control connection, decided by its first frame
//! (after a `Grant`, if any). An engine's first frame is `Hello`, which picks the replica by
//! volume id (answered with its header, `NotFound` for a volume this node does not hold); then
//! requests are pipelined — each runs as soon as it is read (see `pipeline`) and its reply is
//! written when it is done, so replies leave in completion order, matched by request id. A
//! control connection starts with a control request instead (`CreateReplica`, `CreateReplicaOn`,
//! `DeleteReplica`, `NodeInfo`, `ListDisks`, `Describe`, `SetRecord`, `Identify`, `EngineCall`)
//! and may send only those,
//! answered one at a time; it is closed after [`ServerConfig::idle_timeout`] without a request.
//! Engine sessions are long-lived and mostly quiet: they use TCP keepalive instead.
//! `EngineCall`s go to the engines running in this server's process ([`EngineCalls`]), when it
//! was given them.
//!
//! Any protocol error (garbage, a bad checksum, a request before `Hello`, a reply sent to us)
//! closes that connection only; the listener and other connections keep serving.
//!
//! The dirty flag, per replica: set (durably) when an engine says `Hello`; cleared when the last
//! engine leaves cleanly, meaning its final request was a `Flush` that arrived with no mutation in
//! flight, and no session that overlapped it ended otherwise. Anything else (a crash, a write
//! after the last flush, a protocol error) leaves it set so the next engine knows this replica may
//! disagree with its peers.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use thiserror::Error;
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use wasmcsi_trust::listener::{self, PermissiveConnection, Permit, PlainConnection, Stats, TlsConnection};
use wasmcsi_trust::stream::from_server_stream;
use wasmcsi_trust::{Limits, Listener, Role};

use super::authorize::{self, Caller, Granted, Refusal};
use super::disks::{DEFAULT_DISK, ReplicaDisks};
use super::error::StoreError;
use super::frames::{ConnError, Reader, drain, write_loop};
use super::node::{NodeError, Replica, ReplicaNode};
use super::pipeline;
use super::session;
use crate::protocol::{DEFAULT_MAX_PAYLOAD, DiskSummary, Frame, Message, RecordInfo, ReplicaHeader, Status};
use crate::transport::{ReadHalf, Transport, WriteHalf, keepalive};

/// Who a replica server is, as `Identify` answers: the node's name and labels, which placement
/// and topology use (addresses change, names do not).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeIdentity {
    pub node: String,
    pub labels: Vec<(String, String)>,
}

/// The engines running in the replica server's process, which `EngineCall` requests reach (the
/// node plugin's attached volumes). A request and its reply are the engine control surface's
/// encoding; `Err(NotFound)` when no engine of the volume runs here.
pub trait EngineCalls: Send + Sync + 'static {
    fn call(
        &self,
        volume_id: String,
        request: Vec<u8>,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<u8>, Status>> + Send>>;
}

/// A control connection is closed after this long without a request.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// An engine session's TCP keepalive starts probing after this long without traffic.
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(30);

/// Per-connection limits, how connections are carried, and who the server is.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Requests of one connection executing or waiting to be answered before the server stops
    /// reading from it.
    pub max_in_flight: usize,
    /// Largest frame payload accepted or sent (the protocol's default: a 4 MiB write).
    pub max_payload: usize,
    /// On shutdown, how long a connection may take to deliver replies to requests it already
    /// read; a peer that stopped reading must not hold the shutdown forever.
    pub shutdown_grace: Duration,
    /// What `Identify` answers.
    pub identity: NodeIdentity,
    /// Plaintext, or TLS with the node's credentials (which must name this node).
    pub transport: Transport,
    /// The listener's bounds.
    pub limits: Limits,
    /// A connection that has not yet become an engine session (nothing sent, or a control
    /// connection between requests) is closed after this long idle.
    pub idle_timeout: Duration,
    /// Engine sessions: TCP keepalive idle time (see `transport::keepalive`).
    pub keepalive: Duration,
}

impl ServerConfig {
    /// Plaintext (`--tls-mode off`) with the default limits: there is no default transport, a
    /// server that serves plaintext says so where it is started.
    pub fn plaintext() -> Self {
        Self {
            max_in_flight: 64,
            max_payload: DEFAULT_MAX_PAYLOAD,
            shutdown_grace: Duration::from_secs(5),
            identity: NodeIdentity::default(),
            transport: Transport::Plain,
            limits: Limits::default(),
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            keepalive: DEFAULT_KEEPALIVE,
        }
    }
}

#[derive(Debug, Error)]
pub enum ServerError {
    #[error("opening replica: {0}")]
    Store(#[from] StoreError),
    #[error("opening the replica node: {0}")]
    Node(#[from] NodeError),
    #[error("binding replica listener: {0}")]
    Bind(std::io::Error),
    #[error("replica store task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
    #[error("the replica server's certificate is {found}'s; it serves node {node:?} and needs that node's")]
    Identity { found: String, node: String },
}

/// A running replica server. Dropping it shuts the server down in the background, like
/// [`ReplicaServer::shutdown`] without waiting for it.
#[derive(Debug)]
pub struct ReplicaServer {
    local_addr: SocketAddr,
    node: Arc<ReplicaNode>,
    disks: ReplicaDisks,
    stats: Arc<Stats>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// Shared by the accept loop and every connection.
pub(super) struct Shared {
    pub(super) disks: ReplicaDisks,
    pub(super) config: ServerConfig,
    engines: Option<Arc<dyn EngineCalls>>,
    /// Held by every connection (through this), so the accept loop knows when all are gone.
    _alive: mpsc::Sender<()>,
}

impl ReplicaServer {
    /// Opens every replica under `root` (created if missing) and serves them on `addr` (port 0
    /// picks a free port; see [`ReplicaServer::local_addr`]) in plaintext (`--tls-mode off`).
    pub async fn bind_plaintext(addr: impl ToSocketAddrs, root: &Path) -> Result<Self, ServerError> {
        let root = root.to_path_buf();
        let node = tokio::task::spawn_blocking(move || ReplicaNode::open(&root)).await??;
        Self::serve(addr, Arc::new(node), ServerConfig::plaintext()).await
    }

    /// Serves an already opened node with explicit limits.
    pub async fn serve(
        addr: impl ToSocketAddrs,
        node: Arc<ReplicaNode>,
        config: ServerConfig,
    ) -> Result<Self, ServerError> {
        Self::serve_with_engines(addr, node, config, None).await
    }

    /// Like [`ReplicaServer::serve`], and `EngineCall`s reach `engines`.
    pub async fn serve_with_engines(
        addr: impl ToSocketAddrs,
        node: Arc<ReplicaNode>,
        config: ServerConfig,
        engines: Option<Arc<dyn EngineCalls>>,
    ) -> Result<Self, ServerError> {
        let listener = TcpListener::bind(addr).await.map_err(ServerError::Bind)?;
        Self::serve_listener(listener, ReplicaDisks::single(node), config, engines)
    }

    /// Like [`ReplicaServer::serve_with_engines`] on a socket bound already (one a data path
    /// inherited from the process it took over from).
    pub async fn serve_on_listener(
        listener: std::net::TcpListener,
        node: Arc<ReplicaNode>,
        config: ServerConfig,
        engines: Option<Arc<dyn EngineCalls>>,
    ) -> Result<Self, ServerError> {
        Self::serve_disks_on_listener(listener, ReplicaDisks::single(node), config, engines).await
    }

    /// Like [`ReplicaServer::serve_on_listener`], serving several disks (replica roots).
    pub async fn serve_disks_on_listener(
        listener: std::net::TcpListener,
        disks: ReplicaDisks,
        config: ServerConfig,
        engines: Option<Arc<dyn EngineCalls>>,
    ) -> Result<Self, ServerError> {
        listener.set_nonblocking(true).map_err(ServerError::Bind)?;
        let listener = TcpListener::from_std(listener).map_err(ServerError::Bind)?;
        Self::serve_listener(listener, disks, config, engines)
    }

    fn serve_listener(
        listener: TcpListener,
        disks: ReplicaDisks,
        config: ServerConfig,
        engines: Option<Arc<dyn EngineCalls>>,
    ) -> Result<Self, ServerError> {
        check_identity(&config)?;
        let local_addr = listener.local_addr().map_err(ServerError::Bind)?;
        let listener = Listener::new(listener, config.limits.clone());
        let stats = listener.stats();
        let (shutdown, rx) = watch::channel(false);
        let (alive, gone) = mpsc::channel(1);
        let transport = config.transport.mode();
        let node = disks.default_disk().clone();
        let names: Vec<&str> = disks.names().collect();
        tracing::info!(
            replica.addr = %local_addr,
            replica.root = %node.root().display(),
            replica.disks = %names.join(","),
            tls = %transport,
            "replica node serving"
        );
        let shared = Arc::new(Shared { disks: disks.clone(), config, engines, _alive: alive });
        let task = tokio::spawn(accept_loop(listener, shared, rx, gone));
        Ok(Self { local_addr, node, disks, stats, shutdown, task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The replicas this server serves on its disk `default` (create, delete and inspect them
    /// directly).
    pub fn node(&self) -> &Arc<ReplicaNode> {
        &self.node
    }

    /// Every disk this server serves.
    pub fn disks(&self) -> &ReplicaDisks {
        &self.disks
    }

    /// The listener's counters (connections open, refused, handshakes).
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// Stops accepting, lets every connection finish and answer the requests it already read,
    /// closes them, and returns when all are gone.
    pub async fn shutdown(self) -> Result<(), ServerError> {
        // Err only if the accept loop is already gone, which is what we want anyway.
        let _ = self.shutdown.send(true);
        self.task.await?;
        Ok(())
    }
}

/// A node's replica server must present that node's certificate: engines dialling it check
/// that it is the member node they mean to reach.
fn check_identity(config: &ServerConfig) -> Result<(), ServerError> {
    let Some(role) = config.transport.role() else { return Ok(()) };
    let node = &config.identity.node;
    match role {
        Role::Node(id) if node.is_empty() || id == *node => Ok(()),
        other => Err(ServerError::Identity { found: other.to_string(), node: node.clone() }),
    }
}

async fn accept_loop(
    listener: Listener,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
    mut gone: mpsc::Receiver<()>,
) {
    // Connections still in their handshake hold the server only weakly: a shutdown does not
    // wait for a peer that never finishes one.
    let weak = Arc::downgrade(&shared);
    let transport = shared.config.transport.clone();
    let serving = serve(listener, transport, weak, shutdown.clone());
    tokio::select! {
        () = stopped(shutdown.clone()) => {}
        result = serving => {
            if let Err(e) = result {
                tracing::error!(error = %e, "the replica listener failed; no new connections are accepted");
            }
            stopped(shutdown).await;
        }
    }
    drop(shared);
    // `None` once every connection let go of the server.
    let _ = gone.recv().await;
}

/// Completes once the server is asked to stop (or its handle is gone, which is a stop too).
async fn stopped(mut shutdown: watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// Runs the listener in `transport`'s mode until it fails.
async fn serve(
    listener: Listener,
    transport: Transport,
    server: Weak<Shared>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let handle = move |accepted: Option<Accepted>| {
        let (server, shutdown) = (server.upgrade(), shutdown.clone());
        async move {
            if let (Some(server), Some(accepted)) = (server, accepted) {
                connection(accepted, server, shutdown).await;
            }
        }
    };
    match transport {
        Transport::Plain => listener.serve_plain(move |c| handle(Some(Accepted::plain(c)))).await,
        Transport::Permissive(credentials) => {
            listener.serve_permissive(credentials, move |c| handle(Accepted::permissive(c))).await
        }
        Transport::Required(credentials) => {
            listener.serve_tls(credentials, move |c| handle(Some(Accepted::tls(c)))).await
        }
    }
}

/// A connection the listener admitted, split, with who it is.
struct Accepted {
    rd: ReadHalf,
    wr: WriteHalf,
    peer: SocketAddr,
    caller: Caller,
    /// The listener's slot, held as long as the connection.
    _permit: Permit,
}

impl Accepted {
    fn plain(c: PlainConnection) -> Accepted {
        Accepted::split_plain(c.stream, c.peer, c.permit)
    }

    fn tls(c: TlsConnection) -> Accepted {
        let (writer, reader) = from_server_stream(c.stream);
        Accepted {
            rd: ReadHalf::Tls(reader),
            wr: WriteHalf::Tls(writer),
            peer: c.peer,
            caller: Caller::Tls(c.role),
            _permit: c.permit,
        }
    }

    fn permissive(c: PermissiveConnection) -> Option<Accepted> {
        match c.transport {
            listener::Transport::Tls { stream, role } => {
                Some(Accepted::tls(TlsConnection { stream: *stream, peer: c.peer, role, permit: c.permit }))
            }
            listener::Transport::Plain(stream) => {
                // Once per connection: an operator sees who still speaks plaintext before
                // switching to `required`.
                tracing::info!(replica.peer = %c.peer, "plaintext replica connection (permissive mode): unauthenticated, served by the rules before TLS");
                Some(Accepted::split_plain(stream, c.peer, c.permit))
            }
        }
    }

    fn split_plain(stream: TcpStream, peer: SocketAddr, permit: Permit) -> Accepted {
        // Small frames (replies) must not wait for Nagle.
        let _ = stream.set_nodelay(true);
        let (rd, wr) = stream.into_split();
        Accepted { rd: ReadHalf::Plain(rd), wr: WriteHalf::Plain(wr), peer, caller: Caller::Plaintext, _permit: permit }
    }

    fn socket(&self) -> Option<&TcpStream> {
        match &self.wr {
            WriteHalf::Plain(w) => Some(w.as_ref()),
            WriteHalf::Tls(w) => Some(w.socket()),
        }
    }
}

async fn connection(accepted: Accepted, shared: Arc<Shared>, shutdown: watch::Receiver<bool>) {
    let (peer, caller) = (accepted.peer, accepted.caller.clone());
    if let Some(socket) = accepted.socket() {
        keepalive(socket, shared.config.keepalive);
    }
    match serve_connection(accepted, &shared, shutdown).await {
        Ok(()) | Err(ConnError::Denied) => {
            tracing::debug!(replica.peer = %peer, replica.caller = %caller, "replica connection closed")
        }
        Err(e) => {
            tracing::warn!(replica.peer = %peer, replica.caller = %caller, error = %e, "replica connection dropped")
        }
    }
}

/// A connection's state between its first frames.
struct Conn<'a> {
    shared: &'a Arc<Shared>,
    peer: SocketAddr,
    caller: Caller,
    tx: mpsc::Sender<Frame>,
}

impl Conn<'_> {
    /// Answers `request` `Denied` and logs why, once: the connection ends after it.
    async fn deny(&self, request_id: u64, request: &Message, why: Refusal) -> ConnError {
        authorize::log_refusal(self.peer, &self.caller, request, &why);
        let _ = self.tx.send(Frame { request_id, message: authorize::denied(request) }).await;
        ConnError::Denied
    }

    async fn reply(&self, request_id: u64, message: Message) {
        let _ = self.tx.send(Frame { request_id, message }).await;
    }
}

async fn serve_connection(
    accepted: Accepted,
    shared: &Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) -> Result<(), ConnError> {
    let cfg = &shared.config;
    let Accepted { rd, wr, peer, caller, _permit } = accepted;
    let drain_signal = shutdown.clone();
    // Allocates nothing until the first read; the read buffer grows with what arrives.
    let mut reader = Reader::new(rd, cfg.max_payload, shutdown);
    let Some(mut first) = reader.next_within(cfg.idle_timeout).await? else { return Ok(()) };
    let (tx, rx) = mpsc::channel::<Frame>(cfg.max_in_flight.max(1));
    let mut writer = tokio::spawn(write_loop(wr, rx, cfg.max_payload));
    let conn = Conn { shared, peer, caller, tx };

    let mut granted = None;
    if let Message::Grant { grant } = &first.message {
        match verify_grant(&conn, grant) {
            Ok(g) => granted = g,
            Err(why) => return finish(writer, Err(conn.deny(first.request_id, &first.message, why).await), conn).await,
        }
        conn.reply(first.request_id, Message::Reply { status: Status::Ok }).await;
        first = match reader.next_within(cfg.idle_timeout).await {
            Ok(Some(frame)) => frame,
            other => return finish(writer, other.map(|_| ()), conn).await,
        };
    }
    let (request_id, volume_id, protocol_version, disk) = match first.message {
        Message::Hello { ref volume_id, protocol_version, ref disk, .. } => {
            (first.request_id, volume_id.clone(), protocol_version, disk.clone())
        }
        Message::Grant { .. } => {
            let denied = conn.deny(first.request_id, &first.message, Refusal::LateGrant).await;
            return finish(writer, Err(denied), conn).await;
        }
        ref m if is_control(m) => {
            let result = serve_control(first, &mut reader, &conn).await;
            return finish(writer, result, conn).await;
        }
        _ => {
            writer.abort();
            return Err(ConnError::Unexpected("first frame is neither Hello nor a control request"));
        }
    };
    let grant_epoch = match conn.caller.may_open(&volume_id, granted.as_ref()) {
        Ok(epoch) => epoch,
        Err(why) => return finish(writer, Err(conn.deny(request_id, &first.message, why).await), conn).await,
    };
    // A disk this server does not have holds no replica: `NotFound`, like a disk without it.
    let node = shared.disks.get(&disk).cloned();
    let opened = tokio::task::spawn_blocking(move || match node {
        Ok(node) => session::open(&node, volume_id, protocol_version, grant_epoch),
        Err(e) => session::refused(e.status(), volume_id),
    })
    .await;
    let (replica, status, header) = match opened {
        Ok(opened) => opened,
        Err(e) => {
            tracing::error!(error = %e, "replica hello panicked");
            writer.abort();
            return Err(ConnError::Unexpected("hello failed"));
        }
    };
    if status == Status::Denied {
        let replica_epoch = replica_epoch(shared, &disk, &header.volume_id);
        let why = Refusal::StaleEpoch { granted: grant_epoch.unwrap_or(0), replica: replica_epoch };
        authorize::log_refusal(peer, &conn.caller, &first.message, &why);
    }
    // The reply carries the header as it was before this session marked it dirty, so the engine
    // sees whether the previous one ended cleanly.
    conn.reply(request_id, Message::HelloReply { status, header }).await;
    let Some(replica) = replica else {
        let result = if status == Status::Denied { Err(ConnError::Denied) } else { Ok(()) };
        return finish(writer, result, conn).await;
    };

    let result = pipeline::serve_requests(
        &mut reader,
        pipeline::Bounds { max_in_flight: shared.config.max_in_flight, max_payload: shared.config.max_payload },
        &replica,
        &conn.tx,
        granted.as_ref(),
        peer,
        &conn.caller,
    )
    .await;
    let Conn { tx, .. } = conn;
    drop(tx);
    let clean = match result {
        // Every request task holds a sender; the writer ends once all replies are out.
        Ok(clean) => match drain(&mut writer, drain_signal, cfg.shutdown_grace).await {
            Some(mut wr) => {
                // The end of the stream is sent only after the session ended (dirty flag
                // cleared), so a peer that waits for it knows the replica is clean.
                end_session(&replica, clean).await;
                let _ = wr.shutdown().await;
                return Ok(());
            }
            None => false,
        },
        Err(ConnError::Denied) => {
            // The refusal is queued: deliver it, then close.
            if let Some(mut wr) = drain(&mut writer, drain_signal, cfg.shutdown_grace).await {
                let _ = wr.shutdown().await;
            }
            end_session(&replica, false).await;
            return Err(ConnError::Denied);
        }
        Err(e) => {
            // The stream has no trustworthy framing left: close without answering the rest.
            writer.abort();
            end_session(&replica, false).await;
            return Err(e);
        }
    };
    end_session(&replica, clean).await;
    Ok(())
}

/// Ends a connection that opened no session: every queued reply (a refusal too) is delivered,
/// then the stream closed.
async fn finish(
    writer: JoinHandle<Option<WriteHalf>>,
    result: Result<(), ConnError>,
    conn: Conn<'_>,
) -> Result<(), ConnError> {
    drop(conn);
    if let Ok(Some(mut wr)) = writer.await {
        let _ = wr.shutdown().await;
    }
    result
}

/// Verifies a `Grant` against the CA bundle of the server's current credentials.
fn verify_grant(conn: &Conn<'_>, grant: &[u8]) -> Result<Option<Granted>, Refusal> {
    let Some(credentials) = conn.shared.config.transport.credentials() else { return Ok(None) };
    let anchors = credentials.current().anchors().clone();
    conn.caller.accept_grant(grant, &anchors, SystemTime::now())
}

fn replica_epoch(shared: &Shared, disk: &str, volume_id: &str) -> u64 {
    let described = shared.disks.get(disk).and_then(|node| node.describe(volume_id));
    described.map(|(_, record)| record.epoch).unwrap_or(0)
}

/// Ends one engine session (see [`session::end`]) on the blocking pool: it may fsync.
async fn end_session(replica: &Arc<Replica>, clean: bool) {
    let replica = replica.clone();
    if let Err(e) = tokio::task::spawn_blocking(move || session::end(&replica, clean)).await {
        tracing::error!(error = %e, "ending a replica session panicked");
    }
}

/// Serves a control connection: control requests one at a time until end of stream, an idle
/// timeout, or a refused request.
async fn serve_control(first: Frame, reader: &mut Reader, conn: &Conn<'_>) -> Result<(), ConnError> {
    let shared = conn.shared;
    let mut next = Some(first);
    while let Some(frame) = next.take() {
        if let Err(why) = conn.caller.may_control(&frame.message) {
            return Err(conn.deny(frame.request_id, &frame.message, why).await);
        }
        let disks = shared.disks.clone();
        let request_id = frame.request_id;
        let message = match frame.message {
            Message::EngineCall { volume_id, request } => engine_call(shared, volume_id, request).await,
            Message::Identify => Message::Identity {
                status: Status::Ok,
                node: shared.config.identity.node.clone(),
                labels: shared.config.identity.labels.clone(),
            },
            message => {
                tokio::task::spawn_blocking(move || execute_control(&disks, message)).await.unwrap_or_else(|e| {
                    tracing::error!(error = %e, "replica control request panicked");
                    Message::Reply { status: Status::IoError }
                })
            }
        };
        if conn.tx.send(Frame { request_id, message }).await.is_err() {
            return Ok(());
        }
        next = reader.next_within(shared.config.idle_timeout).await?;
        if let Some(f) = &next
            && !is_control(&f.message)
        {
            return Err(ConnError::Unexpected("a control connection sent a non-control request"));
        }
    }
    Ok(())
}

/// Whether a message is a control request (see the module docs).
fn is_control(m: &Message) -> bool {
    matches!(
        m,
        Message::CreateReplica { .. }
            | Message::CreateReplicaOn { .. }
            | Message::DeleteReplica { .. }
            | Message::NodeInfo
            | Message::ListDisks
            | Message::Describe { .. }
            | Message::SetRecord { .. }
            | Message::Identify
            | Message::EngineCall { .. }
    )
}

/// Answers an `EngineCall` from the engines of this process.
async fn engine_call(shared: &Shared, volume_id: String, request: Vec<u8>) -> Message {
    let result = match &shared.engines {
        Some(engines) => engines.call(volume_id, request).await,
        None => Err(Status::NotFound),
    };
    match result {
        Ok(reply) => Message::EngineReply { status: Status::Ok, reply },
        Err(status) => Message::EngineReply { status, reply: Vec::new() },
    }
}

/// Runs one control request against the node's disks and builds its reply. A request naming a
/// replica goes to the disk it names.
fn execute_control(disks: &ReplicaDisks, request: Message) -> Message {
    let reply = |r: Result<(), NodeError>, what: &str, volume_id: &str| {
        let status = match r {
            Ok(()) => Status::Ok,
            Err(e) => {
                let status = e.status();
                match status {
                    Status::NotFound
                    | Status::AlreadyExists
                    | Status::Busy
                    | Status::Invalid
                    | Status::StaleRevision => {
                        tracing::info!(replica.volume = volume_id, error = %e, "replica {what} refused")
                    }
                    _ => tracing::warn!(replica.volume = volume_id, error = %e, "replica {what} failed"),
                }
                status
            }
        };
        Message::Reply { status }
    };
    match request {
        Message::CreateReplica { volume_id, size } => {
            let _span = tracing::info_span!(
                "replica.create",
                replica.volume = %volume_id,
                size,
            )
            .entered();
            reply(disks.create_replica(DEFAULT_DISK, &volume_id, size).map(|_| ()), "create", &volume_id)
        }
        Message::CreateReplicaOn { disk, volume_id, size } => {
            let _span = tracing::info_span!(
                "replica.create",
                replica.volume = %volume_id,
                replica.disk = %disk,
                size,
            )
            .entered();
            reply(disks.create_replica(&disk, &volume_id, size).map(|_| ()), "create", &volume_id)
        }
        Message::ListDisks => match disks.report() {
            Ok(reports) => Message::DiskList {
                status: Status::Ok,
                disks: reports
                    .into_iter()
                    .map(|d| DiskSummary {
                        name: d.name,
                        capacity: d.report.capacity,
                        available: d.report.available,
                        volumes: d.report.replicas.into_iter().map(|r| r.volume_id).collect(),
                    })
                    .collect(),
            },
            Err(e) => {
                tracing::warn!(error = %e, "replica disk list failed");
                Message::DiskList { status: e.status(), disks: Vec::new() }
            }
        },
        Message::DeleteReplica { volume_id, disk } => {
            let _span = tracing::info_span!(
                "replica.delete",
                replica.volume = %volume_id,
                replica.disk = %disk,
            )
            .entered();
            reply(disks.get(&disk).and_then(|node| node.delete_replica(&volume_id)), "delete", &volume_id)
        }
        // Every disk's replicas, and their space summed: what the server holds, for a client
        // that does not know disks (and for finding a volume's holders).
        Message::NodeInfo => match disks.report() {
            Ok(reports) => Message::NodeInfoReply {
                status: Status::Ok,
                capacity: reports.iter().map(|d| d.report.capacity).fold(0, u64::saturating_add),
                available: reports.iter().map(|d| d.report.available).fold(0, u64::saturating_add),
                replicas: reports.into_iter().flat_map(|d| d.report.replicas).collect(),
            },
            Err(e) => {
                tracing::warn!(error = %e, "replica node info failed");
                Message::NodeInfoReply { status: e.status(), capacity: 0, available: 0, replicas: Vec::new() }
            }
        },
        Message::Describe { volume_id, disk } => match disks.get(&disk).and_then(|node| node.describe(&volume_id)) {
            Ok((header, record)) => Message::Description { status: Status::Ok, header, record },
            Err(e) => {
                if e.status() != Status::NotFound {
                    tracing::warn!(replica.volume = %volume_id, error = %e, "replica describe failed");
                }
                let header = ReplicaHeader { volume_id, size: 0, revision: 0, snapshots: Vec::new(), dirty: false };
                Message::Description { status: e.status(), header, record: RecordInfo::default() }
            }
        },
        Message::SetRecord { volume_id, version, epoch, data, disk } => {
            let _span =
                tracing::info_span!("replica.set_record", replica.volume = %volume_id, replica.disk = %disk, version, epoch)
                    .entered();
            let record = RecordInfo { version, epoch, data };
            reply(disks.get(&disk).and_then(|node| node.set_record(&volume_id, record)), "record update", &volume_id)
        }
        _ => Message::Reply { status: Status::Invalid },
    }
}
