//! The snapshot chain against an in-memory model (seeded random operations, every view compared
//! byte for byte after every step, reopening from disk along the way), plus the specific cases:
//! idempotent retries, fencing, resize, and crashes between the steps of each change.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::block_map::BLOCK;
use super::error::StoreError;
use super::header_file::{HEADER_TMP, layer_file_name};
use super::store::{DATA_FILE, ReplicaStore};
use crate::protocol::Status;
use crate::testutil::Rng;

const SIZE: u64 = 64 * BLOCK;

fn store(dir: &Path) -> ReplicaStore {
    ReplicaStore::create(dir, "v", SIZE).expect("create")
}

fn fill(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    (0..len).map(|_| rng.next() as u8 | 1).collect()
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// What the replica must read: the live volume and every snapshot's frozen copy.
struct Model {
    live: Vec<u8>,
    snapshots: Vec<(String, Vec<u8>)>,
}

impl Model {
    fn check(&self, s: &ReplicaStore, step: &str) {
        let size = self.live.len() as u64;
        assert_eq!(s.header().size, size, "{step}");
        let names: Vec<&str> = self.snapshots.iter().map(|(n, _)| n.as_str()).collect();
        let header = s.header();
        let have: Vec<&str> = header.snapshots.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(have, names, "{step}: chain");
        assert!(s.read(0, size as u32).expect("read") == self.live, "{step}: live view");
        covers(&self.live, &s.list_extents(0, size).expect("extents"), step);
        for (name, data) in &self.snapshots {
            assert!(s.read_snapshot(name, 0, size as u32).expect("read snapshot") == *data, "{step}: view of {name}");
            covers(data, &s.list_snapshot_extents(name, 0, size).expect("extents"), step);
            covers(data, &s.snapshot_delta(None, name, 0, size).expect("delta"), step);
        }
        // Every pair, both ways: the delta covers each block the two views disagree on.
        for (base, old) in &self.snapshots {
            for (name, new) in &self.snapshots {
                let delta = s.snapshot_delta(Some(base), name, 0, size).expect("delta");
                let differ: Vec<u8> = old.iter().zip(new).map(|(a, b)| u8::from(a != b)).collect();
                covers(&differ, &delta, &format!("{step}: delta {base} -> {name}"));
            }
        }
    }
}

/// The 4 KiB blocks an extent list covers.
fn blocks_of(extents: &[crate::protocol::Extent]) -> Vec<u64> {
    extents.iter().flat_map(|e| e.offset / BLOCK..(e.offset + e.len).div_ceil(BLOCK)).collect()
}

/// Every non-zero byte lies inside a listed extent (what a rebuild or clone copies).
fn covers(data: &[u8], extents: &[crate::protocol::Extent], step: &str) {
    let mut listed = vec![false; data.len()];
    for e in extents {
        listed[e.offset as usize..(e.offset + e.len) as usize].fill(true);
    }
    let missed = data.iter().zip(&listed).position(|(&b, &l)| b != 0 && !l);
    assert_eq!(missed, None, "{step}: data outside the extent list");
}

fn random_ops(seed: u64, ops: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut s = store(dir.path());
    let mut m = Model { live: vec![0; SIZE as usize], snapshots: Vec::new() };
    let mut rng = Rng::new(seed);
    let mut next_name = 0;
    for i in 0..ops {
        let size = m.live.len() as u64;
        // Mostly block-sized I/O, sometimes unaligned, sometimes long.
        let range = |rng: &mut Rng| {
            let (off, len) = if rng.chance(50) {
                let b = rng.below(size / BLOCK);
                (b * BLOCK, (1 + rng.below(4)) * BLOCK)
            } else {
                (rng.below(size), 1 + rng.below(3 * BLOCK))
            };
            (off, len.min(size - off))
        };
        let step = format!("seed {seed} op {i}");
        match rng.below(100) {
            0..40 => {
                let (off, len) = range(&mut rng);
                let data = fill(rng.next(), len as usize);
                s.write(off, &data, 0).expect("write");
                m.live[off as usize..(off + len) as usize].copy_from_slice(&data);
            }
            40..55 => {
                let (off, len) = range(&mut rng);
                s.unmap(off, len, 0).expect("unmap");
                m.live[off as usize..(off + len) as usize].fill(0);
            }
            55..67 => {
                let name = format!("s{next_name}");
                next_name += 1;
                s.snapshot(&name, 0).expect("snapshot");
                m.snapshots.push((name, m.live.clone()));
            }
            67..79 if !m.snapshots.is_empty() => {
                let k = rng.below(m.snapshots.len() as u64) as usize;
                let (name, _) = m.snapshots.remove(k);
                s.delete_snapshot(&name, 0).expect("delete");
            }
            79..84 if !m.snapshots.is_empty() => {
                let k = rng.below(m.snapshots.len() as u64) as usize;
                s.revert(&m.snapshots[k].0, 0).expect("revert");
                m.live = m.snapshots[k].1.clone();
                m.snapshots.truncate(k + 1);
            }
            84..88 => {
                let grown = size + rng.below(8) * BLOCK;
                s.resize(grown, 0).expect("resize");
                m.live.resize(grown as usize, 0);
                for (_, d) in &mut m.snapshots {
                    d.resize(grown as usize, 0);
                }
            }
            88..94 => {
                s.flush().expect("flush");
                drop(s);
                s = ReplicaStore::open(dir.path()).expect("reopen");
            }
            _ => s.flush().expect("flush"),
        }
        m.check(&s, &step);
    }
    drop(s);
    m.check(&ReplicaStore::open(dir.path()).expect("reopen"), "final reopen");
}

#[test]
fn random_operations_keep_every_view_byte_exact() {
    for seed in 1..=6 {
        random_ops(seed, 250);
    }
}

#[test]
fn a_snapshot_keeps_the_old_data_while_the_head_takes_new_writes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = store(dir.path());
    s.write(0, &[1; 8192], 0).expect("write");
    s.snapshot("a", 3).expect("snapshot");
    s.write(4096, &[2; 4096], 3).expect("overwrite");
    assert_eq!(s.read_snapshot("a", 0, 8192).expect("read"), vec![1; 8192]);
    assert_eq!(s.read(0, 8192).expect("read"), [vec![1; 4096], vec![2; 4096]].concat());
    let h = s.header();
    assert_eq!((h.snapshots.len(), h.snapshots[0].name.as_str(), h.snapshots[0].revision), (1, "a", 3));
    assert!(h.snapshots[0].created_ns > 1_600_000_000_000_000_000, "wall clock at the replica");
    drop(s);
    let s = ReplicaStore::open(dir.path()).expect("reopen");
    assert_eq!(s.read_snapshot("a", 0, 8192).expect("read"), vec![1; 8192]);
    assert_eq!(s.read(4096, 4096).expect("read"), vec![2; 4096]);
}

