//! The two calls of the authority endpoint and who gets what (see the module doc of
//! [`super`]).
use std::sync::Arc;
use std::time::Duration;

use wasmcsi_proto::authority::v1 as pb;
use wasmcsi_proto::authority::v1::authority_server::Authority as AuthorityRpc;
use wasmcsi_trust::grant::source::{Publications, grant_published};
use wasmcsi_trust::grant::{DEFAULT_LIFE, MAX_VOLUME_LEN};
use wasmcsi_trust::{Authority, GrantSourceError, LiveCredentials, Role, Validity};

use super::Caller;
use super::token_review::{ReviewError, TokenReviewer};

/// Why a call was refused, each with its gRPC code (one mapping, [`From<AuthorityError>`]).
#[derive(Debug, thiserror::Error)]
pub enum AuthorityError {
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Unavailable(String),
}

impl From<AuthorityError> for tonic::Status {
    fn from(e: AuthorityError) -> Self {
        let message = e.to_string();
        match e {
            AuthorityError::Unauthenticated(_) => tonic::Status::unauthenticated(message),
            AuthorityError::PermissionDenied(_) => tonic::Status::permission_denied(message),
            AuthorityError::Invalid(_) => tonic::Status::invalid_argument(message),
            AuthorityError::FailedPrecondition(_) => tonic::Status::failed_precondition(message),
            AuthorityError::Unavailable(_) => tonic::Status::unavailable(message),
        }
    }
}

impl From<GrantSourceError> for AuthorityError {
    fn from(e: GrantSourceError) -> Self {
        match e {
            GrantSourceError::Refused { .. } => AuthorityError::PermissionDenied(e.to_string()),
            GrantSourceError::Unavailable { .. } => AuthorityError::Unavailable(e.to_string()),
        }
    }
}

/// The built-in CA's part of the endpoint: node certificates, and who may have one.
pub struct CertificateIssuer {
    ca: Authority,
    validity: Duration,
    /// Checks the tokens of nodes without a certificate; `None`: renewals only.
    reviewer: Option<TokenReviewer>,
    /// `system:serviceaccount:NAMESPACE:NAME` of the node plugin: the one user whose tokens prove
    /// a node.
    node_user: String,
}

impl CertificateIssuer {
    /// Issues node certificates valid for `validity`, renewing them for their holders; with
    /// `tokens`, also to nodes without one that prove themselves with a token of
    /// `node_service_account` (`NAMESPACE:NAME`), checked by that reviewer.
    pub fn new(
        ca: Authority,
        validity: Duration,
        tokens: Option<(TokenReviewer, &str)>,
    ) -> Result<CertificateIssuer, AuthorityError> {
        let (reviewer, node_user) = match tokens {
            Some((reviewer, account)) => {
                let (namespace, name) =
                    account.split_once(':').filter(|(ns, n)| !ns.is_empty() && !n.is_empty()).ok_or_else(|| {
                        AuthorityError::Invalid(format!(
                            "the node plugin's ServiceAccount {account:?} is not NAMESPACE:NAME"
                        ))
                    })?;
                (Some(reviewer), format!("system:serviceaccount:{namespace}:{name}"))
            }
            None => (None, String::new()),
        };
        Ok(CertificateIssuer { ca, validity, reviewer, node_user })
    }
}

/// The authority endpoint's gRPC service.
pub struct AuthorityService {
    /// The controller's own credentials: they sign grants.
    credentials: LiveCredentials,
    publications: Arc<dyn Publications>,
    issuer: Option<Arc<CertificateIssuer>>,
    grant_life: Duration,
}

impl AuthorityService {
    /// Grants (for [`DEFAULT_LIFE`]) signed with `credentials` for the volumes `publications`
    /// says are published to their caller; no certificates until [`Self::with_issuer`].
    pub fn new(credentials: LiveCredentials, publications: Arc<dyn Publications>) -> Self {
        AuthorityService { credentials, publications, issuer: None, grant_life: DEFAULT_LIFE }
    }

    pub fn with_issuer(mut self, issuer: CertificateIssuer) -> Self {
        self.issuer = Some(Arc::new(issuer));
        self
    }

    pub fn with_grant_life(mut self, life: Duration) -> Self {
        self.grant_life = life;
        self
    }

    async fn grant_volume(&self, caller: &Caller, set_id: &str) -> Result<pb::GrantVolumeResponse, AuthorityError> {
        let node = match &caller.role {
            Some(Role::Node(node)) => node,
            Some(Role::Controller) => {
                return Err(AuthorityError::PermissionDenied(
                    "grants are for nodes; the controller opens any volume without one".into(),
                ));
            }
            None => {
                return Err(AuthorityError::Unauthenticated(
                    "a grant is given to a node: call with its certificate".into(),
                ));
            }
        };
        if set_id.is_empty() || set_id.len() > MAX_VOLUME_LEN {
            return Err(AuthorityError::Invalid(format!("set_id must be 1..={MAX_VOLUME_LEN} bytes")));
        }
        let grant =
            grant_published(&self.credentials, self.publications.as_ref(), set_id, node, self.grant_life).await?;
        Ok(pb::GrantVolumeResponse { grant })
    }

