//! The VM tier proven on what it exists for: the kernel frontends this machine's kernel lacks.
//! Each test boots its own VM (~10 s under TCG) and runs its body there as root.

use std::fs;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use wasmcsi_vmtest::guest::{KernelNfsServer, NbdDevice, sh};
use wasmcsi_vmtest::{Error, Vm};

#[test]
fn modules_for_the_kernel_frontends_are_loaded() {
    let Some(_guest) = wasmcsi_vmtest::enter!() else { return };
    let release = sh("uname", &["-r"]).expect("uname");
    assert!(release.starts_with("6.12."), "the VM runs the fetched 6.12 kernel, not {release}");
    for module in ["nfs", "nfsv4", "nfsd", "nbd", "ublk_drv", "rbd", "loop"] {
        assert!(Path::new("/sys/module").join(module).exists(), "module {module} is not loaded in the VM");
    }
    for node in ["/dev/ublk-control", "/dev/nbd0", "/dev/vda"] {
        assert!(Path::new(node).exists(), "{node} is missing in the VM");
    }
    // Modules outside the initramfs list load on demand from the guest layer's kmod.
    sh("modprobe", &["zram"]).expect("modprobe zram");
    assert!(Path::new("/sys/module/zram").exists(), "modprobe zram did not load it");
}

#[test]
fn kernel_nfs_mount_round_trips_for_a_non_root_user() {
    let Some(guest) = wasmcsi_vmtest::enter!() else { return };
    let export = guest.scratch().join("export");
    let server = KernelNfsServer::start(&export, 2).expect("start the kernel NFS server");
    sh("chmod", &["0777", &export.to_string_lossy()]).expect("chmod the export");

    let mnt = Path::new("/mnt/wasmcsi-nfs");
    fs::create_dir_all(mnt).expect("create the mount point");
    let mnt_arg = mnt.to_string_lossy();
    sh("mount", &["-t", "nfs4", "-o", "vers=4.2", &server.source("/"), &mnt_arg]).expect("mount -t nfs4");
    let mounts = fs::read_to_string("/proc/self/mounts").expect("read mounts");
    assert!(mounts.lines().any(|l| l.contains(" /mnt/wasmcsi-nfs nfs4 ")), "no nfs4 mount on {mnt_arg} in:\n{mounts}");

    // uid 1000 writes through the kernel client; the server stores it under that uid.
    let script = "mkdir /mnt/wasmcsi-nfs/d && echo written-over-nfs > /mnt/wasmcsi-nfs/d/f && cat /mnt/wasmcsi-nfs/d/f";
    let read_back = sh("setpriv", &["--reuid=1000", "--regid=1000", "--clear-groups", "sh", "-c", script])
        .expect("write and read as uid 1000 over NFS");
    assert_eq!(read_back, "written-over-nfs\n");
    let on_server = fs::read_to_string(export.join("d/f")).expect("the file is in the exported directory");
    assert_eq!(on_server, "written-over-nfs\n");
    let owner = sh("stat", &["-c", "%u:%g", &export.join("d/f").to_string_lossy()]).expect("stat");
    assert_eq!(owner.trim(), "1000:1000", "the server must store the client's uid");
    // Root on the client sees the same bytes (no_root_squash).
    assert_eq!(fs::read_to_string(mnt.join("d/f")).expect("read as root over NFS"), "written-over-nfs\n");

    sh("umount", &[&mnt_arg]).expect("umount the NFS mount");
    drop(server);
}

#[test]
fn nbd_device_carries_an_ext4_filesystem() {
    let Some(guest) = wasmcsi_vmtest::enter!() else { return };
    let image = guest.scratch().join("nbd.img");
    fs::File::create(&image).and_then(|f| f.set_len(64 << 20)).expect("create the image");
    let nbd = NbdDevice::attach(&image).expect("attach the image to an NBD device");
    let dev = nbd.path().to_string_lossy().into_owned();
    sh("mkfs.ext4", &["-q", &dev]).expect("mkfs.ext4 on NBD");

    let mnt = Path::new("/mnt/wasmcsi-nbd");
    fs::create_dir_all(mnt).expect("create the mount point");
    let mnt_arg = mnt.to_string_lossy().into_owned();
    let pattern: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    sh("mount", &[&dev, &mnt_arg]).expect("mount the NBD device");
    fs::write(mnt.join("data"), &pattern).expect("write through NBD");
    sh("umount", &[&mnt_arg]).expect("umount");
    // Remounted, the data comes back from the server, not from the page cache of the mount.
    sh("mount", &[&dev, &mnt_arg]).expect("mount again");
    assert!(fs::read(mnt.join("data")).expect("read through NBD") == pattern, "data read back differs");
    sh("umount", &[&mnt_arg]).expect("umount");
    drop(nbd);
}

/// The plumbing itself: output and exit status cross the VM boundary, a failing command fails
/// its caller, and the hard timeout holds. Runs on the host only (it boots its own VMs).
#[test]
fn the_vm_reports_output_status_and_timeout() {
    if wasmcsi_vmtest::in_vm() {
        return;
    }
    let vm = Vm::new().scratch("0").timeout(Duration::from_secs(120));
    let out = match vm.output("sh", &["-c", "echo to-stdout; echo to-stderr >&2; exit 7"]) {
        Ok(out) => out,
        Err(Error::Unavailable(why)) if !wasmcsi_vmtest::required() => {
            let _ = writeln!(std::io::stderr(), "skipped: {why}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    assert_eq!(out.status, 7);
    assert_eq!(out.stdout, b"to-stdout\n");
    assert_eq!(out.stderr, b"to-stderr\n");

    let err = Vm::new().scratch("0").timeout(Duration::from_secs(15)).run("sleep", &["600"]).expect_err("times out");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
}
