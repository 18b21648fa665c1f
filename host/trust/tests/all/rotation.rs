//! Rotation under a running server: the credentials directory is replaced (by the same
//! symlink swap the kubelet does), new handshakes get the new certificate, and a connection
//! opened before keeps exchanging data.

use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmcsi_trust::reload::watch;
use wasmcsi_trust::{ExpectedRole, Limits, Role};

use crate::support::{Pki, dial, echo_server, round_trip};

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_handshakes_see_the_new_certificate_and_open_connections_keep_working() {
    let mut pki = Pki::new();
    let dir = pki.dir(&Role::Node("n1".into()));
    let (live, _watcher) = watch(&dir, Duration::from_millis(50)).expect("watch");
    let first_leaf = live.current().chain()[0].clone();
    let server = echo_server(live.clone(), Limits::default()).await;
    let controller = Arc::new(pki.credentials(&Role::Controller));
    let config = controller.client_config(ExpectedRole::Node("n1".into())).expect("config");

    let mut before = dial(config.clone(), server.addr).await.expect("handshake before");
    round_trip(&mut before, b"before the rotation").await.expect("echo");
    let seen = before.get_ref().1.peer_certificates().expect("server chain")[0].clone();
    assert_eq!(seen, first_leaf);

    // A new key and certificate, swapped in under the running server.
    let rotated = pki.write(&Role::Node("n1".into()), &dir);
    let live_for_wait = live.clone();
    tokio::task::spawn_blocking(move || wait_for("the reload", || live_for_wait.generation() == 1))
        .await
        .expect("wait");
    assert_ne!(rotated.chain[0], first_leaf);

    let mut after = dial(config.clone(), server.addr).await.expect("handshake after");
    round_trip(&mut after, b"after the rotation").await.expect("echo");
    let seen = after.get_ref().1.peer_certificates().expect("server chain")[0].clone();
    assert_eq!(seen, rotated.chain[0], "a new handshake must get the new certificate");

    // The connection from before the rotation is untouched.
    for i in 0..100 {
        round_trip(&mut before, format!("still here {i}").as_bytes()).await.expect("old connection");
    }

    // A broken set (the key of another certificate) is refused; the current one keeps serving.
    let stray = pki.dir(&Role::Node("n1".into()));
    std::fs::copy(stray.join("tls.key"), dir.join("..data/tls.key")).expect("break the key");
    let live_for_wait = live.clone();
    tokio::task::spawn_blocking(move || wait_for("the refusal", || live_for_wait.refusal().is_some()))
        .await
        .expect("wait");
    assert_eq!(live.generation(), 1);
    let mut third = dial(config, server.addr).await.expect("handshake with the kept set");
    round_trip(&mut third, b"kept").await.expect("echo");
    assert_eq!(third.get_ref().1.peer_certificates().expect("chain")[0], rotated.chain[0]);
    round_trip(&mut before, b"and still").await.expect("old connection");
}