#[test]
fn unaligned_writes_over_a_snapshot_keep_the_rest_of_the_block() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = store(dir.path());
    let old = fill(1, 3 * BLOCK as usize);
    s.write(0, &old, 0).expect("write");
    s.snapshot("a", 0).expect("snapshot");
    // Inside one block, across a block boundary, and two writes sharing one block.
    s.write(100, &[9; 10], 0).expect("write");
    s.write(4000, &[8; 200], 0).expect("write");
    s.write(8192 + 10, &[7; 5], 0).expect("write");
    s.write(8192 + 20, &[6; 5], 0).expect("write");
    let mut want = old.clone();
    want[100..110].fill(9);
    want[4000..4200].fill(8);
    want[8202..8207].fill(7);
    want[8212..8217].fill(6);
    assert_eq!(s.read(0, 3 * BLOCK as u32).expect("read"), want);
    assert_eq!(s.read_snapshot("a", 0, 3 * BLOCK as u32).expect("read"), old);
}

#[test]
fn unmap_over_a_snapshot_reads_zeros_while_the_snapshot_keeps_its_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = store(dir.path());
    let old = fill(2, 8 * BLOCK as usize);
    s.write(0, &old, 0).expect("write");
    s.snapshot("a", 0).expect("snapshot");
    s.unmap(100, 6 * BLOCK, 0).expect("unmap");
    let mut want = old.clone();
    want[100..100 + 6 * BLOCK as usize].fill(0);
    assert_eq!(s.read(0, 8 * BLOCK as u32).expect("read"), want);
    assert_eq!(s.read_snapshot("a", 0, 8 * BLOCK as u32).expect("read"), old);
    // Where no snapshot holds data, unmap still frees blocks in the head.
    s.write(32 * BLOCK, &[5; 8 * BLOCK as usize], 0).expect("write");
    s.flush().expect("flush");
    let before = s.allocated_bytes().expect("allocated");
    s.unmap(32 * BLOCK, 8 * BLOCK, 0).expect("unmap");
    s.flush().expect("flush");
    assert_eq!(before - s.allocated_bytes().expect("allocated"), 8 * BLOCK);
    drop(s);
    let s = ReplicaStore::open(dir.path()).expect("reopen");
    assert_eq!(s.read(0, 8 * BLOCK as u32).expect("read"), want, "zeros in the head survive a reopen");
}

