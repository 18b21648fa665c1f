//! Hot reload end to end: a host started with an empty backends directory picks up a
//! component an operator drops in, keeps serving the previous version through a broken file,
//! swaps builds under concurrent CreateVolume calls without failing one, and records in each
//! volume the digest of the build that created it. All through the real CSI socket.
#![allow(clippy::unwrap_used, reason = "tests")]
use sha2::{Digest, Sha256};
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tonic::Code;
use tonic::transport::Channel;
use wasmcsi::host::{Host, HostOptions, connect};
use wasmcsi_csi::Mode;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::controller_client::ControllerClient;
use wasmcsi_proto::csi::v1::identity_client::IdentityClient;
use wasmcsi_runtime::config::HostConfig;

const RELOAD_INTERVAL: Duration = Duration::from_millis(100);
const DIGEST_KEY: &str = "wasmcsi.io/backend-digest";

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn leb128(mut n: usize, out: &mut Vec<u8>) {
    loop {
        let byte = u8::try_from(n & 0x7f).unwrap();
        n >>= 7;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// The same component with a trailing custom section: another digest, the same behaviour.
fn with_custom_section(wasm: &[u8], name: &str, payload: &[u8]) -> Vec<u8> {
    let mut section = Vec::new();
    leb128(name.len(), &mut section);
    section.extend_from_slice(name.as_bytes());
    section.extend_from_slice(payload);
    let mut out = wasm.to_vec();
    out.push(0x00);
    leb128(section.len(), &mut out);
    out.extend(section);
    out
}

/// Replace `dir/NAME.wasm` as an operator would: write a temporary name, then rename.
fn install(dir: &Path, name: &str, bytes: &[u8]) {
    let partial = dir.join(format!("{name}.wasm.partial"));
    std::fs::write(&partial, bytes).unwrap();
    std::fs::rename(&partial, dir.join(format!("{name}.wasm"))).unwrap();
}

/// Poll `check` until it yields a value, for at most 5 s.
async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(tokio::time::Instant::now() < until, "timed out waiting for {what}");
        tokio::time::sleep(RELOAD_INTERVAL / 4).await;
    }
}

fn create_request(name: &str) -> csi::CreateVolumeRequest {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode as AM};
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 }),
        volume_capabilities: vec![csi::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: AM::SingleNodeWriter as i32 }),
        }],
        parameters: [("backend".to_string(), "hostpath".to_string())].into_iter().collect(),
        ..Default::default()
    }
}

/// CreateVolume through the socket; the created volume's recorded digest.
async fn create(channel: &Channel, name: &str) -> Result<String, tonic::Status> {
    let volume =
        ControllerClient::new(channel.clone()).create_volume(create_request(name)).await?.into_inner().volume.unwrap();
    assert_eq!(volume.volume_id, format!("hostpath:default.{name}"));
    Ok(volume.volume_context[DIGEST_KEY].clone())
}

async fn ready(channel: &Channel) -> Option<bool> {
    IdentityClient::new(channel.clone()).probe(csi::ProbeRequest {}).await.unwrap().into_inner().ready
}

/// The digest prefix GetPluginInfo reports for hostpath (`hostpath@<12 hex>`), if loaded.
async fn serving_digest(channel: &Channel) -> Option<String> {
    let info =
        IdentityClient::new(channel.clone()).get_plugin_info(csi::GetPluginInfoRequest {}).await.unwrap().into_inner();
    info.manifest.get("backends")?.split(',').find_map(|b| b.strip_prefix("hostpath@")).map(str::to_string)
}

