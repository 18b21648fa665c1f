//! The behaviours every target must show, run against the filesystem target (`filesystem.rs`)
//! and the RADOS Gateway (`s3.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use wasmcsi_backup::{
    BackupRequest, BackupStore, CancellationToken, Error, ErrorKind, MemorySource, layout::VolumeKeys,
};

use crate::support::*;

fn req<'a>(volume: &'a str, backup: &'a str, parent: Option<&'a str>, snapshot: &'a str) -> BackupRequest<'a> {
    BackupRequest { volume, backup, parent, snapshot: Some(snapshot) }
}

/// Full backup, then an incremental after a change of ~2.5 chunks: the incremental reads and
/// uploads only the touched chunks; both restore exactly, holes as holes.
pub async fn full_then_incremental(store: &BackupStore, volume: &str) {
    let cancel = CancellationToken::new();
    let chunks = 40;
    let v1 = volume_data(chunks);
    let p1 = progress();
    let m1 = store
        .backup(req(volume, "b1", None, "s1"), Arc::new(MemorySource::new(v1.clone())), &options(), p1.clone(), &cancel)
        .await
        .expect("full backup");
    let s1 = p1.snapshot();
    let distinct = distinct_data_chunks(&v1) as u64;
    assert_eq!(m1.stats.uploaded_chunks, distinct, "every distinct data chunk once, no hole");
    assert_eq!(m1.chunks.len() as u64, chunks - 4, "holes are not in the manifest");
    assert_eq!(s1.transferred_bytes, m1.stats.uploaded_bytes);
    assert!(m1.stats.uploaded_bytes < (distinct - 1) * CHUNK + CHUNK / 4, "the text chunk compressed: {s1:?}");
    assert_eq!(s1.total_bytes, v1.len() as u64);

    // Change 2.5 chunks' worth from the middle of chunk 20 (chunks 20..=22 touched).
    let mut v2 = v1.clone();
    let start = 20 * CHUNK + CHUNK / 2;
    let changed = start..start + 5 * CHUNK / 2;
    v2[changed.start as usize..changed.end as usize]
        .copy_from_slice(&noise(77, (changed.end - changed.start) as usize));
    let source = MemorySource::new(v2.clone()).with_changes("s1", vec![changed.clone()]);
    let p2 = progress();
    let m2 = store
        .backup(req(volume, "b2", Some("b1"), "s2"), Arc::new(source), &options(), p2.clone(), &cancel)
        .await
        .expect("incremental backup");
    let s2 = p2.snapshot();
    assert_eq!(m2.stats.read_bytes, 3 * CHUNK, "only the touched chunks are read: {s2:?}");
    assert_eq!(m2.stats.uploaded_chunks, 3);
    let changed_bytes = changed.end - changed.start;
    assert!(
        m2.stats.uploaded_bytes <= changed_bytes * 3 / 2,
        "uploaded {} for {changed_bytes} changed",
        m2.stats.uploaded_bytes
    );
    assert_eq!(s2.skipped_bytes + s2.read_bytes, v2.len() as u64);
    assert_eq!(m2.parent.as_deref(), Some("b1"));

    let (r1, alloc1) = restore(store, volume, "b1").await.expect("restore b1");
    assert!(r1 == v1, "b1 restores exactly");
    assert!(alloc1 < v1.len() as u64 - 2 * CHUNK, "holes restored as holes: {alloc1} allocated");
    let (r2, _) = restore(store, volume, "b2").await.expect("restore b2");
    assert!(r2 == v2, "b2 restores exactly");

    let listed: Vec<String> = store.list_backups(volume).await.expect("list").into_iter().map(|b| b.backup).collect();
    assert_eq!(listed, ["b1", "b2"]);
    assert_eq!(store.volumes().await.expect("volumes"), [volume]);
}

fn volume_data(chunks: u64) -> Vec<u8> {
    volume(chunks, 1)
}

