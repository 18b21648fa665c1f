//! Keeping each attached volume's grant fresh: the grant its engine presents to open sessions on
//! the replicas of other nodes (`wasmcsi_block::volume::VolumeGrant`). One keeper task per
//! attached volume asks the node's [`GrantSource`] for a new grant when less than half of the
//! current one's life is left, when it has none or one that no longer verifies here (expired, a
//! stage from long ago, a volume attached before grants existed), and when a connection says a
//! replica refused the one it presented. A failure is logged, counted
//! ([`GrantKeepers::renewal_failures`], `wasmcsi_grant_renewal_failures_total` on `/metrics`)
//! and retried with back-off; sessions already open keep running, since a grant is checked only
//! when a session opens.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::Instrument as _;
use wasmcsi_block::volume::VolumeGrant;
use wasmcsi_trust::{GrantSource, LiveCredentials, TrustAnchors};

/// First wait after a failed renewal; doubled per failure up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// Least time between two fetches asked for by connections: a replica that refuses for a reason
/// a fresh grant does not change (another node holds the volume now) must not make this node
/// hammer the controller.
const MIN_REFETCH: Duration = Duration::from_secs(1);

/// What the keepers of one data path share: where grants come from (set once the binary has
/// one), the credentials grants are checked with, the failure counter.
#[derive(Clone)]
pub struct GrantKeepers {
    source: Arc<OnceLock<Arc<dyn GrantSource>>>,
    failures: Arc<AtomicU64>,
}

impl Default for GrantKeepers {
    fn default() -> Self {
        Self { source: Arc::new(OnceLock::new()), failures: Arc::new(AtomicU64::new(0)) }
    }
}

impl GrantKeepers {
    /// Grants come from `source` from now on (once; a second call is ignored and says so).
    pub fn set_source(&self, source: Arc<dyn GrantSource>) -> bool {
        self.source.set(source).is_ok()
    }

    /// Renewals that failed since this data path started.
    pub fn renewal_failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Starts the keeper of `volume`'s grant, checked against `credentials`' CA bundle.
    pub(crate) fn keep(&self, volume: &str, grant: Arc<VolumeGrant>, credentials: LiveCredentials) -> JoinHandle<()> {
        let span = tracing::info_span!("datapath.grant", volume.id = %volume);
        tokio::spawn(keep(volume.to_owned(), grant, credentials, self.clone()).instrument(span))
    }
}

