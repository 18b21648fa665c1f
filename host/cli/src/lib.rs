//! The `wasmcsi` binary's library: starting a host, the CLI commands (`backend check` runs the
//! CSI conformance suite of `wasmcsi-conformance`; `wasmcsi datapath` and `wasmcsi upgrade
//! datapath` parse their arguments here and leave the data-path process to `wasmcsi-datapath`),
//! the metrics endpoint, replica nodes as child processes (the demo's and the benchmark's), the
//! built-in CA by hand (`wasmcsi pki`), a host's identity and authority endpoint (`trust`), and
//! the descriptor limit every process raises at start (`descriptors`), and backups of replicated
//! volumes by hand (`backup_cmd`, over the runtime's replica snapshot source). `anyhow` lives here, at
//! the edge; the libraries below use typed errors.
pub mod backend_dir;
pub mod backup_cmd;
pub mod block_cmd;
pub mod block_ctl;
pub mod check;
pub mod compose;
pub mod datapath_cmd;
pub mod datapath_upgrade;
pub mod demo;
pub mod descriptors;
pub mod host;
pub mod metrics_http;
pub mod oci_cmd;
pub mod pki_cmd;
pub mod replica_process;
pub mod scaffold;
pub mod trust;

/// Read a host configuration file, or the defaults when none is given.
pub fn load_config_file(path: Option<&std::path::Path>) -> anyhow::Result<wasmcsi_runtime::config::HostConfig> {
    match path {
        Some(p) => Ok(wasmcsi_runtime::config::HostConfig::load(p)?),
        None => Ok(wasmcsi_runtime::config::HostConfig::default()),
    }
}

/// Refuses a directory whose mount would keep what this process mounts beneath it inside its
/// own mount namespace (see `wasmcsi_csi::node::propagation`): `name` says what the directory
/// is, `why` who must see those mounts; both go into the error, `name` into the log line of a
/// directory that passes.
pub fn check_shared_mount(flag: &str, dir: &std::path::Path, name: &str, why: &str) -> anyhow::Result<()> {
    use anyhow::Context;
    use wasmcsi_csi::node::propagation;
    use wasmcsi_mountinfo as mountinfo;
    // Spelled as the mount table spells it: no symlink on the way.
    let canonical = std::fs::canonicalize(dir).with_context(|| format!("{flag} {}", dir.display()))?;
    let entries = mountinfo::read_current()?;
    propagation::check_shared(&entries, &canonical).with_context(|| format!("{flag}: {name}: {why}"))?;
    tracing::info!(dir = %canonical.display(), "{name} is a shared mount");
    Ok(())
}
