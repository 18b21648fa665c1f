//! The `rbd` capability's client against a real Ceph cluster (1 mon, 1 mgr, 2 memstore OSDs),
//! shared by every test of this binary (`wasmcsi_ceph::Ceph::shared`); each test uses
//! its own pool. Needs root and `scripts/ceph-setup` (run automatically when tools are missing).
//! Results are checked behind the client's back with the `rbd` CLI where that says more.
use std::time::{Duration, Instant};
use wasmcsi_ceph::{CLUSTER, Ceph};
use wasmcsi_rbd::{ImageSpec, QosLimits, RbdClient, RbdCredentials, RbdError, RbdPool};

const MIB: u64 = 1 << 20;

fn setup(pool: &str) -> Option<(&'static Ceph, RbdPool)> {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).try_init();
    let ceph = Ceph::shared()?;
    eprintln!("cluster started in {:?}", ceph.started_in());
    let t = Instant::now();
    ceph.create_pool(pool).expect("create pool");
    eprintln!("pool {pool} active+clean in {:?}", t.elapsed());
    let client = RbdClient::new(ceph.config(&[pool]));
    Some((ceph, client.pool(CLUSTER, pool, &ceph.admin()).expect("granted pool")))
}

fn spec(size: u64) -> ImageSpec {
    ImageSpec { size_bytes: size, ..Default::default() }
}

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::test]
async fn create_info_remove_and_their_errors() {
    let Some((ceph, p)) = setup("ops") else { return };
    let s = ImageSpec {
        size_bytes: 64 * MIB,
        features: vec!["layering".into(), "exclusive-lock".into()],
        data_pool: None,
        metadata: vec![("csi.volume.name".into(), "pvc-1".into()), ("empty".into(), String::new())],
    };
    p.create("img", &s).await.expect("create");
    let info = p.info("img").await.expect("info").expect("present");
    assert_eq!(info.size_bytes, 64 * MIB);
    assert_eq!(info.features, ["exclusive-lock", "layering"], "librbd lists them sorted by name");
    assert_eq!(info.parent, None);
    assert_eq!(info.metadata, [("csi.volume.name".into(), "pvc-1".into()), ("empty".into(), String::new())]);
    // Behind the client: the CLI sees the same image.
    let cli: serde_json::Value =
        serde_json::from_str(&ceph.rbd(&["info", "ops/img", "--format", "json"]).expect("rbd info")).expect("json");
    assert_eq!(cli["size"], 64 * MIB);

    assert!(matches!(p.create("img", &spec(MIB)).await, Err(RbdError::AlreadyExists(_))));
    assert_eq!(p.info("nope").await.expect("info"), None);
    let bad_feature = ImageSpec { features: vec!["warp-drive".into()], ..spec(MIB) };
    assert!(matches!(p.create("x", &bad_feature).await, Err(RbdError::InvalidArgument(_))));

    // Default features when none are asked for; a latency sample of create.
    let mut lat = Vec::new();
    for i in 0..9 {
        let t = Instant::now();
        p.create(&format!("d{i}"), &spec(MIB)).await.expect("create default");
        lat.push(t.elapsed());
    }
    eprintln!("create p50 {:?} (max {:?})", p50(lat.clone()), lat.iter().max());
    let t = Instant::now();
    let info = p.info("d0").await.expect("info").expect("present");
    eprintln!("info {:?}", t.elapsed());
    assert!(info.features.contains(&"layering".to_owned()), "{:?}", info.features);

    let mut lat = Vec::new();
    for i in 0..9 {
        let t = Instant::now();
        p.remove(&format!("d{i}")).await.expect("remove");
        lat.push(t.elapsed());
    }
    eprintln!("remove p50 {:?}", p50(lat));
    p.remove("d0").await.expect("absent succeeds");
    p.remove("img").await.expect("remove");
    assert_eq!(p.info("img").await.expect("info"), None);
}

#[tokio::test]
async fn find_by_metadata_resize_and_stats() {
    let Some((_ceph, p)) = setup("meta") else { return };
    for (name, owner) in [("a", "x"), ("b", "y"), ("c", "x")] {
        let s = ImageSpec { metadata: vec![("owner".into(), owner.into())], ..spec(4 * MIB) };
        p.create(name, &s).await.expect("create");
    }
    p.create("plain", &spec(MIB)).await.expect("create without metadata");
    let t = Instant::now();
    assert_eq!(p.find_by_metadata("owner", "x").await.expect("find"), ["a", "c"]);
    eprintln!("find-by-metadata over 4 images {:?}", t.elapsed());
    assert!(p.find_by_metadata("owner", "z").await.expect("find").is_empty());

    p.resize("a", 8 * MIB).await.expect("grow");
    assert_eq!(p.info("a").await.expect("info").expect("a").size_bytes, 8 * MIB);
    p.resize("a", 8 * MIB).await.expect("same size");
    assert!(matches!(p.resize("a", 4 * MIB).await, Err(RbdError::OutOfRange(_))));
    assert!(matches!(p.resize("none", 4 * MIB).await, Err(RbdError::NotFound(_))));

    let s = p.stats().await.expect("stats");
    assert!(s.total_bytes > 0 && s.available_bytes > 0 && s.available_bytes <= s.total_bytes, "{s:?}");
    // Two 1 GiB memstore OSDs, two replicas: at most ~1 GiB usable.
    assert!(s.total_bytes <= 2 << 30, "{s:?}");
}

