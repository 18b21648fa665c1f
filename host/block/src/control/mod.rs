//! The control surface of the replicated block data path: what the CLI and, later, the
//! `replicated-block` component's `block` capability call to manage replica sets — create and
//! delete replicas on nodes, list nodes with their free space, and the operations on a volume
//! that is *not attached* (snapshot, delete a snapshot, revert, expand, clone from a snapshot).
//! While a volume is attached its engine owns the replicas; the same operations then go through
//! the engine ([`crate::volume::ReplicatedVolume`]) so they are ordered with client I/O.
//!
//! Every call has a deadline: an unreachable node fails with [`ControlError::Unreachable`] or
//! [`ControlError::Timeout`] naming the address, never hangs. Requests are idempotent the way
//! the protocol makes them (creating an existing replica of the same size, deleting a missing
//! one, deleting a missing snapshot all succeed), so a caller may retry after any failure.
//!
//! Every connection travels as its [`Transport`] says: plaintext, or mutual TLS with the
//! caller's credentials (the controller's; a node's for its read-only discovery), checking that
//! the server is who the caller expects. A request the server's authorization refuses fails
//! with [`ControlError::Denied`], which callers map to PERMISSION_DENIED.
//!
//! Offline operations (on a [`ReplicaSet`], in `replica_set`) refuse a replica set whose
//! members disagree (different revision, size or snapshot chain, or a replica left dirty by a
//! crashed engine): changing such a set by hand could make a stale replica look current.
//! Attaching the volume lets the engine rebuild first.

use std::net::SocketAddr;
use std::time::Duration;

use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use wasmcsi_trust::ExpectedRole;

mod replica_set;

pub use replica_set::ReplicaSet;

use crate::protocol::{
    DEFAULT_DISK, DEFAULT_MAX_PAYLOAD, DiskSummary, Extent, Frame, FrameDecoder, Message, PROTOCOL_VERSION, RecordInfo,
    ReplicaHeader, ReplicaSummary, Status, encode,
};
use crate::replica::NodeIdentity;
use crate::transport::{self, ClientStream, DialError, Transport};

/// Bytes moved per request when copying a volume (clone): one frame each way.
pub const COPY_CHUNK: u64 = 1 << 20;
/// Bytes of the volume covered by one `ListSnapshotExtents` request, so the reply fits a frame.
pub(crate) const EXTENT_WINDOW: u64 = 64 << 30;