#[test]
fn deleting_the_oldest_middle_and_newest_of_three_preserves_the_others() {
    for victim in ["s0", "s1", "s2"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = store(dir.path());
        let mut views = BTreeMap::new();
        for (i, name) in ["s0", "s1", "s2"].iter().enumerate() {
            s.write(i as u64 * 1000, &fill(i as u64, 10_000), 0).expect("write");
            s.snapshot(name, 0).expect("snapshot");
            views.insert(*name, s.read(0, SIZE as u32).expect("read"));
        }
        s.write(5000, &fill(9, 3000), 0).expect("write");
        let live = s.read(0, SIZE as u32).expect("read");
        s.delete_snapshot(victim, 0).expect("delete");
        assert!(matches!(s.delete_snapshot(victim, 0), Err(e) if e.status() == Status::NotFound));
        views.remove(victim);
        let check = |s: &ReplicaStore| {
            for (name, data) in &views {
                assert_eq!(&s.read_snapshot(name, 0, SIZE as u32).expect("read"), data, "{victim} deleted: {name}");
            }
            assert_eq!(s.read(0, SIZE as u32).expect("read"), live);
        };
        check(&s);
        drop(s);
        check(&ReplicaStore::open(dir.path()).expect("reopen"));
        assert_eq!(files(dir.path()).len(), 1 + 3, "header and three layers, nothing leaked");
    }
}

#[test]
fn snapshot_retry_is_idempotent_only_for_the_newest_with_nothing_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = store(dir.path());
    s.write(0, &[1; 4096], 0).expect("write");
    s.snapshot("a", 0).expect("snapshot");
    s.snapshot("a", 0).expect("retry of the newest with nothing written since");
    assert_eq!(s.header().snapshots.len(), 1);
    s.snapshot("b", 0).expect("snapshot");
    assert_eq!(s.snapshot("a", 0).map_err(|e| e.status()), Err(Status::AlreadyExists), "not the newest");
    s.write(0, &[2; 4096], 0).expect("write");
    assert_eq!(s.snapshot("b", 0).map_err(|e| e.status()), Err(Status::AlreadyExists), "written since");
    assert_eq!(s.snapshot("", 0).map_err(|e| e.status()), Err(Status::Invalid));
}

#[test]
fn every_mutation_is_fenced_by_revision() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = store(dir.path());
    s.snapshot("a", 0).expect("snapshot");
    s.set_revision(5).expect("revision");
    let stale = |r: Result<(), StoreError>| assert_eq!(r.map_err(|e| e.status()), Err(Status::StaleRevision));
    stale(s.write(0, &[1], 4));
    stale(s.unmap(0, 1, 4));
    stale(s.snapshot("b", 4));
    stale(s.delete_snapshot("a", 4));
    stale(s.revert("a", 4));
    stale(s.resize(2 * SIZE, 4));
    stale(s.reinitialize(4));
    assert_eq!(s.header().snapshots.len(), 1);
    assert_eq!(s.header().size, SIZE);
}