#[tokio::test]
async fn snapshots_clones_children_and_flatten() {
    let Some((ceph, p)) = setup("snaps") else { return };
    p.create("parent", &spec(8 * MIB)).await.expect("create");
    p.write("parent", 4096, b"parent data").await.expect("write");
    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs() as i64;
    let t = Instant::now();
    let snap = p.snapshot_create("parent", "s1").await.expect("snapshot");
    eprintln!("snapshot-create {:?}", t.elapsed());
    assert_eq!((snap.name.as_str(), snap.size_bytes, snap.protected), ("s1", 8 * MIB, false));
    assert!((snap.created.seconds - before).abs() <= 5, "{snap:?}");
    assert!(matches!(p.snapshot_create("parent", "s1").await, Err(RbdError::AlreadyExists(_))));
    assert!(matches!(p.snapshot_create("none", "s1").await, Err(RbdError::NotFound(_))));

    // Clone without protect (clone v2, mimic compat).
    let t = Instant::now();
    p.clone_image("parent", "s1", "snaps", "child", &["layering".into()]).await.expect("clone");
    eprintln!("clone {:?}", t.elapsed());
    assert!(matches!(p.clone_image("parent", "s1", "snaps", "child", &[]).await, Err(RbdError::AlreadyExists(_))));
    assert!(matches!(p.clone_image("parent", "nosnap", "snaps", "c2", &[]).await, Err(RbdError::NotFound(_))));
    let info = p.info("child").await.expect("info").expect("child");
    assert_eq!(info.parent.as_deref(), Some("snaps/parent@s1"));
    assert_eq!(p.read("child", 4096, 11).await.expect("read"), b"parent data");
    assert_eq!(p.children("parent", "s1").await.expect("children"), ["snaps/child"]);
    assert!(matches!(p.children("parent", "nosnap").await, Err(RbdError::NotFound(_))));

    // A snapshot with children, and an image with snapshots, are not removed.
    assert!(matches!(p.snapshot_remove("parent", "s1").await, Err(RbdError::FailedPrecondition(_))));
    assert!(matches!(p.remove("parent").await, Err(RbdError::FailedPrecondition(_))));

    // Protect works too, idempotently, and shows in the list.
    p.snapshot_protect("parent", "s1").await.expect("protect");
    p.snapshot_protect("parent", "s1").await.expect("protect again");
    let list = p.snapshot_list("parent").await.expect("list");
    assert_eq!(list.len(), 1);
    assert!(list[0].protected);
    assert_eq!(list[0].created, snap.created);
    p.clone_image("parent", "s1", "snaps", "child2", &[]).await.expect("clone of a protected snapshot");

    let t = Instant::now();
    p.flatten("child").await.expect("flatten");
    eprintln!("flatten 8 MiB {:?}", t.elapsed());
    assert_eq!(p.info("child").await.expect("info").expect("child").parent, None);
    assert_eq!(p.read("child", 4096, 11).await.expect("read"), b"parent data");
    p.flatten("child").await.expect("flatten of a non-clone succeeds");
    p.flatten("parent").await.expect("flatten of a plain image succeeds");
    assert_eq!(p.children("parent", "s1").await.expect("children"), ["snaps/child2"]);
    p.remove("child2").await.expect("remove clone");

    // Now childless: the protected snapshot is unprotected and removed; absent succeeds.
    p.snapshot_remove("parent", "s1").await.expect("remove snapshot");
    p.snapshot_remove("parent", "s1").await.expect("absent snapshot");
    assert!(p.snapshot_list("parent").await.expect("list").is_empty());
    assert!(matches!(p.snapshot_remove("none", "s1").await, Err(RbdError::NotFound(_))));
    p.remove("parent").await.expect("remove parent");
    let listed = ceph.rbd(&["ls", "snaps"]).expect("rbd ls");
    assert_eq!(listed.split_whitespace().collect::<Vec<_>>(), ["child"]);
}

