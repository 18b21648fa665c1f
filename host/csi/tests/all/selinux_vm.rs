//! SELinux labels from the CO's `context=` mount flag (kubelet adds it when the CSIDriver says
//! `seLinuxMount: true`) on every kind of filesystem volume the node makes, against a kernel that
//! enforces labels. This machine's kernel has no SELinux: the body runs in the kernel-VM tier
//! (`testing/vmtest`), booted with `security=selinux` and a minimal permissive policy, so what
//! is checked is the label the kernel gives the volume's files, not access decisions.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::path::Path;

use wasmcsi_csi::node::filesystem::{Filesystem, unmount_all};
use wasmcsi_csi::node::{mount_options, nfs};
use wasmcsi_mountinfo as mountinfo;
use wasmcsi_runtime::bindings::types;
use wasmcsi_runtime::driver;
use wasmcsi_vmtest::guest::{KernelNfsServer, load_selinux_policy, selinux_label, sh};

/// kubelet's label for a pod: MCS categories, so a comma inside the quoted value.
const LABEL: &str = "system_u:object_r:container_file_t:s0:c3,c7";

fn capability(flags: &[String]) -> driver::VolumeCapability {
    driver::VolumeCapability {
        access_type: types::AccessType::Mount(types::MountVolume {
            fs_type: String::new(),
            mount_flags: flags.to_vec(),
        }),
        access_mode: types::AccessMode::SingleNodeWriter,
    }
}

fn labels_under(dir: &Path) -> Vec<(String, String)> {
    let out = sh("find", &[&dir.to_string_lossy(), "-xdev", "-printf", "%p %Z\n"]).expect("find");
    out.lines().filter_map(|l| l.split_once(' ')).map(|(p, z)| (p.to_owned(), z.to_owned())).collect()
}

#[test]
fn a_co_selinux_context_labels_block_filesystems_nfs_shares_and_directory_volumes() {
    let vm = wasmcsi_vmtest::Vm::new().kernel_arg("security=selinux");
    let Some(guest) = wasmcsi_vmtest::enter!(vm) else { return };
    load_selinux_policy().expect("minimal SELinux policy");
    let flags = vec!["noatime".to_owned(), format!("context=\"{LABEL}\"")];

    // A filesystem on a block device (a replicated or RBD volume's): formatted blank, mounted
    // with the context, so every file shows it without a write to the volume.
    let image = guest.scratch().join("volume.img");
    sh("truncate", &["-s", "128M", &image.to_string_lossy()]).expect("image");
    let device = sh("losetup", &["-f", "--show", &image.to_string_lossy()]).expect("loop");
    let device = Path::new(device.trim());
    let staging = Path::new("/mnt/selinux/block");
    let mut fs = Filesystem::wanted("ext4", &flags, false).expect("wanted");
    fs.format_and_mount(device, staging, "the test volume").expect("format and mount with the context");
    std::fs::write(staging.join("written"), "x").expect("write");
    assert_eq!(selinux_label(staging).expect("root"), LABEL);
    assert_eq!(selinux_label(&staging.join("written")).expect("file"), LABEL);
    let mounts = mountinfo::read_current().expect("mountinfo");
    let entry = mountinfo::mounts_at(&mounts, staging).last().copied().expect("mounted");
    assert!(
        entry.super_options.iter().any(|o| o.contains(LABEL)),
        "the superblock shows the context: {:?}",
        entry.super_options
    );
    unmount_all(staging, None).expect("unmount");
    sh("losetup", &["-d", &device.to_string_lossy()]).expect("detach");

    // An NFS share: the CO's flags follow the backend's options to mount(8), the quoted context
    // as one option. mount(8) passes SELinux options on only where libselinux sees an SELinux
    // host: selinuxfs mounted and an /etc/selinux/config (load_selinux_policy gives this guest
    // both, as an SELinux node has them; the node plugin's pod mounts the node's).
    let export = guest.scratch().join("export");
    let server = KernelNfsServer::start(&export, 2).expect("kernel NFS server");
    std::fs::create_dir_all(export.join("pvc-1")).expect("volume directory");
    std::fs::write(export.join("pvc-1/old"), "x").expect("a file from before");
    let mut options = nfs::mount_options(&["nfsvers=4.2".into(), "soft".into()], false).expect("options");
    for opt in nfs::co_options(&capability(&flags)).expect("the CO's options") {
        options = format!("{options},{opt}");
    }
    let share = Path::new("/mnt/selinux/nfs");
    nfs::mount_nfs(&server.source("pvc-1"), share, &options, nfs::NFS_DEADLINE).expect("mount the share");
    let on_share = selinux_label(&share.join("old"));
    nfs::unmount_bounded(share, nfs::NFS_DEADLINE).expect("unmount the share");
    drop(server);
    assert_eq!(on_share.expect("label on the share"), LABEL, "mount options {options}");

    // A directory volume (bind-mounted, which takes no context): its tree is relabelled, the
    // root last; a second stage finds it done.
    let dir = guest.scratch().join("dirvol");
    std::fs::create_dir_all(dir.join("sub")).expect("tree");
    std::fs::write(dir.join("sub/file"), "x").expect("file");
    std::os::unix::fs::symlink("/etc/hostname", dir.join("link")).expect("symlink");
    let label = mount_options::selinux_context(&flags).expect("context").expect("one");
    mount_options::relabel_tree(&dir, &label).expect("relabel");
    let labels = labels_under(&dir);
    assert_eq!(labels.len(), 4, "{labels:?}");
    assert!(labels.iter().all(|(_, z)| z == LABEL), "{labels:?}");
    assert_ne!(selinux_label(Path::new("/etc/hostname")).unwrap_or_default(), LABEL, "the link is not followed");
    mount_options::relabel_tree(&dir, &label).expect("a retried stage");
}
