//! A backend's answers, checked before any part of them reaches the CO: the one place that
//! knows the contract of each answer and the limit of every string and list in it. A backend
//! is untrusted: an answer outside the contract (an invalid id, a size outside the request,
//! a list no CO can read) is refused as the backend's fault (`Backend::reject_output`:
//! INTERNAL, counted as `bad-output`), never clamped into something that looks right. Free
//! text (condition and validation messages, like error messages one layer down) is clipped
//! instead: it carries no meaning a clip could break.
//!
//! | what a backend returns | limit |
//! |---|---|
//! | error message | [`MAX_ERROR_MESSAGE`](wasmcsi_runtime::backend::MAX_ERROR_MESSAGE) bytes, clipped (in `wasmcsi-runtime`, also for the log) |
//! | condition / validation message | [`MAX_MESSAGE`] bytes, clipped |
//! | volume or snapshot id | [`MAX_LOCAL_ID`] bytes of `[A-Za-z0-9._-]` |
//! | volume context | [`MAX_CONTEXT_ENTRIES`] entries, [`MAX_CONTEXT_BYTES`] bytes, keys non-empty, no NUL |
//! | accessible topology | [`MAX_TOPOLOGIES`] topologies of 1..=[`MAX_SEGMENTS`] segments, label keys and values |
//! | page token | [`MAX_PAGE_TOKEN`] bytes |
//! | entries of a page | what the host asked for, at most [`MAX_PAGE_ENTRIES`] |
//! | sizes | ≤ `i64::MAX` (CSI's int64), inside the request's range |
//! | times | inside protobuf `Timestamp`'s range |
//!
//! It does not check what a backend asks the host to do (attach plans: the node's attachers
//! check those against the grants).
use crate::error::{CsiError, CsiResult};
pub use crate::ids::MAX_LOCAL_ID;
use crate::ids::{ObjectId, is_valid_local};
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_runtime::Backend;
use wasmcsi_runtime::bindings::types;
use wasmcsi_runtime::driver;

/// Longest condition or validation message handed to the CO (longer ones are clipped).
pub const MAX_MESSAGE: usize = 1024;
/// Most entries of a volume context.
pub const MAX_CONTEXT_ENTRIES: usize = 64;
/// Most bytes of a volume context (keys and values).
pub const MAX_CONTEXT_BYTES: usize = 16 << 10;
/// Most topologies a volume is accessible from.
pub const MAX_TOPOLOGIES: usize = 16;
/// Most segments of one topology.
pub const MAX_SEGMENTS: usize = 8;
/// Longest page token (a clipped token would be a broken one: refused, not clipped).
pub const MAX_PAGE_TOKEN: usize = 1024;
/// Most entries the host asks a backend for in one page (also when the CO set no limit), so
/// a page of the largest entries stays under gRPC's default 4 MiB message size.
pub const MAX_PAGE_ENTRIES: u32 = 50;
/// protobuf `Timestamp`'s range: 0001-01-01T00:00:00Z ..= 9999-12-31T23:59:59Z.
const MIN_SECONDS: i64 = -62_135_596_800;
const MAX_SECONDS: i64 = 253_402_300_799;

/// What is wrong with one part of an answer.
type Check<T = ()> = Result<T, String>;

/// The answer of `op` as the CO gets it, or the backend's fault.
fn checked<T>(backend: &Backend, op: &'static str, check: Check<T>) -> CsiResult<T> {
    check.map_err(|m| CsiError::Call(backend.reject_output(op, m)))
}

/// `text` clipped to [`MAX_MESSAGE`] bytes at a character boundary, saying so.
pub fn message(text: &str) -> String {
    if text.len() <= MAX_MESSAGE {
        return text.to_string();
    }
    const MARK: &str = " [clipped]";
    let mut end = MAX_MESSAGE - MARK.len();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{MARK}", &text[..end])
}

pub fn condition(c: &types::VolumeCondition) -> csi::VolumeCondition {
    csi::VolumeCondition { abnormal: c.abnormal, message: message(&c.message) }
}

fn local(what: &str, id: &str) -> Check {
    if is_valid_local(id) {
        Ok(())
    } else {
        Err(format!("invalid {what} id ({} bytes); ids are 1-{MAX_LOCAL_ID} of [A-Za-z0-9._-]", id.len()))
    }
}

