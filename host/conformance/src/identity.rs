//! The Identity service (GetPluginInfo, GetPluginCapabilities, Probe) and the capabilities the
//! controller and node services offer, which gate the checks after them.
use crate::{Outcome, Suite, call, status};
use csi::controller_service_capability::rpc::Type as ControllerRpc;
use csi::node_service_capability::rpc::Type as NodeRpc;
use std::collections::HashSet;
use tonic::Code;
use wasmcsi_proto::csi::v1 as csi;

impl Suite<'_> {
    pub(crate) async fn identity_checks(&mut self) {
        let answer = call(self.identity.clone().get_plugin_info(csi::GetPluginInfoRequest {})).await;
        self.judge(
            "GetPluginInfo returns a name and a version",
            answer.map_err(status).and_then(|info| {
                if info.name.is_empty() || info.name.len() > 63 {
                    Err(format!("name {:?} must be 1-63 characters", info.name))
                } else if info.vendor_version.is_empty() {
                    Err("vendor_version is empty".into())
                } else {
                    Ok(())
                }
            }),
        );

        use csi::plugin_capability::{Type, service};
        let answer = call(self.identity.clone().get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {})).await;
        self.judge(
            "GetPluginCapabilities offers CONTROLLER_SERVICE",
            answer.map_err(status).and_then(|r| {
                let offered = r.capabilities.iter().any(|c| matches!(&c.r#type, Some(Type::Service(s)) if s.r#type == service::Type::ControllerService as i32));
                if offered { Ok(()) } else { Err(format!("capabilities: {:?}", r.capabilities)) }
            }),
        );

        let answer = call(self.identity.clone().probe(csi::ProbeRequest {})).await;
        self.judge(
            "Probe reports ready",
            answer.map_err(status).and_then(
                |r| {
                    if r.ready == Some(false) { Err("ready = false".into()) } else { Ok(()) }
                },
            ),
        );
    }

    pub(crate) async fn capability_checks(&mut self) {
        use csi::controller_service_capability::Type;
        let answer = call(self.ctl().controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})).await;
        match answer {
            Ok(r) => {
                let caps: HashSet<i32> = r
                    .capabilities
                    .iter()
                    .filter_map(|c| match &c.r#type {
                        Some(Type::Rpc(rpc)) => Some(rpc.r#type),
                        _ => None,
                    })
                    .collect();
                let verdict = if caps.contains(&(ControllerRpc::CreateDeleteVolume as i32)) {
                    Ok(())
                } else {
                    Err("CREATE_DELETE_VOLUME is not offered".into())
                };
                self.controller_caps = Some(caps);
                self.judge("ControllerGetCapabilities offers CREATE_DELETE_VOLUME", verdict);
            }
            Err(s) => self.record("ControllerGetCapabilities offers CREATE_DELETE_VOLUME", Outcome::Fail(status(s))),
        }

        // Without PUBLISH_UNPUBLISH_VOLUME the spec asks for UNIMPLEMENTED.
        let offered =
            self.controller_caps.as_ref().is_some_and(|c| c.contains(&(ControllerRpc::PublishUnpublishVolume as i32)));
        let gate = offered.then(|| "the controller offers PUBLISH_UNPUBLISH_VOLUME".to_string());
        let request = csi::ControllerPublishVolumeRequest {
            volume_id: self.unknown_id(),
            node_id: "csic-node".into(),
            volume_capability: Some(self.profile.capability.clone()),
            ..Default::default()
        };
        self.expect(
            "ControllerPublishVolume is Unimplemented",
            gate.clone(),
            Code::Unimplemented,
            rpc!(self.ctl(), controller_publish_volume, request),
        )
        .await;
        let request = csi::ControllerUnpublishVolumeRequest {
            volume_id: self.unknown_id(),
            node_id: "csic-node".into(),
            ..Default::default()
        };
        self.expect(
            "ControllerUnpublishVolume is Unimplemented",
            gate,
            Code::Unimplemented,
            rpc!(self.ctl(), controller_unpublish_volume, request),
        )
        .await;

        use csi::node_service_capability::Type as NodeType;
        const NODE_CAPS: &str = "NodeGetCapabilities offers STAGE_UNSTAGE_VOLUME";
        match call(self.nd().node_get_capabilities(csi::NodeGetCapabilitiesRequest {})).await {
            Ok(r) => {
                let caps: HashSet<i32> = r
                    .capabilities
                    .iter()
                    .filter_map(|c| match &c.r#type {
                        Some(NodeType::Rpc(rpc)) => Some(rpc.r#type),
                        _ => None,
                    })
                    .collect();
                let verdict = if caps.contains(&(NodeRpc::StageUnstageVolume as i32)) {
                    Ok(())
                } else {
                    Err("STAGE_UNSTAGE_VOLUME is not offered".into())
                };
                self.node_caps = Some(caps);
                self.judge(NODE_CAPS, verdict);
            }
            Err(s) if s.code() == Code::Unimplemented && !self.profile.node => {
                self.record(NODE_CAPS, Outcome::Skip(format!("the node service is not served ({})", s.message())));
            }
            Err(s) => self.record(NODE_CAPS, Outcome::Fail(status(s))),
        }

        const NODE_INFO: &str = "NodeGetInfo returns a node id";
        if self.open(NODE_INFO, &self.node_gate(None)) {
            let answer = call(self.nd().node_get_info(csi::NodeGetInfoRequest {})).await;
            let verdict = answer
                .map_err(status)
                .and_then(|r| if r.node_id.is_empty() { Err("node_id is empty".to_string()) } else { Ok(r.node_id) });
            self.node_id = verdict.as_ref().ok().cloned();
            self.judge(NODE_INFO, verdict.map(drop));
        }
    }
}
