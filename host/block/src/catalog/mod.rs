//! The catalog of replica sets on a grant's replica nodes: what the `block` capability and the
//! node's attacher see of replicated volumes. Everything it knows it reads from the nodes each
//! time — every replica keeps the volume's record beside its data ([`record`], stored by the
//! replica as `replica::record`), so a controller restarted on another machine finds every
//! volume, its members, its snapshots and the node it is attached to; nothing is kept here but
//! work in progress (clones being filled, when a detached replica was first seen down).
//!
//! A replica is named by its [`Location`], a node and one of its disks: a node may hold several
//! replicas of one volume, each on another disk (a cluster with fewer nodes than replicas).
//!
//! Rules it keeps:
//! - The newest record (highest version among the holders that answer) is the truth; updates
//!   write version + 1 to every reachable member, the new member of a replacement first.
//! - An attached volume (its record names an owner whose engine runs) changes only through that
//!   engine ([`engine_call`]), ordered with its I/O; a detached one through sessions that claim
//!   the record's epoch, so an engine given the volume meanwhile fences them.
//! - Publishing a volume to a node raises the epoch on the replicas (`claim`), unpublishing it
//!   raises it again (`release`): an engine still running on the old node is fenced by every
//!   replica that hears of it, and by every other at the new engine's claim.
//! - Deleting marks the record first, then removes the replicas: a node that was down during the
//!   delete is finished when it answers again.
//!
//! This file holds the catalog's types, reading (discovery, views, listing), records, metadata,
//! deletion, expansion and how a change is routed (through the attached engine or
//! offline); creating and filling a set is in `create`, clones nobody asks for any more in
//! `abandoned`, publishing it to a node (claims, and
//! what the node's engine needs) in `publish`, snapshots in `snapshots`, snapshots of several
//! sets at one point in `group`, I/O limits in `limits`, replacement and the
//! collection of leftovers in `membership`.
//!
//! Not here: placement (the backend's policy chooses nodes and disks) and the engine itself
//! ([`crate::engine`], driven by [`crate::volume`]).

mod abandoned;
mod create;
pub mod engine_call;
mod group;
mod limits;
mod membership;
pub mod nodes;
mod publish;
pub mod record;
mod snapshots;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use thiserror::Error;

use crate::control::{ControlError, Reach, ReplicaServerClient, ReplicaSet};
use crate::protocol::{RecordInfo, ReplicaHeader, SnapshotInfo, Status};
pub use abandoned::Tended;
pub use create::{Origin, Placement, RestoreInto, RestoreProgress, Restorer};
use engine_call::{EngineReply, EngineRequest, EngineStatus};

/// How long a delete waits for a replica still open to be let go of (see `remove_replicas`).
const RELEASE_WAIT: Duration = Duration::from_secs(5);
pub use group::{GroupSnapshot, MAX_GROUP};
pub use nodes::{Discovery, NodeSources, NodeView, discover};
pub use record::{FillSource, Location, VolumeRecord};

#[derive(Debug, Error)]
pub enum CatalogError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    OutOfRange(String),
    #[error("{0}")]
    ResourceExhausted(String),
    /// A node did not answer, or the operation must wait (a rebuild, an engine starting).
    #[error("{0}")]
    Unavailable(String),
    /// The set must change first (another replica finish its rebuild): retried later.
    #[error("{0}")]
    Aborted(String),
    /// The node is not one of the grant's nodes.
    #[error("{0}")]
    NotGranted(String),
    /// A replica server's authorization refused the request to this caller (its role may not
    /// make it): PERMISSION_DENIED.
    #[error("{0}")]
    Denied(String),
    #[error("{0}")]
    Internal(String),
}

type Result<T> = std::result::Result<T, CatalogError>;