/// A size in CSI's int64.
fn size(what: &str, n: u64) -> Check<i64> {
    i64::try_from(n).map_err(|_| format!("{what} {n} is beyond CSI's int64"))
}

/// A size inside the request's range (limit 0: none).
fn within(what: &str, n: u64, range: &driver::CapacityRange) -> Check<i64> {
    if n < range.required_bytes || (range.limit_bytes != 0 && n > range.limit_bytes) {
        return Err(format!(
            "{what} {n} outside the requested range [{}, {}]",
            range.required_bytes, range.limit_bytes
        ));
    }
    size(what, n)
}

fn context(ctx: &[driver::Pair]) -> Check {
    let bytes: usize = ctx.iter().map(|p| p.key.len() + p.value.len()).sum();
    if ctx.len() > MAX_CONTEXT_ENTRIES || bytes > MAX_CONTEXT_BYTES {
        return Err(format!(
            "volume context of {} entries, {bytes} bytes (at most {MAX_CONTEXT_ENTRIES}, {MAX_CONTEXT_BYTES})",
            ctx.len()
        ));
    }
    if ctx.iter().any(|p| p.key.is_empty() || p.key.contains('\0') || p.value.contains('\0')) {
        return Err("volume context with an empty key or a NUL".into());
    }
    Ok(())
}

/// A Kubernetes label name: 1-63 of `[A-Za-z0-9._-]`, alphanumeric at both ends.
fn label_name(s: &str) -> bool {
    let b = s.as_bytes();
    (1..=63).contains(&b.len())
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(c))
}

/// A Kubernetes label key: `[PREFIX/]NAME`, PREFIX a DNS subdomain (≤ 253, lowercase).
pub fn label_key(key: &str) -> bool {
    match key.split_once('/') {
        None => label_name(key),
        Some((prefix, name)) => {
            let dns_label = |l: &str| {
                let b = l.as_bytes();
                (1..=63).contains(&b.len())
                    && b[0].is_ascii_alphanumeric()
                    && b[b.len() - 1].is_ascii_alphanumeric()
                    && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
            };
            prefix.len() <= 253 && prefix.split('.').all(dns_label) && label_name(name)
        }
    }
}

/// A Kubernetes label value: empty, or a label name.
pub fn label_value(value: &str) -> bool {
    value.is_empty() || label_name(value)
}

fn topology(topologies: &[driver::Topology]) -> Check<Vec<csi::Topology>> {
    if topologies.len() > MAX_TOPOLOGIES {
        return Err(format!("{} accessible topologies (at most {MAX_TOPOLOGIES})", topologies.len()));
    }
    topologies
        .iter()
        .map(|t| {
            if t.segments.is_empty() || t.segments.len() > MAX_SEGMENTS {
                return Err(format!("a topology of {} segments (1 to {MAX_SEGMENTS})", t.segments.len()));
            }
            let mut segments = std::collections::HashMap::new();
            for p in &t.segments {
                if !label_key(&p.key) || !label_value(&p.value) {
                    let clip = |s: &str| s.chars().take(64).collect::<String>().escape_debug().to_string();
                    return Err(format!(
                        "topology segment {}={} is not a label key and value",
                        clip(&p.key),
                        clip(&p.value)
                    ));
                }
                if segments.insert(p.key.clone(), p.value.clone()).is_some() {
                    return Err(format!("topology segment {} given twice", p.key));
                }
            }
            Ok(csi::Topology { segments })
        })
        .collect()
}

fn timestamp(t: &types::Timestamp) -> Check<prost_types::Timestamp> {
    let nanos = i32::try_from(t.nanos).ok().filter(|n| *n < 1_000_000_000);
    match nanos {
        Some(nanos) if (MIN_SECONDS..=MAX_SECONDS).contains(&t.seconds) => {
            Ok(prost_types::Timestamp { seconds: t.seconds, nanos })
        }
        _ => Err(format!("time {}s {}ns is outside protobuf's Timestamp range", t.seconds, t.nanos)),
    }
}

