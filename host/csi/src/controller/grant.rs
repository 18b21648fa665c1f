//! The grant ControllerPublishVolume hands a replicated volume's node: "node N may open engine
//! sessions of replica set S at epoch E", signed with the controller's credentials
//! ([`wasmcsi_trust::Grant::sign`]) for the epoch the publish's claim raised the replicas to.
//! NodeStage reads it from the publish context ([`GRANT_CONTEXT_KEY`], standard base64 with
//! padding) and hands it to the data path with the attach; the data path renews it from the
//! authority endpoint later.
//!
//! Without controller credentials (`--tls-mode off`) no key is added, and a grant the publish
//! context cannot hold is left out (logged): the node then asks the authority endpoint for one,
//! as it does for a volume published before grants existed.
use std::collections::HashMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use wasmcsi_trust::grant::DEFAULT_LIFE;
use wasmcsi_trust::{Grant, LiveCredentials};

use crate::error::{CsiError, CsiResult};

/// The publish context key of the grant.
pub const GRANT_CONTEXT_KEY: &str = "wasmcsi.io/grant";
/// The CSI spec's general size limit for a `map<string, string>` field (keys and values):
/// publish_context does not override it, and a CO may refuse a larger one.
pub const MAX_PUBLISH_CONTEXT: usize = 4 * 1024;

/// The publish context of a replicated volume `set_id` published to `node` at `epoch`: its grant,
/// when this controller has credentials to sign one with.
pub(crate) fn publish_context(
    signer: Option<&LiveCredentials>,
    set_id: &str,
    node: &str,
    epoch: u64,
) -> CsiResult<HashMap<String, String>> {
    let mut context = HashMap::new();
    let Some(signer) = signer else { return Ok(context) };
    let signed = Grant::starting_now(set_id, node, epoch, DEFAULT_LIFE)
        .sign(&signer.current())
        .map_err(|e| CsiError::Unavailable(format!("signing the grant of {set_id} for node {node}: {e}")))?;
    let value = STANDARD.encode(&signed.encoded);
    if GRANT_CONTEXT_KEY.len() + value.len() > MAX_PUBLISH_CONTEXT {
        // A controller chain with several intermediates: the node fetches its grant instead.
        tracing::warn!(
            volume.id = set_id,
            node,
            bytes = value.len(),
            "the grant does not fit in the publish context ({MAX_PUBLISH_CONTEXT} bytes); the node asks the authority endpoint for it"
        );
        return Ok(context);
    }
    context.insert(GRANT_CONTEXT_KEY.to_owned(), value);
    Ok(context)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used, reason = "test")]
    use super::*;
    use std::time::SystemTime;
    use wasmcsi_trust::pki::{Authority, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Validity};
    use wasmcsi_trust::{Credentials, Role, TrustAnchors};

    fn credentials(ca: &Authority, role: &Role, dir: &std::path::Path) -> LiveCredentials {
        ca.issue(role, Validity::starting_now(DEFAULT_LEAF_VALIDITY))
            .expect("issue")
            .write(dir, &[ca.certificate().clone()])
            .expect("write");
        LiveCredentials::new(Credentials::load(dir).expect("load"))
    }

    #[test]
    fn the_grant_names_the_set_node_and_epoch_and_fits_the_spec_size_limit() {
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("CA");
        let dir = tempfile::tempdir().expect("tempdir");
        let controller = credentials(&ca, &Role::Controller, dir.path());
        // The longest ids a grant takes: the size bound holds for every volume and node.
        let (set, node) = ("s".repeat(wasmcsi_trust::grant::MAX_VOLUME_LEN), "n".repeat(253));
        let context = publish_context(Some(&controller), &set, &node, 7).expect("signed");
        let total: usize = context.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert!(total <= MAX_PUBLISH_CONTEXT, "{total} bytes");
        let bytes = STANDARD.decode(&context[GRANT_CONTEXT_KEY]).expect("standard base64");
        let anchors = TrustAnchors::new(vec![ca.certificate().clone()]).expect("anchors");
        let grant = wasmcsi_trust::grant::verify(&bytes, &anchors, SystemTime::now()).expect("verifies");
        assert_eq!((grant.volume.as_str(), grant.node.as_str(), grant.epoch), (set.as_str(), node.as_str(), 7));
    }

    #[test]
    fn without_credentials_nothing_is_added_and_a_node_signer_is_an_error() {
        assert!(publish_context(None, "set", "n1", 1).expect("no signer").is_empty());
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("CA");
        let dir = tempfile::tempdir().expect("tempdir");
        let node = credentials(&ca, &Role::Node("n1".into()), dir.path());
        let err = publish_context(Some(&node), "set", "n1", 1).expect_err("a node cannot sign");
        assert!(err.to_string().contains("only the controller"), "{err}");
    }
}