impl From<ControlError> for CatalogError {
    fn from(e: ControlError) -> Self {
        match &e {
            ControlError::Unreachable { .. } | ControlError::Timeout { .. } | ControlError::Connection { .. } => {
                Self::Unavailable(e.to_string())
            }
            ControlError::NotInSync { .. } => Self::Unavailable(e.to_string()),
            ControlError::Denied { .. } => Self::Denied(e.to_string()),
            // A server whose certificate does not verify (or is another node) may be a
            // rotation in progress or an impostor: either way not this caller's to fix now.
            ControlError::Tls { .. } => Self::Unavailable(e.to_string()),
            ControlError::Refused { status: Status::Fenced | Status::Busy | Status::StaleRevision, .. } => {
                Self::Unavailable(e.to_string())
            }
            ControlError::Refused { status: Status::NotFound, .. } => Self::NotFound(e.to_string()),
            ControlError::Refused { status: Status::AlreadyExists, .. } => Self::AlreadyExists(e.to_string()),
            ControlError::Refused { status: Status::OutOfRange, .. } => Self::OutOfRange(e.to_string()),
            ControlError::Refused { status: Status::Invalid, .. } | ControlError::Invalid(_) => {
                Self::Invalid(e.to_string())
            }
            _ => Self::Internal(e.to_string()),
        }
    }
}

/// A member's state as the catalog reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberState {
    Healthy,
    Rebuilding,
    /// Reachable but behind (or without its replica yet): waits for a rebuild.
    Stale,
    Unreachable,
}

/// One member of a set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub node: String,
    /// The disk of the node holding the replica (as the record names it).
    pub disk: String,
    pub state: MemberState,
    /// When it was first seen not healthy (ns since the Unix epoch), as far as anyone knows.
    pub down_since_ns: Option<u64>,
    pub rebuilt: u64,
    pub rebuild_total: u64,
}

impl Member {
    pub fn location(&self) -> Location {
        Location::new(&self.node, &self.disk)
    }
}

/// A replica set as found on the nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetView {
    pub id: String,
    pub size: u64,
    pub record: VolumeRecord,
    pub version: u64,
    pub epoch: u64,
    /// The newest data revision among the members' replicas.
    pub revision: u64,
    pub members: Vec<Member>,
    /// The owner, when its engine runs the volume now.
    pub attached_to: Option<String>,
    pub snapshots: Vec<SnapshotInfo>,
    /// Bytes copied and to copy while the set is filled from its source.
    pub filling: Option<(u64, u64)>,
    /// Replicas of the id that are not members (left by a replacement).
    pub leftovers: Vec<Location>,
}

/// Where one replica answers: its server and the disk holding it there.
pub type ReplicaAt = (SocketAddr, String);

/// What a node needs to start the volume's engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachInfo {
    pub size: u64,
    pub epoch: u64,
    /// Each member's name and address: where it answers now, else where it last answered (engine
    /// replica order). `None` only for a member that never answered since the record existed.
    pub members: Vec<(String, Option<SocketAddr>)>,
    /// Each member's disk, in the same order (missing: `default`).
    pub disks: Vec<String>,
    /// The grant of the volume to this node the controller signed (`wasmcsi_trust::Grant`, as
    /// encoded), when the caller has one: ControllerPublishVolume's, or the current one a data
    /// path hands over. The replicas do not hold it: [`Catalog::attach_info`] leaves it empty.
    pub grant: Option<Vec<u8>>,
    /// The I/O limits the engine applies from its start (the record's).
    pub limits: crate::qos::IoLimits,
}

impl AttachInfo {
    /// The disk of member `i`.
    pub fn disk(&self, i: usize) -> &str {
        self.disks.get(i).map_or(crate::protocol::DEFAULT_DISK, String::as_str)
    }
}

/// What a replica of the id on one disk of a node said.
#[derive(Debug, Clone)]
struct Holder {
    at: Location,
    addr: SocketAddr,
    header: ReplicaHeader,
    record: RecordInfo,
}

/// A clone being filled in this process.
#[derive(Debug, Clone, Default)]
struct Fill {
    done: u64,
    total: u64,
    finished: bool,
    /// The last failure, reported once by `create`.
    error: Option<String>,
    /// The copy's task: aborted when the clone is deleted before it is whole.
    task: Option<tokio::task::AbortHandle>,
}

