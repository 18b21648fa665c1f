//! The secrets of one backend call. Their values stay in the host: the call's store keeps them
//! for the capabilities that need one (`rbd`'s credentials) and the guest gets only
//! [`secret_refs`], each key with an index as its opaque handle, valid for that call.
use crate::bindings::types::SecretRef;

/// CSI secrets of one call, `(key, value)`. Values stay in the host's store; the guest
/// gets [`secret_refs`]: each key with its index as an opaque handle.
pub type Secrets = Vec<(String, String)>;

/// The handles the guest sees for `secrets` (valid for the call they are passed to).
pub fn secret_refs(secrets: &[(String, String)]) -> Vec<SecretRef> {
    secrets
        .iter()
        .enumerate()
        .map(|(i, (key, _))| SecretRef { key: key.clone(), handle: u32::try_from(i).unwrap_or(u32::MAX) })
        .collect()
}
