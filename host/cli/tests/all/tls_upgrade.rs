//! The replica port's TLS changed on live nodes, with real processes ([`support::cluster`]: a
//! controller and node plugins as `wasmcsi serve`, each node's data path a `wasmcsi datapath`
//! process of its own, on a private LAN):
//!
//! - A cluster that runs plaintext (`--tls-mode off`, the version before TLS) moves to mutual TLS
//!   with a replicated volume attached and under fio `--verify`: the controller and the node
//!   plugins are restarted with credentials (they hold no volume I/O), each node's data path is
//!   moved `off` → `permissive` → `required` by `wasmcsi upgrade datapath --tls-mode …` (the same
//!   process, its volumes handed over live). A node asked to go `required` while a replica of
//!   its volume is on a node still in plaintext refuses, saying so, and serves on. At the end
//!   fio saw no error, the volume never left its device, and a client without a certificate is
//!   refused by every replica port.
//! - In `required`, the nodes' certificates are renewed (written over their credentials
//!   directories, as a renewal does) while fio `--verify` writes: no error, and each replica
//!   port presents the new certificate afterwards.
//! - In `required`, a volume's grant is renewed (the authority endpoint signs 40 s grants here),
//!   then the first grant's expiry passes, the controller stops (no grant can be fetched any
//!   more) and the data path is upgraded live: the new image's engine reopens its sessions with
//!   the renewed grant it was handed, both replicas serve, and fio sees no error.
//!
//! Root only, with /dev/fuse, `ip` and fio; skipped with a message otherwise. The cluster's drop
//! guard takes namespaces, processes, mounts and loop devices down, also when the test panics.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use wasmcsi_datapath::client::DataPathClient;
use wasmcsi_trust::Role;
use wasmcsi_trust::pki::{Authority, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Validity};

use crate::support;
use crate::support::cluster::{
    Cluster, Plugin, REPLICA_PORT, create, fio, fio_ok, fio_until, mount_cap, publish, runtime, skip_reason,
    wait_condition,
};
use crate::support::csi::{controller_unpublish, mounts_under, stage_and_publish, unpublish_and_unstage};

const AUTHORITY_PORT: u16 = 9503;

/// Writes credentials of `role` issued by `ca` into `dir`, as an operator's PKI would.
fn credentials(ca: &Authority, role: &Role, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let issued = ca.issue(role, Validity::starting_now(DEFAULT_LEAF_VALIDITY)).unwrap();
    issued.write(dir, &[ca.certificate().clone()]).unwrap();
}

fn flags(mode: &str, dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut f = vec!["--tls-mode".to_owned(), mode.to_owned(), "--tls-dir".to_owned(), dir.display().to_string()];
    f.extend(extra.iter().map(|s| (*s).to_owned()));
    f
}

/// `wasmcsi upgrade datapath` of the data path at `socket` to this binary, with `tls` flags.
fn upgrade(socket: &Path, tls: &[String]) -> Output {
    Command::new(support::process::BIN)
        .args(["upgrade", "datapath", "--wait", "60", "--socket"])
        .arg(socket)
        .args(["--binary", support::process::BIN])
        .args(tls)
        .output()
        .unwrap()
}

fn upgraded(socket: &Path, tls: &[String], what: &str) -> String {
    let out = upgrade(socket, tls);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what}: {text}");
    eprintln!("{what}: {}", text.trim());
    // The new image's engines reach every replica at once: an engine that waited out its
    // attach timeout (10 s) for a replica refusing it (no grant yet under `required`) paused
    // the volume's I/O that long.
    let pause = support::cluster::upgrade_pause(&text);
    assert!(pause < Duration::from_secs(5), "{what}: the handover paused I/O {pause:?}: {text}");
    text
}

