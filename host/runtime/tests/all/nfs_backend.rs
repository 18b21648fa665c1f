//! The nfs backend component (`wasmcsi_artifacts::NFS`) loaded into a real `Runtime` and driven
//! through its exports against a real nfs-ganesha (`wasmcsi_ganesha::Ganesha`, in a private
//! namespace; needs root and the packages `scripts/nfs-setup` installs). Results are checked on
//! the server's side of the export, behind the protocol.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::path::Path;
use std::sync::Arc;

use wasmcsi_ganesha::Ganesha;
use wasmcsi_runtime::bindings::types::{AccessMode, AccessType, MountVolume};
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::driver::{Attachment, CapacityRange, ContentSource, CreateVolumeRequest, Pair, VolumeCapability};
use wasmcsi_runtime::wasm_engine::WasmEngineSettings;
use wasmcsi_runtime::{Backend, CallError, Runtime, RuntimeOptions, WitError};

const MIB: u64 = 1 << 20;

fn runtime(dir: &Path, g: &Ganesha) -> Arc<Runtime> {
    let text = format!(
        "[runtime]\ncall_deadline_ms = 60000\nimport_timeout_ms = 10000\n\
         [backends.nfs]\ncall_deadline_ms = 60000\n\
         [backends.nfs.grants]\nnfs = [{{ server = {:?}, share = \"/export\" }}]\n",
        g.server()
    );
    Runtime::new(RuntimeOptions {
        config: HostConfig::parse(&text, Path::new("test")).unwrap(),
        cache_dir: Some(dir.join("cache")),
        store_path: dir.join("state/meta.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 16, max_memory_bytes: 256 << 20 },
    })
    .unwrap()
}

fn pairs(kv: &[(&str, &str)]) -> Vec<Pair> {
    kv.iter().map(|(k, v)| Pair { key: (*k).into(), value: (*v).into() }).collect()
}

fn request(name: &str, bytes: u64, params: Vec<Pair>, source: Option<ContentSource>) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity: CapacityRange { required_bytes: bytes, limit_bytes: 0 },
        capabilities: vec![mount()],
        parameters: params,
        secrets: vec![],
        content_source: source,
        accessibility: None,
        mutable_parameters: vec![],
    }
}

fn mount() -> VolumeCapability {
    VolumeCapability {
        access_type: AccessType::Mount(MountVolume { fs_type: String::new(), mount_flags: vec![] }),
        access_mode: AccessMode::MultiNodeMultiWriter,
    }
}

fn wit(r: Result<impl std::fmt::Debug, CallError>) -> WitError {
    match r {
        Err(CallError::Backend { error, .. }) => error,
        other => panic!("expected a backend error, got {other:?}"),
    }
}

fn base(g: &Ganesha, extra: &[(&str, &str)]) -> Vec<Pair> {
    let server = g.server();
    let mut kv = vec![("server", server.as_str()), ("share", "/export")];
    kv.extend_from_slice(extra);
    pairs(&kv)
}

