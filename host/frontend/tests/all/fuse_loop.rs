//! The FUSE + loop frontend against the real kernel: loop devices, ext4, O_DIRECT at queue
//! depth 16, and teardown that leaves nothing behind, also when an attach fails halfway.
//!
//! Needs root, `/dev/fuse`, util-linux and e2fsprogs; each test prints why and passes vacuously
//! when they are missing, because a CI runner without them cannot exercise this path at all.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use wasmcsi_frontend::mkfs::{self, FsType};
use wasmcsi_frontend::{BlockDevice, FailPoint, FileDevice, Frontend, FrontendError, FuseLoopFrontend};

const SIZE: u64 = 256 << 20;
const BLOCK: usize = 4096;
const BLOCKS: u64 = SIZE / BLOCK as u64;

fn skip_reason(tools: &[&str]) -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse missing".into());
    }
    for tool in tools {
        if Command::new("sh").arg("-c").arg(format!("command -v {tool}")).output().map_or(true, |o| !o.status.success())
        {
            return Some(format!("{tool} not installed"));
        }
    }
    None
}

macro_rules! require {
    ($($tool:expr),*) => {
        if let Some(reason) = skip_reason(&[$($tool),*]) {
            eprintln!("SKIPPED: {reason}");
            return;
        }
    };
}

/// Deterministic content of block `idx` at generation `generation` (0 = never written = zeros):
/// pseudo-random payload, then idx, generation and a CRC32 of everything before it, so that a
/// torn, misplaced or stale block is told apart from a correct one.
fn make_block(idx: u64, generation: u64, out: &mut [u8]) {
    if generation == 0 {
        out.fill(0);
        return;
    }
    let mut state = idx.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ generation.wrapping_mul(0xD1B5_4A32_D192_ED03);
    for chunk in out[..BLOCK - 20].chunks_mut(8) {
        // splitmix64
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
    out[BLOCK - 20..BLOCK - 12].copy_from_slice(&idx.to_le_bytes());
    out[BLOCK - 12..BLOCK - 4].copy_from_slice(&generation.to_le_bytes());
    let crc = crc32fast::hash(&out[..BLOCK - 4]);
    out[BLOCK - 4..].copy_from_slice(&crc.to_le_bytes());
}

/// Checks a block read back; returns a description of what is wrong.
fn check_block(idx: u64, generation: u64, got: &[u8]) -> Option<String> {
    let mut want = vec![0u8; BLOCK];
    make_block(idx, generation, &mut want);
    if got == want.as_slice() {
        return None;
    }
    let crc_ok = crc32fast::hash(&got[..BLOCK - 4]).to_le_bytes() == got[BLOCK - 4..];
    let mut field = [0u8; 8];
    field.copy_from_slice(&got[BLOCK - 20..BLOCK - 12]);
    let got_idx = u64::from_le_bytes(field);
    field.copy_from_slice(&got[BLOCK - 12..BLOCK - 4]);
    let got_gen = u64::from_le_bytes(field);
    Some(format!("block {idx}: want gen {generation}, got crc_ok={crc_ok} idx={got_idx} gen={got_gen}"))
}

/// Which generation each block holds after the O_DIRECT test's passes.
fn generation_after_passes(idx: u64) -> u64 {
    if (1024..2048).contains(&idx) {
        0 // discarded
    } else if idx.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 63 == 1 {
        2
    } else {
        1
    }
}

/// A 4 KiB-aligned 4 KiB buffer without unsafe code: an over-allocated Vec and an offset.
struct Aligned {
    buf: Vec<u8>,
    off: usize,
}

impl Aligned {
    fn new() -> Self {
        let buf = vec![0u8; 2 * BLOCK];
        let off = buf.as_ptr().align_offset(BLOCK);
        Self { buf, off }
    }
    fn get(&mut self) -> &mut [u8] {
        &mut self.buf[self.off..self.off + BLOCK]
    }
}

/// Runs `f(thread_buffer, block)` over `blocks` on 16 threads at once (queue depth 16).
fn par_blocks(blocks: &[u64], f: impl Fn(&mut Aligned, u64) + Sync) {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..16 {
            s.spawn(|| {
                let mut buf = Aligned::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&idx) = blocks.get(i) else { break };
                    f(&mut buf, idx);
                }
            });
        }
    });
}