/// A full backup of data another backup of the volume already stored uploads nothing.
pub async fn dedup_across_backups(store: &BackupStore, volume: &str) {
    let cancel = CancellationToken::new();
    let data = volume_data(24);
    let m1 = store
        .backup(
            req(volume, "a", None, "s1"),
            Arc::new(MemorySource::new(data.clone())),
            &options(),
            progress(),
            &cancel,
        )
        .await
        .expect("first");
    assert!(m1.stats.uploaded_chunks > 0);
    // No parent: every chunk is read and hashed, and found stored.
    let p = progress();
    let m2 = store
        .backup(req(volume, "b", None, "s2"), Arc::new(MemorySource::new(data.clone())), &options(), p.clone(), &cancel)
        .await
        .expect("second");
    assert_eq!(m2.stats.uploaded_chunks, 0, "{:?}", p.snapshot());
    assert_eq!(p.snapshot().chunks_deduplicated, m2.chunks.len() as u64);
    assert_eq!(m1.chunks, m2.chunks);
    // Backing up `a` again is the same backup (a retry after it completed).
    let again = store
        .backup(req(volume, "a", None, "s1"), Arc::new(MemorySource::new(vec![1; 10])), &options(), progress(), &cancel)
        .await
        .expect("retry of a complete backup");
    assert_eq!(again, m1);
    // An incremental from a backup that does not exist is refused, naming it.
    let e = store
        .backup(
            req(volume, "c", Some("nope"), "s3"),
            Arc::new(MemorySource::new(data)),
            &options(),
            progress(),
            &cancel,
        )
        .await
        .expect_err("no parent");
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(e.to_string().contains("nope"), "{e}");
}

/// A chunk flipped behind our back and a chunk deleted are each detected and named, with the
/// volume offset of the chunk.
pub async fn corrupt_and_missing_chunks(store: &BackupStore, volume: &str) {
    let cancel = CancellationToken::new();
    let data = volume_data(16);
    let m = store
        .backup(req(volume, "c", None, "s"), Arc::new(MemorySource::new(data)), &options(), progress(), &cancel)
        .await
        .expect("backup");
    let keys = VolumeKeys::new(volume).expect("keys");
    let target = store.target();

    let (i, hash) = m.chunks[2];
    let key = keys.chunk(&hash);
    let mut stored = target.get(&key).await.expect("get").to_vec();
    let last = stored.len() - 1;
    stored[last] ^= 0x40;
    target.put(&key, Bytes::from(stored)).await.expect("flip");
    let e = restore(store, volume, "c").await.expect_err("corrupt");
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    match &e {
        Error::CorruptChunk { hash: h, offset, .. } => assert_eq!((*h, *offset), (hash, i * CHUNK)),
        other => panic!("{other}"),
    }
    let text = e.to_string();
    assert!(text.contains(&hash.to_string()) && text.contains(&(i * CHUNK).to_string()), "{text}");

    let (j, gone) = m.chunks[5];
    target.delete(&keys.chunk(&gone)).await.expect("delete");
    // Restore the flipped one first, so the missing one is what fails.
    let good = data_chunk(&volume_data(16), i);
    target.put(&key, Bytes::from(wasmcsi_backup::chunk::encode(&good, 1).expect("encode"))).await.expect("repair");
    let e = restore(store, volume, "c").await.expect_err("missing");
    assert_eq!(e.kind(), ErrorKind::MissingChunk, "{e}");
    match &e {
        Error::MissingChunk { hash: h, offset, .. } => assert_eq!((*h, *offset), (gone, j * CHUNK)),
        other => panic!("{other}"),
    }
}

fn data_chunk(data: &[u8], i: u64) -> Vec<u8> {
    data[(i * CHUNK) as usize..((i + 1) * CHUNK) as usize].to_vec()
}

