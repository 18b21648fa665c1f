//! Volume and snapshot ids as Kubernetes sees them: `BACKEND:LOCAL`, or `BACKEND@NODE:LOCAL`
//! for an object of a node-local backend made in a multi-node cluster (see `topology`: NODE
//! is the node's tag, which routes Delete, Expand and snapshots to the node holding it). The
//! backend part routes every later call (Delete, Expand, NodeStage, …) to the component that
//! created the object; the local part is the backend's own. Also the names a CO gives new objects
//! ([`check_name`]), checked here once for every backend.
use crate::error::{CsiError, CsiResult};
use sha2::{Digest, Sha256};
use wasmcsi_runtime::config::is_valid_name;

/// CSI's limit on a name (and on an id).
pub const MAX_NAME_BYTES: usize = 128;

/// Longest local id a backend may return (`BACKEND:LOCAL` ≤ 128 bytes, CSI's limit).
pub const MAX_LOCAL_ID: usize = 95;

/// A parsed id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectId {
    pub backend: String,
    /// The tag of the node holding the object (node-local backends in a multi-node cluster);
    /// `None`: the object is the backend's wherever it runs (central backends, or a
    /// standalone host's node-local ones).
    pub node: Option<String>,
    pub local: String,
}

impl ObjectId {
    /// `None` when the id cannot have come from this driver.
    pub fn parse(id: &str) -> Option<Self> {
        let (head, local) = id.split_once(':')?;
        let (backend, node) = match head.split_once('@') {
            Some((b, n)) => (b, Some(n)),
            None => (head, None),
        };
        let node_ok = node.is_none_or(is_node_tag);
        (is_valid_name(backend) && node_ok && is_valid_local(local) && id.len() <= MAX_NAME_BYTES).then(|| Self {
            backend: backend.into(),
            node: node.map(str::to_string),
            local: local.into(),
        })
    }

    pub fn new(backend: &str, local: &str) -> Self {
        Self { backend: backend.into(), node: None, local: local.into() }
    }

    /// The same object, pinned to the node tagged `tag`.
    pub fn on_node(self, tag: &str) -> Self {
        Self { node: Some(tag.to_string()), ..self }
    }
}

impl std::fmt::Display for ObjectId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.node {
            Some(node) => write!(f, "{}@{node}:{}", self.backend, self.local),
            None => write!(f, "{}:{}", self.backend, self.local),
        }
    }
}

/// What a backend may use as a local id: safe in paths, logs and Kubernetes objects.
pub fn is_valid_local(local: &str) -> bool {
    !local.is_empty()
        && local.len() <= MAX_LOCAL_ID
        && local.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Whether CSI allows `c` in a name: the spec bans the C0 and C1 control characters except
/// tab, line feed and carriage return (U+0000–U+0008, U+000B, U+000C, U+000E–U+001F,
/// U+007F–U+009F).
pub fn is_name_char(c: char) -> bool {
    !matches!(c, '\u{0}'..='\u{8}' | '\u{b}' | '\u{c}' | '\u{e}'..='\u{1f}' | '\u{7f}'..='\u{9f}')
}

/// The `name` of a CreateVolume or CreateSnapshot: 1 to 128 bytes of any Unicode the spec
/// allows; INVALID_ARGUMENT otherwise, before any backend sees it. How a valid name becomes an
/// id or a path is the backend's business.
pub fn check_name(field: &'static str, name: &str) -> CsiResult<()> {
    if name.is_empty() {
        return Err(CsiError::Missing(field));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(CsiError::Invalid(format!("{field} is {} bytes; CSI allows at most {MAX_NAME_BYTES}", name.len())));
    }
    if let Some(c) = name.chars().find(|c| !is_name_char(*c)) {
        return Err(CsiError::Invalid(format!(
            "{field} {name:?} contains the control character U+{:04X}, which CSI bans in names",
            u32::from(c)
        )));
    }
    Ok(())
}

/// Hex digits of a hashed tag.
const HASH_TAG_HEX: usize = 16;

/// A node name usable as it is in an id: a DNS-1123 subdomain (Kubernetes node names are).
fn is_plain_node(n: &str) -> bool {
    let b = n.as_bytes();
    !b.is_empty()
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'.')
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// Whether `t` can be a node tag: a plain node name, or `_` and 16 lowercase hex digits
/// (`_` is in no node name, so the two never collide).
pub(crate) fn is_node_tag(t: &str) -> bool {
    match t.strip_prefix('_') {
        Some(h) => h.len() == HASH_TAG_HEX && h.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)),
        None => is_plain_node(t),
    }
}