#[test]
fn missing_snapshots_are_not_found() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = store(dir.path());
    let nf = Err(Status::NotFound);
    assert_eq!(s.delete_snapshot("x", 0).map_err(|e| e.status()), nf);
    assert_eq!(s.revert("x", 0).map_err(|e| e.status()), nf);
    assert_eq!(s.read_snapshot("x", 0, 1).map(|_| ()).map_err(|e| e.status()), nf);
    assert_eq!(s.list_snapshot_extents("x", 0, 1).map(|_| ()).map_err(|e| e.status()), nf);
}

#[test]
fn revert_drops_newer_snapshots_and_the_head() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = store(dir.path());
    s.write(0, &[1; 4096], 0).expect("write");
    s.snapshot("a", 0).expect("snapshot");
    s.write(0, &[2; 4096], 0).expect("write");
    s.snapshot("b", 0).expect("snapshot");
    s.write(4096, &[3; 4096], 0).expect("write");
    s.revert("a", 0).expect("revert");
    assert_eq!(s.read(0, 8192).expect("read"), [vec![1; 4096], vec![0; 4096]].concat());
    assert_eq!(s.header().snapshots.iter().map(|x| x.name.as_str()).collect::<Vec<_>>(), ["a"]);
    s.revert("a", 0).expect("a retry is harmless");
    drop(s);
    assert_eq!(files(dir.path()).len(), 3, "header, a's layer, a fresh head");
    let s = ReplicaStore::open(dir.path()).expect("reopen");
    assert_eq!(s.read(0, 8192).expect("read"), [vec![1; 4096], vec![0; 4096]].concat());
}

#[test]
fn resize_grows_durably_and_the_new_tail_reads_zeros() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = store(dir.path());
    s.write(SIZE - 4096, &[4; 4096], 0).expect("write");
    s.snapshot("a", 0).expect("snapshot");
    s.resize(SIZE, 0).expect("same size is a no-op");
    assert_eq!(s.resize(SIZE - 4096, 0).map_err(|e| e.status()), Err(Status::Invalid));
    assert_eq!(s.resize(SIZE + 1, 0).map_err(|e| e.status()), Err(Status::Invalid));
    s.resize(2 * SIZE, 0).expect("grow");
    assert_eq!(s.read(SIZE, SIZE as u32).expect("read"), vec![0; SIZE as usize]);
    assert_eq!(s.read_snapshot("a", SIZE - 4096, 8192).expect("read"), [vec![4; 4096], vec![0; 4096]].concat());
    s.write(2 * SIZE - 4096, &[5; 4096], 0).expect("write at the new end");
    drop(s);
    let s = ReplicaStore::open(dir.path()).expect("reopen");
    assert_eq!(s.header().size, 2 * SIZE);
    assert_eq!(s.read(2 * SIZE - 4096, 4096).expect("read"), vec![5; 4096]);
}

#[test]
fn reinitialize_drops_everything_and_records_the_revision() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = store(dir.path());
    s.write(0, &[1; 4096], 0).expect("write");
    s.snapshot("a", 0).expect("snapshot");
    s.write(0, &[2; 4096], 0).expect("write");
    s.reinitialize(7).expect("reinitialize");
    let check = |s: &ReplicaStore| {
        let h = s.header();
        assert_eq!((h.revision, h.snapshots.len()), (7, 0));
        assert_eq!(s.read(0, SIZE as u32).expect("read"), vec![0; SIZE as usize]);
        assert!(s.list_extents(0, SIZE).expect("extents").is_empty());
    };
    check(&s);
    drop(s);
    check(&ReplicaStore::open(dir.path()).expect("reopen"));
    assert_eq!(files(dir.path()).len(), 2, "header and one empty head");
}