/// The blocks in a scrambled order, so concurrent writes hit scattered offsets.
fn scrambled(n: u64) -> Vec<u64> {
    // Multiplying by an odd constant is a permutation modulo a power of two.
    assert!(n.is_power_of_two());
    (0..n).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) & (n - 1)).collect()
}

fn loop_size(device: &Path) -> u64 {
    let name = device.file_name().and_then(|n| n.to_str()).expect("loop name");
    let sectors = std::fs::read_to_string(format!("/sys/block/{name}/size")).expect("sysfs size");
    sectors.trim().parse::<u64>().expect("sectors") * 512
}

/// Asserts that nothing created under `runtime` is left: no mount, no loop device, no mount
/// directory, and the FUSE filesystem (the only other owner of `dev`) has been dropped, which
/// happens only after all its server threads returned.
fn assert_clean(runtime: &Path, dev: &Arc<dyn BlockDevice>) {
    let needle = runtime.to_str().expect("utf-8 path");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let left: Vec<&str> = mountinfo.lines().filter(|l| l.contains(needle)).collect();
    assert!(left.is_empty(), "mounts left: {left:?}");
    let losetup = Command::new("losetup").arg("-a").output().expect("losetup -a");
    let losetup = String::from_utf8_lossy(&losetup.stdout);
    let left: Vec<&str> = losetup.lines().filter(|l| l.contains(needle)).collect();
    assert!(left.is_empty(), "loop devices left: {left:?}");
    // `owners/` holds this process's owner lock (`wasmcsi_frontend::owner`): it stays while the
    // process lives, whatever it mounted.
    let entries: Vec<PathBuf> = match std::fs::read_dir(runtime) {
        Ok(rd) => rd.map(|e| e.expect("dir entry").path()).filter(|p| !p.ends_with("owners")).collect(),
        Err(_) => Vec::new(),
    };
    assert!(entries.is_empty(), "runtime entries left: {entries:?}");
    assert_eq!(Arc::strong_count(dev), 1, "the FUSE server still holds the device");
}

/// A [`FileDevice`] that records how many writes were in flight at once, to prove that the
/// frontend really serves queue depth > 1 concurrently.
struct CountingDevice {
    inner: FileDevice,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

impl BlockDevice for CountingDevice {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let result = self.inner.write_at(buf, offset);
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        result
    }
    fn flush(&self) -> std::io::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.discard(offset, len)
    }
}

fn open_direct(device: &Path) -> std::fs::File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
        .open(device)
        .expect("open O_DIRECT")
}

/// Pass 1 writes every block, pass 2 overwrites about half (a stale block shows as gen 1), 16 at
/// a time in a scrambled order; returns how many blocks were written.
fn write_passes(disk: &std::fs::File) -> u64 {
    let all = scrambled(BLOCKS);
    par_blocks(&all, |buf, idx| {
        make_block(idx, 1, buf.get());
        disk.write_all_at(buf.get(), idx * BLOCK as u64).expect("write gen 1");
    });
    let second: Vec<u64> = all.iter().copied().filter(|&i| generation_after_passes(i) == 2).collect();
    par_blocks(&second, |buf, idx| {
        make_block(idx, 2, buf.get());
        disk.write_all_at(buf.get(), idx * BLOCK as u64).expect("write gen 2");
    });
    BLOCKS + second.len() as u64
}

/// Reads every block back, 16 at a time, and checks it holds what the passes and the discard
/// left there.
fn verify_via_loop(disk: &std::fs::File) {
    let bad = AtomicU64::new(0);
    par_blocks(&scrambled(BLOCKS), |buf, idx| {
        disk.read_exact_at(buf.get(), idx * BLOCK as u64).expect("read");
        if let Some(what) = check_block(idx, generation_after_passes(idx), buf.get())
            && bad.fetch_add(1, Ordering::Relaxed) < 10
        {
            eprintln!("via loop: {what}");
        }
    });
    assert_eq!(bad.load(Ordering::Relaxed), 0, "mismatching blocks read through the loop device");
}

