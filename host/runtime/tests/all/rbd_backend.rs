//! The ceph-rbd-shim component (`wasmcsi_artifacts::CEPH_RBD_SHIM`) loaded into a real `Runtime`
//! with an `rbd` grant and driven through its exports against a real Ceph cluster
//! (`wasmcsi_ceph::Ceph`: 1 mon, 1 mgr, 2 memstore OSDs in a private namespace; needs
//! root and `scripts/ceph-setup`, skipped with a message otherwise, required in CI with
//! `WASMCSI_CEPH_TESTS=require`). Each test uses its own pool and a cephx user limited to it, as
//! ceph-csi's docs set one up. Results are checked behind the backend's back with the `rbd` CLI
//! and the host's own client.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use wasmcsi_ceph::{CLUSTER, Ceph};
use wasmcsi_rbd::{RbdClient, RbdPool};
use wasmcsi_runtime::bindings::types::{AccessMode, AccessType, MountVolume};
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::driver::{Attachment, CapacityRange, ContentSource, CreateVolumeRequest, Pair, VolumeCapability};
use wasmcsi_runtime::wasm_engine::WasmEngineSettings;
use wasmcsi_runtime::{Backend, CallError, Runtime, RuntimeOptions, Secrets, WitError, secret_refs};

const MIB: u64 = 1 << 20;
const NAME: &str = "ceph-rbd-shim";

/// Everything the host logs, at every level, so a test can assert no key ever reaches a log.
fn logs() -> &'static Mutex<Vec<u8>> {
    static LOGS: OnceLock<&'static Mutex<Vec<u8>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf: &'static Mutex<Vec<u8>> = Box::leak(Box::new(Mutex::new(Vec::new())));
        struct W(&'static Mutex<Vec<u8>>);
        impl Write for W {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        // Everything of ours and the runtime's at trace; the compiler's own chatter off.
        let filter = "trace,cranelift_codegen=warn,cranelift_frontend=warn,wasmtime=warn,wasmtime_cranelift=warn,\
                      wasmtime_environ=warn,regalloc2=warn,wasmparser=warn";
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(move || W(buf))
            .with_ansi(false)
            .try_init();
        buf
    })
}

struct Env {
    ceph: &'static Ceph,
    pool: String,
    /// what the test reads and writes images with, behind the backend
    admin: RbdPool,
    key: String,
    secrets: Secrets,
    /// kept alive: its epoch ticker drives every call's deadline
    _rt: Arc<Runtime>,
    backend: Arc<Backend>,
    _dir: tempfile::TempDir,
}

async fn setup(pool: &str, extra_config: &str) -> Option<Env> {
    setup_backend(NAME, wasmcsi_artifacts::CEPH_RBD_SHIM, pool, extra_config).await
}

