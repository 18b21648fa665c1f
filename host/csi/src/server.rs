//! Serving the CSI services on a unix socket, as kubelet and the sidecars expect.
use crate::authority::AuthorityFix;
use crate::controller::ControllerService;
use crate::group_controller::GroupControllerService;
use crate::identity::IdentityService;
use crate::node::NodeService;
use crate::plugin::Plugin;
use futures::TryStreamExt as _;
use std::path::Path;
use std::sync::Arc;
use wasmcsi_proto::csi::v1::{
    controller_server::ControllerServer, group_controller_server::GroupControllerServer,
    identity_server::IdentityServer, node_server::NodeServer,
};

/// Errors binding the socket.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("binding CSI socket {path}: {source}")]
    Bind { path: String, source: std::io::Error },
    #[error("serving CSI: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Bind `socket`, replacing a stale socket file from an earlier run. Binding before serving
/// means a caller that gets the listener back can connect at once.
pub fn bind(socket: &Path) -> Result<tokio::net::UnixListener, ServeError> {
    let bind_err = |source| ServeError::Bind { path: socket.display().to_string(), source };
    if let Some(parent) = socket.parent() {
        std::fs::create_dir_all(parent).map_err(bind_err)?;
    }
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind_err(e)),
    }
    tokio::net::UnixListener::bind(socket).map_err(bind_err)
}

/// The connections `listener` accepts. tonic retries a failed accept at once, which at the
/// descriptor limit (EMFILE: the connection stays in the backlog, the socket stays readable)
/// spins a core until a descriptor is freed; here such errors are waited out with the back-off
/// every listener of the product uses, and a socket that can no longer accept ends the stream.
fn accepted(
    listener: tokio::net::UnixListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::UnixStream>> {
    let backoff = wasmcsi_trust::listener::AcceptBackoff::new("CSI socket");
    futures::stream::unfold(Some((listener, backoff)), |state| async move {
        let (listener, mut backoff) = state?;
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    backoff.after_success();
                    return Some((Ok(stream), Some((listener, backoff))));
                }
                Err(error) => match backoff.after_error(error) {
                    Ok(delay) => tokio::time::sleep(delay).await,
                    Err(fatal) => {
                        tracing::error!(error = %fatal, "the CSI socket can no longer accept connections");
                        return Some((Err(fatal), None));
                    }
                },
            }
        }
    })
}

/// Serve on a bound listener until `shutdown` resolves. Identity always; Controller and
/// Node as the driver's mode says.
pub async fn serve(
    driver: Arc<Plugin>,
    listener: tokio::net::UnixListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    // Every connection goes through the `:authority` fix, so clients built on gRPC's C core
    // (grpcio, grpcurl) are served like Go's.
    let incoming = accepted(listener).map_ok(AuthorityFix::new);
    let mode = driver.mode;
    let router = tonic::transport::Server::builder().add_service(IdentityServer::new(IdentityService(driver.clone())));
    let router = router
        .add_optional_service(mode.controller().then(|| ControllerServer::new(ControllerService(driver.clone()))))
        // Served with the controller, advertised only while a backend offers group snapshots.
        .add_optional_service(
            mode.controller().then(|| GroupControllerServer::new(GroupControllerService(driver.clone()))),
        )
        .add_optional_service(mode.node().then(|| NodeServer::new(NodeService(driver))));
    router.serve_with_incoming_shutdown(incoming, shutdown).await?;
    Ok(())
}
