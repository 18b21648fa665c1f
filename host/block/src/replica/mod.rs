//! The replica server: replicas of volumes stored as chains of sparse layer files ([`store`],
//! [`chain`]) and served over TCP with the pipelined protocol of `proto/replica-protocol.md`
//! ([`server`]). It owns the replica side of the protocol's semantics (fencing by revision,
//! flush = fdatasync, unmap, snapshots, the dirty flag); the engine side is `replication` plus
//! its driver, not built here.

mod block_map;
pub mod chain;
mod header_file;
mod layers;
pub mod server;
pub mod store;

pub use block_map::BLOCK;
pub use server::{ReplicaServer, ServerConfig, ServerError};
pub use store::{ReplicaStore, StoreError};

#[cfg(test)]
mod chain_tests;