/// `setup` with the component `wasm`, loaded as backend `name`.
async fn setup_backend(name: &str, wasm: &[u8], pool: &str, extra_config: &str) -> Option<Env> {
    logs();
    let ceph = Ceph::shared()?;
    ceph.create_pool(pool).expect("create pool");
    let key = ceph.create_user(&format!("csi-{pool}"), pool).expect("create user");
    let dir = tempfile::tempdir().unwrap();
    let monitors: Vec<String> = ceph.monitors();
    let text = format!(
        "[runtime]\ncall_deadline_ms = 60000\nimport_timeout_ms = 20000\n\
         [clusters.{CLUSTER}]\nmonitors = {monitors:?}\n\
         [backends.{name}]\ncall_deadline_ms = 60000\n\
         [backends.{name}.grants]\nrbd = [{{ cluster = {CLUSTER:?}, pools = [{pool:?}] }}]\n{extra_config}"
    );
    let rt = Runtime::new(RuntimeOptions {
        config: HostConfig::parse(&text, Path::new("test")).unwrap(),
        cache_dir: Some(dir.path().join("cache")),
        store_path: dir.path().join("state/meta.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 16, max_memory_bytes: 256 << 20 },
    })
    .unwrap();
    let t = Instant::now();
    let backend = rt.load(name, wasm, None).await.unwrap();
    eprintln!("component loaded in {:?}", t.elapsed());
    let admin = RbdClient::new(ceph.config(&[pool])).pool(CLUSTER, pool, &ceph.admin()).unwrap();
    // A mix of keys, sorted as the CSI layer sorts them; the backend must find its pair.
    let secrets = vec![
        ("csi.storage.k8s.io/unrelated".to_owned(), "x".to_owned()),
        ("userID".to_owned(), format!("csi-{pool}")),
        ("userKey".to_owned(), key.clone()),
    ];
    Some(Env { ceph, pool: pool.into(), admin, key, secrets, _rt: rt, backend, _dir: dir })
}

impl Env {
    fn params(&self, extra: &[(&str, &str)]) -> Vec<Pair> {
        let mut kv = vec![("clusterID", CLUSTER), ("pool", self.pool.as_str())];
        for (k, v) in extra {
            kv.retain(|(x, _)| x != k);
            kv.push((k, v));
        }
        pairs(&kv)
    }

    fn request(&self, name: &str, bytes: u64, params: Vec<Pair>, source: Option<ContentSource>) -> CreateVolumeRequest {
        CreateVolumeRequest {
            name: name.into(),
            capacity: CapacityRange { required_bytes: bytes, limit_bytes: 0 },
            capabilities: vec![mount()],
            parameters: params,
            secrets: secret_refs(&self.secrets),
            content_source: source,
            accessibility: None,
            mutable_parameters: vec![],
        }
    }

    /// Images in the pool, by the CLI.
    fn images(&self) -> Vec<String> {
        let out = self.ceph.rbd(&["ls", &self.pool]).unwrap();
        let mut v: Vec<String> = out.split_whitespace().map(str::to_owned).collect();
        v.sort();
        v
    }

    fn no_key_in(&self, what: &str) {
        assert!(!what.contains(&self.key), "the key leaked: {what}");
    }

    fn no_key_in_logs(&self) {
        let logs = String::from_utf8_lossy(&logs().lock().unwrap()).into_owned();
        assert!(!logs.is_empty(), "the log capture works");
        self.no_key_in(&logs);
    }
}

fn pairs(kv: &[(&str, &str)]) -> Vec<Pair> {
    kv.iter().map(|(k, v)| Pair { key: (*k).into(), value: (*v).into() }).collect()
}

fn mount() -> VolumeCapability {
    VolumeCapability {
        access_type: AccessType::Mount(MountVolume { fs_type: String::new(), mount_flags: vec![] }),
        access_mode: AccessMode::SingleNodeWriter,
    }
}

fn block(mode: AccessMode) -> VolumeCapability {
    VolumeCapability { access_type: AccessType::Block, access_mode: mode }
}

fn wit(r: Result<impl std::fmt::Debug, CallError>) -> WitError {
    match r {
        Err(CallError::Backend { error, .. }) => error,
        other => panic!("expected a backend error, got {other:?}"),
    }
}

fn image_of(volume_id: &str) -> String {
    volume_id.rsplit('.').next().unwrap().to_owned()
}

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbd_backend_provisions_snapshots_clones_expands_and_deletes() {
    let Some(env) = setup("shim-flow", "").await else { return };
    let b = &env.backend;
    let s = &env.secrets;
    let mut errors: Vec<String> = Vec::new();

    // Create, twice (idempotent), then with a larger size (already-exists).
    let params = env.params(&[("imageFeatures", "layering,exclusive-lock")]);
    let t = Instant::now();
    let v1 = b.create_volume(env.request("pvc-1", 4 * MIB, params.clone(), None), s.clone()).await.unwrap();
    eprintln!("first CreateVolume through the runtime: {:?}", t.elapsed());
    let img1 = image_of(&v1.volume_id);
    assert_eq!(v1.volume_id, format!("{CLUSTER}.{}.{img1}", env.pool));
    assert!(img1.starts_with("csi-vol-") && img1.len() == 24, "{img1}");
    assert!(v1.volume_id.len() <= 95);
    assert_eq!(v1.capacity_bytes, 4 * MIB);
    let cli: serde_json::Value =
        serde_json::from_str(&env.ceph.rbd(&["info", &format!("{}/{img1}", env.pool), "--format", "json"]).unwrap())
            .unwrap();
    assert_eq!(cli["size"], 4 * MIB);
    let mut features: Vec<&str> = cli["features"].as_array().unwrap().iter().filter_map(|f| f.as_str()).collect();
    features.sort();
    assert_eq!(features, ["exclusive-lock", "layering"]);
    let name = env.ceph.rbd(&["image-meta", "get", &format!("{}/{img1}", env.pool), "csi.wasmcsi.io/name"]).unwrap();
    assert_eq!(name.trim(), "pvc-1");
    let mut lat = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let again = b.create_volume(env.request("pvc-1", 4 * MIB, params.clone(), None), s.clone()).await.unwrap();
        lat.push(t.elapsed());
        assert_eq!(again.volume_id, v1.volume_id);
    }
    eprintln!("repeated CreateVolume (found by name) p50 {:?}", p50(lat));
    let e = wit(b.create_volume(env.request("pvc-1", 8 * MIB, params.clone(), None), s.clone()).await);
    assert!(matches!(e, WitError::AlreadyExists(_)), "{e:?}");
    errors.push(format!("{e:?}"));
    let mut lat = Vec::new();
    for i in 0..5 {
        let t = Instant::now();
        let v = b.create_volume(env.request(&format!("lat-{i}"), MIB, env.params(&[]), None), s.clone()).await.unwrap();
        lat.push(t.elapsed());
        b.delete_volume(v.volume_id, s.clone()).await.unwrap();
    }
    eprintln!("new CreateVolume through the runtime p50 {:?}", p50(lat));
    env.admin.write(&img1, 4096, b"rbd volume data").await.unwrap();

    // Capacity, get and list: CSI passes no secrets; the host reuses the accepted ones.
    let cap = b.get_capacity(vec![mount()], env.params(&[]), None).await.unwrap();
    assert!(cap.available_bytes > 0, "{cap:?}");
    let st = b.get_volume(v1.volume_id.clone()).await.unwrap();
    assert_eq!(st.volume.capacity_bytes, 4 * MIB);
    let listed = b.list_volumes(0, String::new()).await.unwrap();
    assert_eq!(listed.entries.iter().map(|e| e.volume.volume_id.as_str()).collect::<Vec<_>>(), [v1.volume_id.as_str()]);
    assert_eq!(
        b.validate_volume_capabilities(v1.volume_id.clone(), vec![], vec![mount()], vec![]).await.unwrap(),
        None
    );
    let rwx_fs = VolumeCapability { access_mode: AccessMode::MultiNodeMultiWriter, ..mount() };
    assert!(
        b.validate_volume_capabilities(v1.volume_id.clone(), vec![], vec![rwx_fs.clone()], vec![])
            .await
            .unwrap()
            .is_some()
    );
    let rwx_block = block(AccessMode::MultiNodeMultiWriter);
    assert_eq!(
        b.validate_volume_capabilities(v1.volume_id.clone(), vec![], vec![rwx_block.clone()], vec![]).await.unwrap(),
        None
    );

    // Attach plans: the id's parts; a multi-node writer filesystem is refused.
    let Attachment::Rbd(plan) =
        b.attach_plan(v1.volume_id.clone(), v1.volume_context.clone(), mount(), vec![]).await.unwrap()
    else {
        panic!("not an rbd plan")
    };
    assert_eq!(
        (plan.cluster.as_str(), plan.pool.as_str(), plan.image.as_str()),
        (CLUSTER, env.pool.as_str(), img1.as_str())
    );
    assert!(matches!(
        wit(b.attach_plan(v1.volume_id.clone(), vec![], rwx_fs, vec![]).await),
        WitError::FailedPrecondition(_)
    ));
    assert!(b.attach_plan(v1.volume_id.clone(), vec![], rwx_block, vec![]).await.is_ok());

    // Expand: filesystem volumes need the node; block ones do not; a smaller size is a no-op.
    let x = b.expand_volume(
        v1.volume_id.clone(),
        CapacityRange { required_bytes: 8 * MIB, limit_bytes: 0 },
        Some(mount()),
        s.clone(),
    );
    let x = x.await.unwrap();
    assert_eq!((x.capacity_bytes, x.node_expansion_required), (8 * MIB, true));
    let x = b.expand_volume(
        v1.volume_id.clone(),
        CapacityRange { required_bytes: 6 * MIB, limit_bytes: 0 },
        Some(block(AccessMode::SingleNodeWriter)),
        s.clone(),
    );
    let x = x.await.unwrap();
    assert_eq!((x.capacity_bytes, x.node_expansion_required), (8 * MIB, false));
    assert_eq!(env.admin.info(&img1).await.unwrap().unwrap().size_bytes, 8 * MIB);
    // The original request still answers with the (expanded) volume.
    let again = b.create_volume(env.request("pvc-1", 4 * MIB, params.clone(), None), s.clone()).await.unwrap();
    assert_eq!((again.volume_id.as_str(), again.capacity_bytes), (v1.volume_id.as_str(), 8 * MIB));

    // Snapshot: an RBD snapshot of the image; by name again → the same one.
    let t = Instant::now();
    let snap = b.create_snapshot("snap-1".into(), v1.volume_id.clone(), vec![], s.clone()).await.unwrap();
    eprintln!("CreateSnapshot {:?}", t.elapsed());
    assert!(snap.snapshot_id.starts_with(&format!("{}.", v1.volume_id)), "{snap:?}");
    assert!(snap.snapshot_id.len() <= 95);
    assert_eq!(
        (snap.size_bytes, snap.ready_to_use, snap.source_volume_id.as_str()),
        (8 * MIB, true, v1.volume_id.as_str())
    );
    let snap2 = b.create_snapshot("snap-1".into(), v1.volume_id.clone(), vec![], s.clone()).await.unwrap();
    assert_eq!(snap2.snapshot_id, snap.snapshot_id);
    assert_eq!(
        (snap2.creation_time.seconds, snap2.creation_time.nanos),
        (snap.creation_time.seconds, snap.creation_time.nanos)
    );
    let e = wit(b.create_snapshot("snap-x".into(), v1.volume_id.clone(), pairs(&[("colour", "red")]), s.clone()).await);
    assert!(matches!(&e, WitError::InvalidArgument(m) if m.contains("colour")), "{e:?}");
    for (filter_snap, filter_vol) in
        [(None, None), (Some(snap.snapshot_id.clone()), None), (None, Some(v1.volume_id.clone()))]
    {
        let page = b.list_snapshots(filter_snap, filter_vol, 0, String::new()).await.unwrap();
        assert_eq!(
            page.entries.iter().map(|x| x.snapshot_id.as_str()).collect::<Vec<_>>(),
            [snap.snapshot_id.as_str()]
        );
    }
    let none =
        b.list_snapshots(Some(format!("{}.0123456789abcdef", v1.volume_id)), None, 0, String::new()).await.unwrap();
    assert!(none.entries.is_empty());

    // From the snapshot, larger than it; from the volume (a temporary snapshot on the source).
    let t = Instant::now();
    let v2 = b.create_volume(
        env.request("pvc-2", 16 * MIB, env.params(&[]), Some(ContentSource::Snapshot(snap.snapshot_id.clone()))),
        s.clone(),
    );
    let v2 = v2.await.unwrap();
    eprintln!("CreateVolume from a snapshot {:?}", t.elapsed());
    let img2 = image_of(&v2.volume_id);
    let info2 = env.admin.info(&img2).await.unwrap().unwrap();
    assert_eq!(info2.size_bytes, 16 * MIB);
    assert_eq!(
        info2.parent.as_deref(),
        Some(format!("{}/{img1}@csi-snap-{}", env.pool, snap.snapshot_id.rsplit('.').next().unwrap()).as_str())
    );
    assert_eq!(env.admin.read(&img2, 4096, 15).await.unwrap(), b"rbd volume data");
    let again = b.create_volume(
        env.request("pvc-2", 16 * MIB, env.params(&[]), Some(ContentSource::Snapshot(snap.snapshot_id.clone()))),
        s.clone(),
    );
    assert_eq!(again.await.unwrap().volume_id, v2.volume_id);
    // The snapshot's name from another source volume: already-exists.
    let e = wit(b.create_snapshot("snap-1".into(), v2.volume_id.clone(), vec![], s.clone()).await);
    assert!(matches!(e, WitError::AlreadyExists(_)), "{e:?}");
    // Same name, other source: already-exists.
    let e = wit(b
        .create_volume(
            env.request("pvc-2", 16 * MIB, env.params(&[]), Some(ContentSource::Volume(v1.volume_id.clone()))),
            s.clone(),
        )
        .await);
    assert!(matches!(e, WitError::AlreadyExists(_)), "{e:?}");
    let e = wit(b.create_volume(env.request("pvc-2", 16 * MIB, env.params(&[]), None), s.clone()).await);
    assert!(matches!(e, WitError::AlreadyExists(_)), "{e:?}");
    let t = Instant::now();
    let v3 = b.create_volume(
        env.request("pvc-3", 0, env.params(&[]), Some(ContentSource::Volume(v1.volume_id.clone()))),
        s.clone(),
    );
    let v3 = v3.await.unwrap();
    eprintln!("CreateVolume from a volume {:?}", t.elapsed());
    let img3 = image_of(&v3.volume_id);
    assert_eq!(v3.capacity_bytes, 8 * MIB, "the source's size when none is asked for");
    assert_eq!(env.admin.read(&img3, 4096, 15).await.unwrap(), b"rbd volume data");
    let snaps1: Vec<String> = env.admin.snapshot_list(&img1).await.unwrap().into_iter().map(|x| x.name).collect();
    assert_eq!(snaps1.len(), 2, "the CSI snapshot and the clone's temporary one: {snaps1:?}");
    assert!(snaps1.iter().any(|n| n.starts_with("csi-tmp-")), "{snaps1:?}");
    // The temporary snapshot is not a CSI snapshot.
    assert_eq!(b.list_snapshots(None, Some(v1.volume_id.clone()), 0, String::new()).await.unwrap().entries.len(), 1);
    let e = wit(b
        .create_volume(
            env.request("pvc-4", MIB, env.params(&[]), Some(ContentSource::Volume(v1.volume_id.clone()))),
            s.clone(),
        )
        .await);
    assert!(matches!(e, WitError::OutOfRange(_)), "smaller than the source: {e:?}");
    let missing = format!("{CLUSTER}.{}.csi-vol-0000000000000000", env.pool);
    let e = wit(b
        .create_volume(
            env.request("pvc-5", 0, env.params(&[]), Some(ContentSource::Volume(missing.clone()))),
            s.clone(),
        )
        .await);
    assert!(matches!(e, WitError::NotFound(_)), "{e:?}");

    // Delete the source while a CSI snapshot and a clone of it exist: the volume is gone for
    // CSI, the image stays for them (nothing they read is lost).
    b.delete_volume(v1.volume_id.clone(), s.clone()).await.unwrap();
    assert!(env.images().contains(&img1));
    assert!(matches!(wit(b.get_volume(v1.volume_id.clone()).await), WitError::NotFound(_)));
    let e = wit(b
        .expand_volume(
            v1.volume_id.clone(),
            CapacityRange { required_bytes: 32 * MIB, limit_bytes: 0 },
            None,
            s.clone(),
        )
        .await);
    assert!(matches!(e, WitError::NotFound(_)), "{e:?}");
    assert!(
        !b.list_volumes(0, String::new()).await.unwrap().entries.iter().any(|e| e.volume.volume_id == v1.volume_id)
    );
    b.delete_volume(v1.volume_id.clone(), s.clone()).await.unwrap();
    assert_eq!(
        b.list_snapshots(Some(snap.snapshot_id.clone()), None, 0, String::new()).await.unwrap().entries.len(),
        1,
        "the snapshot lives on"
    );
    assert_eq!(env.admin.read(&img3, 4096, 15).await.unwrap(), b"rbd volume data");

    // The clone from the volume goes: its temporary snapshot goes with it.
    b.delete_volume(v3.volume_id.clone(), s.clone()).await.unwrap();
    let snaps1: Vec<String> = env.admin.snapshot_list(&img1).await.unwrap().into_iter().map(|x| x.name).collect();
    assert!(!snaps1.iter().any(|n| n.starts_with("csi-tmp-")), "{snaps1:?}");
    assert!(env.images().contains(&img1));

    // The last snapshot goes: its clone (pvc-2) is flattened first, then the deleted source
    // image is removed for good.
    let t = Instant::now();
    b.delete_snapshot(snap.snapshot_id.clone(), s.clone()).await.unwrap();
    eprintln!("DeleteSnapshot with a clone (flatten) and a deferred image removal {:?}", t.elapsed());
    b.delete_snapshot(snap.snapshot_id.clone(), s.clone()).await.unwrap();
    assert_eq!(env.images(), std::slice::from_ref(&img2));
    let info2 = env.admin.info(&img2).await.unwrap().unwrap();
    assert_eq!(info2.parent, None);
    assert_eq!(env.admin.read(&img2, 4096, 15).await.unwrap(), b"rbd volume data");
    assert!(b.list_snapshots(None, None, 0, String::new()).await.unwrap().entries.is_empty());

    b.delete_volume(v2.volume_id.clone(), s.clone()).await.unwrap();
    b.delete_volume(v2.volume_id.clone(), s.clone()).await.unwrap();
    b.delete_volume("not-an-id".into(), s.clone()).await.unwrap();
    assert!(env.images().is_empty(), "{:?}", env.images());
    for e in &errors {
        env.no_key_in(e);
    }
    env.no_key_in_logs();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_deeper_than_max_clone_depth_are_flattened() {
    let Some(env) = setup("shim-depth", "").await else { return };
    let (b, s) = (&env.backend, &env.secrets);
    let params = env.params(&[("maxCloneDepth", "2")]);
    let mut ids =
        vec![b.create_volume(env.request("d0", MIB, params.clone(), None), s.clone()).await.unwrap().volume_id];
    env.admin.write(&image_of(&ids[0]), 0, b"depth").await.unwrap();
    for i in 1..=3 {
        let src = ContentSource::Volume(ids[i - 1].clone());
        let v = b.create_volume(env.request(&format!("d{i}"), 0, params.clone(), Some(src)), s.clone()).await.unwrap();
        ids.push(v.volume_id);
    }
    let parents: Vec<Option<String>> = {
        let mut v = vec![];
        for id in &ids {
            v.push(env.admin.info(&image_of(id)).await.unwrap().unwrap().parent);
        }
        v
    };
    assert!(parents[0].is_none() && parents[1].is_some() && parents[2].is_some(), "{parents:?}");
    assert!(parents[3].is_none(), "depth 3 > maxCloneDepth 2: flattened: {parents:?}");
    assert_eq!(env.admin.read(&image_of(&ids[3]), 0, 5).await.unwrap(), b"depth");
    // The flattened clone's temporary snapshot on its source is gone; the others stay.
    assert!(env.admin.snapshot_list(&image_of(&ids[2])).await.unwrap().is_empty());
    assert_eq!(env.admin.snapshot_list(&image_of(&ids[1])).await.unwrap().len(), 1);
    // A retry of the flattened clone finds it by its lineage.
    let again =
        b.create_volume(env.request("d3", 0, params.clone(), Some(ContentSource::Volume(ids[2].clone()))), s.clone());
    assert_eq!(again.await.unwrap().volume_id, ids[3]);

    // Deleting the middle of the chain flattens its clone first.
    b.delete_volume(ids[1].clone(), s.clone()).await.unwrap();
    assert_eq!(env.admin.info(&image_of(&ids[2])).await.unwrap().unwrap().parent, None);
    assert_eq!(env.admin.read(&image_of(&ids[2]), 0, 5).await.unwrap(), b"depth");
    for id in [&ids[0], &ids[2], &ids[3]] {
        b.delete_volume(id.clone(), s.clone()).await.unwrap();
    }
    assert!(env.images().is_empty(), "{:?}", env.images());

    // maxCloneDepth=0: every clone is a full copy.
    let flat = env.params(&[("maxCloneDepth", "0")]);
    let v = b.create_volume(env.request("f0", MIB, flat.clone(), None), s.clone()).await.unwrap();
    let c = b
        .create_volume(env.request("f1", 0, flat, Some(ContentSource::Volume(v.volume_id.clone()))), s.clone())
        .await
        .unwrap();
    assert_eq!(env.admin.info(&image_of(&c.volume_id)).await.unwrap().unwrap().parent, None);
    b.delete_volume(v.volume_id, s.clone()).await.unwrap();
    b.delete_volume(c.volume_id, s.clone()).await.unwrap();
    assert!(env.images().is_empty());
}

/// The image's QoS metadata as the `rbd` CLI lists it (`conf_rbd_qos_*` keys only).
fn qos_meta(env: &Env, image: &str) -> std::collections::BTreeMap<String, String> {
    let out = env.ceph.rbd(&["image-meta", "list", &format!("{}/{image}", env.pool), "--format", "json"]).unwrap();
    let all: std::collections::BTreeMap<String, String> =
        if out.trim().is_empty() { Default::default() } else { serde_json::from_str(&out).unwrap() };
    all.into_iter().filter(|(k, _)| k.starts_with("conf_rbd_qos_")).collect()
}

/// `rbd bench` (a librbd client, which applies the image's own configuration when it opens it)
/// writing `ops` 4 KiB blocks: how long it took.
fn bench_writes(env: &Env, image: &str, ops: u64) -> Duration {
    let total = (ops * 4096).to_string();
    let spec = format!("{}/{image}", env.pool);
    let t = Instant::now();
    let args = ["bench", "--io-type", "write", "--io-size", "4096", "--io-threads", "4", "--io-total", &total, &spec];
    env.ceph.rbd(&args).unwrap();
    t.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos_limits_are_set_at_creation_modified_by_key_lifted_and_enforced_by_librbd() {
    let Some(env) = setup("shim-qos", "").await else { return };
    let (b, s) = (&env.backend, &env.secrets);
    let kv = |pairs: &[(&str, &str)]| -> std::collections::BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    };
    let mut req = env.request("q-1", 8 * MIB, env.params(&[]), None);
    req.mutable_parameters = pairs(&[("writeIOPS", "25"), ("readBytesPerSecond", "10Mi")]);
    let v = b.create_volume(req.clone(), s.clone()).await.unwrap();
    let img = image_of(&v.volume_id);
    assert_eq!(
        qos_meta(&env, &img),
        kv(&[("conf_rbd_qos_read_bps_limit", "10485760"), ("conf_rbd_qos_write_iops_limit", "25")])
    );
    assert_eq!(b.create_volume(req, s.clone()).await.unwrap().volume_id, v.volume_id, "a retry");

    // librbd enforces it: 100 writes at 25 IOPS take seconds (the first second's burst aside).
    let limited = bench_writes(&env, &img, 100);
    eprintln!("rbd bench: 100 x 4 KiB writes at writeIOPS=25 took {limited:?}");
    assert!(limited >= Duration::from_secs(2), "{limited:?}");

    // Modify: a key given changes, the others stay, 0 lifts.
    let modify = |kv: &[(&str, &str)]| b.modify_volume(v.volume_id.clone(), pairs(kv), s.clone());
    let t = Instant::now();
    modify(&[("readIOPS", "500"), ("writeIOPS", "0"), ("writeBytesPerSecond", "1G")]).await.unwrap();
    eprintln!("ControllerModifyVolume through the runtime: {:?}", t.elapsed());
    assert_eq!(
        qos_meta(&env, &img),
        kv(&[
            ("conf_rbd_qos_read_bps_limit", "10485760"),
            ("conf_rbd_qos_read_iops_limit", "500"),
            ("conf_rbd_qos_write_bps_limit", "1000000000")
        ])
    );
    modify(&[("readIOPS", "500"), ("writeIOPS", "0"), ("writeBytesPerSecond", "1G")]).await.expect("the same again");
    let free = bench_writes(&env, &img, 100);
    eprintln!("rbd bench: 100 x 4 KiB writes with writeIOPS lifted took {free:?}");
    assert!(free < limited, "{free:?} vs {limited:?}");

    // Refused by name with nothing changed: an unknown key, a StorageClass parameter, a bad value.
    let before = qos_meta(&env, &img);
    for (pairs_, name) in [
        (&[("readIOPS", "1"), ("colour", "red")][..], "colour"),
        (&[("pool", "elsewhere")][..], "pool"),
        (&[("writeIOPS", "-3")][..], "writeIOPS"),
    ] {
        let e = wit(modify(pairs_).await);
        assert!(matches!(&e, WitError::InvalidArgument(m) if m.contains(&format!("{name:?}"))), "{e:?}");
    }
    assert_eq!(qos_meta(&env, &img), before);
    let missing = format!("{CLUSTER}.{}.csi-vol-0000000000000000", env.pool);
    let e = wit(b.modify_volume(missing, pairs(&[("readIOPS", "1")]), s.clone()).await);
    assert!(matches!(e, WitError::NotFound(_)), "{e:?}");

    // Lifting every limit leaves no QoS key at all.
    modify(&[("readIOPS", "0"), ("readBytesPerSecond", "0"), ("writeBytesPerSecond", "0")]).await.unwrap();
    assert!(qos_meta(&env, &img).is_empty(), "{:?}", qos_meta(&env, &img));
    b.delete_volume(v.volume_id, s.clone()).await.unwrap();
    assert!(env.images().is_empty(), "{:?}", env.images());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_parameters_ungranted_pools_and_bad_secrets_are_refused_without_creating_anything() {
    let Some(env) = setup("shim-refuse", "").await else { return };
    let (b, s) = (&env.backend, &env.secrets);
    let mut errors: Vec<String> = Vec::new();
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("colour", "red")], "colour"),
        (&[("imageFeatures", "object-map")], "imageFeatures"),
        (&[("imageFeatures", "journaling")], "imageFeatures"),
        (&[("imageNamePrefix", "a.b")], "imageNamePrefix"),
        (&[("maxCloneDepth", "many")], "maxCloneDepth"),
        (&[("dataPool", "no/pe")], "dataPool"),
        (&[("imageFormat", "1")], "imageFormat"),
    ];
    for (extra, name) in cases {
        let e = wit(b.create_volume(env.request("bad", MIB, env.params(extra), None), s.clone()).await);
        assert!(matches!(&e, WitError::InvalidArgument(m) if m.contains(name)), "{extra:?}: {e:?}");
        errors.push(format!("{e:?}"));
    }
    let e = wit(b.create_volume(env.request("bad", MIB, pairs(&[("pool", &env.pool)]), None), s.clone()).await);
    assert!(matches!(&e, WitError::InvalidArgument(m) if m.contains("clusterID")), "{e:?}");
    let e = wit(b.get_capacity(vec![], pairs(&[("clusterID", CLUSTER)]), None).await);
    assert!(matches!(&e, WitError::InvalidArgument(m) if m.contains("pool")), "{e:?}");
    let rwx = VolumeCapability { access_mode: AccessMode::MultiNodeMultiWriter, ..mount() };
    let mut r = env.request("bad", MIB, env.params(&[]), None);
    r.capabilities = vec![rwx];
    assert!(matches!(wit(b.create_volume(r, s.clone()).await), WitError::InvalidArgument(_)));
    assert!(env.images().is_empty(), "nothing created: {:?}", env.images());

    // Pools and clusters the operator did not grant, and a data pool outside the grant.
    env.ceph.create_pool("shim-other").unwrap();
    for params in [
        pairs(&[("clusterID", CLUSTER), ("pool", "shim-other")]),
        pairs(&[("clusterID", "elsewhere"), ("pool", &env.pool)]),
        env.params(&[("dataPool", "shim-other")]),
    ] {
        let e = wit(b.create_volume(env.request("bad", MIB, params, None), s.clone()).await);
        assert!(matches!(e, WitError::PermissionDenied(_)), "{e:?}");
        errors.push(format!("{e:?}"));
    }

    // Secrets: none, half a pair, a wrong key (cephx refuses it), a user limited to another pool.
    let mut r = env.request("bad", MIB, env.params(&[]), None);
    r.secrets = vec![];
    let e = wit(b.create_volume(r, vec![]).await);
    assert!(matches!(&e, WitError::InvalidArgument(m) if m.contains("userID")), "{e:?}");
    let half: Secrets = vec![("userID".into(), format!("csi-{}", env.pool))];
    let mut r = env.request("bad", MIB, env.params(&[]), None);
    r.secrets = secret_refs(&half);
    let e = wit(b.create_volume(r, half).await);
    assert!(matches!(&e, WitError::InvalidArgument(m) if m.contains("userKey")), "{e:?}");
    let wrong_key = "AQBnBwFnAAAAABAAzlZ6nYv8w3G0fLrYL0aoNg==";
    let wrong: Secrets = vec![("userID".into(), format!("csi-{}", env.pool)), ("userKey".into(), wrong_key.into())];
    let mut r = env.request("bad", MIB, env.params(&[]), None);
    r.secrets = secret_refs(&wrong);
    let e = wit(b.create_volume(r, wrong).await);
    assert!(matches!(e, WitError::PermissionDenied(_)), "{e:?}");
    assert!(!format!("{e:?}").contains(wrong_key), "{e:?}");
    let other_key = env.ceph.create_user("csi-other", "shim-other").unwrap();
    let other: Secrets = vec![("userID".into(), "csi-other".into()), ("userKey".into(), other_key.clone())];
    let mut r = env.request("bad", MIB, env.params(&[]), None);
    r.secrets = secret_refs(&other);
    let e = wit(b.create_volume(r, other).await);
    assert!(matches!(e, WitError::PermissionDenied(_)), "{e:?}");
    assert!(!format!("{e:?}").contains(&other_key), "{e:?}");
    errors.push(format!("{e:?}"));
    assert!(env.images().is_empty(), "nothing created: {:?}", env.images());

    // The admin pair works too (ceph-csi accepts it for provisioning).
    let admin: Secrets = vec![("adminID".into(), "admin".into()), ("adminKey".into(), env.ceph.admin_key().into())];
    let mut r = env.request("by-admin", MIB, env.params(&[]), None);
    r.secrets = secret_refs(&admin);
    let v = b.create_volume(r, admin.clone()).await.unwrap();
    b.delete_volume(v.volume_id, admin).await.unwrap();

    // Unknown ids: delete succeeds, the rest is not-found.
    let unknown = format!("{CLUSTER}.{}.csi-vol-0123456789abcdef", env.pool);
    b.delete_volume(unknown.clone(), s.clone()).await.unwrap();
    b.delete_snapshot(format!("{unknown}.0123456789abcdef"), s.clone()).await.unwrap();
    assert!(matches!(wit(b.get_volume(unknown.clone()).await), WitError::NotFound(_)));
    assert!(matches!(
        wit(b.create_snapshot("s".into(), unknown.clone(), vec![], s.clone()).await),
        WitError::NotFound(_)
    ));
    assert!(matches!(
        wit(b.validate_volume_capabilities("nope".into(), vec![], vec![mount()], vec![]).await),
        WitError::NotFound(_)
    ));
    for e in &errors {
        env.no_key_in(e);
    }
    env.no_key_in_logs();
}

