//! `wasmcsi upgrade datapath`: the operator's command that asks a running data path (`wasmcsi
//! datapath`) to hand its volumes to a new binary live, and waits until the new binary serves
//! them, with the replica port's TLS configuration changed when asked (`--tls-mode`,
//! `--tls-dir`, `--authority`: checked by the data path first, `wasmcsi_datapath::tls_change`).
//! The handover itself (suspend, `execve` with the fds kept open, adopt) is the data path
//! process's (`wasmcsi_datapath::upgrade`, `wasmcsi_datapath::handover`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use wasmcsi_datapath::client::DataPathClient;
use wasmcsi_datapath::wire::TlsChange;

/// `wasmcsi upgrade datapath`.
#[derive(Args, Debug, Clone)]
pub struct UpgradeArgs {
    /// The socket of the data path to upgrade.
    #[arg(long, default_value = "/var/lib/wasmcsi/datapath/datapath.sock")]
    pub socket: PathBuf,
    /// The new wasmcsi binary (an absolute path the data path's container can read).
    #[arg(long)]
    pub binary: PathBuf,
    /// How long to wait for the new binary to serve, in seconds.
    #[arg(long, default_value_t = 120)]
    pub wait: u64,
    /// Move the replica port to this TLS mode with the upgrade (`off` → `permissive` →
    /// `required`, one step per upgrade, every node `permissive` before any goes `required`).
    /// The data path checks first that its attached volumes' engines keep their replicas and
    /// refuses the upgrade with the reason otherwise. Unset: the mode stays as it is.
    #[arg(long, value_name = "off|permissive|required")]
    pub tls_mode: Option<wasmcsi_trust::TlsMode>,
    /// With --tls-mode: this node's credentials directory for the new binary (unset: the one
    /// the data path runs with).
    #[arg(long, requires = "tls_mode")]
    pub tls_dir: Option<PathBuf>,
    /// With --tls-mode: the controller's authority endpoint the new binary renews grants at
    /// (unset: the one the data path runs with).
    #[arg(long, requires = "tls_mode")]
    pub authority: Option<String>,
}

/// Asks the data path at `args.socket` to hand its volumes to `args.binary` and waits until the
/// new binary serves them; prints the handover's longest I/O pause.
pub async fn run_upgrade(args: UpgradeArgs) -> anyhow::Result<()> {
    let binary = std::path::absolute(&args.binary).with_context(|| format!("resolving {}", args.binary.display()))?;
    let tls = match args.tls_mode {
        Some(mode) => {
            let dir = match &args.tls_dir {
                Some(d) => Some(std::path::absolute(d).with_context(|| format!("resolving {}", d.display()))?),
                None => None,
            };
            Some(TlsChange { mode, dir, authority: args.authority.clone() })
        }
        None => None,
    };
    let client = DataPathClient::new(&args.socket);
    let started = Instant::now();
    let before = client.upgrade(&binary, tls.clone()).await.context("asking the data path to upgrade")?;
    let deadline = started + Duration::from_secs(args.wait);
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Requests wait in the socket's queue while the volumes move: this answers once the
        // new image serves, or the old one gave up.
        match client.report().await {
            Ok((pid, now)) if now.handovers > before.handovers => {
                if let Some(change) = &tls {
                    // A data path of the version before TLS changes ignores the request's
                    // change: it upgraded, but the mode did not move.
                    let mode = client.tls_mode().await.context("asking the upgraded data path its TLS mode")?;
                    anyhow::ensure!(
                        mode.as_deref() == Some(change.mode.to_string().as_str()),
                        "data path {pid} upgraded, but its replica port runs --tls-mode {} instead of {}: the data \
                         path that took the request predates live TLS changes; run the upgrade again",
                        mode.as_deref().unwrap_or("(unknown)"),
                        change.mode
                    );
                }
                let mode =
                    tls.as_ref().map(|t| format!(", replica port now --tls-mode {}", t.mode)).unwrap_or_default();
                println!(
                    "data path {pid} upgraded to {} in {:.3}s: {} volumes, longest I/O pause {:.1} ms (handover {}){mode}",
                    binary.display(),
                    started.elapsed().as_secs_f64(),
                    now.last_volumes,
                    now.last_pause_us.unwrap_or(0) as f64 / 1000.0,
                    now.handovers
                );
                return Ok(());
            }
            Ok((_, now)) if now.last_error.is_some() && now.last_error != before.last_error => {
                anyhow::bail!("the data path did not upgrade and serves on: {}", now.last_error.unwrap_or_default());
            }
            _ if Instant::now() >= deadline => {
                anyhow::bail!("the data path did not report an upgrade within {}s", args.wait)
            }
            _ => {}
        }
    }
}
