//! Where a node gets the grants its engines present: a [`GrantSource`].
//!
//! The data path holds one as `Arc<dyn GrantSource>` and asks it for a grant of each attached
//! volume when it has none, or when less than half of the one it has is left. Two sources exist:
//! the client of the controller's authority endpoint (its `GrantVolume` call, in the CSI crate),
//! and [`LocalGrantSource`], which signs with the controller's own credentials in this process
//! (a process that is controller and node at once, and tests). Both decide the same way: a grant
//! of volume V for node N is signed only while V is published to N, at the epoch it is published
//! at ([`Publications`]); the controller answers that from the volumes' records.
//!
//! Errors say what the caller should do: [`GrantSourceError::Refused`] will not change by
//! asking again (the volume is not published to this node, or gone), while
//! [`GrantSourceError::Unavailable`] is worth retrying with back-off (the controller or a node of
//! the volume does not answer, the signer's credentials are unusable for now).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::grant::{DEFAULT_LIFE, Grant};
use crate::reload::LiveCredentials;

/// What [`GrantSource::grant`] returns.
pub type GrantFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<u8>, GrantSourceError>> + Send + 'a>>;
/// What [`Publications::published_epoch`] returns.
pub type EpochFuture<'a> = Pin<Box<dyn Future<Output = Result<u64, GrantSourceError>> + Send + 'a>>;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GrantSourceError {
    /// The controller will not grant the volume to this node (it is published to another node,
    /// to none, or it does not exist): asking again changes nothing until it is published here.
    #[error("no grant of volume {volume}: {reason}")]
    Refused { volume: String, reason: String },
    /// No grant for now (the controller or the volume's nodes do not answer, the signer's
    /// credentials are unusable): retry with back-off.
    #[error("no grant of volume {volume} for now: {reason}")]
    Unavailable { volume: String, reason: String },
}

impl GrantSourceError {
    pub fn refused(volume: &str, reason: impl Into<String>) -> Self {
        GrantSourceError::Refused { volume: volume.to_owned(), reason: reason.into() }
    }

    pub fn unavailable(volume: &str, reason: impl Into<String>) -> Self {
        GrantSourceError::Unavailable { volume: volume.to_owned(), reason: reason.into() }
    }
}

/// Grants of volumes (replica set ids) for the node this source serves.
pub trait GrantSource: Send + Sync {
    /// A grant of `set_id` for this node, encoded as [`Grant::sign`] encodes it.
    fn grant<'a>(&'a self, set_id: &'a str) -> GrantFuture<'a>;
}

/// The controller's knowledge of which volume is published to which node.
pub trait Publications: Send + Sync {
    /// The epoch `set_id` is published to `node` at; [`GrantSourceError::Refused`] when it is
    /// not published to `node`.
    fn published_epoch<'a>(&'a self, set_id: &'a str, node: &'a str) -> EpochFuture<'a>;
}

/// Signs a grant of `set_id` for `node` at the epoch `publications` says, with the controller's
/// credentials: the decision the authority endpoint makes for a remote node, and
/// [`LocalGrantSource`] for this one.
pub async fn grant_published(
    signer: &LiveCredentials,
    publications: &dyn Publications,
    set_id: &str,
    node: &str,
    life: Duration,
) -> Result<Vec<u8>, GrantSourceError> {
    let epoch = publications.published_epoch(set_id, node).await?;
    Grant::starting_now(set_id, node, epoch, life)
        .sign(&signer.current())
        .map(|signed| signed.encoded)
        .map_err(|e| GrantSourceError::unavailable(set_id, e.to_string()))
}

/// A source that signs grants itself, with the controller's credentials (a process that is
/// controller and node at once; tests).
pub struct LocalGrantSource {
    signer: LiveCredentials,
    node: String,
    life: Duration,
    publications: Arc<dyn Publications>,
}

impl LocalGrantSource {
    /// Grants for `node`, signed with `signer` (the controller's credentials), for
    /// [`DEFAULT_LIFE`].
    pub fn new(signer: LiveCredentials, node: impl Into<String>, publications: Arc<dyn Publications>) -> Self {
        LocalGrantSource { signer, node: node.into(), life: DEFAULT_LIFE, publications }
    }

    /// Grants valid for `life` instead.
    pub fn with_life(mut self, life: Duration) -> Self {
        self.life = life;
        self
    }
}

impl GrantSource for LocalGrantSource {
    fn grant<'a>(&'a self, set_id: &'a str) -> GrantFuture<'a> {
        Box::pin(grant_published(&self.signer, self.publications.as_ref(), set_id, &self.node, self.life))
    }
}