#[derive(Debug, Error)]
pub enum ControlError {
    #[error("replica server {addr} is unreachable: {source}")]
    Unreachable {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("replica server {addr} did not answer {what} within {timeout:?}")]
    Timeout { addr: SocketAddr, what: &'static str, timeout: Duration },
    #[error("replica server {addr}: connection failed during {what}: {detail}")]
    Connection { addr: SocketAddr, what: &'static str, detail: String },
    #[error("replica server {addr} refused {what}: {status:?}")]
    Refused { addr: SocketAddr, what: &'static str, status: Status },
    /// The server's authorization refused the request (`Denied`): this caller's role may not
    /// make it (a node asking for what is the controller's), or its grant does not open the
    /// session. Asking again as the same caller changes nothing.
    #[error("replica server {addr} denied {what} to this caller")]
    Denied { addr: SocketAddr, what: &'static str },
    /// TLS failed: the handshake, or the server is not who the caller expects.
    #[error("replica server {addr}: {detail}")]
    Tls { addr: SocketAddr, detail: String },
    #[error("replica server {addr} answered {what} with an unexpected message")]
    Protocol { addr: SocketAddr, what: &'static str },
    #[error("replicas of {volume_id} disagree, refusing to change them by hand: {detail}")]
    NotInSync { volume_id: String, detail: String },
    #[error("invalid request: {0}")]
    Invalid(String),
}

impl ControlError {
    /// The status a replica refused with, if that is what happened.
    pub fn status(&self) -> Option<Status> {
        match self {
            Self::Refused { status, .. } => Some(*status),
            Self::Denied { .. } => Some(Status::Denied),
            _ => None,
        }
    }

    /// The error of a reply with `status` (not `Ok`): [`Self::Denied`] for `Denied`.
    fn refused(addr: SocketAddr, what: &'static str, status: Status) -> Self {
        match status {
            Status::Denied => Self::Denied { addr, what },
            status => Self::Refused { addr, what, status },
        }
    }
}

/// One request/response connection to a replica server (control traffic is not pipelined).
struct Conn {
    addr: SocketAddr,
    stream: ClientStream,
    decoder: FrameDecoder,
    next_id: u64,
    timeout: Duration,
    buf: Vec<u8>,
    /// One request, one answer: the stream is ended once the answer is in ([`Self::once`]).
    once: bool,
}

impl Conn {
    /// A connection for one request: after its answer the client ends the stream (over TLS a
    /// close_notify first), so the server reads a clean end rather than a truncated one.
    async fn once(addr: SocketAddr, timeout: Duration, reach: &Reach) -> Result<Self, ControlError> {
        let mut conn = Self::connect(addr, timeout, reach).await?;
        conn.once = true;
        Ok(conn)
    }

    async fn connect(addr: SocketAddr, timeout: Duration, reach: &Reach) -> Result<Self, ControlError> {
        let stream = match transport::dial(addr, &reach.transport, &reach.server, timeout).await {
            Ok(dialed) => dialed.stream,
            Err(DialError::Unreachable(source)) => return Err(ControlError::Unreachable { addr, source }),
            Err(DialError::TimedOut(_)) => return Err(ControlError::Timeout { addr, what: "connect", timeout }),
            Err(e) => return Err(ControlError::Tls { addr, detail: e.to_string() }),
        };
        Ok(Self {
            addr,
            stream,
            decoder: FrameDecoder::new(DEFAULT_MAX_PAYLOAD),
            next_id: 1,
            timeout,
            buf: vec![0; 256 << 10],
            once: false,
        })
    }

    async fn call(&mut self, what: &'static str, message: Message) -> Result<Message, ControlError> {
        let (addr, timeout) = (self.addr, self.timeout);
        let answer = match tokio::time::timeout(timeout, self.exchange(what, message)).await {
            Ok(result) => result,
            Err(_) => Err(ControlError::Timeout { addr, what, timeout }),
        };
        if self.once {
            // Best effort: the answer is in, and dropping the stream ends it anyway.
            let _ = tokio::time::timeout(timeout, self.stream.shutdown()).await;
        }
        answer
    }

    async fn exchange(&mut self, what: &'static str, message: Message) -> Result<Message, ControlError> {
        let addr = self.addr;
        let request_id = self.next_id;
        self.next_id += 1;
        let mut out = Vec::new();
        encode(&Frame { request_id, message }, &mut out).map_err(|e| ControlError::Invalid(e.to_string()))?;
        let conn_err = |detail: String| ControlError::Connection { addr, what, detail };
        self.stream.write_all(&out).await.map_err(|e| conn_err(e.to_string()))?;
        self.stream.flush().await.map_err(|e| conn_err(e.to_string()))?;
        loop {
            match self.decoder.next_frame() {
                Ok(Some(frame)) if frame.request_id == request_id => return Ok(frame.message),
                Ok(Some(_)) => return Err(ControlError::Protocol { addr, what }),
                Ok(None) => {}
                Err(e) => return Err(conn_err(e.to_string())),
            }
            let n = self.stream.read(&mut self.buf).await.map_err(|e| conn_err(e.to_string()))?;
            if n == 0 {
                return Err(conn_err("closed by the server".into()));
            }
            self.decoder.push(&self.buf[..n]);
        }
    }

    /// Sends a request answered by `Reply`; `Ok` or one of `accept` is success.
    async fn reply(&mut self, what: &'static str, message: Message, accept: &[Status]) -> Result<(), ControlError> {
        match self.call(what, message).await? {
            Message::Reply { status: Status::Ok } => Ok(()),
            Message::Reply { status } if accept.contains(&status) => Ok(()),
            Message::Reply { status } => Err(ControlError::refused(self.addr, what, status)),
            _ => Err(ControlError::Protocol { addr: self.addr, what }),
        }
    }
}

/// How a client reaches replica servers: over what, and who the server must be (TLS).
#[derive(Debug, Clone)]
pub struct Reach {
    pub transport: Transport,
    pub server: ExpectedRole,
}

impl Reach {
    /// Plaintext (`--tls-mode off`).
    pub fn plaintext() -> Self {
        Self { transport: Transport::Plain, server: ExpectedRole::AnyNode }
    }

    /// Over `transport`, to any node of the cluster (a server reached by its address).
    pub fn any_node(transport: Transport) -> Self {
        Self { transport, server: ExpectedRole::AnyNode }
    }
}

/// What a replica server reports about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub addr: SocketAddr,
    pub capacity: u64,
    pub available: u64,
    pub replicas: Vec<ReplicaSummary>,
}

/// Control requests to one replica server (a "node" of the data path).
#[derive(Debug, Clone)]
pub struct ReplicaServerClient {
    pub addr: SocketAddr,
    pub timeout: Duration,
    pub reach: Reach,
}

impl ReplicaServerClient {
    /// A plaintext client (`--tls-mode off`).
    pub fn new(addr: SocketAddr, timeout: Duration) -> Self {
        Self { addr, timeout, reach: Reach::plaintext() }
    }

    /// A client reaching the server as `reach` says.
    pub fn over(addr: SocketAddr, timeout: Duration, reach: Reach) -> Self {
        Self { addr, timeout, reach }
    }

    /// Creates an empty replica; succeeds if one of the same size exists (a retry).
    pub async fn create_replica(&self, volume_id: &str, size: u64) -> Result<(), ControlError> {
        let mut c = Conn::once(self.addr, self.timeout, &self.reach).await?;
        let message = Message::CreateReplica { volume_id: volume_id.to_owned(), size };
        c.reply("CreateReplica", message, &[]).await
    }

    /// Creates an empty replica on the server's disk `disk` (see `CreateReplicaOn`); the disk
    /// `default` is asked with `CreateReplica`, which every server understands.
    pub async fn create_replica_on(&self, disk: &str, volume_id: &str, size: u64) -> Result<(), ControlError> {
        if disk == DEFAULT_DISK {
            return self.create_replica(volume_id, size).await;
        }
        let mut c = Conn::connect(self.addr, self.timeout, &self.reach).await?;
        let message = Message::CreateReplicaOn { disk: disk.to_owned(), volume_id: volume_id.to_owned(), size };
        c.reply("CreateReplicaOn", message, &[]).await
    }

    /// The server's disks, their space and the volumes each holds a replica of.
    pub async fn disks(&self) -> Result<Vec<DiskSummary>, ControlError> {
        let mut c = Conn::connect(self.addr, self.timeout, &self.reach).await?;
        match c.call("ListDisks", Message::ListDisks).await? {
            Message::DiskList { status: Status::Ok, disks } => Ok(disks),
            Message::DiskList { status, .. } => Err(ControlError::refused(self.addr, "ListDisks", status)),
            _ => Err(ControlError::Protocol { addr: self.addr, what: "ListDisks" }),
        }
    }

    /// Deletes the replica on the disk `default` and its files; succeeds if it is already gone
    /// (a retry).
    pub async fn delete_replica(&self, volume_id: &str) -> Result<(), ControlError> {
        self.delete_replica_on(DEFAULT_DISK, volume_id).await
    }

    /// Deletes the replica of `volume_id` on the server's disk `disk`, like
    /// [`Self::delete_replica`].
    pub async fn delete_replica_on(&self, disk: &str, volume_id: &str) -> Result<(), ControlError> {
        let mut c = Conn::once(self.addr, self.timeout, &self.reach).await?;
        let message = Message::DeleteReplica { volume_id: volume_id.to_owned(), disk: disk.to_owned() };
        c.reply("DeleteReplica", message, &[Status::NotFound]).await
    }

    pub async fn node_info(&self) -> Result<NodeInfo, ControlError> {
        let mut c = Conn::once(self.addr, self.timeout, &self.reach).await?;
        match c.call("NodeInfo", Message::NodeInfo).await? {
            Message::NodeInfoReply { status: Status::Ok, capacity, available, replicas } => {
                Ok(NodeInfo { addr: self.addr, capacity, available, replicas })
            }
            Message::NodeInfoReply { status, .. } => Err(ControlError::refused(self.addr, "NodeInfo", status)),
            _ => Err(ControlError::Protocol { addr: self.addr, what: "NodeInfo" }),
        }
    }

    /// Who the server is (its node name and labels).
    pub async fn identify(&self) -> Result<NodeIdentity, ControlError> {
        let mut c = Conn::once(self.addr, self.timeout, &self.reach).await?;
        match c.call("Identify", Message::Identify).await? {
            Message::Identity { status: Status::Ok, node, labels } => Ok(NodeIdentity { node, labels }),
            Message::Identity { status, .. } => Err(ControlError::refused(self.addr, "Identify", status)),
            _ => Err(ControlError::Protocol { addr: self.addr, what: "Identify" }),
        }
    }

    /// The header and volume record of the replica of `volume_id` on this server's disk
    /// `default`, without opening a session (the dirty flag and sessions stay as they are).
    pub async fn describe(&self, volume_id: &str) -> Result<(ReplicaHeader, RecordInfo), ControlError> {
        self.describe_on(DEFAULT_DISK, volume_id).await
    }

    /// Like [`Self::describe`], the replica on the server's disk `disk`.
    pub async fn describe_on(&self, disk: &str, volume_id: &str) -> Result<(ReplicaHeader, RecordInfo), ControlError> {
        let mut c = Conn::once(self.addr, self.timeout, &self.reach).await?;
        match c.call("Describe", Message::Describe { volume_id: volume_id.to_owned(), disk: disk.to_owned() }).await? {
            Message::Description { status: Status::Ok, header, record } => Ok((header, record)),
            Message::Description { status, .. } => Err(ControlError::refused(self.addr, "Describe", status)),
            _ => Err(ControlError::Protocol { addr: self.addr, what: "Describe" }),
        }
    }

    /// Replaces the record of the replica of `volume_id` on the disk `default` if `record` is
    /// newer; refused with `StaleRevision` when the replica holds a newer (or conflicting) one.
    pub async fn set_record(&self, volume_id: &str, record: &RecordInfo) -> Result<(), ControlError> {
        self.set_record_on(DEFAULT_DISK, volume_id, record).await
    }

    /// Like [`Self::set_record`], the replica on the server's disk `disk`.
    pub async fn set_record_on(&self, disk: &str, volume_id: &str, record: &RecordInfo) -> Result<(), ControlError> {
        let mut c = Conn::once(self.addr, self.timeout, &self.reach).await?;
        let message = Message::SetRecord {
            volume_id: volume_id.to_owned(),
            version: record.version,
            epoch: record.epoch,
            data: record.data.clone(),
            disk: disk.to_owned(),
        };
        c.reply("SetRecord", message, &[]).await
    }

    /// A request for the engine of `volume_id` running in the server's process.
    pub async fn engine_call(&self, volume_id: &str, request: Vec<u8>) -> Result<Vec<u8>, ControlError> {
        let mut c = Conn::once(self.addr, self.timeout, &self.reach).await?;
        match c.call("EngineCall", Message::EngineCall { volume_id: volume_id.to_owned(), request }).await? {
            Message::EngineReply { status: Status::Ok, reply } => Ok(reply),
            Message::EngineReply { status, .. } => Err(ControlError::refused(self.addr, "EngineCall", status)),
            _ => Err(ControlError::Protocol { addr: self.addr, what: "EngineCall" }),
        }
    }
}

/// A session on one replica (after `Hello`), for offline operations and copies. Close it with
/// [`ReplicaSession::close`]: the final flush is what lets the replica clear its dirty flag.
pub struct ReplicaSession {
    conn: Conn,
    header: ReplicaHeader,
}

impl ReplicaSession {
    /// Connects and says `Hello`; the header is the replica's as it was before this session
    /// (`dirty` set means the previous session did not end cleanly).
    pub async fn open(addr: SocketAddr, volume_id: &str, timeout: Duration) -> Result<Self, ControlError> {
        Self::open_claimed(addr, volume_id, timeout, 0).await
    }

    /// Like [`ReplicaSession::open`], then claims `epoch` (unless 0) as an engine would: the
    /// session is refused (`Fenced`) when the volume was given to a newer epoch.
    pub async fn open_claimed(
        addr: SocketAddr,
        volume_id: &str,
        timeout: Duration,
        epoch: u64,
    ) -> Result<Self, ControlError> {
        Self::open_over(addr, volume_id, timeout, epoch, &Reach::plaintext()).await
    }

    /// Like [`ReplicaSession::open_claimed`], reaching the server as `reach` says (a session
    /// as the controller: a node's needs a grant, which only an engine presents).
    pub async fn open_over(
        addr: SocketAddr,
        volume_id: &str,
        timeout: Duration,
        epoch: u64,
        reach: &Reach,
    ) -> Result<Self, ControlError> {
        Self::open_on(addr, DEFAULT_DISK, volume_id, timeout, epoch, reach).await
    }

    /// Like [`ReplicaSession::open_over`], on the replica on the server's disk `disk`.
    pub async fn open_on(
        addr: SocketAddr,
        disk: &str,
        volume_id: &str,
        timeout: Duration,
        epoch: u64,
        reach: &Reach,
    ) -> Result<Self, ControlError> {
        let mut conn = Conn::connect(addr, timeout, reach).await?;
        let hello = Message::Hello {
            volume_id: volume_id.to_owned(),
            protocol_version: PROTOCOL_VERSION,
            revision: 0,
            disk: disk.to_owned(),
        };
        let header = match conn.call("Hello", hello).await? {
            Message::HelloReply { status: Status::Ok, header } => header,
            Message::HelloReply { status, .. } => return Err(ControlError::refused(addr, "Hello", status)),
            _ => return Err(ControlError::Protocol { addr, what: "Hello" }),
        };
        let mut session = Self { conn, header };
        if epoch > 0
            && let Err(e) = session.conn.reply("Claim", Message::Claim { epoch }, &[]).await
        {
            // Ends the session cleanly: nothing was written.
            let _ = session.close().await;
            return Err(e);
        }
        Ok(session)
    }

    pub fn addr(&self) -> SocketAddr {
        self.conn.addr
    }

    pub fn header(&self) -> &ReplicaHeader {
        &self.header
    }

    pub async fn snapshot(&mut self, name: &str) -> Result<(), ControlError> {
        let revision = self.header.revision;
        self.conn.reply("Snapshot", Message::Snapshot { name: name.to_owned(), revision }, &[]).await
    }

    pub async fn delete_snapshot(&mut self, name: &str) -> Result<(), ControlError> {
        let message = Message::DeleteSnapshot { name: name.to_owned(), revision: self.header.revision };
        self.conn.reply("DeleteSnapshot", message, &[Status::NotFound]).await
    }

    pub async fn revert(&mut self, name: &str) -> Result<(), ControlError> {
        let message = Message::Revert { name: name.to_owned(), revision: self.header.revision };
        self.conn.reply("Revert", message, &[]).await
    }

    /// Records `revision` in the replica's header (it only grows).
    pub async fn set_revision(&mut self, revision: u64) -> Result<(), ControlError> {
        self.conn.reply("SetRevision", Message::SetRevision { revision }, &[]).await?;
        self.header.revision = self.header.revision.max(revision);
        Ok(())
    }

    pub async fn resize(&mut self, size: u64) -> Result<(), ControlError> {
        self.conn.reply("Resize", Message::Resize { size, revision: self.header.revision }, &[]).await
    }

    pub async fn write(&mut self, offset: u64, data: Vec<u8>) -> Result<(), ControlError> {
        self.conn
            .reply("Write", Message::Write { offset, revision: self.header.revision, data: data.into() }, &[])
            .await
    }

    pub async fn flush(&mut self) -> Result<(), ControlError> {
        self.conn.reply("Flush", Message::Flush, &[]).await
    }

    /// Reads the live volume; exactly `len` bytes.
    pub async fn read(&mut self, offset: u64, len: u32) -> Result<Vec<u8>, ControlError> {
        let addr = self.conn.addr;
        match self.conn.call("Read", Message::Read { offset, len }).await? {
            Message::ReadReply { status: Status::Ok, data } if data.len() == len as usize => Ok(data),
            Message::ReadReply { status: Status::Ok, .. } => Err(ControlError::Protocol { addr, what: "Read" }),
            Message::ReadReply { status, .. } => Err(ControlError::Refused { addr, what: "Read", status }),
            _ => Err(ControlError::Protocol { addr, what: "Read" }),
        }
    }

    /// Reads the volume as of a snapshot; exactly `len` bytes.
    pub async fn read_snapshot(&mut self, name: &str, offset: u64, len: u32) -> Result<Vec<u8>, ControlError> {
        let addr = self.conn.addr;
        let message = Message::ReadSnapshot { name: name.to_owned(), offset, len };
        match self.conn.call("ReadSnapshot", message).await? {
            Message::ReadReply { status: Status::Ok, data } if data.len() == len as usize => Ok(data),
            Message::ReadReply { status: Status::Ok, .. } => Err(ControlError::Protocol { addr, what: "ReadSnapshot" }),
            Message::ReadReply { status, .. } => Err(ControlError::Refused { addr, what: "ReadSnapshot", status }),
            _ => Err(ControlError::Protocol { addr, what: "ReadSnapshot" }),
        }
    }

    /// Extents holding data in the snapshot's view of `[offset, offset + len)`.
    pub async fn snapshot_extents(&mut self, name: &str, offset: u64, len: u64) -> Result<Vec<Extent>, ControlError> {
        let addr = self.conn.addr;
        let message = Message::ListSnapshotExtents { name: name.to_owned(), offset, len };
        match self.conn.call("ListSnapshotExtents", message).await? {
            Message::ExtentMap { status: Status::Ok, extents } => Ok(extents),
            Message::ExtentMap { status, .. } => {
                Err(ControlError::Refused { addr, what: "ListSnapshotExtents", status })
            }
            _ => Err(ControlError::Protocol { addr, what: "ListSnapshotExtents" }),
        }
    }

    /// Extents of `[offset, offset + len)` that may differ between snapshots `base` and `name`
    /// (with no base: that hold data as of `name`). A `len` above 64 GiB may not fit one answer
    /// (`Invalid`): ask in windows.
    pub async fn snapshot_delta(
        &mut self,
        base: Option<&str>,
        name: &str,
        offset: u64,
        len: u64,
    ) -> Result<Vec<Extent>, ControlError> {
        let addr = self.conn.addr;
        let message = Message::ListSnapshotDelta { base: base.map(str::to_owned), name: name.to_owned(), offset, len };
        match self.conn.call("ListSnapshotDelta", message).await? {
            Message::ExtentMap { status: Status::Ok, extents } => Ok(extents),
            Message::ExtentMap { status, .. } => Err(ControlError::refused(addr, "ListSnapshotDelta", status)),
            _ => Err(ControlError::Protocol { addr, what: "ListSnapshotDelta" }),
        }
    }

    /// Flushes and closes, so the replica ends the session clean; returns once the server has
    /// ended the session (it closes its side only after clearing the dirty flag), so the next
    /// session sees a clean replica.
    pub async fn close(mut self) -> Result<(), ControlError> {
        self.flush().await?;
        let (addr, timeout) = (self.conn.addr, self.conn.timeout);
        let conn = &mut self.conn;
        let wait_eof = async {
            conn.stream.shutdown().await?;
            let mut scratch = [0u8; 64];
            while conn.stream.read(&mut scratch).await? > 0 {}
            Ok::<(), std::io::Error>(())
        };
        match tokio::time::timeout(timeout, wait_eof).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ControlError::Connection { addr, what: "close", detail: e.to_string() }),
            Err(_) => Err(ControlError::Timeout { addr, what: "close", timeout }),
        }
    }
}

/// Every node's report, in order; a node that fails is reported as its error, so one dead node
/// does not hide the others' free space.
pub async fn list_nodes(nodes: &[SocketAddr], timeout: Duration) -> Vec<Result<NodeInfo, ControlError>> {
    list_nodes_over(nodes, timeout, &Reach::plaintext()).await
}

/// [`list_nodes`], reaching the servers as `reach` says.
pub async fn list_nodes_over(
    nodes: &[SocketAddr],
    timeout: Duration,
    reach: &Reach,
) -> Vec<Result<NodeInfo, ControlError>> {
    let mut set = tokio::task::JoinSet::new();
    for (i, addr) in nodes.iter().enumerate() {
        let client = ReplicaServerClient::over(*addr, timeout, reach.clone());
        set.spawn(async move { (i, client.node_info().await) });
    }
    let mut out: Vec<Option<Result<NodeInfo, ControlError>>> = nodes.iter().map(|_| None).collect();
    while let Some(joined) = set.join_next().await {
        if let Ok((i, result)) = joined {
            out[i] = Some(result);
        }
    }
    out.into_iter()
        .zip(nodes)
        .map(|(r, addr)| {
            r.unwrap_or_else(|| {
                Err(ControlError::Connection { addr: *addr, what: "NodeInfo", detail: "task failed".into() })
            })
        })
        .collect()
}
