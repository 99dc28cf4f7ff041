//! The HTTP side: `/mutate` over HTTPS (HTTP/2 or HTTP/1.1, as the API
//! server negotiates), and `/metrics`, `/healthz`, `/readyz` on both the
//! HTTPS port and a plain-HTTP port for Prometheus and the kubelet's probes.
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

use super::cache::VolumeCache;
use super::metrics::Metrics;
use super::policy::Selection;
use super::review;

/// Largest review read. The API server caps a request body at 3 MiB, and
/// an update review carries the object twice.
const MAX_BODY: usize = 8 * 1024 * 1024;
/// A client that has not finished its TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// An HTTP/1 client that has not sent its headers by then is dropped.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long open connections may finish after a shutdown request.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// What every request handler shares.
#[derive(Debug)]
pub struct State {
    pub selection: Selection,
    pub cache: Arc<VolumeCache>,
    pub metrics: Arc<Metrics>,
    /// Set at shutdown: `/readyz` fails so the Service stops sending reviews.
    stopping: AtomicBool,
}

impl State {
    pub fn new(selection: Selection, cache: Arc<VolumeCache>, metrics: Arc<Metrics>) -> Self {
        State { selection, cache, metrics, stopping: AtomicBool::new(false) }
    }
}

/// A running server: its two listeners' tasks.
#[derive(Debug)]
pub struct Server {
    https_addr: SocketAddr,
    metrics_addr: SocketAddr,
    stop: watch::Sender<bool>,
    state: Arc<State>,
    tasks: Vec<JoinHandle<()>>,
}

impl Server {
    /// Binds both addresses (port 0 picks a free port) and starts serving.
    /// Must be called within a tokio runtime.
    pub async fn start(
        https: SocketAddr,
        metrics: SocketAddr,
        tls: Arc<rustls::ServerConfig>,
        state: Arc<State>,
    ) -> Result<Server, ServerError> {
        let bind =
            |addr| async move { TcpListener::bind(addr).await.map_err(|source| ServerError::Bind { addr, source }) };
        let (https_listener, metrics_listener) = (bind(https).await?, bind(metrics).await?);
        let local =
            |listener: &TcpListener, addr| listener.local_addr().map_err(|source| ServerError::Bind { addr, source });
        let (https_addr, metrics_addr) = (local(&https_listener, https)?, local(&metrics_listener, metrics)?);
        let (stop, stopped) = watch::channel(false);
        let tasks = vec![
            tokio::spawn(accept(https_listener, Some(TlsAcceptor::from(tls)), state.clone(), stopped.clone())),
            tokio::spawn(accept(metrics_listener, None, state.clone(), stopped)),
        ];
        tracing::info!(%https_addr, %metrics_addr, "webhook serving");
        Ok(Server { https_addr, metrics_addr, stop, state, tasks })
    }

    pub fn https_addr(&self) -> SocketAddr {
        self.https_addr
    }

    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    /// `/readyz` fails from now on, so the Service stops routing reviews
    /// here while the server still answers the ones already on the way.
    pub fn unready(&self) {
        self.state.stopping.store(true, Ordering::Relaxed);
    }

    /// Stops accepting, lets open connections finish (a bounded time) and
    /// returns once both listeners are closed.
    pub async fn shutdown(self) {
        self.unready();
        // The receivers live as long as the accept loops; a send error
        // means they ended already.
        let _ = self.stop.send(true);
        for task in self.tasks {
            if let Err(err) = task.await {
                tracing::error!(?err, "listener task failed");
            }
        }
    }
}

async fn accept(listener: TcpListener, tls: Option<TlsAcceptor>, state: Arc<State>, mut stop: watch::Receiver<bool>) {
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT);
    let secure = tls.is_some();
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // EMFILE and the like: pause instead of spinning.
                    tracing::warn!(?err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            // The guard wait_for returns is not Send: drop it in here.
            _ = async { stop.wait_for(|stop| *stop).await.is_ok() } => break,
        };
        let (builder, state, tls, watcher) = (builder.clone(), state.clone(), tls.clone(), graceful.watcher());
        tokio::spawn(async move {
            let service = service_fn(move |request| handle(request, state.clone(), secure));
            let served = match tls {
                Some(tls) => match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
                    Ok(Ok(stream)) => {
                        watcher.watch(builder.serve_connection(TokioIo::new(stream), service).into_owned()).await
                    }
                    Ok(Err(err)) => return tracing::debug!(%peer, ?err, "TLS handshake failed"),
                    Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
                },
                None => watcher.watch(builder.serve_connection(TokioIo::new(stream), service).into_owned()).await,
            };
            if let Err(err) = served {
                tracing::debug!(%peer, ?err, "connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown()).await.is_err() {
        tracing::warn!("connections still open at shutdown; closing them");
    }
}

async fn handle(
    request: Request<Incoming>,
    state: Arc<State>,
    secure: bool,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let response = match (request.method(), request.uri().path()) {
        // Reviews carry pod specs: never over plain HTTP.
        (&Method::POST, "/mutate") if secure => mutate(request, &state).await,
        (&Method::GET, "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n"),
        (&Method::GET, "/readyz") => readiness(&state),
        (&Method::GET, "/metrics") => {
            state.metrics.set_cache_ready(state.cache.is_ready());
            reply(StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", state.metrics.encode())
        }
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    };
    Ok(response)
}

fn readiness(state: &State) -> Response<Full<Bytes>> {
    if state.stopping.load(Ordering::Relaxed) {
        reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "shutting down\n")
    } else if !state.cache.is_ready() {
        // Reviews would still be answered (admitted unchanged), but a
        // replica whose cache is ready serves them better.
        reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "volume cache not synced yet\n")
    } else {
        reply(StatusCode::OK, "text/plain", "ok\n")
    }
}

async fn mutate(request: Request<Incoming>, state: &State) -> Response<Full<Bytes>> {
    let body = match Limited::new(request.into_body(), MAX_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(err) => {
            tracing::warn!(?err, "cannot read an admission review body");
            state.metrics.admitted(None, 0, &[], Duration::ZERO);
            let message = format!("cannot read the request body (at most {MAX_BODY} bytes): {err}");
            return reply(StatusCode::BAD_REQUEST, "application/json", review::status_body(&message));
        }
    };
    let started = Instant::now();
    match review::review(&body, &state.selection, &state.cache) {
        Ok(reviewed) => {
            let took = started.elapsed();
            let plan = &reviewed.plan;
            state.metrics.admitted(Some(reviewed.outcome), plan.changes.len(), &plan.unresolved, took);
            tracing::debug!(
                uid = %reviewed.uid,
                namespace = %reviewed.namespace,
                pod = %reviewed.pod,
                outcome = reviewed.outcome.as_str(),
                mounts = plan.changes.len(),
                unresolved = ?plan.unresolved,
                ?took,
                "admission reviewed"
            );
            reply(StatusCode::OK, "application/json", reviewed.response)
        }
        Err(err) => {
            state.metrics.admitted(None, 0, &[], started.elapsed());
            let message = crate::report::error_chain(&err);
            tracing::warn!(error = %message, "malformed admission review");
            reply(StatusCode::BAD_REQUEST, "application/json", review::status_body(&message))
        }
    }
}

fn reply(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}
