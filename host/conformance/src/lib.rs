//! The CSI conformance suite: drives a running host over its real unix socket with a real gRPC
//! client, as kubelet and the CSI sidecars would, and judges every answer against the CSI spec
//! (v1.12): required fields, error codes, idempotent repeats, concurrent retries, paging,
//! snapshots (GetSnapshot too) and clones, any name the spec allows and none it bans (`names`),
//! and, when the profile allows real mounts, the node's stage/publish/unpublish/unstage flow
//! (with ControllerPublishVolume first when the controller offers it, as a CO does) and the
//! one-target rule of SINGLE_NODE_SINGLE_WRITER (`single_writer`). `wasmcsi backend check` and the integration tests share
//! it; it works against any backend, named by the profile's `backend` parameter.
//!
//! Every check is named and judged on its own: a failure never stops the suite, and a check that
//! needs an object an earlier check could not make is skipped with the reason. What the suite
//! creates (volumes, snapshots, mounts, directories under `work_dir`) is removed at the end even
//! when checks failed, and that cleanup is judged as a check too. Optional features a backend
//! answers UNIMPLEMENTED for (snapshots, clones, expansion, ...) are skipped, not failed.
//!
//! It does not start hosts (see `crate::host`) and it never looks inside one: everything it
//! knows comes over the socket, plus the mount table of this machine for the node checks.
use anyhow::Context;
use csi::controller_client::ControllerClient;
use csi::controller_service_capability::rpc::Type as ControllerRpc;
use csi::identity_client::IdentityClient;
use csi::node_client::NodeClient;
use csi::node_service_capability::rpc::Type as NodeRpc;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;
use tonic::transport::Channel;
use tonic::{Code, Status};
use wasmcsi_csi::driver::BACKEND_PARAMETER;
use wasmcsi_csi::node::mountinfo;
use wasmcsi_proto::csi::v1 as csi;

mod names;
mod single_writer;
mod topology;

/// Longest the suite waits for one answer: a host that hangs fails that check, not the suite.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Parallel copies of one CreateVolume / DeleteVolume, as retrying sidecars may send them.
const PARALLEL: usize = 8;
/// Pages followed before a listing counts as a token loop.
const MAX_PAGES: usize = 10_000;
/// An id no driver of ours hands out.
const FOREIGN_ID: &str = "nope";
/// A well-formed backend name that is (presumably) not loaded.
const UNKNOWN_BACKEND: &str = "csic-no-such-backend";
/// The file the node flow writes and the clone checks expect to find.
const DATA_FILE: &str = "conformance.txt";
const NO_VOLUME: &str = "no volume: CreateVolume failed";

/// What to test and how: the StorageClass a backend is used with.
#[derive(Debug, Clone)]
pub struct Profile {
    /// StorageClass parameters, including `backend`.
    pub parameters: HashMap<String, String>,
    /// Used to create, validate, stage and publish.
    pub capability: csi::VolumeCapability,
    pub required_bytes: i64,
    /// Run the node flow (real mounts: needs root and the node service).
    pub node: bool,
    /// Staging and target directories are made in a fresh directory under it.
    pub work_dir: PathBuf,
    /// CSI secrets put into every controller request that carries secrets (ceph-csi's
    /// `userID`/`userKey` for an RBD backend); empty for backends that need none.
    pub secrets: HashMap<String, String>,
}

/// Controller requests that carry CSI secrets.
trait Secreted {
    fn secrets_mut(&mut self) -> &mut HashMap<String, String>;
}

macro_rules! secreted {
    ($($t:ident),*) => {$(
        impl Secreted for csi::$t {
            fn secrets_mut(&mut self) -> &mut HashMap<String, String> {
                &mut self.secrets
            }
        }
    )*};
}
secreted!(
    CreateVolumeRequest,
    DeleteVolumeRequest,
    CreateSnapshotRequest,
    DeleteSnapshotRequest,
    GetSnapshotRequest,
    ControllerExpandVolumeRequest,
    ValidateVolumeCapabilitiesRequest
);

impl Profile {
    /// The backend the profile names.
    pub fn backend(&self) -> Option<&str> {
        self.parameters.get(BACKEND_PARAMETER).map(String::as_str)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Pass,
    Fail(String),
    Skip(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: String,
    pub outcome: Outcome,
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    /// No check failed.
    pub fn passed(&self) -> bool {
        !self.checks.iter().any(|c| matches!(c.outcome, Outcome::Fail(_)))
    }

    /// (passed, failed, skipped)
    pub fn counts(&self) -> (usize, usize, usize) {
        self.checks.iter().fold((0, 0, 0), |(p, f, s), c| match c.outcome {
            Outcome::Pass => (p + 1, f, s),
            Outcome::Fail(_) => (p, f + 1, s),
            Outcome::Skip(_) => (p, f, s + 1),
        })
    }

    /// The outcome of the check called `name`.
    pub fn outcome(&self, name: &str) -> Option<&Outcome> {
        self.checks.iter().find(|c| c.name == name).map(|c| &c.outcome)
    }

    /// One line per check, then a summary line.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for c in &self.checks {
            let line = match &c.outcome {
                Outcome::Pass => format!("PASS {}\n", c.name),
                Outcome::Fail(why) => format!("FAIL {}: {why}\n", c.name),
                Outcome::Skip(why) => format!("SKIP {}: {why}\n", c.name),
            };
            out.push_str(&line);
        }
        let (p, f, s) = self.counts();
        out.push_str(&format!("{p} passed, {f} failed, {s} skipped\n"));
        out
    }
}

/// Run the whole suite against the CSI socket at `socket`. `Err` only when the suite cannot
/// start (no `backend` parameter, no socket, `work_dir` unusable); everything else is a check.
pub async fn run(socket: &Path, profile: &Profile) -> anyhow::Result<Report> {
    let backend = profile.backend().context("the profile's parameters name no \"backend\"")?.to_string();
    std::fs::create_dir_all(&profile.work_dir)
        .with_context(|| format!("creating work dir {}", profile.work_dir.display()))?;
    // The mount table spells paths canonically; so must we.
    let work_dir = profile
        .work_dir
        .canonicalize()
        .with_context(|| format!("resolving work dir {}", profile.work_dir.display()))?;
    let run = run_id();
    let work = work_dir.join(format!("conformance-{run}"));
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let channel = crate::host::connect(socket).await?;
    let mut suite = Suite {
        profile,
        backend,
        run,
        work,
        identity: IdentityClient::new(channel.clone()),
        controller: ControllerClient::new(channel.clone()),
        node: NodeClient::new(channel),
        controller_caps: None,
        node_caps: None,
        node_id: None,
        checks: Vec::new(),
        created: Created::default(),
    };
    suite.all_checks().await;
    suite.clean_up().await;
    Ok(Report { checks: suite.checks })
}

fn run_id() -> String {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("{:x}{:x}", std::process::id(), nanos)
}

/// What a call the suite made left behind, so that it can be removed again.
enum Made {
    Nothing,
    Volume(String),
    Snapshot(String),
}

type Pending = Pin<Box<dyn Future<Output = Result<Made, Status>> + Send>>;

/// One RPC as a boxed future; the optional mapping says what its answer created, so that a
/// request the host should have refused but carried out is still cleaned up.
macro_rules! rpc {
    ($client:expr, $method:ident, $request:expr) => {
        rpc!($client, $method, $request, |_| Made::Nothing)
    };
    ($client:expr, $method:ident, $request:expr, $made:expr) => {{
        let mut client = $client;
        let request = $request;
        let pending: Pending = Box::pin(async move { client.$method(request).await.map(|r| ($made)(r.into_inner())) });
        pending
    }};
}

fn made_volume(r: csi::CreateVolumeResponse) -> Made {
    r.volume.map_or(Made::Nothing, |v| Made::Volume(v.volume_id))
}

fn made_snapshot(r: csi::CreateSnapshotResponse) -> Made {
    r.snapshot.map_or(Made::Nothing, |s| Made::Snapshot(s.snapshot_id))
}

/// Await one answer, bounded by [`CALL_TIMEOUT`].
async fn call<T>(fut: impl Future<Output = Result<tonic::Response<T>, Status>>) -> Result<T, Status> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(answer) => answer.map(tonic::Response::into_inner),
        Err(_) => Err(Status::deadline_exceeded(format!("no answer within {CALL_TIMEOUT:?}"))),
    }
}

