//! The `ceph-rbd-shim` backend: a volume is an RBD image on a granted pool of a configured Ceph
//! cluster, driven through the host's narrow `wasmcsi:backend/rbd` capability (librbd in the
//! host). The guest decides names, sizes, features, clone depth and what deleting means; the host
//! owns the connections, the credentials (secret handles only reach here) and the node side.
//!
//! Where the truth lives (nothing of our own, no process-local state):
//! - Image names are deterministic: `imageNamePrefix + sha256(request name)[..16]`, and the
//!   request name is recorded in image metadata (`csi.wasmcsi.io/name`) when the image is
//!   created. A retry after any crash or host restart computes the same name and finds the image
//!   with `info`; a different request of the same name (size, source) is `already-exists`.
//!   Clones inherit their parent's metadata (librbd copies it), so a clone is recognised by its
//!   parent (`pool/image@snap`), or once flattened by the lineage its inherited name records.
//! - CSI snapshots are RBD snapshots `csi-snap-HASH` (hash of the CSI name) on the source image:
//!   a retried CreateSnapshot finds the snapshot by name. Snapshot ids are `VOLUME_ID.HASH`.
//! - A clone of a volume hangs off a temporary snapshot `csi-tmp-HASH` (hash of the *new*
//!   volume's name) of the source, removed when the clone no longer needs it.
//! - A volume deleted while CSI snapshots of it exist gets a `csi-deleted` marker snapshot
//!   instead of being removed (its data is what the snapshots share): it is gone for CSI (not
//!   listed, NotFound), and the image goes with its last snapshot. Clones of a snapshot or image
//!   that must go are flattened first, so no deletion ever takes data another volume reads.
//! - kv `snapshots/HASH` → the source volume of a CSI snapshot name, so the same name from
//!   another source is refused without scanning every image (see [`create_snapshot`]).
//! - kv `pools/CLUSTER.POOL`: the pools volumes were created in, so ListVolumes and an
//!   unfiltered ListSnapshots know where to look (the capability does not list its grants).
//! - QoS (VolumeAttributesClass: `modify-volume`, and `mutable_parameters` at creation): librbd's
//!   per-image limits, kept in the image's own metadata (`conf_rbd_qos_*`, as ceph-csi sets
//!   them), so the current limits are read from the image and nothing is kept elsewhere. The
//!   keys are the shared `wasmcsi_backend_sdk::io_limits` ones; a key not given stays, `0`
//!   lifts a limit; a StorageClass parameter or an unknown key is invalid-argument naming it,
//!   checked before anything changes. A clone inherits its source's limits (librbd copies image
//!   metadata) unless its own mutable parameters set them.
//!
//! - Group snapshots ([`group`]): an RBD group snapshot of every source image (the group
//!   `csi-group-HASH` records it); each image's part `csi-group-HASH@csi-snap-HASH` is a CSI
//!   snapshot `VOLUME_ID.HASH`, deleted alone or with the group, restored by a full copy the
//!   host runs in the background (CreateVolume answers UNAVAILABLE with the progress until it is
//!   done; the copy records its source in `csi.wasmcsi.io/copy-of`). The group's id is
//!   `CLUSTER.POOL.group-HASH`, its sources recorded in kv `groups/HASH`. Every source must be
//!   in one cluster and pool.
//!
//! Volume ids are `CLUSTER.POOL.IMAGE` (see [`policy::encode_volume_id`]); the host prefixes
//! `BACKEND:`. What this crate does not do: map, mkfs or mount (the node executes the `rbd`
//! attach plan with the NodeStage secrets), or see any key.
mod group;
pub mod policy;
#[cfg(test)]
mod tests;

use policy::{Invalid, Params, Target};
use wasmcsi_backend_sdk::io_limits::{self, Modification};
use wasmcsi_backend_sdk::prelude::*;
use wasmcsi_backend_sdk::rbd::{ImageInfo, ImageSnapshot, qos_limits};
use wasmcsi_backend_sdk::targets::KnownTargets;

/// The backend.
pub struct CephRbd;

/// The pools volumes were ever created in, as `CLUSTER.POOL` (the capability does not list its
/// grants).
const POOLS: KnownTargets = KnownTargets::new("pools/");

fn bad(e: Invalid) -> Error {
    Error::InvalidArgument(e.0)
}
fn params(pairs: &[Pair]) -> Result<Params, Error> {
    Params::parse(pairs.iter().map(|p| (p.key.as_str(), p.value.as_str()))).map_err(bad)
}
/// The VolumeAttributesClass parameters, checked whole before anything changes: the
/// StorageClass's own parameters cannot change on an existing image.
fn parse_mutable(pairs: &[Pair]) -> Result<Modification, Error> {
    io_limits::parse(pairs.iter().map(|p| (p.key.as_str(), p.value.as_str())), policy::PARAMETERS)
}
/// Sets what `m` changes of an image's librbd QoS limits; the others stay as its metadata has
/// them. The same limits again rewrite the same keys: a retry completes an interrupted attempt.
fn apply_limits(h: &impl Host, t: &Target, image: &str, info: &ImageInfo, m: &Modification, s: &[SecretRef]) -> Result<(), Error> {
    if m.is_empty() {
        return Ok(());
    }
    let limits = m.applied_to(qos_limits(&info.metadata));
    h.rbd().set_qos(&t.pool(s), image, &limits)?;
    let shown = format!(
        "read {} IOPS {} B/s, write {} IOPS {} B/s",
        limits.read_iops, limits.read_bytes_per_second, limits.write_iops, limits.write_bytes_per_second
    );
    h.log().info("qos limits set", &[("volume", &policy::encode_volume_id(t, image)), ("limits", &shown)]);
    Ok(())
}
fn meta<'a>(info: &'a ImageInfo, key: &str) -> Option<&'a str> {
    info.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}