/// A backend built against 0.2.0, whose `rbd` import took `(cluster, pool, …, secrets)` in every
/// function, still creates, expands, snapshots and deletes real images through the 0.3.0 host
/// (its calls reach the same pool with the same credentials), and its plan reaches the node as
/// before (no encryption asked for).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0_2_backend_drives_rbd_through_the_current_host() {
    let Some(env) = setup_backend("rbd-v0-2", wasmcsi_artifacts::RBD_V0_2, "shim-v0-2", "").await else { return };
    let b = &env.backend;
    let s = &env.secrets;
    assert_eq!(b.contract, wasmcsi_runtime::contract::ContractVersion::V0_2);

    let v = b.create_volume(env.request("old-1", 4 * MIB, env.params(&[]), None), s.clone()).await.unwrap();
    assert_eq!(v.volume_id, format!("{CLUSTER}.{}.v-old-1", env.pool));
    assert_eq!(env.images(), ["v-old-1"]);
    let meta = env.ceph.rbd(&["image-meta", "get", &format!("{}/v-old-1", env.pool), "fixture/name"]).unwrap();
    assert_eq!(meta.trim(), "old-1", "the metadata pairs reached the image");
    let again = b.create_volume(env.request("old-1", 4 * MIB, env.params(&[]), None), s.clone()).await.unwrap();
    assert_eq!(
        (again.volume_id, again.capacity_bytes),
        (v.volume_id.clone(), v.capacity_bytes),
        "info through the old shape finds the image"
    );

    let e = b.expand_volume(
        v.volume_id.clone(),
        CapacityRange { required_bytes: 8 * MIB, limit_bytes: 0 },
        None,
        s.clone(),
    );
    assert_eq!(e.await.unwrap().capacity_bytes, 8 * MIB);
    let cli: serde_json::Value =
        serde_json::from_str(&env.ceph.rbd(&["info", &format!("{}/v-old-1", env.pool), "--format", "json"]).unwrap())
            .unwrap();
    assert_eq!(cli["size"], 8 * MIB);

    let snap = b.create_snapshot("s1".into(), v.volume_id.clone(), vec![], s.clone()).await.unwrap();
    assert_eq!(snap.snapshot_id, format!("{}@s1", v.volume_id));
    assert_eq!(snap.size_bytes, 8 * MIB);
    let snaps = env.ceph.rbd(&["snap", "ls", &format!("{}/v-old-1", env.pool)]).unwrap();
    assert!(snaps.contains("s1"), "{snaps}");

    match b.attach_plan(v.volume_id.clone(), vec![], mount(), vec![]).await.unwrap() {
        Attachment::Rbd(plan) => {
            assert_eq!(
                (plan.cluster.as_str(), plan.pool.as_str(), plan.image.as_str()),
                (CLUSTER, env.pool.as_str(), "v-old-1")
            );
            assert!(plan.encryption.is_none(), "a 0.2.0 plan asks for no encryption");
        }
        other => panic!("expected an rbd plan, got {other:?}"),
    }

    // A pool the grant does not name is refused through the old shape as through the new.
    let other = env.params(&[("pool", "not-granted")]);
    let refused = wit(b.create_volume(env.request("old-2", 4 * MIB, other, None), s.clone()).await);
    assert!(matches!(refused, WitError::PermissionDenied(_)), "{refused:?}");

    b.delete_snapshot(snap.snapshot_id.clone(), s.clone()).await.unwrap();
    b.delete_volume(v.volume_id.clone(), s.clone()).await.unwrap();
    assert!(env.images().is_empty());
    env.no_key_in_logs();
}

