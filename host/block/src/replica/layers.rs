//! One layer of a replica's snapshot chain (a sparse file plus its [`BlockMap`]) and the views
//! over a stack of layers: a read takes each block from the topmost layer that holds it (zeros
//! where none does), and the extent list of a view is the union of its layers' maps. The chain's
//! rules — which layer a write goes to, when a block needs read-modify-write, folding — are in
//! `store` and `chain`; this module only reads and writes files it is given.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{FallocateFlags, fallocate};

use super::block_map::{BLOCK, BlockMap};
use super::error::{StoreError, io_err, nix_err, to_off};

/// Largest piece of a buffered write (see [`Layer::write_at`]).
const WRITE_PIECE: u64 = 16 * 1024;

/// One layer file: a snapshot's frozen data or the live head.
#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) file: File,
    pub(crate) path: PathBuf,
    /// File name inside the replica directory, as the header records it.
    pub(crate) name: String,
    pub(crate) map: BlockMap,
}

impl Layer {
    /// Opens an existing layer file and rebuilds its map from the file system.
    pub(crate) fn open(dir: &Path, name: &str, blocks: u64) -> Result<Self, StoreError> {
        let path = dir.join(name);
        let file = OpenOptions::new().read(true).write(true).open(&path).map_err(io_err("open", &path))?;
        let map = BlockMap::from_file(&file, &path, blocks)?;
        Ok(Self { file, path, name: name.to_owned(), map })
    }

    /// Creates an empty layer of `size` bytes, durable (file and directory entry) before it
    /// returns, so a header that names it never names a file that a crash took away. An existing
    /// file of that name can only be a crash leftover nothing references: it is replaced.
    pub(crate) fn create(dir: &Path, name: &str, size: u64) -> Result<Self, StoreError> {
        let path = dir.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(io_err("create", &path))?;
        file.set_len(size).map_err(io_err("set length of", &path))?;
        file.sync_all().map_err(io_err("fsync", &path))?;
        super::header_file::sync_dir(dir)?;
        Ok(Self { file, path, name: name.to_owned(), map: BlockMap::new(size.div_ceil(BLOCK)) })
    }

    pub(crate) fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), StoreError> {
        // `read_exact_at` retries short reads; callers check ranges, so EOF means the file was
        // truncated behind our back, which is an I/O error, not zeros.
        self.file.read_exact_at(buf, offset).map_err(io_err("read", &self.path))
    }

    /// Fills `buf` only if every byte of it is in the page cache, without waiting for the disk
    /// (`RWF_NOWAIT`): `false` when some of it is not (or on any error, which the blocking
    /// [`Layer::read_at`] then meets and reports). Lets a replica answer a cached read on its
    /// connection task instead of handing it to a blocking thread and back.
    pub(crate) fn read_cached_at(&self, buf: &mut [u8], offset: u64) -> bool {
        let mut done = 0;
        while done < buf.len() {
            match pread_nowait(&self.file, &mut buf[done..], offset + done as u64) {
                Ok(n) if n > 0 => done += n,
                // EOF (the blocking read reports it), EAGAIN (not cached), or a real error.
                _ => return false,
            }
        }
        true
    }

    /// Writes through the page cache in pieces of at most [`WRITE_PIECE`] bytes, aligned to it.
    /// The file system sizes a page cache folio by the write that creates it: one 1 MiB write
    /// leaves a 1 MiB folio, and every later 4 KiB write into it walks all of the folio's 256
    /// block buffers (measured: a third of the replica's CPU under 4 KiB random writes). Pieces
    /// cap folios at 4 blocks for 64 syscalls per MiB (16 KiB pieces measured ~15% more 4 KiB
    /// QD32 writes than 64 KiB ones).
    pub(crate) fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), StoreError> {
        let mut done = 0;
        while done < buf.len() {
            let at = offset + done as u64;
            let room = (WRITE_PIECE - at % WRITE_PIECE) as usize;
            let n = room.min(buf.len() - done);
            self.file.write_all_at(&buf[done..done + n], at).map_err(io_err("write", &self.path))?;
            done += n;
        }
        Ok(())
    }

    pub(crate) fn sync_data(&self) -> Result<(), StoreError> {
        self.file.sync_data().map_err(io_err("fdatasync", &self.path))
    }

    /// Frees `[offset, offset + len)`; it reads as zeros afterwards.
    pub(crate) fn punch(&self, offset: u64, len: u64) -> Result<(), StoreError> {
        if len == 0 {
            return Ok(());
        }
        // KEEP_SIZE: punching the tail must not shrink the layer.
        let flags = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
        fallocate(&self.file, flags, to_off(offset)?, to_off(len)?).map_err(nix_err("punch hole in", &self.path))
    }

    /// Writes zeros over `[offset, offset + len)` as real data, in bounded chunks. Used where a
    /// hole would let an older layer show through; FALLOC_FL_ZERO_RANGE is not an option because
    /// SEEK_DATA reports clean unwritten extents as holes, which would lose the block at reopen.
    pub(crate) fn write_zeros(&self, offset: u64, len: u64) -> Result<(), StoreError> {
        const CHUNK: u64 = 1 << 20;
        let zeros = vec![0; CHUNK.min(len) as usize];
        let mut pos = offset;
        while pos < offset + len {
            let n = CHUNK.min(offset + len - pos);
            self.write_at(&zeros[..n as usize], pos)?;
            pos += n;
        }
        Ok(())
    }

    /// Bytes of the file allocated on disk.
    pub(crate) fn allocated(&self) -> Result<u64, StoreError> {
        use std::os::unix::fs::MetadataExt;
        Ok(self.file.metadata().map_err(io_err("stat", &self.path))?.blocks() * 512)
    }
}