/// Discards blocks 1024..2048 (see [`generation_after_passes`]), then fsyncs the device.
fn discard_and_sync(device: &Path, disk: &std::fs::File) {
    // Discard reaches the device as a punched hole and reads back as zeros.
    let out = Command::new("blkdiscard")
        .args(["-o", &(1024 * BLOCK).to_string(), "-l", &(1024 * BLOCK).to_string()])
        .arg(device)
        .output()
        .expect("blkdiscard");
    assert!(out.status.success(), "blkdiscard: {}", String::from_utf8_lossy(&out.stderr));
    disk.sync_all().expect("fsync");
}

#[test]
fn odirect_qd16_on_the_loop_device_verifies_every_block() {
    require!("losetup", "blkdiscard");
    let tmp = tempfile::tempdir().expect("tempdir");
    let runtime = tmp.path().join("run");
    let backing = tmp.path().join("backing.img");
    let counting = Arc::new(CountingDevice {
        inner: FileDevice::create(&backing, SIZE).expect("backing file"),
        in_flight: AtomicUsize::new(0),
        max_in_flight: AtomicUsize::new(0),
    });
    let dev: Arc<dyn BlockDevice> = counting.clone();
    let frontend = FuseLoopFrontend::new(&runtime);
    let mut attached = frontend.attach(dev.clone(), "dio").expect("attach");
    let device = attached.device().to_path_buf();
    assert!(std::fs::metadata(&device).expect("device node").file_type().is_block_device());
    assert_eq!(loop_size(&device), SIZE);
    let name = device.file_name().and_then(|n| n.to_str()).expect("loop name");
    let dio = std::fs::read_to_string(format!("/sys/block/{name}/loop/dio")).expect("sysfs dio");
    assert_eq!(dio.trim(), "1", "the loop device should run with direct I/O");

    let disk = open_direct(&device);
    let started = std::time::Instant::now();
    let written = write_passes(&disk);
    let max_in_flight = counting.max_in_flight.load(Ordering::SeqCst);
    eprintln!(
        "{written} 4k O_DIRECT writes at QD16 in {:.2?} ({:.0} IOPS), up to {max_in_flight} in flight at the device",
        started.elapsed(),
        written as f64 / started.elapsed().as_secs_f64()
    );
    assert!(max_in_flight > 1, "writes reached the device one at a time");
    discard_and_sync(&device, &disk);
    verify_via_loop(&disk);
    drop(disk);

    attached.detach().expect("detach");
    drop(attached);
    drop(dev);
    // The frontend's clone of the device is gone once its server threads are.
    assert_eq!(Arc::strong_count(&counting), 1, "the FUSE server still holds the device");
    assert_clean(&runtime, &(counting as Arc<dyn BlockDevice>));

    // The backing file itself holds the data.
    let file = std::fs::File::open(&backing).expect("open backing");
    let mut buf = vec![0u8; BLOCK];
    let mut bad = 0;
    for idx in 0..BLOCKS {
        file.read_exact_at(&mut buf, idx * BLOCK as u64).expect("read backing");
        if let Some(what) = check_block(idx, generation_after_passes(idx), &buf) {
            bad += 1;
            if bad <= 10 {
                eprintln!("in backing file: {what}");
            }
        }
    }
    assert_eq!(bad, 0, "mismatching blocks in the backing file");
}

/// Unmounts on drop, so a failing assertion while mounted does not leave the loop device pinned
/// (an `Attached` refuses to tear down under a mounted filesystem). Declare it after the
/// `Attached` so that it drops first.
struct UnmountGuard<'a>(&'a Path);

impl Drop for UnmountGuard<'_> {
    fn drop(&mut self) {
        let _ = mkfs::unmount(self.0);
    }
}

/// Blocks of the test file on ext4, written 16 at a time by 8 threads.
const FILE_BLOCKS: u64 = 16384; // 64 MiB