/// Publications kept in a table in memory: tests, and a process with no volume records to read.
#[derive(Default)]
pub struct PublicationTable {
    /// volume → (node, epoch)
    published: Mutex<HashMap<String, (String, u64)>>,
}

impl PublicationTable {
    /// `set_id` is published to `node` at `epoch` (replacing what was published before).
    pub fn publish(&self, set_id: &str, node: &str, epoch: u64) {
        self.lock().insert(set_id.to_owned(), (node.to_owned(), epoch));
    }

    /// `set_id` is published to no node.
    pub fn unpublish(&self, set_id: &str) {
        self.lock().remove(set_id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, u64)>> {
        self.published.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Publications for PublicationTable {
    fn published_epoch<'a>(&'a self, set_id: &'a str, node: &'a str) -> EpochFuture<'a> {
        let answer = match self.lock().get(set_id) {
            Some((owner, epoch)) if owner == node => Ok(*epoch),
            Some((owner, _)) => {
                Err(GrantSourceError::refused(set_id, format!("it is published to node {owner}, not {node}")))
            }
            None => Err(GrantSourceError::refused(set_id, format!("it is not published to node {node}"))),
        };
        Box::pin(std::future::ready(answer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Role;
    use crate::test_support::Pki;
    use crate::verifier::TrustAnchors;
    use std::time::SystemTime;

    struct Setup {
        source: Arc<dyn GrantSource>,
        table: Arc<PublicationTable>,
        anchors: TrustAnchors,
        _pki: Pki,
    }

    fn setup(signer_role: Role) -> Setup {
        let mut pki = Pki::new();
        let signer = LiveCredentials::new(pki.credentials(&signer_role));
        let table = Arc::new(PublicationTable::default());
        let source: Arc<dyn GrantSource> =
            Arc::new(LocalGrantSource::new(signer, "n1", table.clone()).with_life(Duration::from_secs(600)));
        let anchors = TrustAnchors::new(vec![pki.ca.certificate().clone()]).expect("anchors");
        Setup { source, table, anchors, _pki: pki }
    }

    fn block_on<T>(f: impl Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(f)
    }

    #[test]
    fn a_volume_published_to_this_node_gets_a_grant_at_its_epoch() {
        let s = setup(Role::Controller);
        s.table.publish("set-1", "n1", 9);
        let encoded = block_on(s.source.grant("set-1")).expect("granted");
        let grant = crate::grant::verify(&encoded, &s.anchors, SystemTime::now()).expect("verifies");
        assert_eq!((grant.volume.as_str(), grant.node.as_str(), grant.epoch), ("set-1", "n1", 9));
        let life = grant.not_after.duration_since(grant.not_before).expect("ordered");
        // Starts SKEW early, ends `life` from now, cut to whole seconds.
        assert!(life.as_secs().abs_diff(600 + 30) <= 1, "{life:?}");
    }

    #[test]
    fn a_volume_published_elsewhere_or_nowhere_is_refused() {
        let s = setup(Role::Controller);
        s.table.publish("set-1", "n2", 3);
        let err = block_on(s.source.grant("set-1")).expect_err("published to n2");
        assert!(matches!(&err, GrantSourceError::Refused { reason, .. } if reason.contains("n2")), "{err}");
        s.table.unpublish("set-1");
        let err = block_on(s.source.grant("set-1")).expect_err("published nowhere");
        assert!(matches!(err, GrantSourceError::Refused { .. }), "{err}");
    }

    #[test]
    fn a_republish_at_a_new_epoch_is_what_the_next_grant_carries() {
        let s = setup(Role::Controller);
        s.table.publish("set-1", "n1", 4);
        let first = block_on(s.source.grant("set-1")).expect("granted");
        s.table.publish("set-1", "n1", 6);
        let second = block_on(s.source.grant("set-1")).expect("granted");
        let epoch = |g: &[u8]| crate::grant::verify(g, &s.anchors, SystemTime::now()).expect("verifies").epoch;
        assert_eq!((epoch(&first), epoch(&second)), (4, 6));
    }

    #[test]
    fn a_signer_that_is_not_the_controller_gives_no_grant_and_says_why() {
        let s = setup(Role::Node("n1".into()));
        s.table.publish("set-1", "n1", 1);
        let err = block_on(s.source.grant("set-1")).expect_err("a node cannot sign");
        assert!(
            matches!(&err, GrantSourceError::Unavailable { reason, .. } if reason.contains("only the controller")),
            "{err}"
        );
    }
}
