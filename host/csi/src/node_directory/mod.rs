//! The controller's node directory: which node ids exist, so that ControllerPublishVolume to a
//! node no node has answers NOT_FOUND (CSI: "a node corresponding to the specified node_id does
//! not exist") before any backend is asked, and an unknown node never becomes anything (an
//! owner, a grant).
//!
//! The directory keeps no list of its own; it asks the sources the host already has, each time:
//!
//! | source | says | complete (its "unknown" may refuse)? |
//! |---|---|---|
//! | this process's own node (mode `all`, `node`) | itself | only for a standalone host (below) |
//! | the nodes the operator named (`--known-node`) | those | yes |
//! | Kubernetes CSINode objects (`csi_nodes`; in a pod, or `--kube-api`) | every node whose CSINode lists this driver with that node id: the ids the external-attacher publishes to | yes |
//! | the node plugins found behind `--peer` / `--peer-service` (`peer::Peers`) | the nodes that answer | no |
//! | the replica servers of each backend's `block` grant (the catalog's discovery) | their nodes | no |
//!
//! A standalone host (controller and node in one process, no node plugins to forward to, no
//! peer endpoint) is complete for itself plus its replica nodes: there is no other node a CO
//! could have learnt an id from.
//!
//! **Never refuse a real node.** A node is found when any source knows it. NOT_FOUND only when a
//! complete source exists, and every source asked answered, and none knows it. When a source
//! could not be asked (the API server, a node plugin, a replica server did not answer) the
//! answer is UNAVAILABLE: the node may be behind it, and the CO retries. With no complete
//! source at all (a controller with neither Kubernetes, nor `--known-node`, nor a node of its
//! own) the directory cannot be authoritative and lets the call through, as before: the
//! backend's own check (replicated-block's claim) still applies; `serve` logs this once at start.
pub mod csi_nodes;

use std::collections::BTreeSet;

use crate::error::{CsiError, CsiResult};
use crate::plugin::{Mode, Plugin};
pub use csi_nodes::CsiNodes;

/// What one source says of a node id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    Known,
    Unknown,
    /// The source could not be asked (or not wholly): the node may be behind it.
    Unreachable(String),
}

/// The sources of node ids this host was given (the others are the plugin's own: its node,
/// its peers, its backends' replica nodes).
#[derive(Default)]
pub struct NodeDirectory {
    /// Node ids the operator named: complete.
    configured: BTreeSet<String>,
    /// The cluster's CSINode objects: complete.
    csi_nodes: Option<CsiNodes>,
}

impl NodeDirectory {
    pub fn new(configured: impl IntoIterator<Item = String>, csi_nodes: Option<CsiNodes>) -> Self {
        Self { configured: configured.into_iter().filter(|n| !n.is_empty()).collect(), csi_nodes }
    }

    /// Whether a complete source was configured (the plugin's own may add one: standalone).
    pub fn has_complete_source(&self) -> bool {
        !self.configured.is_empty() || self.csi_nodes.is_some()
    }
}

/// Whether a host of `mode` that forwards to no node plugins and serves no peer endpoint is
/// the only node there is (apart from its replica nodes).
pub fn is_standalone(mode: Mode, forwards: bool, serves_peers: bool) -> bool {
    mode == Mode::All && !forwards && !serves_peers
}

/// The answer from what the sources said: known by any; else unavailable when any could not be
/// asked; else not found.
fn verdict(node: &str, answers: &[(String, Lookup)]) -> CsiResult<()> {
    if answers.iter().any(|(_, a)| *a == Lookup::Known) {
        return Ok(());
    }
    let unreachable: Vec<String> = answers
        .iter()
        .filter_map(|(source, a)| match a {
            Lookup::Unreachable(why) => Some(format!("{source}: {why}")),
            _ => None,
        })
        .collect();
    if !unreachable.is_empty() {
        return Err(CsiError::Unavailable(format!(
            "node {node} is not known to the sources that answered, and some could not be asked ({}); retry",
            unreachable.join("; ")
        )));
    }
    let asked: Vec<&str> = answers.iter().map(|(s, _)| s.as_str()).collect();
    Err(CsiError::NotFound(format!("node {node} does not exist: no node of that id is known to {}", asked.join(", "))))
}

