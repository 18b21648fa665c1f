//! A node plugin's peer endpoint: Identity (who this node is) and Controller (the node-local
//! calls a controller forwards) on a TCP listener, every non-Identity call checked against
//! the controller's key for this node before it reaches the service (`auth`).
use super::auth::Verifier;
use crate::controller::ControllerService;
use crate::identity::IdentityService;
use crate::plugin::Plugin;
use crate::server::ServeError;
use futures::future::Either;
use std::sync::Arc;
use std::task::{Context, Poll};
use wasmcsi_proto::csi::v1::{controller_server::ControllerServer, identity_server::IdentityServer};

/// Serve the peer endpoint on `listener` until `shutdown` resolves.
pub async fn serve(
    driver: Arc<Plugin>,
    listener: tokio::net::TcpListener,
    verifier: Verifier,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tonic::transport::Server::builder()
        .layer(VerifyLayer(Arc::new(verifier)))
        .add_service(IdentityServer::new(IdentityService(driver.clone())))
        .add_service(ControllerServer::new(ControllerService(driver)))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

#[derive(Clone)]
struct VerifyLayer(Arc<Verifier>);

impl<S> tower::Layer<S> for VerifyLayer {
    type Service = Verify<S>;
    fn layer(&self, inner: S) -> Verify<S> {
        Verify { inner, verifier: self.0.clone() }
    }
}

/// Answers UNAUTHENTICATED, before any service sees it, a call the verifier refuses.
#[derive(Clone)]
struct Verify<S> {
    inner: S,
    verifier: Arc<Verifier>,
}

impl<S, B> tower::Service<http::Request<B>> for Verify<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<std::future::Ready<Result<S::Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        match self.verifier.check(req.uri().path(), req.headers()) {
            Ok(()) => Either::Right(self.inner.call(req)),
            Err(why) => {
                tracing::warn!(method = req.uri().path(), why, "peer call refused");
                Either::Left(std::future::ready(Ok(tonic::Status::unauthenticated(why).into_http())))
            }
        }
    }
}
