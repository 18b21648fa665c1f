//! Topology: the driver advertises VOLUME_ACCESSIBILITY_CONSTRAINTS, so the node reports where
//! it is (NodeGetInfo's accessible topology), and a volume made for accessibility requirements
//! is accessible from one of the requisite topologies. A backend whose volume comes back
//! pinned to the node (`topology.wasmcsi.io/node`, a node-local backend such as hostpath) must
//! also refuse a volume only a node that does not exist could take (RESOURCE_EXHAUSTED, the
//! spec's code for "cannot be provisioned in the requisite topology") and answer GetCapacity
//! per node: this node's answers, one that does not exist has none.
use crate::{Outcome, Suite, call, expect_code, made_volume, status};
use tonic::Code;
use wasmcsi_csi::plugin::TOPOLOGY_NODE_KEY;
use wasmcsi_proto::csi::v1 as csi;

/// A node name no cluster of the suite has.
const NO_SUCH_NODE: &str = "wasmcsi-conformance-no-such-node";

fn node_topology(node: &str) -> csi::Topology {
    csi::Topology { segments: [(TOPOLOGY_NODE_KEY.to_string(), node.to_string())].into_iter().collect() }
}

/// Whether `t` is accessible from within `within` (every segment of `t` is one of `within`).
fn inside(t: &csi::Topology, within: &csi::Topology) -> bool {
    t.segments.iter().all(|(k, v)| within.segments.get(k) == Some(v))
}

impl Suite<'_> {
    pub(super) async fn topology_checks(&mut self) {
        const REPORTED: &str = "NodeGetInfo reports the node's accessible topology";
        const WITHIN: &str = "CreateVolume for this node's topology answers a volume accessible from it";
        const NOWHERE: &str =
            "CreateVolume of a node-pinned volume for a node that does not exist is ResourceExhausted";
        const HERE: &str = "GetCapacity of a node-pinned backend for this node's topology answers";
        const ELSEWHERE: &str = "GetCapacity of a node-pinned backend for a node that does not exist is 0";
        let mut here = None;
        let answer = call(self.nd().node_get_info(csi::NodeGetInfoRequest {})).await;
        match answer {
            // A controller-only host: no node to place on, nothing to check here.
            Err(s) if s.code() == Code::Unimplemented => {
                self.record(REPORTED, Outcome::Skip("the host serves no Node service".into()));
            }
            answer => {
                let verdict = answer.map_err(status).and_then(|info| match info.accessible_topology {
                    Some(t) if t.segments.get(TOPOLOGY_NODE_KEY) == Some(&info.node_id) => {
                        here = Some(t);
                        Ok(())
                    }
                    Some(t) => {
                        Err(format!("{TOPOLOGY_NODE_KEY} is not the node id {:?}: {:?}", info.node_id, t.segments))
                    }
                    None => Err("no accessible_topology".into()),
                });
                self.judge(REPORTED, verdict);
            }
        }
        let blocked = here.is_none().then(|| "the node reported no topology".to_string());
        let mut pinned = false;
        if self.open(WITHIN, &blocked)
            && let Some(t) = &here
        {
            let mut request = self.create_request(&self.name("topo"), self.profile.required_bytes);
            request.accessibility_requirements =
                Some(csi::TopologyRequirement { requisite: vec![t.clone()], preferred: vec![t.clone()] });
            let answer = call(self.ctl().create_volume(request)).await;
            if let Ok(r) = &answer {
                self.created.made(&made_volume(r.clone()));
            }
            let verdict = answer.map_err(status).and_then(|r| {
                let v = r.volume.ok_or("the answer carries no volume")?;
                pinned = v.accessible_topology.iter().any(|a| a.segments.contains_key(TOPOLOGY_NODE_KEY));
                // None: accessible everywhere, this node included.
                if v.accessible_topology.is_empty() || v.accessible_topology.iter().any(|a| inside(a, t)) {
                    Ok(())
                } else {
                    Err(format!("accessible from {:?}, none of them this node", v.accessible_topology))
                }
            });
            self.judge(WITHIN, verdict);
        }
        let pin_blocked = (!pinned).then(|| "the backend's volumes are not pinned to a node".to_string());
        if self.open(NOWHERE, &pin_blocked) {
            let nowhere = node_topology(NO_SUCH_NODE);
            let mut request = self.create_request(&self.name("nowhere"), self.profile.required_bytes);
            request.accessibility_requirements =
                Some(csi::TopologyRequirement { requisite: vec![nowhere.clone()], preferred: vec![nowhere] });
            let answer = call(self.ctl().create_volume(request)).await;
            if let Ok(r) = &answer {
                self.created.made(&made_volume(r.clone()));
            }
            self.record(NOWHERE, expect_code(&answer, Code::ResourceExhausted));
        }
        for (name, node) in [(HERE, here.clone()), (ELSEWHERE, Some(node_topology(NO_SUCH_NODE)))] {
            if !self.open(name, &pin_blocked) {
                continue;
            }
            let request = csi::GetCapacityRequest {
                volume_capabilities: vec![self.profile.capability.clone()],
                parameters: self.profile.parameters.clone(),
                accessible_topology: node,
            };
            let answer = call(self.ctl().get_capacity(request)).await;
            let verdict = answer.map_err(status).and_then(|c| match (name, c.available_capacity) {
                (ELSEWHERE, 0) | (HERE, _) => Ok(()),
                (_, n) => Err(format!("{n} bytes available on a node that does not exist")),
            });
            self.judge(name, verdict);
        }
    }
}