#[test]
fn crash_leftovers_are_removed_and_the_committed_chain_opens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = store(dir.path());
    s.write(0, &[1; 4096], 0).expect("write");
    s.snapshot("a", 0).expect("snapshot");
    s.write(0, &[2; 4096], 0).expect("write");
    s.flush().expect("flush");
    drop(s);
    let committed = files(dir.path());
    // A snapshot that crashed after creating its new head, and a header replacement that
    // crashed before its rename: neither is committed.
    std::fs::write(dir.path().join(layer_file_name(99)), b"junk").expect("leftover layer");
    std::fs::write(dir.path().join(HEADER_TMP), b"half a header").expect("leftover header");
    std::fs::write(dir.path().join("operator-notes.txt"), b"keep me").expect("foreign file");
    let s = ReplicaStore::open(dir.path()).expect("open");
    assert_eq!(s.read(0, 4096).expect("read"), vec![2; 4096]);
    assert_eq!(s.read_snapshot("a", 0, 4096).expect("read"), vec![1; 4096]);
    let mut want = committed.clone();
    want.push("operator-notes.txt".into());
    want.sort();
    assert_eq!(files(dir.path()), want, "only files this store creates are removed");
}

#[test]
fn a_fold_interrupted_before_its_commit_changes_no_view() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = store(dir.path());
    s.write(0, &fill(1, 16 * BLOCK as usize), 0).expect("write");
    s.snapshot("a", 0).expect("snapshot");
    s.write(4 * BLOCK, &fill(2, 4 * BLOCK as usize), 0).expect("write");
    s.snapshot("b", 0).expect("snapshot");
    s.write(100, &fill(3, 100), 0).expect("write");
    let (va, vb, live) = (
        s.read_snapshot("a", 0, SIZE as u32).expect("read"),
        s.read_snapshot("b", 0, SIZE as u32).expect("read"),
        s.read(0, SIZE as u32).expect("read"),
    );
    // Fold a into b and b into the head, then "crash" before either header commit.
    s.fold(0).expect("fold a");
    s.fold(1).expect("fold b");
    drop(s);
    let s = ReplicaStore::open(dir.path()).expect("reopen");
    assert_eq!(s.header().snapshots.len(), 2);
    assert_eq!(s.read_snapshot("a", 0, SIZE as u32).expect("read"), va);
    assert_eq!(s.read_snapshot("b", 0, SIZE as u32).expect("read"), vb);
    assert_eq!(s.read(0, SIZE as u32).expect("read"), live);
    s.delete_snapshot("a", 0).expect("the delete can be retried");
    assert_eq!(s.read_snapshot("b", 0, SIZE as u32).expect("read"), vb);
}

#[test]
fn a_resize_interrupted_before_its_commit_is_undone_on_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    drop(store(dir.path()));
    let head = std::fs::OpenOptions::new().write(true).open(dir.path().join(DATA_FILE)).expect("open");
    head.set_len(2 * SIZE).expect("extend without a header commit");
    drop(head);
    let s = ReplicaStore::open(dir.path()).expect("open");
    assert_eq!(s.header().size, SIZE);
    assert_eq!(std::fs::metadata(dir.path().join(DATA_FILE)).expect("stat").len(), SIZE);
}

#[test]
fn writes_racing_a_fold_into_the_head_are_never_overwritten() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Arc::new(ReplicaStore::create(dir.path(), "v", 4096 * BLOCK).expect("create"));
    s.write(0, &vec![1; (4096 * BLOCK) as usize], 0).expect("fill");
    s.snapshot("a", 0).expect("snapshot");
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (s, stop) = (s.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = Rng::new(7);
            let mut written = BTreeMap::new();
            while !stop.load(Ordering::Relaxed) {
                let b = rng.below(4096);
                let v = (rng.below(250) + 2) as u8;
                // Half the writes partial, so read-modify-write races the fold too.
                let (off, len) = if rng.chance(50) { (b * BLOCK, BLOCK) } else { (b * BLOCK + 512, 1024) };
                s.write(off, &vec![v; len as usize], 0).expect("write");
                written.insert(b, (off, len, v));
            }
            written
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(20));
    s.delete_snapshot("a", 0).expect("delete");
    stop.store(true, Ordering::Relaxed);
    let written = writer.join().expect("writer");
    assert!(!written.is_empty());
    let all = s.read(0, (4096 * BLOCK) as u32).expect("read");
    for b in 0..4096u64 {
        let block = &all[(b * BLOCK) as usize..((b + 1) * BLOCK) as usize];
        let mut want = vec![1u8; BLOCK as usize];
        if let Some(&(off, len, v)) = written.get(&b) {
            want[(off - b * BLOCK) as usize..(off - b * BLOCK + len) as usize].fill(v);
        }
        // A block written twice may hold both writes' bytes: check only the last write's range
        // and that nothing is zero (the fold never hid a block).
        let (lo, hi) =
            written.get(&b).map_or((0, 0), |&(o, l, _)| ((o - b * BLOCK) as usize, (o - b * BLOCK + l) as usize));
        assert_eq!(&block[lo..hi], &want[lo..hi], "block {b}");
        assert!(block.iter().all(|&x| x != 0), "block {b} lost data");
    }
}