/// A volume as the CO gets it. `expect_id`: the local id the caller asked about.
pub fn volume(
    backend: &Backend,
    op: &'static str,
    v: &driver::Volume,
    expect_id: Option<&str>,
) -> CsiResult<csi::Volume> {
    checked(
        backend,
        op,
        (|| {
            local("volume", &v.volume_id)?;
            if let Some(want) = expect_id.filter(|w| *w != v.volume_id) {
                return Err(format!("answered for volume {} when asked for {want}", v.volume_id));
            }
            context(&v.volume_context)?;
            Ok(csi::Volume {
                capacity_bytes: size("capacity", v.capacity_bytes)?,
                volume_id: ObjectId::new(&backend.name, &v.volume_id).to_string(),
                volume_context: crate::convert::to_map(&v.volume_context),
                content_source: None,
                accessible_topology: topology(&v.accessible_topology)?,
            })
        })(),
    )
}

/// A volume the backend created for a request of `range`.
pub fn created(backend: &Backend, v: &driver::Volume, range: &driver::CapacityRange) -> CsiResult<csi::Volume> {
    checked(backend, "create_volume", within("capacity", v.capacity_bytes, range))?;
    volume(backend, "create_volume", v, None)
}

pub fn snapshot(backend: &Backend, op: &'static str, s: &driver::Snapshot) -> CsiResult<csi::Snapshot> {
    checked(
        backend,
        op,
        (|| {
            local("snapshot", &s.snapshot_id)?;
            local("volume", &s.source_volume_id)?;
            Ok(csi::Snapshot {
                size_bytes: size("snapshot size", s.size_bytes)?,
                snapshot_id: ObjectId::new(&backend.name, &s.snapshot_id).to_string(),
                source_volume_id: ObjectId::new(&backend.name, &s.source_volume_id).to_string(),
                creation_time: Some(timestamp(&s.creation_time)?),
                ready_to_use: s.ready_to_use,
                group_snapshot_id: String::new(),
            })
        })(),
    )
}

/// A group snapshot as the CO gets it: every member a snapshot of this backend naming the
/// group, one per source when `sources` (local ids) are known, ready only when every member is.
pub fn group_snapshot(
    backend: &Backend,
    op: &'static str,
    g: &driver::GroupSnapshot,
    sources: Option<&[String]>,
) -> CsiResult<csi::VolumeGroupSnapshot> {
    checked(backend, op, local("group snapshot", &g.group_snapshot_id))?;
    let group_id = ObjectId::new(&backend.name, &g.group_snapshot_id).to_string();
    let mut snapshots = Vec::with_capacity(g.snapshots.len());
    for s in &g.snapshots {
        let mut member = snapshot(backend, op, s)?;
        member.group_snapshot_id = group_id.clone();
        snapshots.push(member);
    }
    checked(
        backend,
        op,
        (|| {
            if g.snapshots.is_empty() {
                return Err("a group snapshot with no snapshot".to_string());
            }
            if let Some(sources) = sources {
                let mut of: Vec<&str> = g.snapshots.iter().map(|s| s.source_volume_id.as_str()).collect();
                let mut asked: Vec<&str> = sources.iter().map(String::as_str).collect();
                of.sort_unstable();
                asked.sort_unstable();
                if of != asked {
                    return Err(format!("snapshots of {of:?} when asked for {asked:?}"));
                }
            }
            if g.ready_to_use && g.snapshots.iter().any(|s| !s.ready_to_use) {
                return Err("ready to use while one of its snapshots is not".to_string());
            }
            Ok(csi::VolumeGroupSnapshot {
                group_snapshot_id: group_id.clone(),
                snapshots: snapshots.clone(),
                creation_time: Some(timestamp(&g.creation_time)?),
                ready_to_use: g.ready_to_use,
            })
        })(),
    )
}

/// A page's entries and next token, for a page of at most `max` entries.
pub fn page<T>(backend: &Backend, op: &'static str, entries: &[T], token: &str, max: u32) -> CsiResult<()> {
    checked(
        backend,
        op,
        (|| {
            if entries.len() > max as usize {
                return Err(format!("{} entries when asked for at most {max}", entries.len()));
            }
            if token.len() > MAX_PAGE_TOKEN {
                return Err(format!("a page token of {} bytes (at most {MAX_PAGE_TOKEN})", token.len()));
            }
            Ok(())
        })(),
    )
}

/// The size a volume was expanded to, for a request of `range`.
pub fn expansion(backend: &Backend, e: &driver::Expansion, range: &driver::CapacityRange) -> CsiResult<i64> {
    checked(backend, "expand_volume", within("expanded capacity", e.capacity_bytes, range))
}

