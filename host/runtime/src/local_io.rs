//! Where an import's local blocking work runs: inline, on the calling worker (see [`local_io`]).
//! Network capabilities (nfs, block, rbd) do async I/O under their import timeout instead.

/// Run local blocking work of one entry (a file system syscall or a few, a metadata-store
/// commit) inline on the calling worker. It takes microseconds, and every alternative measured
/// on these machines costs more than the work: a hop to the blocking pool 40-80 µs per import,
/// `block_in_place` ~20 µs per import (CreateVolume via hostpath: 1.20x native with it, 1.07x
/// without). The price: a syscall that hangs in the kernel (a dead disk under a dir root) holds
/// this worker thread. Work that grows with a tree never runs here: `dir`'s copy-tree,
/// remove-all and usage run off the workers under a deadline (`imports::dir`).
pub(crate) fn local_io<T>(work: impl FnOnce() -> T) -> T {
    work()
}
