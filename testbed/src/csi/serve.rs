//! Serving the generated CSI Identity and Node servers on a unix socket,
//! as HTTP/2 without TLS (what the kubelet speaks to a driver).
use std::future::Future;

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::UnixListener;
use tonic::codegen::Service as _;

use super::api::identity_server::{Identity, IdentityServer};
use super::api::node_server::{Node, NodeServer};

/// Serves `identity` and `node` on `listener` until `shutdown` completes.
pub async fn serve_identity_and_node<I: Identity, N: Node>(
    listener: UnixListener,
    identity: I,
    node: N,
    shutdown: impl Future<Output = ()>,
) {
    let (identity, node) = (IdentityServer::new(identity), NodeServer::new(node));
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    eprintln!("csi plugin: accept failed: {err}");
                    continue;
                }
            },
        };
        let (identity, node) = (identity.clone(), node.clone());
        let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
            let (mut identity, mut node) = (identity.clone(), node.clone());
            async move {
                if request.uri().path().starts_with("/csi.v1.Identity/") {
                    identity.call(request).await
                } else {
                    node.call(request).await
                }
            }
        });
        tokio::spawn(async move {
            let builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
            // A client that goes away ends its connection: nothing to report.
            let _ = builder.serve_connection(TokioIo::new(stream), service).await;
        });
    }
}