#[test]
fn ext4_on_the_loop_device_survives_detach_and_reattach() {
    require!("losetup", "blkid", "mkfs.ext4");
    let tmp = tempfile::tempdir().expect("tempdir");
    let runtime = tmp.path().join("run");
    let backing = tmp.path().join("backing.img");
    let target = tmp.path().join("mnt");
    std::fs::create_dir(&target).expect("mount dir");
    let frontend = FuseLoopFrontend::new(&runtime);

    let dev: Arc<dyn BlockDevice> = Arc::new(FileDevice::create(&backing, SIZE).expect("backing file"));
    let mut attached = frontend.attach(dev.clone(), "fs").expect("attach");
    let device = attached.device().to_path_buf();
    assert_eq!(loop_size(&device), SIZE);
    assert_eq!(mkfs::probe_fs(&device).expect("probe"), None);
    assert_eq!(mkfs::ensure_fs(&device, FsType::Ext4).expect("mkfs"), "ext4");
    mkfs::mount(&device, &target, "ext4", None).expect("mount");
    let guard = UnmountGuard(&target);

    let path = target.join("data.bin");
    let file = OpenOptions::new().read(true).write(true).create_new(true).open(&path).expect("create file");
    file.set_len(FILE_BLOCKS * BLOCK as u64).expect("set_len");
    let chunks: Vec<u64> = (0..FILE_BLOCKS / 16).collect();
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                let mut buf = vec![0u8; 16 * BLOCK];
                while let Some(&chunk) = chunks.get(next.fetch_add(1, Ordering::Relaxed)) {
                    for (i, block) in buf.chunks_mut(BLOCK).enumerate() {
                        make_block(chunk * 16 + i as u64, 1, block);
                    }
                    file.write_all_at(&buf, chunk * 16 * BLOCK as u64).expect("write");
                }
            });
        }
    });
    file.sync_all().expect("fsync");
    drop(file);

    // Detaching under a mounted filesystem is refused and changes nothing.
    match attached.detach() {
        Err(FrontendError::InUse { .. }) => {}
        other => panic!("detach while mounted: {other:?}"),
    }
    assert_eq!(loop_size(&device), SIZE);

    mkfs::unmount(&target).expect("unmount");
    drop(guard);
    attached.detach().expect("detach");
    assert_clean(&runtime, &dev);
    drop((attached, dev));

    // Attach the same backing file again: the filesystem and the file's content are there, and
    // ensure_fs does not reformat.
    let dev: Arc<dyn BlockDevice> = Arc::new(FileDevice::open(&backing).expect("reopen backing"));
    let mut attached = frontend.attach(dev.clone(), "fs").expect("re-attach");
    let device = attached.device().to_path_buf();
    assert_eq!(mkfs::ensure_fs(&device, FsType::Ext4).expect("ensure_fs"), "ext4");
    mkfs::mount(&device, &target, "ext4", None).expect("mount again");
    let guard = UnmountGuard(&target);
    let file = std::fs::File::open(&path).expect("open file");
    let mut buf = vec![0u8; BLOCK];
    let mut bad = 0;
    for idx in 0..FILE_BLOCKS {
        file.read_exact_at(&mut buf, idx * BLOCK as u64).expect("read file");
        if let Some(what) = check_block(idx, 1, &buf) {
            bad += 1;
            if bad <= 10 {
                eprintln!("{what}");
            }
        }
    }
    drop(file);
    mkfs::unmount(&target).expect("unmount");
    drop(guard);
    attached.detach().expect("detach");
    assert_clean(&runtime, &dev);
    assert_eq!(bad, 0, "mismatching blocks in the file after re-attach");
}

fn failed_attach_leaves_nothing(point: FailPoint) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let runtime = tmp.path().join("run");
    let dev: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::create(&tmp.path().join("backing.img"), SIZE).expect("backing file"));
    let frontend = FuseLoopFrontend::new(&runtime).with_fail_point(point);
    match frontend.attach(dev.clone(), "broken") {
        Err(FrontendError::Injected(p)) => assert_eq!(p, point),
        other => panic!("attach with an injected failure: {other:?}"),
    }
    assert_clean(&runtime, &dev);
}

#[test]
fn attach_failing_after_the_fuse_mount_leaves_nothing() {
    require!("losetup");
    failed_attach_leaves_nothing(FailPoint::AfterFuseMount);
}

#[test]
fn attach_failing_after_losetup_leaves_nothing() {
    require!("losetup");
    failed_attach_leaves_nothing(FailPoint::AfterLosetup);
}

