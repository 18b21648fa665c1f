//! Trust for every network channel of wasmcsi: who a peer is, whether it may connect, and what
//! the controller granted it. It owns the identities ([`identity`]: a [`Role`] in a
//! `spiffe://wasmcsi/…` URI SAN), the built-in CA ([`pki`]: generate, load, issue, sign
//! requests, write a credentials directory in the Kubernetes TLS Secret layout; [`inspect`] reads
//! one back fact by fact), loading a
//! credentials directory into mutual-TLS rustls configs with our own verifiers
//! ([`credentials`], [`verifier`]; TLS 1.3 only, ring, AES-128-GCM preferred: [`provider`]),
//! following that directory as it rotates ([`reload`]), controller-signed grants and where a node
//! gets them ([`grant`], [`grant::source`]), the one bounded accept loop of every TCP listener
//! ([`listener`]: caps, back-off on descriptor exhaustion, handshake deadline and byte budget,
//! plaintext and permissive modes), a TLS connection a synchronous thread writes into
//! directly ([`stream`]) and the `--tls-mode` every channel is run in ([`mode`]).
//!
//! It does not own what a role may do: the replica server decides which requests a node or the
//! controller may make and checks a grant's volume, node and epoch; the authority endpoint
//! decides who gets a certificate (token review, renewal); the CLI turns these into `pki`
//! commands and `--tls-dir`/`--tls-mode` options; metrics are registered by their processes
//! (this crate exposes the numbers: [`LiveCredentials::seconds_to_expiry`], [`listener::Stats`]).
//! It depends on no other wasmcsi crate.
//!
//! Why operator-issued and built-in certificates are both supported: a cluster that runs
//! cert-manager already has rotation, auditing and its own CA policy, and wasmcsi should only
//! read the files it is given ([`reload`] follows them); a cluster without one still gets
//! per-node identities from the built-in CA with no extra component.

pub mod credentials;
pub mod grant;
pub mod identity;
pub mod inspect;
pub mod listener;
pub mod mode;
pub mod pki;
pub mod provider;
pub mod reload;
pub mod secret_dir;
pub mod stream;
pub mod verifier;

pub use credentials::{Credentials, CredentialsError};
pub use grant::source::{GrantSource, GrantSourceError, LocalGrantSource, Publications};
pub use grant::{Grant, GrantError, SignedGrant};
pub use identity::{IdentityError, Role};
pub use listener::{Limits, Listener};
pub use mode::TlsMode;
pub use pki::{Authority, Validity};
pub use reload::{LiveCredentials, Watcher, watch};
pub use verifier::{ExpectedRole, TrustAnchors};

#[cfg(test)]
pub(crate) mod test_support;
