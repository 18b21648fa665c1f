//! rbd-fuse as the node-side attach on this kernel: the image as a file, data written through
//! the file is what librbd reads, the file works under a loop device with a filesystem, and
//! detach leaves no mount, no process and no key on disk. Shares the binary's cluster.
use std::os::unix::fs::FileExt;
use std::process::Command;
use std::time::{Duration, Instant};
use wasmcsi_ceph::{CLUSTER, Ceph};
use wasmcsi_frontend::mkfs::{self, FsType};
use wasmcsi_mountinfo as mountinfo;
use wasmcsi_rbd::fuse_attach::{FuseAttachRequest, attach};
use wasmcsi_rbd::{ImageSpec, RbdClient};

const SIZE: u64 = 64 << 20;

fn mounted(path: &std::path::Path) -> bool {
    mountinfo::is_mount_point(path).expect("mountinfo")
}

#[tokio::test]
async fn attach_write_read_back_through_librbd_and_detach_cleanly() {
    let Some(ceph) = Ceph::shared() else { return };
    ceph.create_pool("fuse").expect("pool");
    let key = ceph.create_user("node", "fuse").expect("user");
    let creds = wasmcsi_rbd::RbdCredentials::new("node", key.clone());
    let client = RbdClient::new(ceph.config(&["fuse"]));
    let p = client.pool(CLUSTER, "fuse", &creds).expect("granted");
    p.create("vol", &ImageSpec { size_bytes: SIZE, ..Default::default() }).await.expect("create");

    let runtime = tempfile::tempdir().expect("runtime dir");
    let req = FuseAttachRequest {
        monitors: ceph.monitors(),
        pool: "fuse".into(),
        image: "vol".into(),
        creds,
        size_bytes: SIZE,
        runtime_dir: runtime.path().to_owned(),
        timeout: Duration::from_secs(10),
        private_dir: None,
    };
    let t = Instant::now();
    let mut a = attach(&req).expect("attach");
    eprintln!("rbd-fuse attach {:?}", t.elapsed());
    let pid = a.pid().expect("running");
    // The key is in no process's argv.
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    assert!(!String::from_utf8_lossy(&cmdline).contains(&key));

    let f = std::fs::OpenOptions::new().read(true).write(true).open(a.file()).expect("open image file");
    f.write_all_at(b"written through rbd-fuse", 1 << 20).expect("write");
    f.sync_all().expect("fsync");
    drop(f);
    assert_eq!(p.read("vol", 1 << 20, 24).await.expect("librbd read"), b"written through rbd-fuse");

    // Loop device + ext4 + mount over the file, with the frontend's helpers.
    let out = Command::new("losetup").args(["--find", "--show"]).arg(a.file()).output().expect("losetup");
    assert!(out.status.success(), "{out:?}");
    let dev = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let mnt = tempfile::tempdir().expect("mnt");
    let fs = mkfs::ensure_fs(&dev, FsType::Ext4).expect("mkfs");
    mkfs::mount(&dev, mnt.path(), &fs, None).expect("mount");
    std::fs::write(mnt.path().join("hello"), b"on ext4 on rbd").expect("write file");
    mkfs::unmount(mnt.path()).expect("unmount");
    let out = Command::new("losetup").arg("-d").arg(&dev).output().expect("losetup -d");
    assert!(out.status.success(), "{out:?}");
    let backing = std::path::Path::new("/sys/block").join(dev.file_name().expect("name")).join("loop/backing_file");
    let deadline = Instant::now() + Duration::from_secs(10);
    while backing.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }

    let mount_point = a.mount_point().to_owned();
    let t = Instant::now();
    a.detach().expect("detach");
    eprintln!("rbd-fuse detach {:?}", t.elapsed());
    assert!(!mounted(&mount_point));
    assert!(!mount_point.exists());
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "rbd-fuse still running");
    a.detach().expect("detach is idempotent");

    // The filesystem is in the image: attach again and find the file's blocks through librbd.
    let sb = p.read("vol", 1024 + 0x38, 2).await.expect("read superblock magic");
    assert_eq!(sb, [0x53, 0xef], "ext4 magic in the image");

    // A missing image fails within the timeout and leaves nothing behind.
    let bad = FuseAttachRequest { image: "missing".into(), timeout: Duration::from_secs(3), ..req };
    let t = Instant::now();
    assert!(attach(&bad).is_err());
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(std::fs::read_dir(runtime.path()).expect("ls").count(), 0, "no mount point left");
}

