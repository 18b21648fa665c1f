//! The state every CSI service shares, and routing: which backend serves a request (by the
//! StorageClass parameter `backend`, or by the prefix of an id).
use crate::error::{CsiError, CsiResult};
use crate::guard::InFlight;
use crate::ids::ObjectId;
use crate::node::attachers::Attachers;
use crate::peer::Peers;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use wasmcsi_runtime::driver;
use wasmcsi_runtime::{Backend, Registry};

/// The StorageClass parameter that selects a backend.
pub const BACKEND_PARAMETER: &str = "backend";
/// Volume context key: the sha256 of the backend build that created the volume.
pub const DIGEST_CONTEXT_KEY: &str = "wasmcsi.io/backend-digest";
/// Topology key every node reports (and hostpath-like backends are bound to).
pub const TOPOLOGY_NODE_KEY: &str = "topology.wasmcsi.io/node";

/// Which CSI services this process serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Controller,
    Node,
    All,
}

impl Mode {
    pub fn controller(self) -> bool {
        matches!(self, Self::Controller | Self::All)
    }
    pub fn node(self) -> bool {
        matches!(self, Self::Node | Self::All)
    }
}

/// What this host is in a multi-node cluster, for node-local backends.
#[derive(Default)]
pub struct NodeLocal {
    /// The node plugins a controller forwards node-local calls to; `None`: it forwards none.
    pub peers: Option<Arc<Peers>>,
    /// This host is one node of a multi-node cluster (it serves peers): the ids of node-local
    /// objects it makes carry its tag.
    pub pinned: bool,
}

pub struct Plugin {
    pub name: String,
    pub version: String,
    pub mode: Mode,
    /// required in node mode
    pub node_id: String,
    pub registry: Arc<Registry>,
    pub inflight: InFlight,
    /// What carries out attachment plans on this node, one attacher per kind.
    pub attachers: Attachers,
    /// Where node-local backends' calls run in a multi-node cluster (`topology`).
    pub node_local: NodeLocal,
    /// Which node ids exist, as far as the sources this host was given tell
    /// (`node_directory`): ControllerPublishVolume to any other is NOT_FOUND.
    pub nodes: crate::node_directory::NodeDirectory,
    /// The controller's credentials, when it has them: ControllerPublishVolume signs the grant
    /// of each replicated volume for its node with them (`controller::grant`).
    pub grant_signer: Option<wasmcsi_trust::LiveCredentials>,
}

impl Plugin {
    /// The backend a StorageClass selects, and the parameters it gets (ours removed).
    pub(crate) fn backend_for_parameters(
        &self,
        params: &HashMap<String, String>,
    ) -> CsiResult<(Arc<Backend>, Vec<driver::Pair>)> {
        let name = params.get(BACKEND_PARAMETER).ok_or_else(|| {
            CsiError::Invalid(format!(
                "parameter {BACKEND_PARAMETER:?} is required; available backends: {}",
                self.registry.names().join(", ")
            ))
        })?;
        let backend = match self.registry.get(name) {
            Some(b) => b,
            // Being replaced, or the journal holds its volumes: it is meant to be here, and a
            // final INVALID_ARGUMENT would make the provisioner give up on the claim.
            None if self.registry.expected(name) || self.journal_knows(name) => {
                return Err(CsiError::BackendNotLoaded(name.clone()));
            }
            None => return Err(CsiError::UnknownBackend { name: name.clone(), available: self.registry.names() }),
        };
        Ok((backend, backend_parameters(params)))
    }

    /// Whether the host's journal records volumes of backend `name` (made on this host).
    pub(crate) fn journal_knows(&self, name: &str) -> bool {
        self.registry.journal_volumes(name, 0, 1).is_ok_and(|v| !v.is_empty())
    }