fn is_multi_writer(m: AccessMode) -> bool {
    matches!(m, AccessMode::MultiNodeMultiWriter | AccessMode::MultiNodeSingleWriter)
}
fn check_caps(caps: &[VolumeCapability]) -> Result<(), Invalid> {
    caps.iter().try_for_each(|c| policy::check_capability(matches!(c.access_type, AccessType::Block), is_multi_writer(c.access_mode)))
}
/// Calls that change the cluster carry the CSI call's credentials: ceph-csi's `userID`/`userKey`
/// (or `adminID`/`adminKey`). Checked by key here, before any traffic, so a missing secret is
/// named; the values stay in the host.
fn require_credentials(s: &[SecretRef]) -> Result<(), Error> {
    let has = |k: &str| s.iter().any(|r| r.key == k);
    for (id, key) in [("userID", "userKey"), ("adminID", "adminKey")] {
        match (has(id), has(key)) {
            (true, true) => return Ok(()),
            (true, false) => return Err(Error::InvalidArgument(format!("secret {id} is given without {key}"))),
            (false, true) => return Err(Error::InvalidArgument(format!("secret {key} is given without {id}"))),
            (false, false) => {}
        }
    }
    Err(Error::InvalidArgument("ceph credentials missing: secrets userID and userKey (or adminID and adminKey) are required".into()))
}
/// The pools volumes were ever created in.
fn known_pools(h: &impl Host) -> Result<Vec<Target>, Error> {
    Ok(POOLS.list(h.kv())?.iter().filter_map(|k| k.split_once('.')).map(|(cluster, pool)| Target::new(cluster, pool)).collect())
}
fn remember_pool(h: &impl Host, t: &Target) -> Result<(), Error> {
    POOLS.remember(h.kv(), &format!("{}.{}", t.cluster, t.pool))
}

fn volume(t: &Target, image: &str, size: u64) -> Volume {
    let context = [("clusterID", t.cluster.as_str()), ("pool", &t.pool), ("imageName", image)];
    Volume {
        volume_id: policy::encode_volume_id(t, image),
        capacity_bytes: size,
        volume_context: context.iter().map(|(k, v)| Pair { key: (*k).into(), value: (*v).into() }).collect(),
        content_source: None,
        accessible_topology: vec![],
    }
}

/// Whether the image carries the marker of a deletion deferred by its snapshots.
fn is_deleted(snaps: &[ImageSnapshot]) -> bool {
    snaps.iter().any(|s| s.name == policy::DELETED_MARKER)
}

/// A live volume (exists, not deleted): its info and snapshots; `None` otherwise.
fn live(h: &impl Host, t: &Target, image: &str, s: &[SecretRef]) -> Result<Option<(ImageInfo, Vec<ImageSnapshot>)>, Error> {
    let Some(info) = h.rbd().info(&t.pool(s), image)? else { return Ok(None) };
    let snaps = match h.rbd().snapshot_list(&t.pool(s), image) {
        Ok(v) => v,
        Err(Error::NotFound(_)) => return Ok(None),
        Err(e) => return Err(e),
    };
    Ok((!is_deleted(&snaps)).then_some((info, snaps)))
}

fn live_id(h: &impl Host, id: &str, s: &[SecretRef]) -> Result<(Target, String, ImageInfo, Vec<ImageSnapshot>), Error> {
    let not_found = || Error::NotFound(format!("volume {id} not found"));
    let (t, image) = policy::decode_volume_id(id).ok_or_else(not_found)?;
    let (info, snaps) = live(h, &t, &image, s)?.ok_or_else(not_found)?;
    Ok((t, image, info, snaps))
}

/// Ancestors of an image (its parent chain's length), bounded.
fn depth(h: &impl Host, t: &Target, info: &ImageInfo, s: &[SecretRef]) -> Result<u32, Error> {
    let mut d = 0;
    let mut parent = info.parent.clone();
    while let Some(p) = parent {
        d += 1;
        if d > policy::MAX_CLONE_DEPTH + 1 {
            break; // deep enough to flatten whatever the limit; no need to walk further
        }
        let Some((pool, image, _)) = policy::parse_parent(&p) else { break };
        let pt = Target { cluster: t.cluster.clone(), pool };
        parent = h.rbd().info(&pt.pool(s), &image)?.and_then(|i| i.parent);
    }
    Ok(d)
}

/// What a new volume is made from, resolved and checked before anything is created.
struct Source {
    target: Target,
    image: String,
    /// the RBD snapshot the clone hangs off (a CSI snapshot, or our temporary one)
    snap: String,
    temporary: bool,
    size: u64,
    /// the source image's ancestors
    depth: u32,
    /// the name the source image records (inherited by its clones)
    lineage: Option<String>,
    /// restored by a full copy, not a clone: a group snapshot's part (Ceph 16.2 clones only
    /// ordinary snapshots)
    copy: bool,
}

impl Source {
    fn parent(&self) -> String {
        format!("{}/{}@{}", self.target.pool, self.image, self.snap)
    }
}

fn resolve_source(h: &impl Host, p: &Params, name: &str, src: &ContentSource, s: &[SecretRef]) -> Result<Source, Error> {
    let (target, image, snap, temporary, id) = match src {
        ContentSource::Snapshot(sid) => {
            let (_, t, image, snap) = policy::decode_snapshot_id(sid).ok_or_else(|| Error::NotFound(format!("snapshot {sid} not found")))?;
            (t, image, snap, false, sid)
        }
        ContentSource::Volume(vid) => {
            let (t, image) = policy::decode_volume_id(vid).ok_or_else(|| Error::NotFound(format!("volume {vid} not found")))?;
            (t, image, policy::temp_snap_name(name), true, vid)
        }
    };
    if target.cluster != p.target.cluster {
        return Err(Error::InvalidArgument(format!("content source {id} is on cluster {}, not {}", target.cluster, p.target.cluster)));
    }
    let gone = || Error::NotFound(format!("content source {id} not found"));
    let info = h.rbd().info(&target.pool(s), &image)?.ok_or_else(gone)?;
    let snaps = match h.rbd().snapshot_list(&target.pool(s), &image) {
        Ok(v) => v,
        Err(Error::NotFound(_)) => return Err(gone()),
        Err(e) => return Err(e),
    };
    // A snapshot of a deleted volume stays usable; a deleted volume is no source.
    let (size, snap) = if temporary {
        if is_deleted(&snaps) {
            return Err(gone());
        }
        (info.size_bytes, snap)
    } else {
        // The id names the hash; the snapshot is an ordinary one or a group snapshot's part.
        let hash = policy::csi_hash(&snap);
        let found = snaps.into_iter().find(|x| policy::csi_hash(&x.name) == hash).ok_or_else(gone)?;
        (found.size_bytes, found.name)
    };
    let copy = snap.contains('@');
    let depth = depth(h, &target, &info, s)?;
    let lineage = meta(&info, policy::META_NAME).map(str::to_owned);
    Ok(Source { target, image, snap, temporary, size, depth, lineage, copy })
}

