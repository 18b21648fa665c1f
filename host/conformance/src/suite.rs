//! The runner every check goes through: the [`Suite`] (clients, what the driver offers, the
//! checks so far), how one answer is awaited and judged (a bounded [`call`], [`expect_code`],
//! optional features' UNIMPLEMENTED as a skip, gates that skip a check with the reason), the
//! requests most checks build, and the order the checks run in ([`Suite::all_checks`]).
use crate::{CALL_TIMEOUT, Check, Created, Outcome, Pending, Profile, Secreted};
use csi::controller_client::ControllerClient;
use csi::controller_service_capability::rpc::Type as ControllerRpc;
use csi::group_controller_client::GroupControllerClient;
use csi::identity_client::IdentityClient;
use csi::node_client::NodeClient;
use csi::node_service_capability::rpc::Type as NodeRpc;
use std::collections::HashSet;
use std::future::Future;
use std::path::Path;
use std::path::PathBuf;
use tonic::Code;
use tonic::Status;
use tonic::transport::Channel;
use wasmcsi_proto::csi::v1 as csi;

/// Await one answer, bounded by [`CALL_TIMEOUT`].
pub(crate) async fn call<T>(fut: impl Future<Output = Result<tonic::Response<T>, Status>>) -> Result<T, Status> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(answer) => answer.map(tonic::Response::into_inner),
        Err(_) => Err(Status::deadline_exceeded(format!("no answer within {CALL_TIMEOUT:?}"))),
    }
}

pub(crate) fn status(s: Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

pub(crate) fn expect_code<T>(answer: &Result<T, Status>, want: Code) -> Outcome {
    match (answer, want) {
        (Ok(_), Code::Ok) => Outcome::Pass,
        (Ok(_), _) => Outcome::Fail(format!("expected {want:?}, got OK")),
        (Err(s), _) if s.code() == want => Outcome::Pass,
        (Err(s), _) => Outcome::Fail(format!("expected {want:?}, got {:?}: {}", s.code(), s.message())),
    }
}

pub(crate) fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

pub(crate) struct Suite<'p> {
    pub(crate) profile: &'p Profile,
    pub(crate) backend: String,
    /// Unique per run: names of created objects and the work directory.
    pub(crate) run: String,
    /// This run's directory under the profile's `work_dir` (canonical).
    pub(crate) work: PathBuf,
    pub(crate) identity: IdentityClient<Channel>,
    pub(crate) controller: ControllerClient<Channel>,
    pub(crate) node: NodeClient<Channel>,
    pub(crate) group: GroupControllerClient<Channel>,
    /// `None`: the capabilities are unknown (the call failed), so nothing is skipped for them.
    pub(crate) controller_caps: Option<HashSet<i32>>,
    /// `None`: the node service is not served.
    pub(crate) node_caps: Option<HashSet<i32>>,
    /// What NodeGetInfo answered: the node ControllerPublishVolume names.
    pub(crate) node_id: Option<String>,
    pub(crate) checks: Vec<Check>,
    pub(crate) created: Created,
}

/// The objects the controller checks made, for the checks after them.
#[derive(Default)]
pub(crate) struct Objects {
    pub(crate) volume: Option<csi::Volume>,
    /// Capacity after ControllerExpandVolume, when that worked.
    pub(crate) expanded: Option<i64>,
    /// A second volume (from the concurrent CreateVolume check).
    pub(crate) other: Option<String>,
    pub(crate) snapshot: Option<csi::Snapshot>,
    pub(crate) clones: Vec<String>,
    /// The node flow wrote [`DATA_FILE`](crate::DATA_FILE) into the volume.
    pub(crate) data_written: bool,
}