    /// The backend an id belongs to. `Ok(None)`: the id cannot be ours (callers decide
    /// whether that is NotFound or an idempotent success). A well-formed id of a backend that
    /// is not loaded is Unavailable: answering NotFound could orphan the volume.
    pub(crate) fn backend_for_id(&self, id: &str) -> CsiResult<Option<(Arc<Backend>, ObjectId)>> {
        let Some(oid) = ObjectId::parse(id) else { return Ok(None) };
        match self.registry.get(&oid.backend) {
            Some(b) => Ok(Some((b, oid))),
            None => Err(CsiError::BackendNotLoaded(oid.backend)),
        }
    }

    /// Run one RPC: convert its error into a Status, count it by code, and log it once, at
    /// its end: method, code, duration (the span the RPC runs in adds the volume, snapshot or
    /// name). Failures at WARN with the message the CO gets; successes at INFO, except the
    /// calls COs poll (see [`polled`]), at DEBUG, so they do not bury the rest.
    pub(crate) async fn observe<T>(
        &self,
        method: &'static str,
        fut: impl Future<Output = CsiResult<T>>,
    ) -> Result<tonic::Response<T>, tonic::Status> {
        let started = std::time::Instant::now();
        let result = fut.await;
        let duration_ms = started.elapsed().as_secs_f64() * 1e3;
        let code = match &result {
            Ok(_) => tonic::Code::Ok,
            Err(e) => e.code(),
        };
        let code = crate::error::code_name(code);
        self.registry.runtime().metrics.rpc(method, code);
        crate::metrics::global().observe(method, code, duration_ms / 1e3);
        match result {
            Ok(reply) => {
                if polled(method) {
                    tracing::debug!(method, code, duration_ms, "csi call done");
                } else {
                    tracing::info!(method, code, duration_ms, "csi call done");
                }
                Ok(tonic::Response::new(reply))
            }
            Err(e) => {
                let status = tonic::Status::from(e);
                tracing::warn!(method, code, duration_ms, error = status.message(), "csi call failed");
                Err(status)
            }
        }
    }
}

/// The calls kubelet, the sidecars and the liveness probe repeat every few seconds whatever
/// happens; logged at DEBUG when they succeed.
pub(crate) fn polled(method: &str) -> bool {
    matches!(
        method,
        "Probe" | "GetPluginInfo" | "GetPluginCapabilities" | "ControllerGetCapabilities" | "NodeGetCapabilities"
    )
}

/// StorageClass (or VolumeSnapshotClass) parameters as a backend sees them: the one that
/// selects the backend ([`BACKEND_PARAMETER`]) is the host's, not the backend's.
pub(crate) fn backend_parameters(params: &HashMap<String, String>) -> Vec<driver::Pair> {
    let mut pairs = crate::convert::pairs(params);
    pairs.retain(|p| p.key != BACKEND_PARAMETER);
    pairs
}

/// A volume context as its backend sees it: the keys the host adds
/// ([`DIGEST_CONTEXT_KEY`]) are the host's, not the backend's.
pub(crate) fn backend_context(context: &HashMap<String, String>) -> Vec<driver::Pair> {
    let mut pairs = crate::convert::pairs(context);
    pairs.retain(|p| p.key != DIGEST_CONTEXT_KEY);
    pairs
}

/// Require a non-empty string field.
pub(crate) fn required<'a>(value: &'a str, field: &'static str) -> CsiResult<&'a str> {
    if value.is_empty() { Err(CsiError::Missing(field)) } else { Ok(value) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn keys(pairs: Vec<driver::Pair>) -> Vec<String> {
        pairs.into_iter().map(|p| p.key).collect()
    }

    #[test]
    fn a_backend_sees_neither_the_parameter_that_selects_it_nor_the_hosts_context_keys() {
        let params = map(&[("b", "2"), (BACKEND_PARAMETER, "hostpath"), ("a", "1")]);
        assert_eq!(keys(backend_parameters(&params)), ["a", "b"]);
        let context = map(&[(DIGEST_CONTEXT_KEY, "sha"), ("path", "/x")]);
        assert_eq!(keys(backend_context(&context)), ["path"]);
        // Only the host's own keys go: a backend's context keeps a key named like our parameter.
        assert_eq!(keys(backend_context(&map(&[(BACKEND_PARAMETER, "x")]))), [BACKEND_PARAMETER]);
    }
}
