//! The pure policy of the ceph-rbd-shim backend: StorageClass parameters, image features and
//! their dependencies, sizes, deterministic image and snapshot names, volume/snapshot ids, the
//! image metadata this backend writes, and the access modes an RBD image can serve. No I/O
//! here; everything is unit-tested natively.
use wasmcsi_backend_sdk::capacity::Sizing;
pub use wasmcsi_backend_sdk::names::{HASH_HEX, MAX_ID_BYTES, name_hash};
pub use wasmcsi_backend_sdk::rbd::Target;

/// A policy failure: which WIT error case it becomes is decided by the caller (parameters are
/// `invalid-argument`, ids that do not parse are `not-found`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub String);

fn invalid(msg: impl Into<String>) -> Invalid {
    Invalid(msg.into())
}

/// A volume id leaves room for `.HASH` so that every snapshot id of it fits [`MAX_ID_BYTES`] too.
pub const MAX_VOLUME_ID: usize = MAX_ID_BYTES - 1 - HASH_HEX;
/// Default size when the request names none (ceph-csi's default too).
pub const DEFAULT_BYTES: u64 = 1 << 30;
/// RBD sizes are rounded up to whole MiB (what ceph-csi does; object sizes are MiB multiples).
pub const SIZE_UNIT: u64 = 1 << 20;
/// How volumes are sized: the request (default [`DEFAULT_BYTES`]) in whole [`SIZE_UNIT`]s.
pub const SIZING: Sizing = Sizing { default_bytes: DEFAULT_BYTES, unit_bytes: SIZE_UNIT };
/// Default `imageNamePrefix` (ceph-csi's).
pub const DEFAULT_PREFIX: &str = "csi-vol-";
/// Default `imageFeatures`.
pub const DEFAULT_FEATURES: &[&str] = &["layering"];
/// Default `maxCloneDepth`: ceph-csi's `rbdHardMaxCloneDepth` default.
pub const DEFAULT_MAX_CLONE_DEPTH: u32 = 8;
/// Upper bound of `maxCloneDepth` (a long parent chain makes every read walk it).
pub const MAX_CLONE_DEPTH: u32 = 16;
/// Longest `imageNamePrefix`.
pub const MAX_PREFIX: usize = 32;

/// Metadata keys this backend writes on the images it creates.
pub const META_NAME: &str = "csi.wasmcsi.io/name";
/// Every image this backend made (clones inherit it): ListVolumes finds them by it.
pub const META_OWNER: &str = "csi.wasmcsi.io/owner";
/// Image metadata of a volume restored by copy: the snapshot it was copied from
/// (`pool/image@snap`), so a request of the same name from another source is told apart.
pub const META_COPY_OF: &str = "csi.wasmcsi.io/copy-of";
/// A restore by copy no CreateVolume asked for this long is abandoned and deleted: twice the
/// external-provisioner's longest retry backoff (5 min), as replicated-block's
/// `--abandoned-clone-timeout` defaults to.
pub const ABANDONED_RESTORE_SECS: i64 = 600;
pub const OWNER: &str = "wasmcsi-ceph-rbd-shim";

/// RBD snapshot names: a CSI snapshot, a temporary snapshot a clone-from-volume hangs off, and
/// the marker of a volume deleted while CSI snapshots of it exist.
pub const SNAP_PREFIX: &str = "csi-snap-";
pub const TEMP_PREFIX: &str = "csi-tmp-";
pub const DELETED_MARKER: &str = "csi-deleted";

/// The StorageClass parameters this backend takes.
pub const PARAMETERS: &[&str] = &["clusterID", "pool", "dataPool", "imageFeatures", "imageNamePrefix", "imageFormat", "maxCloneDepth"];