async fn load(rt: &Runtime) -> Arc<Backend> {
    rt.load("nfs", wasmcsi_artifacts::NFS, None).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nfs_backend_provisions_snapshots_clones_and_deletes_on_ganesha() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: not root (ganesha runs in a private namespace)");
        return;
    }
    let g = Ganesha::start().expect("start ganesha (root and scripts/nfs-setup needed)");
    let tmp = tempfile::tempdir().unwrap();
    let rt = runtime(tmp.path(), &g);
    let b = load(&rt).await;
    let export = g.export_dir();
    assert_eq!(b.info.name, "nfs");

    // Create, twice (idempotent), then with another size (already-exists).
    let params = base(
        &g,
        &[("mountOptions", "nfsvers=4.1,hard"), ("mountPermissions", "0775"), ("uid", "1000"), ("gid", "1000")],
    );
    let v1 = b.create_volume(request("pvc-1", MIB, params.clone(), None), vec![]).await.unwrap();
    assert_eq!(v1.volume_id, format!("{}_export_pvc-1", g.server()));
    assert_eq!(v1.capacity_bytes, MIB);
    let dir1 = export.join("pvc-1");
    assert!(dir1.is_dir());
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let m = std::fs::metadata(&dir1).unwrap();
        assert_eq!((m.permissions().mode() & 0o7777, m.uid(), m.gid()), (0o775, 1000, 1000));
    }
    assert!(std::fs::read_to_string(dir1.join(".wasmcsi-volume")).unwrap().contains("capacity=1048576"));
    let again = b.create_volume(request("pvc-1", MIB, params.clone(), None), vec![]).await.unwrap();
    assert_eq!(again.volume_id, v1.volume_id);
    let e = wit(b.create_volume(request("pvc-1", 2 * MIB, params.clone(), None), vec![]).await);
    assert!(matches!(e, WitError::AlreadyExists(_)), "{e:?}");
    std::fs::write(dir1.join("data.txt"), b"hello nfs").unwrap();

    // Expand: the metadata records the new size.
    let x =
        b.expand_volume(v1.volume_id.clone(), CapacityRange { required_bytes: 4 * MIB, limit_bytes: 0 }, None, vec![]);
    assert_eq!(x.await.unwrap().capacity_bytes, 4 * MIB);
    assert!(std::fs::read_to_string(dir1.join(".wasmcsi-volume")).unwrap().contains("capacity=4194304"));
    let st = b.get_volume(v1.volume_id.clone()).await.unwrap();
    assert_eq!(st.volume.capacity_bytes, 4 * MIB);
    assert!(!st.condition.unwrap().abnormal);

    // Capacity: the export's free space.
    let cap = b.get_capacity(vec![mount()], base(&g, &[]), None).await.unwrap();
    assert!(cap.available_bytes > 0);

    // Snapshot: a server-side copy; same name + source again returns it.
    let s = b.create_snapshot("snap-1".into(), v1.volume_id.clone(), vec![], vec![]).await.unwrap();
    assert_eq!(s.source_volume_id, v1.volume_id);
    assert_eq!(s.size_bytes, 4 * MIB);
    assert!(s.ready_to_use);
    assert_eq!(std::fs::read(export.join(".snapshots/snap-1/data/data.txt")).unwrap(), b"hello nfs");
    let s2 = b.create_snapshot("snap-1".into(), v1.volume_id.clone(), vec![], vec![]).await.unwrap();
    assert_eq!(s2.snapshot_id, s.snapshot_id);
    let all = b.list_snapshots(None, None, 0, String::new()).await.unwrap();
    assert_eq!(all.entries.iter().map(|s| s.snapshot_id.as_str()).collect::<Vec<_>>(), [s.snapshot_id.as_str()]);
    let by_vol = b.list_snapshots(None, Some(v1.volume_id.clone()), 0, String::new()).await.unwrap();
    assert_eq!(by_vol.entries.len(), 1);
    let by_id = b.list_snapshots(Some(s.snapshot_id.clone()), None, 0, String::new()).await.unwrap();
    assert_eq!(by_id.entries.len(), 1);
    let unknown = b.list_snapshots(Some(format!("{}_export_nope", g.server())), None, 0, String::new()).await.unwrap();
    assert!(unknown.entries.is_empty());

    // From the snapshot (retained on delete) and from the volume (archived on delete, templated
    // subDir): the content is there.
    let retain = base(&g, &[("onDelete", "retain")]);
    let v2 =
        b.create_volume(request("pvc-2", MIB, retain, Some(ContentSource::Snapshot(s.snapshot_id.clone()))), vec![]);
    let v2 = v2.await.unwrap();
    assert!(matches!(&v2.content_source, Some(ContentSource::Snapshot(id)) if *id == s.snapshot_id));
    assert_eq!(std::fs::read(export.join("pvc-2/data.txt")).unwrap(), b"hello nfs");
    let archive = base(
        &g,
        &[
            ("onDelete", "archive"),
            ("subDir", "${pvc.namespace}/${pvc.name}"),
            ("csi.storage.k8s.io/pvc/name", "data"),
            ("csi.storage.k8s.io/pvc/namespace", "team-a"),
        ],
    );
    let v3 = b.create_volume(request("pvc-3", MIB, archive, Some(ContentSource::Volume(v1.volume_id.clone()))), vec![]);
    let v3 = v3.await.unwrap();
    assert_eq!(std::fs::read(export.join("team-a/data/data.txt")).unwrap(), b"hello nfs");

    // Attach plan: from the volume context, and from the metadata when the context is empty.
    let plan = b.attach_plan(v1.volume_id.clone(), v1.volume_context.clone(), mount(), vec![]).await.unwrap();
    let Attachment::Nfs(p) = plan else { panic!("not an nfs plan: {plan:?}") };
    assert_eq!((p.server.as_str(), p.share.as_str(), p.path.as_str()), (g.server().as_str(), "/export", "pvc-1"));
    assert_eq!(p.mount_options, ["nfsvers=4.1", "hard"]);
    let Attachment::Nfs(p3) = b.attach_plan(v3.volume_id.clone(), vec![], mount(), vec![]).await.unwrap() else {
        panic!()
    };
    assert_eq!(p3.path, "team-a/data");
    let block = VolumeCapability { access_type: AccessType::Block, access_mode: AccessMode::SingleNodeWriter };
    let e = wit(b.attach_plan(v1.volume_id.clone(), vec![], block, vec![]).await);
    assert!(matches!(e, WitError::FailedPrecondition(_)), "{e:?}");

    // Delete: a volume with snapshots goes (snapshots are independent copies); retain keeps
    // the directory, archive renames it; a second delete succeeds.
    b.delete_volume(v1.volume_id.clone(), vec![]).await.unwrap();
    assert!(!dir1.exists());
    assert!(export.join(".snapshots/snap-1/data/data.txt").exists());
    b.delete_volume(v2.volume_id.clone(), vec![]).await.unwrap();
    assert!(export.join("pvc-2/data.txt").exists(), "retained");
    b.delete_volume(v3.volume_id.clone(), vec![]).await.unwrap();
    assert!(!export.join("team-a/data").exists());
    assert!(export.join("team-a/archived-data/data.txt").exists(), "archived");
    for id in [&v1.volume_id, &v2.volume_id, &v3.volume_id] {
        b.delete_volume(id.clone(), vec![]).await.unwrap();
        assert!(matches!(wit(b.get_volume(id.clone()).await), WitError::NotFound(_)));
    }
    b.delete_snapshot(s.snapshot_id.clone(), vec![]).await.unwrap();
    b.delete_snapshot(s.snapshot_id.clone(), vec![]).await.unwrap();
    assert!(!export.join(".snapshots/snap-1").exists());
    assert!(b.list_snapshots(None, None, 0, String::new()).await.unwrap().entries.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nfs_backend_rejects_bad_parameters_before_touching_the_export_and_ungranted_shares() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: not root (ganesha runs in a private namespace)");
        return;
    }
    let g = Ganesha::start().expect("start ganesha (root and scripts/nfs-setup needed)");
    let tmp = tempfile::tempdir().unwrap();
    let rt = runtime(tmp.path(), &g);
    let b = load(&rt).await;
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("colour", "red")], "colour"),
        (&[("onDelete", "shred")], "onDelete"),
        (&[("mountPermissions", "rwx")], "mountPermissions"),
        (&[("uid", "-1")], "uid"),
        (&[("subDir", "../escape")], "subDir"),
        (&[("subDir", "${pvc.name}")], "subDir"),
        (&[("subDir", "${pvc.name}"), ("csi.storage.k8s.io/pvc/name", "..")], "subDir"),
        (&[("subDir", "a/${pv.name}/../../x")], "subDir"),
        (&[("subDir", "${nope}")], "subDir"),
    ];
    for (extra, name) in cases {
        let e = wit(b.create_volume(request("pvc-bad", MIB, base(&g, extra), None), vec![]).await);
        assert!(matches!(&e, WitError::InvalidArgument(m) if m.contains(name)), "{extra:?}: {e:?}");
    }
    let long = "a".repeat(256);
    let p = base(&g, &[("subDir", "${pvc.name}"), ("csi.storage.k8s.io/pvc/name", &long)]);
    let e = wit(b.create_volume(request("pvc-bad", MIB, p, None), vec![]).await);
    assert!(matches!(e, WitError::InvalidArgument(_)), "{e:?}");
    let e = wit(b.get_capacity(vec![], pairs(&[("share", "/export")]), None).await);
    assert!(matches!(&e, WitError::InvalidArgument(m) if m.contains("server")), "{e:?}");
    let entries: Vec<_> = std::fs::read_dir(g.export_dir()).unwrap().collect();
    assert!(entries.is_empty(), "nothing touched: {entries:?}");

    // Any CSI name is valid; one with path characters maps to a local name that
    // stays one directory inside the export.
    let v = b.create_volume(request("../pvc", MIB, base(&g, &[]), None), vec![]).await.unwrap();
    let sub = v.volume_context.iter().find(|p| p.key == "subDir").map(|p| p.value.clone()).unwrap();
    assert!(!sub.contains('/') && !sub.starts_with('.'), "{sub:?}");
    b.delete_volume(v.volume_id.clone(), vec![]).await.unwrap();

    // A share the operator did not grant: the host refuses it.
    let server = g.server();
    let other = pairs(&[("server", server.as_str()), ("share", "/elsewhere")]);
    let e = wit(b.create_volume(request("pvc-x", MIB, other.clone(), None), vec![]).await);
    assert!(matches!(e, WitError::PermissionDenied(_)), "{e:?}");
    let e = wit(b.get_capacity(vec![], other, None).await);
    assert!(matches!(e, WitError::PermissionDenied(_)), "{e:?}");
}

