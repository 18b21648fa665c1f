//! The replica server: replicas of volumes stored as chains of sparse layer files ([`store`],
//! [`chain`]), every replica of a node held under one root ([`node`]), and served over TCP with
//! the pipelined protocol of `proto/replica-protocol.md` ([`server`], one listener per node, which
//! may serve several roots: its [`disks`]). It
//! owns the replica side of the protocol's semantics (fencing by revision, flush = fdatasync,
//! unmap, snapshots, the dirty flag); the engine side is [`crate::engine`], driven by
//! [`crate::volume`].

mod authorize;
mod block_map;
pub mod chain;
pub mod disks;
mod error;
mod frames;
mod header_file;
mod layers;
pub mod node;
mod pipeline;
mod record;
pub mod server;
pub(crate) mod session;
pub mod store;

pub use block_map::BLOCK;
pub use disks::{DEFAULT_DISK, DiskReport, ReplicaDisks};
pub use error::StoreError;
pub use node::{NodeError, NodeReport, Replica, ReplicaNode, replica_dir_name};
pub use server::{EngineCalls, NodeIdentity, ReplicaServer, ServerConfig, ServerError};
pub use store::ReplicaStore;

#[cfg(test)]
mod chain_tests;
