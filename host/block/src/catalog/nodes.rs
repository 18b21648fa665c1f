//! Finding the replica nodes of a grant: the operator names replica servers by address, by a
//! file of addresses that is re-read every time, or by DNS names resolved every time (a
//! Kubernetes headless Service in front of every node's replica server, so nodes join and leave
//! without anyone restarting the controller). Each address found is asked who it is
//! (`Identify`: the node's name and labels) and what it holds (`NodeInfo`, and `ListDisks`: its
//! disks, each a replica root, and which volumes each holds; a server of the version before
//! disks has one, `default`, with what `NodeInfo` says); placement and
//! membership use names, never addresses, which change when a node plugin restarts.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::control::{ControlError, Reach, ReplicaServerClient};
use crate::protocol::{DiskSummary, ReplicaSummary};
use crate::replica::DEFAULT_DISK;

/// Where the replica nodes of a grant are found (`[backends.NAME.grants] block = { ... }`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSources {
    /// Replica server addresses, `host:port`.
    #[serde(default)]
    pub nodes: Vec<String>,
    /// A file with one `host:port` per line (`#` starts a comment), re-read at every discovery.
    #[serde(default)]
    pub nodes_file: Option<PathBuf>,
    /// DNS names `name:port` resolved to every address at every discovery, e.g. a headless
    /// Service selecting the node plugins: `wasmcsi-replicas.wasmcsi.svc.cluster.local:9501`.
    #[serde(default)]
    pub services: Vec<String>,
}

impl NodeSources {
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty() && self.nodes_file.is_none() && self.services.is_empty()
    }
}

/// One replica node as it answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    /// Its name (the CSI node id of the node plugin serving it; the address for a server
    /// started by hand without one).
    pub name: String,
    pub addr: SocketAddr,
    pub labels: Vec<(String, String)>,
    pub capacity: u64,
    pub available: u64,
    pub replicas: Vec<ReplicaSummary>,
    /// Its disks (replica roots), `default` first.
    pub disks: Vec<DiskSummary>,
}

/// What one discovery found.
#[derive(Debug, Default)]
pub struct Discovery {
    /// Nodes that answered, by name.
    pub nodes: BTreeMap<String, NodeView>,
    /// Addresses that did not answer, with why.
    pub unreachable: Vec<(String, String)>,
}

impl Discovery {
    pub fn node(&self, name: &str) -> Option<&NodeView> {
        self.nodes.get(name)
    }
}

/// Resolves every source to addresses (deduplicated, in order); an entry that does not resolve is
/// reported unreachable, not fatal.
async fn addresses(
    sources: &NodeSources,
    timeout: Duration,
    unreachable: &mut Vec<(String, String)>,
) -> Vec<SocketAddr> {
    let mut entries: Vec<String> = sources.nodes.clone();
    if let Some(path) = &sources.nodes_file {
        match tokio::fs::read_to_string(path).await {
            Ok(text) => entries.extend(
                text.lines()
                    .map(|l| l.split('#').next().unwrap_or("").trim())
                    .filter(|l| !l.is_empty())
                    .map(str::to_owned),
            ),
            Err(e) => unreachable.push((path.display().to_string(), format!("reading the nodes file: {e}"))),
        }
    }
    entries.extend(sources.services.iter().cloned());
    let mut out = Vec::new();
    for entry in entries {
        let looked_up = tokio::time::timeout(timeout, tokio::net::lookup_host(entry.clone())).await;
        match looked_up {
            Ok(Ok(found)) => {
                for addr in found {
                    if !out.contains(&addr) {
                        out.push(addr);
                    }
                }
            }
            Ok(Err(e)) => unreachable.push((entry, format!("does not resolve: {e}"))),
            Err(_) => unreachable.push((entry, format!("did not resolve within {timeout:?}"))),
        }
    }
    out
}

/// Share of a catalog operation's budget that discovery may spend on one round (name lookups,
/// then every node's answer). A node that is switched off or cut off never answers (no RST):
/// waiting the whole budget for it would fail every operation while one node is down, so it
/// counts as unreachable after this share and the operation goes on with the nodes that
/// answered (at the default 3 s import timeout: 750 ms, hundreds of LAN round trips).
pub const DISCOVERY_SHARE: u32 = 4;

/// Asks every node of `sources` who it is and what it holds, all at once, within `budget /
/// DISCOVERY_SHARE` for the lookups and as much again for the answers.
pub async fn discover(sources: &NodeSources, budget: Duration, reach: &Reach) -> Discovery {
    let timeout = budget / DISCOVERY_SHARE;
    let mut found = Discovery::default();
    let addrs = addresses(sources, timeout, &mut found.unreachable).await;
    let mut tasks = tokio::task::JoinSet::new();
    for addr in addrs {
        let reach = reach.clone();
        tasks.spawn(async move {
            let client = ReplicaServerClient::over(addr, timeout, reach);
            let asked = async {
                let identity = client.identify().await?;
                let info = client.node_info().await?;
                let disks = match client.disks().await {
                    Ok(disks) if !disks.is_empty() => disks,
                    // A server of the version before disks closes the connection on ListDisks:
                    // one disk, what NodeInfo said.
                    Ok(_) | Err(_) => vec![DiskSummary {
                        name: DEFAULT_DISK.to_owned(),
                        capacity: info.capacity,
                        available: info.available,
                        volumes: info.replicas.iter().map(|r| r.volume_id.clone()).collect(),
                    }],
                };
                Ok::<_, ControlError>((identity, info, disks))
            };
            let answer = tokio::time::timeout(timeout, asked).await.unwrap_or(Err(ControlError::Timeout {
                addr,
                what: "discovery",
                timeout,
            }));
            (addr, answer)
        });
    }
    let mut answered = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((addr, Ok((identity, info, disks)))) => answered.push((addr, identity, info, disks)),
            Ok((addr, Err(e))) => found.unreachable.push((addr.to_string(), e.to_string())),
            Err(e) => tracing::error!(error = %e, "replica node discovery task failed"),
        }
    }
    // Deterministic when two addresses claim one name: the lowest address wins.
    answered.sort_by_key(|(addr, _, _, _)| *addr);
    for (addr, identity, info, disks) in answered {
        let name = if identity.node.is_empty() { addr.to_string() } else { identity.node };
        if let Some(first) = found.nodes.get(&name) {
            tracing::warn!(node = %name, kept = %first.addr, ignored = %addr, "two replica servers claim one node name");
            continue;
        }
        found.nodes.insert(
            name.clone(),
            NodeView {
                name,
                addr,
                labels: identity.labels,
                capacity: info.capacity,
                available: info.available,
                replicas: info.replicas,
                disks,
            },
        );
    }
    found
}
