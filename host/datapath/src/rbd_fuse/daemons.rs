//! The data path's rbd-fuse daemons: `wasmcsi_rbd::fuse_daemons` (which runs them and keeps
//! their records) behind [`RbdFuseDaemons`] (what the data path serves on its socket). The rbd
//! crate never knows the data path and the data path's wire never names an rbd type: this
//! file only converts between their types.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use wasmcsi_rbd::RbdCredentials;
use wasmcsi_rbd::fuse_attach::FuseAttachError;
use wasmcsi_rbd::fuse_daemons::{DaemonSpec, DaemonState, FuseDaemons};

use super::{RbdFuseDaemons, RbdFuseError, RbdFuseSpec, RbdFuseView};
use crate::DataPath;

/// Bound on rbd-fuse's start and on each of its teardown steps (as the plugin's own was).
const FUSE_TIMEOUT: Duration = Duration::from_secs(30);

/// The data path's rbd-fuse daemons, with their records under `<state_dir>/rbd-fuse`.
struct Daemons(FuseDaemons);

fn err(e: FuseAttachError) -> RbdFuseError {
    match e {
        FuseAttachError::InvalidArgument(m) => RbdFuseError::Invalid(m),
        other => RbdFuseError::Failed(other.to_string()),
    }
}

fn view(s: DaemonState) -> RbdFuseView {
    RbdFuseView {
        volume: s.record.volume,
        pool: s.record.pool,
        image: s.record.image,
        pid: s.record.fuse.pid,
        mount_point: s.record.fuse.mount_point,
        file: s.record.fuse.file,
        connection: s.record.fuse.connection,
        alive: s.alive,
    }
}

impl RbdFuseDaemons for Daemons {
    fn attach(&self, spec: &RbdFuseSpec) -> Result<RbdFuseView, RbdFuseError> {
        let spec = DaemonSpec {
            volume: spec.volume.clone(),
            monitors: spec.monitors.clone(),
            pool: spec.pool.clone(),
            image: spec.image.clone(),
            creds: RbdCredentials::new(spec.user.clone(), spec.key.0.clone()),
            size_bytes: spec.size,
        };
        self.0.attach(&spec).map(view).map_err(err)
    }

    fn detach(&self, volume: &str) -> Result<(), RbdFuseError> {
        self.0.detach(volume).map_err(err)
    }

    fn list(&self) -> Vec<RbdFuseView> {
        self.0.list().into_iter().map(view).collect()
    }
}

/// Adopts the daemons recorded under `<state_dir>/rbd-fuse` (a previous image of this process,
/// or one that crashed) and has `datapath` serve rbd-fuse with them.
pub fn serve(datapath: &DataPath, state_dir: &Path) -> Result<(), RbdFuseError> {
    let root = state_dir.join("rbd-fuse");
    let daemons = FuseDaemons::open(&root, FUSE_TIMEOUT)
        .map_err(|e| RbdFuseError::Failed(format!("opening the rbd-fuse records in {}: {e}", root.display())))?;
    datapath.serve_rbd_fuse(Arc::new(Daemons(daemons)));
    Ok(())
}
