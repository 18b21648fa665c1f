//! The GroupController service (VolumeGroupSnapshots): advertised in GetPluginCapabilities
//! exactly when GroupControllerGetCapabilities offers CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT
//! (a backend that does not offer group snapshots must not advertise the service), and when
//! offered: CreateVolumeGroupSnapshot of the volume idempotent, one ordinary snapshot per source
//! naming the group, GetVolumeGroupSnapshot, the spec's codes for no sources and a missing
//! source, DeleteVolumeGroupSnapshot idempotent and NOT_FOUND from Get afterwards.
use crate::{Outcome, Suite, call, expect_code, status};
use csi::group_controller_service_capability::{Type as GroupType, rpc::Type as GroupRpc};
use csi::plugin_capability::{Type, service};
use tonic::Code;
use wasmcsi_proto::csi::v1 as csi;

impl Suite<'_> {
    /// Whether the service is advertised and offers group snapshots; records the check that the
    /// two agree.
    async fn group_snapshots_offered(&mut self) -> bool {
        const AGREE: &str = "GROUP_CONTROLLER_SERVICE is advertised exactly when group snapshots are offered";
        let advertised = call(self.identity.clone().get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {}))
            .await
            .map(|r| {
                r.capabilities.iter().any(|c| {
                    matches!(&c.r#type, Some(Type::Service(s)) if s.r#type == service::Type::GroupControllerService as i32)
                })
            });
        let offered = call(self.group.clone().group_controller_get_capabilities(csi::GroupControllerGetCapabilitiesRequest {}))
            .await
            .map(|r| {
                r.capabilities.iter().any(|c| {
                    matches!(&c.r#type, Some(GroupType::Rpc(rpc)) if rpc.r#type == GroupRpc::CreateDeleteGetVolumeGroupSnapshot as i32)
                })
            });
        // A driver that does not serve the service at all answers UNIMPLEMENTED: not offered.
        let offered = match offered {
            Err(s) if s.code() == Code::Unimplemented => Ok(false),
            other => other,
        };
        match (advertised, offered) {
            (Ok(a), Ok(o)) => {
                self.judge(AGREE, if a == o { Ok(()) } else { Err(format!("advertised: {a}, offered: {o}")) });
                a && o
            }
            (Err(s), _) | (_, Err(s)) => {
                self.judge(AGREE, Err(status(s)));
                false
            }
        }
    }

    pub(crate) async fn group_snapshot_checks(&mut self, volume: Option<&csi::Volume>) {
        const CREATE: &str = "CreateVolumeGroupSnapshot snapshots every source, each snapshot naming the group";
        const REPEAT: &str = "CreateVolumeGroupSnapshot repeated returns the same group snapshot";
        const GET: &str = "GetVolumeGroupSnapshot returns the group snapshot";
        const EMPTY: &str = "CreateVolumeGroupSnapshot without source volumes is InvalidArgument";
        const MISSING: &str = "CreateVolumeGroupSnapshot of a missing source volume is NotFound";
        const DELETE: &str = "DeleteVolumeGroupSnapshot deletes it, and again succeeds";
        const GONE: &str = "GetVolumeGroupSnapshot of a deleted group snapshot is NotFound";
        let offered = self.group_snapshots_offered().await;
        let blocked = Self::gates([
            (!offered).then(|| "the driver does not offer group snapshots".to_string()),
            volume.is_none().then(|| crate::NO_VOLUME.to_string()),
        ]);
        if self.open(EMPTY, &blocked) {
            let answer = call(self.group.clone().create_volume_group_snapshot(csi::CreateVolumeGroupSnapshotRequest {
                name: self.name("group-empty"),
                secrets: self.profile.secrets.clone(),
                ..Default::default()
            }))
            .await;
            self.record(EMPTY, expect_code(&answer, Code::InvalidArgument));
        }
        if self.open(MISSING, &blocked) {
            let answer = call(self.group.clone().create_volume_group_snapshot(csi::CreateVolumeGroupSnapshotRequest {
                name: self.name("group-missing"),
                source_volume_ids: vec![self.unknown_id()],
                secrets: self.profile.secrets.clone(),
                ..Default::default()
            }))
            .await;
            self.record(MISSING, expect_code(&answer, Code::NotFound));
        }
        let Some(volume) = volume.filter(|_| self.open(CREATE, &blocked)) else {
            for name in [REPEAT, GET, DELETE, GONE] {
                self.open(name, &blocked);
            }
            return;
        };
        let request = csi::CreateVolumeGroupSnapshotRequest {
            name: self.name("group"),
            source_volume_ids: vec![volume.volume_id.clone()],
            secrets: self.profile.secrets.clone(),
            ..Default::default()
        };
        let first = call(self.group.clone().create_volume_group_snapshot(request.clone())).await;
        let group = match first.map(|r| r.group_snapshot) {
            Ok(Some(g)) => {
                let members_ok = g.snapshots.len() == 1
                    && g.snapshots
                        .iter()
                        .all(|s| s.source_volume_id == volume.volume_id && s.group_snapshot_id == g.group_snapshot_id);
                self.judge(
                    CREATE,
                    if !g.group_snapshot_id.is_empty() && members_ok { Ok(()) } else { Err(format!("{g:?}")) },
                );
                g
            }
            Ok(None) => {
                self.judge(CREATE, Err("the answer carries no group snapshot".into()));
                return;
            }
            // A driver of several backends offers the service for all of them; the profile's
            // may take none, and says so with the code of an argument it cannot take.
            Err(s) if s.code() == Code::InvalidArgument => {
                let why = format!("the profile's backend takes no group snapshots: {}", s.message());
                for name in [CREATE, REPEAT, GET, DELETE, GONE] {
                    self.record(name, Outcome::Skip(why.clone()));
                }
                return;
            }
            Err(s) => {
                self.judge(CREATE, Err(status(s)));
                return;
            }
        };
        let again = call(self.group.clone().create_volume_group_snapshot(request)).await;
        self.judge(
            REPEAT,
            match again.map(|r| r.group_snapshot) {
                Ok(Some(g)) if g.group_snapshot_id == group.group_snapshot_id => Ok(()),
                Ok(other) => Err(format!("another answer: {other:?}")),
                Err(s) => Err(status(s)),
            },
        );
        let ids: Vec<String> = group.snapshots.iter().map(|s| s.snapshot_id.clone()).collect();
        let get = |ids: Vec<String>| csi::GetVolumeGroupSnapshotRequest {
            group_snapshot_id: group.group_snapshot_id.clone(),
            snapshot_ids: ids,
            secrets: self.profile.secrets.clone(),
        };
        let got = call(self.group.clone().get_volume_group_snapshot(get(ids.clone()))).await;
        self.judge(
            GET,
            match got.map(|r| r.group_snapshot) {
                Ok(Some(g)) if g.group_snapshot_id == group.group_snapshot_id && g.snapshots.len() == 1 => Ok(()),
                Ok(other) => Err(format!("another answer: {other:?}")),
                Err(s) => Err(status(s)),
            },
        );
        let delete = csi::DeleteVolumeGroupSnapshotRequest {
            group_snapshot_id: group.group_snapshot_id.clone(),
            snapshot_ids: ids,
            secrets: self.profile.secrets.clone(),
        };
        let first = call(self.group.clone().delete_volume_group_snapshot(delete.clone())).await;
        let second = call(self.group.clone().delete_volume_group_snapshot(delete)).await;
        self.judge(DELETE, first.and(second).map(drop).map_err(status));
        let gone = call(self.group.clone().get_volume_group_snapshot(get(vec![]))).await;
        self.record(GONE, expect_code(&gone, Code::NotFound));
    }
}
