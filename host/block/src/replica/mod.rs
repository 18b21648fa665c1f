//! The replica server: one replica of a volume stored in sparse files ([`store`]) and served over
//! TCP with the pipelined protocol of `proto/replica-protocol.md` ([`server`]). It owns the
//! replica side of the protocol's semantics (fencing by revision, flush = fdatasync, unmap = hole
//! punch, the dirty flag); the engine side is `replication` plus its driver, not built here.

pub mod server;
pub mod store;

pub use server::{ReplicaServer, ServerConfig, ServerError};
pub use store::{ReplicaStore, StoreError};
