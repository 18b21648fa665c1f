//! The catalog of replica sets on a grant's replica nodes: what the `block` capability and the
//! node's attacher see of replicated volumes. Everything it knows it reads from the nodes each
//! time — every replica keeps the volume's record beside its data ([`record`], stored by the
//! replica as `replica::record`), so a controller restarted on another machine finds every
//! volume, its members, its snapshots and the node it is attached to; nothing is kept here but
//! work in progress (clones being filled, when a detached replica was first seen down).
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
//! Not here: placement (the backend's policy chooses nodes) and the engine itself
//! ([`crate::engine`], driven by [`crate::volume`]).

pub mod engine_call;
pub mod nodes;
pub mod record;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use thiserror::Error;

use crate::control::{ControlError, ReplicaServerClient, ReplicaSet};
use crate::protocol::{RecordInfo, ReplicaHeader, SnapshotInfo, Status};
use engine_call::{EngineReply, EngineRequest, EngineStatus};
pub use nodes::{Discovery, NodeSources, NodeView, discover};
pub use record::{FillSource, VolumeRecord};

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
    /// The node is not one of the grant's nodes.
    #[error("{0}")]
    NotGranted(String),
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
    pub state: MemberState,
    /// When it was first seen not healthy (ns since the Unix epoch), as far as anyone knows.
    pub down_since_ns: Option<u64>,
    pub rebuilt: u64,
    pub rebuild_total: u64,
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
    /// Nodes holding a replica of the id that are not members (left by a replacement).
    pub leftovers: Vec<String>,
}

/// What a node needs to start the volume's engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachInfo {
    pub size: u64,
    pub epoch: u64,
    /// Each member's name and address: where it answers now, else where it last answered (engine
    /// replica order). `None` only for a member that never answered since the record existed.
    pub members: Vec<(String, Option<SocketAddr>)>,
}

/// What a replica of the id on one node said.
#[derive(Debug, Clone)]
struct Holder {
    node: String,
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
}

