//! The replica server over real TCP (127.0.0.1, port 0) on real sparse files in temp dirs: the
//! handshake, pipelined out-of-order replies, flush durability, unmap, fencing, header
//! corruption, and that a misbehaving client loses only its own connection; the node's control
//! requests (create, delete, node info), Hello routing between volumes, and every snapshot,
//! resize and reinitialize message.
#![allow(clippy::unwrap_used, reason = "tests")]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use wasmcsi_block::protocol::{
    DEFAULT_DISK, DEFAULT_MAX_PAYLOAD, ExtentState, Frame, FrameDecoder, Message, PROTOCOL_VERSION, ReplicaHeader,
    Status, encode,
};
use wasmcsi_block::replica::{ReplicaNode, ReplicaServer, ReplicaStore, ServerConfig, StoreError};

const SIZE: u64 = 64 << 20;
const VOLUME: &str = "vol-a";

/// A bare protocol client: what an engine driver does, minus the engine.
struct Client {
    stream: TcpStream,
    decoder: FrameDecoder,
    next_id: u64,
}

impl Client {
    async fn connect(addr: SocketAddr) -> Self {
        Self {
            stream: TcpStream::connect(addr).await.unwrap(),
            decoder: FrameDecoder::new(DEFAULT_MAX_PAYLOAD),
            next_id: 1,
        }
    }

    async fn hello(addr: SocketAddr) -> (Self, Status, ReplicaHeader) {
        Self::hello_to(addr, VOLUME).await
    }

    async fn hello_to(addr: SocketAddr, volume: &str) -> (Self, Status, ReplicaHeader) {
        let mut c = Self::connect(addr).await;
        let hello = Message::Hello {
            volume_id: volume.into(),
            protocol_version: PROTOCOL_VERSION,
            revision: 0,
            disk: DEFAULT_DISK.into(),
        };
        match c.call(hello).await {
            Message::HelloReply { status, header } => (c, status, header),
            other => panic!("expected HelloReply, got {other:?}"),
        }
    }

    async fn send(&mut self, message: Message) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let mut out = Vec::new();
        encode(&Frame { request_id: id, message }, &mut out).unwrap();
        self.stream.write_all(&out).await.unwrap();
        id
    }

    /// The next frame, `None` once the server closed the connection.
    async fn recv(&mut self) -> Option<Frame> {
        let mut buf = vec![0; 64 * 1024];
        loop {
            if let Some(f) = self.decoder.next_frame().unwrap() {
                return Some(f);
            }
            match self.stream.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.decoder.push(&buf[..n]),
            }
        }
    }

    async fn call(&mut self, message: Message) -> Message {
        let id = self.send(message).await;
        let f = self.recv().await.expect("reply");
        assert_eq!(f.request_id, id);
        f.message
    }

    async fn write(&mut self, offset: u64, data: Vec<u8>, revision: u64) -> Status {
        match self.call(Message::Write { offset, revision, data: data.into() }).await {
            Message::Reply { status } => status,
            other => panic!("{other:?}"),
        }
    }

    async fn simple(&mut self, message: Message) -> Status {
        match self.call(message).await {
            Message::Reply { status } => status,
            other => panic!("{other:?}"),
        }
    }

    async fn read(&mut self, offset: u64, len: u32) -> Vec<u8> {
        match self.call(Message::Read { offset, len }).await {
            Message::ReadReply { status: Status::Ok, data } => data,
            other => panic!("{other:?}"),
        }
    }
}

/// The directory of `VOLUME`'s replica under a node root (the id is filesystem-safe).
fn replica_dir(root: &Path) -> std::path::PathBuf {
    root.join(VOLUME)
}

/// A node server on `root` holding (at least) `VOLUME`'s replica.
async fn start(root: &Path) -> ReplicaServer {
    if !replica_dir(root).join("header").exists() {
        ReplicaStore::create(&replica_dir(root), VOLUME, SIZE).unwrap();
    }
    ReplicaServer::bind_plaintext("127.0.0.1:0", root).await.unwrap()
}

/// A node with `VOLUME`'s replica and explicit server limits.
async fn serve_with(root: &Path, config: ServerConfig) -> ReplicaServer {
    let node = ReplicaNode::open(root).unwrap();
    node.create_replica(VOLUME, SIZE).unwrap();
    ReplicaServer::serve("127.0.0.1:0", std::sync::Arc::new(node), config).await.unwrap()
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8).collect()
}

