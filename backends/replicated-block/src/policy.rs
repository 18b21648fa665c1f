//! The pure policy of the replicated-block backend: StorageClass parameters, sizes, volume and
//! snapshot ids derived from CSI names, replica placement (selector, spreading, most free space
//! first, distinct nodes before distinct disks of one node), the capacity a new volume can still
//! get, the volume condition, and when a lost replica is replaced. No I/O here; everything is
//! unit-tested natively.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use sha2::{Digest, Sha256};

/// A policy failure; the caller decides which WIT error case it becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub String);

fn invalid(msg: impl Into<String>) -> Invalid {
    Invalid(msg.into())
}

/// CSI's limit on an id is 128 bytes; the host prefixes `BACKEND:` and allows a backend 95.
pub const MAX_ID: usize = 95;
/// Hex digits of a name hash in ids (64 bits).
pub const HASH_HEX: usize = 16;
/// Readable part of a volume id (from the CSI name), so `pvc-…` stays visible on the nodes.
const READABLE: usize = 40;
/// Default size when the request names none.
pub const DEFAULT_BYTES: u64 = 1 << 30;
/// Sizes are whole MiB: the engine's regions are 1 MiB, and it keeps the arithmetic simple.
pub const SIZE_UNIT: u64 = 1 << 20;
/// Default and largest `numberOfReplicas`.
pub const DEFAULT_REPLICAS: u32 = 3;
pub const MAX_REPLICAS: u32 = 16;
/// Default `staleReplicaTimeout` (Longhorn's StorageClass example uses 30 minutes too).
pub const DEFAULT_STALE_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// Shortest `staleReplicaTimeout`: below it a node reboot would cost a full rebuild.
pub const MIN_STALE_TIMEOUT: Duration = Duration::from_secs(5);
/// The filesystem of a mount volume whose capability names none.
pub const DEFAULT_FS: &str = "ext4";
/// The filesystems the node side can make and grow.
pub const FILESYSTEMS: &[&str] = &["ext4", "xfs"];

/// Snapshot names in the engine's chain: `csi-snap-HASH` (hash of the CSI snapshot name).
pub const SNAP_PREFIX: &str = "csi-snap-";

/// Engine snapshots backups are read from: `csi-backup-HASH` (hash of the CSI snapshot name).
/// Not CSI snapshots (their CSI snapshot is the backup on its target, [`backup_snapshot_id`]):
/// the newest one of a volume stays in its chain as the base of its next incremental backup.
pub const BACKUP_PREFIX: &str = "csi-backup-";
/// Longest backup target name a backup's snapshot id can carry (`VOLUME.HASH.TARGET` within
/// [`MAX_ID`]).
pub const MAX_TARGET: usize = MAX_ID - (57 + 1 + HASH_HEX + 1);

/// The VolumeSnapshotClass parameters this backend takes.
pub const SNAPSHOT_PARAMETERS: &[&str] = &["type", "target"];

/// What a VolumeSnapshotClass asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotKind {
    /// A snapshot in the replicas' chain (`type: snapshot`, the default).
    Local,
    /// A snapshot uploaded to a backup target (`type: backup`, `target: NAME`).
    Backup { target: String },
}

/// The snapshot class's parameters.
pub fn parse_snapshot_parameters(params: &[(String, String)]) -> Result<SnapshotKind, Invalid> {
    let (mut kind, mut target) = (None, None);
    for (k, v) in params {
        match k.as_str() {
            "type" => kind = Some(v.trim().to_owned()),
            "target" => target = Some(v.trim().to_owned()),
            other if other.starts_with("csi.storage.k8s.io/") => {}
            other => {
                return Err(invalid(format!(
                    "unknown snapshot parameter {other:?} (this backend takes {SNAPSHOT_PARAMETERS:?})"
                )));
            }
        }
    }
    match (kind.as_deref(), target) {
        (None | Some("snapshot"), None) => Ok(SnapshotKind::Local),
        (None | Some("snapshot"), Some(_)) => Err(invalid("parameter target is for type: backup")),
        (Some("backup"), Some(t)) if is_target_name(&t) => Ok(SnapshotKind::Backup { target: t }),
        (Some("backup"), Some(t)) => {
            Err(invalid(format!("target {t:?}: a backup target's name is 1 to {MAX_TARGET} of [a-z0-9-]")))
        }
        (Some("backup"), None) => Err(invalid("type: backup needs parameter target (a backup target's name)")),
        (Some(other), _) => Err(invalid(format!("type {other:?} is not snapshot or backup"))),
    }
}