fn rejected(host: &Host) -> String {
    let text = host.registry.runtime().metrics.encode();
    let series = r#"wasmcsi_backend_rejected_total{backend="hostpath"} "#;
    text.lines().find_map(|l| l.strip_prefix(series)).unwrap_or("0").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_are_added_and_swapped_without_a_restart_and_broken_files_are_rejected() {
    let d = tempfile::tempdir().unwrap();
    let backends = d.path().join("backends");
    for sub in ["backends", "root", "state"] {
        std::fs::create_dir_all(d.path().join(sub)).unwrap();
    }
    let config = format!("[backends.hostpath.grants]\ndir = {{ default = \"{}/root\" }}\n", d.path().display());
    let host = Host::start(HostOptions {
        driver_name: "reload.test.wasmcsi.io".into(),
        mode: Mode::Controller,
        node_id: "node-1".into(),
        socket: d.path().join("csi.sock"),
        config: HostConfig::parse(&config, Path::new("hot-reload-test")).unwrap(),
        config_file: None,
        backends_dir: Some(backends.clone()),
        state_dir: d.path().join("state"),
        reload_interval: RELOAD_INTERVAL,
        metrics_addr: None,
        replicas: None,
        reconcile: None,
    })
    .await
    .unwrap();
    let channel = connect(&host.socket).await.unwrap();

    // Nothing to serve yet: not ready, and the StorageClass names an unknown backend.
    assert_eq!(ready(&channel).await, Some(false));
    let status = create(&channel, "pvc-early").await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("none loaded"), "{status:?}");

    // Dropped in: served within a few reload intervals, no restart.
    let build_a = wasmcsi_artifacts::HOSTPATH.to_vec();
    let build_b = with_custom_section(&build_a, "wasmcsi-test", b"build b");
    let (digest_a, digest_b) = (sha256_hex(&build_a), sha256_hex(&build_b));
    assert_ne!(digest_a, digest_b);
    install(&backends, "hostpath", &build_a);
    let digest = eventually("hostpath to load", || async { create(&channel, "pvc-first").await.ok() }).await;
    assert_eq!(digest, digest_a, "the volume records the digest of the file that created it");
    assert_eq!(ready(&channel).await, Some(true));
    assert!(d.path().join("root/volumes/pvc-first").is_dir());

    // A broken file is rejected once; the previous version keeps serving.
    install(&backends, "hostpath", b"\0asm\x0d\0\x01\0 not a component");
    eventually("the broken file to be rejected", || async { (rejected(&host) == "1").then_some(()) }).await;
    tokio::time::sleep(RELOAD_INTERVAL * 3).await;
    assert_eq!(rejected(&host), "1", "an unchanged broken file is looked at once");
    assert_eq!(create(&channel, "pvc-during-broken").await.unwrap(), digest_a);
    assert_eq!(serving_digest(&channel).await.unwrap(), digest_a[..12]);

    // 20 swaps between two valid builds while two clients keep creating volumes: no call
    // fails, each volume records the build that served it.
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..2)
        .map(|c| {
            let (channel, stop) = (channel.clone(), stop.clone());
            tokio::spawn(async move {
                let mut digests = Vec::new();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let name = format!("pvc-c{c}-{i}");
                    digests.push(
                        create(&channel, &name).await.unwrap_or_else(|e| panic!("{name} failed during a swap: {e:?}")),
                    );
                    i += 1;
                }
                digests
            })
        })
        .collect();
    for swap in 0..20 {
        let (bytes, digest) = if swap % 2 == 0 { (&build_b, &digest_b) } else { (&build_a, &digest_a) };
        install(&backends, "hostpath", bytes);
        eventually("the swap to be served", || async {
            (serving_digest(&channel).await.as_deref() == Some(&digest[..12])).then_some(())
        })
        .await;
        assert_eq!(&create(&channel, &format!("pvc-swap-{swap}")).await.unwrap(), digest, "swap {swap}");
    }
    stop.store(true, Ordering::Relaxed);
    let mut during = Vec::new();
    for client in clients {
        during.extend(client.await.unwrap());
    }
    assert!(during.len() >= 20, "the clients barely ran: {} calls", during.len());
    assert!(during.iter().all(|d| *d == digest_a || *d == digest_b), "unknown digests recorded");
    assert!(during.contains(&digest_a) && during.contains(&digest_b), "calls ran on both builds");
    // A retry of an existing volume keeps the digest of the build that created it.
    assert_eq!(create(&channel, "pvc-first").await.unwrap(), digest_a);
    assert_eq!(create(&channel, "pvc-swap-0").await.unwrap(), digest_b);
    assert_eq!(rejected(&host), "1");

    drop(channel);
    host.shutdown().await.unwrap();
}

/// A counter of the host's metrics, as `/metrics` shows it.
fn counter(host: &Host, name: &str) -> String {
    let text = host.registry.runtime().metrics.encode();
    text.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).unwrap_or("0").to_string()
}

/// Config reload: the configuration file `serve --config` names is re-read on change
/// like the backends directory, through the running host: a grant added lets a backend serve
/// without a restart, a file that does not parse is refused once and the configuration in force
/// keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_configuration_file_is_put_in_force_without_a_restart_and_a_bad_one_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let (backends, file) = (d.path().join("backends"), d.path().join("config.toml"));
    for sub in ["backends", "root", "state"] {
        std::fs::create_dir_all(d.path().join(sub)).unwrap();
    }
    install(&backends, "hostpath", wasmcsi_artifacts::HOSTPATH);
    // Written as an operator (or a ConfigMap update) does: a new file renamed over the old.
    let write_config = |text: &str| {
        let partial = d.path().join("config.toml.partial");
        std::fs::write(&partial, text).unwrap();
        std::fs::rename(&partial, &file).unwrap();
    };
    write_config("# hostpath is not granted its root yet\n");
    let host = Host::start(HostOptions {
        driver_name: "reload.test.wasmcsi.io".into(),
        mode: Mode::Controller,
        node_id: "node-1".into(),
        socket: d.path().join("csi.sock"),
        config: HostConfig::load(&file).unwrap(),
        config_file: Some(file.clone()),
        backends_dir: Some(backends.clone()),
        state_dir: d.path().join("state"),
        reload_interval: RELOAD_INTERVAL,
        metrics_addr: None,
        replicas: None,
        reconcile: None,
    })
    .await
    .unwrap();
    let channel = connect(&host.socket).await.unwrap();
    assert_eq!(rejected(&host), "1", "hostpath imports dir, not granted at start");
    assert_eq!(create(&channel, "pvc-early").await.unwrap_err().code(), Code::InvalidArgument);

    write_config(&format!("[backends.hostpath.grants]\ndir = {{ default = \"{}/root\" }}\n", d.path().display()));
    eventually("the new configuration to serve hostpath", || async { create(&channel, "pvc-granted").await.ok() })
        .await;
    assert!(d.path().join("root/volumes/pvc-granted").is_dir());
    assert_eq!(counter(&host, "wasmcsi_config_loads_total"), "1");

    write_config("[backends.hostpath.grants\n");
    eventually("the broken configuration to be refused", || async {
        (counter(&host, "wasmcsi_config_rejected_total") == "1").then_some(())
    })
    .await;
    tokio::time::sleep(RELOAD_INTERVAL * 3).await;
    assert_eq!(counter(&host, "wasmcsi_config_rejected_total"), "1", "an unchanged bad file is looked at once");
    create(&channel, "pvc-after-bad").await.unwrap();
    assert!(d.path().join("root/volumes/pvc-after-bad").is_dir());

    drop(channel);
    host.shutdown().await.unwrap();
}