/// A capacity report: sizes in int64, minimum ≤ maximum where both are known.
pub fn capacity(backend: &Backend, c: &driver::Capacity) -> CsiResult<()> {
    checked(
        backend,
        "get_capacity",
        (|| {
            size("available capacity", c.available_bytes)?;
            size("maximum volume size", c.maximum_volume_bytes)?;
            size("minimum volume size", c.minimum_volume_bytes)?;
            if c.maximum_volume_bytes != 0 && c.minimum_volume_bytes > c.maximum_volume_bytes {
                return Err(format!(
                    "minimum volume size {} above the maximum {}",
                    c.minimum_volume_bytes, c.maximum_volume_bytes
                ));
            }
            Ok(())
        })(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(k: &str, v: &str) -> driver::Pair {
        driver::Pair { key: k.into(), value: v.into() }
    }

    #[test]
    fn backend_answers_outside_the_contract_are_caught() {
        assert!(local("volume", "../x").is_err());
        assert!(within("capacity", 1, &driver::CapacityRange { required_bytes: 2, limit_bytes: 0 }).is_err());
        assert!(context(&[driver::Pair { key: String::new(), value: "\0".into() }]).is_err());
    }

    #[test]
    fn messages_are_clipped_at_a_character_boundary() {
        assert_eq!(message("short"), "short");
        let long = "é".repeat(MAX_MESSAGE);
        let clipped = message(&long);
        assert!(clipped.len() <= MAX_MESSAGE && clipped.ends_with(" [clipped]"), "{}", clipped.len());
    }

    #[test]
    fn topology_keys_and_values_are_labels_and_lists_are_bounded() {
        let one = |k: &str, v: &str| vec![driver::Topology { segments: vec![pair(k, v)] }];
        assert!(topology(&one("topology.wasmcsi.io/node", "node-1")).is_ok());
        assert!(topology(&one("zone", "")).is_ok());
        for (k, v) in [("", "x"), ("a b", "x"), ("UPPER.example/x", "x"), ("k", "a\0"), ("k", "-x"), ("/x", "y")] {
            assert!(topology(&one(k, v)).is_err(), "{k:?}={v:?}");
        }
        assert!(topology(&one(&"k".repeat(64), "v")).is_err());
        assert!(topology(&one("k", &"v".repeat(64))).is_err());
        let many = vec![driver::Topology { segments: vec![pair("k", "v")] }; MAX_TOPOLOGIES + 1];
        assert!(topology(&many).is_err());
        let wide: Vec<_> = (0..=MAX_SEGMENTS).map(|i| pair(&format!("k{i}"), "v")).collect();
        assert!(topology(&[driver::Topology { segments: wide }]).is_err());
        assert!(topology(&[driver::Topology { segments: vec![] }]).is_err());
    }

    #[test]
    fn contexts_sizes_and_times_outside_the_contract_are_refused() {
        assert!(context(&[pair("", "v")]).is_err());
        assert!(context(&[pair("k", "\0")]).is_err());
        let many: Vec<_> = (0..=MAX_CONTEXT_ENTRIES).map(|i| pair(&format!("k{i}"), "v")).collect();
        assert!(context(&many).is_err());
        assert!(context(&[pair("k", &"v".repeat(MAX_CONTEXT_BYTES))]).is_err());
        assert!(size("capacity", u64::MAX).is_err());
        assert_eq!(size("capacity", i64::MAX as u64), Ok(i64::MAX));
        let range = driver::CapacityRange { required_bytes: 10, limit_bytes: 20 };
        assert!(within("capacity", 21, &range).is_err());
        assert!(within("capacity", 9, &range).is_err());
        let unlimited = driver::CapacityRange { required_bytes: 0, limit_bytes: 0 };
        assert!(within("capacity", u64::MAX, &unlimited).is_err());
        let t = |seconds, nanos| timestamp(&types::Timestamp { seconds, nanos });
        assert!(t(0, 0).is_ok() && t(MAX_SECONDS, 999_999_999).is_ok() && t(MIN_SECONDS, 0).is_ok());
        assert!(t(MAX_SECONDS + 1, 0).is_err() && t(i64::MIN, 0).is_err() && t(0, 1_000_000_000).is_err());
    }
}
