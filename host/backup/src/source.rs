//! What a backup reads: a frozen view of a volume (a snapshot) that reads byte ranges and says
//! which ranges may differ from an earlier snapshot. The replica layer chain answers the latter
//! from its layers' block bitmaps (no read of the volume); [`FileSource`] from the file's
//! allocation map for a full backup; [`MemorySource`] from what a test tells it.
//!
//! The methods are blocking (a replica's layers and a file are read with positional reads): the
//! backup calls them on tokio's blocking threads, a bounded number at a time.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt as _;
use std::path::Path;

/// Which bytes may differ from the base a backup compares against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Changes {
    /// Only these byte ranges may differ (any order, may overlap; a superset is always correct).
    /// Against no base, the ranges that may hold anything but zeros.
    Ranges(Vec<Range<u64>>),
    /// Unknown: every chunk is read (and compared with the base by hash, so only changed chunks
    /// are still uploaded).
    Everything,
}

/// A frozen view of a volume.
pub trait Source: Send + Sync {
    /// The volume's size in bytes as of this view.
    fn size(&self) -> u64;

    /// What may differ from snapshot `since` of the same volume (`None`: from all zeros).
    /// A source that cannot tell answers [`Changes::Everything`].
    fn changes(&self, since: Option<&str>) -> io::Result<Changes>;

    /// Fills `buf` with the bytes at `offset` (the range is inside [`Self::size`]).
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
}

/// A volume in memory with the changes a test declares.
#[derive(Debug, Clone, Default)]
pub struct MemorySource {
    pub data: Vec<u8>,
    /// `(since, ranges)`: the answer to `changes(Some(since))`; other bases get `Everything`.
    pub changed_since: Option<(String, Vec<Range<u64>>)>,
}

impl MemorySource {
    pub fn new(data: Vec<u8>) -> Self {
        Self { data, changed_since: None }
    }

    /// The same data, declaring `ranges` as what changed since snapshot `since`.
    pub fn with_changes(mut self, since: &str, ranges: Vec<Range<u64>>) -> Self {
        self.changed_since = Some((since.to_owned(), ranges));
        self
    }
}

impl Source for MemorySource {
    fn size(&self) -> u64 {
        self.data.len() as u64
    }

    fn changes(&self, since: Option<&str>) -> io::Result<Changes> {
        Ok(match (since, &self.changed_since) {
            (None, _) => Changes::Everything,
            (Some(s), Some((base, ranges))) if s == base => Changes::Ranges(ranges.clone()),
            (Some(_), _) => Changes::Everything,
        })
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(io::Error::other)?;
        let src = self
            .data
            .get(start..start + buf.len())
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

/// A file or block device read as a volume. Against no base, a regular file answers its data
/// ranges (`SEEK_DATA`/`SEEK_HOLE`), so its holes are never read; against a base it cannot tell.
#[derive(Debug)]
pub struct FileSource {
    file: File,
    size: u64,
}

impl FileSource {
    pub fn open(path: &Path) -> io::Result<Self> {
        use std::io::Seek as _;
        let mut file = File::open(path)?;
        // Seeking to the end sizes block devices too (their metadata says 0).
        let size = file.seek(io::SeekFrom::End(0))?;
        Ok(Self { file, size })
    }

    fn data_ranges(&self) -> io::Result<Option<Vec<Range<u64>>>> {
        use nix::unistd::{Whence, lseek};
        if !self.file.metadata()?.is_file() {
            return Ok(None);
        }
        let mut out = Vec::new();
        let mut pos = 0u64;
        while pos < self.size {
            let at = i64::try_from(pos).map_err(io::Error::other)?;
            let start = match lseek(&self.file, at, Whence::SeekData) {
                Ok(s) => s as u64,
                Err(nix::errno::Errno::ENXIO) => break,
                // A filesystem without SEEK_DATA: read it all.
                Err(nix::errno::Errno::EINVAL) => return Ok(None),
                Err(e) => return Err(e.into()),
            };
            let end = lseek(&self.file, start as i64, Whence::SeekHole).map_err(io::Error::from)? as u64;
            out.push(start..end.min(self.size));
            pos = end;
        }
        Ok(Some(out))
    }
}

impl Source for FileSource {
    fn size(&self) -> u64 {
        self.size
    }

    fn changes(&self, since: Option<&str>) -> io::Result<Changes> {
        match since {
            None => Ok(self.data_ranges()?.map_or(Changes::Everything, Changes::Ranges)),
            Some(_) => Ok(Changes::Everything),
        }
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_source_reports_its_data_ranges() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("vol");
        let f = File::create(&path).expect("create");
        f.set_len(8 << 20).expect("size");
        f.write_all_at(&[1; 4096], 3 << 20).expect("write");
        drop(f);
        let s = FileSource::open(&path).expect("open");
        assert_eq!(s.size(), 8 << 20);
        let Changes::Ranges(r) = s.changes(None).expect("changes") else { panic!("tmp supports SEEK_DATA") };
        assert!(r.iter().any(|r| r.contains(&(3 << 20))), "{r:?}");
        let covered: u64 = r.iter().map(|r| r.end - r.start).sum();
        assert!(covered < 1 << 20, "{r:?}");
        assert_eq!(s.changes(Some("s1")).expect("changes"), Changes::Everything);
        let mut buf = [0; 2];
        s.read_at((3 << 20) + 4095, &mut buf).expect("read");
        assert_eq!(buf, [1, 0]);
    }
}
