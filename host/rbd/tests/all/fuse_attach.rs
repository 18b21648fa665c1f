//! rbd-fuse as the node-side attach on this kernel: the image as a file, data written through
//! the file is what librbd reads, the file works under a loop device with a filesystem, and
//! detach leaves no mount, no process and no key on disk. Shares the binary's cluster.
use std::os::unix::fs::FileExt;
use std::process::Command;
use std::time::{Duration, Instant};
use wasmcsi_ceph::{CLUSTER, Ceph};
use wasmcsi_frontend::mkfs::{self, FsType};
use wasmcsi_mountinfo as mountinfo;
use wasmcsi_rbd::CopyProgress;
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

/// Ask for the copy of `image@snap` into `child` (same pool) until it is done: a bounded retry,
/// as the CO's, never a wait on the machine's speed.
async fn copy_until_done(p: &wasmcsi_rbd::RbdPool, image: &str, snap: &str, child: &str, md: &[(String, String)]) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while p.snapshot_copy(image, snap, p.name(), child, &[], md).await.expect("copy") != CopyProgress::Done {
        assert!(Instant::now() < deadline, "the copy of {image}@{snap} into {child} did not finish within 120 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The group snapshot of [`wasmcsi_rbd::RbdPool::group_snapshot`] (librbd's RBD group snapshot)
/// against rbd-fuse clients (the node's attach here), each holding its image open and its
/// exclusive lock: one writer writes one numbered sequence round-robin over three images (`n`
/// to image `n % 3`, block `n / 3`), issuing `n + 1` only once `n` was acknowledged (written
/// and fdatasync'd). Every group snapshot must hold exactly the writes `0..k` for some `k`:
/// never a later write without an earlier one. No write may fail (librbd makes writers wait
/// while it takes the snapshot); the pauses are measured. Then each part restored by copy, one
/// removed alone, an image left in another group, and removal with the group.
#[tokio::test]
async fn group_snapshots_are_one_point_of_a_dependent_writer_across_rbd_fuse_clients() {
    let Some(ceph) = Ceph::shared() else { return };
    ceph.create_pool("group").expect("pool");
    let admin = ceph.admin();
    let client = RbdClient::new(ceph.config(&["group"]));
    let p = client.pool(CLUSTER, "group", &admin).expect("granted");
    // exclusive-lock: what rbd-fuse writers hold while writing (the default features).
    let spec = ImageSpec {
        size_bytes: SIZE,
        features: vec!["layering".into(), "exclusive-lock".into()],
        ..Default::default()
    };
    let images: Vec<String> = ["g-c", "g-a", "g-b"].map(String::from).to_vec();
    for i in &images {
        p.create(i, &spec).await.expect("create");
    }

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

    // Refused before any traffic: an image named twice, a name with `@`.
    assert!(matches!(p.group_snapshot("g@x", &images, "s").await, Err(wasmcsi_rbd::RbdError::InvalidArgument(_))));
    let twice = vec![images[0].clone(), images[0].clone()];
    assert!(matches!(p.group_snapshot("g", &twice, "refused").await, Err(wasmcsi_rbd::RbdError::InvalidArgument(_))));

    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut pauses = Vec::new();
    for k in 0..5 {
        let (group, member) = (format!("g{k}"), format!("g{k}@s"));
        let taken = p.group_snapshot(&group, &images, "s").await.expect("group snapshot");
        assert_eq!(taken.snapshots.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), [member.as_str(); 3]);
        pauses.push(taken.pause.expect("taken"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (written, failed) = writer.join().expect("writer");
    let mut sorted = pauses.clone();
    sorted.sort();
    eprintln!(
        "RBD group snapshot of 3 rbd-fuse images: pauses {pauses:?}, median {:?}; {written} writes, {} failed attempts: {:?}",
        sorted[sorted.len() / 2],
        failed.len(),
        failed.iter().take(5).collect::<Vec<_>>()
    );

    assert!(failed.is_empty(), "writers wait for a group snapshot, they do not fail: {failed:?}");
    let mut prefixes = Vec::new();
    for k in 0..5 {
        let snap = format!("g{k}@s");
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

    // The same again: the same parts, nothing taken.
    let again = p.group_snapshot("g4", &images, "s").await.expect("again");
    assert_eq!(again.pause, None);
    // With an image it was not taken of: that image has no part in it.
    p.create("g-extra", &ImageSpec { size_bytes: 1 << 20, ..Default::default() }).await.expect("create");
    let mut more = images.clone();
    more.push("g-extra".into());
    let e = p.group_snapshot("g4", &more, "s").await.expect_err("other images");
    assert!(matches!(&e, wasmcsi_rbd::RbdError::AlreadyExists(m) if m.contains("g-extra")), "{e:?}");
    assert_eq!(ceph.rbd(&["group", "image", "list", "group/g4"]).expect("ls").trim(), "", "nothing left in the group");
    p.remove("g-extra").await.expect("remove");

    // Restored by copy, byte for byte what the part holds (the copy in the background; a
    // retry answers progress, then done); the copy carries the metadata given.
    let len = (written.div_ceil(3) + 1) * BLOCK;
    let md = vec![("k".to_owned(), "restored".to_owned())];
    copy_until_done(&p, &images[1], "g2@s", "g-copy", &md).await;
    let copied = p.read("g-copy", 0, len as usize).await.expect("read copy");
    assert_eq!(copied, p.read_snapshot(&images[1], "g2@s", 0, len as usize).await.expect("read part"));
    let info = p.info("g-copy").await.expect("info").expect("exists");
    assert!(info.metadata.contains(&md[0]) && info.parent.is_none(), "{info:?}");
    assert!(!info.metadata.iter().any(|(k, _)| k == wasmcsi_rbd::copy::INCOMPLETE));
    assert_eq!(
        p.snapshot_copy(&images[1], "g2@s", "group", "g-copy", &[], &md).await.expect("again"),
        CopyProgress::Done
    );
    // A copy a dead process left (the marker still on): removed and copied again.
    ceph.rbd(&["image-meta", "set", "group/g-copy", wasmcsi_rbd::copy::INCOMPLETE, "1"]).expect("mark");
    ceph.rbd(&["bench", "--io-type", "write", "--io-size", "4K", "--io-total", "64K", "group/g-copy"])
        .expect("scribble");
    copy_until_done(&p, &images[1], "g2@s", "g-copy", &md).await;
    assert_eq!(p.read("g-copy", 0, len as usize).await.expect("read copy"), copied, "copied afresh");
    let e = p.snapshot_copy(&images[1], "g9@s", "group", "g-none", &[], &md).await.expect_err("no such part");
    assert!(matches!(e, wasmcsi_rbd::RbdError::NotFound(_)), "{e:?}");
    p.remove("g-copy").await.expect("remove copy");

    // A part removed alone: the group snapshot keeps the others.
    p.snapshot_remove(&images[0], "g0@s").await.expect("remove a part");
    let names = |v: Vec<wasmcsi_rbd::ImageSnapshot>| v.into_iter().map(|s| s.name).collect::<Vec<_>>();
    assert!(!names(p.snapshot_list(&images[0]).await.expect("list")).contains(&"g0@s".to_owned()));
    assert!(names(p.snapshot_list(&images[1]).await.expect("list")).contains(&"g0@s".to_owned()));
    // An image left in another group (an interrupted attempt, or by hand) is taken out of it.
    ceph.rbd(&["group", "create", "group/stray"]).expect("group");
    ceph.rbd(&["group", "image", "add", "group/stray", &format!("group/{}", images[2])]).expect("add");
    p.group_snapshot("g5", &images, "s").await.expect("taken out of the stray group first");
    assert_eq!(ceph.rbd(&["group", "image", "list", "group/stray"]).expect("ls").trim(), "");
    // Removed with the group, which goes too; absent succeeds.
    for k in 0..6 {
        p.group_snapshot_remove(&format!("g{k}"), "s").await.expect("remove");
    }
    p.group_snapshot_remove("g0", "s").await.expect("absent");
    for i in &images {
        assert!(p.snapshot_list(i).await.expect("list").is_empty());
    }
    assert_eq!(ceph.rbd(&["group", "list", "group"]).expect("groups").trim(), "stray");
    for mut a in attached {
        a.detach().expect("detach");
    }
}