/// A copy longer than a call: CreateSnapshot answers `ready_to_use = false` while the host
/// copies and a retry later answers ready; a clone of the volume fails `aborted` until its copy
/// is whole, then succeeds; a snapshot deleted while it copies leaves nothing behind. The copy
/// is held before it is placed (`wasmcsi_nfs::hold_copies`) for as long as the test needs it
/// running: whether 32 MiB take longer than a call depends on the machine, and is not what the
/// host promises.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nfs_backend_copies_big_trees_across_retries() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: not root (ganesha runs in a private namespace)");
        return;
    }
    let g = Ganesha::start().expect("start ganesha (root and scripts/nfs-setup needed)");
    let tmp = tempfile::tempdir().unwrap();
    let text = format!(
        "[runtime]\ncall_deadline_ms = 60000\nimport_timeout_ms = 400\n\
         [backends.nfs]\ncall_deadline_ms = 60000\n\
         [backends.nfs.grants]\nnfs = [{{ server = {:?}, share = \"/export\" }}]\n",
        g.server()
    );
    let rt = Runtime::new(RuntimeOptions {
        config: HostConfig::parse(&text, Path::new("test")).unwrap(),
        cache_dir: Some(tmp.path().join("cache")),
        store_path: tmp.path().join("state/meta.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 16, max_memory_bytes: 256 << 20 },
    })
    .unwrap();
    let b = load(&rt).await;
    let export = g.export_dir();
    let share = wasmcsi_nfs::NfsExport::new(g.server(), "/export");
    let v = b.create_volume(request("big", MIB, base(&g, &[]), None), vec![]).await.unwrap();
    let data: Vec<u8> = (0..32u32 << 20).map(|i| (i % 249) as u8 | 1).collect();
    std::fs::write(export.join("big/blob"), &data).unwrap();
    let patience = std::time::Duration::from_secs(120);

    let hold = wasmcsi_nfs::hold_copies(&share);
    let first = b.create_snapshot("snap-big".into(), v.volume_id.clone(), vec![], vec![]).await.unwrap();
    assert!(!first.ready_to_use, "a copy still running is not ready");
    let listed = b.list_snapshots(Some(first.snapshot_id.clone()), None, 0, String::new()).await.unwrap();
    assert!(!listed.entries[0].ready_to_use, "listed, not ready");
    let retried = b.create_snapshot("snap-big".into(), v.volume_id.clone(), vec![], vec![]).await.unwrap();
    assert!(!retried.ready_to_use, "a retry finds the copy running");
    drop(hold);
    let started = std::time::Instant::now();
    let mut s = retried;
    while !s.ready_to_use {
        assert!(started.elapsed() < patience, "the copy never finished");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        s = b.create_snapshot("snap-big".into(), v.volume_id.clone(), vec![], vec![]).await.unwrap();
    }
    let when = |t: &wasmcsi_runtime::bindings::types::Timestamp| (t.seconds, t.nanos);
    assert_eq!(when(&s.creation_time), when(&first.creation_time), "the cut's time does not move");
    assert_eq!(std::fs::read(export.join(".snapshots/snap-big/data/blob")).unwrap(), data);

    // a clone: aborted while copying, then whole
    let clone_request = || {
        let src = Some(ContentSource::Snapshot(s.snapshot_id.clone()));
        request("big-clone", MIB, base(&g, &[]), src)
    };
    let hold = wasmcsi_nfs::hold_copies(&share);
    let e = wit(b.create_volume(clone_request(), vec![]).await);
    assert!(matches!(&e, WitError::Aborted(m) if m.contains("retry")), "{e:?}");
    drop(hold);
    let started = std::time::Instant::now();
    let clone = loop {
        match b.create_volume(clone_request(), vec![]).await {
            Ok(v) => break v,
            Err(CallError::Backend { error: WitError::Aborted(m), .. }) => {
                assert!(m.contains("retry"), "{m}");
                assert!(started.elapsed() < patience, "the clone never finished");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => panic!("clone: {e:?}"),
        }
    };
    assert_eq!(std::fs::read(export.join("big-clone/blob")).unwrap(), data);
    assert!(!export.join(".wasmcsi/staging/big-clone").exists(), "staging cleaned up");

    // deleted while copying: the copy stops, nothing is left
    let hold = wasmcsi_nfs::hold_copies(&share);
    let t = b.create_snapshot("snap-gone".into(), v.volume_id.clone(), vec![], vec![]).await.unwrap();
    assert!(!t.ready_to_use);
    b.delete_snapshot(t.snapshot_id.clone(), vec![]).await.unwrap();
    assert!(!export.join(".snapshots/snap-gone").exists(), "a snapshot deleted mid-copy leaves nothing");
    // Let go: a copy the delete did not stop would now be placed.
    drop(hold);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!export.join(".snapshots/snap-gone").exists(), "the copy of a deleted snapshot went on");
    for id in [clone.volume_id, v.volume_id] {
        b.delete_volume(id, vec![]).await.unwrap();
    }
    b.delete_snapshot(s.snapshot_id, vec![]).await.unwrap();
}