/// Features a StorageClass may ask for, and what each needs (librbd refuses the rest anyway;
/// checking here names the parameter and creates nothing).
const FEATURES: &[(&str, &[&str])] =
    &[("layering", &[]), ("exclusive-lock", &[]), ("object-map", &["exclusive-lock"]), ("fast-diff", &["object-map"]), ("deep-flatten", &[])];

/// The StorageClass parameters, parsed and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    pub target: Target,
    pub data_pool: Option<String>,
    /// sorted, deduplicated
    pub features: Vec<String>,
    pub prefix: String,
    pub max_clone_depth: u32,
}

/// Cluster names are the host's `[clusters.NAME]`: 1–32 of `[a-z0-9-]`.
fn check_cluster(v: &str) -> Result<(), Invalid> {
    let ok = !v.is_empty() && v.len() <= 32 && v.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok { Ok(()) } else { Err(invalid(format!("parameter clusterID: {v:?} is not 1-32 of [a-z0-9-]"))) }
}

/// Pool names: 1–63 of `[A-Za-z0-9_-]` (no `.`: it separates the parts of an id).
pub fn check_pool(param: &str, v: &str) -> Result<(), Invalid> {
    let ok = !v.is_empty() && v.len() <= 63 && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok { Ok(()) } else { Err(invalid(format!("parameter {param}: {v:?} is not 1-63 of [A-Za-z0-9_-]"))) }
}

fn parse_features(v: &str) -> Result<Vec<String>, Invalid> {
    let mut out: Vec<String> = Vec::new();
    for f in v.split(',').map(str::trim).filter(|f| !f.is_empty()) {
        if !FEATURES.iter().any(|(n, _)| *n == f) {
            let allowed: Vec<&str> = FEATURES.iter().map(|(n, _)| *n).collect();
            return Err(invalid(format!("parameter imageFeatures: {f:?} is not one of {}", allowed.join(", "))));
        }
        if !out.iter().any(|x| x == f) {
            out.push(f.to_owned());
        }
    }
    if out.is_empty() {
        return Err(invalid("parameter imageFeatures: empty (leave it out for the default, layering)"));
    }
    for f in &out {
        let needs = FEATURES.iter().find(|(n, _)| n == f).map(|(_, d)| *d).unwrap_or(&[]);
        for d in needs {
            if !out.iter().any(|x| x == d) {
                return Err(invalid(format!("parameter imageFeatures: {f} needs {d}")));
            }
        }
    }
    out.sort();
    Ok(out)
}