#[test]
fn dropping_an_attached_volume_tears_it_down() {
    require!("losetup");
    let tmp = tempfile::tempdir().expect("tempdir");
    let runtime = tmp.path().join("run");
    let dev: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::create(&tmp.path().join("backing.img"), SIZE).expect("backing file"));
    let attached = FuseLoopFrontend::new(&runtime).attach(dev.clone(), "dropped").expect("attach");
    assert!(attached.device().exists());
    drop(attached);
    assert_clean(&runtime, &dev);
}

#[test]
fn invalid_volumes_are_refused_before_touching_the_kernel() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let runtime = tmp.path().join("run");
    let odd: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::create(&tmp.path().join("odd.img"), 1000).expect("backing file"));
    let frontend = FuseLoopFrontend::new(&runtime);
    assert!(matches!(frontend.attach(odd.clone(), "odd"), Err(FrontendError::Invalid(_))));
    let ok: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::create(&tmp.path().join("ok.img"), 1 << 20).expect("backing file"));
    assert!(matches!(frontend.attach(ok.clone(), "../escape"), Err(FrontendError::Invalid(_))));
    assert_clean(&runtime, &odd);
    assert_clean(&runtime, &ok);
}

/// Online expansion: the device grows while a filesystem on it stays mounted, the loop device
/// shows the new size, data written before is intact, the new tail is usable, and XFS grows
/// online to fill it.
#[test]
fn online_resize_grows_the_mounted_device_and_xfs() {
    require!("losetup", "blkid", "mkfs.xfs", "xfs_growfs");
    const BEFORE: u64 = 512 << 20;
    const AFTER: u64 = 1 << 30;
    let tmp = tempfile::tempdir().expect("tempdir");
    let runtime = tmp.path().join("run");
    let target = tmp.path().join("mnt");
    std::fs::create_dir(&target).expect("mount dir");
    let file_dev = Arc::new(FileDevice::create(&tmp.path().join("backing.img"), BEFORE).expect("backing file"));
    let dev: Arc<dyn BlockDevice> = file_dev.clone();
    let mut attached = FuseLoopFrontend::new(&runtime).attach(dev.clone(), "grow").expect("attach");
    let device = attached.device().to_path_buf();
    assert_eq!(mkfs::ensure_fs(&device, FsType::Xfs).expect("mkfs.xfs"), "xfs");
    mkfs::mount(&device, &target, "xfs", None).expect("mount");
    let guard = UnmountGuard(&target);
    let mut block = vec![0u8; BLOCK];
    make_block(7, 1, &mut block);
    std::fs::write(target.join("before"), &block).expect("write before");
    let total = |p: &Path| {
        let st = nix::sys::statvfs::statvfs(p).expect("statvfs");
        st.blocks() as u64 * st.fragment_size() as u64
    };
    let fs_before = total(&target);

    file_dev.grow(AFTER).expect("grow backing device");
    assert_eq!(attached.refresh_size().expect("refresh size"), AFTER);
    assert_eq!(loop_size(&device), AFTER);
    mkfs::grow_fs(&device, "xfs", Some(&target)).expect("xfs_growfs");
    let fs_after = total(&target);
    assert!(fs_after > fs_before + (AFTER - BEFORE) / 2, "xfs grew from {fs_before} to {fs_after}");
    // The new space is usable and the old data intact, through a remount.
    std::fs::write(target.join("after"), vec![0xA5; 64 << 20]).expect("fill the new space");
    mkfs::unmount(&target).expect("unmount");
    mkfs::mount(&device, &target, "xfs", None).expect("remount");
    assert_eq!(std::fs::read(target.join("before")).expect("read before"), block);
    assert_eq!(std::fs::metadata(target.join("after")).expect("after").len(), 64 << 20);
    mkfs::unmount(&target).expect("unmount");
    drop(guard);
    // Shrinking is refused by the device and changes nothing.
    assert!(file_dev.grow(BEFORE).is_err());
    assert_eq!(attached.refresh_size().expect("refresh again"), AFTER);
    attached.detach().expect("detach");
    drop(file_dev);
    assert_clean(&runtime, &dev);
}