/// VolumeGroupSnapshots through the backend (RBD group snapshots): three volumes, one writer
/// writing one numbered sequence round-robin over them through its own librbd client (`n` to
/// volume `n % 3`, block `n / 3`; `n + 1` only once `n` was acknowledged), group snapshots
/// taken meanwhile, and every group restored member by member through CreateVolume (a copy in
/// the host's background: UNAVAILABLE with the progress until done, retried as the CO would):
/// each must hold exactly the writes `0..k` of the sequence for some `k`. No write may fail.
/// Then a retry, delete, and the refusals (another pool or cluster).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_snapshots_are_one_point_of_a_dependent_writer_and_restore_through_create_volume() {
    let Some(env) = setup("shim-group", "").await else { return };
    let b = &env.backend;
    let s = &env.secrets;
    let mut ids = Vec::new();
    for n in ["vol-a", "vol-b", "vol-c"] {
        ids.push(b.create_volume(env.request(n, 4 * MIB, env.params(&[]), None), s.clone()).await.unwrap().volume_id);
    }
    let images: Vec<String> = ids.iter().map(|v| image_of(v)).collect();

    const BLOCK: u64 = 4096;
    const MAGIC: &[u8; 8] = b"wasmcsi!";
    // The writer: another librbd client (its own connection), as a node would be.
    let writer_pool =
        RbdClient::new(env.ceph.config(&[&env.pool])).pool(CLUSTER, &env.pool, &env.ceph.admin()).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (stop, images) = (stop.clone(), images.clone());
        tokio::spawn(async move {
            let (mut n, mut failed) = (0u64, Vec::<String>::new());
            'writes: while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut buf = vec![0u8; BLOCK as usize];
                buf[..8].copy_from_slice(MAGIC);
                buf[8..16].copy_from_slice(&n.to_le_bytes());
                while let Err(e) = writer_pool.write(&images[(n % 3) as usize], (n / 3) * BLOCK, &buf).await {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break 'writes;
                    }
                    failed.push(format!("write {n}: {e}"));
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                n += 1;
            }
            (n, failed)
        })
    };

    tokio::time::sleep(Duration::from_millis(300)).await;
    let sources = ids.clone();
    let mut groups = Vec::new();
    let mut lat = Vec::new();
    for k in 0..5 {
        let t = Instant::now();
        let g = b.create_group_snapshot(format!("vgs-{k}"), sources.clone(), vec![], s.clone()).await.unwrap();
        lat.push(t.elapsed());
        assert!(g.ready_to_use && g.snapshots.len() == 3, "{g:?}");
        assert_eq!(g.snapshots.iter().map(|x| x.source_volume_id.clone()).collect::<Vec<_>>(), sources);
        groups.push(g);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (written, failed) = writer.await.unwrap();
    let logged = String::from_utf8_lossy(&logs().lock().unwrap()).into_owned();
    let mut pauses: Vec<f64> = logged
        .lines()
        .filter(|l| l.contains("group snapshot taken; writes were held") && l.contains("shim-group"))
        .filter_map(|l| l.split("pause_ms=").nth(1)?.split_whitespace().next()?.parse().ok())
        .collect();
    pauses.sort_by(f64::total_cmp);
    eprintln!(
        "CreateVolumeGroupSnapshot of 3 volumes p50 {:?}; writes held (ms) {pauses:?}, median {:?}; \
         {written} writes, {} refused attempts retried: {:?}",
        p50(lat),
        pauses.get(pauses.len() / 2),
        failed.len(),
        failed.iter().take(3).collect::<Vec<_>>()
    );
    assert_eq!(pauses.len(), 5, "one pause logged per group snapshot");

    assert!(failed.is_empty(), "writers wait for a group snapshot, they do not fail: {failed:?}");
    // Restore every member through CreateVolume and read the records back.
    let mut prefixes = Vec::new();
    let mut retries = 0;
    for (k, g) in groups.iter().enumerate() {
        let mut seen = Vec::new();
        for (i, member) in g.snapshots.iter().enumerate() {
            let source = Some(ContentSource::Snapshot(member.snapshot_id.clone()));
            let req = || env.request(&format!("restore-{k}-{i}"), 0, env.params(&[]), source.clone());
            let deadline = Instant::now() + Duration::from_secs(120);
            let r = loop {
                match b.create_volume(req(), s.clone()).await {
                    Ok(v) => break v,
                    Err(e) => match wit(Err::<(), _>(e)) {
                        WitError::Unavailable(m) if m.contains("copied; retry") => {
                            assert!(Instant::now() < deadline, "restore-{k}-{i} still copying after 120 s: {m}");
                            retries += 1;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        e => panic!("restore: {e:?}"),
                    },
                }
            };
            let blocks = written.div_ceil(3) + 1;
            let data = env.admin.read(&image_of(&r.volume_id), 0, (blocks * BLOCK) as usize).await.unwrap();
            for (j, block) in data.chunks(BLOCK as usize).enumerate() {
                if &block[..8] != MAGIC {
                    continue;
                }
                let n = u64::from_le_bytes(block[8..16].try_into().unwrap());
                assert_eq!(n, j as u64 * 3 + i as u64, "record {n} in the wrong place (volume {i} block {j})");
                seen.push(n);
            }
            b.delete_volume(r.volume_id, s.clone()).await.unwrap();
        }
        seen.sort_unstable();
        let len = seen.len() as u64;
        assert_eq!(seen, (0..len).collect::<Vec<_>>(), "group snapshot {k} is not a prefix of the writes");
        prefixes.push(len);
    }
    eprintln!(
        "writes held by the 5 group snapshots: {prefixes:?} (of {written}); {retries} CreateVolume retries while copying"
    );
    assert!(prefixes.windows(2).all(|w| w[0] <= w[1]) && prefixes[4] > prefixes[0], "{prefixes:?}");

    // A retry is the same group; Get finds it by id; a member is an ordinary snapshot.
    let again = b.create_group_snapshot("vgs-0".into(), sources.clone(), vec![], s.clone()).await.unwrap();
    let ids_of = |g: &wasmcsi_runtime::driver::GroupSnapshot| {
        (g.group_snapshot_id.clone(), g.snapshots.iter().map(|x| x.snapshot_id.clone()).collect::<Vec<_>>())
    };
    assert_eq!(ids_of(&again), ids_of(&groups[0]));
    assert_eq!(
        (again.creation_time.seconds, again.creation_time.nanos),
        (groups[0].creation_time.seconds, groups[0].creation_time.nanos)
    );
    let member_ids: Vec<String> = groups[0].snapshots.iter().map(|x| x.snapshot_id.clone()).collect();
    let got = b.get_group_snapshot(groups[0].group_snapshot_id.clone(), member_ids.clone(), s.clone()).await.unwrap();
    assert_eq!(got.snapshots.len(), 3);
    let listed = b.list_snapshots(Some(member_ids[0].clone()), None, 0, String::new()).await.unwrap();
    assert_eq!(listed.entries.len(), 1);
    let e = wit(b.create_group_snapshot("vgs-0".into(), sources[..2].to_vec(), vec![], s.clone()).await);
    assert!(matches!(e, WitError::AlreadyExists(_)), "{e:?}");

    // Delete removes every member's RBD snapshot.
    for g in &groups {
        b.delete_group_snapshot(g.group_snapshot_id.clone(), vec![], s.clone()).await.unwrap();
    }
    b.delete_group_snapshot(groups[0].group_snapshot_id.clone(), vec![], s.clone()).await.unwrap();
    for i in &images {
        assert_eq!(env.admin.snapshot_list(i).await.unwrap(), vec![], "{i}");
    }
    assert!(matches!(
        wit(b.get_group_snapshot(groups[0].group_snapshot_id.clone(), vec![], s.clone()).await),
        WitError::NotFound(_)
    ));

    // Refused: a volume of another pool or cluster (an RBD group snapshot is of one pool).
    for other in [format!("{CLUSTER}.elsewhere.{}", images[0]), format!("other-cluster.{}.{}", env.pool, images[0])] {
        let e =
            wit(b.create_group_snapshot("vgs-x".into(), vec![ids[1].clone(), other.clone()], vec![], s.clone()).await);
        assert!(matches!(&e, WitError::InvalidArgument(m) if m.contains(&other)), "{e:?}");
    }
    assert_eq!(env.admin.snapshot_list(&images[0]).await.unwrap(), vec![], "nothing taken");
    for id in ids {
        b.delete_volume(id, s.clone()).await.unwrap();
    }
    assert_eq!(env.images(), Vec::<String>::new());
    env.no_key_in_logs();
}