/// A backup that fails half-way, or is cancelled, is never listed; the retry with the same id
/// reuses what the failed attempt uploaded.
pub async fn incomplete_backup_never_listed(store: &BackupStore, volume: &str) {
    let cancel = CancellationToken::new();
    let data = noise(5, 32 * CHUNK as usize);
    let failing = FailingSource { inner: MemorySource::new(data.clone()), ok_reads: 12, reads: AtomicU64::new(0) };
    let e = store
        .backup(req(volume, "x", None, "s"), Arc::new(failing), &options(), progress(), &cancel)
        .await
        .expect_err("read error");
    assert_eq!(e.kind(), ErrorKind::Local, "{e}");
    assert!(store.list_backups(volume).await.expect("list").is_empty());
    assert_eq!(store.manifest(volume, "x").await.expect_err("incomplete").kind(), ErrorKind::NotFound);

    let p = progress();
    let m = store
        .backup(req(volume, "x", None, "s"), Arc::new(MemorySource::new(data.clone())), &options(), p.clone(), &cancel)
        .await
        .expect("retry");
    let s = p.snapshot();
    assert!(s.chunks_deduplicated >= 8, "the first attempt's chunks are reused: {s:?}");
    assert_eq!(s.chunks_deduplicated + s.chunks_transferred, 32);
    assert_eq!(m.chunks.len(), 32);
    assert!(restore(store, volume, "x").await.expect("restore").0 == data);

    // Cancelled while reads wait: fails as cancelled, leaves no manifest.
    let gate = Arc::new(Gate::default());
    let gated = GatedSource {
        inner: MemorySource::new(noise(6, 16 * CHUNK as usize)),
        free_reads: 2,
        reads: AtomicU64::new(0),
        gate: gate.clone(),
    };
    let cancel2 = CancellationToken::new();
    let opts = options();
    let run = store.backup(req(volume, "y", None, "s"), Arc::new(gated), &opts, progress(), &cancel2);
    let canceller = async {
        while gate.waiting.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        cancel2.cancel();
    };
    let (result, ()) = tokio::join!(run, canceller);
    gate.open();
    assert_eq!(result.expect_err("cancelled").kind(), ErrorKind::Cancelled);
    let listed: Vec<String> = store.list_backups(volume).await.expect("list").into_iter().map(|b| b.backup).collect();
    assert_eq!(listed, ["x"]);

    // A crash half-way (the backup's future dropped, as when its process dies: nothing cleans
    // up). Its lease stays until it expires, so a collection now is refused; the retry with the
    // same id resumes from the chunks it uploaded.
    let data = noise(7, 16 * CHUNK as usize);
    let gate = Arc::new(Gate::default());
    let gated = GatedSource {
        inner: MemorySource::new(data.clone()),
        free_reads: 6,
        reads: AtomicU64::new(0),
        gate: gate.clone(),
    };
    let p = progress();
    let crashing = store.backup(req(volume, "z", None, "s"), Arc::new(gated), &opts, p.clone(), &cancel);
    tokio::select! {
        _ = crashing => panic!("the gated backup cannot finish"),
        () = async {
            while p.snapshot().chunks_transferred < 6 || gate.waiting.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        } => {}
    }
    gate.open();
    let listed: Vec<String> = store.list_backups(volume).await.expect("list").into_iter().map(|b| b.backup).collect();
    assert_eq!(listed, ["x"], "the crashed backup is not listed");
    assert_eq!(store.collect_garbage(volume).await.expect_err("lease live").kind(), ErrorKind::Busy);
    let p = progress();
    store
        .backup(req(volume, "z", None, "s"), Arc::new(MemorySource::new(data.clone())), &opts, p.clone(), &cancel)
        .await
        .expect("resumed");
    assert_eq!(p.snapshot().chunks_deduplicated, 6, "{:?}", p.snapshot());
    assert!(restore(store, volume, "z").await.expect("restore").0 == data);
}

