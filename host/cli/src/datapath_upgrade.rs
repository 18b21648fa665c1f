//! `wasmcsi upgrade datapath`: the operator's command that asks a running data path (`wasmcsi
//! datapath`) to hand its volumes to a new binary live, and waits until the new binary serves
//! them. The handover itself (suspend, `execve` with the fds kept open, adopt) is the data path
//! process's (`wasmcsi_datapath::upgrade`, `wasmcsi_datapath::handover`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use wasmcsi_datapath::client::DataPathClient;

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
}

/// Asks the data path at `args.socket` to hand its volumes to `args.binary` and waits until the
/// new binary serves them; prints the handover's longest I/O pause.
pub async fn run_upgrade(args: UpgradeArgs) -> anyhow::Result<()> {
    let binary = std::path::absolute(&args.binary).with_context(|| format!("resolving {}", args.binary.display()))?;
    let client = DataPathClient::new(&args.socket);
    let started = Instant::now();
    let before = client.upgrade(&binary).await.context("asking the data path to upgrade")?;
    let deadline = started + Duration::from_secs(args.wait);
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Requests wait in the socket's queue while the volumes move: this answers once the
        // new image serves, or the old one gave up.
        match client.report().await {
            Ok((pid, now)) if now.handovers > before.handovers => {
                println!(
                    "data path {pid} upgraded to {} in {:.3}s: {} volumes, longest I/O pause {:.1} ms (handover {})",
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
