//! The CSI face of wasmcsi: Identity, Controller and Node over gRPC on a unix socket. It
//! validates requests as the CSI spec asks, routes them to the backend that owns them (by
//! the `backend` StorageClass parameter or the id's prefix), checks what backends answer,
//! and carries out attachment plans on the node. It also serves the controller's authority
//! endpoint (`authority_endpoint`: node certificates and grants of volumes) and holds the
//! node's client of it. It runs no guest code itself (that is `wasmcsi-runtime`) and decides
//! no storage policy (that is the backends).
//!
//! Other crates see what they build a host from: the [`Plugin`] and its services
//! (`controller`, `node`, `server`, `peer`, `authority_endpoint`), the node directory
//! (`node_directory`: which node ids exist), the reconciler, the metrics
//! and the constants a CO or a conformance run speaks (`plugin`); the checks, conversions and
//! guards are the crate's own.
mod answer;
mod authority;
pub mod authority_endpoint;
pub mod controller;
mod convert;
mod error;
mod group_controller;
mod guard;
mod identity;
mod ids;
pub mod metrics;
pub mod node;
pub mod node_directory;
pub mod peer;
pub mod plugin;
pub mod reconcile;
pub mod server;
pub mod topology;

pub use error::{CsiError, CsiResult, ObjectKind};
pub use guard::InFlight;
pub use plugin::{Mode, Plugin};