/// The group snapshot of [`wasmcsi_rbd::RbdPool::group_snapshot`] against rbd-fuse clients (the
/// node's attach here), each holding its image open and its exclusive lock: one writer writes
/// one numbered sequence round-robin over three images (`n` to image `n % 3`, block `n / 3`),
/// issuing `n + 1` only once `n` was acknowledged (written and fdatasync'd). Every group
/// snapshot must hold exactly the writes `0..k` for some `k`: never a later write without an
/// earlier one. Writes that fail while the host holds the locks are retried (not acknowledged,
/// so the order stays) and counted; the pauses are measured.
#[tokio::test]
async fn group_snapshots_are_one_point_of_a_dependent_writer_across_rbd_fuse_clients() {
    let Some(ceph) = Ceph::shared() else { return };
    ceph.create_pool("group").expect("pool");
    let admin = ceph.admin();
    let client = RbdClient::new(ceph.config(&["group"]));
    let p = client.pool(CLUSTER, "group", &admin).expect("granted");
    let locked = ImageSpec {
        size_bytes: SIZE,
        features: vec!["layering".into(), "exclusive-lock".into()],
        ..Default::default()
    };
    let images: Vec<String> = ["g-c", "g-a", "g-b"].map(String::from).to_vec();
    for i in &images {
        p.create(i, &locked).await.expect("create");
    }
    p.create("g-plain", &ImageSpec { size_bytes: SIZE, features: vec!["layering".into()], ..Default::default() })
        .await
        .expect("create");

    let runtime = tempfile::tempdir().expect("runtime dir");
    let mut attached = Vec::new();
    for i in &images {
        let req = FuseAttachRequest {
            monitors: ceph.monitors(),
            pool: "group".into(),
            image: i.clone(),
            creds: admin.clone(),
            size_bytes: SIZE,
            runtime_dir: runtime.path().to_owned(),
            timeout: Duration::from_secs(10),
            private_dir: None,
        };
        attached.push(attach(&req).expect("attach"));
    }
    let files: Vec<std::fs::File> = attached
        .iter()
        .map(|a| std::fs::OpenOptions::new().read(true).write(true).open(a.file()).expect("open"))
        .collect();

    const BLOCK: u64 = 4096;
    const MAGIC: &[u8; 8] = b"wasmcsi!";
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut n, mut failed) = (0u64, Vec::<String>::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut buf = vec![0u8; BLOCK as usize];
                buf[..8].copy_from_slice(MAGIC);
                buf[8..16].copy_from_slice(&n.to_le_bytes());
                let f = &files[(n % 3) as usize];
                let off = (n / 3) * BLOCK;
                let acknowledged = loop {
                    match f.write_all_at(&buf, off).and_then(|()| f.sync_data()) {
                        Ok(()) => break true,
                        Err(_) if stop.load(std::sync::atomic::Ordering::Relaxed) => break false,
                        Err(e) => {
                            failed.push(format!("write {n}: {e}"));
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    }
                };
                if !acknowledged {
                    break;
                }
                n += 1;
            }
            (n, failed)
        })
    };

    // Refused before anything is locked: an image without exclusive-lock, one named twice.
    let mut with_plain = images.clone();
    with_plain.push("g-plain".into());
    let e = p.group_snapshot("g", &with_plain, "refused").await.expect_err("no exclusive-lock");
    assert!(matches!(&e, wasmcsi_rbd::RbdError::FailedPrecondition(m) if m.contains("g-plain")), "{e:?}");
    let twice = vec![images[0].clone(), images[0].clone()];
    assert!(matches!(p.group_snapshot("g", &twice, "refused").await, Err(wasmcsi_rbd::RbdError::InvalidArgument(_))));

    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut pauses = Vec::new();
    for k in 0..5 {
        let snap = format!("gs-{k}");
        let taken = p.group_snapshot("g", &images, &snap).await.expect("group snapshot");
        assert_eq!(taken.snapshots.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), [snap.as_str(); 3]);
        pauses.push(taken.pause.expect("locked"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (written, failed) = writer.join().expect("writer");
    let mut sorted = pauses.clone();
    sorted.sort();
    eprintln!(
        "group snapshot of 3 rbd-fuse images: pauses {pauses:?}, median {:?}; {written} writes, {} failed attempts: {:?}",
        sorted[sorted.len() / 2],
        failed.len(),
        failed.iter().take(5).collect::<Vec<_>>()
    );

    let mut prefixes = Vec::new();
    for k in 0..5 {
        let snap = format!("gs-{k}");
        let mut seen = Vec::new();
        for (i, image) in images.iter().enumerate() {
            let blocks = written.div_ceil(3) + 1;
            let data = p.read_snapshot(image, &snap, 0, (blocks * BLOCK) as usize).await.expect("read snapshot");
            for (j, block) in data.chunks(BLOCK as usize).enumerate() {
                if &block[..8] != MAGIC {
                    continue;
                }
                let n = u64::from_le_bytes(block[8..16].try_into().expect("8 bytes"));
                assert_eq!(n, j as u64 * 3 + i as u64, "record {n} in the wrong place ({image} block {j})");
                seen.push(n);
            }
        }
        seen.sort_unstable();
        let k_len = seen.len() as u64;
        assert_eq!(seen, (0..k_len).collect::<Vec<_>>(), "snapshot {snap} is not a prefix of the writes");
        prefixes.push(k_len);
    }
    eprintln!("prefixes held by the 5 group snapshots: {prefixes:?}");
    assert!(prefixes.windows(2).all(|w| w[0] <= w[1]) && prefixes[4] > prefixes[0], "{prefixes:?}");

    // The same again: the same snapshots, nothing locked.
    let again = p.group_snapshot("g", &images, "gs-4").await.expect("again");
    assert_eq!(again.pause, None);
    // An interrupted attempt (one image has the snapshot): taken again on all, at one point.
    p.snapshot_create(&images[1], "gs-partial").await.expect("partial");
    let redone = p.group_snapshot("g", &images, "gs-partial").await.expect("redone");
    assert!(redone.pause.is_some());
    // Removed from every image that has it; then absent succeeds.
    for k in 0..5 {
        let removed = p.group_snapshot_remove("g", &format!("gs-{k}")).await.expect("remove");
        assert_eq!(removed.len(), 3);
    }
    p.group_snapshot_remove("g", "gs-partial").await.expect("remove");
    assert!(p.group_snapshot_remove("g", "gs-0").await.expect("absent").is_empty());
    for i in &images {
        assert!(p.snapshot_list(i).await.expect("list").is_empty());
    }
    for mut a in attached {
        a.detach().expect("detach");
    }
}