#[test]
fn the_delta_between_snapshots_is_exactly_the_blocks_written_between_them_and_survives_a_fold() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = store(dir.path());
    s.write(0, &fill(1, 16 * BLOCK as usize), 0).expect("write");
    s.snapshot("s1", 0).expect("snapshot");
    // Between s1 and s2: block 3, and an unaligned write over blocks 10 and 11.
    s.write(3 * BLOCK, &fill(2, BLOCK as usize), 0).expect("write");
    s.write(10 * BLOCK + 100, &fill(3, BLOCK as usize), 0).expect("write");
    s.snapshot("s2", 0).expect("snapshot");
    // Between s2 and s3: block 3 again, and block 40 (never written before).
    s.write(3 * BLOCK, &fill(4, BLOCK as usize), 0).expect("write");
    s.write(40 * BLOCK, &fill(5, BLOCK as usize), 0).expect("write");
    s.snapshot("s3", 0).expect("snapshot");
    s.write(50 * BLOCK, &fill(6, BLOCK as usize), 0).expect("write in the head, after every snapshot");
    let delta = |base: Option<&str>, name: &str| blocks_of(&s.snapshot_delta(base, name, 0, SIZE).expect("delta"));
    assert_eq!(delta(Some("s1"), "s2"), [3, 10, 11]);
    assert_eq!(delta(Some("s2"), "s3"), [3, 40]);
    assert_eq!(delta(Some("s1"), "s3"), [3, 10, 11, 40]);
    assert_eq!(delta(Some("s3"), "s1"), [3, 10, 11, 40], "symmetric");
    assert_eq!(delta(Some("s2"), "s2"), Vec::<u64>::new());
    assert_eq!(delta(None, "s1"), (0..16).collect::<Vec<_>>());
    let ranged = s.snapshot_delta(Some("s1"), "s3", 10 * BLOCK + 7, 30 * BLOCK).expect("delta");
    assert_eq!(
        ranged.iter().map(|e| (e.offset, e.len)).collect::<Vec<_>>(),
        [(10 * BLOCK + 7, 2 * BLOCK - 7), (40 * BLOCK, 7)]
    );

    // Folding the middle snapshot keeps the delta of the outer two exact, also after a reopen.
    s.delete_snapshot("s2", 0).expect("delete");
    assert_eq!(delta(Some("s1"), "s3"), [3, 10, 11, 40]);
    drop(s);
    let s = ReplicaStore::open(dir.path()).expect("reopen");
    assert_eq!(blocks_of(&s.snapshot_delta(Some("s1"), "s3", 0, SIZE).expect("delta")), [3, 10, 11, 40]);

    // Folding the base itself makes the delta unknowable: refused, never guessed.
    s.delete_snapshot("s1", 0).expect("delete");
    let gone = s.snapshot_delta(Some("s1"), "s3", 0, SIZE).map(|_| ()).map_err(|e| e.status());
    assert_eq!(gone, Err(Status::NotFound));
    let all = blocks_of(&s.snapshot_delta(None, "s3", 0, SIZE).expect("delta"));
    assert_eq!(all, [(0..16).collect::<Vec<_>>(), vec![40]].concat(), "everything allocated in s3");
    assert!(matches!(s.snapshot_delta(None, "s2", 0, SIZE), Err(e) if e.status() == Status::NotFound));
    assert!(matches!(s.snapshot_delta(Some("s3"), "s3", SIZE, 1), Err(e) if e.status() == Status::OutOfRange));
}