impl Plugin {
    /// Whether this host is standalone (see the module doc).
    fn standalone(&self) -> bool {
        is_standalone(self.mode, self.node_local.peers.is_some(), self.node_local.pinned)
    }

    /// Whether the node directory can refuse an unknown node: it has a complete source.
    pub fn node_directory_is_authoritative(&self) -> bool {
        self.nodes.has_complete_source() || self.standalone()
    }

    /// `Ok` when `node` may be a node of this cluster, NOT_FOUND when it is certainly none,
    /// UNAVAILABLE when a source that might know it could not be asked (see the module doc).
    #[tracing::instrument(name = "node_directory.check", skip(self))]
    pub(crate) async fn check_node(&self, node: &str) -> CsiResult<()> {
        if (self.mode.node() && node == self.node_id) || self.nodes.configured.contains(node) {
            return Ok(());
        }
        if !self.node_directory_is_authoritative() {
            tracing::debug!(node, "no complete source of node ids: not checked");
            return Ok(());
        }
        let mut answers: Vec<(String, Lookup)> = Vec::new();
        if !self.nodes.configured.is_empty() {
            answers.push(("the configured nodes".into(), Lookup::Unknown));
        }
        if self.standalone() {
            answers.push((format!("this host (node {})", self.node_id), Lookup::Unknown));
        }
        if let Some(csi_nodes) = &self.nodes.csi_nodes {
            let found = csi_nodes.lookup(node).await;
            if found == Lookup::Known {
                return Ok(());
            }
            answers.push(("the cluster's CSINode objects".into(), found));
        }
        if let Some(peers) = &self.node_local.peers {
            let found = peers.lookup(node).await;
            if found == Lookup::Known {
                return Ok(());
            }
            answers.push(("the node plugins".into(), found));
        }
        for backend in self.registry.all() {
            let Some(catalog) = backend.block_catalog() else { continue };
            let d = catalog.discover().await;
            let found = if d.node(node).is_some() {
                return Ok(());
            } else if d.unreachable.is_empty() {
                Lookup::Unknown
            } else {
                let addrs: Vec<String> = d.unreachable.iter().map(|(a, _)| a.to_string()).collect();
                Lookup::Unreachable(format!("replica servers {} did not answer", addrs.join(", ")))
            };
            answers.push((format!("the replica nodes of backend {}", backend.name), found));
        }
        verdict(node, &answers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn said(list: &[(&str, Lookup)]) -> Vec<(String, Lookup)> {
        list.iter().map(|(s, a)| (s.to_string(), a.clone())).collect()
    }

    #[test]
    fn a_node_any_source_knows_is_found_whatever_the_others_say() {
        let answers = said(&[("a", Lookup::Unknown), ("b", Lookup::Unreachable("down".into())), ("c", Lookup::Known)]);
        assert!(verdict("n", &answers).is_ok());
    }

    #[test]
    fn an_unknown_node_is_not_found_only_when_every_source_answered() {
        let all = said(&[("a", Lookup::Unknown), ("b", Lookup::Unknown)]);
        let e = verdict("ghost", &all).expect_err("refused");
        assert_eq!(e.code(), tonic::Code::NotFound, "{e}");
        assert!(e.to_string().contains("ghost") && e.to_string().contains("a, b"), "{e}");
        let partial = said(&[("a", Lookup::Unknown), ("b", Lookup::Unreachable("timed out".into()))]);
        let e = verdict("ghost", &partial).expect_err("refused");
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
        assert!(e.to_string().contains("b: timed out"), "{e}");
    }

    #[test]
    fn only_a_host_that_is_both_and_talks_to_no_other_node_is_standalone() {
        assert!(is_standalone(Mode::All, false, false));
        assert!(!is_standalone(Mode::All, true, false));
        assert!(!is_standalone(Mode::All, false, true));
        assert!(!is_standalone(Mode::Controller, false, false));
        assert!(!is_standalone(Mode::Node, false, false));
    }

    #[test]
    fn configured_ids_make_the_directory_complete_and_empty_ones_are_dropped() {
        assert!(!NodeDirectory::default().has_complete_source());
        assert!(!NodeDirectory::new([String::new()], None).has_complete_source());
        assert!(NodeDirectory::new(["n1".to_string()], None).has_complete_source());
    }
}
