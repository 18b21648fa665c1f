//! The host's replicated block data path. Pure logic: the replica wire protocol ([`protocol`]),
//! the dirty-region bitmap that makes delta rebuilds possible ([`dirty`]) and the sans-I/O
//! replication engine ([`replication`]) that turns client I/O and replica replies into messages
//! to send — no sockets, files, threads or clocks, which is what lets `sim` test it on a seeded
//! simulated network. I/O: the replica server ([`replica`]), which stores one replica in sparse
//! files and serves the protocol over TCP; and the engine's tokio driver ([`driver`]), which
//! connects the engine to its replicas and exposes the volume as a synchronous
//! `wasmcsi_frontend::BlockDevice` for the FUSE frontend, plus unmap, online expansion and
//! snapshots. Still to come (issue 4): snapshot revert and clones, reconciling replicas after an
//! engine crash (the header's dirty flag).

pub mod dirty;
pub mod driver;
pub mod protocol;
pub mod replica;
pub mod replication;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod testutil;
