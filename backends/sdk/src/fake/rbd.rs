//! The fake `rbd`: granted pools of images with snapshots, clones and metadata, following the
//! host's librbd client: a pool not added is permission-denied; removing an image with
//! snapshots, or a snapshot with clones, is failed-precondition; removing an absent image or
//! snapshot succeeds; a clone copies its parent's metadata (librbd does) and is sized like the
//! snapshot; flattening detaches it; a protected snapshot without clones is removed (the host
//! unprotects it first). Clones do not require a protected snapshot (clone v2). Secret handles
//! are accepted and ignored. `set-qos` writes the image metadata keys the host writes
//! ([`QOS_KEYS`]). A group snapshot `group@snap` is one snapshot `GROUP@SNAP` per image, all with
//! one timestamp, recorded with its images (the same request again returns them; other images:
//! already-exists); such a snapshot is removed on its own like any other, but cannot be cloned
//! (not-found, as Ceph 16.2 answers), only copied. `snapshot-copy` makes the image at once and
//! answers `copying` the first time, `done` after, as a host's background copy would.
use super::{Clock, Journal};
use crate::rbd::{CopyProgress, ImageInfo, ImageSnapshot, PoolStats, Rbd, RbdPool, Target};
use crate::types::{Error, IoLimits};
use std::cell::RefCell;
use std::collections::BTreeMap;

const TOTAL_BYTES: u64 = 100 << 30;

use crate::rbd::QOS_KEYS;

/// One image as the fake holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeImage {
    pub size_bytes: u64,
    pub features: Vec<String>,
    pub data_pool: Option<String>,
    pub metadata: BTreeMap<String, String>,
    /// (pool, image, snapshot) of the parent while a clone is not flattened
    pub parent: Option<(String, String, String)>,
    /// oldest first
    pub snapshots: Vec<ImageSnapshot>,
}

#[derive(Debug, Default)]
struct Pool {
    images: BTreeMap<String, FakeImage>,
    total_bytes: Option<u64>,
    /// group snapshots `(group, snap)` and the images they were taken of
    groups: BTreeMap<(String, String), Vec<String>>,
}

#[derive(Debug, Default)]
pub struct FakeRbd {
    pools: RefCell<BTreeMap<Target, Pool>>,
    /// copies started and not yet answered `done`: (cluster, pool, image)
    copying: RefCell<std::collections::BTreeSet<(String, String, String)>>,
    clock: Clock,
    pub journal: Journal,
}

fn not_granted(t: &Target) -> Error {
    Error::PermissionDenied(format!("pool {:?} of cluster {:?} is not granted to this backend", t.pool, t.cluster))
}

fn no_image(t: &Target, name: &str) -> Error {
    Error::NotFound(format!("image {}/{name} does not exist", t.pool))
}

impl FakeRbd {
    /// Grant a pool (empty) of a cluster.
    pub fn add_pool(&self, cluster: &str, pool: &str) -> Target {
        let t = Target::new(cluster, pool);
        self.pools.borrow_mut().entry(t.clone()).or_default();
        t
    }
    /// The size `stats` reports for a pool; available = size − image sizes.
    pub fn set_total_bytes(&self, t: &Target, bytes: u64) {
        if let Some(p) = self.pools.borrow_mut().get_mut(t) {
            p.total_bytes = Some(bytes);
        }
    }
    /// An image, for assertions.
    pub fn image(&self, t: &Target, name: &str) -> Option<FakeImage> {
        self.pools.borrow().get(t).and_then(|p| p.images.get(name).cloned())
    }
    /// The names of a pool's images, in order.
    pub fn images(&self, t: &Target) -> Vec<String> {
        self.pools.borrow().get(t).map(|p| p.images.keys().cloned().collect()).unwrap_or_default()
    }
    pub fn fail_next(&self, op: &str, error: Error) {
        self.journal.fail_next(op, error)
    }

