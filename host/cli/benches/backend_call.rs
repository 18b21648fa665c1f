//! `cargo bench --workspace --bench backend_call`: the sandbox's costs, one table from one
//! run (ratios are only meaningful side by side on the same noisy machine).
//!
//! 1. backend call: instantiate a fresh instance from the pre-instantiated component + call
//!    an export (`info`: no imports), p50/p99; and `get-capacity` (one host import).
//! 2. CreateVolume through the CSI socket: hostpath as `.wasm` vs the same crate linked
//!    natively, interleaved call by call; p50/p99 and the ratio.
//! 3. host ready to serve (runtime + 3 backends from a warm compile cache + socket + Probe).
#![allow(clippy::unwrap_used, reason = "benchmark harness")]
use std::path::Path;
use std::time::{Duration, Instant};
use wasmcsi::host::{Host, HostOptions, connect};
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::{controller_client::ControllerClient, identity_client::IdentityClient};
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::native::NativeDriver;

fn pct(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[i]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn config(root: &Path) -> HostConfig {
    let grants = |name: &str| {
        format!("[backends.{name}.grants]\ndir = {{ default = {:?} }}\n", root.join(name).display().to_string())
    };
    let text = ["hostpath", "hostpath-native", "hostpath-b", "hostile"].iter().map(|n| grants(n)).collect::<String>();
    for n in ["hostpath", "hostpath-native", "hostpath-b", "hostile"] {
        std::fs::create_dir_all(root.join(n)).unwrap();
    }
    HostConfig::parse(&text, Path::new("bench")).unwrap()
}

/// The same component bytes with a trailing custom section: a different digest (so its own
/// compiled artifact), identical behaviour.
fn variant(wasm: &[u8], tag: &str) -> Vec<u8> {
    let name = b"wasmcsi-bench";
    let mut payload = vec![name.len() as u8];
    payload.extend_from_slice(name);
    payload.extend_from_slice(tag.as_bytes());
    let mut out = wasm.to_vec();
    out.push(0);
    out.push(payload.len() as u8);
    out.extend(payload);
    out
}

fn options(dir: &Path, backends: &Path) -> HostOptions {
    HostOptions {
        driver_name: "bench.wasmcsi.io".into(),
        mode: wasmcsi_csi::Mode::Controller,
        node_id: "bench".into(),
        socket: dir.join("csi.sock"),
        config: config(&dir.join("roots")),
        backends_dir: Some(backends.to_path_buf()),
        state_dir: dir.join("state"),
        reload_interval: Duration::from_secs(3600),
        metrics_addr: None,
    }
}

fn create(name: &str, backend: &str) -> csi::CreateVolumeRequest {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 }),
        volume_capabilities: vec![csi::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
        }],
        parameters: [("backend".to_string(), backend.to_string())].into_iter().collect(),
        ..Default::default()
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    let backends = dir.path().join("backends");
    std::fs::create_dir_all(&backends).unwrap();
    std::fs::write(backends.join("hostpath.wasm"), wasmcsi_artifacts::HOSTPATH).unwrap();
    std::fs::write(backends.join("hostpath-b.wasm"), variant(wasmcsi_artifacts::HOSTPATH, "b")).unwrap();
    std::fs::write(backends.join("hostile.wasm"), wasmcsi_artifacts::HOSTILE).unwrap();

    let host = Host::start(options(dir.path(), &backends)).await.unwrap();
    let rt = host.registry.runtime().clone();
    host.registry
        .insert(rt.load_native("hostpath-native", NativeDriver::of::<wasmcsi_backend_hostpath::HostPath>()).unwrap());
    let wasm = host.registry.get("hostpath").unwrap();

    // 1. instantiate + call.
    let n = 20_000;
    let mut info = Vec::with_capacity(n);
    for i in 0..n + 1000 {
        let t = Instant::now();
        wasm.call("info", vec![], |g, s| Box::pin(async move { g.call_info(s).await.map(Ok) })).await.unwrap();
        if i >= 1000 {
            info.push(t.elapsed());
        }
    }
    let mut cap = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let t = Instant::now();
        wasm.get_capacity(vec![], vec![], None).await.unwrap();
        cap.push(t.elapsed());
    }

    // 2. CreateVolume through the socket, wasm vs native, interleaved.
    let channel = connect(&host.socket).await.unwrap();
    let mut ctl = ControllerClient::new(channel);
    let rounds = 2000;
    let (mut w, mut nat) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for i in 0..rounds + 100 {
        for (backend, samples) in [("hostpath", &mut w), ("hostpath-native", &mut nat)] {
            let name = format!("pvc-{i}");
            let t = Instant::now();
            let v = ctl.create_volume(create(&name, backend)).await.unwrap().into_inner().volume.unwrap();
            let took = t.elapsed();
            ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id, ..Default::default() }).await.unwrap();
            if i >= 100 {
                samples.push(took);
            }
        }
    }
    host.shutdown().await.unwrap();

    // 3. Ready to serve with a warm compile cache (the first start above filled it).
    let mut ready = Vec::new();
    for _ in 0..15 {
        let t = Instant::now();
        let host = Host::start(options(dir.path(), &backends)).await.unwrap();
        let mut id = IdentityClient::new(connect(&host.socket).await.unwrap());
        assert_eq!(id.probe(csi::ProbeRequest {}).await.unwrap().into_inner().ready, Some(true));
        ready.push(t.elapsed());
        assert!(host.registry.all().iter().all(|b| b.cache_hit), "cache should be warm");
        assert_eq!(host.registry.names().len(), 3);
        host.shutdown().await.unwrap();
    }

    let (wp50, np50) = (pct(&mut w, 0.5), pct(&mut nat, 0.5));
    let mean = |v: &[Duration]| v.iter().sum::<Duration>() / v.len() as u32;
    println!("\nwasmcsi sandbox benchmark (one run, 2 tokio workers)");
    println!("{:<58} {:>12} {:>12}", "measure", "p50", "p99");
    println!(
        "{:<58} {:>12} {:>12}",
        format!("backend call: instantiate + info() (n={n})"),
        us(pct(&mut info, 0.5)),
        us(pct(&mut info, 0.99))
    );
    println!(
        "{:<58} {:>12} {:>12}",
        "backend call: instantiate + get-capacity (1 host import)",
        us(pct(&mut cap, 0.5)),
        us(pct(&mut cap, 0.99))
    );
    println!(
        "{:<58} {:>12} {:>12}",
        format!("CreateVolume via socket, hostpath .wasm (n={rounds})"),
        us(wp50),
        us(pct(&mut w, 0.99))
    );
    println!(
        "{:<58} {:>12} {:>12}",
        format!("CreateVolume via socket, hostpath native (n={rounds})"),
        us(np50),
        us(pct(&mut nat, 0.99))
    );
    println!(
        "{:<58} {:>12} {:>12}",
        "  ratio .wasm / native (p50, mean)",
        format!("{:.3}x", wp50.as_secs_f64() / np50.as_secs_f64()),
        format!("{:.3}x", mean(&w).as_secs_f64() / mean(&nat).as_secs_f64())
    );
    println!(
        "{:<58} {:>12} {:>12}",
        "host ready, 3 backends, warm cache (n=15; p50, max)",
        format!("{:.1} ms", pct(&mut ready, 0.5).as_secs_f64() * 1e3),
        format!("{:.1} ms", pct(&mut ready, 1.0).as_secs_f64() * 1e3)
    );
}