#[tokio::test]
async fn hello_returns_the_header_and_marks_the_replica_dirty() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let (_c, status, header) = Client::hello(server.local_addr()).await;
    assert_eq!(status, Status::Ok);
    assert_eq!(
        header,
        ReplicaHeader { volume_id: VOLUME.into(), size: SIZE, revision: 0, snapshots: vec![], dirty: false }
    );
    assert!(server.node().store(VOLUME).unwrap().header().dirty, "an open engine session marks the replica dirty");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn hello_for_a_volume_the_node_does_not_hold_is_answered_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let mut c = Client::connect(server.local_addr()).await;
    let reply = c
        .call(Message::Hello {
            volume_id: "other".into(),
            protocol_version: PROTOCOL_VERSION,
            revision: 0,
            disk: DEFAULT_DISK.into(),
        })
        .await;
    assert!(matches!(reply, Message::HelloReply { status: Status::NotFound, .. }), "{reply:?}");
    assert!(c.recv().await.is_none(), "the connection is closed after a refused hello");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn write_then_read_round_trips_and_holes_read_as_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let (mut c, _, _) = Client::hello(server.local_addr()).await;
    let data = pattern(1, 8192);
    assert_eq!(c.write(12345, data.clone(), 0).await, Status::Ok);
    assert_eq!(c.read(12345, 8192).await, data);
    assert_eq!(c.read(40 << 20, 4096).await, vec![0; 4096]);
    let past_end = c.call(Message::Read { offset: SIZE - 10, len: 20 }).await;
    assert_eq!(past_end, Message::ReadReply { status: Status::OutOfRange, data: vec![] });
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn pipelined_writes_and_reads_are_matched_by_request_id() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let (mut c, _, _) = Client::hello(server.local_addr()).await;
    const N: u64 = 256;
    const LEN: usize = 16 * 1024;
    // Send everything without waiting for any reply, from its own task so that replies are
    // read meanwhile: the server's in-flight bound stops it reading when replies pile up, so a
    // client that only sends would deadlock once the socket buffers are full (as a real engine
    // would, which is the point of the bound).
    let (mut rd, mut wr) = c.stream.into_split();
    let sender = tokio::spawn(async move {
        let mut out = Vec::new();
        for i in 0..N {
            out.clear();
            let message = Message::Write { offset: i * LEN as u64 * 2, revision: 0, data: pattern(i, LEN).into() };
            encode(&Frame { request_id: 1000 + i, message }, &mut out).unwrap();
            wr.write_all(&out).await.unwrap();
        }
        for i in 0..N {
            out.clear();
            let message = Message::Read { offset: i * LEN as u64 * 2, len: LEN as u32 };
            encode(&Frame { request_id: 5000 + i, message }, &mut out).unwrap();
            wr.write_all(&out).await.unwrap();
        }
        wr
    });
    let mut replies = Vec::new();
    let mut buf = vec![0; 64 * 1024];
    while replies.len() < 2 * N as usize {
        match c.decoder.next_frame().unwrap() {
            Some(f) => replies.push(f),
            None => {
                let n = rd.read(&mut buf).await.unwrap();
                assert!(n > 0, "server closed the connection");
                c.decoder.push(&buf[..n]);
            }
        }
    }
    c.stream = rd.reunite(sender.await.unwrap()).unwrap();
    // Reads were sent after the writes but before their replies, so the protocol allows them
    // to see old data; collect everything, check each reply by its id, then re-read.
    let mut write_ok = 0;
    let mut reads = HashMap::new();
    let mut order = Vec::new();
    for f in replies {
        order.push(f.request_id);
        match f.message {
            Message::Reply { status: Status::Ok } if (1000..1000 + N).contains(&f.request_id) => write_ok += 1,
            Message::ReadReply { status: Status::Ok, data } if (5000..5000 + N).contains(&f.request_id) => {
                assert!(reads.insert(f.request_id - 5000, data).is_none(), "one reply per request");
            }
            other => panic!("unexpected reply {} {other:?}", f.request_id),
        }
    }
    assert_eq!(write_ok, N);
    assert_eq!(reads.len() as u64, N);
    // Re-read now that all writes are acknowledged: every read must see its write.
    for i in 0..N {
        assert_eq!(c.read(i * LEN as u64 * 2, LEN as u32).await, pattern(i, LEN), "block {i}");
    }
    let mut sorted = order.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), order.len(), "no id answered twice");
    eprintln!("replies out of submission order: {}", order.windows(2).filter(|w| w[0] > w[1]).count());
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn flushed_writes_survive_reopening_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let (mut c, _, _) = Client::hello(server.local_addr()).await;
    assert_eq!(c.write(1 << 20, pattern(9, 65536), 0).await, Status::Ok);
    assert_eq!(c.simple(Message::Flush).await, Status::Ok);
    drop(c);
    server.shutdown().await.unwrap();
    let store = ReplicaStore::open(&replica_dir(dir.path())).unwrap();
    assert_eq!(store.read(1 << 20, 65536).unwrap(), pattern(9, 65536));
    assert!(!store.header().dirty, "the engine's last request was a flush: a clean close");
}

