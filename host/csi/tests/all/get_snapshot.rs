//! CSI GetSnapshot through the Controller service, with natively linked backends (no component
//! to compile): the backend's `get-snapshot` answers it; a backend of an older contract that
//! only lists snapshots is asked for the list filtered by the id; an unknown or foreign id is
//! NOT_FOUND; a backend that answers another snapshot than the one asked is refused (INTERNAL),
//! never passed on; and GET_SNAPSHOT is advertised.
use std::path::Path;
use std::sync::Arc;

use tonic::Code;
use wasmcsi_csi::controller::{ControllerService, controller_capabilities};
use wasmcsi_csi::node::mounts::KernelMounts;
use wasmcsi_csi::node::{Attachers, NodeSetup};
use wasmcsi_csi::plugin::{Mode, Plugin};
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::controller_server::Controller;
use wasmcsi_runtime::bindings::driver::*;
use wasmcsi_runtime::bindings::types::{Error, Timestamp};
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::native::{Guest, NativeDriver};
use wasmcsi_runtime::{Registry, Runtime, RuntimeOptions};

/// The one snapshot every backend here knows.
const KNOWN: &str = "snap-1";

fn snapshot(id: &str) -> Snapshot {
    Snapshot {
        snapshot_id: id.into(),
        source_volume_id: "vol-1".into(),
        size_bytes: 1 << 20,
        creation_time: Timestamp { seconds: 1_700_000_000, nanos: 0 },
        ready_to_use: true,
    }
}

fn unimplemented<T>() -> Result<T, Error> {
    Err(Error::Unimplemented("not in this test backend".into()))
}

/// Everything but snapshots is unimplemented; `features` and the snapshot answers vary.
macro_rules! backend {
    ($name:ident, $features:expr, get: $get:expr, list: $list:expr) => {
        struct $name;
        impl Guest for $name {
            fn info() -> BackendInfo {
                BackendInfo {
                    name: stringify!($name).into(),
                    version: "0".into(),
                    parameters: vec![],
                    features: $features,
                }
            }
            fn list_snapshots(id: Option<String>, _: Option<String>, _: u32, _: String) -> Result<SnapshotPage, Error> {
                let list: fn(Option<String>) -> Vec<Snapshot> = $list;
                Ok(SnapshotPage { entries: list(id), next_token: String::new() })
            }
            fn get_snapshot(id: String) -> Result<Snapshot, Error> {
                let get: fn(String) -> Result<Snapshot, Error> = $get;
                get(id)
            }
        }
    };
}

fn known_only(id: String) -> Result<Snapshot, Error> {
    if id == KNOWN { Ok(snapshot(&id)) } else { Err(Error::NotFound(format!("snapshot {id} not found"))) }
}

backend!(
    Getter,
    vec![Feature::CreateDeleteSnapshot, Feature::ListSnapshots, Feature::GetSnapshot],
    get: known_only,
    list: |_| panic!("a backend with get-snapshot is not listed for GetSnapshot")
);
// An older guest: no `get-snapshot` feature (its export is the SDK's default, unimplemented).
backend!(
    Lister,
    vec![Feature::CreateDeleteSnapshot, Feature::ListSnapshots],
    get: |_| unimplemented(),
    list: |id| id.filter(|id| id == KNOWN).map(|id| snapshot(&id)).into_iter().collect()
);
// Answers a snapshot, but not the one asked for.
backend!(
    Liar,
    vec![Feature::CreateDeleteSnapshot, Feature::ListSnapshots, Feature::GetSnapshot],
    get: |_| Ok(snapshot("snap-2")),
    list: |_| vec![]
);
// Lists whatever it has, ignoring the filter.
backend!(
    SloppyLister,
    vec![Feature::ListSnapshots],
    get: |_| unimplemented(),
    list: |_| vec![snapshot("snap-0"), snapshot("snap-2")]
);
backend!(NoSnapshots, vec![], get: |_| unimplemented(), list: |_| vec![]);