/// `wasmcsi volume status` of `volume` asked of `node`'s replica port without a certificate,
/// from that node's network namespace: whether it answered, and what it printed.
fn plaintext_status(node: &Plugin, volume: &str) -> (bool, String) {
    let set = volume.strip_prefix("replicated-block:").unwrap_or(volume);
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", node.member.netns))
        .args(["--", support::process::BIN, "volume", "status", "--volume-id", set, "--timeout", "3"])
        .args(["--replica", &format!("{}:{REPLICA_PORT}", node.member.addr)])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn tls_dir(cluster: &Cluster, name: &str) -> PathBuf {
    cluster.dir.path().join("tls").join(name)
}

/// The controller's and every node's credentials, issued by `ca`, in [`tls_dir`].
fn issue_all(cluster: &Cluster, ca: &Authority) {
    credentials(ca, &Role::Controller, &tls_dir(cluster, "controller"));
    for node in &cluster.nodes {
        credentials(ca, &Role::Node(node.name.clone()), &tls_dir(cluster, &node.name));
    }
}

/// A controller (serving the authority endpoint, with `controller_extra` flags) and `n` nodes,
/// each with a data path of its own, all `required` from their start with credentials of `ca`.
async fn required_cluster(n: usize, ca: &Authority, controller_extra: &[&str]) -> Cluster {
    let mut cluster = Cluster::prepare(n);
    issue_all(&cluster, ca);
    let authority = format!("https://{}:{AUTHORITY_PORT}", cluster.controller.member.addr);
    let listen = format!("{}:{AUTHORITY_PORT}", cluster.controller.member.addr);
    let mut extra = vec!["--authority-listen", listen.as_str()];
    extra.extend(controller_extra);
    cluster.controller.tls = flags("required", &tls_dir(&cluster, "controller"), &extra);
    for i in 0..n {
        let dir = tls_dir(&cluster, &cluster.nodes[i].name);
        cluster.nodes[i].datapath = true;
        cluster.nodes[i].tls = flags("required", &dir, &["--authority", &authority]);
    }
    cluster.start_all().await;
    cluster
}

/// The certificate `node`'s replica port presents to a TLS client (PEM), as `openssl s_client`
/// in the node's network namespace receives it, the client being `client`'s credentials.
fn served_certificate(node: &Plugin, client: &Path) -> String {
    let file = |f: &str| client.join(f).display().to_string();
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", node.member.netns))
        .args(["--", "openssl", "s_client", "-tls1_3", "-connect"])
        .arg(format!("{}:{REPLICA_PORT}", node.member.addr))
        .args(["-cert", &file("tls.crt"), "-key", &file("tls.key"), "-CAfile", &file("ca.crt")])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    first_pem(&text).unwrap_or_else(|| panic!("no server certificate from {}: {text}", node.name))
}

/// The first PEM certificate in `text`, whitespace removed.
fn first_pem(text: &str) -> Option<String> {
    let begin = text.find("-----BEGIN CERTIFICATE-----")?;
    let end = text[begin..].find("-----END CERTIFICATE-----")? + begin;
    Some(text[begin..end].split_whitespace().collect())
}

#[test]
fn a_volume_under_verified_io_moves_from_plaintext_to_required_tls_by_live_upgrades_of_its_data_paths() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    runtime().block_on(async {
        let mut cluster = Cluster::prepare(2);
        for node in &mut cluster.nodes {
            node.datapath = true;
        }
        // Credentials the operator puts on every node before the switch (cert-manager, say).
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).unwrap();
        issue_all(&cluster, &ca);
        let base = tls_dir(&cluster, "");
        let tls_dir = |name: &str| base.join(name);
        cluster.start_all().await;
        let pids: Vec<i32> = cluster.nodes.iter().map(|n| n.datapath_pid().expect("a data path of its own")).collect();
        let sockets: Vec<PathBuf> = cluster.nodes.iter().map(|n| n.home.join("datapath.sock")).collect();

        let mut ctl = cluster.controller().await;
        let cap = mount_cap(Some("ext4"));
        let v = create(&mut ctl, "pvc-tls-upgrade", 2, &cap).await;
        let ctx = publish(&mut ctl, &v, "node-a", &cap).await;
        let p = cluster.paths(0, "pod-1");
        let mut node_a = cluster.nodes[0].node().await;
        stage_and_publish(&mut node_a, &v, &ctx, &p, &cap).await;
        let mounted = mounts_under(&cluster.nodes[0].home);
        for node in &cluster.nodes {
            let (ok, text) = plaintext_status(node, &v.volume_id);
            assert!(ok, "{}'s replica port in plaintext answers a plaintext client: {text}", node.name);
        }

        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (file, stop) = (p.target.join("verified.dat"), stop.clone());
            std::thread::spawn(move || fio_until(file, stop))
        };
        tokio::time::sleep(Duration::from_millis(500)).await;

        // Step 1: the controller serves the authority endpoint; node plugins and data paths speak
        // TLS and still serve and fall back to plaintext.
        let authority = format!("https://{}:{AUTHORITY_PORT}", cluster.controller.member.addr);
        let listen = format!("{}:{AUTHORITY_PORT}", cluster.controller.member.addr);
        cluster
            .restart_with_tls(None, flags("permissive", &tls_dir("controller"), &["--authority-listen", &listen]))
            .await;
        for i in 0..cluster.nodes.len() {
            let dir = tls_dir(&cluster.nodes[i].name);
            cluster.restart_with_tls(Some(i), flags("permissive", &dir, &["--authority", &authority])).await;
        }
        upgraded(
            &sockets[0],
            &flags("permissive", &tls_dir("node-a"), &["--authority", &authority]),
            "node-a permissive",
        );

        // node-b's data path still speaks plaintext only: node-a's engine could not reach its
        // replica there in `required`. Refused, and node-a serves on in `permissive`.
        let out = upgrade(&sockets[0], &["--tls-mode".to_owned(), "required".to_owned()]);
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "node-a went required while node-b was plaintext: {text}");
        assert!(text.contains("cut off from its replica on node node-b"), "the refusal says why: {text}");
        eprintln!("refused as it should be: {}", text.trim());
        let mode = DataPathClient::new(&sockets[0]).tls_mode().await.unwrap();
        assert_eq!(mode.as_deref(), Some("permissive"), "node-a serves on as it was");

        upgraded(
            &sockets[1],
            &flags("permissive", &tls_dir("node-b"), &["--authority", &authority]),
            "node-b permissive",
        );

        // Step 2: every node speaks TLS; now `required` everywhere.
        cluster
            .restart_with_tls(None, flags("required", &tls_dir("controller"), &["--authority-listen", &listen]))
            .await;
        for i in 0..cluster.nodes.len() {
            let dir = tls_dir(&cluster.nodes[i].name);
            cluster.restart_with_tls(Some(i), flags("required", &dir, &["--authority", &authority])).await;
        }
        let required = ["--tls-mode".to_owned(), "required".to_owned()];
        upgraded(&sockets[0], &required, "node-a required");
        upgraded(&sockets[1], &required, "node-b required");
        for (i, socket) in sockets.iter().enumerate() {
            let mode = DataPathClient::new(socket).tls_mode().await.unwrap();
            assert_eq!(mode.as_deref(), Some("required"), "node {i}'s data path");
            assert_eq!(cluster.nodes[i].datapath_pid(), Some(pids[i]), "node {i}'s data path is the same process");
        }
        assert_eq!(mounts_under(&cluster.nodes[0].home), mounted, "nothing was unmounted or mounted");

        // Writes go on under `required` before fio is stopped.
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.store(true, Ordering::SeqCst);
        let (runs, failed, longest) = writer.join().unwrap();
        assert!(runs >= 1, "fio ran");
        assert_eq!(failed, 0, "fio runs with an error (of {runs}) through the switch to TLS");
        eprintln!("fio: {runs} verified runs through the switch, longest write latency {longest:?}");
        fio_ok(&mut fio(&p.target.join("verified.dat"), true), "verify after the switch");
        wait_condition(&mut node_a, &v, &p, "healthy under required TLS", |c| !c.abnormal).await;

        // A client without a certificate is refused by every replica port now (it was answered
        // before the switch).
        for node in &cluster.nodes {
            let (ok, text) = plaintext_status(node, &v.volume_id);
            assert!(!ok, "{}'s replica port answered a plaintext client: {text}", node.name);
        }

        unpublish_and_unstage(&mut node_a, &v, &p).await;
        controller_unpublish(&mut ctl, &v, "node-a").await;
        assert_eq!(mounts_under(cluster.dir.path()), Vec::<String>::new(), "nothing left mounted");
        cluster.stop();
    });
}