fn is_target_name(t: &str) -> bool {
    (1..=MAX_TARGET).contains(&t.len()) && t.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// The engine snapshot (and backup name) of the CSI snapshot `csi_name` of class `type: backup`.
pub fn backup_name(csi_name: &str) -> String {
    format!("{BACKUP_PREFIX}{}", name_hash(csi_name))
}

/// `VOLUME.HASH.TARGET`: the snapshot id of backup `backup` (made by [`backup_name`]) on
/// `target`. A target name has no `.`, so a local snapshot id (two parts) is never one.
pub fn backup_snapshot_id(volume_id: &str, backup: &str, target: &str) -> Option<String> {
    let hash = backup.strip_prefix(BACKUP_PREFIX)?;
    (is_volume_id(volume_id) && is_target_name(target)).then(|| format!("{volume_id}.{hash}.{target}"))
}

/// The volume id, backup name and target a backup's snapshot id names.
pub fn parse_backup_snapshot_id(id: &str) -> Option<(String, String, String)> {
    let (local, target) = id.rsplit_once('.')?;
    let (volume, snap) = parse_snapshot_id(local)?;
    let hash = snap.strip_prefix(SNAP_PREFIX)?;
    is_target_name(target).then(|| (volume, format!("{BACKUP_PREFIX}{hash}"), target.to_owned()))
}

/// Metadata keys kept with every replica set this backend makes.
pub const META_NAME: &str = "csi.name";
pub const META_REPLICAS: &str = "numberOfReplicas";
pub const META_SELECTOR: &str = "replicaNodeSelector";
pub const META_SPREAD: &str = "replicaSpreadKey";
pub const META_STALE: &str = "staleReplicaTimeoutSeconds";
pub const META_FS: &str = "fsType";
/// Set when DeleteVolume found snapshots: the volume is gone for CSI, its replicas stay until
/// the last snapshot is deleted (CSI snapshots outlive their source).
pub const META_DELETED: &str = "deleted";

/// The StorageClass parameters this backend takes.
pub const PARAMETERS: &[&str] =
    &["numberOfReplicas", "replicaNodeSelector", "replicaSpreadKey", "staleReplicaTimeout", "fsType"];

/// A volume's placement and healing policy, from its StorageClass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub replicas: u32,
    /// Labels every replica node must carry: `key=value`, or `key` for any value.
    pub selector: Vec<(String, Option<String>)>,
    /// Replicas go to distinct values of this node label when the nodes allow it.
    pub spread_key: Option<String>,
    pub stale_timeout: Duration,
    /// Filesystem for mount volumes whose capability names none.
    pub fs_type: String,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            replicas: DEFAULT_REPLICAS,
            selector: Vec::new(),
            spread_key: None,
            stale_timeout: DEFAULT_STALE_TIMEOUT,
            fs_type: DEFAULT_FS.into(),
        }
    }
}

/// A `numberOfReplicas` value: 1 to [`MAX_REPLICAS`].
pub fn parse_replicas(v: &str) -> Result<u32, Invalid> {
    v.trim()
        .parse::<u32>()
        .ok()
        .filter(|n| (1..=MAX_REPLICAS).contains(n))
        .ok_or_else(|| invalid(format!("numberOfReplicas {v:?} is not a number from 1 to {MAX_REPLICAS}")))
}

/// Checks every StorageClass parameter before anything is created; unknown ones are refused
/// (a typo must not silently give three replicas instead of two). The host's and Kubernetes'
/// own keys (`csi.storage.k8s.io/*`) pass.
pub fn parse_parameters(params: &[(String, String)]) -> Result<Policy, Invalid> {
    let mut p = Policy::default();
    for (k, v) in params {
        match k.as_str() {
            "numberOfReplicas" => p.replicas = parse_replicas(v)?,
            "replicaNodeSelector" => p.selector = parse_selector(v)?,
            "replicaSpreadKey" => {
                let key = v.trim();
                if !key.is_empty() {
                    check_label_key(key).map_err(|e| invalid(format!("replicaSpreadKey: {e}")))?;
                    p.spread_key = Some(key.to_owned());
                }
            }
            "staleReplicaTimeout" => p.stale_timeout = parse_duration(v)?,
            "fsType" | "csi.storage.k8s.io/fstype" => {
                let fs = v.trim();
                if !fs.is_empty() {
                    if !FILESYSTEMS.contains(&fs) {
                        return Err(invalid(format!("{k} {fs:?} is not one of {FILESYSTEMS:?}")));
                    }
                    p.fs_type = fs.to_owned();
                }
            }
            other if other.starts_with("csi.storage.k8s.io/") => {}
            other => {
                return Err(invalid(format!("unknown parameter {other:?} (this backend takes {PARAMETERS:?})")));
            }
        }
    }
    Ok(p)
}

/// `key=value,key2,key3=value` (every label must match); empty: any node.
pub fn parse_selector(s: &str) -> Result<Vec<(String, Option<String>)>, Invalid> {
    let mut out = Vec::new();
    for term in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (k, v) = match term.split_once('=') {
            Some((k, v)) => (k.trim(), Some(v.trim().to_owned())),
            None => (term, None),
        };
        check_label_key(k).map_err(|e| invalid(format!("replicaNodeSelector {s:?}: {e}")))?;
        out.push((k.to_owned(), v));
    }
    Ok(out)
}

/// A Kubernetes label key: optional `prefix/` (a DNS subdomain) and a name of at most 63
/// characters of `[A-Za-z0-9._-]`, starting and ending alphanumeric.
fn check_label_key(key: &str) -> Result<(), String> {
    let name = key.rsplit_once('/').map_or(key, |(prefix, name)| {
        if prefix.is_empty() || prefix.len() > 253 {
            return "";
        }
        name
    });
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && name.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && name.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric());
    if ok { Ok(()) } else { Err(format!("{key:?} is not a label key")) }
}

/// Minutes as a bare number (Longhorn's unit), or a number with `s`, `m`, `h`.
pub fn parse_duration(v: &str) -> Result<Duration, Invalid> {
    let v = v.trim();
    let bad = || invalid(format!("staleReplicaTimeout {v:?} is not a duration (minutes, or 90s, 30m, 2h)"));
    let (digits, unit) = match v.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => v.split_at(i),
        None => (v, "m"),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let secs = match unit {
        "s" => Some(n),
        "m" => n.checked_mul(60),
        "h" => n.checked_mul(3600),
        _ => None,
    }
    .ok_or_else(bad)?;
    let d = Duration::from_secs(secs);
    if d < MIN_STALE_TIMEOUT {
        return Err(invalid(format!("staleReplicaTimeout {v:?} is below the minimum of {MIN_STALE_TIMEOUT:?}")));
    }
    Ok(d)
}

