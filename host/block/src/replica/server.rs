//! Serves every replica of a [`ReplicaNode`] over TCP with the replica protocol: one listener per
//! node. A connection is either an engine session or a control connection, decided by its first
//! frame. An engine's first frame is `Hello`, which picks the replica by volume id (answered with
//! its header, `NotFound` for a volume this node does not hold); then requests are pipelined —
//! each runs as soon as it is read (small writes inline on the connection task, everything else
//! on the blocking pool, see `dispatch`) and its reply is written when it is done, so replies
//! leave in completion order, matched by request id. The protocol lets a replica do
//! that because the engine never has overlapping writes in flight on one connection; `Flush`
//! covers every write *acknowledged* before it arrived, and a write is only acknowledged after its
//! `pwrite` returned, so a flush needs no barrier. A control connection starts with a control
//! request instead (`CreateReplica`, `DeleteReplica`, `NodeInfo`, `Describe`, `SetRecord`,
//! `Identify`, `EngineCall`) and may send only those, answered one at a time. `EngineCall`s go to
//! the engines running in this server's process ([`EngineCalls`]), when it was given them.
//!
//! Backpressure: at most [`ServerConfig::max_in_flight`] requests per connection are executing or
//! waiting for their reply to be written; beyond that the server stops reading the socket, so a
//! fast engine fills its TCP window instead of the replica's memory.
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
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};

use super::error::StoreError;
use super::node::{NodeError, Replica, ReplicaNode};
use super::session::{self, Placement};
use crate::protocol::{
    DEFAULT_MAX_PAYLOAD, DecodeError, Frame, FrameDecoder, Message, RecordInfo, ReplicaHeader, Status,
    encode_with_limit,
};

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

/// Per-connection limits, and who the server is.
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
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            max_in_flight: 64,
            max_payload: DEFAULT_MAX_PAYLOAD,
            shutdown_grace: Duration::from_secs(5),
            identity: NodeIdentity::default(),
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
}

/// Why one connection ended early; logged, never propagated past the connection.
#[derive(Debug, Error)]
enum ConnError {
    #[error("reading: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Decode(#[from] DecodeError),
    #[error("protocol: {0}")]
    Unexpected(&'static str),
}

/// A running replica server. Dropping it shuts the server down in the background, like
/// [`ReplicaServer::shutdown`] without waiting for it.
#[derive(Debug)]
pub struct ReplicaServer {
    local_addr: SocketAddr,
    node: Arc<ReplicaNode>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// Shared by the accept loop and every connection.
struct Shared {
    node: Arc<ReplicaNode>,
    config: ServerConfig,
    engines: Option<Arc<dyn EngineCalls>>,
}

impl ReplicaServer {
    /// Opens every replica under `root` (created if missing) and serves them on `addr` (port 0
    /// picks a free port; see [`ReplicaServer::local_addr`]).
    pub async fn bind(addr: impl ToSocketAddrs, root: &Path) -> Result<Self, ServerError> {
        let root = root.to_path_buf();
        let node = tokio::task::spawn_blocking(move || ReplicaNode::open(&root)).await??;
        Self::serve(addr, Arc::new(node), ServerConfig::default()).await
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
        Self::serve_listener(listener, node, config, engines)
    }

    /// Like [`ReplicaServer::serve_with_engines`] on a socket bound already (one a data path
    /// inherited from the process it took over from).
    pub async fn serve_on_listener(
        listener: std::net::TcpListener,
        node: Arc<ReplicaNode>,
        config: ServerConfig,
        engines: Option<Arc<dyn EngineCalls>>,
    ) -> Result<Self, ServerError> {
        listener.set_nonblocking(true).map_err(ServerError::Bind)?;
        let listener = TcpListener::from_std(listener).map_err(ServerError::Bind)?;
        Self::serve_listener(listener, node, config, engines)
    }