#[tokio::test]
async fn a_write_after_the_last_flush_leaves_the_replica_dirty() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let (mut c, _, _) = Client::hello(server.local_addr()).await;
    assert_eq!(c.simple(Message::Flush).await, Status::Ok);
    assert_eq!(c.write(0, vec![1; 512], 0).await, Status::Ok);
    drop(c);
    server.shutdown().await.unwrap();
    assert!(ReplicaStore::open(&replica_dir(dir.path())).unwrap().header().dirty);
    let server = start(dir.path()).await;
    let (_c, _, header) = Client::hello(server.local_addr()).await;
    assert!(header.dirty, "the next engine learns the previous session did not end cleanly");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn unmap_reads_back_zeros_and_frees_extents() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let (mut c, _, _) = Client::hello(server.local_addr()).await;
    assert_eq!(c.write(0, pattern(3, 4 << 20), 0).await, Status::Ok);
    assert_eq!(c.simple(Message::Flush).await, Status::Ok);
    let allocated = |m: Message| match m {
        Message::ExtentMap { status: Status::Ok, extents } => {
            assert!(extents.iter().all(|e| e.state == ExtentState::Allocated), "flushed: {extents:?}");
            extents.iter().map(|e| e.len).sum::<u64>()
        }
        other => panic!("{other:?}"),
    };
    let before = allocated(c.call(Message::ListExtents { offset: 0, len: SIZE }).await);
    assert!(before >= 4 << 20, "{before}");
    assert_eq!(c.simple(Message::Unmap { offset: 1 << 20, len: 2 << 20, revision: 0 }).await, Status::Ok);
    assert_eq!(c.read(1 << 20, 1 << 20).await, vec![0; 1 << 20]);
    assert_eq!(c.read(0, 4096).await, pattern(3, 4 << 20)[..4096].to_vec(), "outside the range untouched");
    assert_eq!(c.simple(Message::Flush).await, Status::Ok);
    let after = allocated(c.call(Message::ListExtents { offset: 0, len: SIZE }).await);
    assert_eq!(before - after, 2 << 20, "the punched range is no longer allocated");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn stale_revision_writes_and_rebuild_reads_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let (mut c, _, _) = Client::hello(server.local_addr()).await;
    assert_eq!(c.simple(Message::SetRevision { revision: 5 }).await, Status::Ok);
    assert_eq!(c.write(0, vec![7; 4096], 4).await, Status::StaleRevision);
    assert_eq!(c.simple(Message::Unmap { offset: 0, len: 4096, revision: 4 }).await, Status::StaleRevision);
    assert_eq!(c.read(0, 4096).await, vec![0; 4096], "the refused write left nothing behind");
    assert_eq!(c.write(0, vec![7; 4096], 5).await, Status::Ok);
    let stale_source = c.call(Message::ReadExtent { offset: 0, len: 4096, revision: 6 }).await;
    assert_eq!(stale_source, Message::ReadReply { status: Status::StaleRevision, data: vec![] });
    let source = c.call(Message::ReadExtent { offset: 0, len: 4096, revision: 5 }).await;
    assert_eq!(source, Message::ReadReply { status: Status::Ok, data: vec![7; 4096] });
    // The revision was durable before the reply.
    assert_eq!(ReplicaStore::open(&replica_dir(dir.path())).unwrap().header().revision, 5);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_corrupt_header_is_an_error_on_open_not_an_empty_replica() {
    let dir = tempfile::tempdir().unwrap();
    let store = ReplicaStore::create(&replica_dir(dir.path()), VOLUME, SIZE).unwrap();
    store.set_revision(3).unwrap();
    drop(store);
    let path = replica_dir(dir.path()).join("header");
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let err = ReplicaStore::open(&replica_dir(dir.path())).unwrap_err();
    assert!(matches!(err, StoreError::CorruptHeader { .. }), "{err}");
    assert!(err.to_string().contains("checksum"), "{err}");
    // The node still serves its other replicas; this one is refused, never served empty, and
    // cannot be created over.
    let server = ReplicaServer::bind_plaintext("127.0.0.1:0", dir.path()).await.unwrap();
    let (_c, status, _) = Client::hello(server.local_addr()).await;
    assert_eq!(status, Status::IoError);
    assert!(server.node().create_replica(VOLUME, SIZE).is_err());
    server.shutdown().await.unwrap();
    std::fs::write(&path, b"").unwrap();
    assert!(matches!(ReplicaStore::open(&replica_dir(dir.path())), Err(StoreError::CorruptHeader { .. })));
}