/// A selector as the StorageClass writes it (`key=value,key2`).
fn selector_text(selector: &[(String, Option<String>)]) -> String {
    let terms: Vec<String> =
        selector.iter().map(|(k, v)| v.as_ref().map_or_else(|| k.clone(), |v| format!("{k}={v}"))).collect();
    terms.join(",")
}

/// The policy as kept in a set's metadata, and back.
pub fn policy_metadata(name: &str, p: &Policy) -> Vec<(String, String)> {
    let mut m = vec![
        (META_NAME.to_owned(), name.to_owned()),
        (META_REPLICAS.to_owned(), p.replicas.to_string()),
        (META_STALE.to_owned(), p.stale_timeout.as_secs().to_string()),
        (META_FS.to_owned(), p.fs_type.clone()),
    ];
    if !p.selector.is_empty() {
        m.push((META_SELECTOR.to_owned(), selector_text(&p.selector)));
    }
    if let Some(k) = &p.spread_key {
        m.push((META_SPREAD.to_owned(), k.clone()));
    }
    m
}

/// Writes the keys a VolumeAttributesClass may change (replica count, selector, stale timeout)
/// of `p` into a set's metadata `m`, keeping every other key.
pub fn update_policy_metadata(m: &mut BTreeMap<String, String>, p: &Policy) {
    m.insert(META_REPLICAS.to_owned(), p.replicas.to_string());
    m.insert(META_STALE.to_owned(), p.stale_timeout.as_secs().to_string());
    if p.selector.is_empty() {
        m.remove(META_SELECTOR);
    } else {
        m.insert(META_SELECTOR.to_owned(), selector_text(&p.selector));
    }
}

/// Reads back what [`policy_metadata`] stored; a missing or damaged key takes its default, so
/// a set is always healable.
pub fn policy_from_metadata(m: &BTreeMap<String, String>) -> Policy {
    let d = Policy::default();
    Policy {
        replicas: m.get(META_REPLICAS).and_then(|v| v.parse().ok()).unwrap_or(d.replicas),
        selector: m.get(META_SELECTOR).and_then(|v| parse_selector(v).ok()).unwrap_or_default(),
        spread_key: m.get(META_SPREAD).cloned(),
        stale_timeout: m
            .get(META_STALE)
            .and_then(|v| v.parse().ok())
            .map(Duration::from_secs)
            .unwrap_or(d.stale_timeout),
        fs_type: m.get(META_FS).cloned().unwrap_or(d.fs_type),
    }
}

/// The size to create for a CSI capacity range: `required` rounded up to whole MiB (the
/// default when unset), refused when that exceeds `limit`.
pub fn size_for(required: u64, limit: u64) -> Result<u64, Invalid> {
    let want = if required == 0 { DEFAULT_BYTES.min(if limit == 0 { u64::MAX } else { limit }) } else { required };
    let rounded = want
        .checked_next_multiple_of(SIZE_UNIT)
        .ok_or_else(|| invalid(format!("size {want} cannot be rounded to whole MiB")))?;
    if limit != 0 && rounded > limit {
        return Err(invalid(format!(
            "required {required} bytes rounds up to {rounded} (whole MiB), above the limit of {limit}"
        )));
    }
    Ok(rounded.max(SIZE_UNIT))
}

/// Hex of the first 64 bits of sha256(`s`).
pub fn name_hash(s: &str) -> String {
    let digest = Sha256::digest(s.as_bytes());
    digest.iter().take(HASH_HEX / 2).map(|b| format!("{b:02x}")).collect()
}

/// The volume id of a CSI name: a readable part (lowercase letters, digits and `-` of the
/// name, at most 40) and the name's hash. Never contains `.` (it separates snapshot ids), at
/// most 57 bytes, so every snapshot id of it fits [`MAX_ID`].
pub fn volume_id(name: &str) -> String {
    let readable: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
        .take(READABLE)
        .collect();
    let readable = readable.trim_matches('-');
    if readable.is_empty() { format!("v-{}", name_hash(name)) } else { format!("{readable}-{}", name_hash(name)) }
}

/// Whether `id` has the form [`volume_id`] gives (a backend must answer NOT_FOUND, never touch
/// anything, for an id it did not make).
pub fn is_volume_id(id: &str) -> bool {
    let Some((readable, hash)) = id.rsplit_once('-') else { return false };
    !readable.is_empty()
        && readable.len() <= READABLE
        && readable.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && hash.len() == HASH_HEX
        && hash.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The engine snapshot name of a CSI snapshot name.
pub fn snapshot_name(csi_name: &str) -> String {
    format!("{SNAP_PREFIX}{}", name_hash(csi_name))
}

/// `VOLUME.HASH`: the snapshot id of `snapshot` (an engine name made by [`snapshot_name`]).
pub fn snapshot_id(volume_id: &str, snapshot: &str) -> Option<String> {
    let hash = snapshot.strip_prefix(SNAP_PREFIX)?;
    Some(format!("{volume_id}.{hash}"))
}

/// Prefix of a group snapshot's id: `group-HASH`, the hash of its CSI name.
pub const GROUP_PREFIX: &str = "group-";

/// The engine snapshot name every member of the group snapshot `csi_name` has in its volume's
/// chain: an ordinary snapshot name ([`SNAP_PREFIX`]), hashed from the name apart from the
/// VolumeSnapshots', so a VolumeSnapshot and a VolumeGroupSnapshot of one name never meet.
pub fn group_snapshot_name(csi_name: &str) -> String {
    format!("{SNAP_PREFIX}{}", name_hash(&format!("group:{csi_name}")))
}

/// `group-HASH`: the id of the group whose members are named `snapshot` (see
/// [`group_snapshot_name`]); each member's own id is [`snapshot_id`] of its volume.
pub fn group_id(snapshot: &str) -> Option<String> {
    Some(format!("{GROUP_PREFIX}{}", snapshot.strip_prefix(SNAP_PREFIX)?))
}

/// The engine snapshot name of a group id's members.
pub fn parse_group_id(id: &str) -> Option<String> {
    let hash = id.strip_prefix(GROUP_PREFIX)?;
    (hash.len() == HASH_HEX && hash.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        .then(|| format!("{SNAP_PREFIX}{hash}"))
}

/// The volume id and engine snapshot name a snapshot id names.
pub fn parse_snapshot_id(id: &str) -> Option<(String, String)> {
    let (volume, hash) = id.split_once('.')?;
    let ok = is_volume_id(volume) && hash.len() == HASH_HEX && hash.bytes().all(|b| b.is_ascii_hexdigit());
    ok.then(|| (volume.to_owned(), format!("{SNAP_PREFIX}{hash}")))
}

/// A replica node as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub name: String,
    /// Free bytes of all its disks.
    pub free: u64,
    pub labels: BTreeMap<String, String>,
    /// The disks (replica roots) the node's replica server keeps replicas on. Empty: a host
    /// that does not report disks; the node is one disk of `free` bytes then.
    pub disks: Vec<Disk>,
}

/// One disk of a replica node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disk {
    pub name: String,
    pub free: u64,
}

