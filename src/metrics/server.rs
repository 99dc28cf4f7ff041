//! A small HTTP/1.1 server for `/metrics`, `/healthz` and `/readyz`: hyper
//! over a tokio runtime of its own, current-thread, on one thread
//! (`metrics`). hyper parses and writes; this module decides how long and
//! how many connections may hold the server. One request per connection
//! (`Connection: close`); scrapers and probes open one per request anyway.
//!
//! Anything that reaches the pod's IP can connect, so the kubelet's probes
//! must get through whatever other clients do (a liveness probe starved
//! three times in a row restarts the agent):
//! - a request head must be complete within [`HEAD_DEADLINE`] of the
//!   accept, however its bytes trickle in. One deadline per connection,
//!   moved to [`ANSWER_DEADLINE`] once the head is in, bounds both phases,
//!   so hyper's own header timeout (and its timer) is off;
//! - at most [`HEADS_PER_PEER`] heads from one address are read at once, at
//!   most [`HEADS_PENDING`] in all, and a new connection is never refused
//!   for lack of room: it replaces the oldest head of its own address when
//!   that address is at its cap, else the oldest of all when the table is
//!   full. Refusing would hand the table to whoever fills it first (and
//!   the probes come from the node's address, which every host-network pod
//!   shares); replacing the oldest leaves an attacker only its own slots.
//!   A probe sends its head in one segment, mostly read whole at its
//!   connection's first poll (it then takes no room at all). A connection
//!   that has sent nothing yet takes no room either for up to
//!   [`ADMISSION_GRACE`] (at most [`SILENT_WAITING`] such at once): a probe
//!   whose client was preempted between its connect and its write would
//!   otherwise be the oldest head of its address after as many newer
//!   connections of that address, and slow clients that come back
//!   whenever closed make that many within a millisecond (one of 30
//!   probes lost among 64 of them from the probes' address);
//! - probes are answered in rounds, one ping of the supervisor loop (at
//!   most [`LIVENESS_WAIT`]) answering every `/healthz` that waits, so a
//!   flood of them costs the loop one ping per round, and a probe waits
//!   for the round under way and its own at most. The ping blocks, so the
//!   rounds run on a thread of their own, started when a probe comes and
//!   gone when none waits, and the runtime goes on reading heads meanwhile.
//!   Beyond [`PROBES_WAITING`] waiting, a probe is answered 503;
//! - `/metrics` (and errors) are answered on at most [`OTHER_ANSWERS`]
//!   connections at once, so scrapers that never read their answer hold
//!   none of the probes' way (503 beyond); every connection is closed
//!   [`ANSWER_DEADLINE`] after its head, written or not. hyper's own
//!   answers to malformed heads (400, 431) are written within the head's
//!   place and deadline.
//!
//! No timer while idle: the only timers are open connections' deadlines,
//! so with none open the runtime sleeps in epoll without a timeout.
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::thread::JoinHandle;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::time::Instant;
use tracing::{debug, error, warn};

use super::{CONTENT_TYPE, Metrics};
use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::health::Health;

/// How long `/healthz` waits for the loop to answer its ping. The
/// manifest's probe allows 5 s; a loop busy for longer than this in one
/// heal fails one probe, and three in a row restart it.
pub const LIVENESS_WAIT: Duration = Duration::from_secs(1);
/// How long a whole request head may take to arrive, from the accept. The
/// kubelet and Prometheus send theirs in one segment right after the
/// connect, so this only has to cover a retransmission or two; it is the
/// readiness probe's timeout (the liveness probe allows 5 s).
pub const HEAD_DEADLINE: Duration = Duration::from_secs(3);
/// How long a connection stays once its head is in: a probe's round (two
/// [`LIVENESS_WAIT`]s at most) and the writing of any answer, so a client
/// reading a byte at a time does not hold it longer.
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(5);
/// Request heads being read at once, from every address.
pub const HEADS_PENDING: usize = 64;
/// Request heads being read at once from one address.
pub const HEADS_PER_PEER: usize = 8;
/// `/healthz` and `/readyz` requests waiting for the probe answerer, which
/// answers all that wait in one round of at most [`LIVENESS_WAIT`]: the
/// kubelet sends one of each per period, so only a flood fills it.
pub const PROBES_WAITING: usize = 256;
/// Other answers (`/metrics`, errors) at once: a scraper or two.
pub const OTHER_ANSWERS: usize = 4;
/// How long a connection that has sent nothing yet waits for its first
/// bytes before it takes a place among the heads being read.
pub const ADMISSION_GRACE: Duration = Duration::from_millis(250);
/// Connections waiting so at once; beyond, a silent one takes its place at
/// once, as any other.
pub const SILENT_WAITING: usize = 4 * HEADS_PENDING;
/// Longest request head read (hyper's smallest read buffer); a probe's or
/// scraper's is a few hundred bytes. Longer: 431.
const MAX_HEAD: usize = 8 * 1024;
/// Header fields in one head; more: 431.
const MAX_HEADERS: usize = 32;
/// The pause after an accept error that is not about one connection (out
/// of descriptors, say): the listener stays readable, and accepting again
/// at once would spin on it.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen for metrics on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("cannot set up the metrics server on {addr}: {step}")]
    Setup {
        addr: SocketAddr,
        step: &'static str,
        #[source]
        source: io::Error,
    },
}

