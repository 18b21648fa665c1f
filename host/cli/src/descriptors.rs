//! The soft limit on open descriptors, raised to the hard limit at the start of every wasmcsi
//! process. The soft limit is often 1024 (systemd's and many container runtimes' default) while
//! the hard limit is far higher: a node plugin or data path with many volumes, connections and
//! FUSE sessions would run out at the soft one for no reason, and every listener's caps are
//! sized assuming the hard one.
use nix::sys::resource::{Resource, getrlimit, setrlimit};

/// Raises the soft `RLIMIT_NOFILE` to the hard limit; returns the limits now in force
/// `(soft, hard)`. A failure leaves the limits as they were and is only logged: the process can
/// still serve.
pub fn raise_soft_limit() -> Option<(u64, u64)> {
    let (soft, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(limits) => limits,
        Err(e) => {
            tracing::warn!(error = %e, "reading the descriptor limit");
            return None;
        }
    };
    if soft >= hard {
        return Some((soft, hard));
    }
    match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
        Ok(()) => {
            tracing::debug!(from = soft, to = hard, "raised the soft descriptor limit to the hard limit");
            Some((hard, hard))
        }
        Err(e) => {
            tracing::warn!(soft, hard, error = %e, "raising the soft descriptor limit");
            Some((soft, hard))
        }
    }
}
