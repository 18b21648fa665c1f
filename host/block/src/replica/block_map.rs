//! `BlockMap`: which 4 KiB blocks one layer file of a replica holds. Reads of a snapshot chain
//! consult these maps instead of asking the file system (SEEK_DATA) per block, and writes update
//! them without a lock (atomic words), so the map costs a few nanoseconds per block on every path.
//!
//! The invariant the chain relies on: a set bit means the layer's whole 4 KiB block is the
//! block's content at that layer (a layer only ever acquires whole blocks, see `store`); a clear
//! bit means the layer holds nothing there and the block comes from a lower layer.

use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use nix::unistd::{Whence, lseek};

use super::error::{StoreError, nix_err, to_off};

/// Granularity of the chain: the unit of read-modify-write and of folding. Also the largest file
/// system block size a chain is allowed on (see `store::check_fs_block_size`).
pub const BLOCK: u64 = 4096;

/// One bit per [`BLOCK`] of a layer.
#[derive(Debug)]
pub(crate) struct BlockMap {
    blocks: u64,
    words: Vec<AtomicU64>,
}

/// Mask of bits `lo..hi` (both ≤ 64) of one word.
fn mask(lo: u64, hi: u64) -> u64 {
    let upper = if hi >= 64 { u64::MAX } else { (1u64 << hi) - 1 };
    upper & !((1u64 << lo) - 1)
}

impl BlockMap {
    /// An empty map for `blocks` blocks.
    pub(crate) fn new(blocks: u64) -> Self {
        Self { blocks, words: (0..blocks.div_ceil(64)).map(|_| AtomicU64::new(0)).collect() }
    }

    /// The map of `file` as the file system reports it (SEEK_DATA/SEEK_HOLE): every block with
    /// any data in it is held. Used at open, where the maps are rebuilt instead of persisted.
    pub(crate) fn from_file(file: &File, path: &Path, blocks: u64) -> Result<Self, StoreError> {
        let map = Self::new(blocks);
        let len = file.metadata().map_err(|source| StoreError::Io { op: "stat", path: path.into(), source })?.len();
        let mut pos = 0;
        while pos < len {
            let data = match lseek(file, to_off(pos)?, Whence::SeekData) {
                Ok(d) => d as u64,
                // ENXIO: no data at or after `pos`.
                Err(nix::Error::ENXIO) => break,
                Err(e) => return Err(nix_err("seek data in", path)(e)),
            };
            let hole = lseek(file, to_off(data)?, Whence::SeekHole).map_err(nix_err("seek hole in", path))? as u64;
            map.set(data / BLOCK, hole.div_ceil(BLOCK).min(blocks));
            pos = hole;
        }
        Ok(map)
    }

    #[cfg(test)]
    pub(crate) fn blocks(&self) -> u64 {
        self.blocks
    }

    /// A copy with room for `blocks` blocks (never fewer than now): what a resize needs.
    pub(crate) fn grown(&self, blocks: u64) -> Self {
        let grown = Self::new(blocks.max(self.blocks));
        for (dst, src) in grown.words.iter().zip(&self.words) {
            dst.store(src.load(Ordering::Acquire), Ordering::Release);
        }
        grown
    }

    pub(crate) fn get(&self, block: u64) -> bool {
        block < self.blocks && self.words[(block / 64) as usize].load(Ordering::Acquire) & (1 << (block % 64)) != 0
    }

    /// Marks blocks `first..end` held. Callers set bits only *after* the data is in the file, so
    /// a concurrent reader that sees the bit also sees the data.
    pub(crate) fn set(&self, first: u64, end: u64) {
        self.update(first, end, |w, m| {
            w.fetch_or(m, Ordering::AcqRel);
        });
    }

    /// Marks blocks `first..end` not held.
    pub(crate) fn clear(&self, first: u64, end: u64) {
        self.update(first, end, |w, m| {
            w.fetch_and(!m, Ordering::AcqRel);
        });
    }