#[test]
fn certificates_renewed_under_verified_io_are_the_ones_presented_afterwards() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    runtime().block_on(async {
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).unwrap();
        let mut cluster = required_cluster(2, &ca, &[]).await;
        let mut ctl = cluster.controller().await;
        let cap = mount_cap(Some("ext4"));
        let v = create(&mut ctl, "pvc-tls-rotate", 2, &cap).await;
        let ctx = publish(&mut ctl, &v, "node-a", &cap).await;
        let p = cluster.paths(0, "pod-1");
        let mut node_a = cluster.nodes[0].node().await;
        stage_and_publish(&mut node_a, &v, &ctx, &p, &cap).await;
        // Each node's replica port asked by the other node.
        let client = |i: usize| tls_dir(&cluster, &cluster.nodes[1 - i].name);
        let before: Vec<String> =
            cluster.nodes.iter().enumerate().map(|(i, n)| served_certificate(n, &client(i))).collect();

        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (file, stop) = (p.target.join("verified.dat"), stop.clone());
            std::thread::spawn(move || fio_until(file, stop))
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        // A renewal: new keys and certificates written over each node's directory (the data path
        // and the node plugin of a node read the same one).
        for node in &cluster.nodes {
            credentials(&ca, &Role::Node(node.name.clone()), &tls_dir(&cluster, &node.name));
        }
        let renewed: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| first_pem(&std::fs::read_to_string(tls_dir(&cluster, &n.name).join("tls.crt")).unwrap()).unwrap())
            .collect();
        // Each node's processes poll their directory (every 5 s): new handshakes then present
        // the new certificate, sessions already open keep running.
        let deadline = Instant::now() + Duration::from_secs(60);
        for (i, node) in cluster.nodes.iter().enumerate() {
            assert_ne!(before[i], renewed[i], "the renewal made a new certificate");
            while served_certificate(node, &client(i)) != renewed[i] {
                assert!(Instant::now() < deadline, "{} never presented its renewed certificate", node.name);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.store(true, Ordering::SeqCst);
        let (runs, failed, longest) = writer.join().unwrap();
        assert!(runs >= 1, "fio ran");
        assert_eq!(failed, 0, "fio runs with an error (of {runs}) through the renewal");
        eprintln!("fio: {runs} verified runs through the renewal, longest write latency {longest:?}");
        fio_ok(&mut fio(&p.target.join("verified.dat"), true), "verify after the renewal");
        wait_condition(&mut node_a, &v, &p, "healthy after the renewal", |c| !c.abnormal).await;

        unpublish_and_unstage(&mut node_a, &v, &p).await;
        controller_unpublish(&mut ctl, &v, "node-a").await;
        assert_eq!(mounts_under(cluster.dir.path()), Vec::<String>::new(), "nothing left mounted");
        cluster.stop();
    });
}