/// The driver, over any [`Host`]: the [`Backend`] methods below call these.
fn create_volume(h: &impl Host, req: &CreateVolumeRequest) -> Result<Volume, Error> {
    if req.name.is_empty() {
        return Err(Error::InvalidArgument("volume name is empty".into()));
    }
    let p = params(&req.parameters)?;
    // Checked before anything is made: a class that cannot be applied creates nothing.
    let limits = parse_mutable(&req.mutable_parameters)?;
    check_caps(&req.capabilities).map_err(bad)?;
    let s = req.secrets.as_slice();
    require_credentials(s)?;
    let source = req.content_source.as_ref().map(|c| resolve_source(h, &p, &req.name, c, s)).transpose()?;
    // From a source without a size: the source's; with one, never smaller than the source.
    let required = match &source {
        Some(src) if req.capacity.required_bytes == 0 => src.size,
        _ => req.capacity.required_bytes,
    };
    let size = policy::SIZING.resolve(required, req.capacity.limit_bytes)?;
    if let Some(src) = &source
        && size < src.size
    {
        return Err(Error::OutOfRange(format!("{size} bytes is smaller than the content source's {} bytes", src.size)));
    }
    let t = &p.target;
    let image = policy::image_name(&p.prefix, &req.name);
    let id = policy::encode_volume_id(t, &image);
    sweep_abandoned(h, t, s)?;
    if let Some(src) = source.as_ref().filter(|src| src.copy) {
        return restore_by_copy(h, &p, req, src, &image, size, &limits);
    }

    // Read state: does an earlier attempt's image exist, and is it this request's?
    let mut existing = h.rbd().info(&t.pool(s), &image)?;
    if existing.is_none() {
        remember_pool(h, t)?;
        let made = match &source {
            None => {
                let metadata = [(policy::META_NAME.to_owned(), req.name.clone()), (policy::META_OWNER.to_owned(), policy::OWNER.to_owned())];
                h.rbd().create(&t.pool(s), &image, size, &p.features, p.data_pool.as_deref(), &metadata)
            }
            Some(src) => clone_into(h, &p, src, &image, s),
        };
        match made {
            // Another attempt made it meanwhile: judged below like any existing image.
            Ok(()) | Err(Error::AlreadyExists(_)) => {}
            Err(e) => return Err(e),
        }
        existing = h.rbd().info(&t.pool(s), &image)?;
    }
    let info = existing.ok_or_else(|| Error::Internal(format!("image {image} vanished right after its creation")))?;
    let snaps = h.rbd().snapshot_list(&t.pool(s), &image)?;
    if is_deleted(&snaps) {
        return Err(Error::Aborted(format!("an earlier volume named {} is still being deleted (its snapshots keep image {image})", req.name)));
    }
    check_same_request(&req.name, &image, &info, source.as_ref(), size, req.capacity.limit_bytes)?;
    // Finish what an interrupted attempt may have left undone: the size, the flatten the clone
    // depth asks for, the temporary snapshot a flattened clone no longer needs.
    let mut size_now = info.size_bytes;
    if let Some(src) = &source {
        if size_now < size {
            h.rbd().resize(&t.pool(s), &image, size)?;
            size_now = size;
        }
        let (_, flatten) = policy::clone_plan(src.depth, p.max_clone_depth);
        if flatten && info.parent.is_some() {
            h.rbd().flatten(&t.pool(s), &image)?;
            h.log().info("clone flattened", &[("volume", &id), ("maxCloneDepth", &p.max_clone_depth.to_string())]);
        }
        if src.temporary && (flatten || info.parent.is_none()) {
            drop_temp_snapshot(h, &src.target, &src.image, &src.snap, s)?;
        }
    }
    apply_limits(h, t, &image, &info, &limits, s)?;
    h.log().info("volume ready", &[("volume", &id), ("bytes", &size_now.to_string())]);
    Ok(volume(t, &image, size_now))
}

