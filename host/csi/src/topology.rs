//! Node-local backends in a multi-node cluster: which backends are node-local, which node a
//! new volume of one goes to, how its id names that node, and where a call on it runs.
//!
//! A backend is node-local when it imports `dir`: its grant is a directory on the disk of the
//! host that runs it, so what it makes exists on one node only. Its calls must run on that
//! node. A controller that is no node forwards them, whole, to the node plugin of the node
//! (`peer`); a node runs them itself and pins the answer: the volume's accessible topology is
//! `{topology.wasmcsi.io/node: NODE}` (what NodeGetInfo reports), and in a multi-node cluster
//! its id carries the node's tag (`BACKEND@TAG:LOCAL`, see `ids`), so Delete, Expand and snapshots reach
//! the same node after any restart, with no state kept by the controller. Central backends
//! (nfs, rbd, block) are untouched: they run where the call arrives and have no node
//! constraint. A standalone host (controller and node in one process, no peers) keeps the
//! plain ids it always made: there is only one node to be on.
use crate::error::{CsiError, CsiResult};
use crate::ids::{MAX_NAME_BYTES, ObjectId, node_tag};
use crate::plugin::{Plugin, TOPOLOGY_NODE_KEY};
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_runtime::Backend;
use wasmcsi_runtime::capabilities::Capability;

/// Where a call on a node-local backend runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Route {
    /// in this process
    Here,
    /// on the node plugin of this node (its name)
    Node(String),
}

/// A node holding objects of a node-local backend, as a listing visits it: its tag in the
/// backend's ids, and the node plugin to ask (`None`: this process is that node).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) tag: String,
    pub(crate) node: Option<String>,
}

/// Whether `backend`'s objects live on one node: it imports `dir`, whose roots are the disk
/// of whichever host runs it.
pub(crate) fn is_node_local(backend: &Backend) -> bool {
    backend.imports.capabilities.contains(&Capability::Dir)
}

/// The node a topology names, if it names one.
fn node_of(t: &csi::Topology) -> Option<&str> {
    t.segments.get(TOPOLOGY_NODE_KEY).map(String::as_str)
}

/// The nodes a new volume may go to, most preferred first: `preferred` in its order, then the
/// rest of `requisite` (the spec makes preferred a subset of requisite when both are given).
/// Topologies that name no node are not placement for a node-local backend.
pub(crate) fn candidate_nodes(req: Option<&csi::TopologyRequirement>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for t in req.into_iter().flat_map(|r| r.preferred.iter().chain(&r.requisite)) {
        if let Some(n) = node_of(t).filter(|n| !out.iter().any(|o| o == n)) {
            out.push(n.to_string());
        }
    }
    out
}

/// `{topology.wasmcsi.io/node: node}`: where a node-local volume is accessible.
pub(crate) fn node_topology(node: &str) -> csi::Topology {
    csi::Topology { segments: [(TOPOLOGY_NODE_KEY.to_string(), node.to_string())].into_iter().collect() }
}

impl Plugin {
    /// Whether this process is node `tag` for `backend`'s ids.
    fn is_this_node(&self, backend: &str, tag: &str) -> bool {
        self.mode.node() && node_tag(backend, &self.node_id) == tag
    }

    /// Where a call on an existing object of `backend` runs: here for central backends and
    /// for objects without a node (a standalone host's), else on the node its id names.
    pub(crate) async fn route_object(&self, backend: &Backend, oid: &ObjectId) -> CsiResult<Route> {
        let Some(tag) = oid.node.as_deref().filter(|_| is_node_local(backend)) else { return Ok(Route::Here) };
        if self.is_this_node(&backend.name, tag) {
            return Ok(Route::Here);
        }
        match &self.node_local.peers {
            Some(peers) => peers
                .node_of_tag(&backend.name, tag)
                .await
                .map(Route::Node)
                .ok_or_else(|| CsiError::NodeUnreachable { id: oid.to_string(), tag: tag.to_string() }),
            None => {
                Err(CsiError::NotOnThisNode { id: oid.to_string(), tag: tag.to_string(), node: self.node_id.clone() })
            }
        }
    }

