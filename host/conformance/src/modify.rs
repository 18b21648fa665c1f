//! ControllerModifyVolume and CreateVolume's `mutable_parameters` (VolumeAttributesClass, CSI
//! v1.12): a controller that does not offer MODIFY_VOLUME answers UNIMPLEMENTED; one that does
//! answers for the profile's backend either UNIMPLEMENTED (the backend cannot modify: another
//! backend of the driver can; wasmcsi answers INVALID_ARGUMENT naming the key instead) or by
//! the spec: a missing id or an empty map is INVALID_ARGUMENT,
//! an unknown volume NOT_FOUND, an unknown key INVALID_ARGUMENT naming it — at creation too,
//! where nothing may be made then.
use crate::{NO_VOLUME, Outcome, Suite, call, made_volume, status};
use csi::controller_service_capability::rpc::Type as ControllerRpc;
use tonic::Code;
use wasmcsi_proto::csi::v1 as csi;

/// A key no backend takes.
const UNKNOWN_KEY: &str = "csic-no-such-parameter";

impl Suite<'_> {
    pub(crate) async fn modify_checks(&mut self, volume: Option<&csi::Volume>) {
        let offered = self.controller_gate(ControllerRpc::ModifyVolume).is_none();
        let unknown = [(UNKNOWN_KEY.to_string(), "1".to_string())].into_iter().collect();
        if !offered {
            let request = csi::ControllerModifyVolumeRequest {
                volume_id: volume.map_or_else(|| self.unknown_id(), |v| v.volume_id.clone()),
                mutable_parameters: unknown,
                ..Default::default()
            };
            self.expect(
                "ControllerModifyVolume is Unimplemented without MODIFY_VOLUME",
                None,
                Code::Unimplemented,
                rpc!(self.ctl(), controller_modify_volume, self.secreted(request)),
            )
            .await;
            return;
        }

        let request = csi::ControllerModifyVolumeRequest { mutable_parameters: unknown.clone(), ..Default::default() };
        self.expect(
            "ControllerModifyVolume without volume_id is InvalidArgument",
            None,
            Code::InvalidArgument,
            rpc!(self.ctl(), controller_modify_volume, request),
        )
        .await;

        const NAME: &str = "ControllerModifyVolume with an unknown key is InvalidArgument naming it";
        let Some(v) = volume else {
            self.record(NAME, Outcome::Skip(NO_VOLUME.into()));
            return;
        };
        let request = csi::ControllerModifyVolumeRequest {
            volume_id: v.volume_id.clone(),
            mutable_parameters: unknown.clone(),
            ..Default::default()
        };
        let answer = call(self.ctl().controller_modify_volume(self.secreted(request))).await;
        let modifies = match answer {
            Err(s) if s.code() == Code::Unimplemented => {
                self.record(NAME, Outcome::Skip(format!("the backend does not modify volumes: {}", s.message())));
                false
            }
            Err(s) if s.code() == Code::InvalidArgument && s.message().contains(UNKNOWN_KEY) => {
                self.record(NAME, Outcome::Pass);
                true
            }
            Err(s) => {
                self.record(
                    NAME,
                    Outcome::Fail(format!("expected InvalidArgument naming {UNKNOWN_KEY}, got {}", status(s))),
                );
                true
            }
            Ok(_) => {
                self.record(NAME, Outcome::Fail("an unknown key was accepted".into()));
                true
            }
        };
        if !modifies {
            return;
        }

        let request = csi::ControllerModifyVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() };
        self.expect(
            "ControllerModifyVolume with no mutable_parameters is InvalidArgument",
            None,
            Code::InvalidArgument,
            rpc!(self.ctl(), controller_modify_volume, self.secreted(request)),
        )
        .await;
        let request = csi::ControllerModifyVolumeRequest {
            volume_id: self.unknown_id(),
            mutable_parameters: unknown.clone(),
            ..Default::default()
        };
        self.expect(
            "ControllerModifyVolume of an unknown volume is NotFound",
            None,
            Code::NotFound,
            rpc!(self.ctl(), controller_modify_volume, self.secreted(request)),
        )
        .await;

        const CREATE: &str = "CreateVolume with an unknown mutable parameter is InvalidArgument naming it";
        let mut request = self.create_request(&self.name("mutable"), self.profile.required_bytes);
        request.mutable_parameters = unknown;
        let verdict = match call(self.ctl().create_volume(request)).await {
            Err(s) if s.code() == Code::InvalidArgument && s.message().contains(UNKNOWN_KEY) => Ok(()),
            Err(s) => Err(format!("expected InvalidArgument naming {UNKNOWN_KEY}, got {}", status(s))),
            Ok(r) => {
                self.created.made(&made_volume(r));
                Err("a volume was made with an unknown mutable parameter".into())
            }
        };
        self.judge(CREATE, verdict);
    }
}