/// CreateVolume from a group snapshot's part: a full copy the host runs in the background.
/// Each attempt asks how far it is (the first starts it): UNAVAILABLE with the progress until
/// it is done, which the CO retries; then the volume is judged and finished as a clone is.
fn restore_by_copy(
    h: &impl Host,
    p: &Params,
    req: &CreateVolumeRequest,
    src: &Source,
    image: &str,
    size: u64,
    limits: &Modification,
) -> Result<Volume, Error> {
    let (t, s) = (&p.target, req.secrets.as_slice());
    remember_pool(h, t)?;
    // Asked again: an abandoned restore is told by no attempt for a while (see
    // [`reconcile_volume`]).
    let restoring = restore_key(&policy::encode_volume_id(t, image));
    h.kv().set(&restoring, ASKED)?;
    let metadata = [
        (policy::META_NAME.to_owned(), req.name.clone()),
        (policy::META_OWNER.to_owned(), policy::OWNER.to_owned()),
        (policy::META_COPY_OF.to_owned(), src.parent()),
    ];
    let progress = h.rbd().snapshot_copy(&src.target.pool(s), &src.image, &src.snap, &t.pool, image, &p.features, &metadata)?;
    if !progress.done {
        return Err(Error::Unavailable(format!(
            "volume {} is being restored from {}: {} of {} bytes copied; retry",
            req.name,
            src.parent(),
            progress.bytes,
            src.size
        )));
    }
    let info = h.rbd().info(&t.pool(s), image)?.ok_or_else(|| Error::Aborted(format!("image {image} of volume {} vanished; retry", req.name)))?;
    check_same_request(&req.name, image, &info, Some(src), size, req.capacity.limit_bytes)?;
    let size_now = if info.size_bytes < size {
        h.rbd().resize(&t.pool(s), image, size)?;
        size
    } else {
        info.size_bytes
    };
    apply_limits(h, t, image, &info, limits, s)?;
    let id = policy::encode_volume_id(t, image);
    h.kv().delete(&restoring)?;
    h.log().info("volume restored by copy", &[("volume", &id), ("from", &src.parent()), ("bytes", &size_now.to_string())]);
    Ok(volume(t, image, size_now))
}

/// kv `restores/VOLUME_ID`: a restore by copy the CO has not been answered for yet. CreateVolume
/// writes [`ASKED`] on every attempt and deletes it once it returns the volume; the reconcile
/// rounds turn `ASKED` into `SEEN_PREFIX` + the host's time, and [`ABANDONED`] once no attempt
/// came for [`policy::ABANDONED_RESTORE_SECS`] (the CO gave up: its claim was deleted while the
/// copy ran, and it never got the id to delete). An abandoned restore is deleted by the next
/// CreateVolume or DeleteVolume in its pool ([`sweep_abandoned`]): removing an image needs the
/// credentials a CSI call carries, which a round has not.
fn restore_key(volume_id: &str) -> String {
    format!("restores/{volume_id}")
}
const ASKED: &[u8] = b"asked";
const SEEN_PREFIX: &str = "seen:";
const ABANDONED: &[u8] = b"abandoned";

