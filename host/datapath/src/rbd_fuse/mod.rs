//! rbd-fuse attachments served by the data path: the node plugin stages an RBD image with
//! rbd-fuse + loop where the kernel maps no RBD, and the rbd-fuse daemon must outlive the
//! plugin as the replicated volumes' engines do (in a pod, a restart of the plugin's container
//! kills every process in it). So the daemons are the data path's children: the plugin asks for
//! one with a typed request ([`RbdFuseSpec`]: a volume id, a pool, an image, monitors, a cephx
//! user and key, a size; never a path nor a command line) and gets the image's file back
//! ([`RbdFuseView`]); it then puts a loop device on it and mounts as before.
//!
//! The data path serves whatever [`RbdFuseDaemons`] is registered with it
//! ([`crate::DataPath::serve_rbd_fuse`]); how rbd-fuse runs is `wasmcsi-rbd`'s (it links
//! librados), behind that trait in [`daemons`]. The implementation keeps its own records, so a
//! data path that replaced its image in a live upgrade (same pid: the daemons stay its children)
//! or restarted after a crash adopts them.

pub mod daemons;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A cephx key on the wire: shown as `<redacted>` in logs and errors.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CephKey(pub String);

impl std::fmt::Debug for CephKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// One rbd-fuse attachment to make.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RbdFuseSpec {
    /// The CSI volume id: the attachment's key.
    pub volume: String,
    /// The cluster's monitors (`host:port` or `[v2:…,v1:…]`).
    pub monitors: Vec<String>,
    pub pool: String,
    pub image: String,
    /// The cephx user (without `client.`) and its key.
    pub user: String,
    pub key: CephKey,
    /// The image's size: the attach is complete when the file shows it.
    pub size: u64,
}

/// An rbd-fuse attachment as the plugin sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RbdFuseView {
    pub volume: String,
    pub pool: String,
    pub image: String,
    /// rbd-fuse's pid, in the data path's pid namespace.
    pub pid: u32,
    /// rbd-fuse's mount point and the image as a file in it (what the loop device is put on).
    pub mount_point: PathBuf,
    pub file: PathBuf,
    /// The FUSE connection number, to abort an unmount that hangs on a dead cluster.
    pub connection: Option<u64>,
    /// Whether the daemon runs; a dead one stays listed until it is detached.
    pub alive: bool,
}

/// Why an rbd-fuse request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RbdFuseError {
    /// The request names something it may not (a bad name, another image for the volume).
    #[error("{0}")]
    Invalid(String),
    /// rbd-fuse did not start, or its teardown failed.
    #[error("{0}")]
    Failed(String),
}

/// What runs rbd-fuse for the data path (registered with [`crate::DataPath::serve_rbd_fuse`]:
/// [`daemons::serve`]). Blocking calls: the data path runs them on blocking threads, one at a
/// time per volume, never during a handover.
pub trait RbdFuseDaemons: Send + Sync {
    /// Starts rbd-fuse for the spec; the running attachment when the volume has it already.
    fn attach(&self, spec: &RbdFuseSpec) -> Result<RbdFuseView, RbdFuseError>;
    /// Tears the volume's rbd-fuse down (its file must not be under a loop device); absent
    /// succeeds.
    fn detach(&self, volume: &str) -> Result<(), RbdFuseError>;
    /// Every attachment, by volume id.
    fn list(&self) -> Vec<RbdFuseView>;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    impl RbdFuseSpec {
        /// A spec for volume `ceph:v1` whose key is `AQBsecret==` (what the tests look for).
        pub(crate) fn example() -> Self {
            RbdFuseSpec {
                volume: "ceph:v1".into(),
                monitors: vec!["10.0.0.1:6789".into()],
                pool: "p".into(),
                image: "i".into(),
                user: "csi".into(),
                key: CephKey("AQBsecret==".into()),
                size: 1 << 20,
            }
        }
    }

    #[test]
    fn the_key_never_shows_in_debug_output() {
        let spec = RbdFuseSpec::example();
        assert!(!format!("{spec:?}").contains("AQBsecret"));
        let json = serde_json::to_string(&spec).unwrap();
        assert!(json.contains("\"key\":\"AQBsecret==\""), "the wire carries it: {json}");
        assert_eq!(serde_json::from_str::<RbdFuseSpec>(&json).unwrap(), spec);
    }
}
