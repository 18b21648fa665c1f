//! Creating a replica set: checking the request, writing the record and empty replicas on every
//! node, and for a clone (of a snapshot or of a volume) or a restore (of a backup) the fill that
//! copies the source into the new replicas in the background and then clears `fill` in the
//! record.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use super::{
    Catalog, CatalogError, Discovery, Fill, FillSource, Location, MemberState, NodeView, Result, SetView, VolumeRecord,
    lock, now_ns,
};
use crate::control::{ControlError, Reach, ReplicaSet};
use crate::protocol::{RecordInfo, Status};

/// What a new set is filled from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Snapshot `snapshot` of set `volume`.
    Snapshot { volume: String, snapshot: String },
    /// The current content of set `volume` (snapshotted for the copy, the snapshot dropped after).
    Volume(String),
    /// Backup `backup` of volume `volume` on backup target `target`, written by the catalog's
    /// [`Restorer`].
    Backup { target: String, volume: String, backup: String },
}

/// The replicas a restore writes: every member of the new set, each `(server, disk)`, reached as
/// the catalog reaches them.
#[derive(Debug, Clone)]
pub struct RestoreInto {
    pub volume_id: String,
    pub replicas: Vec<(SocketAddr, String)>,
    /// Sessions claim this epoch (the set's: no engine holds a set while it is filled).
    pub epoch: u64,
    pub timeout: Duration,
    pub reach: Reach,
}

/// How far a restore is: bytes done and to do.
pub type RestoreProgress = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// Writes backups into new sets. The replication library holds no object-store client: the host
/// that has one (the runtime, with the configured backup targets) gives the catalog its restorer.
pub trait Restorer: Send + Sync {
    /// Writes every byte of backup `backup` of `volume` on `target` into `into` (holes need no
    /// write: the replicas are new), checking every chunk. Idempotent: a retry rewrites the same
    /// bytes. The error says why, for the CO.
    fn restore(
        &self,
        target: String,
        volume: String,
        backup: String,
        into: RestoreInto,
        progress: RestoreProgress,
    ) -> Pin<Box<dyn Future<Output = std::result::Result<(), String>> + Send>>;
}

/// Where a new replica goes: a node, and one of its disks (`None`: the one with the most space
/// available).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub node: String,
    pub disk: Option<String>,
}

impl Placement {
    pub fn on(node: impl Into<String>) -> Self {
        Self { node: node.into(), disk: None }
    }
}

/// The disk of `node` a new replica of `size` bytes goes to: the one `disk` names (an error
/// naming the node's disks when it has none of that name), else the one with the most space
/// available among those not `taken` (the disks of the node that hold another replica of the
/// volume).
pub(super) fn choose_disk(node: &NodeView, disk: Option<&str>, size: u64, taken: &[&str]) -> Result<String> {
    let names = || node.disks.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ");
    let chosen = match disk {
        Some(name) => node.disks.iter().find(|d| d.name == name).ok_or_else(|| {
            CatalogError::Invalid(format!(
                "placement on node {}: disk {name:?} does not exist there (its disks: {})",
                node.name,
                names()
            ))
        })?,
        None if node.disks.is_empty() => {
            return Err(CatalogError::Unavailable(format!("node {} reports no disk", node.name)));
        }
        None => {
            node.disks.iter().filter(|d| !taken.contains(&d.name.as_str())).max_by_key(|d| d.available).ok_or_else(
                || {
                    CatalogError::ResourceExhausted(format!(
                        "node {} has no disk left for another replica of the volume (its disks: {}; each holds one \
                     already)",
                        node.name,
                        names()
                    ))
                },
            )?
        }
    };
    if chosen.available < size {
        return Err(CatalogError::ResourceExhausted(format!(
            "disk {} of node {} has {} bytes free, the volume needs {size}",
            chosen.name, node.name, chosen.available
        )));
    }
    Ok(chosen.name.clone())
}