/// Delete the abandoned restores of pool `t` (see [`restore_key`]) with this call's
/// credentials; one still held open by its copy waits for a later call.
fn sweep_abandoned(h: &impl Host, t: &Target, s: &[SecretRef]) -> Result<(), Error> {
    let prefix = restore_key(&format!("{}.{}.", t.cluster, t.pool));
    for key in h.kv().keys(&prefix)? {
        if h.kv().get(&key)?.as_deref() != Some(ABANDONED) {
            continue;
        }
        let Some((kt, image)) = key.strip_prefix("restores/").and_then(policy::decode_volume_id) else { continue };
        match finalize(h, &kt, &image, s) {
            Ok(()) => {
                h.kv().delete(&key)?;
                h.log().warn("abandoned restore deleted (no CreateVolume asked for it)", &[("image", &image)]);
            }
            Err(Error::FailedPrecondition(m)) => h.log().info("abandoned restore not deleted yet", &[("image", &image), ("why", &m)]),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The reconcile round's part for ceph-rbd-shim: abandoned restores by copy (see
/// [`restore_key`]); nothing else to heal (Ceph heals its own data), and no cluster traffic for a
/// volume without a restore record.
fn reconcile_volume(h: &impl Host, id: &str, now: Timestamp) -> Result<(), Error> {
    let (t, image) = policy::decode_volume_id(id).ok_or_else(|| Error::NotFound(format!("volume {id} not found")))?;
    let key = restore_key(id);
    let Some(state) = h.kv().get(&key)? else { return Ok(()) };
    if state == ABANDONED {
        return Ok(());
    }
    let state = String::from_utf8_lossy(&state).into_owned();
    let since = state.strip_prefix(SEEN_PREFIX).and_then(|v| v.parse::<i64>().ok());
    match since {
        None => h.kv().set(&key, format!("{SEEN_PREFIX}{}", now.seconds).as_bytes()),
        Some(since) if now.seconds.saturating_sub(since) < policy::ABANDONED_RESTORE_SECS => Ok(()),
        Some(_) => {
            h.log().warn(
                "restore abandoned: no CreateVolume asked for it; deleted by the next call in its pool",
                &[("volume", id), ("image", &image), ("pool", &t.pool)],
            );
            h.kv().set(&key, ABANDONED)
        }
    }
}

/// Clone `src` into `image` (protecting the snapshot first: clone v1 clusters need it, v2
/// ones accept it), then grow it to `size` if the request asks for more than the source.
fn clone_into(h: &impl Host, p: &Params, src: &Source, image: &str, s: &[SecretRef]) -> Result<(), Error> {
    if src.temporary {
        match h.rbd().snapshot_create(&src.target.pool(s), &src.image, &src.snap) {
            Ok(_) | Err(Error::AlreadyExists(_)) => {}
            Err(e) => return Err(e),
        }
    }
    h.rbd().snapshot_protect(&src.target.pool(s), &src.image, &src.snap)?;
    // Clones need layering whatever the StorageClass lists.
    let mut features = p.features.clone();
    if !features.iter().any(|f| f == "layering") {
        features.push("layering".into());
        features.sort();
    }
    h.rbd().clone_image(&src.target.pool(s), &src.image, &src.snap, &p.target.pool, image, &features)
}

/// Whether an existing image answers this request (CSI: same name and compatible request →
/// the same volume; otherwise already-exists).
fn check_same_request(name: &str, image: &str, info: &ImageInfo, source: Option<&Source>, size: u64, limit: u64) -> Result<(), Error> {
    let recorded = meta(info, policy::META_NAME);
    let ours = match source {
        None => info.parent.is_none() && recorded == Some(name),
        // A copy records its request's name and what it was copied from.
        Some(src) if src.copy => info.parent.is_none() && recorded == Some(name) && meta(info, policy::META_COPY_OF) == Some(src.parent().as_str()),
        Some(src) => match &info.parent {
            Some(parent) => *parent == src.parent(),
            // Flattened: the inherited name tells the lineage (see the crate docs).
            None => recorded.is_some() && recorded.map(str::to_owned) == src.lineage && recorded != Some(name),
        },
    };
    if !ours {
        return Err(Error::AlreadyExists(format!(
            "image {image} exists for another request (recorded name {:?}, parent {:?})",
            recorded.unwrap_or(""),
            info.parent.as_deref().unwrap_or("none")
        )));
    }
    // Compatible when the existing size is within the requested range (an expanded volume
    // still answers its original request). A clone smaller than asked is an interrupted
    // attempt whose resize the caller finishes.
    let too_small = source.is_none() && info.size_bytes < size;
    if too_small || (limit != 0 && info.size_bytes > limit) {
        return Err(Error::AlreadyExists(format!("volume {name} exists with {} bytes, outside the requested range", info.size_bytes)));
    }
    Ok(())
}

/// Remove a temporary snapshot once no clone hangs off it (absent: fine).
fn drop_temp_snapshot(h: &impl Host, t: &Target, image: &str, snap: &str, s: &[SecretRef]) -> Result<(), Error> {
    match h.rbd().children(&t.pool(s), image, snap) {
        Ok(c) if c.is_empty() => match h.rbd().snapshot_remove(&t.pool(s), image, snap) {
            Ok(()) | Err(Error::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        },
        Ok(_) | Err(Error::NotFound(_)) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Flatten every clone of `image@snap`, so the snapshot can go without taking their data.
fn flatten_children(h: &impl Host, t: &Target, image: &str, snap: &str, s: &[SecretRef]) -> Result<(), Error> {
    let children = match h.rbd().children(&t.pool(s), image, snap) {
        Ok(c) => c,
        Err(Error::NotFound(_)) => return Ok(()),
        Err(e) => return Err(e),
    };
    for child in children {
        let (pool, name) = child.split_once('/').ok_or_else(|| Error::Internal(format!("child {child:?} is not pool/image")))?;
        let ct = Target { cluster: t.cluster.clone(), pool: pool.into() };
        h.rbd().flatten(&ct.pool(s), name)?;
        h.log().info("clone flattened before its parent snapshot goes", &[("image", &child), ("parent", &format!("{}/{image}@{snap}", t.pool))]);
    }
    Ok(())
}

/// Remove an image for good: flatten the clones of its (non-CSI) snapshots, remove those, remove
/// the image, then release its parent's temporary snapshot and finish a deferred deletion of
/// the parent that waited for it.
fn finalize(h: &impl Host, t: &Target, image: &str, s: &[SecretRef]) -> Result<(), Error> {
    let Some(info) = h.rbd().info(&t.pool(s), image)? else { return Ok(()) };
    for snap in h.rbd().snapshot_list(&t.pool(s), image)? {
        if policy::csi_hash(&snap.name).is_some() {
            return Err(Error::FailedPrecondition(format!("image {image} still has snapshot {}", snap.name)));
        }
        if !(snap.name.starts_with(policy::TEMP_PREFIX) || snap.name == policy::DELETED_MARKER) {
            // Not ours: someone made it by hand; removing it could lose their data.
            return Err(Error::FailedPrecondition(format!("image {image} has snapshot {} this backend did not make", snap.name)));
        }
        flatten_children(h, t, image, &snap.name, s)?;
        match h.rbd().snapshot_remove(&t.pool(s), image, &snap.name) {
            Ok(()) | Err(Error::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
    }
    h.rbd().remove(&t.pool(s), image)?;
    h.log().info("image removed", &[("image", &format!("{}/{image}", t.pool))]);
    if let Some((pool, pimage, psnap)) = info.parent.as_deref().and_then(policy::parse_parent) {
        let pt = Target { cluster: t.cluster.clone(), pool };
        if psnap.starts_with(policy::TEMP_PREFIX) {
            drop_temp_snapshot(h, &pt, &pimage, &psnap, s)?;
        }
        finish_deferred(h, &pt, &pimage, s)?;
    }
    Ok(())
}

/// A deleted (marked) image whose last CSI snapshot is gone: remove it now.
fn finish_deferred(h: &impl Host, t: &Target, image: &str, s: &[SecretRef]) -> Result<(), Error> {
    let snaps = match h.rbd().snapshot_list(&t.pool(s), image) {
        Ok(v) => v,
        Err(Error::NotFound(_)) => return Ok(()),
        Err(e) => return Err(e),
    };
    if is_deleted(&snaps) && !snaps.iter().any(|x| policy::csi_hash(&x.name).is_some()) {
        finalize(h, t, image, s)?;
    }
    Ok(())
}

fn delete_volume(h: &impl Host, id: &str, s: &[SecretRef]) -> Result<(), Error> {
    // An id this backend cannot have made names no volume: deleting it succeeds.
    let Some((t, image)) = policy::decode_volume_id(id) else { return Ok(()) };
    require_credentials(s)?;
    sweep_abandoned(h, &t, s)?;
    // A restore by copy deleted before its CreateVolume was answered: its record goes too.
    h.kv().delete(&restore_key(id))?;
    if h.rbd().info(&t.pool(s), &image)?.is_none() {
        return Ok(());
    }
    let snaps = h.rbd().snapshot_list(&t.pool(s), &image)?;
    if snaps.iter().any(|x| policy::csi_hash(&x.name).is_some()) {
        // CSI snapshots are independent objects: the volume goes, its data stays for them.
        if !is_deleted(&snaps) {
            match h.rbd().snapshot_create(&t.pool(s), &image, policy::DELETED_MARKER) {
                Ok(_) | Err(Error::AlreadyExists(_)) => {}
                Err(e) => return Err(e),
            }
        }
        h.log().info("volume deleted; image kept for its snapshots", &[("volume", id)]);
        return Ok(());
    }
    finalize(h, &t, &image, s)
}

fn expand_volume(h: &impl Host, id: &str, cap: &CapacityRange, capability: Option<&VolumeCapability>, s: &[SecretRef]) -> Result<Expansion, Error> {
    let (t, image) = policy::decode_volume_id(id).ok_or_else(|| Error::NotFound(format!("volume {id} not found")))?;
    require_credentials(s)?;
    let (info, _) = live(h, &t, &image, s)?.ok_or_else(|| Error::NotFound(format!("volume {id} not found")))?;
    let size = policy::SIZING.resolve(cap.required_bytes, cap.limit_bytes)?;
    let now = if size > info.size_bytes {
        h.rbd().resize(&t.pool(s), &image, size)?;
        size
    } else {
        info.size_bytes
    };
    if cap.limit_bytes != 0 && now > cap.limit_bytes {
        return Err(Error::OutOfRange(format!("volume {id} has {now} bytes, above the limit {}", cap.limit_bytes)));
    }
    // A raw block device is the whole image already; a filesystem must be grown on the node.
    let block = capability.is_some_and(|c| matches!(c.access_type, AccessType::Block));
    Ok(Expansion { capacity_bytes: now, node_expansion_required: !block })
}

/// ControllerModifyVolume: a missing volume is not-found before its keys are judged.
fn modify_volume(h: &impl Host, id: &str, pairs: &[Pair], s: &[SecretRef]) -> Result<(), Error> {
    let (t, image) = policy::decode_volume_id(id).ok_or_else(|| Error::NotFound(format!("volume {id} not found")))?;
    require_credentials(s)?;
    let (info, _) = live(h, &t, &image, s)?.ok_or_else(|| Error::NotFound(format!("volume {id} not found")))?;
    let m = parse_mutable(pairs)?;
    apply_limits(h, &t, &image, &info, &m, s)
}

fn get_volume(h: &impl Host, id: &str) -> Result<VolumeStatus, Error> {
    let (t, image, info, _) = live_id(h, id, &[])?;
    Ok(VolumeStatus { volume: volume(&t, &image, info.size_bytes), condition: None })
}

/// Images of this backend in a pool (clones included: they inherit the owner key).
fn owned_images(h: &impl Host, t: &Target) -> Result<Vec<String>, Error> {
    h.rbd().find_by_metadata(&t.pool(&[]), policy::META_OWNER, policy::OWNER)
}

fn list_volumes(h: &impl Host, max: u32, token: &str) -> Result<VolumePage, Error> {
    let mut all = vec![];
    for t in known_pools(h)? {
        for image in owned_images(h, &t)? {
            if let Some((info, _)) = live(h, &t, &image, &[])? {
                all.push(VolumeStatus { volume: volume(&t, &image, info.size_bytes), condition: None });
            }
        }
    }
    all.sort_by(|a, b| a.volume.volume_id.cmp(&b.volume.volume_id));
    let (entries, next_token) = page(all, max, token)?;
    Ok(VolumePage { entries, next_token })
}

fn snapshot_of(volume_id: &str, snap: &ImageSnapshot) -> Option<Snapshot> {
    let hash = policy::csi_hash(&snap.name)?;
    Some(Snapshot {
        snapshot_id: policy::encode_snapshot_id(volume_id, hash),
        source_volume_id: volume_id.into(),
        size_bytes: snap.size_bytes,
        creation_time: snap.created,
        ready_to_use: true,
    })
}

/// VolumeSnapshotClass parameters: ceph-csi's `clusterID` (must be the source's), the CO's
/// own keys; nothing else.
fn check_snapshot_params(parameters: &[Pair], t: &Target) -> Result<(), Error> {
    for p in parameters {
        match p.key.as_str() {
            "clusterID" if p.value == t.cluster => {}
            "clusterID" => {
                return Err(Error::InvalidArgument(format!("parameter clusterID: {:?} is not the source volume's cluster {}", p.value, t.cluster)));
            }
            k if k.starts_with("csi.storage.k8s.io/") => {}
            k => return Err(Error::InvalidArgument(format!("parameter {k:?} is unknown; snapshots take clusterID only"))),
        }
    }
    Ok(())
}

fn create_snapshot(h: &impl Host, name: &str, source: &str, parameters: &[Pair], s: &[SecretRef]) -> Result<Snapshot, Error> {
    if name.is_empty() {
        return Err(Error::InvalidArgument("snapshot name is empty".into()));
    }
    if policy::decode_volume_id(source).is_none() {
        return Err(Error::NotFound(format!("volume {source} not found")));
    }
    require_credentials(s)?;
    let (t, image, _, snaps) = live_id(h, source, s)?;
    check_snapshot_params(parameters, &t)?;
    let hash = policy::name_hash(name);
    let snap = policy::snap_name(&hash);
    let found = match snaps.into_iter().find(|x| x.name == snap) {
        Some(x) => x,
        None => {
            check_snapshot_name_free(h, name, &hash, source, s)?;
            create_csi_snapshot(h, &t, &image, &snap, source, s)?
        }
    };
    snapshot_of(source, &found).ok_or_else(|| Error::Internal(format!("snapshot {snap} has an unexpected name")))
}

/// kv `snapshots/HASH`: the source volume a CSI snapshot name was taken of. CSI refuses the same
/// name from another source; the RBD snapshot lives on its source image, so without this record
/// that check would scan every image of every pool. The record is written before the snapshot
/// (a crash in between leaves a record of a snapshot that does not exist: it is checked, and
/// overwritten). Records live in the host's store: a controller that lost it still creates and
/// finds snapshots correctly, it only cannot refuse a reused name (docs/ceph-rbd-shim.md).
fn snapshot_key(hash: &str) -> String {
    format!("snapshots/{hash}")
}

fn check_snapshot_name_free(h: &impl Host, name: &str, hash: &str, source: &str, s: &[SecretRef]) -> Result<(), Error> {
    let key = snapshot_key(hash);
    if let Some(prev) = h.kv().get(&key)? {
        let prev = String::from_utf8_lossy(&prev).into_owned();
        if prev != source
            && let Some((pt, pimage)) = policy::decode_volume_id(&prev)
        {
            let taken = match h.rbd().snapshot_list(&pt.pool(s), &pimage) {
                Ok(v) => v.iter().any(|x| x.name == policy::snap_name(hash)),
                Err(Error::NotFound(_)) => false,
                Err(e) => return Err(e),
            };
            if taken {
                return Err(Error::AlreadyExists(format!("snapshot {name} exists with source volume {prev}")));
            }
        }
    }
    h.kv().set(&key, source.as_bytes())
}

fn create_csi_snapshot(h: &impl Host, t: &Target, image: &str, snap: &str, source: &str, s: &[SecretRef]) -> Result<ImageSnapshot, Error> {
    match h.rbd().snapshot_create(&t.pool(s), image, snap) {
        Ok(x) => {
            remember_pool(h, t)?;
            h.log().info("snapshot created", &[("volume", source), ("snapshot", snap)]);
            Ok(x)
        }
        Err(Error::AlreadyExists(_)) => h
            .rbd()
            .snapshot_list(&t.pool(s), image)?
            .into_iter()
            .find(|x| x.name == snap)
            .ok_or_else(|| Error::Aborted(format!("snapshot {snap} is being changed; retry"))),
        Err(e) => Err(e),
    }
}

fn delete_snapshot(h: &impl Host, id: &str, s: &[SecretRef]) -> Result<(), Error> {
    let Some((vid, t, image, snap)) = policy::decode_snapshot_id(id) else { return Ok(()) };
    require_credentials(s)?;
    let snaps = match h.rbd().snapshot_list(&t.pool(s), &image) {
        Ok(v) => v,
        Err(Error::NotFound(_)) => return Ok(()),
        Err(e) => return Err(e),
    };
    let hash = policy::csi_hash(&snap);
    if let Some(found) = snaps.iter().find(|x| policy::csi_hash(&x.name) == hash) {
        // Volumes restored from the snapshot keep their data: clones are flattened first (a
        // group snapshot's part has none: it is restored by copy).
        if !found.name.contains('@') {
            flatten_children(h, &t, &image, &found.name, s)?;
        }
        match h.rbd().snapshot_remove(&t.pool(s), &image, &found.name) {
            Ok(()) | Err(Error::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
        h.log().info("snapshot deleted", &[("snapshot", id)]);
    }
    if let Some(hash) = snap.strip_prefix(policy::SNAP_PREFIX)
        && h.kv().get(&snapshot_key(hash))?.as_deref() == Some(vid.as_bytes())
    {
        h.kv().delete(&snapshot_key(hash))?;
    }
    finish_deferred(h, &t, &image, s)
}

fn list_snapshots(h: &impl Host, snap: Option<&str>, vol: Option<&str>, max: u32, token: &str) -> Result<SnapshotPage, Error> {
    let snaps_of = |t: &Target, image: &str| -> Result<Vec<ImageSnapshot>, Error> {
        match h.rbd().snapshot_list(&t.pool(&[]), image) {
            Ok(v) => Ok(v),
            Err(Error::NotFound(_)) => Ok(vec![]),
            Err(e) => Err(e),
        }
    };
    let mut all: Vec<Snapshot> = vec![];
    if let Some(sid) = snap {
        if let Some((vid, t, image, name)) = policy::decode_snapshot_id(sid) {
            let hash = policy::csi_hash(&name);
            all.extend(snaps_of(&t, &image)?.iter().filter(|x| policy::csi_hash(&x.name) == hash).filter_map(|x| snapshot_of(&vid, x)));
        }
    } else if let Some(vid) = vol {
        if let Some((t, image)) = policy::decode_volume_id(vid) {
            all.extend(snaps_of(&t, &image)?.iter().filter_map(|x| snapshot_of(vid, x)));
        }
    } else {
        for t in known_pools(h)? {
            for image in owned_images(h, &t)? {
                let vid = policy::encode_volume_id(&t, &image);
                all.extend(snaps_of(&t, &image)?.iter().filter_map(|x| snapshot_of(&vid, x)));
            }
        }
    }
    all.retain(|x| vol.is_none_or(|v| v == x.source_volume_id));
    all.sort_by(|a, b| a.snapshot_id.cmp(&b.snapshot_id));
    let (entries, next_token) = page(all, max, token)?;
    Ok(SnapshotPage { entries, next_token })
}

fn validate_volume_capabilities(h: &impl Host, id: &str, caps: &[VolumeCapability], parameters: &[Pair]) -> Result<Option<String>, Error> {
    let (t, image) = policy::decode_volume_id(id).ok_or_else(|| Error::NotFound(format!("volume {id} not found")))?;
    match live(h, &t, &image, &[]) {
        Ok(Some(_)) => {}
        Ok(None) => return Err(Error::NotFound(format!("volume {id} not found"))),
        // No credentials for this pool yet (nothing was created since the host started): the
        // id's form is all that can be checked.
        Err(Error::Unavailable(_)) => {}
        Err(e) => return Err(e),
    }
    if let Err(e) = check_caps(caps) {
        return Ok(Some(e.0));
    }
    if !parameters.is_empty() {
        match Params::parse(parameters.iter().map(|p| (p.key.as_str(), p.value.as_str()))) {
            Err(e) => return Ok(Some(e.0)),
            Ok(p) if p.target != t => return Ok(Some(format!("volume {id} is not in cluster {} pool {}", p.target.cluster, p.target.pool))),
            Ok(_) => {}
        }
    }
    Ok(None)
}

fn get_capacity(h: &impl Host, parameters: &[Pair]) -> Result<Capacity, Error> {
    let p = params(parameters)?;
    let st = h.rbd().stats(&p.target.pool(&[]))?;
    Ok(Capacity { available_bytes: st.available_bytes, maximum_volume_bytes: 0, minimum_volume_bytes: policy::SIZE_UNIT })
}

/// The plan is the id's parts: no cluster traffic on the node. It names ceph-csi's node-stage
/// secret keys (`userID`/`userKey`), which the node maps the image with, by the handles of the
/// NodeStage secrets it was given (0 where it was given none: the node resolves them by key).
fn attach_plan(id: &str, cap: &VolumeCapability, given: &[SecretRef]) -> Result<Attachment, Error> {
    let (t, image) = policy::decode_volume_id(id).ok_or_else(|| Error::NotFound(format!("{id} is not a ceph-rbd-shim volume id")))?;
    let block = matches!(cap.access_type, AccessType::Block);
    policy::check_capability(block, is_multi_writer(cap.access_mode)).map_err(|e| Error::FailedPrecondition(e.0))?;
    let handle = |key: &str| given.iter().find(|r| r.key == key).map_or(0, |r| r.handle);
    let secrets = ["userID", "userKey"].map(|key| SecretRef { key: key.into(), handle: handle(key) }).to_vec();
    Ok(Attachment::Rbd(RbdPlan { cluster: t.cluster, pool: t.pool, image, secrets, encryption: None }))
}

impl Backend for CephRbd {
    fn info() -> BackendInfo {
        use Feature::*;
        BackendInfo {
            name: "ceph-rbd-shim".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            parameters: policy::PARAMETERS.iter().map(|p| (*p).into()).collect(),
            features: vec![
                CreateDeleteVolume,
                CreateDeleteSnapshot,
                ListSnapshots,
                CloneVolume,
                ExpandVolume,
                OnlineExpansion,
                GetCapacity,
                ListVolumes,
                GetVolume,
                SingleNodeMultiWriter,
                NodeExpansion,
                GetSnapshot,
                ModifyVolume,
                GroupSnapshots,
                SelfHealing,
            ],
        }
    }
    fn create_volume(h: &impl Host, req: CreateVolumeRequest) -> Result<Volume, Error> {
        create_volume(h, &req)
    }
    fn delete_volume(h: &impl Host, id: String, secrets: Vec<SecretRef>) -> Result<(), Error> {
        delete_volume(h, &id, &secrets)
    }
    fn expand_volume(
        h: &impl Host,
        id: String,
        cap: CapacityRange,
        capability: Option<VolumeCapability>,
        secrets: Vec<SecretRef>,
    ) -> Result<Expansion, Error> {
        expand_volume(h, &id, &cap, capability.as_ref(), &secrets)
    }
    fn get_volume(h: &impl Host, id: String) -> Result<VolumeStatus, Error> {
        get_volume(h, &id)
    }
    fn modify_volume(h: &impl Host, id: String, mutable_parameters: Vec<Pair>, secrets: Vec<SecretRef>) -> Result<(), Error> {
        modify_volume(h, &id, &mutable_parameters, &secrets)
    }
    fn list_volumes(h: &impl Host, max: u32, token: String) -> Result<VolumePage, Error> {
        list_volumes(h, max, &token)
    }
    fn validate_volume_capabilities(
        h: &impl Host,
        id: String,
        _: Vec<Pair>,
        caps: Vec<VolumeCapability>,
        parameters: Vec<Pair>,
    ) -> Result<Option<String>, Error> {
        validate_volume_capabilities(h, &id, &caps, &parameters)
    }
    fn create_snapshot(h: &impl Host, name: String, source: String, parameters: Vec<Pair>, secrets: Vec<SecretRef>) -> Result<Snapshot, Error> {
        create_snapshot(h, &name, &source, &parameters, &secrets)
    }
    fn delete_snapshot(h: &impl Host, id: String, secrets: Vec<SecretRef>) -> Result<(), Error> {
        delete_snapshot(h, &id, &secrets)
    }
    fn list_snapshots(h: &impl Host, snap: Option<String>, vol: Option<String>, max: u32, token: String) -> Result<SnapshotPage, Error> {
        list_snapshots(h, snap.as_deref(), vol.as_deref(), max, &token)
    }
    fn get_capacity(h: &impl Host, _: Vec<VolumeCapability>, parameters: Vec<Pair>, _: Option<Topology>) -> Result<Capacity, Error> {
        get_capacity(h, &parameters)
    }
    fn attach_plan(_: &impl Host, id: String, _: Vec<Pair>, cap: VolumeCapability, secrets: Vec<SecretRef>) -> Result<Attachment, Error> {
        attach_plan(&id, &cap, &secrets)
    }
    fn create_group_snapshot(
        h: &impl Host,
        name: String,
        source_volume_ids: Vec<String>,
        parameters: Vec<Pair>,
        secrets: Vec<SecretRef>,
    ) -> Result<GroupSnapshot, Error> {
        group::create(h, &name, &source_volume_ids, &parameters, &secrets)
    }
    fn delete_group_snapshot(h: &impl Host, group_snapshot_id: String, snapshot_ids: Vec<String>, secrets: Vec<SecretRef>) -> Result<(), Error> {
        group::delete(h, &group_snapshot_id, &snapshot_ids, &secrets)
    }
    fn get_group_snapshot(
        h: &impl Host,
        group_snapshot_id: String,
        snapshot_ids: Vec<String>,
        secrets: Vec<SecretRef>,
    ) -> Result<GroupSnapshot, Error> {
        group::get(h, &group_snapshot_id, &snapshot_ids, &secrets)
    }
    fn reconcile_volume(h: &impl Host, volume_id: String, now: Timestamp) -> Result<(), Error> {
        reconcile_volume(h, &volume_id, now)
    }
    fn get_snapshot(h: &impl Host, id: String) -> Result<Snapshot, Error> {
        let page = Self::list_snapshots(h, Some(id.clone()), None, 1, String::new())?;
        page.entries.into_iter().next().ok_or_else(|| Error::NotFound(format!("snapshot {id} not found")))
    }
}

wasmcsi_backend_sdk::export!(CephRbd);
