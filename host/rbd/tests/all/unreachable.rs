//! A cluster that cannot be reached, or stops answering, is `Unavailable` naming its monitors
//! within the configured timeout, never a hang; and the client recovers when it is back. These
//! tests freeze and kill daemons, so they run on a cluster of their own (not the shared one).
use std::time::{Duration, Instant};
use wasmcsi_ceph::{CLUSTER, Ceph};
use wasmcsi_rbd::{ImageSpec, RbdClient, RbdCluster, RbdConfig, RbdCredentials, RbdError};

const SLACK: Duration = Duration::from_millis(1500);

fn config(monitors: &str, timeout: Duration) -> RbdConfig {
    let cluster = RbdCluster { name: "dead".into(), monitors: vec![monitors.into()], pools: vec!["p".into()] };
    let mut c = RbdConfig::new(vec![cluster]);
    c.connect_timeout = timeout;
    c.op_timeout = timeout;
    c
}

fn assert_unavailable<T: std::fmt::Debug>(r: Result<T, RbdError>, monitors: &str, t: Instant, limit: Duration) {
    match r {
        Err(RbdError::Unavailable { monitors: m, .. }) => assert_eq!(m, monitors),
        other => panic!("expected Unavailable after {:?}, got {other:?}", t.elapsed()),
    }
    assert!(t.elapsed() < limit + SLACK, "took {:?} (limit {limit:?})", t.elapsed());
}

#[tokio::test]
async fn dead_port_and_blackholed_monitor_are_unavailable_within_the_timeout() {
    let limit = Duration::from_secs(2);
    let creds = RbdCredentials::new("admin", "AQBnBwFnAAAAABAAzlZ6nYv8w3G0fLrYL0aoNg==");
    // Refused: nothing listens there.
    for monitors in ["127.0.0.1:1", "192.0.2.1:6789"] {
        let c = RbdClient::new(config(monitors, limit));
        let p = c.pool("dead", "p", &creds).expect("granted");
        let t = Instant::now();
        assert_unavailable(p.info("img").await, monitors, t, limit);
        let e = p.create("img", &ImageSpec { size_bytes: 1 << 20, ..Default::default() }).await.expect_err("dead");
        assert!(e.to_string().contains(monitors), "{e}");
        assert_eq!(e.wit_case(), "unavailable");
    }
}

#[tokio::test]
async fn frozen_monitor_and_killed_cluster_are_unavailable_within_the_timeout_and_the_client_recovers() {
    let Some(ceph) = Ceph::start_or_skip("frozen_monitor") else { return };
    ceph.create_pool("p").expect("pool");
    let limit = Duration::from_secs(2);
    let mut cfg = ceph.config(&["p"]);
    cfg.connect_timeout = limit;
    cfg.op_timeout = limit;
    let monitors = cfg.clusters[0].monitors.join(",");
    let client = RbdClient::new(cfg.clone());
    let p = client.pool(CLUSTER, "p", &ceph.admin()).expect("granted");
    p.create("img", &ImageSpec { size_bytes: 1 << 20, ..Default::default() }).await.expect("create");

    ceph.pause_mon().expect("pause");
    // A new session needs the monitor: the connect hangs, the call does not.
    let fresh = RbdClient::new(cfg.clone());
    let fp = fresh.pool(CLUSTER, "p", &ceph.admin()).expect("granted");
    let t = Instant::now();
    assert_unavailable(fp.info("img").await, &monitors, t, limit);
    // An established session: monitor commands (pool stats) hang, the call does not.
    let t = Instant::now();
    assert_unavailable(p.stats().await, &monitors, t, limit);
    ceph.resume_mon().expect("resume");
    assert!(fp.info("img").await.expect("after resume").is_some());
    assert!(p.info("img").await.expect("after resume").is_some());

    // Every daemon killed: OSD operations of an established session time out too.
    ceph.stop().expect("stop");
    let t = Instant::now();
    assert_unavailable(p.info("img").await, &monitors, t, limit);
    let t = Instant::now();
    assert_unavailable(p.remove("img").await, &monitors, t, limit);
}
