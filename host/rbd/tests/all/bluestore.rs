//! The bluestore option of the harness (for benchmarks): OSDs on sparse files. Ignored by
//! default (a memstore cluster covers the client; this one takes longer to start); run with
//! `cargo test --release --workspace --locked --test all -- bluestore:: --ignored`.
use std::time::Instant;
use wasmcsi_ceph::{CLUSTER, Ceph, Store};
use wasmcsi_rbd::{ImageSpec, RbdClient};

#[tokio::test]
#[ignore = "slower start; the harness option for benchmarks"]
async fn bluestore_cluster_starts_and_serves_an_image() {
    if wasmcsi_ceph::unavailable().is_some() {
        return;
    }
    let t = Instant::now();
    let ceph = Ceph::start_with(Store::Bluestore { file_bytes: 4 << 30 }).expect("bluestore cluster");
    ceph.create_pool("b").expect("pool");
    eprintln!("bluestore cluster + pool in {:?}", t.elapsed());
    let p = RbdClient::new(ceph.config(&["b"])).pool(CLUSTER, "b", &ceph.admin()).expect("granted");
    p.create("img", &ImageSpec { size_bytes: 16 << 20, ..Default::default() }).await.expect("create");
    p.write("img", 0, b"on bluestore").await.expect("write");
    assert_eq!(p.read("img", 0, 12).await.expect("read"), b"on bluestore");
}