impl Params {
    /// Parse StorageClass parameters. `csi.storage.k8s.io/*` keys (the CO's and the
    /// provisioner's own) are ignored; anything else unknown is an error naming it.
    pub fn parse<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Self, Invalid> {
        let (mut cluster, mut pool, mut data_pool, mut features, mut prefix, mut depth) = (None, None, None, None, None, None);
        for (k, v) in pairs {
            match k {
                "clusterID" => {
                    check_cluster(v)?;
                    cluster = Some(v.to_owned());
                }
                "pool" => {
                    check_pool("pool", v)?;
                    pool = Some(v.to_owned());
                }
                "dataPool" => {
                    if !v.is_empty() {
                        check_pool("dataPool", v)?;
                        data_pool = Some(v.to_owned());
                    }
                }
                "imageFeatures" => features = Some(parse_features(v)?),
                "imageNamePrefix" => {
                    let ok = !v.is_empty() && v.len() <= MAX_PREFIX && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                    if !ok {
                        return Err(invalid(format!("parameter imageNamePrefix: {v:?} is not 1-{MAX_PREFIX} of [A-Za-z0-9_-]")));
                    }
                    prefix = Some(v.to_owned());
                }
                // ceph-csi's StorageClasses carry it; format 1 images have been gone for years.
                "imageFormat" => {
                    if v != "2" {
                        return Err(invalid(format!("parameter imageFormat: {v:?} is not supported (only 2)")));
                    }
                }
                "maxCloneDepth" => {
                    let d: u32 = v.parse().map_err(|_| invalid(format!("parameter maxCloneDepth: {v:?} is not a number")))?;
                    if d > MAX_CLONE_DEPTH {
                        return Err(invalid(format!("parameter maxCloneDepth: {d} is above {MAX_CLONE_DEPTH}")));
                    }
                    depth = Some(d);
                }
                k if k.starts_with("csi.storage.k8s.io/") => {}
                k => {
                    return Err(invalid(format!("parameter {k:?} is unknown; this backend takes {}", PARAMETERS.join(", "))));
                }
            }
        }
        let cluster = cluster.ok_or_else(|| invalid("parameter clusterID is required (a cluster of the host's [clusters])"))?;
        let pool = pool.ok_or_else(|| invalid("parameter pool is required"))?;
        let p = Params {
            target: Target { cluster, pool },
            data_pool,
            features: features.unwrap_or_else(|| DEFAULT_FEATURES.iter().map(|f| (*f).to_owned()).collect()),
            prefix: prefix.unwrap_or_else(|| DEFAULT_PREFIX.to_owned()),
            max_clone_depth: depth.unwrap_or(DEFAULT_MAX_CLONE_DEPTH),
        };
        // Every id of this StorageClass must fit: checked here so no image is ever created
        // that could not be named.
        let id = encode_volume_id(&p.target, &image_name(&p.prefix, "x"));
        if id.len() > MAX_VOLUME_ID {
            return Err(invalid(format!(
                "parameters clusterID, pool and imageNamePrefix make volume ids of {} bytes; at most {MAX_VOLUME_ID} fit",
                id.len()
            )));
        }
        Ok(p)
    }
}

/// The image of the volume named `request_name`: deterministic, so a retry (after any crash or
/// restart) finds the image an earlier attempt created, without state of our own.
pub fn image_name(prefix: &str, request_name: &str) -> String {
    format!("{prefix}{}", name_hash(request_name))
}

/// The RBD snapshot of the CSI snapshot named `request_name` (deterministic, as images are).
pub fn snap_name(hash: &str) -> String {
    format!("{SNAP_PREFIX}{hash}")
}

/// The temporary snapshot a clone of a volume hangs off, named after the *new* volume so a
/// retried clone finds (and reuses) it.
pub fn temp_snap_name(new_volume: &str) -> String {
    format!("{TEMP_PREFIX}{}", name_hash(new_volume))
}

/// A volume id: `CLUSTER.POOL.IMAGE` (none of the three contains a `.`).
pub fn encode_volume_id(t: &Target, image: &str) -> String {
    format!("{}.{}.{image}", t.cluster, t.pool)
}

/// A volume id back into its parts; `None` for anything this backend does not make.
pub fn decode_volume_id(id: &str) -> Option<(Target, String)> {
    let mut it = id.split('.');
    let (cluster, pool, image) = (it.next()?, it.next()?, it.next()?);
    if it.next().is_some() || check_cluster(cluster).is_err() || check_pool("pool", pool).is_err() {
        return None;
    }
    let ok = !image.is_empty() && image.len() <= MAX_PREFIX + HASH_HEX && image.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    ok.then(|| (Target { cluster: cluster.into(), pool: pool.into() }, image.into()))
}

/// A snapshot id: the source volume's id and the snapshot's hash, `VOLUME_ID.HASH`; the RBD
/// snapshot is `IMAGE@csi-snap-HASH` (ceph-csi-like: the id says image and snapshot).
pub fn encode_snapshot_id(volume_id: &str, hash: &str) -> String {
    format!("{volume_id}.{hash}")
}

/// A snapshot id back into (volume id, target, image, RBD snapshot name).
pub fn decode_snapshot_id(id: &str) -> Option<(String, Target, String, String)> {
    let (vol, hash) = id.rsplit_once('.')?;
    if hash.len() != HASH_HEX || !hash.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()) {
        return None;
    }
    let (t, image) = decode_volume_id(vol)?;
    Some((vol.to_owned(), t, image, snap_name(hash)))
}