/// A collection while a backup runs deletes nothing and says the volume is busy; a backup while
/// a collection holds the volume says the same; after the backup, a collection removes only the
/// chunks no manifest names, and a deleted backup's own chunks go.
pub async fn gc_and_concurrent_backup(store: &BackupStore, volume: &str) {
    let cancel = CancellationToken::new();
    let keys = VolumeKeys::new(volume).expect("keys");
    let base = volume_data(20);
    store
        .backup(
            req(volume, "g1", None, "s1"),
            Arc::new(MemorySource::new(base.clone())),
            &options(),
            progress(),
            &cancel,
        )
        .await
        .expect("g1");
    // An orphan: uploaded by an attempt that never committed (its lease long expired).
    let orphan = noise(99, CHUNK as usize);
    let orphan_hash = wasmcsi_backup::ChunkHash::of(&orphan);
    store
        .target()
        .put(&keys.chunk(&orphan_hash), Bytes::from(wasmcsi_backup::chunk::encode(&orphan, 1).expect("encode")))
        .await
        .expect("orphan");

    // g2 rewrites chunks 10..20 with new data and waits half-way, its new chunks partly uploaded.
    let mut next = base.clone();
    let tail = 10 * CHUNK as usize..20 * CHUNK as usize;
    next[tail.clone()].copy_from_slice(&noise(123, tail.len()));
    let rewritten = 10 * CHUNK..20 * CHUNK;
    let gate = Arc::new(Gate::default());
    let source = GatedSource {
        inner: MemorySource::new(next.clone()).with_changes("s1", vec![rewritten]),
        free_reads: 5,
        reads: AtomicU64::new(0),
        gate: gate.clone(),
    };
    let p = progress();
    let opts = options();
    let running = store.backup(req(volume, "g2", Some("g1"), "s2"), Arc::new(source), &opts, p.clone(), &cancel);
    let collector = async {
        while gate.waiting.load(Ordering::SeqCst) == 0 || p.snapshot().chunks_transferred < 5 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Longer than the lease's TTL: the lease is renewed meanwhile, so it stays live.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let e = store.collect_garbage(volume).await.expect_err("busy");
        assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
        assert!(
            store.target().head(&keys.chunk(&orphan_hash)).await.expect("head").is_some(),
            "a busy collection deletes nothing"
        );
        gate.open();
    };
    let (m2, ()) = tokio::join!(running, collector);
    let m2 = m2.expect("g2 completes after the refused collection");
    assert_eq!(m2.stats.uploaded_chunks, 10);
    assert!(restore(store, volume, "g2").await.expect("restore g2").0 == next);

    // A collection lock held by someone else: the backup steps back.
    store.target().put(&keys.gc_lock(), Bytes::from_static(b"{}")).await.expect("lock");
    let e = store
        .backup(
            req(volume, "g3", None, "s3"),
            Arc::new(MemorySource::new(base.clone())),
            &options(),
            progress(),
            &cancel,
        )
        .await
        .expect_err("gc running");
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    store.target().delete(&keys.gc_lock()).await.expect("unlock");

    // Nothing running: the orphan goes, every referenced chunk stays.
    let r = store.collect_garbage(volume).await.expect("collect");
    assert_eq!(r.chunks_deleted, 1, "{r:?}");
    assert_eq!(r.manifests, 2);
    assert!(store.target().head(&keys.chunk(&orphan_hash)).await.expect("head").is_none());
    assert!(restore(store, volume, "g1").await.expect("g1").0 == base);
    assert!(restore(store, volume, "g2").await.expect("g2").0 == next);

    // Deleting g1 frees the chunks only it used: its data chunks 10..18 (18 and 19 are holes;
    // 0..10 are g2's too).
    assert!(store.delete_backup(volume, "g1").await.expect("delete"));
    assert!(!store.delete_backup(volume, "g1").await.expect("delete again"));
    let r = store.collect_garbage(volume).await.expect("collect");
    assert_eq!(r.chunks_deleted, 8, "{r:?}");
    assert!(restore(store, volume, "g2").await.expect("g2 after g1 went").0 == next);
    assert_eq!(store.manifest(volume, "g1").await.expect_err("gone").kind(), ErrorKind::NotFound);

    // A crashed backup's lease expires; the next collection removes it.
    store.target().put(&keys.lease("crashed"), Bytes::from_static(b"{}")).await.expect("lease");
    assert_eq!(store.collect_garbage(volume).await.expect_err("live lease").kind(), ErrorKind::Busy);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let r = store.collect_garbage(volume).await.expect("collect after expiry");
    assert_eq!(r.stale_leases_removed, 1);
}