/// The catalog of one grant's replica nodes. Cheap to clone.
#[derive(Clone)]
pub struct Catalog {
    sources: Arc<NodeSources>,
    timeout: Duration,
    fills: Arc<Mutex<HashMap<String, Fill>>>,
    /// (volume, node) → when the catalog first saw that member not healthy while detached.
    down_since: Arc<Mutex<HashMap<(String, String), u64>>>,
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
        Self { sources: Arc::new(sources), timeout, fills: Arc::default(), down_since: Arc::default() }
    }

    pub fn sources(&self) -> &NodeSources {
        &self.sources
    }

    /// Every node the grant names, as it answers now.
    #[tracing::instrument(name = "catalog.discover", skip_all)]
    pub async fn discover(&self) -> Discovery {
        discover(&self.sources, self.timeout).await
    }

    fn client(&self, addr: SocketAddr) -> ReplicaServerClient {
        ReplicaServerClient::new(addr, self.timeout)
    }

    /// Every replica of `id` on the nodes that answered.
    async fn holders(&self, d: &Discovery, id: &str) -> Vec<Holder> {
        let mut tasks = tokio::task::JoinSet::new();
        for n in d.nodes.values().filter(|n| n.replicas.iter().any(|r| r.volume_id == id)) {
            let (client, node, id) = (self.client(n.addr), n.name.clone(), id.to_owned());
            tasks.spawn(async move { (node, client.addr, client.describe(&id).await) });
        }
        let mut out = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok((node, addr, Ok((header, record)))) => out.push(Holder { node, addr, header, record }),
                Ok((node, _, Err(e))) => {
                    tracing::debug!(%node, volume = id, error = %e, "replica did not describe itself")
                }
                Err(e) => tracing::error!(error = %e, "describe task failed"),
            }
        }
        out.sort_by(|a, b| a.node.cmp(&b.node));
        out
    }

    /// The newest record among `holders` (`None` when no holder has one).
    fn newest(holders: &[Holder]) -> Result<Option<(RecordInfo, VolumeRecord)>> {
        let Some(h) = holders.iter().filter(|h| h.record.version > 0).max_by_key(|h| h.record.version) else {
            return Ok(None);
        };
        let record = VolumeRecord::decode(&h.record.data)
            .map_err(|e| CatalogError::Internal(format!("replica of {} on {}: {e}", h.header.volume_id, h.node)))?;
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
        self.view(&d, id).await.map(|v| v.filter(|v| !v.record.deleting))
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
        let of = |node: &str| holders.iter().find(|h| h.node == node);
        let newest_revision = record.members.iter().filter_map(|m| of(m)).map(|h| h.header.revision).max().unwrap_or(0);
        let current: Vec<&Holder> =
            record.members.iter().filter_map(|m| of(m)).filter(|h| h.header.revision == newest_revision).collect();
        let now = now_ns();
        let mut down = lock(&self.down_since);
        let members: Vec<Member> = record
            .members
            .iter()
            .enumerate()
            .map(|(i, node)| {
                if let Some(r) = engine.as_ref().and_then(|e| e.replicas.get(i)) {
                    let state = match r.state.as_str() {
                        "healthy" => MemberState::Healthy,
                        "rebuilding" => MemberState::Rebuilding,
                        "stale" => MemberState::Stale,
                        _ => MemberState::Unreachable,
                    };
                    return Member {
                        node: node.clone(),
                        state,
                        down_since_ns: r.down_since_ns,
                        rebuilt: r.rebuilt,
                        rebuild_total: r.rebuild_total,
                    };
                }
                let state = match (d.node(node), of(node)) {
                    (None, _) => MemberState::Unreachable,
                    (Some(_), Some(h)) if h.header.revision == newest_revision => MemberState::Healthy,
                    (Some(_), _) => MemberState::Stale,
                };
                let key = (id.to_owned(), node.clone());
                let down_since_ns = if state == MemberState::Healthy {
                    down.remove(&key);
                    None
                } else {
                    Some(*down.entry(key).or_insert(now))
                };
                Member { node: node.clone(), state, down_since_ns, rebuilt: 0, rebuild_total: 0 }
            })
            .collect();
        drop(down);
        let size = engine.as_ref().map(|e| e.size).or_else(|| current.iter().map(|h| h.header.size).max()).unwrap_or(0);
        let snapshots = current.first().map(|h| h.header.snapshots.clone()).unwrap_or_default();
        let filling = record.fill.as_ref().map(|_| {
            let f = lock(&self.fills).get(id).cloned().unwrap_or_default();
            (f.done, f.total)
        });
        let leftovers =
            holders.iter().filter(|h| record.member_index(&h.node).is_none()).map(|h| h.node.clone()).collect();
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
        targets: impl IntoIterator<Item = &String>,
    ) -> Result<usize> {
        let mut written = 0;
        let mut last_error = None;
        for node in targets {
            let Some(n) = d.node(node) else { continue };
            match self.client(n.addr).set_record(id, info).await {
                Ok(()) => written += 1,
                Err(ControlError::Refused { status: Status::StaleRevision, .. }) => {
                    return Err(CatalogError::Unavailable(format!(
                        "the record of {id} changed meanwhile on {node}; retry"
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
        record.addresses.retain(|node, _| record.members.contains(node));
        for m in &record.members {
            if let Some(n) = d.node(m) {
                record.addresses.insert(m.clone(), n.addr);
            }
        }
        Self::next(info, &record, epoch)
    }

    fn next(info: &RecordInfo, record: &VolumeRecord, epoch: u64) -> Result<RecordInfo> {
        let data = record.encode().map_err(|e| CatalogError::Invalid(e.to_string()))?;
        Ok(RecordInfo { version: info.version + 1, epoch, data })
    }

    /// Creates a set (see the `block.create` contract in `wit/backend.wit`).
    #[tracing::instrument(name = "catalog.create", skip(self, metadata), fields(source = ?source))]
    pub async fn create(
        &self,
        id: &str,
        size: u64,
        nodes: &[String],
        source: Option<(String, Option<String>)>,
        metadata: BTreeMap<String, String>,
    ) -> Result<SetView> {
        if size == 0 || !size.is_multiple_of(4096) {
            return Err(CatalogError::Invalid(format!("size {size} is not a positive multiple of 4096")));
        }
        let distinct: BTreeSet<&String> = nodes.iter().collect();
        if nodes.is_empty() || distinct.len() != nodes.len() {
            return Err(CatalogError::Invalid("a replica set needs distinct nodes, at least one".into()));
        }
        let d = self.discover().await;
        for node in nodes {
            if d.node(node).is_none() {
                return Err(CatalogError::Unavailable(format!(
                    "node {node} is not among the granted replica nodes that answer"
                )));
            }
        }
        let holders = self.holders(&d, id).await;
        let (info, record) = match Self::newest(&holders)? {
            Some((info, record)) if !record.deleting => {
                if record.members != nodes {
                    return Err(CatalogError::AlreadyExists(format!(
                        "replica set {id} exists on nodes {:?}",
                        record.members
                    )));
                }
                let have = holders.iter().map(|h| h.header.size).max().unwrap_or(size);
                if have < size {
                    return Err(CatalogError::AlreadyExists(format!("replica set {id} exists with {have} bytes")));
                }
                (info, record)
            }
            Some((_, _)) => {
                return Err(CatalogError::Unavailable(format!("replica set {id} is being deleted; retry")));
            }
            None => {
                for node in nodes {
                    let available = d.node(node).map(|n| n.available).unwrap_or(0);
                    if available < size && !holders.iter().any(|h| &h.node == node) {
                        return Err(CatalogError::ResourceExhausted(format!(
                            "node {node} has {available} bytes free, the volume needs {size}"
                        )));
                    }
                }
                let fill = match source {
                    None => None,
                    Some((volume, Some(snapshot))) => {
                        let src = self.view(&d, &volume).await?;
                        if !src.as_ref().is_some_and(|v| v.snapshots.iter().any(|s| s.name == snapshot)) {
                            return Err(CatalogError::NotFound(format!(
                                "volume {volume} has no snapshot {snapshot:?}"
                            )));
                        }
                        Some(FillSource { volume_id: volume, snapshot, temporary: false })
                    }
                    Some((volume, None)) => {
                        let snapshot = format!("clone-{id}");
                        self.snapshot_in(&d, &volume, &snapshot).await?;
                        Some(FillSource { volume_id: volume, snapshot, temporary: true })
                    }
                };
                if let Some(f) = &fill {
                    let src = self.view(&d, &f.volume_id).await?;
                    if src.is_some_and(|v| v.size > size) {
                        return Err(CatalogError::OutOfRange(format!(
                            "the clone must be at least as large as its source {}",
                            f.volume_id
                        )));
                    }
                }
                let record = VolumeRecord {
                    members: nodes.to_vec(),
                    addresses: nodes.iter().filter_map(|m| d.node(m).map(|n| (m.clone(), n.addr))).collect(),
                    owner: None,
                    metadata,
                    created_ns: now_ns(),
                    fill,
                    deleting: false,
                };
                let info = RecordInfo {
                    version: 1,
                    epoch: 0,
                    data: record.encode().map_err(|e| CatalogError::Invalid(e.to_string()))?,
                };
                (info, record)
            }
        };
        // Every member gets its replica and the record (a retry completes what a crash left).
        for node in nodes {
            let Some(n) = d.node(node) else { continue };
            let client = self.client(n.addr);
            if !holders.iter().any(|h| &h.node == node) {
                client.create_replica(id, size).await?;
            }
            match client.set_record(id, &info).await {
                Ok(()) => {}
                // A newer record is there already (a retry after an update): fine.
                Err(ControlError::Refused { status: Status::StaleRevision, .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if record.fill.is_some() {
            self.ensure_fill(&d, id, &record).await?;
        }
        self.view(&self.discover().await, id)
            .await?
            .ok_or_else(|| CatalogError::Unavailable(format!("replica set {id} vanished while it was created")))
    }

    /// Starts the copy of `record.fill` into `id` in the background unless it runs or is done.
    async fn ensure_fill(&self, d: &Discovery, id: &str, record: &VolumeRecord) -> Result<()> {
        let Some(fill) = record.fill.clone() else { return Ok(()) };
        {
            let mut fills = lock(&self.fills);
            match fills.get_mut(id) {
                Some(f) if !f.finished && f.error.is_none() => return Ok(()),
                Some(f) if f.error.is_some() => {
                    let e = f.error.take().unwrap_or_default();
                    fills.remove(id);
                    return Err(CatalogError::Unavailable(format!("filling {id} failed, retrying: {e}")));
                }
                _ => {
                    fills.insert(id.to_owned(), Fill::default());
                }
            }
        }
        let src_view = self
            .view(d, &fill.volume_id)
            .await?
            .ok_or_else(|| CatalogError::NotFound(format!("source volume {} is gone", fill.volume_id)))?;
        let src_addr = src_view
            .members
            .iter()
            .filter(|m| m.state == MemberState::Healthy)
            .find_map(|m| d.node(&m.node).map(|n| n.addr))
            .ok_or_else(|| CatalogError::Unavailable(format!("no healthy replica of {} answers", fill.volume_id)))?;
        let source = ReplicaSet::new(fill.volume_id.clone(), vec![src_addr], self.timeout).with_epoch(src_view.epoch);
        let targets: Vec<SocketAddr> = record.members.iter().filter_map(|m| d.node(m).map(|n| n.addr)).collect();
        if targets.len() != record.members.len() {
            lock(&self.fills).remove(id);
            return Err(CatalogError::Unavailable(format!("a member of {id} does not answer; its fill waits")));
        }
        let target = ReplicaSet::new(id.to_owned(), targets, self.timeout);
        let (catalog, id) = (self.clone(), id.to_owned());
        let span =
            tracing::info_span!("catalog.fill", volume = %id, source = %fill.volume_id, snapshot = %fill.snapshot);
        tokio::spawn(tracing::Instrument::instrument(
            async move {
                let fills = catalog.fills.clone();
                let progress = |done, total| {
                    if let Some(f) = lock(&fills).get_mut(&id) {
                        f.done = done;
                        f.total = total;
                    }
                };
                let result = match target.clone_from(&source, &fill.snapshot, progress).await {
                    Ok(()) => catalog.finish_fill(&id, &fill).await,
                    Err(e) => Err(CatalogError::from(e)),
                };
                let mut fills = lock(&catalog.fills);
                match result {
                    Ok(()) => {
                        tracing::info!("clone filled");
                        fills.remove(&id);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "filling a clone failed; the next create or get retries");
                        if let Some(f) = fills.get_mut(&id) {
                            f.error = Some(e.to_string());
                        }
                    }
                }
            },
            span,
        ));
        Ok(())
    }

    /// The copy is whole: drop a temporary source snapshot, clear `fill` in the record.
    async fn finish_fill(&self, id: &str, fill: &FillSource) -> Result<()> {
        let d = self.discover().await;
        if fill.temporary {
            self.delete_snapshot_in(&d, &fill.volume_id, &fill.snapshot, Some(id)).await?;
        }
        let holders = self.holders(&d, id).await;
        let (info, mut record) =
            Self::newest(&holders)?.ok_or_else(|| CatalogError::NotFound(format!("{id} vanished while filled")))?;
        record.fill = None;
        let next = Self::next(&info, &record, info.epoch)?;
        self.write_record(&d, id, &next, &record.members).await.map(|_| ())
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
        let targets: Vec<String> = holders.iter().map(|h| h.node.clone()).collect();
        self.write_record(&d, id, &next, &targets).await.map(|_| ())
    }

    /// ControllerPublishVolume: `node` may attach the volume. The same node again is a retry;
    /// another node while one holds it is `FailedPrecondition` naming it. Raises the epoch, so an
    /// engine left over from before can write nothing.
    #[tracing::instrument(name = "catalog.claim", skip(self))]
    pub async fn claim(&self, id: &str, node: &str) -> Result<()> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, record)) = Self::newest(&holders)? else {
            return Err(CatalogError::NotFound(format!("volume {id} not found")));
        };
        if record.deleting {
            return Err(CatalogError::NotFound(format!("volume {id} is being deleted")));
        }
        if record.fill.is_some() {
            return Err(CatalogError::FailedPrecondition(format!("volume {id} is still being filled from its source")));
        }
        match record.owner.as_deref() {
            Some(owner) if owner == node => return Ok(()),
            Some(owner) => {
                return Err(CatalogError::FailedPrecondition(format!("volume {id} is attached to node {owner}")));
            }
            None => {}
        }
        let claimed = VolumeRecord { owner: Some(node.to_owned()), ..record };
        let next = Self::next_seen(&d, &info, &claimed, info.epoch + 1)?;
        let targets: Vec<String> = holders.iter().map(|h| h.node.clone()).collect();
        self.write_record(&d, id, &next, &targets).await.map(|_| ())
    }

    /// ControllerUnpublishVolume: `node` may no longer attach the volume (unknown volume or
    /// another owner: nothing to do). Raises the epoch: an engine still running there (a node the
    /// CO declared gone) is fenced by every replica that answers now, and by the others as soon
    /// as the next engine claims them.
    /// `node` `None` releases whichever node holds it (CSI's unpublish from every node).
    #[tracing::instrument(name = "catalog.release", skip(self))]
    pub async fn release(&self, id: &str, node: Option<&str>) -> Result<()> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, record)) = Self::newest(&holders)? else { return Ok(()) };
        if record.owner.is_none() || node.is_some_and(|n| record.owner.as_deref() != Some(n)) {
            return Ok(());
        }
        let released = VolumeRecord { owner: None, ..record };
        let next = Self::next(&info, &released, info.epoch + 1)?;
        let targets: Vec<String> = holders.iter().map(|h| h.node.clone()).collect();
        self.write_record(&d, id, &next, &targets).await.map(|_| ())
    }

    /// What `node` needs to run the volume's engine: refused unless the volume is published to
    /// it and whole.
    #[tracing::instrument(name = "catalog.attach_info", skip(self))]
    pub async fn attach_info(&self, id: &str, node: &str) -> Result<AttachInfo> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, record)) = Self::newest(&holders)? else {
            return Err(CatalogError::NotFound(format!("volume {id} not found on any replica node")));
        };
        if record.deleting {
            return Err(CatalogError::NotFound(format!("volume {id} is being deleted")));
        }
        if record.fill.is_some() {
            return Err(CatalogError::FailedPrecondition(format!("volume {id} is still being filled from its source")));
        }
        match record.owner.as_deref() {
            Some(owner) if owner == node => {}
            Some(owner) => {
                return Err(CatalogError::FailedPrecondition(format!("volume {id} is attached to node {owner}")));
            }
            None => {
                return Err(CatalogError::FailedPrecondition(format!(
                    "volume {id} is not published to node {node} (ControllerPublishVolume first)"
                )));
            }
        }
        let size =
            holders.iter().filter(|h| record.member_index(&h.node).is_some()).map(|h| h.header.size).max().unwrap_or(0);
        let members = record
            .members
            .iter()
            .map(|m| (m.clone(), d.node(m).map(|n| n.addr).or_else(|| record.addresses.get(m).copied())))
            .collect();
        Ok(AttachInfo { size, epoch: info.epoch, members })
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
                let targets: Vec<String> = holders.iter().map(|h| h.node.clone()).collect();
                self.write_record(&d, id, &next, &targets).await?;
            }
            lock(&self.fills).remove(id);
            self.remove_replicas(&holders).await?;
            // A member whose node is not discovered at all is gone for good (the operator's
            // discovery no longer lists it); one that may be behind an address that did not
            // answer is retried.
            let missing: Vec<&String> = record.members.iter().filter(|m| d.node(m).is_none()).collect();
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

    async fn remove_replicas(&self, holders: &[Holder]) -> Result<()> {
        for h in holders {
            self.client(h.addr).delete_replica(&h.header.volume_id).await?;
        }
        Ok(())
    }

    async fn is_fill_source(&self, d: &Discovery, id: &str) -> bool {
        let targets: BTreeSet<&str> =
            d.nodes.values().flat_map(|n| n.replicas.iter().map(|r| r.volume_id.as_str())).collect();
        let fills: Vec<String> = lock(&self.fills).keys().cloned().collect();
        for t in fills.iter().filter(|t| targets.contains(t.as_str())) {
            if let Ok(Some((_, r))) = Self::newest(&self.holders(d, t).await)
                && r.fill.is_some_and(|f| f.volume_id == id)
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
                let free = d.node(&m.node).map(|n| n.available).unwrap_or(0);
                if free < size - view.size {
                    return Err(CatalogError::ResourceExhausted(format!(
                        "node {} has {free} bytes free, growing {id} needs {}",
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
        let current: Vec<SocketAddr> = view
            .members
            .iter()
            .filter(|m| m.state == MemberState::Healthy)
            .filter_map(|m| d.node(&m.node).map(|n| n.addr))
            .collect();
        if current.is_empty() {
            return Err(CatalogError::Unavailable(format!("no current replica of {} answers", view.id)));
        }
        let raise = (current.len() < view.members.len()).then_some(view.revision + 1);
        Ok(Route::Offline(ReplicaSet::new(view.id.clone(), current, self.timeout).with_epoch(view.epoch), raise))
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

    /// Takes a crash-consistent snapshot (the same name again: the existing one).
    #[tracing::instrument(name = "catalog.snapshot", skip(self))]
    pub async fn snapshot(&self, id: &str, name: &str) -> Result<SnapshotInfo> {
        let d = self.discover().await;
        self.snapshot_in(&d, id, name).await?;
        let view = self.live_view(&self.discover().await, id).await?;
        view.snapshots.into_iter().find(|s| s.name == name).ok_or_else(|| {
            CatalogError::Unavailable(format!("snapshot {name:?} of {id} is not on every replica yet; retry"))
        })
    }

    async fn snapshot_in(&self, d: &Discovery, id: &str, name: &str) -> Result<()> {
        let view = self.live_view(d, id).await?;
        if view.snapshots.iter().any(|s| s.name == name) {
            return Ok(());
        }
        match self.route(d, &view).await? {
            Route::Engine(owner) => {
                self.engine_ok(d, &owner, id, &EngineRequest::Snapshot { name: name.to_owned() }).await
            }
            Route::Offline(set, raise) => Self::offline(&set, raise, |s| s.snapshot(name)).await,
        }
    }

    /// Deletes a snapshot; absent succeeds.
    #[tracing::instrument(name = "catalog.delete_snapshot", skip(self))]
    pub async fn delete_snapshot(&self, id: &str, name: &str) -> Result<()> {
        let d = self.discover().await;
        self.delete_snapshot_in(&d, id, name, None).await
    }

    /// `filled`: the clone whose fill is done with the snapshot (it no longer needs it).
    async fn delete_snapshot_in(&self, d: &Discovery, id: &str, name: &str, filled: Option<&str>) -> Result<()> {
        let Some(view) = self.view(d, id).await?.filter(|v| !v.record.deleting) else { return Ok(()) };
        if !view.snapshots.iter().any(|s| s.name == name) {
            return Ok(());
        }
        if self.snapshot_feeds_a_fill(d, id, name, filled).await {
            return Err(CatalogError::FailedPrecondition(format!("a clone is being filled from {id}@{name}")));
        }
        match self.route(d, &view).await? {
            Route::Engine(owner) => {
                self.engine_ok(d, &owner, id, &EngineRequest::DeleteSnapshot { name: name.to_owned() }).await
            }
            Route::Offline(set, raise) => Self::offline(&set, raise, |s| s.delete_snapshot(name)).await,
        }
    }

    async fn snapshot_feeds_a_fill(&self, d: &Discovery, id: &str, name: &str, except: Option<&str>) -> bool {
        let fills: Vec<String> = lock(&self.fills).keys().filter(|t| Some(t.as_str()) != except).cloned().collect();
        for t in fills {
            if let Ok(Some((_, r))) = Self::newest(&self.holders(d, &t).await)
                && r.fill.is_some_and(|f| f.volume_id == id && f.snapshot == name)
            {
                return true;
            }
        }
        false
    }

    /// Snapshots of one set, or of every set.
    pub async fn list_snapshots(&self, id: Option<&str>) -> Result<Vec<(String, SnapshotInfo, u64)>> {
        let views = match id {
            Some(id) => self.get(id).await?.into_iter().collect(),
            None => self.list(None, usize::MAX).await?,
        };
        Ok(views
            .into_iter()
            .flat_map(|v| {
                let (id, size) = (v.id.clone(), v.size);
                v.snapshots.into_iter().map(move |s| (id.clone(), s, size))
            })
            .collect())
    }

    /// Moves the replica on `node` to the empty node `with` (see `block.replace`).
    #[tracing::instrument(name = "catalog.replace", skip(self))]
    pub async fn replace(&self, id: &str, node: &str, with: &str) -> Result<SetView> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, record)) = Self::newest(&holders)?.filter(|(_, r)| !r.deleting) else {
            return Err(CatalogError::NotFound(format!("replica set {id} not found")));
        };
        let Some(index) = record.member_index(node) else {
            // A retry after the replacement went through.
            if record.member_index(with).is_some() {
                return self.live_view(&d, id).await;
            }
            return Err(CatalogError::NotFound(format!("replica set {id} has no replica on node {node}")));
        };
        if record.member_index(with).is_some() {
            return Err(CatalogError::Invalid(format!("node {with} already holds a replica of {id}")));
        }
        let Some(target) = d.node(with) else {
            return Err(CatalogError::NotGranted(format!(
                "node {with} is not among the granted replica nodes that answer"
            )));
        };
        let view = self.assemble(&d, id, &holders, info.clone(), record.clone(), None);
        // A leftover of an earlier membership must not pass for the new, empty replica.
        if holders.iter().any(|h| h.node == with) {
            self.client(target.addr).delete_replica(id).await?;
        }
        let size = view.size.max(holders.iter().map(|h| h.header.size).max().unwrap_or(0));
        self.client(target.addr).create_replica(id, size).await?;
        let mut moved = record.clone();
        moved.members[index] = with.to_owned();
        let next = Self::next_seen(&d, &info, &moved, info.epoch)?;
        let mut targets = vec![with.to_owned()];
        targets.extend(moved.members.iter().filter(|m| m.as_str() != with).cloned());
        self.write_record(&d, id, &next, &targets).await?;
        let live = self.view(&d, id).await?;
        if let Some(owner) = live.as_ref().and_then(|v| v.attached_to.clone()) {
            let request = EngineRequest::ReplaceReplica { index, addr: target.addr };
            self.engine_ok(&d, &owner, id, &request).await?;
        } else {
            // Detached: the new, empty replica must look behind to the next engine, whatever
            // revision the others are at. The current members move one revision ahead; a member
            // that is behind already stays behind.
            let newest = holders
                .iter()
                .filter(|h| moved.member_index(&h.node).is_some())
                .map(|h| h.header.revision)
                .max()
                .unwrap_or(0);
            for h in holders.iter().filter(|h| h.node != with && moved.member_index(&h.node).is_some()) {
                if h.header.revision == newest {
                    let mut s =
                        crate::control::ReplicaSession::open_claimed(h.addr, id, self.timeout, info.epoch).await?;
                    let raised = s.set_revision(newest + 1).await;
                    s.close().await?;
                    raised?;
                }
            }
        }
        // Best effort: what is left on the old node is a leftover and is collected later.
        if let Some(old) = d.node(node)
            && let Err(e) = self.client(old.addr).delete_replica(id).await
        {
            tracing::info!(volume = id, node, error = %e, "replaced replica not removed yet");
        }
        lock(&self.down_since).remove(&(id.to_owned(), node.to_owned()));
        self.live_view(&self.discover().await, id).await
    }

    /// Removes replicas of `id` on nodes that are not members of its newest record (left by a
    /// replacement whose node was down), and finishes a delete interrupted by a node that was
    /// down. Returns how many replicas it removed.
    #[tracing::instrument(name = "catalog.collect", skip(self))]
    pub async fn collect(&self, id: &str) -> Result<usize> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, record)) = Self::newest(&holders)? else { return Ok(0) };
        let doomed: Vec<Holder> = holders
            .into_iter()
            .filter(|h| record.deleting || (record.member_index(&h.node).is_none() && h.record.version < info.version))
            .collect();
        for h in &doomed {
            self.client(h.addr).delete_replica(id).await?;
            tracing::info!(volume = id, node = %h.node, "leftover replica removed");
        }
        Ok(doomed.len())
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
