//! The host's replicated block data path. Pure logic: the replica wire protocol ([`protocol`]),
//! the dirty-region bitmap that makes delta rebuilds possible ([`dirty`]) and the sans-I/O
//! replication engine ([`replication`]) that turns client I/O and replica replies into messages
//! to send — no sockets, files, threads or clocks, which is what lets `sim` test it on a seeded
//! simulated network. I/O: the replica server ([`replica`]), which stores every replica of a
//! node as a chain of sparse layer files (snapshots, resize) and serves the protocol over TCP;
//! the engine's tokio driver ([`driver`]), which connects the engine to its replicas and exposes
//! the volume as a synchronous `wasmcsi_frontend::BlockDevice` for the FUSE frontend, with
//! unmap, online expansion and snapshots; the control surface ([`control`]) that creates,
//! deletes, reverts and clones replica sets and lists nodes; and a volume attached on this node
//! ([`attach`]: the engine, a frontend's block device, the online operations and the teardown),
//! which the CLI's `volume attach` and the node plugin hold. Not done: reconciling replicas
//! after an *engine* crash left unacknowledged writes on some of them (the header's dirty flag).

pub mod attach;
pub mod catalog;
pub mod control;
pub mod datapath;
pub mod dirty;
pub mod driver;
pub mod protocol;
pub mod replica;
pub mod replication;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod testutil;
