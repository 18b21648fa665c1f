//! The targets a backend has created volumes on (NFS exports, RBD pools, …), remembered in
//! `kv`. A capability does not list its grants to the guest, so an unfiltered ListVolumes or
//! ListSnapshots looks where volumes were made. One key per target, `PREFIX` + the target's
//! own string form, with an empty value; written once, before the first volume on it.
use crate::kv::Kv;
use crate::types::Error;

/// Targets remembered under one key prefix.
///
/// ```
/// use wasmcsi_backend_sdk::targets::KnownTargets;
/// const POOLS: KnownTargets = KnownTargets::new("pools/");
/// assert_eq!(POOLS.key("ceph.rbd"), "pools/ceph.rbd");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownTargets {
    prefix: &'static str,
}

impl KnownTargets {
    pub const fn new(prefix: &'static str) -> Self {
        Self { prefix }
    }

    /// The kv key of `target`.
    pub fn key(&self, target: &str) -> String {
        format!("{}{target}", self.prefix)
    }

    /// Remember `target`; a target already known costs a read, not a write.
    pub fn remember(&self, kv: &impl Kv, target: &str) -> Result<(), Error> {
        let key = self.key(target);
        if kv.get(&key)?.is_none() {
            kv.set(&key, b"")?;
        }
        Ok(())
    }

    /// Every remembered target, in key order.
    pub fn list(&self, kv: &impl Kv) -> Result<Vec<String>, Error> {
        Ok(kv.keys(self.prefix)?.into_iter().filter_map(|k| k.strip_prefix(self.prefix).map(str::to_owned)).collect())
    }
}