/// The running server; stops and joins its thread when stopped or dropped.
pub struct MetricsServer {
    addr: SocketAddr,
    /// Dropping or sending ends the accept loop, and with it the runtime.
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` (port 0: any free port; see [`MetricsServer::local_addr`])
    /// and serves until stopped.
    pub fn start(addr: SocketAddr, metrics: Arc<Metrics>, health: Arc<Health>) -> Result<Self, ServeError> {
        // Bound here, not on the thread, so that a taken port fails the start.
        let listener = std::net::TcpListener::bind(addr).map_err(|source| ServeError::Bind { addr, source })?;
        let setup = |step| move |source| ServeError::Setup { addr, step, source };
        let local = listener.local_addr().map_err(setup("local address"))?;
        listener.set_nonblocking(true).map_err(setup("non-blocking listener"))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(setup("runtime"))?;
        let listener = {
            let _runtime = runtime.enter();
            TcpListener::from_std(listener).map_err(setup("watch the listener"))?
        };
        let server = Arc::new(Server::new(metrics, health));
        let (stop, stopped) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("metrics".into())
            // The connections' tasks are dropped with the runtime, at the end.
            .spawn(move || runtime.block_on(server.accept(listener, stopped)))
            .map_err(setup("thread"))?;
        Ok(MetricsServer { addr: local, stop: Some(stop), thread: Some(thread) })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and joins the thread. Connections still open are
    /// closed, answered or not: the agent is on its way out.
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        // The accept loop may have ended already; then nobody listens.
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(Err(_)) = self.thread.take().map(JoinHandle::join) {
            error!("the metrics server's thread panicked");
        }
    }
}

/// What the accept loop, the connections' tasks and the probe answerer share.
struct Server {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    http: http1::Builder,
    heads: Mutex<Heads>,
    probes: Mutex<Probes>,
    /// One permit per answer other than a probe's, held until its
    /// connection closes.
    others: Arc<Semaphore>,
    /// One permit per connection waiting for its first bytes.
    silent: Arc<Semaphore>,
}

/// The connections whose head is still arriving, keyed by accept order,
/// so the first entry is the oldest.
#[derive(Default)]
struct Heads(BTreeMap<u64, Head>);

struct Head {
    peer: IpAddr,
    /// Dropped to close the connection: its task sees the channel close.
    _evict: oneshot::Sender<()>,
}

/// A connection's place in [`Heads`]; leaves it when dropped.
struct HeadSlot<'a> {
    heads: &'a Mutex<Heads>,
    id: u64,
    evicted: oneshot::Receiver<()>,
}

/// What the service tells its connection's task.
#[derive(Default)]
struct Exchange {
    /// The head is in: hyper called the service.
    asked: AtomicBool,
    /// The [`OTHER_ANSWERS`] permit of this connection's answer, kept until
    /// the connection closes: writing it is what a slow reader holds.
    permit: Mutex<Option<OwnedSemaphorePermit>>,
}

/// Why a connection's task ended, when it was not hyper's doing.
enum Closed {
    Served,
    Late { answering: bool },
    Evicted,
}

impl Server {
    fn new(metrics: Arc<Metrics>, health: Arc<Health>) -> Self {
        let mut http = http1::Builder::new();
        http.keep_alive(false)
            // The deadline of the connection's task bounds the head instead.
            .header_read_timeout(None)
            .max_buf_size(MAX_HEAD)
            .max_headers(MAX_HEADERS)
            // `Content-Type`, as the answers always read: scripts grep them.
            .title_case_headers(true);
        Server {
            metrics,
            health,
            http,
            heads: Mutex::default(),
            probes: Mutex::default(),
            others: Arc::new(Semaphore::new(OTHER_ANSWERS)),
            silent: Arc::new(Semaphore::new(SILENT_WAITING)),
        }
    }

    async fn accept(self: Arc<Self>, listener: TcpListener, mut stopped: oneshot::Receiver<()>) {
        let mut next_id = 0u64;
        loop {
            let accepted = tokio::select! {
                biased;
                _ = &mut stopped => return,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, peer)) => {
                    tokio::spawn(Arc::clone(&self).connection(stream, peer, next_id, Instant::now()));
                    next_id += 1;
                }
                Err(err) if matches!(err.kind(), io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted) => {}
                Err(err) => {
                    warn!(err = %chain(&err), "metrics server cannot accept a connection");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
    }

    /// Serves one connection within its deadlines; takes a place among the
    /// heads being read if its head was not whole at the first poll.
    async fn connection(self: Arc<Self>, stream: TcpStream, peer: SocketAddr, id: u64, accepted: Instant) {
        if let Ok(_waiting) = Arc::clone(&self.silent).try_acquire_owned() {
            // Bytes, an end or an error, or the grace over: then as any
            // other. (A peek, as `readable` says ready at once for a new
            // socket, and a read would take the bytes from hyper.)
            let _ = tokio::time::timeout(ADMISSION_GRACE, stream.peek(&mut [0u8; 1])).await;
        }
        let exchange = Arc::new(Exchange::default());
        let service = {
            let (server, exchange) = (Arc::clone(&self), Arc::clone(&exchange));
            service_fn(move |request: Request<Incoming>| {
                exchange.asked.store(true, Ordering::Relaxed);
                let (server, exchange) = (Arc::clone(&server), Arc::clone(&exchange));
                async move {
                    let reply = server.answer(request.method(), request.uri().path(), peer, &exchange).await;
                    Ok::<_, Infallible>(reply.into_response())
                }
            })
        };
        let mut connection = pin!(self.http.serve_connection(TokioIo::new(stream), service));
        let mut deadline = pin!(tokio::time::sleep_until(accepted + HEAD_DEADLINE));
        let (mut slot, mut first_poll, mut answering) = (None, true, false);
        let closed = poll_fn(|cx| {
            if let Poll::Ready(served) = connection.as_mut().poll(cx) {
                if let Err(err) = served {
                    debug!(%peer, err = %chain(&err), "metrics connection ended with an error");
                }
                return Poll::Ready(Closed::Served);
            }
            if exchange.asked.load(Ordering::Relaxed) {
                if !answering {
                    answering = true;
                    slot = None;
                    deadline.as_mut().reset(Instant::now() + ANSWER_DEADLINE);
                }
            } else if first_poll {
                slot = Some(self.admit(id, peer.ip()));
            }
            first_poll = false;
            if let Some(slot) = &mut slot
                && Pin::new(&mut slot.evicted).poll(cx).is_ready()
            {
                return Poll::Ready(Closed::Evicted);
            }
            match deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Closed::Late { answering }),
                Poll::Pending => Poll::Pending,
            }
        })
        .await;
        match closed {
            Closed::Served | Closed::Evicted => {}
            Closed::Late { answering: false } => debug!(%peer, "request head not complete in time; closed"),
            Closed::Late { answering: true } => debug!(%peer, "metrics answer not written in time; closed"),
        }
    }

    /// A place among the heads being read, made by closing the oldest head
    /// of `peer` if it is at its share, else the oldest of all if the table
    /// is full.
    fn admit(&self, id: u64, peer: IpAddr) -> HeadSlot<'_> {
        let peer = peer.to_canonical();
        let mut heads = self.heads.lock().unwrap_or_else(PoisonError::into_inner);
        let mut from_peer = heads.0.iter().filter(|(_, head)| head.peer == peer);
        let oldest_of_peer = from_peer.next().map(|(id, _)| *id);
        let evicted = if from_peer.count() + 1 >= HEADS_PER_PEER {
            oldest_of_peer
        } else if heads.0.len() >= HEADS_PENDING {
            heads.0.keys().next().copied()
        } else {
            None
        };
        if let Some(oldest) = evicted.and_then(|id| heads.0.remove(&id)) {
            debug!(peer = %oldest.peer, "request head closed to make room for a newer one");
        }
        let (evict, evicted) = oneshot::channel();
        heads.0.insert(id, Head { peer, _evict: evict });
        HeadSlot { heads: &self.heads, id, evicted }
    }

    /// The answer to a complete request: probes through the probe answerer,
    /// anything else while [`OTHER_ANSWERS`] allows (503 at once beyond).
    async fn answer(self: Arc<Self>, method: &Method, path: &str, peer: SocketAddr, exchange: &Exchange) -> Reply {
        let probe = match path {
            "/healthz" => Some(Probe::Live),
            "/readyz" => Some(Probe::Ready),
            _ => None,
        };
        let allowed = matches!(method, &Method::GET | &Method::HEAD);
        if let (Some(probe), true) = (probe, allowed) {
            return self.probe(probe, peer).await;
        }
        let Ok(permit) = Arc::clone(&self.others).try_acquire_owned() else {
            debug!(%peer, %path, "metrics server busy; answered 503");
            return Reply::text(StatusCode::SERVICE_UNAVAILABLE, "busy: too many requests being answered\n");
        };
        *exchange.permit.lock().unwrap_or_else(PoisonError::into_inner) = Some(permit);
        if probe.is_none() && path != "/metrics" {
            return Reply::text(StatusCode::NOT_FOUND, "not found: try /metrics, /healthz or /readyz\n");
        }
        if !allowed {
            return Reply::text(StatusCode::METHOD_NOT_ALLOWED, format!("{method} not allowed on {path}\n"));
        }
        match self.metrics.encode() {
            Ok(body) => Reply { status: StatusCode::OK, content_type: CONTENT_TYPE, body },
            Err(err) => {
                error!(err = %chain(&err), "cannot serve /metrics");
                Reply::text(StatusCode::INTERNAL_SERVER_ERROR, format!("{err}\n"))
            }
        }
    }

    /// Queues a probe for the answerer, starting it if it is not running,
    /// and waits for its answer.
    async fn probe(self: Arc<Self>, probe: Probe, peer: SocketAddr) -> Reply {
        let (reply, answer) = oneshot::channel();
        {
            let mut probes = self.probes.lock().unwrap_or_else(PoisonError::into_inner);
            if probes.waiting.len() >= PROBES_WAITING {
                debug!(%peer, "too many probes waiting; answered 503");
                return Reply::text(StatusCode::SERVICE_UNAVAILABLE, "busy: too many probes waiting\n");
            }
            probes.waiting.push((probe, reply));
            if !probes.answering {
                probes.answering = true;
                let server = Arc::clone(&self);
                let spawned =
                    std::thread::Builder::new().name("metrics-probes".into()).spawn(move || server.answer_probes());
                if let Err(err) = spawned {
                    probes.answering = false;
                    let dropped = std::mem::take(&mut probes.waiting).len();
                    warn!(err = %chain(&err), dropped, "cannot start the thread that answers probes");
                }
            }
        }
        answer
            .await
            .unwrap_or_else(|_| Reply::text(StatusCode::SERVICE_UNAVAILABLE, "the probe answerer could not answer\n"))
    }

    /// Answers the waiting probes in rounds until none is left: one ping of
    /// the loop per round answers every `/healthz` of it, however many. Each
    /// answer is a ping sent after its request came.
    fn answer_probes(&self) {
        loop {
            let round = {
                let mut probes = self.probes.lock().unwrap_or_else(PoisonError::into_inner);
                if probes.waiting.is_empty() {
                    probes.answering = false;
                    return;
                }
                std::mem::take(&mut probes.waiting)
            };
            let mut alive = None;
            for (probe, reply) in round {
                let answer = match probe {
                    Probe::Live => self.liveness(*alive.get_or_insert_with(|| self.ping())),
                    Probe::Ready => self.readiness(),
                };
                // Its connection may be closed already.
                let _ = reply.send(answer);
            }
        }
    }

    fn ping(&self) -> bool {
        let answered = self.health.is_alive(LIVENESS_WAIT);
        if !answered {
            let wait_ms = LIVENESS_WAIT.as_millis() as u64;
            warn!(wait_ms, "liveness check: the supervisor loop did not answer");
        }
        answered
    }

    fn liveness(&self, alive: bool) -> Reply {
        if alive {
            return Reply::text(StatusCode::OK, "ok\n");
        }
        let why = format!("the supervisor loop did not answer within {LIVENESS_WAIT:?}\n");
        Reply::text(StatusCode::SERVICE_UNAVAILABLE, why)
    }

    fn readiness(&self) -> Reply {
        if !self.health.is_ready() {
            return Reply::text(StatusCode::SERVICE_UNAVAILABLE, "the first scan of the mount table is not done\n");
        }
        match self.health.state_problem() {
            None => Reply::text(StatusCode::OK, "ok\n"),
            Some(problem) => Reply::text(
                StatusCode::OK,
                format!(
                    "ok\n{problem}; healing goes on, but a restarted supervisor will not know what this one learned\n"
                ),
            ),
        }
    }
}

impl Drop for HeadSlot<'_> {
    fn drop(&mut self) {
        self.heads.lock().unwrap_or_else(PoisonError::into_inner).0.remove(&self.id);
    }
}

#[derive(Clone, Copy)]
enum Probe {
    Live,
    Ready,
}

/// The probes waiting for the answerer, and whether its thread runs.
#[derive(Default)]
struct Probes {
    waiting: Vec<(Probe, oneshot::Sender<Reply>)>,
    answering: bool,
}

/// An answer, before hyper frames it (HEAD requests get its head only).
struct Reply {
    status: StatusCode,
    content_type: &'static str,
    body: String,
}

impl Reply {
    fn text(status: StatusCode, body: impl Into<String>) -> Self {
        Reply { status, content_type: "text/plain; charset=utf-8", body: body.into() }
    }

    fn into_response(self) -> hyper::Response<Full<Bytes>> {
        let mut response = hyper::Response::new(Full::new(Bytes::from(self.body)));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(hyper::header::CONTENT_TYPE, HeaderValue::from_static(self.content_type));
        if self.status == StatusCode::METHOD_NOT_ALLOWED {
            headers.insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::sync::mpsc;

    use super::*;
    use fuse_supervisor_engine::health::Pong;

    /// One request, raw; returns the status and the whole response.
    fn request(addr: SocketAddr, raw: &str) -> (u16, String) {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream.write_all(raw.as_bytes()).unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let status = response.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap_or(0);
        (status, response)
    }

    fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        request(addr, &format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n"))
    }

    fn server(health: &Arc<Health>) -> (MetricsServer, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        let server =
            MetricsServer::start("127.0.0.1:0".parse().unwrap(), Arc::clone(&metrics), Arc::clone(health)).unwrap();
        (server, metrics)
    }

    #[test]
    fn metrics_are_served_as_openmetrics_text() {
        let health = Arc::new(Health::new());
        let (server, metrics) = server(&health);
        metrics.kube_events_dropped.inc();
        let (status, response) = get(server.local_addr(), "/metrics?debug=1");
        assert_eq!(status, 200, "{response}");
        assert!(response.contains(&format!("Content-Type: {CONTENT_TYPE}\r\n")), "{response}");
        assert!(response.contains("\nfuse_supervisor_kube_events_dropped_total 1\n"), "{response}");
        assert!(response.ends_with("# EOF\n"), "{response}");
        let (status, response) = request(server.local_addr(), "HEAD /metrics HTTP/1.1\r\n\r\n");
        assert_eq!(status, 200);
        assert!(response.ends_with("\r\n\r\n"), "HEAD sent a body: {response}");
        server.stop();
    }

    #[test]
    fn healthz_asks_the_loop_and_readyz_waits_for_the_first_scan() {
        let health = Arc::new(Health::new());
        let (server, _metrics) = server(&health);
        let addr = server.local_addr();
        assert_eq!(get(addr, "/healthz").0, 503, "alive with no loop");
        assert_eq!(get(addr, "/readyz").0, 503, "ready before the first scan");

        let (events, inbox) = mpsc::channel::<Pong>();
        health.attach(move |pong| events.send(pong).is_ok());
        let answering = std::thread::spawn(move || inbox.into_iter().for_each(Pong::answer));
        health.set_ready();
        let (status, response) = get(addr, "/healthz");
        assert_eq!(status, 200, "{response}");
        assert!(response.ends_with("\r\n\r\nok\n"), "{response}");
        assert_eq!(get(addr, "/readyz").0, 200);

        health.detach();
        answering.join().unwrap();
        assert_eq!(get(addr, "/healthz").0, 503, "alive after the loop left");
        assert_eq!(get(addr, "/readyz").0, 503, "ready after the loop left");
    }

    #[test]
    fn readyz_names_a_state_file_that_cannot_be_saved_and_stays_ready() {
        let health = Arc::new(Health::new());
        let (server, _metrics) = server(&health);
        health.set_ready();
        health.set_state_problem(Some("cannot write state file /s/state.json: Read-only file system".into()));
        let (status, response) = get(server.local_addr(), "/readyz");
        assert_eq!(status, 200, "{response}");
        assert!(response.contains("\r\n\r\nok\n") && response.contains("/s/state.json: Read-only"), "{response}");
        health.set_state_problem(None);
        assert!(get(server.local_addr(), "/readyz").1.ends_with("\r\n\r\nok\n"));
    }

    #[test]
    fn unknown_paths_other_methods_and_garbage_are_refused() {
        let health = Arc::new(Health::new());
        let (server, _metrics) = server(&health);
        let addr = server.local_addr();
        assert_eq!(get(addr, "/").0, 404);
        let (status, response) = request(addr, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
        assert_eq!(status, 405);
        assert!(response.contains("Allow: GET, HEAD\r\n"), "{response}");
        assert_eq!(request(addr, "\x16\x03\x01 not http\r\n\r\n").0, 400);
        // Exactly the limit, all of it read: a server closing on unread
        // bytes would reset the connection before the answer is read.
        let start = "GET /metrics HTTP/1.1\r\nX: ";
        let endless = format!("{start}{}", "a".repeat(MAX_HEAD - start.len()));
        assert_eq!(request(addr, &endless).0, 431);
    }

    /// A connection from `peer` (any 127.x address) that sent the start of
    /// a `/readyz` head and not its end.
    fn unfinished_head(addr: SocketAddr, peer: [u8; 4]) -> TcpStream {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket.bind(&SocketAddr::from((peer, 0)).into()).unwrap();
        socket.connect(&addr.into()).unwrap();
        let mut stream: TcpStream = socket.into();
        stream.write_all(b"GET /readyz HTTP/1.1\r\nHost: test\r\n").unwrap();
        stream
    }

    /// Sends the end of an [`unfinished_head`]; the answer's status.
    fn finish_head(mut stream: TcpStream) -> u16 {
        stream.write_all(b"\r\n").unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        response.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap_or(0)
    }

    /// Whether the server closed it: a read ends rather than timing out.
    fn closed(mut stream: &TcpStream) -> bool {
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut sink = [0u8; 512];
        match stream.read(&mut sink) {
            Ok(read) => read == 0,
            Err(err) => !matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut),
        }
    }

    /// Whether it is open and unanswered now.
    fn waiting_now(mut stream: &TcpStream) -> bool {
        stream.set_nonblocking(true).unwrap();
        let waiting = matches!(stream.read(&mut [0u8; 1]), Err(err) if err.kind() == io::ErrorKind::WouldBlock);
        stream.set_nonblocking(false).unwrap();
        waiting
    }

    #[test]
    fn a_peer_over_its_share_of_heads_loses_its_oldest_and_nobody_else_does() {
        let health = Arc::new(Health::new());
        let (server, _metrics) = server(&health);
        let addr = server.local_addr();
        let other = unfinished_head(addr, [127, 0, 0, 3]);
        let own: Vec<TcpStream> = (0..=HEADS_PER_PEER).map(|_| unfinished_head(addr, [127, 0, 0, 2])).collect();
        assert!(closed(&own[0]), "the oldest head of the peer over its share stayed");
        assert!(own[1..].iter().all(waiting_now), "a newer head of that peer was closed");
        assert!(waiting_now(&other), "another peer's head was closed");
        assert_eq!(finish_head(other), 503, "not ready");
    }

    /// A probe whose head comes after its connect, behind newer heads of
    /// its own address (the kubelet's, which host-network pods share): it
    /// took no place before its bytes came, so none of them pushed it out.
    #[test]
    fn a_probe_silent_after_its_connect_is_not_pushed_out_by_newer_heads_of_its_address() {
        let health = Arc::new(Health::new());
        let (server, _metrics) = server(&health);
        let addr = server.local_addr();
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket.bind(&SocketAddr::from(([127, 0, 0, 2], 0)).into()).unwrap();
        socket.connect(&addr.into()).unwrap();
        let mut probe: TcpStream = socket.into();
        let newer: Vec<TcpStream> = (0..=HEADS_PER_PEER).map(|_| unfinished_head(addr, [127, 0, 0, 2])).collect();
        assert!(closed(&newer[0]), "the oldest head of the peer over its share stayed");
        assert!(waiting_now(&probe), "the silent probe was closed");
        health.set_ready();
        probe.write_all(b"GET /readyz HTTP/1.1\r\nHost: test\r\n\r\n").unwrap();
        let mut response = String::new();
        probe.read_to_string(&mut response).unwrap();
        assert!(response.starts_with("HTTP/1.1 200 "), "{response}");
    }

    #[test]
    fn a_full_table_of_heads_makes_room_for_a_probe() {
        let health = Arc::new(Health::new());
        let (server, _metrics) = server(&health);
        let addr = server.local_addr();
        let peers = HEADS_PENDING / HEADS_PER_PEER;
        let heads: Vec<TcpStream> = (0..HEADS_PENDING)
            .map(|i| unfinished_head(addr, [127, 0, 0, 2 + u8::try_from(i % peers).unwrap()]))
            .collect();
        health.set_ready();
        // From the address no head came from yet, as the kubelet's probe.
        let probe = unfinished_head(addr, [127, 0, 0, 1]);
        assert!(closed(&heads[0]), "the oldest head stayed");
        assert!(heads[1..].iter().all(waiting_now), "a head other than the oldest was closed");
        assert_eq!(finish_head(probe), 200);
    }

    /// Asks `server` itself, as hyper would once a head is in.
    fn ask(server: &Arc<Server>, method: Method, path: &str) -> StatusCode {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let peer = SocketAddr::from(([127, 0, 0, 2], 40000));
        let exchange = Exchange::default();
        runtime.block_on(Arc::clone(server).answer(&method, path, peer, &exchange)).status
    }

    #[test]
    fn answers_beyond_their_share_are_503_at_once() {
        let health = Arc::new(Health::new());
        health.set_ready();
        let server = Arc::new(Server::new(Arc::new(Metrics::new()), health));
        // Scrapers that do not read their answers hold every permit.
        let held = Arc::clone(&server.others).try_acquire_many_owned(OTHER_ANSWERS as u32).unwrap();
        assert_eq!(ask(&server, Method::GET, "/metrics"), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(ask(&server, Method::GET, "/nothing"), StatusCode::SERVICE_UNAVAILABLE, "errors share them");
        assert_eq!(ask(&server, Method::GET, "/readyz"), StatusCode::OK, "a probe waited for a permit");
        drop(held);
        assert_eq!(ask(&server, Method::GET, "/metrics"), StatusCode::OK);

        // A flood of probes fills the queue; the answerer is busy in a round.
        let mut probes = server.probes.lock().unwrap();
        probes.answering = true;
        probes.waiting.extend((0..PROBES_WAITING).map(|_| (Probe::Live, oneshot::channel().0)));
        drop(probes);
        assert_eq!(ask(&server, Method::GET, "/healthz"), StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn a_head_trickling_in_is_closed_at_its_deadline() {
        let health = Arc::new(Health::new());
        let (server, _metrics) = server(&health);
        let mut stream = unfinished_head(server.local_addr(), [127, 0, 0, 2]);
        let opened = std::time::Instant::now();
        while stream.write_all(b"a").is_ok() && waiting_now(&stream) {
            std::thread::sleep(Duration::from_millis(200));
        }
        let open = opened.elapsed();
        assert!(closed(&stream), "still open after {open:?}");
        assert!(open >= HEAD_DEADLINE && open < HEAD_DEADLINE + Duration::from_secs(2), "closed after {open:?}");
    }

    #[test]
    fn stop_ends_the_server() {
        let health = Arc::new(Health::new());
        let (server, _metrics) = server(&health);
        let addr = server.local_addr();
        drop(server);
        assert!(TcpStream::connect(addr).is_err(), "still listening after stop");
    }
}
