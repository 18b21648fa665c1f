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
//! It does not start hosts (the CLI's `host` module does) and it never looks inside one:
//! everything it knows comes over the socket, plus the mount table of this machine for the node
//! checks. It ships: `wasmcsi backend check` runs it before a backend is deployed.
//!
//! One file per CSI service, as kubernetes-csi's `pkg/sanity` lays it out: `identity`
//! (GetPluginInfo, Probe and the capabilities of every service), `controller` (volumes:
//! create, get, expand, list, delete, unknown ids), `modify` (ControllerModifyVolume and
//! mutable parameters), `validation` (missing required fields, on
//! every RPC), `snapshots` (snapshots and clones), `group_snapshots` (the GroupController: advertised exactly
//! when offered; VolumeGroupSnapshots created, found and deleted), `node` (stage, publish, unpublish,
//! unstage), `topology`, `names`, `single_writer`; `suite` holds the runner every check
//! is judged by, `cleanup` what the suite made and how it is removed again.
use anyhow::Context;
use csi::controller_client::ControllerClient;
use csi::group_controller_client::GroupControllerClient;
use csi::identity_client::IdentityClient;
use csi::node_client::NodeClient;
use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;
use tonic::Status;
use wasmcsi_csi::plugin::BACKEND_PARAMETER;
use wasmcsi_proto::csi::v1 as csi;

use cleanup::{Created, Made, made_snapshot, made_volume};
use node::{is_mounted, is_unmounted, mounts_under};
use suite::{Objects, Suite, call, expect_code, path_str, status};

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
    ControllerModifyVolumeRequest,
    ValidateVolumeCapabilitiesRequest
);

impl Profile {
    /// The backend the profile names.
    pub fn backend(&self) -> Option<&str> {
        self.parameters.get(BACKEND_PARAMETER).map(String::as_str)
    }
}

// The report (its checks and their rendering) is the one the composed wasmtime checks print
// too, so both say PASS/FAIL/SKIP alike.
pub use wasmcsi_check_report::{Check, Outcome, Report};

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
    let channel = connect(socket).await?;
    let mut suite = Suite {
        profile,
        backend,
        run,
        work,
        identity: IdentityClient::new(channel.clone()),
        controller: ControllerClient::new(channel.clone()),
        group: GroupControllerClient::new(channel.clone()),
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

type Pending = Pin<Box<dyn Future<Output = Result<Made, Status>> + Send>>;

/// One RPC as a boxed future; the optional mapping says what its answer created, so that a
/// request the host should have refused but carried out is still cleaned up.
macro_rules! rpc {
    ($client:expr, $method:ident, $request:expr) => {
        rpc!($client, $method, $request, |_| $crate::Made::Nothing)
    };
    ($client:expr, $method:ident, $request:expr, $made:expr) => {{
        let mut client = $client;
        let request = $request;
        let pending: $crate::Pending =
            Box::pin(async move { client.$method(request).await.map(|r| ($made)(r.into_inner())) });
        pending
    }};
}

mod cleanup;
mod controller;
mod group_snapshots;
mod identity;
mod modify;
mod names;
mod node;
mod single_writer;
mod snapshots;
mod suite;
mod topology;
mod validation;

/// A gRPC channel to the CSI socket at `socket`, as kubelet and the sidecars open one.
pub async fn connect(socket: &Path) -> anyhow::Result<tonic::transport::Channel> {
    let uri = format!("unix://{}", socket.display());
    tonic::transport::Endpoint::try_from(uri)?
        .connect()
        .await
        .with_context(|| format!("connecting to {}", socket.display()))
}
