//! The node's NFS executor against a real kernel NFS client and server. This machine's kernel
//! has neither, so the test body runs in the kernel-VM tier (`testing/vmtest`, a qemu TCG VM with
//! a Debian kernel that has them); it skips only where that tier cannot run at all (see
//! docs/vm-test-tier.md). Covers: staging mount with options, the staged-retry plan, a write
//! as a non-root uid, and an unstage whose server died, which must end (forced or detached)
//! within its deadline instead of hanging the node.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::path::Path;
use std::time::{Duration, Instant};

use wasmcsi_csi::node::nfs::{self, StagePlan, Unmounted};
use wasmcsi_mountinfo as mountinfo;
use wasmcsi_vmtest::guest::{KernelNfsServer, sh};

#[test]
fn nfs_stage_mounts_retries_and_a_dead_server_does_not_wedge_the_unstage() {
    let Some(guest) = wasmcsi_vmtest::enter!() else { return };
    let export = guest.scratch().join("export");
    let server = KernelNfsServer::start(&export, 2).expect("kernel NFS server");
    std::fs::create_dir_all(export.join("vols/pvc-1")).expect("volume directory");
    sh("chown", &["1000:1000", &export.join("vols/pvc-1").to_string_lossy()]).expect("chown");

    let source = nfs::source_spec("127.0.0.1", "/", "vols/pvc-1").expect("source");
    assert_eq!(source, "127.0.0.1:/vols/pvc-1");
    let staging = Path::new("/mnt/staging/pvc-1");
    let options =
        nfs::mount_options(&["nfsvers=4.2".into(), "soft".into(), "timeo=20".into(), "retrans=1".into()], false)
            .expect("options");
    let mounts = mountinfo::read_current().expect("mountinfo");
    assert_eq!(nfs::plan_stage(&mounts, staging, &source), StagePlan::Mount);
    nfs::mount_nfs(&source, staging, &options, nfs::NFS_DEADLINE).expect("mount");
    let mounts = mountinfo::read_current().expect("mountinfo");
    assert_eq!(nfs::plan_stage(&mounts, staging, &source), StagePlan::Done, "a retried stage finds it done");
    let other = nfs::source_spec("127.0.0.1", "/", "vols/other").expect("source");
    assert!(matches!(nfs::plan_stage(&mounts, staging, &other), StagePlan::Conflict(_)));

    let out = sh(
        "setpriv",
        &[
            "--reuid=1000",
            "--regid=1000",
            "--clear-groups",
            "sh",
            "-c",
            "echo hi > /mnt/staging/pvc-1/f && cat /mnt/staging/pvc-1/f",
        ],
    )
    .expect("write as uid 1000");
    assert_eq!(out, "hi\n");
    assert_eq!(std::fs::read_to_string(export.join("vols/pvc-1/f")).expect("on the server"), "hi\n");

    // The server dies with the share mounted: the unstage still ends, bounded.
    drop(server);
    let started = Instant::now();
    let how = nfs::unmount_bounded(staging, Duration::from_secs(5)).expect("bounded unmount");
    assert!(started.elapsed() < Duration::from_secs(20), "unmount took {:?}", started.elapsed());
    assert!(matches!(how, Unmounted::Clean | Unmounted::Forced | Unmounted::Detached), "it was mounted: {how:?}");
    let mounts = mountinfo::read_current().expect("mountinfo");
    assert!(mountinfo::mounts_at(&mounts, staging).is_empty(), "the share is no longer mounted ({how:?})");
    let again = nfs::unmount_bounded(staging, Duration::from_secs(5));
    assert_eq!(again, Ok(Unmounted::NotMounted), "after {how:?}");
}
