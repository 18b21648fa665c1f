//! A replicated volume: one volume's [`Engine`](crate::engine::Engine) driven against its
//! replicas, the only place where the sans-I/O replication core meets sockets, clocks and disks,
//! and exposed as a [`wasmcsi_frontend::BlockDevice`]. This module holds what a caller
//! configures ([`VolumeConfig`], one [`ReplicaEndpoint`] per replica) and sees ([`VolumeStatus`],
//! [`VolumeError`]); the parts live beside it:
//!
//! - `handle`: [`ReplicatedVolume`], the handle a frontend holds; it splits requests to the
//!   engine's limits and blocks (or calls a completion) until the engine answers.
//! - `driver`: the driver that feeds the engine its events (client requests, frames and
//!   connection changes, a periodic tick) and carries out its actions in order — `Send` is
//!   queued on the replica's connection, `Reply` completes the waiting request, `Persist` is
//!   written to the state file *before* any later action of the batch, `ReplicaFailed` closes the
//!   connection and reconnects with exponential backoff — and the task that serves its
//!   connections and timer.
//! - `connection`: one replica's TCP connection, plaintext or mutual TLS (its write side and
//!   the task that connects, presents the volume's grant and reads it).
//! - `grant`: the grant a node's engine presents to open sessions ([`VolumeGrant`]), kept fresh
//!   by the node's data path.
//! - `local`: a replica of this process's own node, reached without a socket
//!   ([`ReplicaEndpoint::InProcess`]), under the same session rules as the server's.
//! - `event`: what those two report to the driver (`ConnEvent`), in a module of its own so
//!   that they do not import the driver.
//! - `hold`: a group snapshot's pause: writes wait outside the engine while a holder holds the
//!   volume, until it lets go or the hold's deadline passes.
//! - `state_file`: the engine's persisted state (`Persist`), crash-safe on disk ([`STATE_FILE`]).
//!
//! It does not own the replication rules (the engine), the replicas' storage ([`crate::replica`])
//! nor the kernel device a frontend makes of the handle (`wasmcsi_datapath::attach`).
//!
//! Size: [`ReplicatedVolume::size`] follows the engine's size (online expansion, and the size
//! the replicas report at attach); the driver updates it before it answers any request of the
//! batch that changed it, so a caller that saw `resize` return sees the new size.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use thiserror::Error;

mod connection;
mod driver;
mod event;
mod grant;
mod handle;
mod hold;
mod local;
mod request;
mod state_file;

pub use grant::VolumeGrant;
pub use handle::ReplicatedVolume;
pub use local::InProcessNode;
pub use state_file::{STATE_FILE, load_state, save_state};

use crate::engine::{EngineConfig, RebuildStatus, ReplicaConfig, ReplicaHealth};
use crate::protocol::SnapshotInfo;
use crate::transport::Transport;

/// Where one replica of a volume is served and how the volume reaches it. A volume's replicas
/// are one list of these, in the engine's replica order (replica `i` is the `i`th).
#[derive(Debug, Clone)]
pub enum ReplicaEndpoint {
    /// A replica server on another node, over TCP.
    Remote(SocketAddr),
    /// A replica server on this node in another process (`wasmcsi replica serve`), over TCP;
    /// the engine prefers it for reads (no network hop).
    Local(SocketAddr),
    /// This process's own replica node, reached without a socket (see [`InProcessNode`]); the
    /// engine prefers it for reads.
    InProcess(InProcessNode),
}

impl ReplicaEndpoint {
    /// The replica server's address: where it is reached over TCP, and how operators and the
    /// control plane name it (also when it is reached in-process).
    pub fn addr(&self) -> SocketAddr {
        match self {
            Self::Remote(addr) | Self::Local(addr) => *addr,
            Self::InProcess(node) => node.addr,
        }
    }

    /// On the engine's own node: preferred for reads.
    pub fn is_local(&self) -> bool {
        !matches!(self, Self::Remote(_))
    }

    /// What the engine knows of it, its replica on the server's disk `disk` of the node `node`
    /// (`None`: unnamed, known by its address).
    pub fn engine_config(&self, disk: &str, node: Option<&str>) -> ReplicaConfig {
        ReplicaConfig { local: self.is_local(), disk: disk.to_owned(), identity: identity(self.addr(), node, disk) }
    }

    /// Where this replica is served once it is replaced by a new one at `addr` (`same_disk`:
    /// on the disk the old one was on): unchanged at the same address, else a remote server (a
    /// replacement created on another node). An in-process replica moved to another disk of
    /// this node is reached through this node's server, which finds a replica by its disk (an
    /// in-process link holds one disk). The engine's read preference stays with the replica's
    /// index for the engine's life.
    fn replaced_by(&self, addr: SocketAddr, same_disk: bool) -> Self {
        match self {
            _ if addr != self.addr() => Self::Remote(addr),
            Self::InProcess(_) if !same_disk => Self::Local(addr),
            _ => self.clone(),
        }
    }
}

/// Who a replica is across engines (see [`ReplicaConfig::identity`]): its node's name and its
/// disk, or its server's address when the node is not named (a volume driven by hand).
pub(crate) fn identity(addr: SocketAddr, node: Option<&str>, disk: &str) -> String {
    match node {
        Some(node) => format!("{node}/{disk}"),
        None => format!("{addr}/{disk}"),
    }
}