/// The tag naming `node` in ids of `backend`: the node's name when the longest id the backend
/// may make still fits CSI's 128 bytes with it, else `_` and a hash of the name.
pub(crate) fn node_tag(backend: &str, node: &str) -> String {
    if is_plain_node(node) && backend.len() + 1 + node.len() + 1 + MAX_LOCAL_ID <= MAX_NAME_BYTES {
        return node.to_string();
    }
    let digest = hex::encode(Sha256::digest(node.as_bytes()));
    format!("_{}", &digest[..HASH_TAG_HEX])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_take_any_unicode_but_the_banned_controls_up_to_128_bytes() {
        let widest = "é".repeat(64);
        assert_eq!(widest.len(), MAX_NAME_BYTES);
        for ok in ["a", "pvc-1", "tab\there", "line\nfeed", "cr\r", "données ✓ 中文 🦀", "\u{a0}", widest.as_str()]
        {
            assert!(check_name("name", ok).is_ok(), "{ok:?}");
        }
        assert!(matches!(check_name("name", ""), Err(CsiError::Missing("name"))));
        let too_long = format!("{widest}a");
        for bad in [
            too_long.as_str(),
            "nul\0",
            "bell\u{7}",
            "vt\u{b}",
            "ff\u{c}",
            "so\u{e}",
            "esc\u{1b}",
            "del\u{7f}",
            "c1\u{9f}",
        ] {
            let err = check_name("name", bad).expect_err(bad);
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{bad:?}: {err}");
        }
    }

    #[test]
    fn ids_round_trip_and_foreign_ids_do_not_parse() {
        let id = ObjectId::new("hostpath", "default.pvc-1");
        assert_eq!(ObjectId::parse(&id.to_string()), Some(id));
        for bad in ["", "nocolon", ":x", "UPPER:x", "a:", "a:b/c", "a:b:c", &format!("a:{}", "x".repeat(96))] {
            assert_eq!(ObjectId::parse(bad), None, "{bad}");
        }
        assert_eq!(format!("{}:{}", "b".repeat(32), "x".repeat(MAX_LOCAL_ID)).len(), 128);
    }

    #[test]
    fn node_local_ids_carry_their_node_and_round_trip() {
        let id = ObjectId::new("hostpath", "default.pvc-1").on_node("node-b");
        assert_eq!(id.to_string(), "hostpath@node-b:default.pvc-1");
        assert_eq!(ObjectId::parse("hostpath@node-b:default.pvc-1"), Some(id));
        let hashed = ObjectId::parse("hostpath@_0123456789abcdef:default.x").expect("a hashed node tag");
        assert_eq!(hashed.node.as_deref(), Some("_0123456789abcdef"));
        for bad in ["hostpath@:x", "hostpath@Node:x", "hostpath@a@b:x", "hostpath@a_b:x", "hostpath@_xyz:x"] {
            assert_eq!(ObjectId::parse(bad), None, "{bad}");
        }
        let long = format!("hostpath@{}:{}", "n".repeat(23), "x".repeat(MAX_LOCAL_ID));
        assert_eq!(long.len(), 128);
        assert!(ObjectId::parse(&long).is_some());
        assert_eq!(ObjectId::parse(&format!("hostpath@{}:{}", "n".repeat(24), "x".repeat(MAX_LOCAL_ID))), None);
    }

    #[test]
    fn node_tags_are_the_name_when_it_fits_else_a_hash() {
        assert_eq!(node_tag("hostpath", "node-b"), "node-b");
        assert_eq!(node_tag("hostpath", "worker-1.example.com"), "worker-1.example.com");
        let long = node_tag("hostpath", &"n".repeat(40));
        assert!(long.starts_with('_') && long.len() == 17 && is_node_tag(&long), "{long}");
        assert_eq!(long, node_tag("hostpath", &"n".repeat(40)), "stable");
        assert_ne!(long, node_tag("hostpath", &"n".repeat(41)));
        // Upper case or '_' is no Kubernetes node name: hashed, never taken as it is.
        assert!(node_tag("hostpath", "Node_1").starts_with('_'));
        for t in ["node-b", "a", "a.b", "_0123456789abcdef"] {
            assert!(is_node_tag(t), "{t}");
        }
        for t in ["", "-a", "a-", "A", "a_b", "_0123", "_0123456789ABCDEF"] {
            assert!(!is_node_tag(t), "{t}");
        }
    }
}