/// Where one replica is: a node and, when known, its disk (`None`: the host's one disk of the
/// node, or a replica whose disk nobody reported).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Slot {
    pub node: String,
    pub disk: Option<String>,
}

impl Slot {
    pub fn new(node: impl Into<String>, disk: Option<&str>) -> Self {
        Self { node: node.into(), disk: disk.map(str::to_owned) }
    }
}

impl std::fmt::Display for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.disk {
            Some(disk) => write!(f, "{}/{disk}", self.node),
            None => f.write_str(&self.node),
        }
    }
}

impl Candidate {
    fn matches(&self, selector: &[(String, Option<String>)]) -> bool {
        selector.iter().all(|(k, v)| match (self.labels.get(k), v) {
            (Some(_), None) => true,
            (Some(have), Some(want)) => have == want,
            (None, _) => false,
        })
    }

    /// Its disks, or the whole node as one unnamed disk when the host reports none.
    fn disks(&self) -> Vec<(Option<&str>, u64)> {
        if self.disks.is_empty() {
            vec![(None, self.free)]
        } else {
            self.disks.iter().map(|d| (Some(d.name.as_str()), d.free)).collect()
        }
    }
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Chooses `count` places for new replicas with a soft anti-affinity: eligible nodes (the
/// selector, a disk with `size` bytes free) that hold no replica of the set first — most free
/// space first, on distinct values of the spread key while any are left —, then, when there
/// are fewer such nodes than replicas, distinct disks of nodes that hold one already (the node
/// with the fewest replicas of the set first, then the disk with the most free space). Every
/// replica gets the disk with the most free space of its node that the set does not use yet.
/// `taken` are the replicas the set keeps (and the spread values their nodes use).
pub fn place(
    nodes: &[Candidate],
    policy: &Policy,
    size: u64,
    count: usize,
    taken: &[Slot],
) -> Result<Vec<Slot>, Invalid> {
    let mut used: BTreeSet<Slot> = taken.iter().cloned().collect();
    let holds = |used: &BTreeSet<Slot>, node: &str| used.iter().filter(|s| s.node == node).count();
    // What is still free on a node for this set: its disks with room the set does not use.
    let open = |used: &BTreeSet<Slot>, c: &Candidate| -> Vec<(Option<String>, u64)> {
        let mut disks: Vec<(Option<String>, u64)> = c
            .disks()
            .into_iter()
            .filter(|(d, free)| *free >= size && !used.contains(&Slot::new(c.name.as_str(), *d)))
            .map(|(d, free)| (d.map(str::to_owned), free))
            .collect();
        disks.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        disks
    };
    let mut eligible: Vec<&Candidate> =
        nodes.iter().filter(|n| n.matches(&policy.selector) && !open(&used, n).is_empty()).collect();
    let open_disks: usize = eligible.iter().map(|n| open(&used, n).len()).sum();
    if open_disks < count {
        let selector = if policy.selector.is_empty() { String::new() } else { " matching replicaNodeSelector".into() };
        return Err(invalid(format!(
            "cannot place {} with {size} bytes free{selector}: {}, {}; {count} needed ({} found; replicas go \
             to distinct nodes, else to distinct disks of a node)",
            plural(count, "replica", "replicas"),
            plural(eligible.len(), "eligible node", "eligible nodes"),
            plural(open_disks, "disk", "disks"),
            plural(nodes.len(), "node", "nodes"),
        )));
    }
    eligible.sort_by(|a, b| b.free.cmp(&a.free).then_with(|| a.name.cmp(&b.name)));
    let spread_of = |c: &Candidate| policy.spread_key.as_ref().and_then(|k| c.labels.get(k).cloned());
    let mut spread: BTreeSet<String> =
        taken.iter().filter_map(|t| nodes.iter().find(|n| n.name == t.node)).filter_map(spread_of).collect();
    let mut chosen: Vec<Slot> = Vec::new();
    let take = |used: &mut BTreeSet<Slot>, chosen: &mut Vec<Slot>, c: &Candidate| {
        if let Some((disk, _)) = open(used, c).into_iter().next() {
            let slot = Slot { node: c.name.clone(), disk };
            used.insert(slot.clone());
            chosen.push(slot);
        }
    };
    // Distinct nodes. First pass: a new spread value each; second pass: whoever is left.
    for c in &eligible {
        if chosen.len() == count {
            break;
        }
        if holds(&used, &c.name) > 0 {
            continue;
        }
        match spread_of(c) {
            Some(v) if spread.contains(&v) => continue,
            Some(v) => {
                spread.insert(v);
            }
            None if policy.spread_key.is_some() => continue,
            None => {}
        }
        take(&mut used, &mut chosen, c);
    }
    for c in &eligible {
        if chosen.len() == count {
            break;
        }
        if holds(&used, &c.name) == 0 {
            take(&mut used, &mut chosen, c);
        }
    }
    // Fewer nodes than replicas: distinct disks of the nodes that hold one, evenly.
    while chosen.len() < count {
        let Some(c) = eligible
            .iter()
            .filter(|c| !open(&used, c).is_empty())
            .min_by(|a, b| {
                let best = |c: &Candidate| open(&used, c).first().map_or(0, |d| d.1);
                holds(&used, &a.name)
                    .cmp(&holds(&used, &b.name))
                    .then_with(|| best(b).cmp(&best(a)))
                    .then_with(|| a.name.cmp(&b.name))
            })
            .copied()
        else {
            break;
        };
        take(&mut used, &mut chosen, c);
    }
    Ok(chosen)
}

/// What a new volume of `policy` can still get: every replica needs a disk of its own with the
/// space (on a node of its own when there are enough), so it is the free space of the
/// `replicas`-th best eligible disk (0 with too few).
pub fn capacity(nodes: &[Candidate], policy: &Policy) -> u64 {
    let mut free: Vec<u64> = nodes
        .iter()
        .filter(|n| n.matches(&policy.selector))
        .flat_map(|n| n.disks().into_iter().map(|(_, free)| free))
        .collect();
    free.sort_unstable_by(|a, b| b.cmp(a));
    let n = policy.replicas as usize;
    if free.len() < n { 0 } else { free[n - 1] / SIZE_UNIT * SIZE_UNIT }
}

/// One replica of a set as the condition and healing see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaView {
    pub slot: Slot,
    pub state: ReplicaHealth,
    /// When it stopped being healthy, seconds since the Unix epoch.
    pub down_since: Option<u64>,
    pub rebuilt: u64,
    pub rebuild_total: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaHealth {
    Healthy,
    Rebuilding,
    Stale,
    Unreachable,
}

/// The volume condition: abnormal unless every wanted replica is healthy; the message says how
/// many are, how far a rebuild is, and when replicas share a node (the soft anti-affinity gave
/// way: a node's loss takes more than one replica, so the volume is not node-redundant). Sharing
/// a node alone is not abnormal: it is what the cluster allows, and every replica is whole.
pub fn condition(replicas: &[ReplicaView], wanted: u32) -> (bool, String) {
    let healthy = replicas.iter().filter(|r| r.state == ReplicaHealth::Healthy).count();
    let mut parts = vec![format!("{healthy}/{wanted} replicas healthy")];
    for r in replicas {
        match r.state {
            ReplicaHealth::Healthy => {}
            ReplicaHealth::Rebuilding => {
                let pct = (r.rebuilt.min(r.rebuild_total) * 100).checked_div(r.rebuild_total).unwrap_or(0);
                parts.push(format!("{} rebuilding {pct}%", r.slot));
            }
            ReplicaHealth::Stale => parts.push(format!("{} waits for a rebuild", r.slot)),
            ReplicaHealth::Unreachable => parts.push(format!("{} unreachable", r.slot)),
        }
    }
    let nodes: BTreeSet<&str> = replicas.iter().map(|r| r.slot.node.as_str()).collect();
    if replicas.len() > 1 && nodes.len() < replicas.len() {
        parts.push(format!(
            "not node-redundant: {} on {} (distinct disks)",
            plural(replicas.len(), "replica", "replicas"),
            plural(nodes.len(), "node", "nodes")
        ));
    }
    let abnormal = healthy < wanted as usize;
    let message = if abnormal { format!("degraded: {}", parts.join(", ")) } else { parts.join(", ") };
    (abnormal, message)
}

/// The replicas to move because their node no longer matches the policy's selector (a
/// VolumeAttributesClass changed it), in the set's order. Only replicas on nodes the host lists
/// count: one whose node is gone is `overdue`'s, not this.
pub fn off_selector(replicas: &[Slot], nodes: &[Candidate], policy: &Policy) -> Vec<Slot> {
    replicas
        .iter()
        .filter(|r| nodes.iter().any(|n| n.name == r.node && !n.matches(&policy.selector)))
        .cloned()
        .collect()
}

/// The next replica to move to a node matching the selector, and where: one at a time, and only
/// while every replica is healthy (a move rebuilds the new replica from the others; the next
/// waits until that rebuild is done, so the set never has two replicas being filled). `None`:
/// nothing to move, or not now.
pub fn next_move(
    replicas: &[ReplicaView],
    nodes: &[Candidate],
    policy: &Policy,
    size: u64,
) -> Result<Option<(Slot, Slot)>, Invalid> {
    if replicas.iter().any(|r| r.state != ReplicaHealth::Healthy) {
        return Ok(None);
    }
    let slots: Vec<Slot> = replicas.iter().map(|r| r.slot.clone()).collect();
    let Some(from) = off_selector(&slots, nodes, policy).into_iter().next() else { return Ok(None) };
    // The whole set stays taken: the new replica lands where none is, the moved one included.
    let to = place(nodes, policy, size, 1, &slots)?.into_iter().next();
    Ok(to.map(|to| (from, to)))
}

/// What the set's replica count needs next, one replica at a time and only while every
/// replica is healthy (an added one is rebuilt from the others; one is removed only once the
/// rest are whole): `Grow(place)` for a new replica, `Shrink(replica)` for one to remove, `None`
/// when the count is the policy's, or not now. The one removed is, in this order, one on a node
/// the selector excludes, one sharing its node with another (it adds no node redundancy), one
/// not on `attached` (the engine's node reads its own replica without a network hop); the
/// last of the set's order among those.
pub fn next_count_change(
    replicas: &[ReplicaView],
    nodes: &[Candidate],
    policy: &Policy,
    size: u64,
    attached: Option<&str>,
) -> Result<Option<CountChange>, Invalid> {
    let wanted = policy.replicas as usize;
    if replicas.len() == wanted || replicas.iter().any(|r| r.state != ReplicaHealth::Healthy) {
        return Ok(None);
    }
    let slots: Vec<Slot> = replicas.iter().map(|r| r.slot.clone()).collect();
    if replicas.len() < wanted {
        return Ok(place(nodes, policy, size, 1, &slots)?.into_iter().next().map(CountChange::Grow));
    }
    let excluded = off_selector(&slots, nodes, policy);
    let shares = |s: &Slot| slots.iter().filter(|o| o.node == s.node).count() > 1;
    let remote = |s: &Slot| attached != Some(s.node.as_str());
    // `max_by_key` keeps the last of equals: the set's last replica among the best.
    let victim = slots.iter().max_by_key(|s| (excluded.contains(s), shares(s), remote(s))).cloned();
    Ok(victim.map(CountChange::Shrink))
}

/// See [`next_count_change`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CountChange {
    Grow(Slot),
    Shrink(Slot),
}

/// Replicas whose node has been unreachable for longer than the policy waits, at `now`
/// (seconds since the Unix epoch): these are replaced; a replica that comes back in time is
/// only rebuilt (a delta).
pub fn overdue(replicas: &[ReplicaView], policy: &Policy, now: u64) -> Vec<Slot> {
    replicas
        .iter()
        .filter(|r| r.state == ReplicaHealth::Unreachable)
        .filter(|r| r.down_since.is_some_and(|t| now.saturating_sub(t) >= policy.stale_timeout.as_secs()))
        .map(|r| r.slot.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(k: &str, v: &str) -> (String, String) {
        (k.to_owned(), v.to_owned())
    }

    fn node(name: &str, free_gib: u64, labels: &[(&str, &str)]) -> Candidate {
        Candidate {
            name: name.into(),
            free: free_gib << 30,
            labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            disks: Vec::new(),
        }
    }

    /// A node with named disks of these sizes (GiB).
    fn node_with_disks(name: &str, disks: &[(&str, u64)]) -> Candidate {
        Candidate {
            name: name.into(),
            free: disks.iter().map(|(_, gib)| gib << 30).sum(),
            labels: BTreeMap::new(),
            disks: disks.iter().map(|(d, gib)| Disk { name: (*d).into(), free: gib << 30 }).collect(),
        }
    }

    /// Every slot holding a whole, healthy replica.
    fn healthy(slots: &[Slot]) -> Vec<ReplicaView> {
        slots
            .iter()
            .map(|slot| ReplicaView {
                slot: slot.clone(),
                state: ReplicaHealth::Healthy,
                down_since: None,
                rebuilt: 0,
                rebuild_total: 0,
            })
            .collect()
    }

    fn shown(slots: &[Slot]) -> Vec<String> {
        slots.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn parameters_are_checked_and_named() {
        let ok = parse_parameters(&[
            p("numberOfReplicas", "2"),
            p("replicaNodeSelector", "storage=ssd, wasmcsi.io/replicas"),
            p("replicaSpreadKey", "topology.kubernetes.io/zone"),
            p("staleReplicaTimeout", "90s"),
            p("csi.storage.k8s.io/fstype", "xfs"),
            p("csi.storage.k8s.io/pvc/name", "data"),
        ])
        .expect("valid");
        assert_eq!(ok.replicas, 2);
        assert_eq!(ok.selector, vec![("storage".into(), Some("ssd".into())), ("wasmcsi.io/replicas".into(), None)]);
        assert_eq!(ok.spread_key.as_deref(), Some("topology.kubernetes.io/zone"));
        assert_eq!(ok.stale_timeout, Duration::from_secs(90));
        assert_eq!(ok.fs_type, "xfs");
        assert_eq!(parse_parameters(&[]).expect("defaults"), Policy::default());
        for (k, v) in [
            ("numberOfReplicas", "0"),
            ("numberOfReplicas", "99"),
            ("numberOfReplicas", "x"),
            ("replicaNodeSelector", "-bad=1"),
            ("replicaSpreadKey", "a b"),
            ("staleReplicaTimeout", "1s"),
            ("staleReplicaTimeout", "soon"),
            ("fsType", "ntfs"),
            ("numberOfReplica", "2"),
        ] {
            let e = parse_parameters(&[p(k, v)]).expect_err(&format!("{k}={v} must be refused"));
            assert!(e.0.contains(k) || e.0.contains(&k[..k.len() - 1]), "{k}={v}: {}", e.0);
        }
        assert_eq!(parse_duration("30").expect("minutes"), Duration::from_secs(1800));
        assert_eq!(parse_duration("2h").expect("hours"), Duration::from_secs(7200));
    }

    #[test]
    fn the_policy_survives_its_metadata_round_trip() {
        let policy = parse_parameters(&[
            p("numberOfReplicas", "2"),
            p("replicaNodeSelector", "a=b,c"),
            p("replicaSpreadKey", "zone"),
            p("staleReplicaTimeout", "45s"),
        ])
        .expect("valid");
        let m: BTreeMap<String, String> = policy_metadata("pvc-1", &policy).into_iter().collect();
        assert_eq!(m[META_NAME], "pvc-1");
        assert_eq!(policy_from_metadata(&m), policy);
        assert_eq!(policy_from_metadata(&BTreeMap::new()), Policy::default(), "a damaged record heals with defaults");
    }

    #[test]
    fn sizes_round_to_whole_mib_within_the_limit() {
        assert_eq!(size_for(0, 0), Ok(DEFAULT_BYTES));
        assert_eq!(size_for(1, 0), Ok(SIZE_UNIT));
        assert_eq!(size_for(SIZE_UNIT + 1, 0), Ok(2 * SIZE_UNIT));
        assert_eq!(size_for(0, 10 * SIZE_UNIT), Ok(10 * SIZE_UNIT));
        assert!(size_for(SIZE_UNIT + 1, SIZE_UNIT + 100).is_err());
        assert!(size_for(u64::MAX, 0).is_err());
    }

    #[test]
    fn ids_are_deterministic_bounded_and_parse_back() {
        let names = ["pvc-0a1b2c3d-aaaa-bbbb-cccc-0123456789ab", "Ünïcödé name/with:stuff", "", "a", &"x".repeat(128)];
        let mut seen = BTreeSet::new();
        for n in names {
            let id = volume_id(n);
            assert_eq!(id, volume_id(n));
            assert!(id.len() <= MAX_ID - 1 - HASH_HEX, "{id}");
            assert!(!id.contains('.') && is_volume_id(&id), "{id}");
            assert!(seen.insert(id.clone()));
            let snap = snapshot_name("snapshot-1");
            let sid = snapshot_id(&id, &snap).expect("ours");
            assert!(sid.len() <= MAX_ID, "{sid}");
            assert_eq!(parse_snapshot_id(&sid), Some((id, snap)));
        }
        assert!(volume_id("pvc-1").starts_with("pvc-1-"));
        for bad in ["", "x", "nope.1234", "UPPER-0123456789abcdef", "a-0123", "../etc-0123456789abcdef"] {
            assert!(!is_volume_id(bad) && parse_snapshot_id(bad).is_none(), "{bad}");
        }
        assert_eq!(snapshot_id("v-0123456789abcdef", "not-ours"), None);
    }

    #[test]
    fn backup_snapshot_ids_round_trip_fit_the_id_limit_and_are_no_local_snapshot_ids() {
        let long = "x".repeat(300);
        for name in ["pvc-1", long.as_str()] {
            let (id, b) = (volume_id(name), backup_name(&format!("snapshot-{name}")));
            let target = "t".repeat(MAX_TARGET);
            let sid = backup_snapshot_id(&id, &b, &target).expect("ours");
            assert!(sid.len() <= MAX_ID, "{sid}");
            assert_eq!(parse_backup_snapshot_id(&sid), Some((id.clone(), b.clone(), target.clone())));
            assert_eq!(parse_snapshot_id(&sid), None, "a backup is no local snapshot");
            assert_eq!(backup_snapshot_id(&id, &b, &format!("{target}t")), None, "too long a target");
        }
        let local = snapshot_id("v-0123456789abcdef", &snapshot_name("s")).expect("local");
        assert_eq!(parse_backup_snapshot_id(&local), None);
        for bad in ["v-0123456789abcdef.0123456789abcdef.", "v-0123456789abcdef.0123456789abcdef.UP", "x.t"] {
            assert_eq!(parse_backup_snapshot_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn snapshot_classes_are_local_by_default_and_backups_name_a_target() {
        let p = |kv: &[(&str, &str)]| -> Vec<(String, String)> {
            kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
        };
        assert_eq!(parse_snapshot_parameters(&[]), Ok(SnapshotKind::Local));
        assert_eq!(parse_snapshot_parameters(&p(&[("type", "snapshot")])), Ok(SnapshotKind::Local));
        assert_eq!(
            parse_snapshot_parameters(&p(&[("type", "backup"), ("target", "offsite"), ("csi.storage.k8s.io/x", "y")])),
            Ok(SnapshotKind::Backup { target: "offsite".into() })
        );
        for (bad, says) in [
            (p(&[("type", "backup")]), "needs parameter target"),
            (p(&[("target", "offsite")]), "for type: backup"),
            (p(&[("type", "copy")]), "\"copy\""),
            (p(&[("type", "backup"), ("target", "Off")]), "\"Off\""),
            (p(&[("colour", "red")]), "\"colour\""),
        ] {
            let e = parse_snapshot_parameters(&bad).expect_err("refused");
            assert!(e.0.contains(says), "{bad:?}: {}", e.0);
        }
    }

    #[test]
    fn placement_takes_distinct_nodes_most_free_first_and_spreads_when_it_can() {
        let nodes = [
            node("a", 10, &[("zone", "1")]),
            node("b", 50, &[("zone", "1")]),
            node("c", 20, &[("zone", "2")]),
            node("d", 30, &[("zone", "2"), ("ssd", "yes")]),
            node("e", 5, &[("zone", "3")]),
        ];
        let plain = Policy::default();
        assert_eq!(shown(&place(&nodes, &plain, 1 << 30, 3, &[]).expect("placed")), ["b", "d", "c"]);
        let spread = Policy { spread_key: Some("zone".into()), ..Policy::default() };
        assert_eq!(shown(&place(&nodes, &spread, 1 << 30, 3, &[]).expect("placed")), ["b", "d", "e"]);
        // More replicas than zones: spread first, then the most free.
        assert_eq!(shown(&place(&nodes, &spread, 1 << 30, 4, &[]).expect("placed")), ["b", "d", "e", "c"]);
        // Too big for e: the third zone has no room, the spread gives way.
        assert_eq!(shown(&place(&nodes, &spread, 8 << 30, 3, &[]).expect("placed")), ["b", "d", "c"]);
        let ssd = Policy { selector: vec![("ssd".into(), Some("yes".into()))], ..Policy::default() };
        let e = place(&nodes, &ssd, 1 << 30, 2, &[]).expect_err("one ssd node");
        assert!(
            e.0.contains("replicaNodeSelector") && e.0.contains("1 eligible node, 1 disk; 2 needed (5 nodes found"),
            "{}",
            e.0
        );
        // A replacement avoids the nodes and spread values the set already uses.
        let taken = [Slot::new("b", None), Slot::new("d", None)];
        assert_eq!(shown(&place(&nodes, &spread, 1 << 30, 1, &taken).expect("placed")), ["e"]);
    }

    #[test]
    fn one_node_with_three_disks_takes_three_replicas_on_three_disks() {
        let nodes = [node_with_disks("edge", &[("default", 10), ("ssd", 40), ("hdd", 20)])];
        let placed = place(&nodes, &Policy::default(), 1 << 30, 3, &[]).expect("placed on disks");
        assert_eq!(shown(&placed), ["edge/ssd", "edge/hdd", "edge/default"], "most free disk first");
        let views = healthy(&placed);
        let (abnormal, message) = condition(&views, 3);
        assert!(!abnormal, "whole replicas on distinct disks are healthy: {message}");
        assert_eq!(message, "3/3 replicas healthy, not node-redundant: 3 replicas on 1 node (distinct disks)");
        // Its capacity is the third disk's free space.
        assert_eq!(capacity(&nodes, &Policy::default()), 10 << 30);
        // A replacement on that node takes the disk the set does not use.
        let taken = [Slot::new("edge", Some("ssd")), Slot::new("edge", Some("hdd"))];
        assert_eq!(shown(&place(&nodes, &Policy::default(), 1 << 30, 1, &taken).expect("placed")), ["edge/default"]);
    }

    #[test]
    fn two_nodes_spread_first_then_share_the_node_with_fewer_replicas() {
        let nodes = [
            node_with_disks("n1", &[("default", 10), ("d2", 30)]),
            node_with_disks("n2", &[("default", 20), ("d2", 5)]),
        ];
        let placed = place(&nodes, &Policy::default(), 1 << 30, 3, &[]).expect("placed");
        assert_eq!(shown(&placed), ["n1/d2", "n2/default", "n1/default"]);
        let (_, message) = condition(&healthy(&placed), 3);
        assert!(message.contains("not node-redundant: 3 replicas on 2 nodes"), "{message}");
        // Two replicas: one per node, no sharing.
        let two = place(&nodes, &Policy::default(), 1 << 30, 2, &[]).expect("placed");
        assert_eq!(shown(&two), ["n1/d2", "n2/default"]);
    }

    #[test]
    fn three_nodes_take_one_replica_each_whatever_their_disks() {
        let nodes = [
            node_with_disks("n1", &[("default", 10), ("d2", 90)]),
            node_with_disks("n2", &[("default", 20)]),
            node_with_disks("n3", &[("default", 30), ("d2", 1)]),
        ];
        let placed = place(&nodes, &Policy::default(), 1 << 30, 3, &[]).expect("placed");
        assert_eq!(shown(&placed), ["n1/d2", "n3/default", "n2/default"]);
        let views = healthy(&placed);
        assert_eq!(condition(&views, 3), (false, "3/3 replicas healthy".into()));
    }

    #[test]
    fn too_few_disks_say_how_many_nodes_and_disks_were_found_and_needed() {
        let one = [node_with_disks("edge", &[("default", 10)])];
        let e = place(&one, &Policy::default(), 1 << 30, 3, &[]).expect_err("one disk for three replicas");
        assert!(e.0.contains("1 eligible node, 1 disk; 3 needed"), "{}", e.0);
        // A disk without room for the size does not count.
        let small = [node_with_disks("a", &[("default", 10), ("tiny", 0)]), node_with_disks("b", &[("default", 0)])];
        let e = place(&small, &Policy::default(), 1 << 30, 2, &[]).expect_err("one disk with room");
        assert!(e.0.contains("1 eligible node, 1 disk; 2 needed (2 nodes found"), "{}", e.0);
        assert_eq!(capacity(&one, &Policy::default()), 0);
    }

    #[test]
    fn condition_and_replacement_follow_the_replicas() {
        let r = |node: &str, state, down_since| ReplicaView {
            slot: Slot::new(node, None),
            state,
            down_since,
            rebuilt: 30,
            rebuild_total: 120,
        };
        let all = [r("a", ReplicaHealth::Healthy, None), r("b", ReplicaHealth::Healthy, None)];
        assert_eq!(condition(&all, 2), (false, "2/2 replicas healthy".into()));
        let degraded = [
            r("a", ReplicaHealth::Healthy, None),
            r("b", ReplicaHealth::Rebuilding, Some(100)),
            r("c", ReplicaHealth::Unreachable, Some(100)),
        ];
        let (abnormal, message) = condition(&degraded, 3);
        assert!(abnormal);
        assert_eq!(message, "degraded: 1/3 replicas healthy, b rebuilding 25%, c unreachable");
        let policy = Policy { stale_timeout: Duration::from_secs(60), ..Policy::default() };
        assert!(overdue(&degraded, &policy, 159).is_empty(), "not yet");
        assert_eq!(
            overdue(&degraded, &policy, 160),
            [Slot::new("c", None)],
            "only the unreachable one, once its time is up"
        );
        // Two replicas of one node: each is named with its disk.
        let shared = [
            ReplicaView { slot: Slot::new("n1", Some("default")), ..r("", ReplicaHealth::Healthy, None) },
            ReplicaView { slot: Slot::new("n1", Some("d2")), ..r("", ReplicaHealth::Rebuilding, None) },
        ];
        assert_eq!(
            condition(&shared, 2),
            (true, "degraded: 1/2 replicas healthy, n1/d2 rebuilding 25%, not node-redundant: 2 replicas on 1 node (distinct disks)".into())
        );
    }
}