    fn with<T>(
        &self,
        op: &str,
        t: &Target,
        f: impl FnOnce(&mut BTreeMap<Target, Pool>) -> Result<T, Error>,
    ) -> Result<T, Error> {
        self.journal.enter(op)?;
        let mut pools = self.pools.borrow_mut();
        if !pools.contains_key(t) {
            return Err(not_granted(t));
        }
        f(&mut pools)
    }
}

fn image<'a>(pools: &'a mut BTreeMap<Target, Pool>, t: &Target, name: &str) -> Result<&'a mut FakeImage, Error> {
    pools.get_mut(t).and_then(|p| p.images.get_mut(name)).ok_or_else(|| no_image(t, name))
}

/// Clones (`pool/image`) of `image@snap` in every pool of `t`'s cluster.
fn children_of(pools: &BTreeMap<Target, Pool>, t: &Target, image: &str, snap: &str) -> Vec<String> {
    let parent = (t.pool.clone(), image.to_owned(), snap.to_owned());
    let mut out: Vec<String> = pools
        .iter()
        .filter(|(pt, _)| pt.cluster == t.cluster)
        .flat_map(|(pt, p)| {
            p.images
                .iter()
                .filter(|(_, i)| i.parent.as_ref() == Some(&parent))
                .map(move |(n, _)| format!("{}/{n}", pt.pool))
        })
        .collect();
    out.sort();
    out
}

