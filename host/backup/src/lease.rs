//! Leases of backups in progress and the lock of a garbage collection: objects renewed while
//! their holder runs, which keep a collection and the backups of a volume from overlapping.
//!
//! The exclusion needs nothing but strongly consistent puts, heads and listings (no conditional
//! writes): each side *writes its own object first, then reads the other's*. A backup puts its
//! lease, then heads the volume's collection lock; a collection puts its lock, then lists the
//! volume's leases. If the backup's read missed the lock, that read came before the lock was
//! written, so the lease was written before the collection listed the leases: at least one side
//! sees the other and steps back ([`crate::Error::Busy`]).
//!
//! Liveness is judged on the target's clock only: an object is live while its `modified` is
//! within the TTL of the `modified` of the object the judge has just written. A holder renews
//! every `renew_every`, and gives up (its work fails, [`crate::Error::LeaseLost`]) once its last
//! successful renewal is older than half the TTL by its own monotonic clock: a holder that was
//! stalled long enough for the other side to think it dead never carries on as if it held the
//! volume.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;

use crate::error::Error;
use crate::target::Target;

/// Timing of leases and collection locks.
#[derive(Clone, Copy, Debug)]
pub struct LeaseOptions {
    /// An object not renewed for this long is dead (its holder crashed).
    pub ttl: Duration,
    pub renew_every: Duration,
}

impl Default for LeaseOptions {
    /// Renewed every 30 s, dead after 10 min: a backup that crashed blocks the volume's garbage
    /// collection for at most 10 minutes, and a slow target (a renewal taking a minute) or a
    /// clock step of a few minutes between client and server loses nothing.
    fn default() -> Self {
        Self { ttl: Duration::from_secs(600), renew_every: Duration::from_secs(30) }
    }
}

/// True when an object last renewed at `modified` is live as of `now` (both the target's clock).
pub fn is_live(modified: SystemTime, now: SystemTime, ttl: Duration) -> bool {
    now.duration_since(modified).map_or(true, |age| age < ttl)
}

/// A lease or lock this process holds; renewed in the background until released or dropped.
pub struct Held {
    target: Arc<dyn Target>,
    key: String,
    /// The target's time when the object was first written.
    pub modified: SystemTime,
    last_renewal: Arc<Mutex<Instant>>,
    options: LeaseOptions,
    renewer: tokio::task::JoinHandle<()>,
}

impl Held {
    /// Writes `key` and starts renewing it.
    pub async fn take(target: Arc<dyn Target>, key: String, body: Bytes, options: LeaseOptions) -> Result<Self, Error> {
        let started = Instant::now();
        target.put(&key, body.clone()).await?;
        let modified = target.head(&key).await?.map_or_else(SystemTime::now, |i| i.modified);
        let last_renewal = Arc::new(Mutex::new(started));
        let renewer = tokio::spawn({
            let (target, key, last) = (Arc::clone(&target), key.clone(), Arc::clone(&last_renewal));
            async move {
                loop {
                    tokio::time::sleep(options.renew_every).await;
                    let at = Instant::now();
                    match target.put(&key, body.clone()).await {
                        Ok(()) => *last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = at,
                        Err(e) => tracing::warn!(lease = %key, error = %e, "could not renew"),
                    }
                }
            }
        });
        Ok(Self { target, key, modified, last_renewal, options, renewer })
    }

    /// `Err(age)` once the last successful renewal is older than half the TTL: the other side
    /// may soon (or already) judge this holder dead.
    pub fn healthy(&self) -> Result<(), Duration> {
        let age = self.last_renewal.lock().unwrap_or_else(std::sync::PoisonError::into_inner).elapsed();
        if age < self.options.ttl / 2 { Ok(()) } else { Err(age) }
    }

    /// Stops renewing and removes the object (a failure only delays the next holder by the TTL).
    pub async fn release(self) {
        self.renewer.abort();
        if let Err(e) = self.target.delete(&self.key).await {
            tracing::warn!(lease = %self.key, error = %e, "could not remove; it expires");
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.renewer.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_on_one_clock() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let ttl = Duration::from_secs(10);
        assert!(is_live(now - Duration::from_secs(9), now, ttl));
        assert!(!is_live(now - Duration::from_secs(10), now, ttl));
        // Renewed after the judge wrote its own object: live.
        assert!(is_live(now + Duration::from_secs(1), now, ttl));
    }

    #[tokio::test]
    async fn a_held_lease_is_renewed_and_removed_on_release() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target: Arc<dyn Target> = Arc::new(crate::FsTarget::new(dir.path()));
        let options = LeaseOptions { ttl: Duration::from_secs(2), renew_every: Duration::from_millis(50) };
        let held = Held::take(Arc::clone(&target), "l".into(), Bytes::from_static(b"{}"), options).await.expect("take");
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert!(held.healthy().is_ok(), "renewed in the background");
        held.release().await;
        assert_eq!(target.head("l").await.expect("head"), None);
    }
}
