//! Where a restore writes: a file or block device (later a replicated volume). Blocking, like
//! [`crate::Source`]; the restore calls it from tokio's blocking threads.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::Path;

/// A volume being restored.
pub trait Sink: Send + Sync {
    /// Writes `data` at `offset`.
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()>;

    /// Makes `[offset, offset + len)` read as zeros, as a hole where the medium has holes.
    fn write_zeros(&self, offset: u64, len: u64) -> io::Result<()>;

    /// Makes everything written durable.
    fn flush(&self) -> io::Result<()>;
}

/// A regular file (made sparse: truncated and sized, so holes cost nothing) or a block device
/// (holes punched, which a loop device or a thin device turns into discards, or written as zeros
/// where the device cannot).
#[derive(Debug)]
pub struct FileSink {
    file: File,
    /// A fresh sparse file reads zeros everywhere: holes need no call at all.
    fresh: bool,
}

impl FileSink {
    /// Opens `path` for a restore of `size` bytes: a regular file is created or truncated and
    /// sized; a block device must hold at least `size` bytes.
    pub fn create(path: &Path, size: u64) -> io::Result<Self> {
        use std::io::Seek as _;
        let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
        if file.metadata()?.is_file() {
            file.set_len(0)?;
            file.set_len(size)?;
            return Ok(Self { file, fresh: true });
        }
        let have = file.seek(io::SeekFrom::End(0))?;
        if have < size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} holds {have} bytes, the backup {size}", path.display()),
            ));
        }
        Ok(Self { file, fresh: false })
    }
}

impl Sink for FileSink {
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.file.write_all_at(data, offset)
    }

    fn write_zeros(&self, offset: u64, len: u64) -> io::Result<()> {
        use nix::fcntl::{FallocateFlags as F, fallocate};
        if self.fresh || len == 0 {
            return Ok(());
        }
        let (off, n) =
            (i64::try_from(offset).map_err(io::Error::other)?, i64::try_from(len).map_err(io::Error::other)?);
        for flags in [F::FALLOC_FL_PUNCH_HOLE | F::FALLOC_FL_KEEP_SIZE, F::FALLOC_FL_ZERO_RANGE] {
            if fallocate(&self.file, flags, off, n).is_ok() {
                return Ok(());
            }
        }
        let zeros = vec![0u8; 1 << 20];
        let mut pos = offset;
        while pos < offset + len {
            let step = (offset + len - pos).min(zeros.len() as u64) as usize;
            self.file.write_all_at(&zeros[..step], pos)?;
            pos += step as u64;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.file.sync_all()
    }
}