#[tokio::test]
async fn names_and_grants_are_checked_before_any_traffic() {
    let Some((ceph, p)) = setup("scope") else { return };
    let long = "x".repeat(wasmcsi_rbd::MAX_NAME + 1);
    for bad in ["", "a/b", "a@b", "a\0b", "..", long.as_str()] {
        assert!(matches!(p.create(bad, &spec(MIB)).await, Err(RbdError::InvalidArgument(_))), "{bad:?}");
        assert!(matches!(p.info(bad).await, Err(RbdError::InvalidArgument(_))), "{bad:?}");
        assert!(matches!(p.snapshot_create("img", bad).await, Err(RbdError::InvalidArgument(_))), "{bad:?}");
    }
    let client = RbdClient::new(ceph.config(&["scope"]));
    let admin = ceph.admin();
    assert!(matches!(client.pool("other-cluster", "scope", &admin), Err(RbdError::PermissionDenied(_))));
    assert!(matches!(client.pool(CLUSTER, "ops", &admin), Err(RbdError::PermissionDenied(_))));
    assert!(matches!(client.pool(CLUSTER, "a/b", &admin), Err(RbdError::InvalidArgument(_))));
    // Clone into, or data in, a pool that is not granted: refused before any traffic. The
    // client's monitor does not exist (192.0.2.1, TEST-NET-1): a call that reached for the
    // cluster would end `Unavailable` at its connect timeout, not `PermissionDenied`.
    let mut nowhere = ceph.config(&["scope"]);
    nowhere.clusters[0].monitors = vec!["192.0.2.1:6789".into()];
    let nowhere = RbdClient::new(nowhere).pool(CLUSTER, "scope", &admin).expect("granted");
    for pool in [&p, &nowhere] {
        let r = pool.clone_image("img", "s", "ops", "c", &[]).await;
        assert!(matches!(r, Err(RbdError::PermissionDenied(_))), "{r:?}");
        let s = ImageSpec { data_pool: Some("ops".into()), ..spec(MIB) };
        let r = pool.create("img", &s).await;
        assert!(matches!(r, Err(RbdError::PermissionDenied(_))), "{r:?}");
    }
    assert_eq!(p.info("img").await.expect("info"), None, "nothing was created");
    // The key never shows in Debug.
    assert!(!format!("{admin:?} {p:?}").contains(ceph.admin_key()));
}

#[tokio::test]
async fn a_user_limited_to_one_pool_works_there_and_nowhere_else() {
    let Some((ceph, _)) = setup("mine") else { return };
    ceph.create_pool("theirs").expect("pool");
    let key = ceph.create_user("csi", "mine").expect("user");
    let creds = RbdCredentials::new("client.csi", key);
    // Granted both pools by the operator; cephx allows only one.
    let client = RbdClient::new(ceph.config(&["mine", "theirs"]));
    let mine = client.pool(CLUSTER, "mine", &creds).expect("granted");
    mine.create("v", &spec(MIB)).await.expect("create in own pool");
    mine.snapshot_create("v", "s").await.expect("snapshot");
    mine.clone_image("v", "s", "mine", "v2", &[]).await.expect("clone");
    assert_eq!(mine.children("v", "s").await.expect("children"), ["mine/v2"]);
    let s = mine.stats().await.expect("stats as a profile-rbd user");
    assert!(s.available_bytes > 0);
    let theirs = client.pool(CLUSTER, "theirs", &creds).expect("granted");
    assert!(matches!(theirs.create("v", &spec(MIB)).await, Err(RbdError::PermissionDenied(_))));

    let wrong = RbdCredentials::new("csi", "AQBnBwFnAAAAABAAzlZ6nYv8w3G0fLrYL0aoNg==");
    let r = client.pool(CLUSTER, "mine", &wrong).expect("granted").info("v").await;
    assert!(matches!(r, Err(RbdError::PermissionDenied(_))), "{r:?}");
}

/// QoS limits land where librbd reads them (the image's own configuration, as
/// `rbd config image get` shows), a 0 gives the key back to the cluster's default, and setting
/// the same limits twice changes nothing.
#[tokio::test]
async fn qos_limits_are_the_images_own_configuration() {
    let Some((ceph, p)) = setup("qos") else { return };
    p.create("img", &spec(4 * MIB)).await.expect("create");
    let get = |key: &str| ceph.rbd(&["config", "image", "get", "qos/img", key]).map(|v| v.trim().to_owned());
    let limits =
        QosLimits { read_iops: 500, write_iops: 200, read_bytes_per_second: 0, write_bytes_per_second: 10 * MIB };
    p.set_qos("img", &limits).await.expect("set qos");
    p.set_qos("img", &limits).await.expect("the same limits again");
    assert_eq!(get("rbd_qos_read_iops_limit").expect("read iops"), "500");
    assert_eq!(get("rbd_qos_write_iops_limit").expect("write iops"), "200");
    assert_eq!(get("rbd_qos_write_bps_limit").expect("write bps"), (10 * MIB).to_string());
    assert!(get("rbd_qos_read_bps_limit").is_err(), "0 sets no key of the image's own");

    p.set_qos("img", &QosLimits { write_iops: 200, ..Default::default() }).await.expect("lower");
    assert!(get("rbd_qos_read_iops_limit").is_err(), "a limit set to 0 is removed");
    assert_eq!(get("rbd_qos_write_iops_limit").expect("kept"), "200");
    assert!(matches!(p.set_qos("nope", &limits).await, Err(RbdError::NotFound(_))));
    p.remove("img").await.expect("remove");
}