/// Marks the group id's last part: `CLUSTER.POOL.group-HASH`.
pub const GROUP_PREFIX: &str = "group-";

/// The hash of the group snapshot named `csi_name`, hashed apart from VolumeSnapshot names so a
/// VolumeSnapshot and a VolumeGroupSnapshot of one name never meet. Its members' ids are
/// `VOLUME_ID.HASH` like any snapshot's; each is the image's part of the RBD group snapshot
/// [`member_snap_name`].
pub fn group_hash(csi_name: &str) -> String {
    name_hash(&format!("group:{csi_name}"))
}

/// The RBD group recording the group snapshot of `hash` (one group per group snapshot).
pub fn group_name(hash: &str) -> String {
    format!("{GROUP_NAME_PREFIX}{hash}")
}

/// Marks the RBD groups of this backend.
pub const GROUP_NAME_PREFIX: &str = "csi-group-";

/// An image's part of the group snapshot of `hash`, as the host names it: `GROUP@SNAP`.
pub fn member_snap_name(hash: &str) -> String {
    format!("{}@{}", group_name(hash), snap_name(hash))
}

/// The hash of a CSI snapshot's RBD snapshot (an ordinary `csi-snap-HASH` or a group member
/// `csi-group-HASH@csi-snap-HASH`); `None` for any other snapshot.
pub fn csi_hash(rbd_snap: &str) -> Option<&str> {
    let hash = match rbd_snap.split_once('@') {
        Some((group, snap)) => {
            let hash = snap.strip_prefix(SNAP_PREFIX)?;
            (group.strip_prefix(GROUP_NAME_PREFIX)? == hash).then_some(hash)?
        }
        None => rbd_snap.strip_prefix(SNAP_PREFIX)?,
    };
    (hash.len() == HASH_HEX).then_some(hash)
}

/// A group snapshot id: where its members live (every member is in one pool) and their hash.
pub fn encode_group_id(t: &Target, hash: &str) -> String {
    format!("{}.{}.{GROUP_PREFIX}{hash}", t.cluster, t.pool)
}

/// A group snapshot id back into (target, hash); `None` for anything this backend does not make.
pub fn decode_group_id(id: &str) -> Option<(Target, String)> {
    let (t, last) = decode_volume_id(id)?;
    let hash = last.strip_prefix(GROUP_PREFIX)?;
    (hash.len() == HASH_HEX && hash.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))).then(|| (t, hash.to_owned()))
}

/// Whether an RBD image can serve an access mode for an access type. A filesystem on an RBD
/// image is single-node (two kernels mounting ext4/xfs read-write corrupt it): multi-node
/// writers are refused for `mount`; a raw block device may be shared (the application, e.g. a
/// VM live migration, coordinates the writers), as ceph-csi allows.
pub fn check_capability(block: bool, mode_multi_writer: bool) -> Result<(), Invalid> {
    if !block && mode_multi_writer {
        return Err(invalid("rbd filesystem volumes are single-node: multi-node writer access needs volumeMode Block"));
    }
    Ok(())
}

/// The depth of a new clone whose source image has `source_depth` ancestors, and whether it
/// must be flattened right after cloning: above `max` the chain would grow without bound,
/// so the new image copies its data and stands alone (ceph-csi's hard clone depth).
pub fn clone_plan(source_depth: u32, max: u32) -> (u32, bool) {
    let depth = source_depth + 1;
    if depth > max { (0, true) } else { (depth, false) }
}

