//! The integration tests of the `wasmcsi` crate: whole hosts in this process or as the real
//! binary, driven over the CSI socket as kubelet and the sidecars drive them.
//!
//! One binary per crate, one module per area (as wasmtime's `tests/all`): the crate and its
//! dependencies are linked once, not once per file. Run one area with
//! `cargo test --release --workspace --locked --test all -- MODULE::`.

mod abandoned_clone;
mod authority;
mod backend_check;
mod backup_cli;
mod block_cli;
mod block_netns;
mod bounds;
mod compose;
mod conformance;
mod controller_faults;
mod datapath_bounds;
mod datapath_crash;
mod group_snapshots;
mod hostile;
mod hot_reload;
mod nfs_flow_vm;
mod node_directory;
mod node_local;
mod oci_cli;
mod pki;
mod rbd_flow;
mod replicated_backup;
mod replicated_disks;
mod replicated_flow;
mod replicated_metrics;
mod replicated_netns;
mod replicated_placement;
mod replicated_qos;
mod replicated_replicas;
mod replicated_tls;
mod serve_cli;
mod support;
mod tls_upgrade;