fn status(s: Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

fn expect_code<T>(answer: &Result<T, Status>, want: Code) -> Outcome {
    match (answer, want) {
        (Ok(_), Code::Ok) => Outcome::Pass,
        (Ok(_), _) => Outcome::Fail(format!("expected {want:?}, got OK")),
        (Err(s), _) if s.code() == want => Outcome::Pass,
        (Err(s), _) => Outcome::Fail(format!("expected {want:?}, got {:?}: {}", s.code(), s.message())),
    }
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Mount points at or under `dir`, deepest first.
fn mounts_under(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let table = mountinfo::read_current().map_err(|e| e.to_string())?;
    let mut found: Vec<PathBuf> = table.into_iter().map(|e| e.mount_point).filter(|m| m.starts_with(dir)).collect();
    found.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    Ok(found)
}

fn is_mounted(path: &Path) -> Result<(), String> {
    let table = mountinfo::read_current().map_err(|e| e.to_string())?;
    if mountinfo::mounts_at(&table, path).is_empty() {
        Err(format!("nothing is mounted at {}", path.display()))
    } else {
        Ok(())
    }
}

fn is_unmounted(path: &Path) -> Result<(), String> {
    match is_mounted(path) {
        Ok(()) => Err(format!("{} is still mounted", path.display())),
        Err(_) => Ok(()),
    }
}

#[derive(Default)]
struct Created {
    volumes: Vec<String>,
    snapshots: Vec<String>,
    /// (volume id, path) of every publish and stage tried; undone in reverse order.
    published: Vec<(String, PathBuf)>,
    staged: Vec<(String, PathBuf)>,
    /// (volume id, node id) of every ControllerPublishVolume tried; undone after the node's.
    attached: Vec<(String, String)>,
}

impl Created {
    fn volume(&mut self, id: &str) {
        if !id.is_empty() && !self.volumes.iter().any(|v| v == id) {
            self.volumes.push(id.to_string());
        }
    }
    fn snapshot(&mut self, id: &str) {
        if !id.is_empty() && !self.snapshots.iter().any(|s| s == id) {
            self.snapshots.push(id.to_string());
        }
    }
    fn made(&mut self, made: &Made) {
        match made {
            Made::Nothing => {}
            Made::Volume(id) => self.volume(id),
            Made::Snapshot(id) => self.snapshot(id),
        }
    }
}

struct Suite<'p> {
    profile: &'p Profile,
    backend: String,
    /// Unique per run: names of created objects and the work directory.
    run: String,
    /// This run's directory under the profile's `work_dir` (canonical).
    work: PathBuf,
    identity: IdentityClient<Channel>,
    controller: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    /// `None`: the capabilities are unknown (the call failed), so nothing is skipped for them.
    controller_caps: Option<HashSet<i32>>,
    /// `None`: the node service is not served.
    node_caps: Option<HashSet<i32>>,
    /// What NodeGetInfo answered: the node ControllerPublishVolume names.
    node_id: Option<String>,
    checks: Vec<Check>,
    created: Created,
}

/// The objects the controller checks made, for the checks after them.
#[derive(Default)]
struct Objects {
    volume: Option<csi::Volume>,
    /// Capacity after ControllerExpandVolume, when that worked.
    expanded: Option<i64>,
    /// A second volume (from the concurrent CreateVolume check).
    other: Option<String>,
    snapshot: Option<csi::Snapshot>,
    clones: Vec<String>,
    /// The node flow wrote [`DATA_FILE`] into the volume.
    data_written: bool,
}

impl Suite<'_> {
    // ---- bookkeeping -------------------------------------------------------------------

    fn record(&mut self, name: &str, outcome: Outcome) {
        self.checks.push(Check { name: name.to_string(), outcome });
    }

    fn judge(&mut self, name: &str, verdict: Result<(), String>) {
        self.record(name, verdict.map_or_else(Outcome::Fail, |()| Outcome::Pass));
    }

    /// Judge an answer of an optional feature: UNIMPLEMENTED is a skip.
    fn judge_optional<T>(
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
    fn open(&mut self, name: &str, blocked: &Option<String>) -> bool {
        match blocked {
            Some(why) => {
                self.record(name, Outcome::Skip(why.clone()));
                false
            }
            None => true,
        }
    }

    /// Run one RPC and expect `want` (`Code::Ok` for success), unless `gate` says skip.
    async fn expect(&mut self, name: &str, gate: Option<String>, want: Code, rpc: Pending) {
        self.expect_answer(name, gate, want, rpc, false).await
    }

    /// [`Self::expect`] for an RPC of an optional feature (snapshots, expansion, GetVolume):
    /// UNIMPLEMENTED is a skip, as in [`Self::judge_optional`]. The controller offers every
    /// feature; the host answers UNIMPLEMENTED for a backend that lacks one.
    async fn expect_optional(&mut self, name: &str, gate: Option<String>, want: Code, rpc: Pending) {
        self.expect_answer(name, gate, want, rpc, true).await
    }

    async fn expect_answer(&mut self, name: &str, gate: Option<String>, want: Code, rpc: Pending, optional: bool) {
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

    fn controller_gate(&self, rpc: ControllerRpc) -> Option<String> {
        match &self.controller_caps {
            Some(caps) if !caps.contains(&(rpc as i32)) => {
                Some(format!("the controller does not offer {}", rpc.as_str_name()))
            }
            _ => None,
        }
    }

    fn node_gate(&self, rpc: Option<NodeRpc>) -> Option<String> {
        match (&self.node_caps, rpc) {
            (None, _) => Some("the node service is not served".into()),
            (Some(caps), Some(rpc)) if !caps.contains(&(rpc as i32)) => {
                Some(format!("the node does not offer {}", rpc.as_str_name()))
            }
            _ => None,
        }
    }

    fn gates(gates: impl IntoIterator<Item = Option<String>>) -> Option<String> {
        gates.into_iter().flatten().next()
    }

    fn name(&self, what: &str) -> String {
        format!("csic-{}-{what}", self.run)
    }

    /// An id of the profile's backend that names nothing.
    fn unknown_id(&self) -> String {
        format!("{}:default.does-not-exist", self.backend)
    }

    fn ctl(&self) -> ControllerClient<Channel> {
        self.controller.clone()
    }

    fn nd(&self) -> NodeClient<Channel> {
        self.node.clone()
    }

    fn create_request(&self, name: &str, required_bytes: i64) -> csi::CreateVolumeRequest {
        csi::CreateVolumeRequest {
            name: name.to_string(),
            capacity_range: Some(csi::CapacityRange { required_bytes, limit_bytes: 0 }),
            volume_capabilities: vec![self.profile.capability.clone()],
            parameters: self.profile.parameters.clone(),
            secrets: self.profile.secrets.clone(),
            ..Default::default()
        }
    }

    /// The profile's secrets on a controller request that has none of its own (what the CO
    /// would pass from the StorageClass's provisioner/controller secret references).
    fn secreted<R: Secreted>(&self, mut request: R) -> R {
        let secrets = request.secrets_mut();
        if secrets.is_empty() {
            secrets.clone_from(&self.profile.secrets);
        }
        request
    }

    fn stage_request(
        &self,
        id: &str,
        context: &HashMap<String, String>,
        staging: &Path,
    ) -> csi::NodeStageVolumeRequest {
        csi::NodeStageVolumeRequest {
            volume_id: id.to_string(),
            staging_target_path: path_str(staging),
            volume_capability: Some(self.profile.capability.clone()),
            volume_context: context.clone(),
            ..Default::default()
        }
    }

    fn publish_request(
        &self,
        id: &str,
        context: &HashMap<String, String>,
        staging: &Path,
        target: &Path,
        readonly: bool,
    ) -> csi::NodePublishVolumeRequest {
        csi::NodePublishVolumeRequest {
            volume_id: id.to_string(),
            staging_target_path: path_str(staging),
            target_path: path_str(target),
            volume_capability: Some(self.profile.capability.clone()),
            readonly,
            volume_context: context.clone(),
            ..Default::default()
        }
    }

    fn data(&self) -> Vec<u8> {
        format!("written through the target path by conformance run {}\n", self.run).into_bytes()
    }

    /// Whether the controller offers PUBLISH_UNPUBLISH_VOLUME (then a CO publishes a volume to
    /// a node before it stages it there).
    fn controller_publishes(&self) -> bool {
        self.controller_caps.as_ref().is_some_and(|c| c.contains(&(ControllerRpc::PublishUnpublishVolume as i32)))
    }

    /// ControllerPublishVolume of `id` to this node, when the controller offers it.
    async fn attach_to_node(&mut self, id: &str, context: &HashMap<String, String>) -> Result<(), String> {
        if !self.controller_publishes() {
            return Ok(());
        }
        let node = self.node_id.clone().ok_or("no node id to ControllerPublishVolume to: NodeGetInfo failed")?;
        self.created.attached.push((id.to_string(), node.clone()));
        let request = csi::ControllerPublishVolumeRequest {
            volume_id: id.to_string(),
            node_id: node,
            volume_capability: Some(self.profile.capability.clone()),
            readonly: false,
            secrets: self.profile.secrets.clone(),
            volume_context: context.clone(),
        };
        call(self.ctl().controller_publish_volume(request))
            .await
            .map(drop)
            .map_err(|s| format!("ControllerPublishVolume: {}", status(s)))
    }

    /// ControllerUnpublishVolume of `id` from this node, when the controller offers it.
    async fn detach_from_node(&mut self, id: &str) -> Result<(), String> {
        if !self.controller_publishes() {
            return Ok(());
        }
        let node = self.node_id.clone().unwrap_or_default();
        let request = csi::ControllerUnpublishVolumeRequest {
            volume_id: id.to_string(),
            node_id: node.clone(),
            secrets: self.profile.secrets.clone(),
        };
        let answer = call(self.ctl().controller_unpublish_volume(request)).await;
        if answer.is_ok() {
            self.created.attached.retain(|(v, n)| !(v == id && *n == node));
        }
        answer.map(drop).map_err(|s| format!("ControllerUnpublishVolume: {}", status(s)))
    }

    // ---- the suite ---------------------------------------------------------------------

    async fn all_checks(&mut self) {
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
        objects.expanded = self.expand_checks(objects.volume.as_ref()).await;
        objects.data_written = self.node_flow(&objects).await;
        objects.snapshot = self.snapshot_checks(&objects).await;
        self.snapshot_name_checks(objects.volume.as_ref()).await;
        self.clone_checks(&mut objects).await;
        self.list_volumes_checks(&objects).await;
        self.delete_checks(&objects).await;
    }

    async fn identity_checks(&mut self) {
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

    async fn capability_checks(&mut self) {
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

    /// The `backend` parameter: missing or unknown is INVALID_ARGUMENT naming the choices.
    async fn backend_parameter_checks(&mut self) {
        let cases = [
            (
                "CreateVolume with an unknown backend is InvalidArgument listing the available ones",
                Some(UNKNOWN_BACKEND),
            ),
            ("CreateVolume without a backend parameter is InvalidArgument listing the available ones", None),
        ];
        for (name, backend) in cases {
            let mut request = self.create_request(&self.name("no-backend"), self.profile.required_bytes);
            match backend {
                Some(b) => request.parameters.insert(BACKEND_PARAMETER.into(), b.into()),
                None => request.parameters.remove(BACKEND_PARAMETER),
            };
            let answer = call(self.ctl().create_volume(request)).await;
            let verdict = match answer {
                Err(s) if s.code() == Code::InvalidArgument && s.message().contains(self.backend.as_str()) => Ok(()),
                Err(s) if s.code() == Code::InvalidArgument => {
                    Err(format!("the message does not list the available backend {:?}: {}", self.backend, s.message()))
                }
                Err(s) => Err(format!("expected InvalidArgument, got {}", status(s))),
                Ok(r) => {
                    self.created.made(&made_volume(r));
                    Err("expected InvalidArgument, got OK".into())
                }
            };
            self.judge(name, verdict);
        }
    }

    /// Unknown ids: NOT_FOUND where the spec says so, OK for deletes.
    async fn unknown_id_checks(&mut self) {
        let staging = self.work.join("unknown-staging");
        let target = self.work.join("unknown-target").join("mount");
        for dir in [&staging, &self.work.join("unknown-target")] {
            if let Err(e) = std::fs::create_dir_all(dir) {
                tracing::warn!(path = %dir.display(), "conformance: cannot create directory: {e}");
            }
        }
        for (label, id) in [("a well-formed unknown id", self.unknown_id()), ("a foreign id", FOREIGN_ID.to_string())] {
            let cap = self.profile.capability.clone();
            let request = self.secreted(csi::ValidateVolumeCapabilitiesRequest {
                volume_id: id.clone(),
                volume_capabilities: vec![cap.clone()],
                ..Default::default()
            });
            self.expect(
                &format!("ValidateVolumeCapabilities of {label} is NotFound"),
                None,
                Code::NotFound,
                rpc!(self.ctl(), validate_volume_capabilities, request),
            )
            .await;

            let gate = self.controller_gate(ControllerRpc::GetVolume);
            let request = csi::ControllerGetVolumeRequest { volume_id: id.clone() };
            self.expect_optional(
                &format!("ControllerGetVolume of {label} is NotFound"),
                gate,
                Code::NotFound,
                rpc!(self.ctl(), controller_get_volume, request),
            )
            .await;

            let gate = self.controller_gate(ControllerRpc::ExpandVolume);
            let request = self.secreted(csi::ControllerExpandVolumeRequest {
                volume_id: id.clone(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: self.profile.required_bytes.saturating_mul(2),
                    limit_bytes: 0,
                }),
                ..Default::default()
            });
            self.expect_optional(
                &format!("ControllerExpandVolume of {label} is NotFound"),
                gate,
                Code::NotFound,
                rpc!(self.ctl(), controller_expand_volume, request),
            )
            .await;

            let gate = self.controller_gate(ControllerRpc::CreateDeleteSnapshot);
            let request = self.secreted(csi::CreateSnapshotRequest {
                source_volume_id: id.clone(),
                name: self.name("snap-of-unknown"),
                ..Default::default()
            });
            self.expect_optional(
                &format!("CreateSnapshot from {label} is NotFound"),
                gate.clone(),
                Code::NotFound,
                rpc!(self.ctl(), create_snapshot, request, made_snapshot),
            )
            .await;

            let request = self.secreted(csi::DeleteSnapshotRequest { snapshot_id: id.clone(), ..Default::default() });
            self.expect_optional(
                &format!("DeleteSnapshot of {label} is OK"),
                gate,
                Code::Ok,
                rpc!(self.ctl(), delete_snapshot, request),
            )
            .await;

            let request = self.secreted(csi::DeleteVolumeRequest { volume_id: id.clone(), ..Default::default() });
            self.expect(
                &format!("DeleteVolume of {label} is OK"),
                None,
                Code::Ok,
                rpc!(self.ctl(), delete_volume, request),
            )
            .await;

            let request = self.stage_request(&id, &HashMap::new(), &staging);
            self.created.staged.push((id.clone(), staging.clone()));
            self.expect(
                &format!("NodeStageVolume of {label} is NotFound"),
                self.node_gate(None),
                Code::NotFound,
                rpc!(self.nd(), node_stage_volume, request),
            )
            .await;

            let request = self.publish_request(&id, &HashMap::new(), &staging, &target, false);
            self.created.published.push((id.clone(), target.clone()));
            self.expect(
                &format!("NodePublishVolume of {label} is NotFound"),
                self.node_gate(None),
                Code::NotFound,
                rpc!(self.nd(), node_publish_volume, request),
            )
            .await;

            let request = csi::NodeGetVolumeStatsRequest {
                volume_id: id.clone(),
                volume_path: path_str(&self.work),
                ..Default::default()
            };
            self.expect(
                &format!("NodeGetVolumeStats of {label} is NotFound"),
                self.node_gate(Some(NodeRpc::GetVolumeStats)),
                Code::NotFound,
                rpc!(self.nd(), node_get_volume_stats, request),
            )
            .await;
        }
    }

    /// The volume most later checks use, and CreateVolume's idempotency.
    async fn create_volume_checks(&mut self) -> Option<csi::Volume> {
        const CREATE: &str = "CreateVolume creates a volume";
        const REPEAT: &str = "CreateVolume repeated with the same name and parameters returns the same volume";
        const CONFLICT: &str = "CreateVolume with the same name and a larger size is AlreadyExists";
        const VALIDATE: &str = "ValidateVolumeCapabilities confirms the profile's capability";
        let name = self.name("vol");
        let required = self.profile.required_bytes;
        let request = self.create_request(&name, required);
        let answer = call(self.ctl().create_volume(request.clone())).await;
        let volume = match answer {
            Ok(r) => {
                self.created.made(&made_volume(r.clone()));
                // `BACKEND@NODE:` for a node-local backend's volume in a multi-node cluster.
                let prefix = format!("{}:", self.backend);
                let pinned = format!("{}@", self.backend);
                let verdict = match &r.volume {
                    None => Err("the answer carries no volume".to_string()),
                    Some(v) if !v.volume_id.starts_with(&prefix) && !v.volume_id.starts_with(&pinned) => {
                        Err(format!("volume id {:?} does not start with {prefix:?}", v.volume_id))
                    }
                    Some(v) if v.capacity_bytes < required => {
                        Err(format!("capacity {} < required {required}", v.capacity_bytes))
                    }
                    Some(_) => Ok(()),
                };
                let ok = verdict.is_ok();
                self.judge(CREATE, verdict);
                r.volume.filter(|_| ok)
            }
            Err(s) => {
                self.record(CREATE, Outcome::Fail(status(s)));
                None
            }
        };
        let blocked = volume.is_none().then(|| NO_VOLUME.to_string());

        if self.open(REPEAT, &blocked)
            && let Some(v) = &volume
        {
            let answer = call(self.ctl().create_volume(request.clone())).await;
            let verdict = match answer {
                Ok(r) => {
                    self.created.made(&made_volume(r.clone()));
                    match r.volume {
                        Some(again) if again.volume_id == v.volume_id && again.capacity_bytes == v.capacity_bytes => {
                            Ok(())
                        }
                        Some(again) => Err(format!(
                            "first {} ({} bytes), then {} ({} bytes)",
                            v.volume_id, v.capacity_bytes, again.volume_id, again.capacity_bytes
                        )),
                        None => Err("the answer carries no volume".into()),
                    }
                }
                Err(s) => Err(status(s)),
            };
            self.judge(REPEAT, verdict);
        }

        if self.open(CONFLICT, &blocked)
            && let Some(v) = &volume
        {
            let larger = v.capacity_bytes.saturating_add(required.max(1 << 20));
            let request = self.create_request(&name, larger);
            self.expect(CONFLICT, None, Code::AlreadyExists, rpc!(self.ctl(), create_volume, request, made_volume))
                .await;
        }

        if self.open(VALIDATE, &blocked)
            && let Some(v) = &volume
        {
            let request = self.secreted(csi::ValidateVolumeCapabilitiesRequest {
                volume_id: v.volume_id.clone(),
                volume_context: v.volume_context.clone(),
                volume_capabilities: vec![self.profile.capability.clone()],
                parameters: self.profile.parameters.clone(),
                ..Default::default()
            });
            let answer = call(self.ctl().validate_volume_capabilities(request)).await;
            let cap = self.profile.capability.clone();
            self.judge(
                VALIDATE,
                answer.map_err(status).and_then(|r| match r.confirmed {
                    Some(c) if c.volume_capabilities == vec![cap] => Ok(()),
                    Some(c) => Err(format!("confirmed other capabilities: {:?}", c.volume_capabilities)),
                    None => Err(format!("not confirmed: {}", r.message)),
                }),
            );
        }
        volume
    }

    /// Missing required fields are INVALID_ARGUMENT, on every RPC that has them.
    async fn validation_checks(&mut self, volume: Option<&csi::Volume>) {
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

    /// Retries racing each other: every answer is the one volume, or ABORTED.
    async fn concurrent_create_check(&mut self) -> Option<String> {
        const NAME: &str = "CreateVolume sent 8 times in parallel yields one volume (OK with the same id, or Aborted)";
        let request = self.create_request(&self.name("race"), self.profile.required_bytes);
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..PARALLEL {
            let mut client = self.ctl();
            let request = request.clone();
            calls.spawn(async move { call(client.create_volume(request)).await });
        }
        let mut ids = Vec::new();
        let mut problems = Vec::new();
        let mut aborted = 0;
        while let Some(joined) = calls.join_next().await {
            match joined {
                Ok(Ok(r)) => match r.volume {
                    Some(v) => ids.push(v.volume_id),
                    None => problems.push("an OK answer without a volume".to_string()),
                },
                Ok(Err(s)) if s.code() == Code::Aborted => aborted += 1,
                Ok(Err(s)) => problems.push(status(s)),
                Err(e) => problems.push(format!("call task failed: {e}")),
            }
        }
        for id in &ids {
            self.created.volume(id);
        }
        let distinct: HashSet<&String> = ids.iter().collect();
        if ids.is_empty() {
            problems.push(format!("no call succeeded ({aborted} Aborted)"));
        }
        if distinct.len() > 1 {
            problems.push(format!("several volumes for one name: {distinct:?}"));
        }
        let verdict = if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) };
        self.judge(NAME, verdict);
        (distinct.len() == 1).then(|| ids.swap_remove(0))
    }

    async fn get_capacity_check(&mut self) {
        const NAME: &str = "GetCapacity answers for the profile's parameters";
        if !self.open(NAME, &self.controller_gate(ControllerRpc::GetCapacity)) {
            return;
        }
        let request = csi::GetCapacityRequest {
            volume_capabilities: vec![self.profile.capability.clone()],
            parameters: self.profile.parameters.clone(),
            ..Default::default()
        };
        let answer = call(self.ctl().get_capacity(request)).await;
        self.judge_optional(NAME, answer, |r| {
            let sizes = [Some(r.available_capacity), r.maximum_volume_size, r.minimum_volume_size];
            if sizes.into_iter().flatten().any(|s| s < 0) { Err(format!("negative size in {r:?}")) } else { Ok(()) }
        });
    }

    async fn get_volume_check(&mut self, volume: Option<&csi::Volume>) {
        const NAME: &str = "ControllerGetVolume returns the volume";
        let blocked = Self::gates([
            self.controller_gate(ControllerRpc::GetVolume),
            volume.is_none().then(|| NO_VOLUME.to_string()),
        ]);
        if !self.open(NAME, &blocked) {
            return;
        }
        let Some(v) = volume else { return };
        let answer =
            call(self.ctl().controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: v.volume_id.clone() }))
                .await;
        let (id, required) = (v.volume_id.clone(), self.profile.required_bytes);
        self.judge_optional(NAME, answer, |r| match r.volume {
            Some(got) if got.volume_id == id && got.capacity_bytes >= required => Ok(()),
            Some(got) => Err(format!("got {} with {} bytes", got.volume_id, got.capacity_bytes)),
            None => Err("the answer carries no volume".into()),
        });
    }

    /// Returns the capacity after expansion.
    async fn expand_checks(&mut self, volume: Option<&csi::Volume>) -> Option<i64> {
        const EXPAND: &str = "ControllerExpandVolume grows the volume to at least the requested size";
        const AFTER: &str = "ControllerGetVolume reports the expanded capacity";
        let blocked = Self::gates([
            self.controller_gate(ControllerRpc::ExpandVolume),
            volume.is_none().then(|| NO_VOLUME.to_string()),
        ]);
        let mut expanded = None;
        if self.open(EXPAND, &blocked)
            && let Some(v) = volume
        {
            let want = v.capacity_bytes.saturating_add(self.profile.required_bytes.max(1 << 20));
            let request = self.secreted(csi::ControllerExpandVolumeRequest {
                volume_id: v.volume_id.clone(),
                capacity_range: Some(csi::CapacityRange { required_bytes: want, limit_bytes: 0 }),
                volume_capability: Some(self.profile.capability.clone()),
                ..Default::default()
            });
            let answer = call(self.ctl().controller_expand_volume(request)).await;
            let mut got = None;
            let ok = self.judge_optional(EXPAND, answer, |r| {
                got = Some(r.capacity_bytes);
                if r.capacity_bytes >= want {
                    Ok(())
                } else {
                    Err(format!("capacity {} < requested {want}", r.capacity_bytes))
                }
            });
            expanded = got.filter(|_| ok);
        }

        let blocked = Self::gates([
            self.controller_gate(ControllerRpc::GetVolume),
            expanded.is_none().then(|| "ControllerExpandVolume did not succeed".to_string()),
        ]);
        if self.open(AFTER, &blocked)
            && let (Some(v), Some(want)) = (volume, expanded)
        {
            let answer = call(
                self.ctl().controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: v.volume_id.clone() }),
            )
            .await;
            self.judge_optional(AFTER, answer, |r| match r.volume {
                Some(got) if got.capacity_bytes >= want => Ok(()),
                Some(got) => Err(format!("capacity {} < expanded {want}", got.capacity_bytes)),
                None => Err("the answer carries no volume".into()),
            });
        }
        expanded
    }

    /// Stage, publish, use, unpublish and unstage the volume on this node. Returns whether
    /// [`DATA_FILE`] was written into the volume.
    async fn node_flow(&mut self, objects: &Objects) -> bool {
        const STAGE: &str = "NodeStageVolume stages the volume";
        const STAGE_AGAIN: &str = "NodeStageVolume repeated is OK";
        const PUBLISH: &str = "NodePublishVolume publishes the volume";
        const PUBLISH_AGAIN: &str = "NodePublishVolume repeated is OK";
        const WRITE: &str = "a file written through the target path reads back";
        const RO_CONFLICT: &str = "NodePublishVolume read-only on the same target is AlreadyExists";
        const RO_PUBLISH: &str = "a read-only publish shows the data and refuses writes";
        const STATS: &str = "NodeGetVolumeStats reports usage";
        const STATS_MISSING: &str = "NodeGetVolumeStats of a missing path is NotFound";
        const EXPAND: &str = "NodeExpandVolume answers";
        const UNPUBLISH: &str = "NodeUnpublishVolume unmounts and removes the target";
        const UNPUBLISH_AGAIN: &str = "NodeUnpublishVolume repeated is OK";
        const UNSTAGE: &str = "NodeUnstageVolume unmounts the staging path";
        const UNSTAGE_AGAIN: &str = "NodeUnstageVolume repeated is OK";
        const DETACH: &str = "ControllerUnpublishVolume releases the volume from the node";
        const NOTHING_LEFT: &str = "the node flow leaves nothing mounted under the work dir";

        let volume = objects.volume.as_ref();
        let id = volume.map(|v| v.volume_id.clone()).unwrap_or_default();
        let context = volume.map(|v| v.volume_context.clone()).unwrap_or_default();
        let capacity = objects.expanded.or(volume.map(|v| v.capacity_bytes)).unwrap_or(self.profile.required_bytes);
        let staging = self.work.join("staging");
        let target = self.work.join("target").join("mount");
        let target_ro = self.work.join("target-ro").join("mount");

        let mut blocked = if !self.profile.node {
            Some("profile.node is off (the node flow makes real mounts: needs root)".to_string())
        } else {
            Self::gates([self.node_gate(None), volume.is_none().then(|| NO_VOLUME.to_string())])
        };
        if blocked.is_none() {
            for dir in [&staging, &self.work.join("target"), &self.work.join("target-ro")] {
                if let Err(e) = std::fs::create_dir_all(dir) {
                    blocked = Some(format!("creating {}: {e}", dir.display()));
                }
            }
        }
        let flow_blocked = blocked.clone();

        // Stage (published to this node first, when the controller publishes).
        if self.open(STAGE, &blocked) {
            let attached = self.attach_to_node(&id, &context).await;
            self.created.staged.push((id.clone(), staging.clone()));
            let verdict = match attached {
                Err(e) => Err(e),
                Ok(()) => {
                    let answer = call(self.nd().node_stage_volume(self.stage_request(&id, &context, &staging))).await;
                    answer.map_err(status).and_then(|_| is_mounted(&staging))
                }
            };
            if verdict.is_err() {
                blocked = Some("NodeStageVolume failed".into());
            }
            self.judge(STAGE, verdict);
        }
        if self.open(STAGE_AGAIN, &blocked) {
            let answer = call(self.nd().node_stage_volume(self.stage_request(&id, &context, &staging))).await;
            self.record(STAGE_AGAIN, expect_code(&answer, Code::Ok));
        }
        let staged_blocked = blocked.clone();

        // Publish.
        if self.open(PUBLISH, &blocked) {
            self.created.published.push((id.clone(), target.clone()));
            let answer =
                call(self.nd().node_publish_volume(self.publish_request(&id, &context, &staging, &target, false)))
                    .await;
            let verdict = answer.map_err(status).and_then(|_| is_mounted(&target));
            if verdict.is_err() {
                blocked = Some("NodePublishVolume failed".into());
            }
            self.judge(PUBLISH, verdict);
        }
        if self.open(PUBLISH_AGAIN, &blocked) {
            let answer =
                call(self.nd().node_publish_volume(self.publish_request(&id, &context, &staging, &target, false)))
                    .await;
            self.record(PUBLISH_AGAIN, expect_code(&answer, Code::Ok));
        }

        let data = self.data();
        let mut written = false;
        if self.open(WRITE, &blocked) {
            let file = target.join(DATA_FILE);
            let verdict = match tokio::fs::write(&file, &data).await {
                Err(e) => Err(format!("writing {}: {e}", file.display())),
                Ok(()) => {
                    written = true;
                    match tokio::fs::read(&file).await {
                        Ok(back) if back == data => Ok(()),
                        Ok(back) => {
                            Err(format!("read back {} bytes that differ from the {} written", back.len(), data.len()))
                        }
                        Err(e) => Err(format!("reading {}: {e}", file.display())),
                    }
                }
            };
            self.judge(WRITE, verdict);
        }

        if self.open(RO_CONFLICT, &blocked) {
            let answer =
                call(self.nd().node_publish_volume(self.publish_request(&id, &context, &staging, &target, true))).await;
            self.record(RO_CONFLICT, expect_code(&answer, Code::AlreadyExists));
        }

        if self.open(RO_PUBLISH, &staged_blocked) {
            self.created.published.push((id.clone(), target_ro.clone()));
            let verdict = self.read_only_publish(&id, &context, &staging, &target_ro, written.then_some(&data)).await;
            self.judge(RO_PUBLISH, verdict);
        }

        let stats_blocked = Self::gates([blocked.clone(), self.node_gate(Some(NodeRpc::GetVolumeStats))]);
        if self.open(STATS, &stats_blocked) {
            let request = csi::NodeGetVolumeStatsRequest {
                volume_id: id.clone(),
                volume_path: path_str(&target),
                staging_target_path: path_str(&staging),
            };
            let answer = call(self.nd().node_get_volume_stats(request)).await;
            self.judge(
                STATS,
                answer.map_err(status).and_then(|r| {
                    if r.usage.is_empty() {
                        Err("no usage reported".into())
                    } else if r.usage.iter().any(|u| u.used < 0 || u.total < 0 || u.available < 0) {
                        Err(format!("negative usage: {:?}", r.usage))
                    } else {
                        Ok(())
                    }
                }),
            );
        }
        if self.open(STATS_MISSING, &stats_blocked) {
            let request = csi::NodeGetVolumeStatsRequest {
                volume_id: id.clone(),
                volume_path: path_str(&self.work.join("no-such-path")),
                ..Default::default()
            };
            let answer = call(self.nd().node_get_volume_stats(request)).await;
            self.record(STATS_MISSING, expect_code(&answer, Code::NotFound));
        }

        let expand_blocked = Self::gates([blocked.clone(), self.node_gate(Some(NodeRpc::ExpandVolume))]);
        if self.open(EXPAND, &expand_blocked) {
            let request = csi::NodeExpandVolumeRequest {
                volume_id: id.clone(),
                volume_path: path_str(&target),
                staging_target_path: path_str(&staging),
                capacity_range: Some(csi::CapacityRange { required_bytes: capacity, limit_bytes: 0 }),
                volume_capability: Some(self.profile.capability.clone()),
                ..Default::default()
            };
            let answer = call(self.nd().node_expand_volume(request)).await;
            self.judge_optional(EXPAND, answer, |r| {
                if r.capacity_bytes == 0 || r.capacity_bytes >= capacity {
                    Ok(())
                } else {
                    Err(format!("capacity {} < requested {capacity}", r.capacity_bytes))
                }
            });
        }

        // Unpublish and unstage (skipped only when there was nothing to undo).
        if self.open(UNPUBLISH, &blocked) {
            let answer = call(self.nd().node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: id.clone(),
                target_path: path_str(&target),
            }))
            .await;
            let verdict = answer.map_err(status).and_then(|_| is_unmounted(&target)).and_then(|()| {
                if target.exists() { Err(format!("{} still exists", target.display())) } else { Ok(()) }
            });
            self.judge(UNPUBLISH, verdict);
        }
        if self.open(UNPUBLISH_AGAIN, &blocked) {
            let answer = call(self.nd().node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: id.clone(),
                target_path: path_str(&target),
            }))
            .await;
            self.record(UNPUBLISH_AGAIN, expect_code(&answer, Code::Ok));
        }
        self.single_writer_checks(&id, &context, &staging, &staged_blocked).await;

        if self.open(UNSTAGE, &staged_blocked) {
            let answer = call(self.nd().node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: path_str(&staging),
            }))
            .await;
            self.judge(UNSTAGE, answer.map_err(status).and_then(|_| is_unmounted(&staging)));
        }
        if self.open(UNSTAGE_AGAIN, &staged_blocked) {
            let answer = call(self.nd().node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: path_str(&staging),
            }))
            .await;
            self.record(UNSTAGE_AGAIN, expect_code(&answer, Code::Ok));
        }
        let detach_blocked = Self::gates([
            staged_blocked.clone(),
            (!self.controller_publishes())
                .then(|| "the controller does not offer PUBLISH_UNPUBLISH_VOLUME".to_string()),
        ]);
        if self.open(DETACH, &detach_blocked) {
            let verdict = self.detach_from_node(&id).await;
            self.judge(DETACH, verdict);
        }
        if self.open(NOTHING_LEFT, &flow_blocked) {
            let verdict = mounts_under(&self.work)
                .and_then(|left| if left.is_empty() { Ok(()) } else { Err(format!("still mounted: {left:?}")) });
            self.judge(NOTHING_LEFT, verdict);
        }
        written
    }

    /// Publish read-only at `target`, read `data` (when given) and fail to write, unpublish.
    async fn read_only_publish(
        &mut self,
        id: &str,
        context: &HashMap<String, String>,
        staging: &Path,
        target: &Path,
        data: Option<&Vec<u8>>,
    ) -> Result<(), String> {
        let answer =
            call(self.nd().node_publish_volume(self.publish_request(id, context, staging, target, true))).await;
        answer.map_err(|s| format!("NodePublishVolume readonly: {}", status(s)))?;
        let mut verdict = Ok(());
        if let Some(data) = data {
            match tokio::fs::read(target.join(DATA_FILE)).await {
                Ok(back) if &back == data => {}
                Ok(_) => verdict = Err("the read-only mount shows other data".to_string()),
                Err(e) => verdict = Err(format!("reading through the read-only mount: {e}")),
            }
        }
        if verdict.is_ok() {
            let probe = target.join("write-probe");
            verdict = match tokio::fs::write(&probe, b"x").await {
                Ok(()) => Err(format!("wrote {} through a read-only publish", probe.display())),
                Err(e) if e.raw_os_error() == Some(nix::errno::Errno::EROFS as i32) => Ok(()),
                Err(e) => Err(format!("writing through the read-only mount failed, but not with EROFS: {e}")),
            };
        }
        let answer = call(self.nd().node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: id.to_string(),
            target_path: path_str(target),
        }))
        .await;
        verdict
            .and(answer.map(|_| ()).map_err(|s| format!("NodeUnpublishVolume of the read-only target: {}", status(s))))
    }

    async fn snapshot_checks(&mut self, objects: &Objects) -> Option<csi::Snapshot> {
        const CREATE: &str = "CreateSnapshot snapshots the volume";
        const REPEAT: &str = "CreateSnapshot repeated returns the same snapshot";
        const CONFLICT: &str = "CreateSnapshot with the same name from another volume is AlreadyExists";
        const BY_ID: &str = "ListSnapshots by snapshot_id finds exactly the snapshot";
        const BY_SOURCE: &str = "ListSnapshots by source_volume_id finds the snapshot";
        const GET: &str = "GetSnapshot returns the snapshot";
        let volume = objects.volume.as_ref();
        let blocked = Self::gates([
            self.controller_gate(ControllerRpc::CreateDeleteSnapshot),
            volume.is_none().then(|| NO_VOLUME.to_string()),
        ]);
        let name = self.name("snap");
        let request = self.secreted(csi::CreateSnapshotRequest {
            source_volume_id: volume.map(|v| v.volume_id.clone()).unwrap_or_default(),
            name: name.clone(),
            ..Default::default()
        });
        let mut snapshot = None;
        if self.open(CREATE, &blocked) {
            let answer = call(self.ctl().create_snapshot(request.clone())).await;
            if let Ok(r) = &answer {
                self.created.made(&made_snapshot(r.clone()));
            }
            let source = request.source_volume_id.clone();
            let mut made = None;
            self.judge_optional(CREATE, answer, |r| match r.snapshot {
                Some(s) if !s.snapshot_id.is_empty() && s.source_volume_id == source => {
                    made = Some(s);
                    Ok(())
                }
                Some(s) => Err(format!(
                    "snapshot {:?} of {:?}, expected a snapshot of {source}",
                    s.snapshot_id, s.source_volume_id
                )),
                None => Err("the answer carries no snapshot".into()),
            });
            snapshot = made;
        }
        let blocked =
            Self::gates([blocked, snapshot.is_none().then(|| "no snapshot: CreateSnapshot failed".to_string())]);

        if self.open(REPEAT, &blocked)
            && let Some(s) = &snapshot
        {
            let answer = call(self.ctl().create_snapshot(request.clone())).await;
            if let Ok(r) = &answer {
                self.created.made(&made_snapshot(r.clone()));
            }
            let first = s.snapshot_id.clone();
            self.judge(
                REPEAT,
                answer.map_err(status).and_then(|r| match r.snapshot {
                    Some(again) if again.snapshot_id == first => Ok(()),
                    Some(again) => Err(format!("first {first}, then {}", again.snapshot_id)),
                    None => Err("the answer carries no snapshot".into()),
                }),
            );
        }

        let conflict_blocked = Self::gates([
            blocked.clone(),
            objects.other.is_none().then(|| "no second volume: the concurrent CreateVolume failed".to_string()),
        ]);
        if self.open(CONFLICT, &conflict_blocked)
            && let Some(other) = &objects.other
        {
            let request =
                self.secreted(csi::CreateSnapshotRequest { source_volume_id: other.clone(), ..request.clone() });
            self.expect(CONFLICT, None, Code::AlreadyExists, rpc!(self.ctl(), create_snapshot, request, made_snapshot))
                .await;
        }

        let blocked_get = blocked.clone();
        let list_blocked = Self::gates([self.controller_gate(ControllerRpc::ListSnapshots), blocked]);
        if self.open(BY_ID, &list_blocked)
            && let Some(s) = &snapshot
        {
            let answer = self
                .list_snapshots(csi::ListSnapshotsRequest { snapshot_id: s.snapshot_id.clone(), ..Default::default() })
                .await;
            let want = s.snapshot_id.clone();
            self.judge_optional(BY_ID, answer, |found| {
                if found.len() == 1 && found[0].snapshot_id == want {
                    Ok(())
                } else {
                    Err(format!("found {:?}", found.iter().map(|s| &s.snapshot_id).collect::<Vec<_>>()))
                }
            });
        }
        if self.open(BY_SOURCE, &list_blocked)
            && let Some(s) = &snapshot
        {
            let answer = self
                .list_snapshots(csi::ListSnapshotsRequest {
                    source_volume_id: s.source_volume_id.clone(),
                    ..Default::default()
                })
                .await;
            let (want, source) = (s.snapshot_id.clone(), s.source_volume_id.clone());
            self.judge_optional(BY_SOURCE, answer, |found| {
                if !found.iter().any(|s| s.snapshot_id == want) {
                    Err(format!(
                        "{want} is missing from {:?}",
                        found.iter().map(|s| &s.snapshot_id).collect::<Vec<_>>()
                    ))
                } else if let Some(other) = found.iter().find(|s| s.source_volume_id != source) {
                    Err(format!("{} of {} is listed too", other.snapshot_id, other.source_volume_id))
                } else {
                    Ok(())
                }
            });
        }
        let get_gate = self.controller_gate(ControllerRpc::GetSnapshot);
        if self.open(GET, &Self::gates([get_gate.clone(), blocked_get]))
            && let Some(s) = &snapshot
        {
            let request =
                self.secreted(csi::GetSnapshotRequest { snapshot_id: s.snapshot_id.clone(), ..Default::default() });
            let answer = call(self.ctl().get_snapshot(request)).await;
            let want = s.clone();
            self.judge(
                GET,
                answer.map_err(status).and_then(|r| match r.snapshot {
                    Some(got)
                        if got.snapshot_id == want.snapshot_id && got.source_volume_id == want.source_volume_id =>
                    {
                        Ok(())
                    }
                    Some(got) => Err(format!(
                        "asked for {} of {}, got {} of {}",
                        want.snapshot_id, want.source_volume_id, got.snapshot_id, got.source_volume_id
                    )),
                    None => Err("the answer carries no snapshot".into()),
                }),
            );
        }
        for (label, id) in [
            ("a well-formed unknown snapshot id", self.unknown_id()),
            ("a foreign snapshot id", FOREIGN_ID.to_string()),
        ] {
            let request = self.secreted(csi::GetSnapshotRequest { snapshot_id: id.clone(), ..Default::default() });
            self.expect_optional(
                &format!("GetSnapshot of {label} is NotFound"),
                get_gate.clone(),
                Code::NotFound,
                rpc!(self.ctl(), get_snapshot, request),
            )
            .await;
            let name = format!("ListSnapshots by {label} is empty");
            if self.open(&name, &self.controller_gate(ControllerRpc::ListSnapshots)) {
                let answer =
                    self.list_snapshots(csi::ListSnapshotsRequest { snapshot_id: id, ..Default::default() }).await;
                self.judge_optional(&name, answer, |found| {
                    if found.is_empty() { Ok(()) } else { Err(format!("found {found:?}")) }
                });
            }
        }
        snapshot
    }

    /// Every snapshot a filter matches, following pages.
    async fn list_snapshots(&mut self, request: csi::ListSnapshotsRequest) -> Result<Vec<csi::Snapshot>, Status> {
        let mut found = Vec::new();
        let mut token = String::new();
        for _ in 0..MAX_PAGES {
            let r =
                call(self.ctl().list_snapshots(csi::ListSnapshotsRequest { starting_token: token, ..request.clone() }))
                    .await?;
            found.extend(r.entries.into_iter().filter_map(|e| e.snapshot));
            if r.next_token.is_empty() {
                return Ok(found);
            }
            token = r.next_token;
        }
        Err(Status::internal(format!("ListSnapshots handed out more than {MAX_PAGES} pages")))
    }

    /// Every volume id ListVolumes returns with `max_entries` per page, in order (duplicates kept).
    async fn list_volume_ids(&mut self, max_entries: i32) -> Result<Vec<String>, String> {
        let mut ids = Vec::new();
        let mut token = String::new();
        for _ in 0..MAX_PAGES {
            let r = call(self.ctl().list_volumes(csi::ListVolumesRequest { max_entries, starting_token: token }))
                .await
                .map_err(status)?;
            if max_entries > 0 && r.entries.len() > max_entries as usize {
                return Err(format!("a page of {} entries with max_entries = {max_entries}", r.entries.len()));
            }
            ids.extend(r.entries.into_iter().filter_map(|e| e.volume).map(|v| v.volume_id));
            if r.next_token.is_empty() {
                return Ok(ids);
            }
            token = r.next_token;
        }
        Err(format!("ListVolumes handed out more than {MAX_PAGES} pages"))
    }

    async fn clone_checks(&mut self, objects: &mut Objects) {
        const FROM_SNAPSHOT: &str = "CreateVolume from the snapshot clones it";
        const FROM_VOLUME: &str = "CreateVolume from the volume clones it";
        const SNAPSHOT_DATA: &str = "a clone of the snapshot holds the data written before the snapshot";
        const VOLUME_DATA: &str = "a clone of the volume holds the volume's data";
        use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};

        let snapshot_source = objects.snapshot.as_ref().map(|s| (s.snapshot_id.clone(), s.size_bytes));
        let volume_source =
            objects.volume.as_ref().map(|v| (v.volume_id.clone(), objects.expanded.unwrap_or(v.capacity_bytes)));
        let cases = [
            (
                FROM_SNAPSHOT,
                SNAPSHOT_DATA,
                "snapshot-clone",
                Self::gates([
                    self.controller_gate(ControllerRpc::CreateDeleteSnapshot),
                    snapshot_source.is_none().then(|| "no snapshot".to_string()),
                ]),
                snapshot_source.map(|(id, size)| (Type::Snapshot(SnapshotSource { snapshot_id: id }), size)),
            ),
            (
                FROM_VOLUME,
                VOLUME_DATA,
                "volume-clone",
                Self::gates([
                    self.controller_gate(ControllerRpc::CloneVolume),
                    volume_source.is_none().then(|| NO_VOLUME.to_string()),
                ]),
                volume_source.map(|(id, size)| (Type::Volume(VolumeSource { volume_id: id }), size)),
            ),
        ];
        for (name, data_name, what, blocked, source) in cases {
            let mut clone = None;
            if self.open(name, &blocked)
                && let Some((source, size)) = source
            {
                let content = csi::VolumeContentSource { r#type: Some(source) };
                let request = csi::CreateVolumeRequest {
                    volume_content_source: Some(content.clone()),
                    ..self.create_request(&self.name(what), self.profile.required_bytes.max(size))
                };
                let answer = self.create_pending(request).await;
                if let Ok(r) = &answer {
                    self.created.made(&made_volume(r.clone()));
                }
                let mut made = None;
                self.judge_optional(name, answer, |r| match r.volume {
                    Some(v) if v.content_source.as_ref() == Some(&content) => {
                        made = Some(v);
                        Ok(())
                    }
                    Some(v) => Err(format!(
                        "volume {} answers content_source {:?}, expected {content:?}",
                        v.volume_id, v.content_source
                    )),
                    None => Err("the answer carries no volume".into()),
                });
                clone = made;
            }
            if let Some(c) = &clone {
                objects.clones.push(c.volume_id.clone());
            }
            let data_blocked = if !self.profile.node {
                Some("profile.node is off (reading a clone needs real mounts)".to_string())
            } else {
                Self::gates([
                    self.node_gate(None),
                    clone.is_none().then(|| "no clone".to_string()),
                    (!objects.data_written).then(|| "the node flow wrote no data".to_string()),
                ])
            };
            if self.open(data_name, &data_blocked)
                && let Some(c) = &clone
            {
                let verdict = self.read_through_mount(&c.volume_id, &c.volume_context, what).await.and_then(|read| {
                    if read == self.data() {
                        Ok(())
                    } else {
                        Err(format!("{DATA_FILE} holds {} other bytes", read.len()))
                    }
                });
                self.judge(data_name, verdict);
            }
        }
    }

    /// CreateVolume, called again while it answers ABORTED ("an operation is pending for this
    /// volume": a clone a backend fills in the background), as the external-provisioner does;
    /// for at most [`CALL_TIMEOUT`].
    async fn create_pending(&mut self, request: csi::CreateVolumeRequest) -> Result<csi::CreateVolumeResponse, Status> {
        let started = std::time::Instant::now();
        loop {
            match call(self.ctl().create_volume(request.clone())).await {
                Err(s) if s.code() == Code::Aborted && started.elapsed() < CALL_TIMEOUT => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                answer => return answer,
            }
        }
    }

    /// Stage and publish a volume in fresh directories, read [`DATA_FILE`], undo both.
    async fn read_through_mount(
        &mut self,
        id: &str,
        context: &HashMap<String, String>,
        tag: &str,
    ) -> Result<Vec<u8>, String> {
        let staging = self.work.join(format!("{tag}-staging"));
        let target = self.work.join(format!("{tag}-target")).join("mount");
        for dir in [&staging, &self.work.join(format!("{tag}-target"))] {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
        self.attach_to_node(id, context).await?;
        self.created.staged.push((id.to_string(), staging.clone()));
        self.created.published.push((id.to_string(), target.clone()));
        let staged = call(self.nd().node_stage_volume(self.stage_request(id, context, &staging))).await;
        let read = match staged {
            Err(s) => Err(format!("NodeStageVolume: {}", status(s))),
            Ok(_) => {
                match call(self.nd().node_publish_volume(self.publish_request(id, context, &staging, &target, true)))
                    .await
                {
                    Err(s) => Err(format!("NodePublishVolume: {}", status(s))),
                    Ok(_) => {
                        tokio::fs::read(target.join(DATA_FILE)).await.map_err(|e| format!("reading {DATA_FILE}: {e}"))
                    }
                }
            }
        };
        let unpublished = call(self.nd().node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: id.to_string(),
            target_path: path_str(&target),
        }))
        .await;
        let unstaged = call(self.nd().node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: id.to_string(),
            staging_target_path: path_str(&staging),
        }))
        .await;
        let detached = self.detach_from_node(id).await;
        let read = read?;
        unpublished.map_err(|s| format!("NodeUnpublishVolume: {}", status(s)))?;
        unstaged.map_err(|s| format!("NodeUnstageVolume: {}", status(s)))?;
        detached?;
        Ok(read)
    }

    async fn list_volumes_checks(&mut self, objects: &Objects) {
        const CONTAINS: &str = "ListVolumes includes the created volume";
        const PAGED: &str = "ListVolumes pages one entry at a time to the end without duplicates";
        const BAD_TOKEN: &str = "ListVolumes with an invalid starting_token is Aborted";
        let gate = self.controller_gate(ControllerRpc::ListVolumes);
        let ours: Vec<String> = objects
            .volume
            .iter()
            .map(|v| v.volume_id.clone())
            .chain(objects.other.clone())
            .chain(objects.clones.clone())
            .collect();

        let blocked = Self::gates([gate.clone(), objects.volume.is_none().then(|| NO_VOLUME.to_string())]);
        if self.open(CONTAINS, &blocked) {
            let verdict = self.list_volume_ids(0).await.and_then(|ids| {
                let missing: Vec<&String> = ours.iter().filter(|v| !ids.contains(v)).collect();
                if missing.is_empty() { Ok(()) } else { Err(format!("missing {missing:?}")) }
            });
            self.judge(CONTAINS, verdict);
        }
        if self.open(PAGED, &blocked) {
            let verdict = self.list_volume_ids(1).await.and_then(|ids| {
                let mut seen = HashSet::new();
                if let Some(dup) = ids.iter().find(|id| !seen.insert(*id)) {
                    return Err(format!("{dup} listed twice"));
                }
                let missing: Vec<&String> = ours.iter().filter(|v| !seen.contains(v)).collect();
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(format!("missing {missing:?} from the {} paged entries", ids.len()))
                }
            });
            self.judge(PAGED, verdict);
        }
        if self.open(BAD_TOKEN, &gate) {
            let mut problems = Vec::new();
            for token in ["csic-invalid-token".to_string(), format!("{}:csic-invalid-token", self.backend)] {
                let answer = call(
                    self.ctl().list_volumes(csi::ListVolumesRequest { max_entries: 0, starting_token: token.clone() }),
                )
                .await;
                if let Outcome::Fail(why) = expect_code(&answer, Code::Aborted) {
                    problems.push(format!("token {token:?}: {why}"));
                }
            }
            self.judge(BAD_TOKEN, if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) });
        }
    }

    /// Whether a volume still exists, asked the cheapest way the controller offers.
    async fn volume_exists(&mut self, id: &str) -> Result<bool, String> {
        if self.controller_gate(ControllerRpc::GetVolume).is_none() {
            match call(self.ctl().controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: id.to_string() }))
                .await
            {
                Ok(_) => return Ok(true),
                Err(s) if s.code() == Code::NotFound => return Ok(false),
                Err(s) if s.code() == Code::Unimplemented => {}
                Err(s) => return Err(format!("ControllerGetVolume: {}", status(s))),
            }
        }
        if self.controller_gate(ControllerRpc::ListVolumes).is_none() {
            return self.list_volume_ids(0).await.map(|ids| ids.iter().any(|v| v == id));
        }
        Err("neither GET_VOLUME nor LIST_VOLUMES is offered".into())
    }

    async fn delete_checks(&mut self, objects: &Objects) {
        const DELETE_SNAPSHOT: &str = "DeleteSnapshot deletes the snapshot";
        const DELETE_SNAPSHOT_AGAIN: &str = "DeleteSnapshot repeated is OK";
        const RACE: &str = "DeleteVolume sent 8 times in parallel deletes the volume (each OK or Aborted)";
        const CLONES: &str = "DeleteVolume deletes the clones";
        const DELETE: &str = "DeleteVolume deletes the volume";
        const DELETE_AGAIN: &str = "DeleteVolume repeated is OK";

        let blocked = objects.snapshot.is_none().then(|| "no snapshot".to_string());
        if self.open(DELETE_SNAPSHOT, &blocked)
            && let Some(s) = &objects.snapshot
        {
            let answer =
                call(self.ctl().delete_snapshot(self.secreted(csi::DeleteSnapshotRequest {
                    snapshot_id: s.snapshot_id.clone(),
                    ..Default::default()
                })))
                .await;
            let mut verdict = answer.map(|_| ()).map_err(status);
            if verdict.is_ok() && self.controller_gate(ControllerRpc::ListSnapshots).is_none() {
                verdict = match self
                    .list_snapshots(csi::ListSnapshotsRequest {
                        snapshot_id: s.snapshot_id.clone(),
                        ..Default::default()
                    })
                    .await
                {
                    Ok(found) if found.is_empty() => Ok(()),
                    Ok(_) => Err("ListSnapshots still finds it".into()),
                    Err(s) if s.code() == Code::Unimplemented => Ok(()),
                    Err(s) => Err(format!("ListSnapshots: {}", status(s))),
                };
            }
            self.judge(DELETE_SNAPSHOT, verdict);
        }
        if self.open(DELETE_SNAPSHOT_AGAIN, &blocked)
            && let Some(s) = &objects.snapshot
        {
            let answer =
                call(self.ctl().delete_snapshot(self.secreted(csi::DeleteSnapshotRequest {
                    snapshot_id: s.snapshot_id.clone(),
                    ..Default::default()
                })))
                .await;
            self.record(DELETE_SNAPSHOT_AGAIN, expect_code(&answer, Code::Ok));
        }

        let blocked = objects.other.is_none().then(|| "no volume from the concurrent CreateVolume".to_string());
        if self.open(RACE, &blocked)
            && let Some(id) = &objects.other
        {
            let mut calls = tokio::task::JoinSet::new();
            for _ in 0..PARALLEL {
                let mut client = self.ctl();
                let request = self.secreted(csi::DeleteVolumeRequest { volume_id: id.clone(), ..Default::default() });
                calls.spawn(async move { call(client.delete_volume(request)).await });
            }
            let mut problems = Vec::new();
            while let Some(joined) = calls.join_next().await {
                match joined {
                    Ok(Ok(_)) => {}
                    Ok(Err(s)) if s.code() == Code::Aborted => {}
                    Ok(Err(s)) => problems.push(status(s)),
                    Err(e) => problems.push(format!("call task failed: {e}")),
                }
            }
            match self.volume_exists(id).await {
                Ok(false) => {}
                Ok(true) => problems.push(format!("{id} still exists afterwards")),
                Err(e) => problems.push(e),
            }
            self.judge(RACE, if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) });
        }

        // Clones first: a backend may refuse to delete a volume that clones depend on.
        let blocked = objects.clones.is_empty().then(|| "no clones".to_string());
        if self.open(CLONES, &blocked) {
            let mut problems = Vec::new();
            for id in &objects.clones {
                if let Err(s) = call(self.ctl().delete_volume(
                    self.secreted(csi::DeleteVolumeRequest { volume_id: id.clone(), ..Default::default() }),
                ))
                .await
                {
                    problems.push(format!("{id}: {}", status(s)));
                }
            }
            self.judge(CLONES, if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) });
        }

        let blocked = objects.volume.is_none().then(|| NO_VOLUME.to_string());
        if self.open(DELETE, &blocked)
            && let Some(v) = &objects.volume
        {
            let answer = call(self.ctl().delete_volume(
                self.secreted(csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() }),
            ))
            .await;
            let mut verdict = answer.map(|_| ()).map_err(status);
            if verdict.is_ok() {
                verdict = match self.volume_exists(&v.volume_id).await {
                    Ok(false) => Ok(()),
                    Ok(true) => Err(format!("{} still exists", v.volume_id)),
                    Err(e) => Err(e),
                };
            }
            self.judge(DELETE, verdict);
        }
        if self.open(DELETE_AGAIN, &blocked)
            && let Some(v) = &objects.volume
        {
            let answer = call(self.ctl().delete_volume(
                self.secreted(csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() }),
            ))
            .await;
            self.record(DELETE_AGAIN, expect_code(&answer, Code::Ok));
        }
    }

    /// Undo everything the suite made, whatever the checks found: mounts first (through the
    /// node service; a lazy detach only as the last resort), then snapshots, then volumes.
    async fn clean_up(&mut self) {
        const NAME: &str = "cleanup removes every mount, snapshot and volume the suite made";
        let mut problems = Vec::new();
        let created = std::mem::take(&mut self.created);
        if self.node_caps.is_some() {
            for (id, path) in created.published.iter().rev() {
                let request = csi::NodeUnpublishVolumeRequest { volume_id: id.clone(), target_path: path_str(path) };
                if let Err(s) = call(self.nd().node_unpublish_volume(request)).await
                    && s.code() != Code::NotFound
                {
                    problems.push(format!("NodeUnpublishVolume {}: {}", path.display(), status(s)));
                }
            }
            for (id, path) in created.staged.iter().rev() {
                let request =
                    csi::NodeUnstageVolumeRequest { volume_id: id.clone(), staging_target_path: path_str(path) };
                if let Err(s) = call(self.nd().node_unstage_volume(request)).await
                    && s.code() != Code::NotFound
                {
                    problems.push(format!("NodeUnstageVolume {}: {}", path.display(), status(s)));
                }
            }
        }
        for (id, node) in created.attached.iter().rev() {
            let request = csi::ControllerUnpublishVolumeRequest {
                volume_id: id.clone(),
                node_id: node.clone(),
                secrets: self.profile.secrets.clone(),
            };
            if let Err(s) = call(self.ctl().controller_unpublish_volume(request)).await
                && s.code() != Code::NotFound
            {
                problems.push(format!("ControllerUnpublishVolume {id} from {node}: {}", status(s)));
            }
        }
        for id in created.snapshots.iter().rev() {
            if let Err(s) = call(self.ctl().delete_snapshot(
                self.secreted(csi::DeleteSnapshotRequest { snapshot_id: id.clone(), ..Default::default() }),
            ))
            .await
            {
                problems.push(format!("DeleteSnapshot {id}: {}", status(s)));
            }
        }
        for id in created.volumes.iter().rev() {
            if let Err(s) =
                call(self.ctl().delete_volume(
                    self.secreted(csi::DeleteVolumeRequest { volume_id: id.clone(), ..Default::default() }),
                ))
                .await
            {
                problems.push(format!("DeleteVolume {id}: {}", status(s)));
            }
        }
        match mounts_under(&self.work) {
            Ok(left) if left.is_empty() => {
                // Nothing mounted: removing the tree cannot reach into a volume.
                if let Err(e) = std::fs::remove_dir_all(&self.work) {
                    problems.push(format!("removing {}: {e}", self.work.display()));
                }
            }
            Ok(left) => {
                problems.push(format!("still mounted after NodeUnpublish/NodeUnstage, detached lazily: {left:?}"));
                for m in &left {
                    if let Err(e) = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH) {
                        problems.push(format!("detaching {}: {e}", m.display()));
                    }
                }
            }
            Err(e) => problems.push(e),
        }
        self.judge(NAME, if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) });
    }
}