/// A copy of the FUSE mount in another mount namespace (what a container runtime, `ip netns
/// exec` or kubelet's mount propagation makes) must not keep the detach waiting forever for the
/// FUSE server: after our unmount the connection is aborted, which ends it in every namespace.
#[test]
fn detach_completes_while_another_mount_namespace_holds_a_copy_of_the_fuse_mount() {
    require!("losetup", "unshare");
    let tmp = tempfile::tempdir().expect("tempdir");
    let runtime = tmp.path().join("run");
    let dev: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::create(&tmp.path().join("backing.img"), SIZE).expect("backing file"));
    let mut attached = FuseLoopFrontend::new(&runtime).attach(dev.clone(), "copied").expect("attach");
    // The new namespace starts with a copy of every mount, ours included, and keeps it.
    let mut holder = Command::new("unshare").args(["--mount", "sleep", "120"]).spawn().expect("unshare");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (tx, rx) = std::sync::mpsc::channel();
    let detacher = std::thread::spawn(move || {
        let result = attached.detach();
        let _ = tx.send(result.is_ok());
        attached
    });
    let finished = rx.recv_timeout(std::time::Duration::from_secs(60));
    let _ = holder.kill();
    let _ = holder.wait();
    assert_eq!(finished, Ok(true), "detach did not complete while another namespace held the mount");
    drop(detacher.join().expect("detach thread"));
    assert_clean(&runtime, &dev);
}

/// A detach aborts its FUSE connection by number, and the kernel gives a number to the next
/// mount as soon as the mount that had it is gone (another volume attached meanwhile, which the
/// integration tests and a busy node do all the time). A number remembered from a mount that is
/// gone must never end the connection that has it now; the right number at the right mount does.
#[test]
fn a_connection_is_aborted_only_through_the_mount_that_has_its_number() {
    use wasmcsi_frontend::fuse::connection::{abort_if_mounted_at, connection_at};
    require!("losetup");
    let tmp = tempfile::tempdir().expect("tempdir");
    let runtime = tmp.path().join("run");
    let frontend = FuseLoopFrontend::new(&runtime);
    let first: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::create(&tmp.path().join("first.img"), SIZE).expect("backing file"));
    let mut attached = frontend.attach(first, "first").expect("attach first");
    let gone_mount = attached.mount_point().expect("a FUSE mount").to_path_buf();
    let gone = connection_at(&gone_mount).expect("the first volume's connection");
    attached.detach().expect("detach first");
    drop(attached);

    let second: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::create(&tmp.path().join("second.img"), SIZE).expect("backing file"));
    let mut block = vec![0u8; BLOCK];
    make_block(7, 1, &mut block);
    second.write_at(&block, 7 * BLOCK as u64).expect("write block 7");
    let mut attached = frontend.attach(second.clone(), "second").expect("attach second");
    let mount = attached.mount_point().expect("a FUSE mount").to_path_buf();
    let live = connection_at(&mount).expect("the second volume's connection");
    // The kernel takes the lowest free number; tests running beside this one may take it first,
    // so the reuse itself is reported, not required: the guard is tested either way.
    eprintln!("first volume's connection {gone}, second's {live}");

    abort_if_mounted_at(&gone_mount, gone);
    abort_if_mounted_at(&gone_mount, live);
    assert!(Path::new(&format!("/sys/fs/fuse/connections/{live}")).exists(), "the live connection was aborted");
    let disk = open_direct(attached.device());
    let mut buf = Aligned::new();
    disk.read_exact_at(buf.get(), 7 * BLOCK as u64).expect("read through the live connection");
    assert_eq!(check_block(7, 1, buf.get()), None);
    drop(disk);

    // Through its own mount, the number does end the connection: reads through the loop device
    // fail, and the detach still completes.
    abort_if_mounted_at(&mount, live);
    let disk = open_direct(attached.device());
    assert!(disk.read_exact_at(buf.get(), 7 * BLOCK as u64).is_err(), "read after the abort");
    drop(disk);
    attached.detach().expect("detach second");
    assert_clean(&runtime, &second);
}

