//! Components built against the previous contract, `wasmcsi:backend@0.1.0`, in a real runtime:
//! the hostpath example as it shipped for 0.1.0 loads beside a current (0.3.0) backend and answers every
//! typed entry point in the current types (GetSnapshot from its snapshot list); it is refused
//! for an ungranted import and stopped by the call limits exactly like a current backend; and a
//! 0.1.0 component importing `block` is refused whatever was granted.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::path::Path;
use std::sync::Arc;
use wasmcsi_runtime::bindings::types::{AccessMode, AccessType, ContentSource, MountVolume, VolumeCapability};
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::driver::{Attachment, CapacityRange, CreateVolumeRequest, Feature};
use wasmcsi_runtime::wasm_engine::WasmEngineSettings;
use wasmcsi_runtime::{CallError, ContractVersion, LoadError, Runtime, RuntimeOptions, WitError};

fn runtime(dir: &Path) -> Arc<Runtime> {
    for root in ["old", "new"] {
        std::fs::create_dir_all(dir.join(root)).unwrap();
    }
    let text = format!(
        "[backends.hostpath-v0-1.grants]\ndir = {{ default = \"{0}/old\" }}\n\
         [backends.hostpath.grants]\ndir = {{ default = \"{0}/new\" }}\n\
         [backends.block-v0-1.grants.block]\nnodes = [\"127.0.0.1:9\"]\n",
        dir.display()
    );
    Runtime::new(RuntimeOptions {
        config: HostConfig::parse(&text, Path::new("test")).unwrap(),
        cache_dir: None,
        store_path: dir.join("state/meta.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 16, max_memory_bytes: 256 << 20 },
    })
    .unwrap()
}

fn mount() -> VolumeCapability {
    VolumeCapability {
        access_type: AccessType::Mount(MountVolume { fs_type: String::new(), mount_flags: vec![] }),
        access_mode: AccessMode::SingleNodeWriter,
    }
}

fn request(name: &str) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity: CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 },
        capabilities: vec![mount()],
        parameters: vec![],
        secrets: vec![],
        content_source: None,
        accessibility: None,
        mutable_parameters: vec![],
    }
}

