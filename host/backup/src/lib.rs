//! The backup store: a volume's data as content-addressed, compressed, deduplicated chunks with one
//! manifest per backup, on a filesystem path or S3-compatible object storage; incremental backup
//! from a [`Source`] that reports what changed, verified restore into a [`Sink`], deletion, and
//! garbage collection that is safe against concurrent backups. It owns the format, the targets
//! ([`Target`], named in configuration by [`BackupTargets`]) and the data movement. It does not
//! own snapshots (the replica layer chain implements [`Source`]), scheduling, retention, or
//! CSI: the engine and the CSI layer call it.
//!
//! # Format
//! - **Chunks of 2 MiB at fixed, volume-aligned offsets** ([`manifest::DEFAULT_CHUNK`]; a power
//!   of two from 64 KiB to 16 MiB per volume, kept by every incremental). Fixed offsets because a
//!   block volume's data does not shift: the changed-block map (4 KiB blocks) says exactly which
//!   chunks to read, and content-defined chunking would only add CPU. 2 MiB because a changed
//!   region of a few MiB costs at most one extra chunk at each end (a 10 MiB change uploads
//!   ≤ 14 MiB), while a request per 2 MiB keeps the per-object overhead of S3 small (512
//!   objects per GiB, `uploads_in_flight` of them at once) and the manifest at 40 bytes of
//!   memory per data chunk. Longhorn uses 2 MiB blocks too, so the two compare chunk for chunk.
//! - **Holes**: a chunk of zeros is recorded by its absence from the manifest, never stored.
//! - **BLAKE3** of the uncompressed chunk is its name. Collision resistance like SHA-256's, but
//!   several times faster without SHA instructions and still faster with them (SIMD, one pass):
//!   hashing must not be what limits a backup's throughput on a node's spare core. The hash is of
//!   the plain data, so deduplication does not depend on the compression level and a restore
//!   checks the bytes it writes.
//! - **zstd** (level 1 by default: ~0.5 GB/s per core, most of the ratio of level 3) per chunk,
//!   or raw when that saves under 3 % — judged first on a 32 KiB sample, so incompressible data
//!   (encrypted volumes, media) costs no compression and is stored from its read buffer.
//! - **Deduplication** within a backup, against the parent (no request at all), and against
//!   everything the volume's backups ever stored (a full backup lists the volume's chunks once;
//!   an incremental heads each new chunk before its put): an identical chunk is stored once per
//!   volume. Chunks are per volume (see [`layout`]), so no operation on a
//!   volume lists or locks anything of another.
//! - **One manifest per backup, written last**: a backup exists exactly when its manifest does;
//!   an interrupted backup is never listed.
//!
//! # Guarantees
//! - Memory of a backup in flight is bounded by [`BackupOptions::buffer_bound`] whatever the
//!   volume's size (measured: [`ProgressSnapshot::peak_buffered_bytes`]), plus its chunk table.
//! - A crashed or cancelled backup leaves no manifest; a retry with the same id reuses what it
//!   uploaded; garbage collection removes it otherwise. GC safety: see `gc.rs` and `lease.rs`.
//! - Every restored chunk is checked against its hash; a missing or corrupt chunk fails the
//!   restore with an error naming the hash and the volume offset.

mod backup;
pub mod chunk;
mod config;
mod error;
mod gc;
pub mod layout;
mod lease;
pub mod manifest;
mod progress;
mod restore;
mod sink;
mod source;
mod store;
mod target;

pub use backup::{BackupOptions, BackupRequest};
pub use chunk::ChunkHash;
pub use config::{BackupTargets, FsConfig, S3Config, S3Credentials, Secret, TargetConfig};
pub use error::{Error, ErrorKind, Result, TargetError, TargetErrorKind};
pub use gc::GcReport;
pub use lease::LeaseOptions;
pub use manifest::Manifest;
pub use progress::{Progress, ProgressSnapshot};
pub use restore::RestoreOptions;
pub use sink::{FileSink, Sink};
pub use source::{Changes, FileSource, MemorySource, Source};
pub use store::{BackupInfo, BackupStore, StoreOptions};
pub use target::{FsTarget, ObjectInfo, S3Target, Target};
pub use tokio_util::sync::CancellationToken;