impl Suite<'_> {
    pub(crate) fn record(&mut self, name: &str, outcome: Outcome) {
        self.checks.push(Check { name: name.to_string(), outcome });
    }

    pub(crate) fn judge(&mut self, name: &str, verdict: Result<(), String>) {
        self.record(name, verdict.map_or_else(Outcome::Fail, |()| Outcome::Pass));
    }

    /// Judge an answer of an optional feature: UNIMPLEMENTED is a skip.
    pub(crate) fn judge_optional<T>(
        &mut self,
        name: &str,
        answer: Result<T, Status>,
        verify: impl FnOnce(T) -> Result<(), String>,
    ) -> bool {
        match answer {
            Ok(t) => {
                let verdict = verify(t);
                let ok = verdict.is_ok();
                self.judge(name, verdict);
                ok
            }
            Err(s) if s.code() == Code::Unimplemented => {
                self.record(name, Outcome::Skip(format!("not supported: {}", s.message())));
                false
            }
            Err(s) => {
                self.record(name, Outcome::Fail(status(s)));
                false
            }
        }
    }

    /// `true` when the check may run; otherwise it is recorded as skipped with `blocked`'s reason.
    pub(crate) fn open(&mut self, name: &str, blocked: &Option<String>) -> bool {
        match blocked {
            Some(why) => {
                self.record(name, Outcome::Skip(why.clone()));
                false
            }
            None => true,
        }
    }

    /// Run one RPC and expect `want` (`Code::Ok` for success), unless `gate` says skip.
    pub(crate) async fn expect(&mut self, name: &str, gate: Option<String>, want: Code, rpc: Pending) {
        self.expect_answer(name, gate, want, rpc, false).await
    }

    /// [`Self::expect`] for an RPC of an optional feature (snapshots, expansion, GetVolume):
    /// UNIMPLEMENTED is a skip, as in [`Self::judge_optional`]. The controller offers every
    /// feature; the host answers UNIMPLEMENTED for a backend that lacks one.
    pub(crate) async fn expect_optional(&mut self, name: &str, gate: Option<String>, want: Code, rpc: Pending) {
        self.expect_answer(name, gate, want, rpc, true).await
    }

    pub(crate) async fn expect_answer(
        &mut self,
        name: &str,
        gate: Option<String>,
        want: Code,
        rpc: Pending,
        optional: bool,
    ) {
        if !self.open(name, &gate) {
            return;
        }
        let answer = match tokio::time::timeout(CALL_TIMEOUT, rpc).await {
            Ok(a) => a,
            Err(_) => Err(Status::deadline_exceeded(format!("no answer within {CALL_TIMEOUT:?}"))),
        };
        if let Ok(made) = &answer {
            self.created.made(made);
        }
        let outcome = match &answer {
            Err(s) if optional && s.code() == Code::Unimplemented && want != Code::Unimplemented => {
                Outcome::Skip(format!("not supported: {}", s.message()))
            }
            _ => expect_code(&answer, want),
        };
        self.record(name, outcome);
    }

    pub(crate) fn controller_gate(&self, rpc: ControllerRpc) -> Option<String> {
        match &self.controller_caps {
            Some(caps) if !caps.contains(&(rpc as i32)) => {
                Some(format!("the controller does not offer {}", rpc.as_str_name()))
            }
            _ => None,
        }
    }

    pub(crate) fn node_gate(&self, rpc: Option<NodeRpc>) -> Option<String> {
        match (&self.node_caps, rpc) {
            (None, _) => Some("the node service is not served".into()),
            (Some(caps), Some(rpc)) if !caps.contains(&(rpc as i32)) => {
                Some(format!("the node does not offer {}", rpc.as_str_name()))
            }
            _ => None,
        }
    }

    pub(crate) fn gates(gates: impl IntoIterator<Item = Option<String>>) -> Option<String> {
        gates.into_iter().flatten().next()
    }

    pub(crate) fn name(&self, what: &str) -> String {
        format!("csic-{}-{what}", self.run)
    }

    /// An id of the profile's backend that names nothing.
    pub(crate) fn unknown_id(&self) -> String {
        format!("{}:default.does-not-exist", self.backend)
    }

    pub(crate) fn ctl(&self) -> ControllerClient<Channel> {
        self.controller.clone()
    }

    pub(crate) fn nd(&self) -> NodeClient<Channel> {
        self.node.clone()
    }

    pub(crate) fn create_request(&self, name: &str, required_bytes: i64) -> csi::CreateVolumeRequest {
        csi::CreateVolumeRequest {
            name: name.to_string(),
            capacity_range: Some(csi::CapacityRange { required_bytes, limit_bytes: 0 }),
            volume_capabilities: vec![self.profile.capability.clone()],
            parameters: self.profile.parameters.clone(),
            secrets: self.profile.secrets.clone(),
            ..Default::default()
        }
    }

    /// DeleteVolume of `volume_id`, with the profile's secrets.
    pub(crate) fn delete_request(&self, volume_id: &str) -> csi::DeleteVolumeRequest {
        self.secreted(csi::DeleteVolumeRequest { volume_id: volume_id.to_owned(), ..Default::default() })
    }

    /// The profile's secrets on a controller request that has none of its own (what the CO
    /// would pass from the StorageClass's provisioner/controller secret references).
    pub(crate) fn secreted<R: Secreted>(&self, mut request: R) -> R {
        let secrets = request.secrets_mut();
        if secrets.is_empty() {
            secrets.clone_from(&self.profile.secrets);
        }
        request
    }

    pub(crate) fn data(&self) -> Vec<u8> {
        format!("written through the target path by conformance run {}\n", self.run).into_bytes()
    }

    // ---- the suite ---------------------------------------------------------------------

    pub(crate) async fn all_checks(&mut self) {
        self.identity_checks().await;
        self.capability_checks().await;
        self.backend_parameter_checks().await;
        self.unknown_id_checks().await;
        let mut objects = Objects { volume: self.create_volume_checks().await, ..Default::default() };
        self.name_checks().await;
        self.validation_checks(objects.volume.as_ref()).await;
        objects.other = self.concurrent_create_check().await;
        self.get_capacity_check().await;
        self.topology_checks().await;
        self.get_volume_check(objects.volume.as_ref()).await;
        self.modify_checks(objects.volume.as_ref()).await;
        objects.expanded = self.expand_checks(objects.volume.as_ref()).await;
        self.unknown_node_check(objects.volume.as_ref()).await;
        objects.data_written = self.node_flow(&objects).await;
        objects.snapshot = self.snapshot_checks(&objects).await;
        self.snapshot_name_checks(objects.volume.as_ref()).await;
        self.group_snapshot_checks(objects.volume.as_ref()).await;
        self.clone_checks(&mut objects).await;
        self.list_volumes_checks(&objects).await;
        self.delete_checks(&objects).await;
        self.reused_name_check().await;
    }
}