/// A device that completes every request later, on its own thread, in reverse order of arrival:
/// what the replicated engine does (its answers come from the network, in any order). Made
/// with `hold`, it also does what the engine does for a plugged thread: it starts nothing that
/// thread submits until the thread unplugs (a frontend that forgot to would hang).
struct DeferredDevice {
    inner: Arc<FileDevice>,
    jobs: std::sync::Mutex<std::sync::mpsc::Sender<Job>>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: AtomicUsize,
    /// Requests held for their plugged threads, by thread; `None` when the device never holds.
    held: Option<std::sync::Mutex<std::collections::HashMap<std::thread::ThreadId, Vec<Job>>>>,
    /// Unplugs that released something, and the most one of them released.
    unplugs: AtomicUsize,
    max_burst: AtomicUsize,
}

enum Job {
    Write(Vec<u8>, u64, wasmcsi_frontend::WriteDone),
    Read(usize, u64, wasmcsi_frontend::ReadDone),
}

impl DeferredDevice {
    fn new(inner: FileDevice, hold: bool) -> Self {
        let inner = Arc::new(inner);
        let in_flight = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let (dev, count) = (inner.clone(), in_flight.clone());
        // Ends when the device (the only sender) is dropped.
        std::thread::spawn(move || {
            while let Ok(first) = rx.recv() {
                // Let a few more arrive, then answer the newest first.
                std::thread::sleep(std::time::Duration::from_micros(200));
                let mut batch = vec![first];
                batch.extend(rx.try_iter());
                for job in batch.into_iter().rev() {
                    count.fetch_sub(1, Ordering::SeqCst);
                    match job {
                        Job::Write(data, offset, done) => done(dev.write_at(&data, offset)),
                        Job::Read(len, offset, done) => {
                            let mut buf = vec![0u8; len];
                            match dev.read_at(&mut buf, offset) {
                                Ok(()) => done(Ok(&buf)),
                                Err(e) => done(Err(e)),
                            }
                        }
                    }
                }
            }
        });
        Self {
            inner,
            jobs: std::sync::Mutex::new(tx),
            in_flight,
            max_in_flight: AtomicUsize::new(0),
            held: hold.then(Default::default),
            unplugs: AtomicUsize::new(0),
            max_burst: AtomicUsize::new(0),
        }
    }

    fn queue(&self, job: Job) {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        if let Some(held) = &self.held
            && wasmcsi_frontend::is_plugged()
        {
            held.lock().expect("held").entry(std::thread::current().id()).or_default().push(job);
            return;
        }
        self.jobs.lock().expect("job queue").send(job).expect("completion thread alive");
    }
}

impl BlockDevice for DeferredDevice {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.discard(offset, len)
    }
    fn submit_write(&self, data: &[u8], offset: u64, done: wasmcsi_frontend::WriteDone) {
        self.queue(Job::Write(data.to_vec(), offset, done));
    }
    fn submit_read(&self, offset: u64, len: usize, done: wasmcsi_frontend::ReadDone) {
        self.queue(Job::Read(len, offset, done));
    }
    fn unplug(&self) {
        let Some(held) = &self.held else { return };
        let jobs = held.lock().expect("held").remove(&std::thread::current().id()).unwrap_or_default();
        if jobs.is_empty() {
            return;
        }
        self.unplugs.fetch_add(1, Ordering::SeqCst);
        self.max_burst.fetch_max(jobs.len(), Ordering::SeqCst);
        let queue = self.jobs.lock().expect("job queue");
        for job in jobs {
            queue.send(job).expect("completion thread alive");
        }
    }
}