/// The topmost layer of `view` (bottom first) that holds `block`.
pub(crate) fn owner(view: &[&Layer], block: u64) -> Option<usize> {
    view.iter().rposition(|l| l.map.get(block))
}

/// Fills `buf` with the view's bytes at `offset`: each block from its topmost holder, zeros where
/// no layer holds it. One positional read per run of blocks with the same holder, so a read
/// costs bitmap lookups plus as many syscalls as the data is fragmented across layers.
///
/// Never reads past a layer's end: a layer holds only blocks inside its file, and snapshot
/// layers taken before a resize are shorter than the volume.
pub(crate) fn read_view(view: &[&Layer], offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
    let end = offset + buf.len() as u64;
    let mut pos = offset;
    while pos < end {
        let first = pos / BLOCK;
        let who = owner(view, first);
        let mut next = first + 1;
        while next * BLOCK < end && owner(view, next) == who {
            next += 1;
        }
        let run_end = (next * BLOCK).min(end);
        let part = &mut buf[(pos - offset) as usize..(run_end - offset) as usize];
        match who {
            Some(i) => view[i].read_at(part, pos)?,
            None => part.fill(0),
        }
        pos = run_end;
    }
    Ok(())
}

/// The byte ranges of `[offset, offset + len)` that some layer of `view` holds, merged and
/// clipped to the range, at [`BLOCK`] granularity (a range may cover zeros a layer wrote).
pub(crate) fn view_extents(view: &[&Layer], offset: u64, len: u64) -> Vec<(u64, u64)> {
    let end = offset + len;
    let (first, last) = (offset / BLOCK, end.div_ceil(BLOCK));
    let mut out = Vec::new();
    let mut b = first;
    while b < last {
        // The next block any layer holds, then extend while some layer keeps holding it.
        let start = view.iter().map(|l| l.map.next(b, last, true)).min().unwrap_or(last);
        if start >= last {
            break;
        }
        let mut stop = start;
        loop {
            let before = stop;
            for l in view {
                if l.map.get(stop) {
                    stop = l.map.next(stop, last, false);
                }
            }
            if stop == before || stop >= last {
                break;
            }
        }
        let (s, e) = ((start * BLOCK).max(offset), (stop * BLOCK).min(end));
        out.push((s, e - s));
        b = stop;
    }
    out
}

/// `preadv2(.., RWF_NOWAIT)` of one buffer: `EAGAIN` instead of waiting for the disk.
#[allow(unsafe_code, reason = "preadv2 has no safe wrapper in std or nix")]
fn pread_nowait(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd as _;
    let offset = i64::try_from(offset).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let iov = nix::libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: `iov` describes `buf`, which is valid for writes of its whole length and outlives
    // the call; the descriptor is borrowed from `file`, open for the duration of the call.
    let n = unsafe { nix::libc::preadv2(file.as_raw_fd(), &iov, 1, offset, nix::libc::RWF_NOWAIT) };
    usize::try_from(n).map_err(|_| std::io::Error::last_os_error())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_reads_each_block_from_its_topmost_holder() {
        let dir = tempfile::tempdir().expect("tempdir");
        let size = 16 * BLOCK;
        let low = Layer::create(dir.path(), "low", size).expect("low");
        let high = Layer::create(dir.path(), "high", size).expect("high");
        low.write_at(&[1; 4 * BLOCK as usize], 0).expect("write");
        low.map.set(0, 4);
        high.write_at(&[2; BLOCK as usize], BLOCK).expect("write");
        high.map.set(1, 2);
        high.write_at(&[3; BLOCK as usize], 6 * BLOCK).expect("write");
        high.map.set(6, 7);
        let mut buf = vec![9; 8 * BLOCK as usize - 100];
        read_view(&[&low, &high], 50, &mut buf).expect("read");
        let mut want = vec![1u8; 4 * BLOCK as usize];
        want[BLOCK as usize..2 * BLOCK as usize].fill(2);
        want.extend(vec![0; 2 * BLOCK as usize]);
        want.extend(vec![3; BLOCK as usize]);
        want.extend(vec![0; BLOCK as usize]);
        assert_eq!(buf, want[50..50 + buf.len()]);
        assert_eq!(view_extents(&[&low, &high], 100, size - 100), vec![(100, 4 * BLOCK - 100), (6 * BLOCK, BLOCK)]);
        assert_eq!(view_extents(&[&low], 0, size), vec![(0, 4 * BLOCK)]);
    }

    /// A cached read returns the same bytes as a blocking one; past the end of the file it
    /// declines (the blocking read reports the truncation) instead of returning zeros.
    #[test]
    fn a_cached_read_matches_the_file_and_declines_past_its_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let layer = Layer::create(dir.path(), "head", 4 * BLOCK).expect("layer");
        let data: Vec<u8> = (0..2 * BLOCK).map(|i| i as u8).collect();
        layer.write_at(&data, BLOCK).expect("write");
        let mut buf = vec![0; BLOCK as usize + 10];
        assert!(layer.read_cached_at(&mut buf, BLOCK + 5), "just written, so cached");
        assert_eq!(buf, data[5..5 + buf.len()]);
        let mut past = vec![0; 2 * BLOCK as usize];
        assert!(!layer.read_cached_at(&mut past, 3 * BLOCK));
    }
}