/// Where the replicas of a new set of `size` bytes go: each placement's node and its named
/// disk, or the node's disk with the most space that no other placement names or took.
fn locate(d: &Discovery, placements: &[Placement], size: u64) -> Result<Vec<Location>> {
    let mut members: Vec<Location> = Vec::with_capacity(placements.len());
    // Named disks first, so a placement without a name never takes one another names.
    let named = |node: &str| -> Vec<&str> {
        placements.iter().filter(|p| p.node == node).filter_map(|p| p.disk.as_deref()).collect()
    };
    for p in placements {
        let Some(n) = d.node(&p.node) else {
            return Err(CatalogError::Unavailable(format!("node {} does not answer", p.node)));
        };
        let mut taken = named(&p.node);
        taken.extend(members.iter().filter(|m| m.node == p.node).map(|m| m.disk.as_str()));
        let disk = choose_disk(n, p.disk.as_deref(), size, &taken)?;
        members.push(Location::new(&p.node, disk));
    }
    Ok(members)
}

impl Catalog {
    /// Creates a set on nodes, each replica on the disk of its node with the most space.
    pub async fn create(
        &self,
        id: &str,
        size: u64,
        nodes: &[String],
        source: Option<Origin>,
        metadata: BTreeMap<String, String>,
    ) -> Result<SetView> {
        let placements: Vec<Placement> = nodes.iter().map(Placement::on).collect();
        self.create_on(id, size, &placements, source, metadata).await
    }