/// Serves O_DIRECT writes at queue depth 16 and a discard from a [`DeferredDevice`] (holding or
/// not) behind two FUSE threads, verifies every block and detaches, leaving nothing behind;
/// returns the device's counters: most requests in flight, unplugs that released something,
/// most released by one.
fn serve_qd16_from_a_deferred_device(hold: bool) -> Option<(usize, usize, usize)> {
    if let Some(why) = skip_reason(&["losetup", "blkdiscard"]) {
        eprintln!("SKIPPED: {why}");
        return None;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let runtime = tmp.path().join("run");
    let device =
        Arc::new(DeferredDevice::new(FileDevice::create(&tmp.path().join("d.img"), SIZE).expect("file"), hold));
    let dev: Arc<dyn BlockDevice> = device.clone();
    // Two FUSE threads against 16 submitters.
    let mut attached = FuseLoopFrontend::new(&runtime).with_threads(2).attach(dev.clone(), "deferred").expect("attach");
    let disk = open_direct(attached.device());
    write_passes(&disk);
    discard_and_sync(attached.device(), &disk);
    verify_via_loop(&disk);
    drop(disk);
    attached.detach().expect("detach");
    drop(attached);
    drop(dev);
    let counts = (
        device.max_in_flight.load(Ordering::SeqCst),
        device.unplugs.load(Ordering::SeqCst),
        device.max_burst.load(Ordering::SeqCst),
    );
    assert_clean(&runtime, &(device as Arc<dyn BlockDevice>));
    Some(counts)
}

#[test]
fn requests_completed_out_of_order_on_another_thread_keep_more_in_flight_than_fuse_threads() {
    let Some((max_in_flight, _, _)) = serve_qd16_from_a_deferred_device(false) else { return };
    eprintln!("up to {max_in_flight} requests in flight at the device with 2 FUSE threads");
    // Only answering out of line serves more than the two threads.
    assert!(max_in_flight > 2, "the frontend waited for each request on its own thread");
}

/// The plug (`wasmcsi_frontend::plug`): a device that starts nothing a plugged FUSE thread
/// submits until that thread unplugs serves every request (so every worker unplugs before it
/// waits), and a worker takes a burst of queued requests under one plug (what lets the engine
/// send them to a replica in one go).
#[test]
fn a_device_that_holds_what_a_plugged_worker_submits_until_it_unplugs_serves_every_request() {
    let Some((_, unplugs, burst)) = serve_qd16_from_a_deferred_device(true) else { return };
    eprintln!("{unplugs} unplugs released held requests, up to {burst} at once");
    assert!(unplugs > 0, "nothing was ever held: the workers do not plug");
    assert!(burst > 1, "no worker took more than one queued request under a plug");
}

/// The handover of a served volume, in one process: writes at queue depth 16 run while the FUSE
/// server is suspended, its connection handed (as a duplicated fd) to a new server over a new
/// device handle, and suspended and resumed again; none fails, every block reads back, and the
/// adopted volume detaches leaving nothing behind.
#[test]
fn a_suspended_volume_is_adopted_by_a_new_server_without_an_io_error() {
    require!("losetup");
    let tmp = tempfile::tempdir().expect("tempdir");
    let runtime = tmp.path().join("run");
    let backing = tmp.path().join("backing.img");
    let first: Arc<dyn BlockDevice> = Arc::new(FileDevice::create(&backing, SIZE).expect("backing file"));
    let attached = FuseLoopFrontend::new(&runtime).attach(first.clone(), "handed").expect("attach");
    let device = attached.device().to_owned();
    let disk = open_direct(&device);

    let writer = std::thread::scope(|s| {
        let writing = s.spawn(|| write_passes(&disk));
        std::thread::sleep(std::time::Duration::from_millis(50));
        let drained = attached.suspend().expect("suspend");
        let session = attached.session_fd().expect("a FUSE session").try_clone_to_owned().expect("dup");
        let mount = attached.mount_point().expect("a mount point").to_owned();
        attached.release();
        // The requests queued meanwhile go to a new server over a new handle of the same data.
        let second: Arc<dyn BlockDevice> = Arc::new(FileDevice::open(&backing).expect("reopen"));
        let adopted =
            FuseLoopFrontend::new(&runtime).adopt(second.clone(), "handed", session, &mount, &device).expect("adopt");
        assert_eq!(adopted.device(), device, "the same loop device");
        adopted.suspend().expect("suspend the adopted one");
        adopted.resume().expect("resume it");
        let written = writing.join().expect("writer");
        (adopted, second, written, drained)
    });
    let (mut adopted, second, written, drained) = writer;
    assert!(written > BLOCKS, "both passes wrote (every write succeeded, or it panicked)");
    eprintln!("drained the first server in {drained:?}");
    discard_and_sync(&device, &disk);
    verify_via_loop(&disk);
    drop(disk);
    adopted.detach().expect("detach the adopted volume");
    assert_eq!(Arc::strong_count(&first), 1, "the first server let go of its device");
    assert_clean(&runtime, &second);
}