    async fn issue_certificate(
        &self,
        caller: &Caller,
        request: pb::IssueCertificateRequest,
    ) -> Result<pb::IssueCertificateResponse, AuthorityError> {
        let issuer = self.issuer.as_ref().ok_or_else(|| {
            AuthorityError::FailedPrecondition(
                "this controller has no built-in CA: node certificates are issued by the cluster's own PKI".into(),
            )
        })?;
        let role = Role::node(request.node.as_str()).map_err(|e| AuthorityError::Invalid(format!("node: {e}")))?;
        let renewal = caller.role.as_ref() == Some(&role);
        if !renewal {
            if request.service_account_token.is_empty() {
                return Err(match &caller.role {
                    Some(other) => AuthorityError::PermissionDenied(format!(
                        "the caller is {other}: only node {:?} itself renews its certificate",
                        request.node
                    )),
                    None => AuthorityError::Unauthenticated(
                        "no proof: call with the node's certificate, or with its ServiceAccount token".into(),
                    ),
                });
            }
            token_proves(issuer, &request.service_account_token, &request.node).await?;
        }
        let leaf = issuer
            .ca
            .sign_request(&request.csr, &role, Validity::starting_now(issuer.validity))
            .map_err(|e| AuthorityError::Invalid(e.to_string()))?;
        let ca = self.credentials.current().anchors().certificates().iter().map(|c| c.to_vec()).collect();
        tracing::info!(node = %request.node, renewal, caller = %caller.addr, "issued a node certificate");
        Ok(pb::IssueCertificateResponse { chain: vec![leaf.to_vec()], ca })
    }
}

/// Whether `token` is the node plugin's on node `node`: accepted by the API server for our
/// audience, of the node plugin's ServiceAccount, and bound to a pod on that node.
async fn token_proves(issuer: &CertificateIssuer, token: &str, node: &str) -> Result<(), AuthorityError> {
    let reviewer = issuer.reviewer.as_ref().ok_or_else(|| {
        AuthorityError::FailedPrecondition(
            "this controller checks no ServiceAccount tokens (no node plugin ServiceAccount configured): \
             renewals only"
                .into(),
        )
    })?;
    let reviewed = reviewer.review(token).await.map_err(|e| match e {
        ReviewError::Rejected(_) => AuthorityError::Unauthenticated(e.to_string()),
        ReviewError::Unavailable { .. } | ReviewError::Config(_) => AuthorityError::Unavailable(e.to_string()),
    })?;
    if reviewed.username != issuer.node_user {
        return Err(AuthorityError::PermissionDenied(format!(
            "the token is {}'s, not the node plugin's ({})",
            reviewed.username, issuer.node_user
        )));
    }
    match reviewed.node.as_deref() {
        Some(bound) if bound == node => Ok(()),
        Some(bound) => {
            Err(AuthorityError::PermissionDenied(format!("the token belongs to a pod on node {bound:?}, not {node:?}")))
        }
        None => Err(AuthorityError::PermissionDenied(
            "the token is bound to no pod's node (a projected ServiceAccount token is needed)".into(),
        )),
    }
}

fn caller_of<T>(request: &tonic::Request<T>) -> Result<Caller, tonic::Status> {
    request.extensions().get::<Caller>().cloned().ok_or_else(|| {
        tonic::Status::internal("the connection carries no caller (not served by authority_endpoint::serve)")
    })
}

/// Logs a refusal once, where it becomes a Status.
fn answer<T>(
    method: &'static str,
    caller: &Caller,
    result: Result<T, AuthorityError>,
) -> Result<tonic::Response<T>, tonic::Status> {
    match result {
        Ok(reply) => Ok(tonic::Response::new(reply)),
        Err(e) => {
            let role = caller.role.as_ref().map_or_else(|| "none".to_owned(), ToString::to_string);
            tracing::warn!(method, caller = %caller.addr, role, error = %e, "authority call refused");
            Err(e.into())
        }
    }
}

#[tonic::async_trait]
impl AuthorityRpc for AuthorityService {
    #[tracing::instrument(name = "authority.grant_volume", skip_all, fields(volume = %r.get_ref().set_id))]
    async fn grant_volume(
        &self,
        r: tonic::Request<pb::GrantVolumeRequest>,
    ) -> Result<tonic::Response<pb::GrantVolumeResponse>, tonic::Status> {
        let caller = caller_of(&r)?;
        let result = AuthorityService::grant_volume(self, &caller, &r.get_ref().set_id).await;
        answer("GrantVolume", &caller, result)
    }

    #[tracing::instrument(name = "authority.issue_certificate", skip_all, fields(node = %r.get_ref().node))]
    async fn issue_certificate(
        &self,
        r: tonic::Request<pb::IssueCertificateRequest>,
    ) -> Result<tonic::Response<pb::IssueCertificateResponse>, tonic::Status> {
        let caller = caller_of(&r)?;
        let result = AuthorityService::issue_certificate(self, &caller, r.into_inner()).await;
        answer("IssueCertificate", &caller, result)
    }
}
