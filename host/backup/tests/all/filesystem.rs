//! The scenarios on a filesystem target, its own failure cases, and the memory bound.

use std::sync::Arc;

use wasmcsi_backup::{BackupOptions, BackupRequest, CancellationToken, ErrorKind, FsTarget, MemorySource, Target};

use crate::scenarios;
use crate::support::*;

#[tokio::test]
async fn full_then_incremental() {
    let (_dir, store) = fs_store();
    scenarios::full_then_incremental(&store, "replicated-block:pvc-1").await;
}

#[tokio::test]
async fn dedup_across_backups() {
    let (_dir, store) = fs_store();
    scenarios::dedup_across_backups(&store, "pvc-2").await;
}

#[tokio::test]
async fn corrupt_and_missing_chunks() {
    let (_dir, store) = fs_store();
    scenarios::corrupt_and_missing_chunks(&store, "pvc-3").await;
}

#[tokio::test]
async fn incomplete_backup_never_listed() {
    let (_dir, store) = fs_store();
    scenarios::incomplete_backup_never_listed(&store, "pvc-4").await;
}

#[tokio::test]
async fn gc_and_concurrent_backup() {
    let (_dir, store) = fs_store();
    scenarios::gc_and_concurrent_backup(&store, "pvc-5").await;
}

/// The chunk buffers a backup holds stay under `BackupOptions::buffer_bound` for a small and an
/// eight times larger volume alike: the bound depends on the options, not the volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_is_bounded_whatever_the_volume_size() {
    let (_dir, store) = fs_store();
    let options = BackupOptions { chunk_size: CHUNK, uploads_in_flight: 3, compression_level: 1 };
    let bound = options.buffer_bound(CHUNK);
    let mut peaks = Vec::new();
    for (n, chunks) in [(0, 64u64), (1, 512)] {
        let data = noise(n + 10, (chunks * CHUNK) as usize);
        let p = progress();
        let volume = format!("mem-{n}");
        let m = store
            .backup(
                BackupRequest { volume: &volume, backup: "b", parent: None, snapshot: None },
                Arc::new(MemorySource::new(data)),
                &options,
                p.clone(),
                &CancellationToken::new(),
            )
            .await
            .expect("backup");
        assert_eq!(m.stats.uploaded_chunks, chunks);
        let s = p.snapshot();
        assert_eq!(s.buffered_bytes, 0, "every buffer released");
        assert!(s.peak_buffered_bytes <= bound, "peak {} over the bound {bound}", s.peak_buffered_bytes);
        // More than one chunk was in flight at once (the bound is not met by running serially).
        assert!(s.peak_buffered_bytes > 2 * CHUNK, "peak {}", s.peak_buffered_bytes);
        peaks.push(s.peak_buffered_bytes);
    }
    eprintln!("peak chunk buffers: {peaks:?} bytes, bound {bound}");
}

/// A target whose root is gone reports a missing bucket; one that is full reports so (a 1 MiB
/// tmpfs mounted for the test).
#[tokio::test]
async fn missing_root_and_full_target() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = wasmcsi_backup::BackupStore::new(Arc::new(FsTarget::new(dir.path().join("gone"))), store_options());
    let cancel = CancellationToken::new();
    let e = store
        .backup(
            BackupRequest { volume: "v", backup: "b", parent: None, snapshot: None },
            Arc::new(MemorySource::new(noise(1, 4 * CHUNK as usize))),
            &options(),
            progress(),
            &cancel,
        )
        .await
        .expect_err("no root");
    assert_eq!(e.kind(), ErrorKind::BucketMissing, "{e}");

    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped the full-target half: mounting a tmpfs needs root");
        return;
    }
    let mnt = dir.path().join("small");
    std::fs::create_dir(&mnt).expect("mkdir");
    nix::mount::mount(Some("tmpfs"), &mnt, Some("tmpfs"), nix::mount::MsFlags::empty(), Some("size=1m"))
        .expect("mount a 1 MiB tmpfs");
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            // Detached: an upload task of the failed backup may still hold a file open there
            // for a moment, and a plain umount would then fail and leave the tmpfs behind.
            let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
        }
    }
    let _unmount = Unmount(mnt.clone());
    let target: Arc<dyn Target> = Arc::new(FsTarget::new(&mnt));
    let store = wasmcsi_backup::BackupStore::new(target, store_options());
    let e = store
        .backup(
            BackupRequest { volume: "v", backup: "b", parent: None, snapshot: None },
            Arc::new(MemorySource::new(noise(2, 32 * CHUNK as usize))),
            &options(),
            progress(),
            &cancel,
        )
        .await
        .expect_err("full");
    assert_eq!(e.kind(), ErrorKind::TargetFull, "{e}");
    assert!(store.list_backups("v").await.expect("list").is_empty());
}

/// A file with holes backs up through `FileSource` (its holes never read) and restores through
/// `FileSink` sparse and equal.
#[tokio::test]
async fn file_source_to_file_sink() {
    use std::os::unix::fs::FileExt as _;
    let (_dir, store) = fs_store();
    let src_dir = tempfile::tempdir().expect("tempdir");
    let path = src_dir.path().join("volume");
    let f = std::fs::File::create(&path).expect("create");
    f.set_len(64 * CHUNK).expect("size");
    f.write_all_at(&noise(3, 3 * CHUNK as usize), 10 * CHUNK + 100).expect("write");
    drop(f);
    let source = Arc::new(wasmcsi_backup::FileSource::open(&path).expect("open"));
    let p = progress();
    let m = store
        .backup(
            BackupRequest { volume: "file", backup: "b", parent: None, snapshot: None },
            source,
            &options(),
            p.clone(),
            &CancellationToken::new(),
        )
        .await
        .expect("backup");
    assert_eq!(m.chunks.len(), 4);
    assert!(p.snapshot().read_bytes <= 5 * CHUNK, "holes are not read: {:?}", p.snapshot());
    let (restored, allocated) = restore(&store, "file", "b").await.expect("restore");
    assert!(restored == std::fs::read(&path).expect("read"));
    assert!(allocated <= 5 * CHUNK, "{allocated}");
}