#[tokio::test]
async fn a_client_sending_garbage_is_disconnected_and_others_keep_being_served() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let (mut good, _, _) = Client::hello(server.local_addr()).await;

    let (mut bad, _, _) = Client::hello(server.local_addr()).await;
    bad.stream.write_all(b"GET / HTTP/1.1\r\nHost: replica\r\n\r\n").await.unwrap();
    assert!(bad.recv().await.is_none(), "garbage closes the connection");

    let mut before_hello = Client::connect(server.local_addr()).await;
    before_hello.send(Message::Read { offset: 0, len: 1 }).await;
    assert!(before_hello.recv().await.is_none(), "a request before Hello closes the connection");

    assert_eq!(good.write(0, vec![5; 512], 0).await, Status::Ok);
    assert_eq!(good.read(0, 512).await, vec![5; 512]);
    let (mut fresh, status, _) = Client::hello(server.local_addr()).await;
    assert_eq!(status, Status::Ok);
    assert_eq!(fresh.read(0, 512).await, vec![5; 512]);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn shutdown_closes_open_connections() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let (mut c, _, _) = Client::hello(server.local_addr()).await;
    let addr = server.local_addr();
    tokio::time::timeout(std::time::Duration::from_secs(10), server.shutdown()).await.unwrap().unwrap();
    assert!(c.recv().await.is_none());
    assert!(TcpStream::connect(addr).await.is_err(), "no longer listening");
}

#[tokio::test]
async fn a_client_that_stops_reading_is_throttled_without_stalling_others_or_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let config =
        ServerConfig { max_in_flight: 2, shutdown_grace: Duration::from_millis(200), ..ServerConfig::plaintext() };
    let server = serve_with(dir.path(), config).await;
    let (mut stuck, _, _) = Client::hello(server.local_addr()).await;
    // 64 MiB of read replies nobody reads fill the socket buffers; the server must then stop
    // reading this socket (bounded in-flight work) instead of buffering, so the 256 MiB of
    // writes behind them cannot all be sent.
    let flood = tokio::spawn(async move {
        for _ in 0..16 {
            stuck.send(Message::Read { offset: 0, len: 4 << 20 }).await;
        }
        for _ in 0..64 {
            stuck.send(Message::Write { offset: 0, revision: 0, data: vec![9; 4 << 20].into() }).await;
        }
        stuck
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!flood.is_finished(), "the server stopped reading from a client that does not read replies");

    let (mut other, _, _) = Client::hello(server.local_addr()).await;
    assert_eq!(other.write(0, vec![1; 4096], 0).await, Status::Ok);
    assert_eq!(other.read(0, 4096).await, vec![1; 4096]);
    drop(other);
    tokio::time::timeout(Duration::from_secs(10), server.shutdown()).await.unwrap().unwrap();
    flood.abort();
}