    fn update(&self, first: u64, end: u64, op: impl Fn(&AtomicU64, u64)) {
        let end = end.min(self.blocks);
        let mut b = first;
        while b < end {
            let word = b / 64;
            let hi = (end - word * 64).min(64);
            op(&self.words[word as usize], mask(b % 64, hi));
            b = word * 64 + hi;
        }
    }

    /// The first block in `from..end` whose bit equals `held`, or `end` if there is none.
    /// Blocks past the map's length count as not held.
    pub(crate) fn next(&self, from: u64, end: u64, held: bool) -> u64 {
        let limit = end.min(self.blocks);
        let mut b = from;
        while b < limit {
            let word = b / 64;
            let mut w = self.words[word as usize].load(Ordering::Acquire);
            if !held {
                w = !w;
            }
            let hi = (limit - word * 64).min(64);
            let bits = w & mask(b % 64, hi);
            if bits != 0 {
                return word * 64 + u64::from(bits.trailing_zeros());
            }
            b = word * 64 + hi;
        }
        if held || from >= end { end } else { b.max(from).min(end) }
    }

    /// Whether any block in `first..end` is held.
    pub(crate) fn any(&self, first: u64, end: u64) -> bool {
        self.next(first, end, true) < end
    }

    /// How many blocks are held.
    #[cfg(test)]
    pub(crate) fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.load(Ordering::Acquire).count_ones())).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::Rng;

    #[test]
    fn set_clear_and_scans_agree_with_a_bool_model() {
        let mut rng = Rng::new(11);
        let n = 300;
        let map = BlockMap::new(n);
        let mut model = vec![false; n as usize];
        for _ in 0..2000 {
            let a = rng.below(n + 1);
            let b = rng.below(n + 1);
            let (lo, hi) = (a.min(b), a.max(b));
            let set = rng.chance(50);
            if set {
                map.set(lo, hi);
            } else {
                map.clear(lo, hi);
            }
            model[lo as usize..hi as usize].fill(set);
            for (i, &x) in model.iter().enumerate() {
                assert_eq!(map.get(i as u64), x, "block {i}");
            }
            let from = rng.below(n);
            let want_held = model[from as usize..].iter().position(|&x| x).map_or(n, |p| from + p as u64);
            let want_free = model[from as usize..].iter().position(|&x| !x).map_or(n, |p| from + p as u64);
            assert_eq!(map.next(from, n, true), want_held);
            assert_eq!(map.next(from, n, false), want_free);
        }
        assert_eq!(map.count(), model.iter().filter(|&&x| x).count() as u64);
    }

    #[test]
    fn ranges_cover_exactly_the_blocks_asked_for() {
        let map = BlockMap::new(200);
        map.set(3, 130);
        assert!(!map.get(2) && map.get(3) && map.get(129) && !map.get(130));
        assert_eq!(map.count(), 127);
        map.clear(64, 65);
        assert!(map.get(63) && !map.get(64) && map.get(65));
        assert_eq!(map.next(60, 200, false), 64);
        assert!(map.any(0, 4) && !map.any(0, 3) && !map.any(150, 200));
        assert_eq!(map.next(150, 500, true), 500, "nothing held: the end of the range");
        assert_eq!(map.next(150, 500, false), 150);
        assert_eq!(map.next(300, 500, false), 300, "past the map counts as not held");
        let grown = map.grown(1000);
        assert_eq!(grown.blocks(), 1000);
        assert_eq!(grown.count(), 126);
    }

    #[test]
    fn from_file_finds_written_blocks() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        let f = File::options().read(true).write(true).create(true).truncate(true).open(&path).expect("create");
        f.set_len(64 * BLOCK).expect("set_len");
        f.write_all_at(&[1; 4096], 5 * BLOCK).expect("write");
        f.write_all_at(&[1; 8192], 40 * BLOCK).expect("write");
        let map = BlockMap::from_file(&f, &path, 64).expect("map");
        assert_eq!(map.count(), 3);
        assert!(map.get(5) && map.get(40) && map.get(41) && !map.get(42));
    }
}