async fn keep(volume: String, grant: Arc<VolumeGrant>, credentials: LiveCredentials, keepers: GrantKeepers) {
    let mut last_fetch: Option<Instant> = None;
    loop {
        let wait = renew_in(grant.current().as_deref(), credentials.current().anchors(), SystemTime::now());
        if !wait.is_zero() {
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = grant.fresh_wanted() => tracing::info!("a replica refused the grant, or none was held; asking for a fresh one"),
            }
        }
        if let Some(since) = last_fetch.map(|t| t.elapsed())
            && since < MIN_REFETCH
        {
            tokio::time::sleep(MIN_REFETCH - since).await;
        }
        let mut backoff = BACKOFF_MIN;
        loop {
            last_fetch = Some(Instant::now());
            match fetch(&volume, &keepers, credentials.current().anchors()).await {
                Ok((fresh, not_after)) => {
                    grant.set(fresh);
                    let left = not_after.duration_since(SystemTime::now()).unwrap_or_default();
                    tracing::info!(valid_for = ?left, "renewed the volume's grant");
                    break;
                }
                Err(error) => {
                    keepers.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%error, retry_in = ?backoff, "renewing the volume's grant failed");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }
}

/// A fresh grant from the source, checked here first (a grant this node's CA bundle does not
/// verify would only be refused by every replica).
async fn fetch(volume: &str, keepers: &GrantKeepers, anchors: &TrustAnchors) -> Result<(Vec<u8>, SystemTime), String> {
    let source = keepers.source.get().ok_or("this data path has no grant source (the node's --authority)")?;
    let fresh = source.grant(volume).await.map_err(|e| e.to_string())?;
    let checked = wasmcsi_trust::grant::verify(&fresh, anchors, SystemTime::now())
        .map_err(|e| format!("the grant the source gave does not verify here: {e}"))?;
    Ok((fresh, checked.not_after))
}

/// How long until `grant` should be renewed: when half of its life is left; at once when there
/// is none or it does not verify against `anchors` (expired, not yet valid, another CA).
pub fn renew_in(grant: Option<&[u8]>, anchors: &TrustAnchors, now: SystemTime) -> Duration {
    let Some(encoded) = grant else { return Duration::ZERO };
    match wasmcsi_trust::grant::verify(encoded, anchors, now) {
        Ok(g) => {
            let life = g.not_after.duration_since(g.not_before).unwrap_or_default();
            (g.not_before + life / 2).duration_since(now).unwrap_or_default()
        }
        Err(_) => Duration::ZERO,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use wasmcsi_trust::grant::source::PublicationTable;
    use wasmcsi_trust::pki::{Authority, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Validity};
    use wasmcsi_trust::{Credentials, Grant, LocalGrantSource, Role};

    struct Setup {
        node: LiveCredentials,
        controller: LiveCredentials,
        table: Arc<PublicationTable>,
        _dirs: Vec<tempfile::TempDir>,
    }

    fn setup() -> Setup {
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).unwrap();
        let mut dirs = Vec::new();
        let mut live = |role: Role| {
            let dir = tempfile::tempdir().unwrap();
            let issued = ca.issue(&role, Validity::starting_now(DEFAULT_LEAF_VALIDITY)).unwrap();
            issued.write(dir.path(), &[ca.certificate().clone()]).unwrap();
            let credentials = LiveCredentials::new(Credentials::load(dir.path()).unwrap());
            dirs.push(dir);
            credentials
        };
        let node = live(Role::Node("n1".into()));
        let controller = live(Role::Controller);
        Setup { node, controller, table: Arc::new(PublicationTable::default()), _dirs: dirs }
    }

    fn signed(s: &Setup, from: SystemTime, life: Duration) -> Vec<u8> {
        let grant =
            Grant { volume: "v1".into(), node: "n1".into(), epoch: 2, not_before: from, not_after: from + life };
        grant.sign(&s.controller.current()).unwrap().encoded
    }

    #[test]
    fn a_grant_is_renewed_at_half_its_life_and_at_once_when_missing_or_expired() {
        let s = setup();
        let anchors = s.node.current().anchors().clone();
        let now = SystemTime::now();
        let hour = Duration::from_secs(3600);
        assert_eq!(renew_in(None, &anchors, now), Duration::ZERO);
        let fresh = signed(&s, now, 2 * hour);
        let wait = renew_in(Some(&fresh), &anchors, now);
        assert!(wait.abs_diff(hour) <= Duration::from_secs(1), "{wait:?}");
        let expired = signed(&s, now - 3 * hour, hour);
        assert_eq!(renew_in(Some(&expired), &anchors, now), Duration::ZERO);
        assert_eq!(renew_in(Some(b"not a grant"), &anchors, now), Duration::ZERO);
    }

    #[tokio::test]
    async fn an_expired_grant_is_replaced_from_the_source_and_failures_are_counted_and_retried() {
        let s = setup();
        let keepers = GrantKeepers::default();
        let expired = signed(&s, SystemTime::now() - Duration::from_secs(7200), Duration::from_secs(3600));
        let grant = Arc::new(VolumeGrant::new(Some(expired.clone())));
        // Not published to this node yet: the source refuses, the keeper counts and retries.
        let source = LocalGrantSource::new(s.controller.clone(), "n1", s.table.clone());
        assert!(keepers.set_source(Arc::new(source)));
        let keeper = keepers.keep("v1", grant.clone(), s.node.clone());
        let deadline = Instant::now() + Duration::from_secs(10);
        while keepers.renewal_failures() == 0 {
            assert!(Instant::now() < deadline, "no failure counted");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(grant.current().as_deref(), Some(&expired[..]), "a failed renewal keeps what it had");
        s.table.publish("v1", "n1", 2);
        while grant.current().as_deref() == Some(&expired[..]) {
            assert!(Instant::now() < deadline, "the grant was not renewed once the source granted it");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let anchors = s.node.current().anchors().clone();
        let renewed = wasmcsi_trust::grant::verify(&grant.current().unwrap(), &anchors, SystemTime::now()).unwrap();
        assert_eq!((renewed.volume.as_str(), renewed.node.as_str(), renewed.epoch), ("v1", "n1", 2));
        // A connection refused the new one (say, after a republish): the keeper fetches again.
        s.table.publish("v1", "n1", 3);
        grant.want_fresh();
        while wasmcsi_trust::grant::verify(&grant.current().unwrap(), &anchors, SystemTime::now()).unwrap().epoch != 3 {
            assert!(Instant::now() < deadline + Duration::from_secs(5), "not fetched again when asked");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        keeper.abort();
    }
}
