//! This process's identity and the controller's authority endpoint, as a host starts them
//! ([`start`]): the credentials directory followed as it rotates (`--tls-dir`); on a node with
//! `--authority`, its certificate asked for (with the node plugin's ServiceAccount token) and
//! renewed from the controller's built-in CA; on a controller with `--authority-listen`, the
//! authority endpoint (grants of volumes from the block catalog; node certificates when it holds
//! the CA, `--ca-dir`, which it reads from its Secret, or creates there, with `--ca-secret`; its
//! own certificate then comes from that CA too, issued and renewed here).
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use wasmcsi_block::transport::Transport;
use wasmcsi_csi::Mode;
use wasmcsi_csi::authority_endpoint::ca_store::CaStore;
use wasmcsi_csi::authority_endpoint::client::ClientIdentity;
use wasmcsi_csi::authority_endpoint::enroll::{Enrollment, renewal_due};
use wasmcsi_csi::authority_endpoint::token_review::{KubeApi, TokenReviewer};
use wasmcsi_csi::authority_endpoint::{AuthorityClient, AuthorityService, CatalogPublications, CertificateIssuer};
use wasmcsi_runtime::Registry;
use wasmcsi_trust::listener::Stats;
use wasmcsi_trust::pki::DEFAULT_LEAF_VALIDITY;
use wasmcsi_trust::reload::DEFAULT_POLL_INTERVAL;
use wasmcsi_trust::{
    Authority, Credentials, GrantSource, Limits, Listener, LiveCredentials, LocalGrantSource, Role, TlsMode, Validity,
    Watcher,
};

/// What a host is told about its identity; the default: none (plaintext, no authority).
#[derive(Debug, Clone, Default)]
pub struct TrustOptions {
    /// How this process's TCP channels are carried (`--tls-mode`: the replica port, the peer
    /// endpoint and the controller's calls to it); `None`: `required` when `tls_dir` is given.
    /// Without either, the peer channel refuses to start and the command line refuses to serve
    /// replicas ([`check_replica_mode`]): plaintext is never a default there. A host built in
    /// code (a test, the demo) may serve replicas in plaintext by leaving both unset.
    pub tls_mode: Option<TlsMode>,
    /// This process's credentials directory (`ca.crt`, `tls.crt`, `tls.key`), followed as it
    /// rotates.
    pub tls_dir: Option<PathBuf>,
    /// A controller: serve the authority endpoint here (with the credentials of `tls_dir`,
    /// which must be the controller's).
    pub authority_listen: Option<SocketAddr>,
    /// A controller: the built-in CA's directory (`pki init`); without it the endpoint serves
    /// grants only, and node certificates come from the cluster's own PKI. With it, the
    /// controller's own certificate in `tls_dir` comes from this CA too (issued when missing,
    /// renewed at 2/3 of its life).
    pub ca_dir: Option<PathBuf>,
    /// A controller in a pod: the built-in CA is kept in this Secret (`NAMESPACE/NAME`), read
    /// into `ca_dir` at start and created when absent; its certificate is published in the
    /// ConfigMap of the same name (what nodes trust the authority endpoint by before their
    /// first certificate).
    pub ca_secret: Option<String>,
    /// How long the node certificates the CA issues are valid (default 24 h).
    pub certificate_validity: Option<Duration>,
    /// How long the grants the authority endpoint signs are valid (default 24 h).
    pub grant_validity: Option<Duration>,
    /// A controller issuing first certificates to nodes that prove themselves with a token: the
    /// node plugin's ServiceAccount, `NAMESPACE:NAME`.
    pub node_service_account: Option<String>,
    /// The API server that reviews those tokens (default: the one of the pod this runs in).
    pub kube_api: Option<KubeApi>,
    /// A node: the authority endpoint (`https://HOST:PORT`) its certificate comes from.
    pub authority: Option<String>,
    /// A node: the CA bundle to trust the authority endpoint by before it has a certificate
    /// (default: `ca.crt` in `tls_dir`).
    pub authority_ca: Option<PathBuf>,
    /// A node: the node plugin's projected ServiceAccount token (audience `wasmcsi`).
    pub authority_token: Option<PathBuf>,
}