impl Rbd for FakeRbd {
    fn create(
        &self,
        pool: &RbdPool,
        name: &str,
        size_bytes: u64,
        features: &[String],
        data_pool: Option<&str>,
        metadata: &[(String, String)],
    ) -> Result<(), Error> {
        let t = &Target::of(pool);
        self.with("create", t, |pools| {
            if let Some(dp) = data_pool {
                let dt = Target::new(t.cluster.clone(), dp);
                if !pools.contains_key(&dt) {
                    return Err(not_granted(&dt));
                }
            }
            let pool = pools.get_mut(t).ok_or_else(|| not_granted(t))?;
            if pool.images.contains_key(name) {
                return Err(Error::AlreadyExists(format!("image {}/{name} exists", t.pool)));
            }
            let img = FakeImage {
                size_bytes,
                features: features.to_vec(),
                data_pool: data_pool.map(str::to_owned),
                metadata: metadata.iter().cloned().collect(),
                parent: None,
                snapshots: vec![],
            };
            pool.images.insert(name.to_owned(), img);
            Ok(())
        })
    }
    fn info(&self, pool: &RbdPool, name: &str) -> Result<Option<ImageInfo>, Error> {
        let t = &Target::of(pool);
        self.with("info", t, |pools| {
            Ok(pools.get(t).and_then(|p| p.images.get(name)).map(|i| ImageInfo {
                name: name.to_owned(),
                size_bytes: i.size_bytes,
                features: i.features.clone(),
                parent: i.parent.as_ref().map(|(p, im, s)| format!("{p}/{im}@{s}")),
                metadata: i.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            }))
        })
    }
    fn find_by_metadata(&self, pool: &RbdPool, key: &str, value: &str) -> Result<Vec<String>, Error> {
        let t = &Target::of(pool);
        self.with("find_by_metadata", t, |pools| {
            let images = pools.get(t).map(|p| &p.images).into_iter().flatten();
            Ok(images
                .filter(|(_, i)| i.metadata.get(key).is_some_and(|v| v == value))
                .map(|(n, _)| n.clone())
                .collect())
        })
    }
    fn remove(&self, pool: &RbdPool, name: &str) -> Result<(), Error> {
        let t = &Target::of(pool);
        self.with("remove", t, |pools| {
            let pool = pools.get_mut(t).ok_or_else(|| not_granted(t))?;
            match pool.images.get(name) {
                None => Ok(()),
                Some(i) if !i.snapshots.is_empty() => {
                    Err(Error::FailedPrecondition(format!("image {}/{name} has snapshots", t.pool)))
                }
                Some(_) => {
                    pool.images.remove(name);
                    Ok(())
                }
            }
        })
    }
    fn resize(&self, pool: &RbdPool, name: &str, size_bytes: u64) -> Result<(), Error> {
        let t = &Target::of(pool);
        self.with("resize", t, |pools| {
            let i = image(pools, t, name)?;
            if size_bytes < i.size_bytes {
                return Err(Error::OutOfRange(format!(
                    "image {name} has {} bytes; shrinking to {size_bytes} is not supported",
                    i.size_bytes
                )));
            }
            i.size_bytes = size_bytes;
            Ok(())
        })
    }
    fn snapshot_create(&self, pool: &RbdPool, name: &str, snap: &str) -> Result<ImageSnapshot, Error> {
        let t = &Target::of(pool);
        let now = self.clock.now();
        self.with("snapshot_create", t, |pools| {
            let i = image(pools, t, name)?;
            if i.snapshots.iter().any(|s| s.name == snap) {
                return Err(Error::AlreadyExists(format!("snapshot {name}@{snap} exists")));
            }
            let s = ImageSnapshot { name: snap.to_owned(), size_bytes: i.size_bytes, protected: false, created: now };
            i.snapshots.push(s.clone());
            Ok(s)
        })
    }
    fn snapshot_remove(&self, pool: &RbdPool, name: &str, snap: &str) -> Result<(), Error> {
        let t = &Target::of(pool);
        self.with("snapshot_remove", t, |pools| {
            let children = children_of(pools, t, name, snap);
            let i = image(pools, t, name)?;
            if !i.snapshots.iter().any(|s| s.name == snap) {
                return Ok(());
            }
            if !children.is_empty() {
                return Err(Error::FailedPrecondition(format!(
                    "snapshot {name}@{snap} has clones: {}",
                    children.join(", ")
                )));
            }
            i.snapshots.retain(|s| s.name != snap);
            Ok(())
        })
    }
    fn snapshot_protect(&self, pool: &RbdPool, name: &str, snap: &str) -> Result<(), Error> {
        let t = &Target::of(pool);
        self.with("snapshot_protect", t, |pools| {
            let i = image(pools, t, name)?;
            let s = i
                .snapshots
                .iter_mut()
                .find(|s| s.name == snap)
                .ok_or_else(|| Error::NotFound(format!("snapshot {name}@{snap} does not exist")))?;
            s.protected = true;
            Ok(())
        })
    }
    fn snapshot_list(&self, pool: &RbdPool, name: &str) -> Result<Vec<ImageSnapshot>, Error> {
        let t = &Target::of(pool);
        self.with("snapshot_list", t, |pools| Ok(image(pools, t, name)?.snapshots.clone()))
    }
    fn clone_image(
        &self,
        pool: &RbdPool,
        name: &str,
        snap: &str,
        child_pool: &str,
        child: &str,
        features: &[String],
    ) -> Result<(), Error> {
        let t = &Target::of(pool);
        self.with("clone_image", t, |pools| {
            let ct = Target::new(t.cluster.clone(), child_pool);
            if !pools.contains_key(&ct) {
                return Err(not_granted(&ct));
            }
            let parent = image(pools, t, name)?;
            let s = parent
                .snapshots
                .iter()
                // A group snapshot's part is not found by name (Ceph 16.2 clones user snapshots).
                .find(|s| s.name == snap && !snap.contains('@'))
                .ok_or_else(|| Error::NotFound(format!("snapshot {name}@{snap} does not exist")))?;
            let clone = FakeImage {
                size_bytes: s.size_bytes,
                features: features.to_vec(),
                data_pool: None,
                metadata: parent.metadata.clone(),
                parent: Some((t.pool.clone(), name.to_owned(), snap.to_owned())),
                snapshots: vec![],
            };
            let pool = pools.get_mut(&ct).ok_or_else(|| not_granted(&ct))?;
            if pool.images.contains_key(child) {
                return Err(Error::AlreadyExists(format!("image {child_pool}/{child} exists")));
            }
            pool.images.insert(child.to_owned(), clone);
            Ok(())
        })
    }
    fn flatten(&self, pool: &RbdPool, name: &str) -> Result<(), Error> {
        let t = &Target::of(pool);
        self.with("flatten", t, |pools| {
            image(pools, t, name)?.parent = None;
            Ok(())
        })
    }
    fn children(&self, pool: &RbdPool, name: &str, snap: &str) -> Result<Vec<String>, Error> {
        let t = &Target::of(pool);
        self.with("children", t, |pools| {
            if !image(pools, t, name)?.snapshots.iter().any(|s| s.name == snap) {
                return Err(Error::NotFound(format!("snapshot {name}@{snap} does not exist")));
            }
            Ok(children_of(pools, t, name, snap))
        })
    }
    fn stats(&self, pool: &RbdPool) -> Result<PoolStats, Error> {
        let t = &Target::of(pool);
        self.with("stats", t, |pools| {
            let pool = pools.get(t).ok_or_else(|| not_granted(t))?;
            let total = pool.total_bytes.unwrap_or(TOTAL_BYTES);
            let used: u64 = pool.images.values().map(|i| i.size_bytes).sum();
            Ok(PoolStats { total_bytes: total, available_bytes: total.saturating_sub(used) })
        })
    }
    fn set_qos(&self, pool: &RbdPool, image_name: &str, limits: &IoLimits) -> Result<(), Error> {
        let t = &Target::of(pool);
        self.with("set_qos", t, |pools| {
            let i = image(pools, t, image_name)?;
            let values =
                [limits.read_iops, limits.write_iops, limits.read_bytes_per_second, limits.write_bytes_per_second];
            for (key, value) in QOS_KEYS.iter().zip(values) {
                match value {
                    0 => i.metadata.remove(*key),
                    v => i.metadata.insert((*key).to_owned(), v.to_string()),
                };
            }
            Ok(())
        })
    }
    fn group_snapshot(
        &self,
        pool: &RbdPool,
        group: &str,
        images: &[String],
        snap: &str,
    ) -> Result<Vec<ImageSnapshot>, Error> {
        let t = &Target::of(pool);
        let now = self.clock.now();
        let member = format!("{group}@{snap}");
        self.with("group_snapshot", t, |pools| {
            if images.is_empty() {
                return Err(Error::InvalidArgument("a group snapshot needs at least one image".into()));
            }
            let mut seen = std::collections::BTreeSet::new();
            if let Some(twice) = images.iter().find(|i| !seen.insert(i.as_str())) {
                return Err(Error::InvalidArgument(format!("image {twice} is named twice in the group")));
            }
            for name in images {
                image(pools, t, name)?;
            }
            let key = (group.to_owned(), snap.to_owned());
            let recorded = pools.get(t).and_then(|p| p.groups.get(&key)).cloned();
            match recorded {
                Some(was) if was != images => {
                    return Err(Error::AlreadyExists(format!("group snapshot {member} exists with other images")));
                }
                Some(_) => {}
                None => {
                    for name in images {
                        let i = image(pools, t, name)?;
                        let size_bytes = i.size_bytes;
                        i.snapshots.push(ImageSnapshot {
                            name: member.clone(),
                            size_bytes,
                            protected: false,
                            created: now,
                        });
                    }
                    pools.get_mut(t).ok_or_else(|| not_granted(t))?.groups.insert(key, images.to_vec());
                }
            }
            images
                .iter()
                .map(|n| {
                    let found = image(pools, t, n)?.snapshots.iter().find(|s| s.name == member).cloned();
                    found.ok_or_else(|| {
                        Error::AlreadyExists(format!("image {n} has no part in group snapshot {member}"))
                    })
                })
                .collect()
        })
    }
    fn group_snapshot_remove(&self, pool: &RbdPool, group: &str, snap: &str) -> Result<(), Error> {
        let t = &Target::of(pool);
        let member = format!("{group}@{snap}");
        self.with("group_snapshot_remove", t, |pools| {
            let p = pools.get_mut(t).ok_or_else(|| not_granted(t))?;
            p.groups.remove(&(group.to_owned(), snap.to_owned()));
            for i in p.images.values_mut() {
                i.snapshots.retain(|s| s.name != member);
            }
            Ok(())
        })
    }
    fn snapshot_copy(
        &self,
        pool: &RbdPool,
        name: &str,
        snap: &str,
        child_pool: &str,
        child: &str,
        features: &[String],
        metadata: &[(String, String)],
    ) -> Result<CopyProgress, Error> {
        let t = &Target::of(pool);
        let key = (t.cluster.clone(), child_pool.to_owned(), child.to_owned());
        self.with("snapshot_copy", t, |pools| {
            let ct = Target::new(t.cluster.clone(), child_pool);
            if !pools.contains_key(&ct) {
                return Err(not_granted(&ct));
            }
            if pools.get(&ct).is_some_and(|p| p.images.contains_key(child)) {
                // Started by an earlier call (answered done now), or complete.
                self.copying.borrow_mut().remove(&key);
                return Ok(CopyProgress { done: true, bytes: 0 });
            }
            let source = image(pools, t, name)?;
            let s = source
                .snapshots
                .iter()
                .find(|s| s.name == snap)
                .ok_or_else(|| Error::NotFound(format!("snapshot {name}@{snap} does not exist")))?;
            let mut meta = source.metadata.clone();
            meta.extend(metadata.iter().cloned());
            let copy = FakeImage {
                size_bytes: s.size_bytes,
                features: features.to_vec(),
                data_pool: None,
                metadata: meta,
                parent: None,
                snapshots: vec![],
            };
            pools.get_mut(&ct).ok_or_else(|| not_granted(&ct))?.images.insert(child.to_owned(), copy);
            self.copying.borrow_mut().insert(key.clone());
            Ok(CopyProgress { done: false, bytes: 0 })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_pin_their_snapshot_until_flattened() {
        let r = FakeRbd::default();
        let t = r.add_pool("c", "p");
        let p = &t.pool(&[]);
        let meta = [("k".to_owned(), "v".to_owned())];
        r.create(p, "img", 10, &[], None, &meta).expect("create");
        assert!(matches!(r.create(p, "img", 10, &[], None, &[]), Err(Error::AlreadyExists(_))));
        r.snapshot_create(p, "img", "s").expect("snapshot");
        r.clone_image(p, "img", "s", "p", "child", &[]).expect("clone");
        let info = r.info(p, "child").expect("info").expect("exists");
        assert_eq!(
            (info.parent.as_deref(), info.metadata.as_slice(), info.size_bytes),
            (Some("p/img@s"), &meta[..], 10)
        );
        assert_eq!(r.children(p, "img", "s"), Ok(vec!["p/child".to_owned()]));
        assert!(matches!(r.snapshot_remove(p, "img", "s"), Err(Error::FailedPrecondition(_))));
        assert!(matches!(r.remove(p, "img"), Err(Error::FailedPrecondition(_))), "it has a snapshot");
        r.flatten(p, "child").expect("flatten");
        r.snapshot_remove(p, "img", "s").expect("no clones left");
        r.snapshot_remove(p, "img", "s").expect("absent snapshot");
        r.remove(p, "img").expect("remove");
        r.remove(p, "img").expect("absent image");
        assert!(matches!(r.snapshot_list(p, "img"), Err(Error::NotFound(_))));
        assert!(matches!(r.resize(p, "child", 5), Err(Error::OutOfRange(_))));
        assert!(matches!(r.info(&Target::new("c", "other").pool(&[]), "x"), Err(Error::PermissionDenied(_))));
        assert_eq!(r.find_by_metadata(p, "k", "v"), Ok(vec!["child".to_owned()]));
    }

    #[test]
    fn qos_limits_are_image_metadata() {
        let r = FakeRbd::default();
        let p = &r.add_pool("c", "p").pool(&[]);
        r.create(p, "img", 10, &[], None, &[]).expect("create");
        let limits =
            IoLimits { read_iops: 100, write_iops: 0, read_bytes_per_second: 0, write_bytes_per_second: 1 << 20 };
        r.set_qos(p, "img", &limits).expect("set");
        let meta = r.image(&Target::of(p), "img").expect("image").metadata;
        assert_eq!(meta.get("conf_rbd_qos_read_iops_limit").map(String::as_str), Some("100"));
        assert_eq!(meta.get("conf_rbd_qos_write_bps_limit").map(String::as_str), Some("1048576"));
        assert!(!meta.contains_key("conf_rbd_qos_write_iops_limit"), "0 sets no limit");
        r.set_qos(p, "img", &IoLimits::UNLIMITED).expect("lift");
        assert!(r.image(&Target::of(p), "img").expect("image").metadata.is_empty());
        assert!(matches!(r.set_qos(p, "nope", &limits), Err(Error::NotFound(_))));
    }

    #[test]
    fn group_snapshots_are_one_part_per_image_removed_alone_or_together_and_copied_not_cloned() {
        let r = FakeRbd::default();
        let p = &r.add_pool("c", "p").pool(&[]);
        for n in ["a", "b", "c"] {
            r.create(p, n, 10, &[], None, &[("k".into(), n.into())]).expect("create");
        }
        let ab = ["a".to_owned(), "b".to_owned()];
        assert!(matches!(r.group_snapshot(p, "g", &[], "s"), Err(Error::InvalidArgument(_))));
        assert!(matches!(r.group_snapshot(p, "g", &["a".into(), "a".into()], "s"), Err(Error::InvalidArgument(_))));
        assert!(matches!(r.group_snapshot(p, "g", &["a".into(), "nope".into()], "s"), Err(Error::NotFound(_))));
        let taken = r.group_snapshot(p, "g", &ab, "s").expect("group");
        assert_eq!(taken.iter().map(|x| x.name.as_str()).collect::<Vec<_>>(), ["g@s", "g@s"]);
        assert_eq!(taken[0].created, taken[1].created, "one point");
        assert_eq!(r.group_snapshot(p, "g", &ab, "s").expect("again"), taken);
        assert!(matches!(r.group_snapshot(p, "g", &["a".into(), "c".into()], "s"), Err(Error::AlreadyExists(_))));
        // An image is in any number of group snapshots.
        r.group_snapshot(p, "h", &["a".into(), "c".into()], "s").expect("another group");
        assert_eq!(r.snapshot_list(p, "a").expect("list").len(), 2);
        // Not clonable; copied in the background (copying, then done), metadata overlaid.
        assert!(matches!(r.clone_image(p, "a", "g@s", "p", "x", &[]), Err(Error::NotFound(_))));
        let md = [("k".to_owned(), "x".to_owned())];
        assert_eq!(r.snapshot_copy(p, "a", "g@s", "p", "x", &[], &md), Ok(CopyProgress { done: false, bytes: 0 }));
        assert_eq!(r.snapshot_copy(p, "a", "g@s", "p", "x", &[], &md), Ok(CopyProgress { done: true, bytes: 0 }));
        let x = r.image(&Target::of(p), "x").expect("copied");
        assert_eq!((x.parent, x.metadata.get("k").map(String::as_str)), (None, Some("x")));
        // A part goes on its own; the group snapshot removes the rest.
        r.snapshot_remove(p, "a", "g@s").expect("alone");
        assert_eq!(r.snapshot_list(p, "b").expect("list").len(), 1);
        r.group_snapshot_remove(p, "g", "s").expect("remove");
        r.group_snapshot_remove(p, "g", "s").expect("absent");
        assert!(r.snapshot_list(p, "b").expect("list").is_empty());
        assert_eq!(r.snapshot_list(p, "a").expect("list").len(), 1, "h@s stays");
    }
}