/// The catalog of one grant's replica nodes. Cheap to clone.
#[derive(Clone)]
pub struct Catalog {
    sources: Arc<NodeSources>,
    timeout: Duration,
    fills: Arc<Mutex<HashMap<String, Fill>>>,
    /// Clone being filled → when a call last named it (see `abandoned`).
    asked: Arc<Mutex<HashMap<String, std::time::Instant>>>,
    /// (volume, replica) → when the catalog first saw that member not healthy while detached.
    down_since: Arc<Mutex<HashMap<(String, Location), u64>>>,
    /// How the replica servers are reached (plaintext, or TLS with this process's credentials).
    reach: Reach,
    /// Writes backups into sets restored from them; `None`: this host has no backup targets.
    restorer: Option<Arc<dyn Restorer>>,
}

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Catalog {
    /// `timeout` bounds every request to a node (the host's import timeout).
    pub fn new(sources: NodeSources, timeout: Duration) -> Self {
        Self {
            sources: Arc::new(sources),
            timeout,
            fills: Arc::default(),
            asked: Arc::default(),
            down_since: Arc::default(),
            reach: Reach::plaintext(),
            restorer: None,
        }
    }

    /// The same catalog restoring backups through `restorer`.
    pub fn with_restorer(mut self, restorer: Arc<dyn Restorer>) -> Self {
        self.restorer = Some(restorer);
        self
    }

    /// The same catalog reaching replica servers as `reach` says (TLS with this process's
    /// credentials: the controller's, or a node's for its read-only discovery).
    pub fn with_reach(mut self, reach: Reach) -> Self {
        self.reach = reach;
        self
    }

    pub fn sources(&self) -> &NodeSources {
        &self.sources
    }

    /// How this catalog reaches the replica servers.
    pub fn reach(&self) -> &Reach {
        &self.reach
    }

    /// The bound of each request to a node.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Every node the grant names, as it answers now.
    #[tracing::instrument(name = "catalog.discover", skip_all)]
    pub async fn discover(&self) -> Discovery {
        discover(&self.sources, self.timeout, &self.reach).await
    }

    fn client(&self, addr: SocketAddr) -> ReplicaServerClient {
        ReplicaServerClient::over(addr, self.timeout, self.reach.clone())
    }

    /// The replicas `replicas` (server, disk) of `id`, for offline operations.
    fn replica_set(&self, id: &str, replicas: Vec<(SocketAddr, String)>) -> ReplicaSet {
        let (addrs, disks) = replicas.into_iter().unzip();
        ReplicaSet::new(id, addrs, self.timeout).with_disks(disks).with_reach(self.reach.clone())
    }

    /// Every replica of `id` on the nodes that answered, on every disk holding one.
    async fn holders(&self, d: &Discovery, id: &str) -> Vec<Holder> {
        let mut tasks = tokio::task::JoinSet::new();
        for n in d.nodes.values() {
            for disk in n.disks.iter().filter(|disk| disk.volumes.iter().any(|v| v == id)) {
                let (client, at, id) = (self.client(n.addr), Location::new(&n.name, &disk.name), id.to_owned());
                tasks.spawn(async move {
                    let described = client.describe_on(&at.disk, &id).await;
                    (at, client.addr, described)
                });
            }
        }
        let mut out = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok((at, addr, Ok((header, record)))) => out.push(Holder { at, addr, header, record }),
                Ok((at, _, Err(e))) => {
                    tracing::debug!(replica = %at, volume = id, error = %e, "replica did not describe itself")
                }
                Err(e) => tracing::error!(error = %e, "describe task failed"),
            }
        }
        out.sort_by(|a, b| a.at.cmp(&b.at));
        out
    }

    /// The newest record among `holders` (`None` when no holder has one).
    fn newest(holders: &[Holder]) -> Result<Option<(RecordInfo, VolumeRecord)>> {
        let Some(h) = holders.iter().filter(|h| h.record.version > 0).max_by_key(|h| h.record.version) else {
            return Ok(None);
        };
        let record = VolumeRecord::decode(&h.record.data)
            .map_err(|e| CatalogError::Internal(format!("replica of {} on {}: {e}", h.header.volume_id, h.at)))?;
        Ok(Some((h.record.clone(), record)))
    }

    /// Asks the engine of the volume on `node` (the owner), if it runs.
    async fn engine(&self, d: &Discovery, node: &str, id: &str, request: &EngineRequest) -> Result<EngineReply> {
        let Some(n) = d.node(node) else {
            return Err(CatalogError::Unavailable(format!(
                "node {node}, which has volume {id} attached, does not answer"
            )));
        };
        let body = serde_json::to_vec(request).map_err(|e| CatalogError::Internal(e.to_string()))?;
        match self.client(n.addr).engine_call(id, body).await {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| CatalogError::Internal(format!("engine of {id} on {node} answered garbage: {e}"))),
            Err(ControlError::Refused { status: Status::NotFound, .. }) => {
                Ok(EngineReply::error(format!("no engine of {id} runs on {node}")))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The engine's status when the owner's engine runs the volume.
    async fn engine_status(&self, d: &Discovery, record: &VolumeRecord, id: &str) -> Result<Option<EngineStatus>> {
        let Some(owner) = &record.owner else { return Ok(None) };
        let reply = self.engine(d, owner, id, &EngineRequest::Status).await?;
        Ok(reply.status.filter(|s| s.attached && reply.ok))
    }

    /// The set `id` as the nodes hold it now; `None` when no node holds it with a record, or its
    /// delete has started.
    #[tracing::instrument(name = "catalog.get", skip(self))]
    pub async fn get(&self, id: &str) -> Result<Option<SetView>> {
        let d = self.discover().await;
        let view = self.view(&d, id).await?.filter(|v| !v.record.deleting);
        if view.as_ref().is_some_and(|v| v.filling.is_some()) {
            // A CreateVolume retried (or any call naming the clone): someone still wants it.
            self.asked(id);
        }
        Ok(view)
    }

    /// The set `id` (as [`Self::get`]) and where its healthy replicas answer now, each
    /// `(server, disk)`: what reading one of its snapshots (a backup) needs.
    #[tracing::instrument(name = "catalog.healthy_replicas", skip(self))]
    pub async fn healthy_replicas(&self, id: &str) -> Result<Option<(SetView, Vec<ReplicaAt>)>> {
        let d = self.discover().await;
        let Some(view) = self.view(&d, id).await?.filter(|v| !v.record.deleting) else { return Ok(None) };
        let replicas = view
            .members
            .iter()
            .filter(|m| m.state == MemberState::Healthy)
            .filter_map(|m| d.node(&m.node).map(|n| (n.addr, m.disk.clone())))
            .collect();
        Ok(Some((view, replicas)))
    }

    async fn view(&self, d: &Discovery, id: &str) -> Result<Option<SetView>> {
        let holders = self.holders(d, id).await;
        let Some((info, record)) = Self::newest(&holders)? else { return Ok(None) };
        let engine = match self.engine_status(d, &record, id).await {
            Ok(s) => s,
            // The owner does not answer: the members' headers are all there is.
            Err(e) => {
                tracing::debug!(volume = id, error = %e, "no engine status");
                None
            }
        };
        Ok(Some(self.assemble(d, id, &holders, info, record, engine)))
    }

    fn assemble(
        &self,
        d: &Discovery,
        id: &str,
        holders: &[Holder],
        info: RecordInfo,
        record: VolumeRecord,
        engine: Option<EngineStatus>,
    ) -> SetView {
        let of = |at: &Location| holders.iter().find(|h| h.at == *at);
        let newest_revision = record.members.iter().filter_map(&of).map(|h| h.header.revision).max().unwrap_or(0);
        let current: Vec<&Holder> =
            record.members.iter().filter_map(&of).filter(|h| h.header.revision == newest_revision).collect();
        let now = now_ns();
        let mut down = lock(&self.down_since);
        let members: Vec<Member> = record
            .members
            .iter()
            .enumerate()
            .map(|(i, at)| {
                let node = &at.node;
                if let Some(r) = engine.as_ref().and_then(|e| e.replicas.get(i)) {
                    let state = match r.state.as_str() {
                        "healthy" => MemberState::Healthy,
                        "rebuilding" => MemberState::Rebuilding,
                        "stale" => MemberState::Stale,
                        _ => MemberState::Unreachable,
                    };
                    return Member {
                        node: node.clone(),
                        disk: at.disk.clone(),
                        state,
                        down_since_ns: r.down_since_ns,
                        rebuilt: r.rebuilt,
                        rebuild_total: r.rebuild_total,
                    };
                }
                let state = match (d.node(node), of(at)) {
                    (None, _) => MemberState::Unreachable,
                    (Some(_), Some(h)) if h.header.revision == newest_revision => MemberState::Healthy,
                    (Some(_), _) => MemberState::Stale,
                };
                let key = (id.to_owned(), at.clone());
                let down_since_ns = if state == MemberState::Healthy {
                    down.remove(&key);
                    None
                } else {
                    Some(*down.entry(key).or_insert(now))
                };
                Member { node: node.clone(), disk: at.disk.clone(), state, down_since_ns, rebuilt: 0, rebuild_total: 0 }
            })
            .collect();
        drop(down);
        let size = engine.as_ref().map(|e| e.size).or_else(|| current.iter().map(|h| h.header.size).max()).unwrap_or(0);
        let snapshots = current.first().map(|h| h.header.snapshots.clone()).unwrap_or_default();
        let filling = record.fill.as_ref().map(|_| {
            let f = lock(&self.fills).get(id).cloned().unwrap_or_default();
            (f.done, f.total)
        });
        let leftovers = holders.iter().filter(|h| record.member_index(&h.at).is_none()).map(|h| h.at.clone()).collect();
        SetView {
            id: id.to_owned(),
            size,
            version: info.version,
            epoch: info.epoch,
            revision: newest_revision,
            attached_to: engine.is_some().then(|| record.owner.clone()).flatten(),
            record,
            members,
            snapshots,
            filling,
            leftovers,
        }
    }

    /// Sets on the granted nodes, ordered by id, at most `limit`, after `start_after`.
    #[tracing::instrument(name = "catalog.list", skip(self))]
    pub async fn list(&self, start_after: Option<&str>, limit: usize) -> Result<Vec<SetView>> {
        let d = self.discover().await;
        if d.nodes.is_empty() && !d.unreachable.is_empty() {
            return Err(CatalogError::Unavailable(no_node_answered(&d)));
        }
        let ids: BTreeSet<&str> =
            d.nodes.values().flat_map(|n| n.replicas.iter().map(|r| r.volume_id.as_str())).collect();
        let mut out = Vec::new();
        for id in ids.into_iter().filter(|id| start_after.is_none_or(|s| *id > s)) {
            if out.len() >= limit {
                break;
            }
            if let Some(v) = self.view(&d, id).await?
                && !v.record.deleting
            {
                out.push(v);
            }
        }
        Ok(out)
    }

    /// Writes `record` as version `version` to every member that answers (and `first`, a new
    /// member, before them); fails when none took it.
    async fn write_record(
        &self,
        d: &Discovery,
        id: &str,
        info: &RecordInfo,
        targets: impl IntoIterator<Item = &Location>,
    ) -> Result<usize> {
        let mut written = 0;
        let mut last_error = None;
        for at in targets {
            let Some(n) = d.node(&at.node) else { continue };
            match self.client(n.addr).set_record_on(&at.disk, id, info).await {
                Ok(()) => written += 1,
                Err(ControlError::Refused { status: Status::StaleRevision, .. }) => {
                    return Err(CatalogError::Unavailable(format!(
                        "the record of {id} changed meanwhile on {at}; retry"
                    )));
                }
                Err(ControlError::Refused { status: Status::NotFound, .. }) => {}
                Err(e) => last_error = Some(e),
            }
        }
        match (written, last_error) {
            (0, Some(e)) => Err(e.into()),
            (0, None) => Err(CatalogError::Unavailable(format!("no member of {id} took its record"))),
            (n, _) => Ok(n),
        }
    }

    /// The record as version `info.version + 1` at `epoch`, with the members' addresses as
    /// discovery found them now (kept as they were for members it did not find).
    fn next_seen(d: &Discovery, info: &RecordInfo, record: &VolumeRecord, epoch: u64) -> Result<RecordInfo> {
        let mut record = record.clone();
        let members = record.members.clone();
        record.addresses.retain(|node, _| members.iter().any(|m| m.node == *node));
        for m in &members {
            if let Some(n) = d.node(&m.node) {
                record.addresses.insert(m.node.clone(), n.addr);
            }
        }
        Self::next(info, &record, epoch)
    }

    fn next(info: &RecordInfo, record: &VolumeRecord, epoch: u64) -> Result<RecordInfo> {
        let data = record.encode().map_err(|e| CatalogError::Invalid(e.to_string()))?;
        Ok(RecordInfo { version: info.version + 1, epoch, data })
    }

    /// Replaces the backend's metadata.
    #[tracing::instrument(name = "catalog.set_metadata", skip(self, metadata))]
    pub async fn set_metadata(&self, id: &str, metadata: BTreeMap<String, String>) -> Result<()> {
        self.update(id, |r| {
            r.metadata = metadata.clone();
            Ok(false)
        })
        .await
    }

    /// Reads the newest record, changes it with `change` (true: also raise the epoch) and writes
    /// it back; `NotFound` for an unknown or deleted set.
    async fn update(&self, id: &str, change: impl Fn(&mut VolumeRecord) -> Result<bool>) -> Result<()> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, mut record)) = Self::newest(&holders)? else {
            return Err(CatalogError::NotFound(format!("replica set {id} not found")));
        };
        if record.deleting {
            return Err(CatalogError::NotFound(format!("replica set {id} is being deleted")));
        }
        let before = record.clone();
        let raise = change(&mut record)?;
        if record == before && !raise {
            return Ok(());
        }
        let epoch = if raise { info.epoch + 1 } else { info.epoch };
        let next = Self::next(&info, &record, epoch)?;
        let targets: Vec<Location> = holders.iter().map(|h| h.at.clone()).collect();
        self.write_record(&d, id, &next, &targets).await.map(|_| ())
    }

    /// Deletes a set and its snapshots (see the module docs); absent succeeds.
    #[tracing::instrument(name = "catalog.delete", skip(self))]
    pub async fn delete(&self, id: &str) -> Result<()> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        if holders.is_empty() {
            return Ok(());
        }
        if let Some((info, record)) = Self::newest(&holders)? {
            if !record.deleting {
                if let Some(owner) = &record.owner {
                    return Err(CatalogError::FailedPrecondition(format!("volume {id} is attached to node {owner}")));
                }
                if self.is_fill_source(&d, id).await {
                    return Err(CatalogError::FailedPrecondition(format!("a clone of {id} is still being filled")));
                }
                let deleting = VolumeRecord { deleting: true, ..record.clone() };
                let next = Self::next(&info, &deleting, info.epoch + 1)?;
                let targets: Vec<Location> = holders.iter().map(|h| h.at.clone()).collect();
                self.write_record(&d, id, &next, &targets).await?;
            }
            // A copy still running writes into replicas about to go: stop it first.
            if let Some(task) = lock(&self.fills).remove(id).and_then(|f| f.task) {
                task.abort();
            }
            // A clone of a volume copies from a snapshot made for it: it goes with the clone,
            // before the replicas whose record says so (a failure here leaves the record
            // `deleting` with its fill: the controller's rounds finish it, see `abandoned`).
            if let Some(fill) = record.fill.as_ref().filter(|f| f.temporary) {
                self.delete_snapshot_in(&d, &fill.volume_id, &fill.snapshot, Some(id)).await?;
            }
            lock(&self.asked).remove(id);
            self.remove_replicas(&holders).await?;
            // A member whose node is not discovered at all is gone for good (the operator's
            // discovery no longer lists it); one that may be behind an address that did not
            // answer is retried.
            let missing: Vec<String> =
                record.members.iter().filter(|m| d.node(&m.node).is_none()).map(ToString::to_string).collect();
            if !missing.is_empty() && !d.unreachable.is_empty() {
                return Err(CatalogError::Unavailable(format!(
                    "volume {id} deleted on the nodes that answer; members {missing:?} may be among the unreachable \
                     {:?}: retry",
                    d.unreachable.iter().map(|(a, _)| a).collect::<Vec<_>>()
                )));
            }
        } else {
            // Replicas without any record: a create that failed before its first record.
            self.remove_replicas(&holders).await?;
        }
        Ok(())
    }

    /// Deletes every holder's replica. A replica still open is waited for a little (at most
    /// [`RELEASE_WAIT`]): a copy into it that `delete` just aborted closes its sessions as its
    /// task is dropped, which the server sees a moment later.
    async fn remove_replicas(&self, holders: &[Holder]) -> Result<()> {
        for h in holders {
            let deadline = std::time::Instant::now() + RELEASE_WAIT;
            loop {
                match self.client(h.addr).delete_replica_on(&h.at.disk, &h.header.volume_id).await {
                    Err(ControlError::Refused { status: Status::Busy, .. }) if std::time::Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    done => break done?,
                }
            }
        }
        Ok(())
    }

    async fn is_fill_source(&self, d: &Discovery, id: &str) -> bool {
        let targets: BTreeSet<&str> =
            d.nodes.values().flat_map(|n| n.replicas.iter().map(|r| r.volume_id.as_str())).collect();
        let fills: Vec<String> = lock(&self.fills).keys().cloned().collect();
        for t in fills.iter().filter(|t| targets.contains(t.as_str())) {
            if let Ok(Some((_, r))) = Self::newest(&self.holders(d, t).await)
                && r.fill.is_some_and(|f| f.target.is_none() && f.volume_id == id)
            {
                return true;
            }
        }
        false
    }

    /// Grows a set (online through its engine when attached).
    #[tracing::instrument(name = "catalog.expand", skip(self))]
    pub async fn expand(&self, id: &str, size: u64) -> Result<SetView> {
        if !size.is_multiple_of(4096) {
            return Err(CatalogError::Invalid(format!("size {size} is not a multiple of 4096")));
        }
        let d = self.discover().await;
        let view = self.live_view(&d, id).await?;
        if size < view.size {
            return Err(CatalogError::OutOfRange(format!(
                "volume {id} cannot shrink from {} to {size} bytes",
                view.size
            )));
        }
        if size > view.size {
            for m in &view.members {
                let disk = d.node(&m.node).and_then(|n| n.disks.iter().find(|x| x.name == m.disk));
                let free = disk.map_or(0, |x| x.available);
                if free < size - view.size {
                    return Err(CatalogError::ResourceExhausted(format!(
                        "disk {} of node {} has {free} bytes free, growing {id} needs {}",
                        m.disk,
                        m.node,
                        size - view.size
                    )));
                }
            }
            match self.route(&d, &view).await? {
                Route::Engine(owner) => self.engine_ok(&d, &owner, id, &EngineRequest::Expand { size }).await?,
                Route::Offline(set, raise) => Self::offline(&set, raise, |s| s.expand(size)).await?,
            }
        }
        self.live_view(&self.discover().await, id).await
    }

    async fn live_view(&self, d: &Discovery, id: &str) -> Result<SetView> {
        match self.view(d, id).await? {
            Some(v) if !v.record.deleting => Ok(v),
            _ => Err(CatalogError::NotFound(format!("replica set {id} not found"))),
        }
    }

    /// Where an operation on the set runs: its engine, or sessions of this process.
    async fn route(&self, d: &Discovery, view: &SetView) -> Result<Route> {
        if let Some(owner) = &view.attached_to {
            return Ok(Route::Engine(owner.clone()));
        }
        if let Some(owner) = &view.record.owner {
            return Err(CatalogError::Unavailable(format!(
                "volume {} is published to node {owner} but its engine does not run there now; retry",
                view.id
            )));
        }
        // Detached: the current replicas (reachable, at the newest revision) take the change.
        // If any member is not among them, they also move one revision ahead, so the others
        // stay behind and get it by a rebuild at the next attach, never the other way round.
        let current: Vec<(SocketAddr, String)> = view
            .members
            .iter()
            .filter(|m| m.state == MemberState::Healthy)
            .filter_map(|m| d.node(&m.node).map(|n| (n.addr, m.disk.clone())))
            .collect();
        if current.is_empty() {
            return Err(CatalogError::Unavailable(format!("no current replica of {} answers", view.id)));
        }
        let raise = (current.len() < view.members.len()).then_some(view.revision + 1);
        Ok(Route::Offline(self.replica_set(&view.id, current).with_epoch(view.epoch), raise))
    }

    /// Runs an offline change on the current replicas, then moves them ahead if asked.
    async fn offline<'a, F>(
        set: &'a ReplicaSet,
        raise: Option<u64>,
        change: impl FnOnce(&'a ReplicaSet) -> F,
    ) -> Result<()>
    where
        F: std::future::Future<Output = std::result::Result<(), ControlError>>,
    {
        change(set).await?;
        if let Some(revision) = raise {
            set.set_revision(revision).await?;
        }
        Ok(())
    }

    async fn engine_ok(&self, d: &Discovery, owner: &str, id: &str, request: &EngineRequest) -> Result<()> {
        let reply = self.engine(d, owner, id, request).await?;
        match (reply.ok, reply.retry) {
            (true, _) => Ok(()),
            (false, true) => Err(CatalogError::Unavailable(reply.error.unwrap_or_default())),
            (false, false) => {
                Err(CatalogError::Internal(format!("engine of {id} on {owner}: {}", reply.error.unwrap_or_default())))
            }
        }
    }
}

enum Route {
    Engine(String),
    /// The current replicas, and the revision to move them to afterwards.
    Offline(ReplicaSet, Option<u64>),
}

fn no_node_answered(d: &Discovery) -> String {
    let tried: Vec<String> = d.unreachable.iter().map(|(a, why)| format!("{a}: {why}")).collect();
    format!("no granted replica node answers ({})", tried.join("; "))
}