    fn serve_listener(
        listener: TcpListener,
        node: Arc<ReplicaNode>,
        config: ServerConfig,
        engines: Option<Arc<dyn EngineCalls>>,
    ) -> Result<Self, ServerError> {
        let local_addr = listener.local_addr().map_err(ServerError::Bind)?;
        let (shutdown, rx) = watch::channel(false);
        let shared = Arc::new(Shared { node: node.clone(), config, engines });
        let task = tokio::spawn(accept_loop(listener, shared, rx));
        tracing::info!(replica.addr = %local_addr, replica.root = %node.root().display(), "replica node serving");
        Ok(Self { local_addr, node, shutdown, task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The replicas this server serves (create, delete and inspect them directly).
    pub fn node(&self) -> &Arc<ReplicaNode> {
        &self.node
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

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut shutdown: watch::Receiver<bool>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    // Small frames (replies) must not wait for Nagle.
                    let _ = stream.set_nodelay(true);
                    connections.spawn(connection(stream, peer, shared.clone(), shutdown.clone()));
                }
                // Per-connection failures (e.g. EMFILE, a reset before accept) must not stop the
                // listener; back off briefly so a persistent one does not spin.
                Err(e) => {
                    tracing::warn!(error = %e, "replica accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
}

async fn connection(stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>, shutdown: watch::Receiver<bool>) {
    match serve_connection(stream, &shared, shutdown).await {
        Ok(()) => tracing::debug!(replica.peer = %peer, "replica connection closed"),
        Err(e) => tracing::warn!(replica.peer = %peer, error = %e, "replica connection dropped"),
    }
}

/// Reads frames off one connection.
struct Reader {
    rd: OwnedReadHalf,
    decoder: FrameDecoder,
    shutdown: watch::Receiver<bool>,
}

impl Reader {
    /// The next frame; `None` on end of stream or server shutdown.
    async fn next(&mut self) -> Result<Option<Frame>, ConnError> {
        loop {
            if let Some(frame) = self.decoder.next_frame()? {
                return Ok(Some(frame));
            }
            if *self.shutdown.borrow() {
                return Ok(None);
            }
            // `read_buf` is cancel safe: a read either landed in the decoder or did not happen.
            let mut room = self.decoder.read_buffer();
            let n = tokio::select! {
                n = self.rd.read_buf(&mut room) => n?,
                _ = self.shutdown.changed() => return Ok(None),
            };
            if n == 0 {
                return Ok(None);
            }
        }
    }

    /// The next frame already buffered, without reading the socket.
    fn buffered(&mut self) -> Result<Option<Frame>, ConnError> {
        Ok(self.decoder.next_frame()?)
    }
}

async fn serve_connection(
    stream: TcpStream,
    shared: &Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) -> Result<(), ConnError> {
    let cfg = &shared.config;
    let (rd, wr) = stream.into_split();
    let drain_signal = shutdown.clone();
    let mut reader = Reader { rd, decoder: FrameDecoder::new(cfg.max_payload), shutdown };
    let (tx, rx) = mpsc::channel::<Frame>(cfg.max_in_flight.max(1));
    let mut writer = tokio::spawn(write_loop(wr, rx, cfg.max_payload));

    let Some(first) = reader.next().await? else { return Ok(()) };
    let (request_id, volume_id, protocol_version) = match first.message {
        Message::Hello { volume_id, protocol_version, .. } => (first.request_id, volume_id, protocol_version),
        ref m if is_control(m) => {
            let result = serve_control(first, &mut reader, shared, &tx).await;
            drop(tx);
            let _ = writer.await;
            return result;
        }
        _ => {
            writer.abort();
            return Err(ConnError::Unexpected("first frame is neither Hello nor a control request"));
        }
    };
    let node = shared.node.clone();
    let opened = tokio::task::spawn_blocking(move || session::open(&node, volume_id, protocol_version)).await;
    let (replica, status, header) = match opened {
        Ok(opened) => opened,
        Err(e) => {
            tracing::error!(error = %e, "replica hello panicked");
            writer.abort();
            return Err(ConnError::Unexpected("hello failed"));
        }
    };
    // The reply carries the header as it was before this session marked it dirty, so the engine
    // sees whether the previous one ended cleanly.
    let _ = tx.send(Frame { request_id, message: Message::HelloReply { status, header } }).await;
    let Some(replica) = replica else {
        drop(tx);
        let _ = writer.await;
        return Ok(());
    };

    let result = serve_requests(&mut reader, shared, &replica, &tx).await;
    drop(tx);
    let clean = match result {
        // Every request task holds a sender; the writer ends once all replies are out.
        Ok(clean) => match drain(&mut writer, drain_signal, cfg.shutdown_grace).await {
            Some(wr) => {
                // The end of the stream is sent only after the session ended (dirty flag
                // cleared), so a peer that waits for it knows the replica is clean.
                end_session(&replica, clean).await;
                let mut wr = wr;
                let _ = wr.shutdown().await;
                return Ok(());
            }
            None => false,
        },
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

/// Ends one engine session (see [`session::end`]) on the blocking pool: it may fsync.
async fn end_session(replica: &Arc<Replica>, clean: bool) {
    let replica = replica.clone();
    if let Err(e) = tokio::task::spawn_blocking(move || session::end(&replica, clean)).await {
        tracing::error!(error = %e, "ending a replica session panicked");
    }
}

/// Serves a control connection: control requests one at a time until end of stream.
async fn serve_control(
    first: Frame,
    reader: &mut Reader,
    shared: &Arc<Shared>,
    tx: &mpsc::Sender<Frame>,
) -> Result<(), ConnError> {
    let mut next = Some(first);
    while let Some(frame) = next.take() {
        let node = shared.node.clone();
        let request_id = frame.request_id;
        let message = match frame.message {
            Message::EngineCall { volume_id, request } => engine_call(shared, volume_id, request).await,
            Message::Identify => Message::Identity {
                status: Status::Ok,
                node: shared.config.identity.node.clone(),
                labels: shared.config.identity.labels.clone(),
            },
            message => tokio::task::spawn_blocking(move || execute_control(&node, message)).await.unwrap_or_else(|e| {
                tracing::error!(error = %e, "replica control request panicked");
                Message::Reply { status: Status::IoError }
            }),
        };
        if tx.send(Frame { request_id, message }).await.is_err() {
            return Ok(());
        }
        next = reader.next().await?;
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
            | Message::DeleteReplica { .. }
            | Message::NodeInfo
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

/// Runs one control request against the node and builds its reply.
fn execute_control(node: &ReplicaNode, request: Message) -> Message {
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
            reply(node.create_replica(&volume_id, size).map(|_| ()), "create", &volume_id)
        }
        Message::DeleteReplica { volume_id } => {
            let _span = tracing::info_span!(
                "replica.delete",
                replica.volume = %volume_id,
            )
            .entered();
            reply(node.delete_replica(&volume_id), "delete", &volume_id)
        }
        Message::NodeInfo => match node.report() {
            Ok(r) => Message::NodeInfoReply {
                status: Status::Ok,
                capacity: r.capacity,
                available: r.available,
                replicas: r.replicas,
            },
            Err(e) => {
                tracing::warn!(error = %e, "replica node info failed");
                Message::NodeInfoReply { status: e.status(), capacity: 0, available: 0, replicas: Vec::new() }
            }
        },
        Message::Describe { volume_id } => match node.describe(&volume_id) {
            Ok((header, record)) => Message::Description { status: Status::Ok, header, record },
            Err(e) => {
                if e.status() != Status::NotFound {
                    tracing::warn!(replica.volume = %volume_id, error = %e, "replica describe failed");
                }
                let header = ReplicaHeader { volume_id, size: 0, revision: 0, snapshots: Vec::new(), dirty: false };
                Message::Description { status: e.status(), header, record: RecordInfo::default() }
            }
        },
        Message::SetRecord { volume_id, version, epoch, data } => {
            let _span =
                tracing::info_span!("replica.set_record", replica.volume = %volume_id, version, epoch).entered();
            reply(node.set_record(&volume_id, RecordInfo { version, epoch, data }), "record update", &volume_id)
        }
        _ => Message::Reply { status: Status::Invalid },
    }
}

/// Waits for the writer to deliver every queued reply; false if it failed or if the server is
/// shutting down and the grace period ran out first (the writer is then aborted).
async fn drain(
    writer: &mut JoinHandle<Option<OwnedWriteHalf>>,
    mut shutdown: watch::Receiver<bool>,
    grace: Duration,
) -> Option<OwnedWriteHalf> {
    let deadline = async {
        // Err: the server handle is gone, which is a shutdown too.
        let _ = shutdown.wait_for(|stop| *stop).await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        delivered = &mut *writer => delivered.ok().flatten(),
        () = deadline => {
            writer.abort();
            None
        }
    }
}

/// Small reads run back to back on one blocking thread, this many per thread.
const SMALL_PER_TASK: usize = 8;
/// Most requests taken off the socket before they are dispatched.
const MAX_BATCH: usize = 64;

/// One request read and admitted (it holds its in-flight permit).
struct Admitted {
    frame: Frame,
    mutation: bool,
    permit: OwnedSemaphorePermit,
}

/// Pipelines requests until end of stream; returns whether the engine left cleanly (see the
/// module docs).
///
/// Every request that is already buffered when one is read is taken too (while permits last),
/// and small reads and writes of that batch run a few at a time per blocking task: a 4 KiB
/// request costs microseconds, a pool hop and its wakeups cost as much again.
async fn serve_requests(
    reader: &mut Reader,
    shared: &Arc<Shared>,
    replica: &Arc<Replica>,
    tx: &mpsc::Sender<Frame>,
) -> Result<bool, ConnError> {
    let max = shared.config.max_in_flight.max(1);
    let permits = Arc::new(Semaphore::new(max));
    let rules = Arc::new(session::Session::default());
    let mutations_in_flight = Arc::new(AtomicUsize::new(0));
    let mut clean = false;
    let max_payload = shared.config.max_payload;
    // No waiting at the end for started requests: each holds a reply sender, so on a clean end
    // the caller's wait for the writer is the wait for them, and on an error the caller closes
    // the writer, which also unblocks any request stuck queueing its reply for a peer not reading.
    loop {
        // Taking the permit before reading is the backpressure: no permit, no read.
        // Shutdown must not wait for a permit: a peer that stopped reading holds them all.
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break Ok(clean),
            },
            _ = reader.shutdown.wait_for(|stop| *stop) => break Ok(false),
        };
        let mut next = match reader.next().await {
            Ok(Some(frame)) => Some((frame, permit)),
            Ok(None) => break Ok(clean),
            Err(e) => break Err(e),
        };
        let mut batch = Vec::new();
        let mut failure = None;
        while let Some((frame, permit)) = next.take() {
            let Some(mutation) = session::classify(&frame.message) else {
                failure = Some(ConnError::Unexpected("not a request after Hello"));
                break;
            };
            clean = matches!(frame.message, Message::Flush) && mutations_in_flight.load(Ordering::SeqCst) == 0;
            if mutation {
                mutations_in_flight.fetch_add(1, Ordering::SeqCst);
            }
            batch.push(Admitted { frame, mutation, permit });
            if batch.len() >= MAX_BATCH {
                break;
            }
            let Ok(permit) = permits.clone().try_acquire_owned() else { break };
            match reader.buffered() {
                Ok(Some(frame)) => next = Some((frame, permit)),
                Ok(None) => {}
                Err(e) => failure = Some(e),
            }
        }
        dispatch(batch, replica, &rules, tx, &mutations_in_flight, max_payload).await;
        if let Some(e) = failure {
            break Err(e);
        }
    }
}

/// Runs a batch of admitted requests: small writes right here on the connection task (a
/// buffered 4 KiB write costs a few microseconds; a hop to the blocking pool and back costs two
/// thread wakeups), and so are small reads the page cache holds (tried without waiting for the
/// disk, `RWF_NOWAIT`); everything else on the blocking pool — other small reads a few per task
/// (they wait for the disk, which must not stall the runtime), the rest one per task (a
/// flush or a large write must not hold up the others). The engine never has overlapping
/// requests in flight, so their order among each other does not matter.
async fn dispatch(
    batch: Vec<Admitted>,
    replica: &Arc<Replica>,
    rules: &Arc<session::Session>,
    tx: &mpsc::Sender<Frame>,
    inflight: &Arc<AtomicUsize>,
    max_payload: usize,
) {
    let mut inline = Vec::new();
    let mut reads = Vec::new();
    let mut cached = Vec::new();
    let mut tasks: Vec<Vec<Admitted>> = Vec::new();
    for a in batch {
        match session::place(replica, &a.frame.message) {
            Placement::Inline => inline.push(a),
            Placement::Answered(message) => cached.push((a, message)),
            Placement::SmallRead => reads.push(a),
            Placement::Blocking => tasks.push(vec![a]),
        }
    }
    let mut reads = reads.into_iter().peekable();
    while reads.peek().is_some() {
        tasks.push(reads.by_ref().take(SMALL_PER_TASK).collect());
    }
    // The pool starts on its share first, so disk reads overlap with the inline writes.
    for task in tasks {
        let (replica, rules, tx, inflight) = (replica.clone(), rules.clone(), tx.clone(), inflight.clone());
        tokio::task::spawn_blocking(move || {
            for Admitted { frame, mutation, permit } in task {
                let message = session::execute(&replica, &rules, frame.message, max_payload);
                if mutation {
                    inflight.fetch_sub(1, Ordering::SeqCst);
                }
                // A closed channel means the connection is gone; the reply has nowhere to go.
                let _ = tx.blocking_send(Frame { request_id: frame.request_id, message });
                drop(permit);
            }
        });
    }
    for (Admitted { frame, mutation, permit }, message) in cached {
        debug_assert!(!mutation, "a read is not a mutation");
        let _ = tx.send(Frame { request_id: frame.request_id, message }).await;
        drop(permit);
    }
    for Admitted { frame, mutation, permit } in inline {
        let message = session::execute(replica, rules, frame.message, max_payload);
        if mutation {
            inflight.fetch_sub(1, Ordering::SeqCst);
        }
        let _ = tx.send(Frame { request_id: frame.request_id, message }).await;
        drop(permit);
    }
}

/// Writes replies in the order they complete, coalescing whatever is queued into one write;
/// true once every reply was written and the stream closed.
/// Writes replies until every sender is gone; returns the write half (still open) when all were
/// delivered, `None` on a failure.
async fn write_loop(
    mut wr: OwnedWriteHalf,
    mut rx: mpsc::Receiver<Frame>,
    max_payload: usize,
) -> Option<OwnedWriteHalf> {
    let mut out = Vec::with_capacity(256 * 1024);
    while let Some(frame) = rx.recv().await {
        out.clear();
        let mut next = Some(frame);
        while let Some(frame) = next.take() {
            if let Err(e) = encode_with_limit(&frame, &mut out, max_payload) {
                // Execute never builds an oversized reply; if it did, the engine would wait
                // forever for this id, so failing the connection is the honest answer.
                tracing::error!(error = %e, request_id = frame.request_id, "replica reply not encodable");
                return None;
            }
            if out.len() < 1024 * 1024 {
                next = rx.try_recv().ok();
            }
        }
        if let Err(e) = wr.write_all(&out).await {
            tracing::debug!(error = %e, "replica connection write failed");
            return None;
        }
    }
    Some(wr)
}
