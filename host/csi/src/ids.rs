//! Volume and snapshot ids as Kubernetes sees them: `BACKEND:LOCAL`. The backend part
//! routes every later call (Delete, Expand, NodeStage, …) to the component that created
//! the object; the local part is the backend's own.
use wasmcsi_runtime::config::is_valid_name;

/// Longest local id a backend may return (`BACKEND:LOCAL` ≤ 128 bytes, CSI's limit).
pub const MAX_LOCAL_ID: usize = 95;

/// A parsed id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectId {
    pub backend: String,
    pub local: String,
}

impl ObjectId {
    /// `None` when the id cannot have come from this driver.
    pub fn parse(id: &str) -> Option<Self> {
        let (backend, local) = id.split_once(':')?;
        (is_valid_name(backend) && is_valid_local(local)).then(|| Self { backend: backend.into(), local: local.into() })
    }

    pub fn new(backend: &str, local: &str) -> Self {
        Self { backend: backend.into(), local: local.into() }
    }
}

impl std::fmt::Display for ObjectId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.backend, self.local)
    }
}

/// What a backend may use as a local id: safe in paths, logs and Kubernetes objects.
pub fn is_valid_local(local: &str) -> bool {
    !local.is_empty()
        && local.len() <= MAX_LOCAL_ID
        && local.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_foreign_ids_do_not_parse() {
        let id = ObjectId::new("hostpath", "default.pvc-1");
        assert_eq!(ObjectId::parse(&id.to_string()), Some(id));
        for bad in ["", "nocolon", ":x", "UPPER:x", "a:", "a:b/c", "a:b:c", &format!("a:{}", "x".repeat(96))] {
            assert_eq!(ObjectId::parse(bad), None, "{bad}");
        }
        assert_eq!(format!("{}:{}", "b".repeat(32), "x".repeat(MAX_LOCAL_ID)).len(), 128);
    }
}
