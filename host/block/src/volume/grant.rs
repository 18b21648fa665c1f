//! The grant a volume's engine presents to replica servers ([`VolumeGrant`]): the bytes the
//! controller signed (`wasmcsi_trust::Grant`), held where the engine's connections read them
//! when they open and where the node's data path puts a renewed one. A connection that finds
//! none, or whose grant a replica refused, says so ([`VolumeGrant::want_fresh`]) and fails like
//! an unreachable replica; whoever keeps the grant fresh ([`VolumeGrant::fresh_wanted`]) fetches
//! a new one, and the connection's next attempt (the driver's reconnect with back-off) presents
//! it. Sessions already open are not touched: a grant is checked only when a session opens.

use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;

/// A volume's current grant, shared by its engine's connections and its keeper.
#[derive(Debug, Default)]
pub struct VolumeGrant {
    current: Mutex<Option<Arc<[u8]>>>,
    wanted: Notify,
}

impl VolumeGrant {
    /// Holds `grant` (none: the first connection asks for one).
    pub fn new(grant: Option<Vec<u8>>) -> Self {
        Self { current: Mutex::new(grant.map(Arc::from)), wanted: Notify::new() }
    }

    /// The grant a connection opening now presents.
    pub fn current(&self) -> Option<Arc<[u8]>> {
        self.current.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Replaces the grant (a renewed one); connections opened from now on present it.
    pub fn set(&self, grant: Vec<u8>) {
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::from(grant));
    }

    /// A connection had no grant, or a replica refused the one it presented: ask the keeper for
    /// a fresh one (several asks before it runs count as one).
    pub fn want_fresh(&self) {
        self.wanted.notify_one();
    }

    /// Completes when a connection asked for a fresh grant.
    pub async fn fresh_wanted(&self) {
        self.wanted.notified().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_renewed_grant_is_what_the_next_connection_presents() {
        let grant = VolumeGrant::new(None);
        assert!(grant.current().is_none());
        grant.set(vec![1, 2]);
        assert_eq!(grant.current().as_deref(), Some(&[1u8, 2][..]));
        grant.set(vec![3]);
        assert_eq!(grant.current().as_deref(), Some(&[3u8][..]));
    }

    #[test]
    fn an_ask_before_the_keeper_waits_is_not_lost() {
        let grant = Arc::new(VolumeGrant::new(None));
        grant.want_fresh();
        grant.want_fresh();
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
        rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(1), grant.fresh_wanted()).await.expect("asked");
            // Two asks before it ran count as one.
            let again = tokio::time::timeout(std::time::Duration::from_millis(50), grant.fresh_wanted()).await;
            assert!(again.is_err());
        });
    }
}
