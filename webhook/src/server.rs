//! The HTTP side: `/mutate` over HTTPS (HTTP/2 or HTTP/1.1, as the API
//! server negotiates), and `/metrics`, `/healthz`, `/readyz` on both the
//! HTTPS port and a plain-HTTP port for Prometheus and the kubelet's probes.
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt as _, Full, LengthLimitError, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;

use super::cache::VolumeCache;
use super::metrics::Metrics;
use super::review;
use super::selection::Selection;
use fuse_supervisor_engine::errors::chain;

/// How long open connections may finish after a shutdown request, or after
/// an idle one was asked to close.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// What one client may take of the server. [`Limits::default`] is what
/// `fuse-supervisor-webhook` serves with; the tests shorten the timeouts.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A client that has not finished its TLS handshake by then is dropped.
    pub handshake_timeout: Duration,
    /// Largest review body read; a longer one is answered 413.
    pub max_body: usize,
    /// How long an HTTP/1 client may take to send a whole request head,
    /// counted from the connection's start or the previous answer.
    pub header_timeout: Duration,
    /// A connection with no request being answered for this long is closed
    /// (HTTP/2: GOAWAY, then the open streams finish).
    pub idle_timeout: Duration,
    /// How long a request's body may take to arrive, from its head: a body
    /// sent a byte at a time is answered 408.
    pub request_deadline: Duration,
    /// HTTP/2 streams one connection may have open at once; more are
    /// refused (RST_STREAM REFUSED_STREAM).
    pub max_streams: u32,
    /// Largest request head: HTTP/2's header list and HTTP/1's read buffer.
    pub max_head: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // The API server's handshake is a round trip or two.
            handshake_timeout: Duration::from_secs(10),
            // A Pod CREATE review carries the pod once (an ephemeral
            // container's update twice); a pod is a few KiB, its
            // annotations at most 256 KiB. A larger body is refused before
            // it is read, and with failurePolicy Ignore its pod is admitted
            // unchanged.
            max_body: 1024 * 1024,
            // The API server sends its head at once, on a connection it
            // opened for it; hyper restarts the timer after each answer, so
            // this is also how long an idle HTTP/1 connection stays.
            header_timeout: Duration::from_secs(10),
            // The API server keeps its HTTP/2 connection for reuse; a minute
            // without a review costs it one TLS handshake, while a client
            // that opens connections and sends nothing keeps each for a
            // minute at most. HTTP/2 keep-alive pings are off: an idle
            // connection is closed anyway, one with a request in flight is
            // bounded by the request deadline, and pings would wake the
            // process on every idle connection.
            idle_timeout: Duration::from_secs(60),
            // Twice the webhook's timeoutSeconds (5 s in deploy/webhook/):
            // the API server has given up on the review by then.
            request_deadline: Duration::from_secs(10),
            // Reviews take tens of microseconds; the API server opens
            // another connection when one is full. Bounds what one
            // connection holds to max_streams bodies.
            max_streams: 32,
            // A review's headers are a few hundred bytes. hyper's HTTP/1
            // buffer cannot be below 8 KiB.
            max_head: 16 * 1024,
        }
    }
}

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
    /// Binds both addresses (port 0 picks a free port) and starts serving,
    /// within the default [`Limits`]. Must be called within a tokio runtime.
    pub async fn start(
        https: SocketAddr,
        metrics: SocketAddr,
        tls: Arc<rustls::ServerConfig>,
        state: Arc<State>,
    ) -> Result<Server, ServerError> {
        Self::start_with(https, metrics, tls, state, Limits::default()).await
    }

    /// As [`Server::start`], within `limits`.
    pub async fn start_with(
        https: SocketAddr,
        metrics: SocketAddr,
        tls: Arc<rustls::ServerConfig>,
        state: Arc<State>,
        limits: Limits,
    ) -> Result<Server, ServerError> {
        let bind =
            |addr| async move { TcpListener::bind(addr).await.map_err(|source| ServerError::Bind { addr, source }) };
        let (https_listener, metrics_listener) = (bind(https).await?, bind(metrics).await?);
        let local =
            |listener: &TcpListener, addr| listener.local_addr().map_err(|source| ServerError::Bind { addr, source });
        let (https_addr, metrics_addr) = (local(&https_listener, https)?, local(&metrics_listener, metrics)?);
        let (stop, stopped) = watch::channel(false);
        let tasks = vec![
            tokio::spawn(accept(https_listener, Some(TlsAcceptor::from(tls)), state.clone(), limits, stopped.clone())),
            tokio::spawn(accept(metrics_listener, None, state.clone(), limits, stopped)),
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
                tracing::error!(err = %chain(&err), "listener task failed");
            }
        }
    }
}

async fn accept(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    state: Arc<State>,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_head as usize);
    builder.http2().max_concurrent_streams(limits.max_streams).max_header_list_size(limits.max_head);
    let mut connections = JoinSet::new();
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // EMFILE and the like: pause instead of spinning.
                    tracing::warn!(err = %chain(&err), "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            // Finished connections' results, so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            _ = stopped(&mut stop) => break,
        };
        let (builder, state, tls, stop) = (builder.clone(), state.clone(), tls.clone(), stop.clone());
        connections.spawn(async move {
            let served = match tls {
                Some(tls) => match tokio::time::timeout(limits.handshake_timeout, tls.accept(stream)).await {
                    Ok(Ok(stream)) => serve(&builder, stream, state, limits, true, stop).await,
                    Ok(Err(err)) => return tracing::debug!(%peer, err = %chain(&err), "TLS handshake failed"),
                    Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
                },
                None => serve(&builder, stream, state, limits, false, stop).await,
            };
            if let Err(err) = served {
                tracing::debug!(%peer, err = %chain(&*err), "connection ended with an error");
            }
        });
    }
    drop(listener);
    // Each connection saw the stop too and closes within DRAIN_TIMEOUT;
    // what is left then (a TLS handshake under way) is dropped.
    let drained = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(DRAIN_TIMEOUT, drained).await.is_err() {
        tracing::warn!("connections still open at shutdown; closing them");
        connections.shutdown().await;
    }
}