    /// Creates a set (see the `block.create` contract in `wit/backend.wit`). Several
    /// placements may fall on one node, each on another of its disks; a placement that names no
    /// disk gets the node's disk with the most space that no other placement of the set took.
    #[tracing::instrument(name = "catalog.create", skip(self, metadata), fields(source = ?source))]
    pub async fn create_on(
        &self,
        id: &str,
        size: u64,
        placements: &[Placement],
        source: Option<Origin>,
        metadata: BTreeMap<String, String>,
    ) -> Result<SetView> {
        if size == 0 || !size.is_multiple_of(4096) {
            return Err(CatalogError::Invalid(format!("size {size} is not a positive multiple of 4096")));
        }
        if placements.is_empty() {
            return Err(CatalogError::Invalid("a replica set needs at least one replica".into()));
        }
        let named: Vec<(&str, &str)> =
            placements.iter().filter_map(|p| p.disk.as_deref().map(|disk| (p.node.as_str(), disk))).collect();
        if named.iter().collect::<BTreeSet<_>>().len() != named.len() {
            return Err(CatalogError::Invalid("two placements on one disk of one node".into()));
        }
        let d = self.discover().await;
        for p in placements {
            if d.node(&p.node).is_none() {
                return Err(CatalogError::Unavailable(format!(
                    "node {} is not among the granted replica nodes that answer",
                    p.node
                )));
            }
        }
        let holders = self.holders(&d, id).await;
        let (info, record) = match Self::newest(&holders)? {
            Some((info, record)) if !record.deleting => {
                let same = record.members.len() == placements.len()
                    && record
                        .members
                        .iter()
                        .zip(placements)
                        .all(|(m, p)| m.node == p.node && p.disk.as_deref().is_none_or(|disk| disk == m.disk));
                if !same {
                    let members: Vec<String> = record.members.iter().map(ToString::to_string).collect();
                    return Err(CatalogError::AlreadyExists(format!("replica set {id} exists on {members:?}")));
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
                let members = locate(&d, placements, size)?;
                let fill = match source {
                    None => None,
                    Some(Origin::Backup { target, volume, backup }) => {
                        if self.restorer.is_none() {
                            return Err(CatalogError::Invalid(
                                "this host has no backup targets: it cannot restore a backup".into(),
                            ));
                        }
                        Some(FillSource { volume_id: volume, snapshot: backup, temporary: false, target: Some(target) })
                    }
                    Some(Origin::Snapshot { volume, snapshot }) => {
                        let src = self.view(&d, &volume).await?;
                        if !src.as_ref().is_some_and(|v| v.snapshots.iter().any(|s| s.name == snapshot)) {
                            return Err(CatalogError::NotFound(format!(
                                "volume {volume} has no snapshot {snapshot:?}"
                            )));
                        }
                        Some(FillSource { volume_id: volume, snapshot, temporary: false, target: None })
                    }
                    Some(Origin::Volume(volume)) => {
                        let snapshot = format!("clone-{id}");
                        self.snapshot_in(&d, &volume, &snapshot).await?;
                        Some(FillSource { volume_id: volume, snapshot, temporary: true, target: None })
                    }
                };
                // A restore's size is the backend's to check against the backup's.
                if let Some(f) = fill.as_ref().filter(|f| f.target.is_none()) {
                    let src = self.view(&d, &f.volume_id).await?;
                    if src.is_some_and(|v| v.size > size) {
                        return Err(CatalogError::OutOfRange(format!(
                            "the clone must be at least as large as its source {}",
                            f.volume_id
                        )));
                    }
                }
                let record = VolumeRecord {
                    addresses: members
                        .iter()
                        .filter_map(|m| d.node(&m.node).map(|n| (m.node.clone(), n.addr)))
                        .collect(),
                    members,
                    owner: None,
                    metadata,
                    created_ns: now_ns(),
                    fill,
                    ..VolumeRecord::default()
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
        for at in &record.members {
            let Some(n) = d.node(&at.node) else { continue };
            let client = self.client(n.addr);
            if !holders.iter().any(|h| h.at == *at) {
                client.create_replica_on(&at.disk, id, size).await?;
            }
            match client.set_record_on(&at.disk, id, &info).await {
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
    pub(super) async fn ensure_fill(&self, d: &Discovery, id: &str, record: &VolumeRecord) -> Result<()> {
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
        if let Some(target) = fill.target.clone() {
            return self.start_restore(d, id, record, target, fill);
        }
        let src_view = self
            .view(d, &fill.volume_id)
            .await?
            .ok_or_else(|| CatalogError::NotFound(format!("source volume {} is gone", fill.volume_id)))?;
        let src = src_view
            .members
            .iter()
            .filter(|m| m.state == MemberState::Healthy)
            .find_map(|m| d.node(&m.node).map(|n| (n.addr, m.disk.clone())))
            .ok_or_else(|| CatalogError::Unavailable(format!("no healthy replica of {} answers", fill.volume_id)))?;
        let source: ReplicaSet = self.replica_set(&fill.volume_id, vec![src]).with_epoch(src_view.epoch);
        let targets: Vec<(SocketAddr, String)> =
            record.members.iter().filter_map(|m| d.node(&m.node).map(|n| (n.addr, m.disk.clone()))).collect();
        if targets.len() != record.members.len() {
            lock(&self.fills).remove(id);
            return Err(CatalogError::Unavailable(format!("a member of {id} does not answer; its fill waits")));
        }
        let target = self.replica_set(id, targets);
        let key = id.to_owned();
        let (catalog, id) = (self.clone(), id.to_owned());
        let span =
            tracing::info_span!("catalog.fill", volume = %id, source = %fill.volume_id, snapshot = %fill.snapshot);
        let task = tokio::spawn(tracing::Instrument::instrument(
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
                catalog.fill_ended(&id, result, "clone filled");
            },
            span,
        ));
        if let Some(f) = lock(&self.fills).get_mut(&key) {
            f.task = Some(task.abort_handle());
        }
        Ok(())
    }

    /// Starts the restore of `fill` (a backup on `target`) into `id` through the catalog's
    /// restorer, in the background; the caller has registered the fill.
    fn start_restore(
        &self,
        d: &Discovery,
        id: &str,
        record: &VolumeRecord,
        target: String,
        fill: FillSource,
    ) -> Result<()> {
        let replicas: Vec<(SocketAddr, String)> =
            record.members.iter().filter_map(|m| d.node(&m.node).map(|n| (n.addr, m.disk.clone()))).collect();
        let restorer = match (&self.restorer, replicas.len() == record.members.len()) {
            (Some(r), true) => Arc::clone(r),
            (None, _) => {
                lock(&self.fills).remove(id);
                return Err(CatalogError::Unavailable(format!(
                    "{id} is restored from a backup, and this host has no backup targets"
                )));
            }
            (_, false) => {
                lock(&self.fills).remove(id);
                return Err(CatalogError::Unavailable(format!("a member of {id} does not answer; its restore waits")));
            }
        };
        let into = RestoreInto {
            volume_id: id.to_owned(),
            replicas,
            // A set being filled is never published, so it is still at its first epoch (as
            // a clone's copy assumes).
            epoch: 0,
            timeout: self.timeout,
            reach: self.reach.clone(),
        };
        let (catalog, id) = (self.clone(), id.to_owned());
        let fills = self.fills.clone();
        let progress_id = id.clone();
        let progress: RestoreProgress = Arc::new(move |done, total| {
            if let Some(f) = lock(&fills).get_mut(&progress_id) {
                f.done = done;
                f.total = total;
            }
        });
        let span = tracing::info_span!("catalog.restore", volume = %id, %target, backup = %fill.snapshot);
        let key = id.clone();
        let task = tokio::spawn(tracing::Instrument::instrument(
            async move {
                let result =
                    match restorer.restore(target, fill.volume_id.clone(), fill.snapshot.clone(), into, progress).await
                    {
                        Ok(()) => catalog.finish_fill(&id, &fill).await,
                        Err(e) => Err(CatalogError::Unavailable(e)),
                    };
                catalog.fill_ended(&id, result, "restored from its backup");
            },
            span,
        ));
        if let Some(f) = lock(&self.fills).get_mut(&key) {
            f.task = Some(task.abort_handle());
        }
        Ok(())
    }

    /// Records how a fill ended: gone from the fills when done, its error kept for the next
    /// `create` otherwise.
    fn fill_ended(&self, id: &str, result: Result<()>, done: &str) {
        let mut fills = lock(&self.fills);
        match result {
            Ok(()) => {
                tracing::info!("{done}");
                fills.remove(id);
            }
            Err(e) => {
                tracing::warn!(error = %e, "filling a new set failed; the next create retries");
                if let Some(f) = fills.get_mut(id) {
                    f.error = Some(e.to_string());
                }
            }
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::DiskSummary;

    fn node(disks: &[(&str, u64)]) -> NodeView {
        NodeView {
            name: "n1".into(),
            addr: "127.0.0.1:9501".parse().expect("addr"),
            labels: vec![],
            capacity: 0,
            available: 0,
            replicas: vec![],
            disks: disks
                .iter()
                .map(|(name, free)| DiskSummary {
                    name: (*name).into(),
                    capacity: 100,
                    available: *free,
                    volumes: vec![],
                })
                .collect(),
        }
    }

    #[test]
    fn replicas_of_one_set_on_one_node_go_to_distinct_disks_named_ones_first() {
        let d = Discovery {
            nodes: [("n1".to_string(), node(&[("default", 50), ("ssd", 80), ("hdd", 60)]))].into(),
            unreachable: vec![],
        };
        let p = |disk: Option<&str>| Placement { node: "n1".into(), disk: disk.map(Into::into) };
        // The unnamed one would take ssd (the roomiest), but the second names it.
        let at = locate(&d, &[p(None), p(Some("ssd")), p(None)], 10).expect("three disks");
        assert_eq!(at, [Location::new("n1", "hdd"), Location::new("n1", "ssd"), Location::new("n1", "default")]);
        let e = locate(&d, &[p(None), p(None), p(None), p(None)], 10).expect_err("four on three disks");
        assert!(matches!(&e, CatalogError::ResourceExhausted(_)), "{e}");
    }

    #[test]
    fn an_unnamed_placement_gets_the_roomiest_disk_no_other_replica_of_the_set_is_on() {
        let n = node(&[("default", 50), ("ssd", 80), ("hdd", 60)]);
        assert_eq!(choose_disk(&n, None, 10, &[]).expect("chosen"), "ssd");
        assert_eq!(choose_disk(&n, None, 10, &["ssd"]).expect("chosen"), "hdd");
        assert_eq!(choose_disk(&n, Some("default"), 10, &["default"]).expect("named wins"), "default");
        let e = choose_disk(&n, None, 10, &["ssd", "hdd", "default"]).expect_err("every disk taken");
        assert!(matches!(&e, CatalogError::ResourceExhausted(m) if m.contains("no disk left")), "{e}");
        let e = choose_disk(&n, None, 70, &["ssd"]).expect_err("too small");
        assert!(matches!(&e, CatalogError::ResourceExhausted(m) if m.contains("hdd")), "{e}");
        let e = choose_disk(&n, Some("nvme"), 10, &[]).expect_err("no such disk");
        assert!(matches!(&e, CatalogError::Invalid(m) if m.contains("nvme")), "{e}");
    }
}