    /// Where a new volume of `backend` goes: the first candidate node (see
    /// [`candidate_nodes`]) that is this node or a node plugin that answers; a content source
    /// pins it to the node holding the source. Central backends: here.
    pub(crate) async fn route_create(
        &self,
        backend: &Backend,
        req: Option<&csi::TopologyRequirement>,
        source: Option<&ObjectId>,
    ) -> CsiResult<Route> {
        if !is_node_local(backend) {
            return Ok(Route::Here);
        }
        let mut candidates = candidate_nodes(req);
        if let Some(src) = source {
            let at = match self.route_object(backend, src).await? {
                Route::Here => self.mode.node().then(|| self.node_id.clone()),
                Route::Node(n) => Some(n),
            };
            if let Some(at) = at {
                if !candidates.is_empty() && !candidates.contains(&at) {
                    return Err(CsiError::ResourceExhausted(format!(
                        "the content source {src} lives on node {at}, outside the volume's accessibility requirements"
                    )));
                }
                candidates = vec![at];
            }
        }
        let me = self.mode.node().then_some(self.node_id.as_str());
        if candidates.is_empty() {
            return match (me, &self.node_local.peers) {
                (Some(_), _) | (None, None) => Ok(Route::Here),
                (None, Some(peers)) => peers
                    .first_node()
                    .await
                    .map(Route::Node)
                    .ok_or_else(|| CsiError::NoNode { backend: backend.name.clone() }),
            };
        }
        for node in &candidates {
            if Some(node.as_str()) == me {
                return Ok(Route::Here);
            }
            if let Some(peers) = &self.node_local.peers
                && peers.knows(node).await
            {
                return Ok(Route::Node(node.clone()));
            }
        }
        Err(CsiError::ResourceExhausted(format!(
            "backend {} keeps volumes on one node, and none of the nodes asked for ({}) can take it here",
            backend.name,
            candidates.join(", ")
        )))
    }

    /// The nodes a listing of `backend` visits, in tag order; `None` when this process holds
    /// all of its objects (a central backend, or no node plugins to ask).
    pub(crate) async fn holders(&self, backend: &Backend) -> Option<Vec<Holder>> {
        if !is_node_local(backend) {
            return None;
        }
        let peers = self.node_local.peers.as_ref()?;
        let me = self.mode.node().then_some(self.node_id.as_str());
        let mut out: Vec<Holder> = peers
            .node_names()
            .await
            .into_iter()
            .filter(|n| Some(n.as_str()) != me)
            .map(|n| Holder { tag: node_tag(&backend.name, &n), node: Some(n) })
            .collect();
        if let Some(me) = me {
            out.push(Holder { tag: node_tag(&backend.name, me), node: None });
        }
        out.sort_by(|a, b| a.tag.cmp(&b.tag));
        out.dedup_by(|a, b| a.tag == b.tag);
        Some(out)
    }

    /// Pin a volume that a node-local backend made on this node: accessible from this node
    /// only, and (in a multi-node cluster) its id names this node.
    pub(crate) fn pin_volume(&self, backend: &Backend, v: &mut csi::Volume) -> CsiResult<()> {
        if !is_node_local(backend) || !self.mode.node() {
            return Ok(());
        }
        v.accessible_topology = vec![node_topology(&self.node_id)];
        v.volume_id = self.pin_id(backend, &v.volume_id)?;
        Ok(())
    }

    /// A node-local object's id as this node hands it out (see [`Plugin::pin_volume`]).
    pub(crate) fn pin_id(&self, backend: &Backend, id: &str) -> CsiResult<String> {
        if !is_node_local(backend) || !self.mode.node() || !self.node_local.pinned {
            return Ok(id.to_string());
        }
        let oid = ObjectId::parse(id).ok_or_else(|| CsiError::Internal(format!("{id} is not an id of ours")))?;
        let pinned = oid.on_node(&node_tag(&backend.name, &self.node_id)).to_string();
        if pinned.len() > MAX_NAME_BYTES {
            return Err(CsiError::Internal(format!(
                "{id} with this node's tag is {} bytes, over CSI's {MAX_NAME_BYTES}",
                pinned.len()
            )));
        }
        Ok(pinned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(node: &str) -> csi::Topology {
        node_topology(node)
    }

    #[test]
    fn candidates_are_preferred_first_then_requisite_once_each() {
        let req = csi::TopologyRequirement {
            requisite: vec![topo("a"), topo("b"), topo("c")],
            preferred: vec![topo("c"), topo("a")],
        };
        assert_eq!(candidate_nodes(Some(&req)), ["c", "a", "b"]);
        assert!(candidate_nodes(None).is_empty());
        let zone_only = csi::TopologyRequirement {
            requisite: vec![csi::Topology { segments: [("zone".to_string(), "z".to_string())].into() }],
            preferred: vec![],
        };
        assert!(candidate_nodes(Some(&zone_only)).is_empty());
    }
}
