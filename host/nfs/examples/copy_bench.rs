//! copy-tree throughput through the userspace client vs a server-side `cp -a` of the same tree
//! on the exported directory, same run, same ganesha (in its own namespace; needs root).
//! `cargo run --release -p wasmcsi-nfs --example copy_bench [-- --big-mib 1024]`
//! Prints numbers; asserts nothing about them.
use std::fs;
use std::io::Write;
use std::time::{Duration, Instant};
use wasmcsi_ganesha::Ganesha;
use wasmcsi_nfs::NfsClient;

fn cp_a(g: &Ganesha, from: &str, to: &str) -> Duration {
    let t = Instant::now();
    let st = std::process::Command::new("cp").args(["-a", from, to]).current_dir(g.export_dir()).status().expect("cp");
    assert!(st.success());
    // Same durability as the client's COMMIT: the data on disk.
    let _ = std::process::Command::new("sync").arg("-f").arg(g.export_dir().join(to)).status();
    t.elapsed()
}

fn drop_caches() {
    let _ = std::process::Command::new("sync").status();
    let _ = fs::write("/proc/sys/vm/drop_caches", "3");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let big_mib: u64 =
        std::env::args().skip_while(|a| a != "--big-mib").nth(1).and_then(|v| v.parse().ok()).unwrap_or(1024);
    let g = Ganesha::start().expect("ganesha");
    let mut cfg = g.config();
    cfg.op_timeout = Duration::from_secs(30);
    let c = NfsClient::new(cfg);
    let e = g.export();
    let root = g.export_dir();

    // (a) 2000 files of 4 KiB in 20 directories.
    let small = root.join("small");
    let block: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    for d in 0..20 {
        let dir = small.join(format!("d{d:02}"));
        fs::create_dir_all(&dir).expect("mkdir");
        for f in 0..100 {
            fs::write(dir.join(format!("f{f:03}")), &block).expect("write");
        }
    }
    // (b) one big file of random-looking (incompressible, non-zero) data.
    let big = root.join("big");
    fs::create_dir(&big).expect("mkdir");
    let mut f = fs::File::create(big.join("blob")).expect("create");
    let mut chunk = vec![0u8; 1 << 20];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..big_mib {
        for b in chunk.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
        }
        f.write_all(&chunk).expect("write");
    }
    f.sync_all().expect("sync");
    drop(f);

    let small_bytes = 2000.0 * 4096.0;
    let big_bytes = (big_mib << 20) as f64;
    println!("copy-tree through the NFSv3 client vs server-side cp -a (same ganesha, same run)");
    for (name, bytes, files) in [("small", small_bytes, 2000.0), ("big", big_bytes, 1.0)] {
        drop_caches();
        let t = Instant::now();
        c.copy_tree(&e, name, &format!("{name}-nfs")).await.expect("copy-tree");
        let nfs = t.elapsed();
        drop_caches();
        let cp = cp_a(&g, name, &format!("{name}-cp"));
        let mb = |d: Duration| bytes / 1e6 / d.as_secs_f64();
        let fps = |d: Duration| files / d.as_secs_f64();
        println!(
            "{name:>5}: client {:>7.2} s {:>8.1} MB/s {:>8.1} files/s | cp -a {:>7.2} s {:>8.1} MB/s {:>8.1} files/s | ratio client/cp {:.2}",
            nfs.as_secs_f64(),
            mb(nfs),
            fps(nfs),
            cp.as_secs_f64(),
            mb(cp),
            fps(cp),
            cp.as_secs_f64() / nfs.as_secs_f64(),
        );
        assert_eq!(
            fs::read(root.join(format!("{name}-nfs")).join(if name == "big" { "blob" } else { "d07/f042" }))
                .expect("copied")
                .len(),
            fs::read(root.join(name).join(if name == "big" { "blob" } else { "d07/f042" })).expect("source").len()
        );
    }
}