#[tokio::test]
async fn pipelining_works_with_an_in_flight_bound_of_one() {
    let dir = tempfile::tempdir().unwrap();
    let server = serve_with(dir.path(), ServerConfig { max_in_flight: 1, ..ServerConfig::plaintext() }).await;
    let (mut c, _, _) = Client::hello(server.local_addr()).await;
    let mut ids = Vec::new();
    for i in 0..32u64 {
        ids.push(c.send(Message::Write { offset: i * 4096, revision: 0, data: pattern(i, 4096).into() }).await);
    }
    let mut got: Vec<u64> = Vec::new();
    for _ in 0..32 {
        let f = c.recv().await.unwrap();
        assert_eq!(f.message, Message::Reply { status: Status::Ok });
        got.push(f.request_id);
    }
    assert_eq!(got, ids, "with one request in flight, replies come back in order");
    assert_eq!(c.read(31 * 4096, 4096).await, pattern(31, 4096));
    server.shutdown().await.unwrap();
}

async fn control(addr: SocketAddr, message: Message) -> Message {
    Client::connect(addr).await.call(message).await
}

fn status(m: Message) -> Status {
    match m {
        Message::Reply { status } => status,
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn control_requests_create_list_and_delete_replicas_idempotently() {
    let dir = tempfile::tempdir().unwrap();
    let server = ReplicaServer::bind_plaintext("127.0.0.1:0", dir.path()).await.unwrap();
    let addr = server.local_addr();
    let create = |id: &str, size| Message::CreateReplica { volume_id: id.into(), size };
    assert_eq!(status(control(addr, create("vol-1", SIZE)).await), Status::Ok);
    assert_eq!(status(control(addr, create("vol-1", SIZE)).await), Status::Ok, "same id and size: done");
    assert_eq!(status(control(addr, create("vol-1", 2 * SIZE)).await), Status::AlreadyExists);
    assert_eq!(status(control(addr, create("vol-2", 4097)).await), Status::Invalid, "not a multiple of 4096");
    assert_eq!(status(control(addr, create("", SIZE)).await), Status::Invalid);
    // An id that is not a safe file name still gets its own directory.
    assert_eq!(status(control(addr, create("ns/pvc 2", SIZE)).await), Status::Ok);
    assert!(dir.path().join("~6e732f7076632032").join("header").exists());

    // Several control requests on one connection.
    let mut c = Client::connect(addr).await;
    let Message::NodeInfoReply { status: Status::Ok, capacity, available, replicas } = c.call(Message::NodeInfo).await
    else {
        panic!("node info")
    };
    assert!(capacity > 0 && available > 0 && available <= capacity);
    let mut ids: Vec<_> = replicas.iter().map(|r| (r.volume_id.as_str(), r.size, r.revision, r.dirty)).collect();
    ids.sort();
    assert_eq!(ids, [("ns/pvc 2", SIZE, 0, false), ("vol-1", SIZE, 0, false)]);
    let delete = || Message::DeleteReplica { volume_id: "ns/pvc 2".into(), disk: DEFAULT_DISK.into() };
    assert_eq!(status(c.call(delete()).await), Status::Ok);
    assert_eq!(status(c.call(delete()).await), Status::NotFound, "deleted already");
    // A data request on a control connection closes it.
    c.send(Message::Read { offset: 0, len: 1 }).await;
    assert!(c.recv().await.is_none());

    // Allocated bytes follow the data.
    let (mut e, st, _) = Client::hello_to(addr, "vol-1").await;
    assert_eq!(st, Status::Ok);
    assert_eq!(e.write(0, vec![1; 1 << 20], 0).await, Status::Ok);
    assert_eq!(e.simple(Message::Flush).await, Status::Ok);
    let Message::NodeInfoReply { replicas, .. } = control(addr, Message::NodeInfo).await else { panic!() };
    assert!(replicas[0].allocated >= 1 << 20 && replicas[0].dirty, "{replicas:?}");

    // Busy while an engine has it open; deletable once it left.
    assert_eq!(
        status(control(addr, Message::DeleteReplica { volume_id: "vol-1".into(), disk: DEFAULT_DISK.into() }).await),
        Status::Busy
    );
    drop(e);
    let deleted = async {
        loop {
            match status(
                control(addr, Message::DeleteReplica { volume_id: "vol-1".into(), disk: DEFAULT_DISK.into() }).await,
            ) {
                Status::Busy => tokio::time::sleep(Duration::from_millis(10)).await,
                other => return other,
            }
        }
    };
    assert_eq!(tokio::time::timeout(Duration::from_secs(5), deleted).await.unwrap(), Status::Ok);
    let (_, st, _) = Client::hello_to(addr, "vol-1").await;
    assert_eq!(st, Status::NotFound);
    server.shutdown().await.unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing left of deleted replicas");

    // The node reopens with what it held.
    let node = ReplicaNode::open(dir.path()).unwrap();
    assert!(node.report().unwrap().replicas.is_empty());
}

#[tokio::test]
async fn one_server_serves_two_volumes_concurrently_routed_by_hello() {
    let dir = tempfile::tempdir().unwrap();
    let server = ReplicaServer::bind_plaintext("127.0.0.1:0", dir.path()).await.unwrap();
    let addr = server.local_addr();
    for id in ["a", "b"] {
        let m = Message::CreateReplica { volume_id: id.into(), size: SIZE };
        assert_eq!(status(control(addr, m).await), Status::Ok);
    }
    let tasks: Vec<_> = [("a", 1u64), ("b", 2u64)]
        .into_iter()
        .map(|(id, seed)| {
            tokio::spawn(async move {
                let (mut c, st, header) = Client::hello_to(addr, id).await;
                assert_eq!((st, header.volume_id.as_str()), (Status::Ok, id));
                for i in 0..64u64 {
                    assert_eq!(c.write(i * 65536, pattern(seed + i, 65536), 0).await, Status::Ok);
                }
                for i in 0..64u64 {
                    assert_eq!(c.read(i * 65536, 65536).await, pattern(seed + i, 65536));
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let a = server.node().store("a").unwrap();
    let b = server.node().store("b").unwrap();
    assert_eq!(a.read(0, 65536).unwrap(), pattern(1, 65536));
    assert_eq!(b.read(0, 65536).unwrap(), pattern(2, 65536));
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn snapshot_messages_are_served_over_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let (mut c, _, _) = Client::hello(server.local_addr()).await;
    let snap = |name: &str| Message::Snapshot { name: name.into(), revision: 0 };
    assert_eq!(c.write(0, vec![1; 8192], 0).await, Status::Ok);
    assert_eq!(c.simple(snap("s1")).await, Status::Ok);
    assert_eq!(c.simple(snap("s1")).await, Status::Ok, "retry of the newest, nothing written since");
    assert_eq!(c.write(4096, vec![2; 4096], 0).await, Status::Ok);
    assert_eq!(c.simple(snap("s1")).await, Status::AlreadyExists);
    assert_eq!(c.simple(snap("s2")).await, Status::Ok);
    assert_eq!(c.write(0, vec![3; 100], 0).await, Status::Ok);

    let read_snap = |name: &str, offset, len| Message::ReadSnapshot { name: name.into(), offset, len };
    assert_eq!(c.call(read_snap("s1", 0, 8192)).await, Message::ReadReply { status: Status::Ok, data: vec![1; 8192] });
    let want_s2 = [vec![1; 4096], vec![2; 4096]].concat();
    assert_eq!(
        c.call(read_snap("s2", 0, 8192)).await,
        Message::ReadReply { status: Status::Ok, data: want_s2.clone() }
    );
    assert_eq!(c.call(read_snap("nope", 0, 1)).await, Message::ReadReply { status: Status::NotFound, data: vec![] });
    assert_eq!(c.call(read_snap("s1", SIZE, 1)).await, Message::ReadReply { status: Status::OutOfRange, data: vec![] });
    let extents = c.call(Message::ListSnapshotExtents { name: "s1".into(), offset: 0, len: SIZE }).await;
    let Message::ExtentMap { status: Status::Ok, extents } = extents else { panic!("{extents:?}") };
    assert_eq!(extents.iter().map(|e| (e.offset, e.len)).collect::<Vec<_>>(), [(0, 8192)]);
    assert!(extents.iter().all(|e| e.state == ExtentState::Allocated));
    let missing = c.call(Message::ListSnapshotExtents { name: "nope".into(), offset: 0, len: 1 }).await;
    assert_eq!(missing, Message::ExtentMap { status: Status::NotFound, extents: vec![] });
    let delta = |base: Option<&str>, name: &str| Message::ListSnapshotDelta {
        base: base.map(str::to_owned),
        name: name.into(),
        offset: 0,
        len: SIZE,
    };
    let Message::ExtentMap { status: Status::Ok, extents } = c.call(delta(Some("s1"), "s2")).await else {
        panic!("delta s1 -> s2")
    };
    assert_eq!(extents.iter().map(|e| (e.offset, e.len)).collect::<Vec<_>>(), [(4096, 4096)], "only s2's write");
    let Message::ExtentMap { status: Status::Ok, extents } = c.call(delta(None, "s2")).await else {
        panic!("delta from nothing")
    };
    assert_eq!(extents.iter().map(|e| (e.offset, e.len)).collect::<Vec<_>>(), [(0, 8192)]);
    let gone = c.call(delta(Some("nope"), "s2")).await;
    assert_eq!(gone, Message::ExtentMap { status: Status::NotFound, extents: vec![] }, "an unknown base is no guess");

    let (_, _, header) = Client::hello(server.local_addr()).await;
    let names: Vec<_> = header.snapshots.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["s1", "s2"], "HelloReply lists the chain oldest first");

    assert_eq!(c.simple(Message::DeleteSnapshot { name: "s1".into(), revision: 0 }).await, Status::Ok);
    assert_eq!(c.simple(Message::DeleteSnapshot { name: "s1".into(), revision: 0 }).await, Status::NotFound);
    assert_eq!(
        c.call(read_snap("s2", 0, 8192)).await,
        Message::ReadReply { status: Status::Ok, data: want_s2.clone() }
    );

    // Revert is refused while another engine session is open (the hello above was dropped, but
    // its close is asynchronous: open a second one on purpose).
    let (other, _, _) = Client::hello(server.local_addr()).await;
    assert_eq!(c.simple(Message::Revert { name: "s2".into(), revision: 0 }).await, Status::Busy);
    drop(other);
    let reverted = async {
        loop {
            match c.simple(Message::Revert { name: "s2".into(), revision: 0 }).await {
                Status::Busy => tokio::time::sleep(Duration::from_millis(10)).await,
                other => return other,
            }
        }
    };
    assert_eq!(tokio::time::timeout(Duration::from_secs(5), reverted).await.unwrap(), Status::Ok);
    assert_eq!(c.read(0, 8192).await, want_s2, "the write after s2 is gone");
    assert_eq!(c.simple(Message::Revert { name: "nope".into(), revision: 0 }).await, Status::NotFound);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn resize_and_reinitialize_are_served_over_tcp_and_fenced() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let (mut c, _, _) = Client::hello(server.local_addr()).await;
    assert_eq!(c.write(0, vec![1; 4096], 0).await, Status::Ok);
    assert_eq!(c.simple(Message::Resize { size: 2 * SIZE, revision: 0 }).await, Status::Ok);
    assert_eq!(c.simple(Message::Resize { size: 2 * SIZE, revision: 0 }).await, Status::Ok, "same size");
    assert_eq!(c.simple(Message::Resize { size: SIZE, revision: 0 }).await, Status::Invalid, "no shrinking");
    assert_eq!(c.read(2 * SIZE - 4096, 4096).await, vec![0; 4096]);
    assert_eq!(c.simple(Message::SetRevision { revision: 4 }).await, Status::Ok);
    assert_eq!(c.simple(Message::Resize { size: 3 * SIZE, revision: 3 }).await, Status::StaleRevision);
    assert_eq!(c.simple(Message::Reinitialize { revision: 3 }).await, Status::StaleRevision);
    assert_eq!(c.simple(Message::Snapshot { name: "x".into(), revision: 3 }).await, Status::StaleRevision);
    assert_eq!(c.simple(Message::Snapshot { name: "x".into(), revision: 4 }).await, Status::Ok);
    assert_eq!(c.simple(Message::DeleteSnapshot { name: "x".into(), revision: 3 }).await, Status::StaleRevision);
    assert_eq!(c.simple(Message::Revert { name: "x".into(), revision: 3 }).await, Status::StaleRevision);
    assert_eq!(c.simple(Message::Reinitialize { revision: 6 }).await, Status::Ok);
    assert_eq!(c.read(0, 4096).await, vec![0; 4096]);
    drop(c);
    let (_, _, header) = Client::hello(server.local_addr()).await;
    assert_eq!((header.size, header.revision, header.snapshots.len()), (2 * SIZE, 6, 0));
    server.shutdown().await.unwrap();
}
