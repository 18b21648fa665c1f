//! Missing required fields are INVALID_ARGUMENT, on every RPC of every service that has them.
use crate::{Pending, Suite, made_snapshot, made_volume, path_str};
use csi::controller_service_capability::rpc::Type as ControllerRpc;
use csi::node_service_capability::rpc::Type as NodeRpc;
use tonic::Code;
use wasmcsi_proto::csi::v1 as csi;

impl Suite<'_> {
    /// Missing required fields are INVALID_ARGUMENT, on every RPC that has them.
    pub(crate) async fn validation_checks(&mut self, volume: Option<&csi::Volume>) {
        let id = volume.map_or_else(|| self.unknown_id(), |v| v.volume_id.clone());
        let cap = self.profile.capability.clone();
        let base = self.create_request(&self.name("invalid"), self.profile.required_bytes);
        let snapshots = self.controller_gate(ControllerRpc::CreateDeleteSnapshot);
        let expand = self.controller_gate(ControllerRpc::ExpandVolume);
        let get = self.controller_gate(ControllerRpc::GetVolume);
        let range = Some(csi::CapacityRange { required_bytes: self.profile.required_bytes, limit_bytes: 0 });
        let no_type = csi::VolumeCapability { access_type: None, access_mode: cap.access_mode };
        let unknown_mode = csi::VolumeCapability {
            access_type: cap.access_type.clone(),
            access_mode: Some(csi::volume_capability::AccessMode { mode: 0 }),
        };
        let no_mode = csi::VolumeCapability { access_type: cap.access_type.clone(), access_mode: None };

        let mut cases: Vec<(&str, Option<String>, Pending)> = vec![
            (
                "CreateVolume without name is InvalidArgument",
                None,
                rpc!(
                    self.ctl(),
                    create_volume,
                    csi::CreateVolumeRequest { name: String::new(), ..base.clone() },
                    made_volume
                ),
            ),
            (
                "CreateVolume without volume_capabilities is InvalidArgument",
                None,
                rpc!(
                    self.ctl(),
                    create_volume,
                    csi::CreateVolumeRequest { volume_capabilities: vec![], ..base.clone() },
                    made_volume
                ),
            ),
            (
                "CreateVolume with a capability without access_type is InvalidArgument",
                None,
                rpc!(
                    self.ctl(),
                    create_volume,
                    csi::CreateVolumeRequest { volume_capabilities: vec![no_type.clone()], ..base.clone() },
                    made_volume
                ),
            ),
            (
                "CreateVolume with an unknown access mode is InvalidArgument",
                None,
                rpc!(
                    self.ctl(),
                    create_volume,
                    csi::CreateVolumeRequest { volume_capabilities: vec![unknown_mode.clone()], ..base.clone() },
                    made_volume
                ),
            ),
            (
                "CreateVolume with a capability without access_mode is InvalidArgument",
                None,
                rpc!(
                    self.ctl(),
                    create_volume,
                    csi::CreateVolumeRequest { volume_capabilities: vec![no_mode], ..base.clone() },
                    made_volume
                ),
            ),
            (
                "DeleteVolume without volume_id is InvalidArgument",
                None,
                rpc!(self.ctl(), delete_volume, csi::DeleteVolumeRequest::default()),
            ),
            (
                "ValidateVolumeCapabilities without volume_id is InvalidArgument",
                None,
                rpc!(
                    self.ctl(),
                    validate_volume_capabilities,
                    csi::ValidateVolumeCapabilitiesRequest {
                        volume_capabilities: vec![cap.clone()],
                        ..Default::default()
                    }
                ),
            ),
            (
                "ValidateVolumeCapabilities without volume_capabilities is InvalidArgument",
                None,
                rpc!(
                    self.ctl(),
                    validate_volume_capabilities,
                    csi::ValidateVolumeCapabilitiesRequest { volume_id: id.clone(), ..Default::default() }
                ),
            ),
            (
                "CreateSnapshot without name is InvalidArgument",
                snapshots.clone(),
                rpc!(
                    self.ctl(),
                    create_snapshot,
                    csi::CreateSnapshotRequest { source_volume_id: id.clone(), ..Default::default() },
                    made_snapshot
                ),
            ),
            (
                "CreateSnapshot without source_volume_id is InvalidArgument",
                snapshots.clone(),
                rpc!(
                    self.ctl(),
                    create_snapshot,
                    csi::CreateSnapshotRequest { name: self.name("invalid-snap"), ..Default::default() },
                    made_snapshot
                ),
            ),
            (
                "GetSnapshot without snapshot_id is InvalidArgument",
                self.controller_gate(ControllerRpc::GetSnapshot),
                rpc!(self.ctl(), get_snapshot, csi::GetSnapshotRequest::default()),
            ),
            (
                "DeleteSnapshot without snapshot_id is InvalidArgument",
                snapshots,
                rpc!(self.ctl(), delete_snapshot, csi::DeleteSnapshotRequest::default()),
            ),
            (
                "ControllerExpandVolume without volume_id is InvalidArgument",
                expand.clone(),
                rpc!(
                    self.ctl(),
                    controller_expand_volume,
                    csi::ControllerExpandVolumeRequest { capacity_range: range, ..Default::default() }
                ),
            ),
            (
                "ControllerExpandVolume without capacity_range is InvalidArgument",
                expand,
                rpc!(
                    self.ctl(),
                    controller_expand_volume,
                    csi::ControllerExpandVolumeRequest { volume_id: id.clone(), ..Default::default() }
                ),
            ),
            (
                "ControllerGetVolume without volume_id is InvalidArgument",
                get,
                rpc!(self.ctl(), controller_get_volume, csi::ControllerGetVolumeRequest::default()),
            ),
        ];

        // Node: real paths under the work dir, registered for cleanup in case a broken host
        // mounts despite the missing field.
        let staging = self.work.join("invalid-staging");
        let target = self.work.join("invalid-target").join("mount");
        self.created.staged.push((id.clone(), staging.clone()));
        self.created.published.push((id.clone(), target.clone()));
        let context = volume.map(|v| v.volume_context.clone()).unwrap_or_default();
        let stage = self.stage_request(&id, &context, &staging);
        let publish = self.publish_request(&id, &context, &staging, &target, false);
        let stats = csi::NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: path_str(&self.work),
            ..Default::default()
        };
        let node_expand = csi::NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: path_str(&self.work),
            capacity_range: range,
            ..Default::default()
        };
        let node = self.node_gate(None);
        let node_stats = self.node_gate(Some(NodeRpc::GetVolumeStats));
        let node_expand_gate = self.node_gate(Some(NodeRpc::ExpandVolume));
        let node_cases: Vec<(&str, Option<String>, Pending)> = vec![
            (
                "NodeStageVolume without volume_id is InvalidArgument",
                node.clone(),
                rpc!(
                    self.nd(),
                    node_stage_volume,
                    csi::NodeStageVolumeRequest { volume_id: String::new(), ..stage.clone() }
                ),
            ),
            (
                "NodeStageVolume without staging_target_path is InvalidArgument",
                node.clone(),
                rpc!(
                    self.nd(),
                    node_stage_volume,
                    csi::NodeStageVolumeRequest { staging_target_path: String::new(), ..stage.clone() }
                ),
            ),
            (
                "NodeStageVolume without volume_capability is InvalidArgument",
                node.clone(),
                rpc!(
                    self.nd(),
                    node_stage_volume,
                    csi::NodeStageVolumeRequest { volume_capability: None, ..stage.clone() }
                ),
            ),
            (
                "NodeStageVolume with a capability without access_type is InvalidArgument",
                node.clone(),
                rpc!(
                    self.nd(),
                    node_stage_volume,
                    csi::NodeStageVolumeRequest { volume_capability: Some(no_type.clone()), ..stage.clone() }
                ),
            ),
            (
                "NodePublishVolume without volume_id is InvalidArgument",
                node.clone(),
                rpc!(
                    self.nd(),
                    node_publish_volume,
                    csi::NodePublishVolumeRequest { volume_id: String::new(), ..publish.clone() }
                ),
            ),
            (
                "NodePublishVolume without staging_target_path is InvalidArgument",
                node.clone(),
                rpc!(
                    self.nd(),
                    node_publish_volume,
                    csi::NodePublishVolumeRequest { staging_target_path: String::new(), ..publish.clone() }
                ),
            ),
            (
                "NodePublishVolume without target_path is InvalidArgument",
                node.clone(),
                rpc!(
                    self.nd(),
                    node_publish_volume,
                    csi::NodePublishVolumeRequest { target_path: String::new(), ..publish.clone() }
                ),
            ),
            (
                "NodePublishVolume without volume_capability is InvalidArgument",
                node.clone(),
                rpc!(
                    self.nd(),
                    node_publish_volume,
                    csi::NodePublishVolumeRequest { volume_capability: None, ..publish.clone() }
                ),
            ),
            (
                "NodeUnstageVolume without volume_id is InvalidArgument",
                node.clone(),
                rpc!(
                    self.nd(),
                    node_unstage_volume,
                    csi::NodeUnstageVolumeRequest { volume_id: String::new(), staging_target_path: path_str(&staging) }
                ),
            ),
            (
                "NodeUnstageVolume without staging_target_path is InvalidArgument",
                node.clone(),
                rpc!(
                    self.nd(),
                    node_unstage_volume,
                    csi::NodeUnstageVolumeRequest { volume_id: id.clone(), staging_target_path: String::new() }
                ),
            ),
            (
                "NodeUnpublishVolume without volume_id is InvalidArgument",
                node.clone(),
                rpc!(
                    self.nd(),
                    node_unpublish_volume,
                    csi::NodeUnpublishVolumeRequest { volume_id: String::new(), target_path: path_str(&target) }
                ),
            ),
            (
                "NodeUnpublishVolume without target_path is InvalidArgument",
                node,
                rpc!(
                    self.nd(),
                    node_unpublish_volume,
                    csi::NodeUnpublishVolumeRequest { volume_id: id.clone(), target_path: String::new() }
                ),
            ),
            (
                "NodeGetVolumeStats without volume_id is InvalidArgument",
                node_stats.clone(),
                rpc!(
                    self.nd(),
                    node_get_volume_stats,
                    csi::NodeGetVolumeStatsRequest { volume_id: String::new(), ..stats.clone() }
                ),
            ),
            (
                "NodeGetVolumeStats without volume_path is InvalidArgument",
                node_stats,
                rpc!(
                    self.nd(),
                    node_get_volume_stats,
                    csi::NodeGetVolumeStatsRequest { volume_path: String::new(), ..stats }
                ),
            ),
            (
                "NodeExpandVolume without volume_id is InvalidArgument",
                node_expand_gate.clone(),
                rpc!(
                    self.nd(),
                    node_expand_volume,
                    csi::NodeExpandVolumeRequest { volume_id: String::new(), ..node_expand.clone() }
                ),
            ),
            (
                "NodeExpandVolume without volume_path is InvalidArgument",
                node_expand_gate,
                rpc!(
                    self.nd(),
                    node_expand_volume,
                    csi::NodeExpandVolumeRequest { volume_path: String::new(), ..node_expand }
                ),
            ),
        ];
        cases.extend(node_cases);
        for (name, gate, pending) in cases {
            self.expect(name, gate, Code::InvalidArgument, pending).await;
        }
    }
}
