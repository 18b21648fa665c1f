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