/// `pool/image@snap` (librbd's spelling of a parent) into its parts.
pub fn parse_parent(s: &str) -> Option<(String, String, String)> {
    let (pool, rest) = s.split_once('/')?;
    let (image, snap) = rest.split_once('@')?;
    Some((pool.into(), image.into(), snap.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(kv: &[(&str, &str)]) -> Result<Params, Invalid> {
        Params::parse(kv.iter().copied())
    }

    #[test]
    fn parameters_parse_with_defaults_and_ignore_the_cos_own_keys() {
        let p = parse(&[("clusterID", "ceph-a"), ("pool", "rbd"), ("csi.storage.k8s.io/fstype", "ext4")]).expect("valid");
        assert_eq!(p.target, Target { cluster: "ceph-a".into(), pool: "rbd".into() });
        assert_eq!(p.features, ["layering"]);
        assert_eq!((p.prefix.as_str(), p.max_clone_depth), ("csi-vol-", 8));
        assert_eq!(p.data_pool, None);
        let p = parse(&[
            ("clusterID", "c"),
            ("pool", "p"),
            ("dataPool", "ec"),
            ("imageFeatures", "layering, fast-diff,object-map,exclusive-lock,layering"),
            ("imageNamePrefix", "k8s-"),
            ("imageFormat", "2"),
            ("maxCloneDepth", "0"),
        ])
        .expect("valid");
        assert_eq!(p.features, ["exclusive-lock", "fast-diff", "layering", "object-map"]);
        assert_eq!((p.data_pool.as_deref(), p.prefix.as_str(), p.max_clone_depth), (Some("ec"), "k8s-", 0));
    }

    #[test]
    fn bad_parameters_name_the_parameter() {
        let base = [("clusterID", "c"), ("pool", "p")];
        assert!(parse(&[("pool", "p")]).expect_err("no cluster").0.contains("clusterID"));
        assert!(parse(&[("clusterID", "c")]).expect_err("no pool").0.contains("pool"));
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("clusterID", "C_1")], "clusterID"),
            (&[("colour", "red")], "colour"),
            (&[("pool", "a.b")], "pool"),
            (&[("dataPool", "x/y")], "dataPool"),
            (&[("imageFeatures", "journaling")], "imageFeatures"),
            (&[("imageFeatures", "object-map")], "imageFeatures"),
            (&[("imageFeatures", "layering,fast-diff,exclusive-lock")], "imageFeatures"),
            (&[("imageFeatures", " , ")], "imageFeatures"),
            (&[("imageNamePrefix", "a.b")], "imageNamePrefix"),
            (&[("imageNamePrefix", "")], "imageNamePrefix"),
            (&[("imageFormat", "1")], "imageFormat"),
            (&[("maxCloneDepth", "-1")], "maxCloneDepth"),
            (&[("maxCloneDepth", "17")], "maxCloneDepth"),
        ];
        for (extra, name) in cases {
            let mut kv: Vec<(&str, &str)> = base.to_vec();
            for (k, v) in *extra {
                kv.retain(|(x, _)| x != k);
                kv.push((k, v));
            }
            let e = parse(&kv).expect_err("invalid");
            assert!(e.0.contains(name), "{extra:?}: {e:?}");
        }
        let long_pool = "p".repeat(60);
        let e = parse(&[("clusterID", &"c".repeat(32)), ("pool", &long_pool)]).expect_err("too long");
        assert!(e.0.contains("volume ids"), "{e:?}");
    }

    #[test]
    fn ids_round_trip_and_fit() {
        let t = Target { cluster: "c".repeat(32), pool: "p".repeat(12) };
        let image = image_name("csi-vol-", "pvc-0f2c4a5e-1b2c-4d3e-9f00-123456789abc");
        assert_eq!(image.len(), 8 + HASH_HEX);
        assert_eq!(image, image_name("csi-vol-", "pvc-0f2c4a5e-1b2c-4d3e-9f00-123456789abc"), "deterministic");
        assert_ne!(image, image_name("csi-vol-", "pvc-other"));
        // Pinned: images made by earlier versions must keep their names.
        assert_eq!(image_name("csi-vol-", "pvc-1"), "csi-vol-f2868e1aa7cab669");
        let id = encode_volume_id(&t, &image);
        assert!(id.len() <= MAX_VOLUME_ID, "{}", id.len());
        assert_eq!(decode_volume_id(&id), Some((t.clone(), image.clone())));
        let hash = name_hash("snapshot-1");
        let sid = encode_snapshot_id(&id, &hash);
        assert!(sid.len() <= MAX_ID_BYTES);
        assert_eq!(decode_snapshot_id(&sid), Some((id.clone(), t.clone(), image, format!("csi-snap-{hash}"))));
        for bad in ["", "a.b", "a.b.c.d", "A.p.i", "c.p.", "c.p.a@b", "../x"] {
            assert_eq!(decode_volume_id(bad), None, "{bad}");
        }
        assert_eq!(decode_snapshot_id(&id), None, "a volume id is no snapshot id");
        assert_eq!(decode_snapshot_id(&format!("{id}.XYZ")), None);
        // A group id fits (its last part is no longer than the shortest image name) and says
        // where its members live.
        let ghash = group_hash("vgs-1");
        assert_ne!(ghash, name_hash("vgs-1"), "apart from a VolumeSnapshot of the same name");
        let gid = encode_group_id(&t, &ghash);
        assert!(gid.len() <= MAX_VOLUME_ID + 1 + HASH_HEX, "{}", gid.len());
        assert_eq!(decode_group_id(&gid), Some((t.clone(), ghash.clone())));
        for bad in [id.as_str(), "c.p.group-XYZ", "c.p.group-", sid.as_str()] {
            assert_eq!(decode_group_id(bad), None, "{bad}");
        }
        // Both kinds of CSI snapshot lead back to their hash; nothing else does.
        assert_eq!(csi_hash(&snap_name(&hash)), Some(hash.as_str()));
        assert_eq!(csi_hash(&member_snap_name(&ghash)), Some(ghash.as_str()));
        let mixed = format!("{}@{}", group_name(&ghash), snap_name(&hash));
        for other in [DELETED_MARKER, "csi-tmp-0123456789abcdef", mixed.as_str(), "csi-snap-short", "x@y"] {
            assert_eq!(csi_hash(other), None, "{other}");
        }
    }

    #[test]
    fn sizes_round_up_to_mib_within_limits() {
        let capacity = |required, limit| SIZING.resolve(required, limit);
        assert_eq!(capacity(0, 0), Ok(DEFAULT_BYTES));
        assert_eq!(capacity(1, 0), Ok(SIZE_UNIT));
        assert_eq!(capacity(SIZE_UNIT + 1, 0), Ok(2 * SIZE_UNIT));
        assert_eq!(capacity(0, 5 * SIZE_UNIT), Ok(5 * SIZE_UNIT));
        assert_eq!(capacity(SIZE_UNIT + 1, 2 * SIZE_UNIT + 5), Ok(2 * SIZE_UNIT));
        assert!(capacity(SIZE_UNIT + 1, SIZE_UNIT + 2).is_err());
        assert!(capacity(5, 4).is_err());
        assert!(capacity(u64::MAX, 0).is_err());
    }

    #[test]
    fn filesystems_are_single_node_blocks_may_be_shared() {
        assert!(check_capability(false, false).is_ok());
        assert!(check_capability(true, true).is_ok());
        assert!(check_capability(false, true).is_err());
    }

    #[test]
    fn clones_past_the_depth_limit_are_flattened() {
        assert_eq!(clone_plan(0, 8), (1, false));
        assert_eq!(clone_plan(7, 8), (8, false));
        assert_eq!(clone_plan(8, 8), (0, true));
        assert_eq!(clone_plan(0, 0), (0, true), "0 = every clone is a full copy");
        assert_eq!(parse_parent("p/img@s"), Some(("p".into(), "img".into(), "s".into())));
        assert_eq!(parse_parent("img@s"), None);
    }
}