fn controller(dir: &Path) -> ControllerService {
    let config = HostConfig::default();
    let runtime = Runtime::new(RuntimeOptions {
        config: config.clone(),
        cache_dir: None,
        store_path: dir.join("meta.redb"),
        wasm_engine: Default::default(),
    })
    .expect("runtime");
    let registry = Registry::new(runtime.clone(), None, None);
    for (name, driver) in [
        ("getter", NativeDriver::of::<Getter>()),
        ("lister", NativeDriver::of::<Lister>()),
        ("liar", NativeDriver::of::<Liar>()),
        ("sloppy", NativeDriver::of::<SloppyLister>()),
        ("none", NativeDriver::of::<NoSnapshots>()),
    ] {
        registry.insert(runtime.load_native(name, driver).expect("native backend"));
    }
    let driver = Plugin {
        name: "wasmcsi.test".into(),
        version: "0".into(),
        mode: Mode::Controller,
        node_id: String::new(),
        registry,
        inflight: Default::default(),
        node_local: Default::default(),
        nodes: Default::default(),
        grant_signer: None,
        attachers: Attachers::new(NodeSetup {
            node_id: "controller".into(),
            state_dir: dir.join("state"),
            config: Arc::new(config),
            mounts: Arc::new(KernelMounts),
            runtime_dir: dir.join("run"),
            datapath: None,
        }),
    };
    ControllerService(Arc::new(driver))
}

async fn get(c: &ControllerService, id: &str) -> Result<csi::Snapshot, tonic::Status> {
    let request = csi::GetSnapshotRequest { snapshot_id: id.into(), ..Default::default() };
    let answer = c.get_snapshot(tonic::Request::new(request)).await?.into_inner();
    answer.snapshot.ok_or_else(|| tonic::Status::internal("the answer carries no snapshot"))
}

#[tokio::test(flavor = "multi_thread")]
async fn get_snapshot_answers_from_the_backend_and_not_found_for_unknown_ids() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = controller(dir.path());
    for backend in ["getter", "lister"] {
        let s = get(&c, &format!("{backend}:{KNOWN}")).await.expect(backend);
        assert_eq!(
            (s.snapshot_id.as_str(), s.source_volume_id.as_str()),
            (&*format!("{backend}:{KNOWN}"), &*format!("{backend}:vol-1"))
        );
        assert!(s.ready_to_use && s.size_bytes == 1 << 20 && s.creation_time.is_some(), "{backend}: {s:?}");
        let unknown = get(&c, &format!("{backend}:snap-9")).await.expect_err(backend);
        assert_eq!(unknown.code(), Code::NotFound, "{backend}: {unknown:?}");
    }
    for foreign in ["nope", "getter:", "getter:a/b"] {
        assert_eq!(get(&c, foreign).await.expect_err(foreign).code(), Code::NotFound, "{foreign}");
    }
    assert_eq!(get(&c, "").await.expect_err("empty").code(), Code::InvalidArgument);
    assert_eq!(get(&c, "not-loaded:snap-1").await.expect_err("unloaded").code(), Code::Unavailable);
    assert_eq!(get(&c, "none:snap-1").await.expect_err("no snapshots").code(), Code::Unimplemented);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backend_answering_another_snapshot_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = controller(dir.path());
    let refused = get(&c, &format!("liar:{KNOWN}")).await.expect_err("another snapshot");
    assert_eq!(refused.code(), Code::Internal, "{refused:?}");
    assert!(refused.message().contains("snap-2"), "{refused:?}");
    // A list that ignores its filter: the snapshot asked for is not among it.
    let missing = get(&c, &format!("sloppy:{KNOWN}")).await.expect_err("not listed");
    assert_eq!(missing.code(), Code::NotFound, "{missing:?}");
}

#[test]
fn get_snapshot_is_advertised() {
    use csi::controller_service_capability::{Type, rpc::Type as R};
    let offered: Vec<i32> = controller_capabilities(false)
        .into_iter()
        .filter_map(|c| match c.r#type {
            Some(Type::Rpc(rpc)) => Some(rpc.r#type),
            _ => None,
        })
        .collect();
    assert!(offered.contains(&(R::GetSnapshot as i32)), "{offered:?}");
}
