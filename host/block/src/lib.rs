//! Replicated block volumes, in the words their docs use: an *engine* replicates one
//! volume to its *replicas*; a *volume* is what a frontend holds.
//!
//! Pure logic: the replica wire protocol ([`protocol`]), the dirty-region bitmap that makes
//! delta rebuilds possible ([`dirty`]) and the sans-I/O replication engine ([`engine`]) that
//! turns client I/O and replica replies into messages to send — no sockets, files, threads or
//! clocks, which is what lets its simulator test it on a seeded simulated network. I/O: the
//! replica server ([`replica`]), which stores every replica of a node as a chain of sparse layer
//! files (snapshots, resize) and serves the protocol over TCP; the replicated volume
//! ([`volume`]): the engine's driver task, its replica connections and state file, and the
//! handle that exposes it as a synchronous `wasmcsi_frontend::BlockDevice` for the FUSE
//! frontend, with unmap, online expansion, snapshots and I/O limits ([`qos`]); and the control surface ([`control`],
//! [`catalog`]) that creates, deletes, reverts and clones replica sets and lists nodes.
//!
//! It does not attach volumes to the kernel nor keep the node's attached volumes: that is the
//! node's data path (`wasmcsi-datapath`), which holds this crate's engines and replica server.
//! Of `wasmcsi-frontend` it uses only the device contract (`BlockDevice`) a frontend calls.

pub mod catalog;
pub mod control;
pub mod dirty_map;
pub mod engine;
pub mod protocol;
pub mod qos;
pub mod replica;
pub mod transport;
pub mod volume;

#[cfg(test)]
mod testutil;