#[derive(Debug, Clone)]
pub struct VolumeConfig {
    pub engine: EngineConfig,
    /// The volume's replicas, in the engine's replica order.
    pub replicas: Vec<ReplicaEndpoint>,
    /// Where the engine's persisted state lives; created if missing.
    pub state_dir: PathBuf,
    /// Period of `Event::Tick`: the resolution of request and attach timeouts.
    pub tick: Duration,
    pub connect_timeout: Duration,
    /// Reconnect delay after the first failure; doubled per failure up to `backoff_max`, and
    /// reset once the replica is healthy again.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// How connections to replica servers travel (in-process replicas use no socket).
    pub transport: Transport,
    /// The node each replica's server must be over TLS, in replica order (`None`, or missing:
    /// any node of the cluster's CA).
    pub nodes: Vec<Option<String>>,
    /// The disk of its server holding each replica, in replica order (missing: the disk
    /// `default`): a server may hold several replicas of one volume, one per disk.
    pub disks: Vec<String>,
    /// The volume's grant, presented first on every session when this engine runs with a
    /// node's credentials (a controller's need none).
    pub grant: Option<Arc<VolumeGrant>>,
}

impl VolumeConfig {
    /// A configuration with default timing.
    pub fn new(engine: EngineConfig, replicas: Vec<ReplicaEndpoint>, state_dir: impl Into<PathBuf>) -> Self {
        Self {
            engine,
            replicas,
            state_dir: state_dir.into(),
            tick: Duration::from_millis(10),
            connect_timeout: Duration::from_secs(3),
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
            transport: Transport::Plain,
            nodes: Vec::new(),
            disks: Vec::new(),
            grant: None,
        }
    }
}

#[derive(Debug, Error)]
pub enum VolumeError {
    #[error("engine state in {path}: {source}")]
    State {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("engine state file {path} is corrupt: {what}")]
    CorruptState { path: PathBuf, what: String },
    #[error("a volume has at most {max} replicas, this one {count}")]
    TooManyReplicas { count: usize, max: usize },
}

/// What the driver publishes after every batch of actions, for callers and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeStatus {
    pub attached: bool,
    pub revision: u64,
    /// Replicas that serve reads and count for acknowledgments.
    pub healthy: usize,
    /// Replicas with an open connection, TCP or in-process (healthy or not).
    pub connected: usize,
    pub rebuilds_finished: u64,
    /// Bytes rebuilds copied to their targets since this engine started (a counter).
    pub rebuilt_bytes: u64,
    /// Time a rebuild was running since this engine started, up to this status (a counter:
    /// with `rebuilt_bytes`, how fast rebuilds go).
    pub rebuild_time: Duration,
    /// The volume's size in bytes (grows with online expansion).
    pub size: u64,
    /// The running rebuild and its progress, for progress bars.
    pub rebuild: Option<RebuildStatus>,
    /// The volume's snapshots, oldest first.
    pub snapshots: Vec<SnapshotInfo>,
    /// Another engine was given the volume; every request fails from now on.
    pub fenced: bool,
    /// Every replica's part and, for one that is not healthy, since when (wall clock): the
    /// control plane replaces a replica lost for too long.
    pub replicas: Vec<(ReplicaHealth, Option<SystemTime>)>,
    /// Where each replica is, in replica order: its server's address and the disk of that
    /// server holding it (several replicas on one server means less than node redundancy).
    pub placement: Vec<(SocketAddr, String)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_names_its_address_and_whether_reads_prefer_it() {
        let (a, b): (SocketAddr, SocketAddr) =
            ("10.0.0.1:9501".parse().expect("address"), "10.0.0.2:9501".parse().expect("address"));
        assert_eq!((ReplicaEndpoint::Remote(a).addr(), ReplicaEndpoint::Remote(a).is_local()), (a, false));
        assert_eq!((ReplicaEndpoint::Local(b).addr(), ReplicaEndpoint::Local(b).is_local()), (b, true));
        let config = ReplicaEndpoint::Local(a).engine_config("ssd", Some("node-a"));
        assert!(config.local && config.disk == "ssd" && config.identity == "node-a/ssd");
        let unnamed = ReplicaEndpoint::Remote(b).engine_config("default", None);
        assert_eq!(unnamed.identity, "10.0.0.2:9501/default", "known by its address");
    }

    #[test]
    fn a_replaced_replica_is_remote_unless_it_stays_where_it_was() {
        let (a, b): (SocketAddr, SocketAddr) =
            ("10.0.0.1:9501".parse().expect("address"), "10.0.0.2:9501".parse().expect("address"));
        assert!(matches!(ReplicaEndpoint::Local(a).replaced_by(a, true), ReplicaEndpoint::Local(x) if x == a));
        assert!(matches!(ReplicaEndpoint::Local(a).replaced_by(b, true), ReplicaEndpoint::Remote(x) if x == b));
        assert!(matches!(ReplicaEndpoint::Remote(b).replaced_by(b, false), ReplicaEndpoint::Remote(x) if x == b));
    }
}