fn is_not_found<T: std::fmt::Debug>(r: &Result<T, CallError>) -> bool {
    matches!(r, Err(CallError::Backend { error: WitError::NotFound(_), .. }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0_1_backend_serves_every_entry_point_beside_a_current_one() {
    let d = tempfile::tempdir().unwrap();
    let rt = runtime(d.path());
    let old = rt.load("hostpath-v0-1", wasmcsi_artifacts::HOSTPATH_V0_1, None).await.unwrap();
    let new = rt.load("hostpath", wasmcsi_artifacts::HOSTPATH, None).await.unwrap();
    assert_eq!((old.contract, new.contract), (ContractVersion::V0_1, ContractVersion::CURRENT));
    assert_eq!(old.info.name, "hostpath");
    // It lists snapshots, so the host answers GetSnapshot for it; it can never self-heal.
    assert!(old.has_feature(Feature::ListSnapshots) && old.has_feature(Feature::GetSnapshot), "{:?}", old.info);
    assert!(!old.has_feature(Feature::SelfHealing));

    let v = old.create_volume(request("pvc-1"), vec![]).await.unwrap();
    assert_eq!((v.volume_id.as_str(), v.capacity_bytes), ("default.pvc-1", 1 << 20));
    assert!(d.path().join("old/volumes/pvc-1").is_dir(), "created through dir@0.1.0");
    assert!(!d.path().join("new/volumes/pvc-1").exists());
    let grown = old
        .expand_volume(v.volume_id.clone(), CapacityRange { required_bytes: 2 << 20, limit_bytes: 0 }, None, vec![])
        .await
        .unwrap();
    assert_eq!(grown.capacity_bytes, 2 << 20);
    assert_eq!(old.get_volume(v.volume_id.clone()).await.unwrap().volume.capacity_bytes, 2 << 20);
    let page = old.list_volumes(0, String::new()).await.unwrap();
    assert_eq!(page.entries.iter().map(|e| e.volume.volume_id.as_str()).collect::<Vec<_>>(), ["default.pvc-1"]);
    assert_eq!(
        old.validate_volume_capabilities(v.volume_id.clone(), vec![], vec![mount()], vec![]).await.unwrap(),
        None
    );
    assert!(old.get_capacity(vec![mount()], vec![], None).await.unwrap().available_bytes > 0);
    match old.attach_plan(v.volume_id.clone(), vec![], mount(), vec![]).await.unwrap() {
        Attachment::Bind(plan) => assert_eq!((plan.root.as_str(), plan.path.as_str()), ("default", "volumes/pvc-1")),
        other => panic!("hostpath plans a bind mount, got {other:?}"),
    }
    // reconcile-volume, which 0.1.0 does not have: what a current backend that does not
    // self-heal answers.
    let e = old
        .reconcile_volume(v.volume_id.clone(), wasmcsi_runtime::bindings::types::Timestamp { seconds: 0, nanos: 0 })
        .await
        .unwrap_err();
    assert!(matches!(&e, CallError::Backend { error: WitError::Unimplemented(m), .. } if m.contains("0.1.0")), "{e}");

    // GetSnapshot, which 0.1.0 does not have, from its snapshot list.
    let s1 = old.create_snapshot("snap-1".into(), v.volume_id.clone(), vec![], vec![]).await.unwrap();
    let s2 = old.create_snapshot("snap-2".into(), v.volume_id.clone(), vec![], vec![]).await.unwrap();
    for s in [&s1, &s2] {
        let found = old.get_snapshot(s.snapshot_id.clone()).await.unwrap();
        assert_eq!(format!("{found:?}"), format!("{s:?}"));
    }
    assert!(is_not_found(&old.get_snapshot("default.snap-3".into()).await));
    assert!(is_not_found(&old.get_snapshot("not-a-hostpath-id".into()).await));
    old.delete_snapshot(s1.snapshot_id.clone(), vec![]).await.unwrap();
    assert!(is_not_found(&old.get_snapshot(s1.snapshot_id.clone()).await));
    assert_eq!(old.get_snapshot(s2.snapshot_id.clone()).await.unwrap().snapshot_id, s2.snapshot_id);
    let listed = old.list_snapshots(None, Some(v.volume_id.clone()), 0, String::new()).await.unwrap();
    assert_eq!(listed.entries.iter().map(|s| s.snapshot_id.as_str()).collect::<Vec<_>>(), [s2.snapshot_id.as_str()]);

    // A clone from the snapshot, then everything gone again.
    let mut clone = request("pvc-2");
    clone.content_source = Some(ContentSource::Snapshot(s2.snapshot_id.clone()));
    assert_eq!(old.create_volume(clone, vec![]).await.unwrap().volume_id, "default.pvc-2");
    old.delete_snapshot(s2.snapshot_id.clone(), vec![]).await.unwrap();
    for id in ["default.pvc-1", "default.pvc-2"] {
        old.delete_volume(id.into(), vec![]).await.unwrap();
        assert!(is_not_found(&old.get_volume(id.into()).await));
    }

    // The current backend in the same runtime is untouched by all of it, and serves its own.
    assert!(new.list_volumes(0, String::new()).await.unwrap().entries.is_empty());
    let v = new.create_volume(request("pvc-1"), vec![]).await.unwrap();
    assert!(d.path().join("new/volumes/pvc-1").is_dir());
    new.delete_volume(v.volume_id, vec![]).await.unwrap();
}

/// The refusal an operator sees for a backend that imports `dir` without a grant: the same for a
/// 0.1.0 and a current build of one backend, word for word (the name aside).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ungranted_import_refuses_a_0_1_backend_as_it_refuses_a_0_2_one() {
    let d = tempfile::tempdir().unwrap();
    let rt = Runtime::new(RuntimeOptions {
        config: HostConfig::parse("", Path::new("test")).unwrap(),
        cache_dir: None,
        store_path: d.path().join("state/meta.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 16, max_memory_bytes: 256 << 20 },
    })
    .unwrap();
    let mut refusals = vec![];
    for (name, wasm) in [("hostpath-v0-1", wasmcsi_artifacts::HOSTPATH_V0_1), ("hostpath", wasmcsi_artifacts::HOSTPATH)]
    {
        match rt.load(name, wasm, None).await.err() {
            Some(e @ LoadError::NotGranted { .. }) => refusals.push(e.to_string().replacen(name, "NAME", 1)),
            other => panic!("{name}: expected a refusal for its ungranted dir import, got {other:?}"),
        }
    }
    assert_eq!(refusals[0], refusals[1]);
    assert!(refusals[0].contains("import wasmcsi:backend/dir is not granted"), "{}", refusals[0]);
}

/// Every bound of a call holds for a 0.1.0 backend as for a current one: each is loaded with
/// an instruction budget and then a memory cap too small for `info`, and is stopped the same
/// way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0_1_backend_is_stopped_by_the_limits_that_stop_a_0_2_one() {
    let d = tempfile::tempdir().unwrap();
    for (limit, expect) in [("fuel = 1000", "out-of-fuel"), ("memory_limit_mib = 1", "out-of-memory")] {
        let text = format!(
            "[backends.hostpath-v0-1]\n{limit}\n[backends.hostpath-v0-1.grants]\ndir = {{ default = \"{0}\" }}\n\
             [backends.hostpath]\n{limit}\n[backends.hostpath.grants]\ndir = {{ default = \"{0}\" }}\n",
            d.path().display()
        );
        let rt = Runtime::new(RuntimeOptions {
            config: HostConfig::parse(&text, Path::new("test")).unwrap(),
            cache_dir: None,
            store_path: d.path().join(format!("state-{expect}/meta.redb")),
            wasm_engine: WasmEngineSettings { max_instances: 16, max_memory_bytes: 256 << 20 },
        })
        .unwrap();
        for (name, wasm) in
            [("hostpath-v0-1", wasmcsi_artifacts::HOSTPATH_V0_1), ("hostpath", wasmcsi_artifacts::HOSTPATH)]
        {
            match rt.load(name, wasm, None).await.err() {
                Some(LoadError::Info { source, .. }) => {
                    assert_eq!(source.kind(), expect, "{name} with {limit}: {source}")
                }
                other => panic!("{name} with {limit}: expected info() to be stopped, got {other:?}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0_1_backend_importing_block_is_refused_naming_the_version_block_needs() {
    let d = tempfile::tempdir().unwrap();
    let rt = runtime(d.path());
    let (imports, exports) = rt.inspect("block-v0-1", wasmcsi_artifacts::BLOCK_V0_1).unwrap();
    assert_eq!(ContractVersion::detect(&imports.wasmcsi, &exports), Ok(ContractVersion::V0_1));
    assert!(imports.wasmcsi.iter().any(|i| i == "wasmcsi:backend/block@0.1.0"), "{imports:?}");
    // Granted block (see `runtime`) and still refused: 0.1.0's block has no provider.
    let e = rt.load("block-v0-1", wasmcsi_artifacts::BLOCK_V0_1, None).await.err();
    match e {
        Some(LoadError::NotGranted { violations, .. }) => {
            assert_eq!(violations.len(), 1, "{violations:?}");
            let v = &violations[0];
            assert!(v.contains("wasmcsi:backend/block@0.1.0") && v.contains("needs wasmcsi:backend@0.2.0"), "{v}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}