/// Whether the server is stopping (or its owner is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    // The guard wait_for returns is not Send: dropped in here.
    let _ = stop.wait_for(|stop| *stop).await.is_ok();
}

/// Serves one connection until it ends; asks it to close when the server
/// stops or when it was idle for `limits.idle_timeout`, and drops it if it
/// has not closed [`DRAIN_TIMEOUT`] later (a client that never reads its
/// answers would hold it open).
async fn serve<I>(
    builder: &auto::Builder<TokioExecutor>,
    io: I,
    state: Arc<State>,
    limits: Limits,
    secure: bool,
    mut stop: watch::Receiver<bool>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::new());
    let tracked = activity.clone();
    let service = service_fn(move |request| {
        let (state, busy) = (state.clone(), tracked.begin());
        async move {
            let response = handle(request, &state, secure, &limits).await;
            drop(busy);
            response
        }
    });
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    let closing = tokio::select! {
        served = connection.as_mut() => return served,
        _ = activity.idle_for(limits.idle_timeout) => "idle",
        _ = stopped(&mut stop) => "stopping",
    };
    tracing::debug!(why = closing, "closing a connection");
    connection.as_mut().graceful_shutdown();
    match tokio::time::timeout(DRAIN_TIMEOUT, connection).await {
        Ok(served) => served,
        Err(_) => Err(format!("connection did not close within {DRAIN_TIMEOUT:?} of being asked ({closing})").into()),
    }
}

/// Requests being answered on one connection, and since when that count
/// last changed: the connection is idle when it is zero for long enough.
struct Activity(Mutex<(usize, Instant)>);

/// One request being answered; ends when dropped.
struct Busy(Arc<Activity>);

impl Activity {
    fn new() -> Self {
        Activity(Mutex::new((0, Instant::now())))
    }

    fn begin(self: &Arc<Self>) -> Busy {
        self.change(|count| *count += 1);
        Busy(self.clone())
    }

    fn change(&self, change: impl FnOnce(&mut usize)) {
        let mut guard = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        change(&mut guard.0);
        guard.1 = Instant::now();
    }

    /// Returns once no request was answered for `timeout`. Sleeps in steps
    /// of `timeout` while requests are answered (each ends within the
    /// request deadline), and not at all on a server without connections.
    async fn idle_for(&self, timeout: Duration) {
        loop {
            let (answering, since) = *self.0.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            let wake = if answering > 0 { now + timeout } else { since + timeout };
            if wake <= now {
                return;
            }
            tokio::time::sleep_until(wake.into()).await;
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.change(|count| *count -= 1);
    }
}

async fn handle(
    request: Request<Incoming>,
    state: &State,
    secure: bool,
    limits: &Limits,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let response = match (request.method(), request.uri().path()) {
        // Reviews carry pod specs: never over plain HTTP.
        (&Method::POST, "/mutate") if secure => mutate(request, state, limits).await,
        (&Method::GET, "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n"),
        (&Method::GET, "/readyz") => readiness(state),
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

async fn mutate(request: Request<Incoming>, state: &State, limits: &Limits) -> Response<Full<Bytes>> {
    let refuse = |status: StatusCode, message: String| {
        tracing::warn!(%status, err = %message, "admission review body refused");
        state.metrics.admitted(None, 0, &[], Duration::ZERO);
        reply(status, "application/json", refusal(status, &message))
    };
    let max = limits.max_body;
    // A declared length over the limit is refused before a byte is read.
    let declared = request.headers().get(CONTENT_LENGTH).and_then(|length| length.to_str().ok()?.parse::<u64>().ok());
    if let Some(length) = declared.filter(|&length| length > max as u64) {
        return refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is {length} bytes; at most {max} are read"),
        );
    }
    let body = match tokio::time::timeout(limits.request_deadline, Limited::new(request.into_body(), max).collect())
        .await
    {
        Ok(Ok(body)) => body.to_bytes(),
        Ok(Err(err)) if err.is::<LengthLimitError>() => {
            return refuse(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body is longer than {max} bytes"));
        }
        Ok(Err(err)) => return refuse(StatusCode::BAD_REQUEST, format!("cannot read the request body: {err}")),
        Err(_) => {
            let deadline = limits.request_deadline;
            return refuse(StatusCode::REQUEST_TIMEOUT, format!("the request body did not arrive within {deadline:?}"));
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
            let message = fuse_supervisor_engine::errors::error_chain(&err);
            tracing::warn!(err = %message, "malformed admission review");
            reply(StatusCode::BAD_REQUEST, "application/json", review::status_body(&message))
        }
    }
}

/// The review's Status for a body that was not read, carrying the HTTP
/// status's code and reason instead of a malformed review's 400.
fn refusal(status: StatusCode, message: &str) -> Vec<u8> {
    let body = review::status_body(message);
    let Ok(mut status_object) = serde_json::from_slice::<serde_json::Value>(&body) else { return body };
    let reason = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "RequestEntityTooLarge",
        StatusCode::REQUEST_TIMEOUT => "Timeout",
        _ => "BadRequest",
    };
    status_object["code"] = status.as_u16().into();
    status_object["reason"] = reason.into();
    status_object.to_string().into_bytes()
}

fn reply(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}