/// What [`start`] started; dropping it stops all of it.
#[derive(Default)]
pub struct Trust {
    /// This process's credentials, when it has any.
    pub credentials: Option<LiveCredentials>,
    /// Where the authority endpoint listens (a controller).
    pub authority_addr: Option<SocketAddr>,
    /// Where this node's data path gets the grants of its volumes: the authority endpoint, or
    /// this process's own controller credentials when it is the controller too.
    pub grant_source: Option<Arc<dyn GrantSource>>,
    /// The counters of the listeners started here, by name (for `/metrics`).
    pub listeners: Vec<(&'static str, Arc<Stats>)>,
    _watcher: Option<Watcher>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Trust {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts what `opts` asks for (see the module doc).
pub async fn start(opts: &TrustOptions, mode: Mode, node_id: &str, registry: &Arc<Registry>) -> anyhow::Result<Trust> {
    let mut trust = Trust::default();
    let needs_dir = |what: &str| anyhow::anyhow!("{what} needs this process's credentials (--tls-dir)");
    if opts.authority_listen.is_some() && !mode.controller() {
        anyhow::bail!("the authority endpoint is served by the controller (--mode controller or all)");
    }
    let enrollment = match (&opts.authority, mode.node()) {
        (Some(url), true) => Some(Enrollment {
            url: url.clone(),
            node: node_id.to_owned(),
            dir: opts.tls_dir.clone().ok_or_else(|| needs_dir("--authority"))?,
            ca_file: opts.authority_ca.clone(),
            token_file: opts.authority_token.clone(),
        }),
        _ => None,
    };
    // A node's first certificate before anything reads the directory.
    if let Some(enrollment) = &enrollment {
        enrollment.ensure().await.with_context(|| format!("this node's certificate from {}", enrollment.url))?;
    }
    // A controller holding the CA: the CA from its Secret, then the controller's own
    // certificate from the CA, before anything reads the directory.
    if let (Some(ca_dir), true) = (&opts.ca_dir, mode.controller()) {
        if let Some(secret) = &opts.ca_secret {
            load_ca_secret(opts, secret, ca_dir).await?;
        }
        if let Some(tls_dir) = &opts.tls_dir {
            let ca = Authority::load(ca_dir).with_context(|| format!("the built-in CA in {}", ca_dir.display()))?;
            let validity = opts.certificate_validity.unwrap_or(DEFAULT_LEAF_VALIDITY);
            ensure_controller_credentials(&ca, tls_dir, validity)?;
            trust.tasks.push(tokio::spawn(renew_controller_forever(ca, tls_dir.clone(), validity)));
        }
    }
    if let Some(dir) = &opts.tls_dir {
        let (live, watcher) = wasmcsi_trust::watch(dir, DEFAULT_POLL_INTERVAL)
            .with_context(|| format!("this process's credentials in {}", dir.display()))?;
        tracing::info!(dir = %dir.display(), role = %live.current().role(), expires_in = live.seconds_to_expiry(), "loaded TLS credentials");
        trust.credentials = Some(live);
        trust._watcher = Some(watcher);
    }
    let publications = || Arc::new(CatalogPublications::new(registry.clone()));

    if let (Some(enrollment), Some(live)) = (enrollment, &trust.credentials) {
        let client = AuthorityClient::new(&enrollment.url, ClientIdentity::Credentials(live.clone()))?;
        trust.grant_source = Some(Arc::new(client));
        trust.tasks.push(tokio::spawn(enrollment.renew_forever(live.clone())));
    } else if let (true, Some(live)) = (mode == Mode::All, &trust.credentials)
        && live.current().role() == &Role::Controller
    {
        trust.grant_source = Some(Arc::new(LocalGrantSource::new(live.clone(), node_id, publications())));
    }

    if let Some(addr) = opts.authority_listen {
        let live = trust.credentials.clone().ok_or_else(|| needs_dir("--authority-listen"))?;
        let role = live.current().role().clone();
        if role != Role::Controller {
            anyhow::bail!(
                "the authority endpoint is served with the controller's credentials; --tls-dir holds {role}'s"
            );
        }
        let mut service = AuthorityService::new(live.clone(), publications());
        if let Some(life) = opts.grant_validity {
            service = service.with_grant_life(life);
        }
        if let Some(ca_dir) = &opts.ca_dir {
            let ca = Authority::load(ca_dir).with_context(|| format!("the built-in CA in {}", ca_dir.display()))?;
            service = service.with_issuer(issuer(opts, ca)?);
        }
        let listener = Listener::bind(addr, Limits::default())
            .await
            .with_context(|| format!("binding the authority endpoint on {addr}"))?;
        let bound = listener.local_addr()?;
        trust.listeners.push(("authority", listener.stats()));
        trust.tasks.push(tokio::spawn(async move {
            if let Err(e) = wasmcsi_csi::authority_endpoint::serve(listener, live, service).await {
                tracing::error!(addr = %bound, error = %e, "the authority endpoint stopped");
            }
        }));
        tracing::info!(addr = %bound, certificates = opts.ca_dir.is_some(), "serving the authority endpoint");
        trust.authority_addr = Some(bound);
    }
    Ok(trust)
}

/// The CA from the Secret `NAMESPACE/NAME` (created when absent) into `ca_dir`, and its
/// certificate published for the nodes (`wasmcsi_csi::authority_endpoint::ca_store`).
async fn load_ca_secret(opts: &TrustOptions, secret: &str, ca_dir: &std::path::Path) -> anyhow::Result<()> {
    let (namespace, name) = secret
        .split_once('/')
        .filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
        .with_context(|| format!("--ca-secret {secret:?}: not NAMESPACE/NAME"))?;
    let api = opts.kube_api.clone().or_else(KubeApi::in_cluster).context(
        "keeping the CA in a Secret needs the Kubernetes API server (--kube-api, or KUBERNETES_SERVICE_HOST in a pod)",
    )?;
    let store = CaStore::new(api, namespace, name)?;
    let ca = store.ensure(ca_dir).await.with_context(|| format!("the built-in CA in the Secret {secret}"))?;
    store.publish(&ca).await.with_context(|| format!("publishing the CA's certificate in the ConfigMap {secret}"))?;
    Ok(())
}

/// The controller's own credentials in `dir`, issued by `ca` unless a controller certificate
/// with more than a third of its life left is there already.
fn ensure_controller_credentials(ca: &Authority, dir: &std::path::Path, validity: Duration) -> anyhow::Result<()> {
    if let Ok(current) = Credentials::load(dir)
        && current.role() == &Role::Controller
        && SystemTime::now() < renewal_due(current.not_before(), current.not_after())
    {
        return Ok(());
    }
    issue_controller_credentials(ca, dir, validity)
}

fn issue_controller_credentials(ca: &Authority, dir: &std::path::Path, validity: Duration) -> anyhow::Result<()> {
    ca.issue(&Role::Controller, Validity::starting_now(validity))
        .and_then(|issued| issued.write(dir, ca.bundle()))
        .with_context(|| format!("the controller's certificate from the built-in CA into {}", dir.display()))?;
    tracing::info!(dir = %dir.display(), valid_for = ?validity, "issued the controller's own certificate");
    Ok(())
}

/// Renews the controller's own certificate from `ca` at 2/3 of its life, forever; the
/// directory's watcher picks each new set up (connections already open keep theirs).
async fn renew_controller_forever(ca: Authority, dir: PathBuf, validity: Duration) {
    loop {
        let due = Credentials::load(&dir)
            .map(|c| renewal_due(c.not_before(), c.not_after()))
            .unwrap_or_else(|_| SystemTime::now());
        if let Ok(wait) = due.duration_since(SystemTime::now()) {
            tokio::time::sleep(wait).await;
        }
        if let Err(e) = issue_controller_credentials(&ca, &dir, validity) {
            tracing::warn!(error = %format!("{e:#}"), "renewing the controller's certificate failed; retrying");
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
    }
}

/// The CA's issuer: tokens are checked when the node plugin's ServiceAccount is named and an API
/// server is known (given, or the pod's own).
fn issuer(opts: &TrustOptions, ca: Authority) -> anyhow::Result<CertificateIssuer> {
    let validity = opts.certificate_validity.unwrap_or(DEFAULT_LEAF_VALIDITY);
    let tokens = match &opts.node_service_account {
        Some(account) => {
            let api = opts.kube_api.clone().or_else(KubeApi::in_cluster).context(
                "checking node tokens needs the Kubernetes API server (--kube-api, or KUBERNETES_SERVICE_HOST in a pod)",
            )?;
            Some((TokenReviewer::new(api)?, account.as_str()))
        }
        None => {
            tracing::info!(
                "no node plugin ServiceAccount given: nodes renew certificates here, their first comes from elsewhere"
            );
            None
        }
    };
    Ok(CertificateIssuer::new(ca, validity, tokens)?)
}

/// How `channel` is carried: `mode` as given (a TLS mode needs credentials), else mutual TLS
/// with this process's credentials; with neither, the channel does not start: plaintext is
/// chosen explicitly (`--tls-mode off`), never fallen into.
pub fn transport(mode: Option<TlsMode>, trust: &Trust, channel: &str) -> anyhow::Result<Transport> {
    match (mode, &trust.credentials) {
        (Some(mode), credentials) => Transport::new(mode, credentials.clone()).with_context(|| channel.to_owned()),
        (None, Some(credentials)) => Ok(Transport::Required(credentials.clone())),
        (None, None) => anyhow::bail!(
            "{channel} needs this process's credentials (--tls-dir) for mutual TLS, or --tls-mode off to run it in plaintext"
        ),
    }
}

/// Over TLS, `channel` is served or dialled as `role`: refuses to start with another's
/// credentials (a node certificate on the controller, another node's on a node).
pub fn require_role(transport: &Transport, role: &Role, channel: &str) -> anyhow::Result<()> {
    match transport.role() {
        Some(ours) if &ours != role => {
            anyhow::bail!("{channel} runs as {role}, but --tls-dir holds {ours}'s certificate")
        }
        _ => Ok(()),
    }
}

/// A process that serves replicas speaks plaintext only when told so: without `--tls-dir`,
/// `--tls-mode off` must be given.
pub fn check_replica_mode(tls_dir: Option<&std::path::Path>, tls_mode: Option<TlsMode>) -> anyhow::Result<()> {
    match (tls_dir, tls_mode) {
        (None, None) => anyhow::bail!(
            "serving replicas needs this node's credentials (--tls-dir), or plaintext chosen explicitly (--tls-mode off)"
        ),
        (None, Some(mode)) if mode != TlsMode::Off => {
            anyhow::bail!("--tls-mode {mode} needs this node's credentials (--tls-dir)")
        }
        _ => Ok(()),
    }
}

/// How the replica port travels for `mode` (unset: `required` with credentials, plaintext
/// without) with this process's `credentials`.
pub fn replica_transport(mode: Option<TlsMode>, credentials: Option<&LiveCredentials>) -> anyhow::Result<Transport> {
    let mode = mode.unwrap_or(if credentials.is_some() { TlsMode::Required } else { TlsMode::Off });
    Ok(Transport::new(mode, credentials.cloned())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plaintext_replicas_are_only_ever_an_explicit_choice() {
        let dir = std::path::Path::new("/etc/wasmcsi/tls");
        assert!(check_replica_mode(None, None).is_err());
        assert!(check_replica_mode(None, Some(TlsMode::Required)).is_err());
        assert!(check_replica_mode(None, Some(TlsMode::Off)).is_ok());
        assert!(check_replica_mode(Some(dir), None).is_ok());
        assert!(check_replica_mode(Some(dir), Some(TlsMode::Permissive)).is_ok());
        assert!(matches!(replica_transport(None, None), Ok(Transport::Plain)));
        assert!(replica_transport(Some(TlsMode::Required), None).is_err());
    }
}