/// Lines of node `node`'s data-path log (the plugin starts it with its log in the state
/// directory) that contain `what`.
fn datapath_log_lines(node: &Plugin, what: &str) -> usize {
    let log = std::fs::read_to_string(node.home.join("state/datapath.log")).unwrap_or_default();
    log.lines().filter(|l| l.contains(what)).count()
}

#[test]
fn a_renewed_grant_is_handed_to_the_upgraded_data_path_and_opens_its_sessions_after_the_first_one_expired() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    runtime().block_on(async {
        const LIFE: Duration = Duration::from_secs(40);
        // A grant is accepted up to 30 s past its end (clock skew).
        const SKEW: Duration = Duration::from_secs(30);
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).unwrap();
        let mut cluster = required_cluster(2, &ca, &["--grant-validity", "40s"]).await;
        let mut ctl = cluster.controller().await;
        let cap = mount_cap(Some("ext4"));
        let v = create(&mut ctl, "pvc-tls-grant", 2, &cap).await;
        let mut ctx = publish(&mut ctl, &v, "node-a", &cap).await;
        // The publish's own grant lives 24 h; without it the data path takes its first grant
        // from the authority endpoint (as for a volume published before grants), a 40 s one.
        assert!(ctx.remove("wasmcsi.io/grant").is_some(), "the publish signed a grant");
        let p = cluster.paths(0, "pod-1");
        let mut node_a = cluster.nodes[0].node().await;
        let attaching = Instant::now();
        stage_and_publish(&mut node_a, &v, &ctx, &p, &cap).await;
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (file, stop) = (p.target.join("verified.dat"), stop.clone());
            std::thread::spawn(move || fio_until(file, stop))
        };

        // The first grant was fetched after `attaching`: every replica refuses it from
        // `attaching + LIFE + SKEW` on. By then it was renewed (at half its life).
        let first_refused = attaching + LIFE + SKEW + Duration::from_secs(2);
        while Instant::now() < first_refused {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let renewed = datapath_log_lines(&cluster.nodes[0], "renewed the volume's grant");
        assert!(renewed >= 2, "the first grant and at least one renewal: {renewed} fetched");
        // No grant can be fetched from now on: the engine of the new image has only what it is
        // handed.
        cluster.controller.stop();
        let refusals_before = datapath_log_lines(&cluster.nodes[0], "a replica refused the grant");
        let socket = cluster.nodes[0].home.join("datapath.sock");
        upgraded(&socket, &[], "node-a, the controller stopped");

        // Both replicas serve: node-b's opened new sessions for the grant the new image was
        // handed (the first grant would be refused, and none could be fetched).
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let view = wasmcsi_datapath::client::Engines::Remote(DataPathClient::new(&socket))
                .list()
                .await
                .unwrap()
                .into_iter()
                .next()
                .expect("the volume is attached");
            if view.healthy() == 2 {
                break;
            }
            assert!(Instant::now() < deadline, "node-b's replica never served the upgraded engine: {view:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Still both after a while: not a state from before the new engine tried its sessions.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let view = wasmcsi_datapath::client::Engines::Remote(DataPathClient::new(&socket)).list().await.unwrap();
        assert_eq!(view.first().map(|v| v.healthy()), Some(2), "{view:?}");
        assert_eq!(
            datapath_log_lines(&cluster.nodes[0], "a replica refused the grant"),
            refusals_before,
            "no replica refused the grant the upgraded engine presented"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.store(true, Ordering::SeqCst);
        let (runs, failed, _) = writer.join().unwrap();
        assert!(runs >= 1, "fio ran");
        assert_eq!(failed, 0, "fio runs with an error (of {runs}) through the upgrade");
        fio_ok(&mut fio(&p.target.join("verified.dat"), true), "verify after the upgrade");

        unpublish_and_unstage(&mut node_a, &v, &p).await;
        cluster.controller.start(&cluster.config);
        let mut ctl = cluster.controller().await;
        controller_unpublish(&mut ctl, &v, "node-a").await;
        assert_eq!(mounts_under(cluster.dir.path()), Vec::<String>::new(), "nothing left mounted");
        cluster.stop();
    });
}
