//! What the control plane asks the engine of an attached volume, wherever it runs: the request
//! travels as an `EngineCall` to the replica server of the node that owns the volume, whose
//! process runs the engine (the node plugin), and is answered there by the engine's control
//! surface. JSON: low rate, and a new request is an addition.

use serde::{Deserialize, Serialize};

/// One request to an attached volume's engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum EngineRequest {
    Status,
    Snapshot {
        name: String,
    },
    DeleteSnapshot {
        name: String,
    },
    Expand {
        size: u64,
    },
    /// The replica at `index` now lives on the (empty) replica on disk `disk` of the replica
    /// server at `addr` (a controller of the version before disks names none: `default`).
    ReplaceReplica {
        index: usize,
        addr: std::net::SocketAddr,
        #[serde(default = "default_disk")]
        disk: String,
    },
    /// Add a new (empty) replica on disk `disk` of the replica server at `addr` (the node `node`,
    /// which the engine requires over TLS) as the set's last; the engine rebuilds it while I/O
    /// goes on. The same place again: success. An engine of the version before it answers an
    /// error: nothing changes there.
    AddReplica {
        addr: std::net::SocketAddr,
        disk: String,
        node: String,
    },
    /// Remove the set's replica on disk `disk` of the replica server at `addr`: the engine stops
    /// using it at once; the control plane deletes it afterwards. None there: success (named by
    /// place, not index, so a retry cannot remove another). Refused for the last healthy one.
    RemoveReplica {
        addr: std::net::SocketAddr,
        disk: String,
    },
    /// Apply these I/O limits from now on (all 0: none). An engine of the version before
    /// limits cannot parse it and answers an error: nothing changes there.
    SetLimits {
        limits: crate::qos::IoLimits,
    },
    /// A group snapshot's first phase: hold the volume's writes for `holder` (at most
    /// `hold_ms`, then the engine lets go by itself) and take snapshot `name` on every replica
    /// while held. An engine of the version before group snapshots does not know it (its answer
    /// is an error naming a malformed request).
    HoldSnapshot {
        holder: String,
        name: String,
        hold_ms: u64,
    },
    /// A group snapshot's last phase: let go of `holder`'s hold (none: success).
    ReleaseHold {
        holder: String,
    },
}

fn default_disk() -> String {
    crate::protocol::DEFAULT_DISK.to_owned()
}

/// The longest a group snapshot may hold a volume's writes: the engine lets go by itself then.
pub const MAX_HOLD_MS: u64 = 30_000;

/// The engine's answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineReply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The engine asks to be asked again later (a snapshot while a replica rebuilds).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retry: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<EngineStatus>,
    /// How long a hold held the volume's writes, in µs (`ReleaseHold` of a hold it still had).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_us: Option<u64>,
}

/// An attached volume as its engine sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineStatus {
    pub attached: bool,
    pub fenced: bool,
    pub size: u64,
    pub revision: u64,
    /// One entry per replica, in the engine's order (the record's member order).
    pub replicas: Vec<EngineReplica>,
}

/// One replica as the engine sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineReplica {
    /// `healthy`, `rebuilding`, `stale` or `down`.
    pub state: String,
    /// When the engine last saw it stop being healthy, ns since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub down_since_ns: Option<u64>,
    #[serde(default)]
    pub rebuilt: u64,
    #[serde(default)]
    pub rebuild_total: u64,
    /// Its replica server's address; absent from an engine of the version before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<std::net::SocketAddr>,
    /// The disk of that server holding it; absent from an engine of the version before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<String>,
}

impl EngineReply {
    pub fn ok() -> Self {
        Self { ok: true, ..Self::default() }
    }
    pub fn error(e: impl std::fmt::Display) -> Self {
        Self { ok: false, error: Some(e.to_string()), ..Self::default() }
    }
    pub fn retry(e: impl std::fmt::Display) -> Self {
        Self { retry: true, ..Self::error(e) }
    }
}
