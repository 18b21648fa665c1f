//! The Prometheus `/metrics` endpoint: a plain HTTP/1 server that answers GET /metrics
//! with the text exposition and 404 otherwise.
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::sync::Arc;
use wasmcsi_runtime::metrics::Metrics;

/// Bind `addr` and serve in the background; returns the bound address (port 0 picks one).
pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let metrics = metrics.clone();
                    async move {
                        if req.uri().path() == "/metrics" {
                            Response::builder()
                                .header("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")
                                .body(Full::new(Bytes::from(metrics.encode())))
                        } else {
                            Response::builder()
                                .status(StatusCode::NOT_FOUND)
                                .body(Full::new(Bytes::from_static(b"not found\n")))
                        }
                    }
                });
                let _ =
                    hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    Ok(bound)
}
