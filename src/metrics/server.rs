//! A small HTTP/1.1 server for `/metrics`, `/healthz` and `/readyz`.
//!
//! One thread sleeps in epoll on the listener, a shutdown eventfd and the
//! connections whose request head is still arriving, and reads those heads
//! itself, without blocking: a slow client costs a buffer, not a thread.
//! Probes (`/healthz`, `/readyz`) are answered by one thread, started when
//! one comes and gone when none waits; anything else on a short-lived
//! thread of its own. One request per connection (`Connection: close`);
//! scrapers and probes open one per request anyway.
//!
//! Anything that reaches the pod's IP can connect, so the kubelet's probes
//! must get through whatever other clients do (a liveness probe starved
//! three times in a row restarts the agent):
//! - a request head must be complete within [`HEAD_DEADLINE`] of the
//!   accept, however its bytes trickle in;
//! - at most [`HEADS_PER_PEER`] heads from one address are read at once, at
//!   most [`HEADS_PENDING`] in all, and a new connection is never refused
//!   for lack of room: it replaces the oldest head of its own address when
//!   that address is at its cap, else the oldest of all when the table is
//!   full. Refusing would hand the table to whoever fills it first (and
//!   the probes come from the node's address, which every host-network pod
//!   shares); replacing the oldest leaves an attacker only its own slots.
//!   A probe sends its head in one segment, mostly read whole at the
//!   accept (it then takes no room at all), else at its first wake-up, so
//!   pushing it out takes [`HEADS_PENDING`] new connections in that moment,
//!   a flood rather than a slow attack;
//! - probes are answered in rounds, one ping of the supervisor loop (at
//!   most [`LIVENESS_WAIT`]) answering every `/healthz` that waits, so a
//!   flood of them costs the loop one ping per round, and a probe waits
//!   for the round under way and its own at most; their answers are small
//!   enough to write without blocking. Beyond [`PROBES_WAITING`] waiting, a probe is answered 503;
//! - `/metrics` (and errors) are answered on at most [`OTHER_ANSWERS`]
//!   threads, each writing for at most [`ANSWER_DEADLINE`], so scrapers that
//!   never read their answer hold none of the probes' way (503 beyond).
//!
//! No timer while idle: epoll waits without a timeout when no head is
//! pending, and until the earliest head's deadline otherwise.
use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::{debug, error, warn};

use super::{CONTENT_TYPE, Metrics};
use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::health::Health;
use fuse_supervisor_engine::watch::thread::{ThreadError, Waiting, Watching, Woken};

/// How long `/healthz` waits for the loop to answer its ping. The
/// manifest's probe allows 5 s; a loop busy for longer than this in one
/// heal fails one probe, and three in a row restart it.
pub const LIVENESS_WAIT: Duration = Duration::from_secs(1);
/// How long a whole request head may take to arrive, from the accept. The
/// kubelet and Prometheus send theirs in one segment right after the
/// connect, so this only has to cover a retransmission or two; it is the
/// readiness probe's timeout (the liveness probe allows 5 s).
pub const HEAD_DEADLINE: Duration = Duration::from_secs(3);
/// How long writing one answer may take, all of it: a client reading a
/// byte at a time does not hold a thread longer.
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
/// Longest request head read; a probe's or scraper's is a few hundred bytes.
const MAX_HEAD: usize = 8 * 1024;
const MAX_HEADERS: usize = 32;
/// The pause after an accept error that is not "no more connections"
/// (out of descriptors, say): the listener stays readable, and epoll would
/// otherwise spin on it.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

const LISTENER: u64 = 1;
/// Connections' epoll tokens count up from here, in accept order.
const FIRST_CONNECTION: u64 = 2;

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
    #[error(transparent)]
    Thread(#[from] ThreadError),
}

/// The running server; stops and joins its thread when stopped or dropped.
pub struct MetricsServer {
    addr: SocketAddr,
    watching: Watching,
}

struct Shared {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    probes: Mutex<Probes>,
    others_answering: AtomicUsize,
}

impl MetricsServer {
    /// Binds `addr` (port 0: any free port; see [`MetricsServer::local_addr`])
    /// and serves until stopped.
    pub fn start(addr: SocketAddr, metrics: Arc<Metrics>, health: Arc<Health>) -> Result<Self, ServeError> {
        let listener = TcpListener::bind(addr).map_err(|source| ServeError::Bind { addr, source })?;
        let setup = |step| move |source| ServeError::Setup { addr, step, source };
        let local = listener.local_addr().map_err(setup("local address"))?;
        listener.set_nonblocking(true).map_err(setup("non-blocking listener"))?;
        let stop = Watching::stop_waker("metrics")?;
        let mut waiting = Waiting::new(&stop).map_err(setup("epoll"))?;
        waiting.add_readable(listener.as_fd(), LISTENER).map_err(setup("watch the listener"))?;
        let shared =
            Arc::new(Shared { metrics, health, probes: Mutex::default(), others_answering: AtomicUsize::new(0) });
        let watching = Watching::start("metrics", stop, move || {
            Heads::new(shared).serve(&listener, &mut waiting);
        })?;
        Ok(MetricsServer { addr: local, watching })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and joins the thread. Heads being read are dropped;
    /// answers being written finish on their own threads within
    /// [`ANSWER_DEADLINE`].
    pub fn stop(self) {
        if let Err(err) = self.watching.stop() {
            error!(err = %chain(&err), "metrics server did not stop cleanly");
        }
    }
}

/// A connection whose request head is still arriving.
struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    head: Vec<u8>,
    deadline: Instant,
}

/// What a read of a pending head came to.
enum Progress {
    /// Method and path (without the query).
    Complete(String, String),
    Incomplete,
    /// Not HTTP, or longer than [`MAX_HEAD`].
    Malformed,
    /// Closed or failed: nobody to answer.
    Gone,
}

/// The heads being read, keyed by epoll token; tokens count up in accept
/// order, so the first entry is the oldest and the first to expire.
struct Heads {
    pending: BTreeMap<u64, Pending>,
    next_token: u64,
    shared: Arc<Shared>,
}

impl Heads {
    fn new(shared: Arc<Shared>) -> Self {
        Heads { pending: BTreeMap::new(), next_token: FIRST_CONNECTION, shared }
    }

    fn serve(&mut self, listener: &TcpListener, waiting: &mut Waiting) {
        loop {
            let timeout =
                self.pending.values().next().map(|oldest| oldest.deadline.saturating_duration_since(Instant::now()));
            let ready: Vec<u64> = match waiting.wait(timeout) {
                Ok(Woken::Ready(tokens)) => tokens.to_vec(),
                Ok(Woken::Stop) => return,
                Err(err) => {
                    error!(err = %chain(&err), "metrics server cannot wait for connections; it stops");
                    return;
                }
            };
            for token in ready {
                if token == LISTENER {
                    self.accept_all(listener, waiting);
                } else {
                    self.read(token, waiting);
                }
            }
            self.expire();
        }
    }

    fn accept_all(&mut self, listener: &TcpListener, waiting: &Waiting) {
        loop {
            match listener.accept() {
                Ok((stream, peer)) => self.admit(stream, peer, waiting),
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return,
                Err(err) if matches!(err.kind(), io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted) => {}
                Err(err) => {
                    warn!(err = %chain(&err), "metrics server cannot accept a connection");
                    std::thread::sleep(ACCEPT_BACKOFF);
                    return;
                }
            }
        }
    }

    /// Reads what already arrived of a new connection's head; if that is
    /// not all of it, makes room for it (see the module doc) and watches it.
    fn admit(&mut self, stream: TcpStream, peer: SocketAddr, waiting: &Waiting) {
        // Accepted sockets do not inherit the listener's O_NONBLOCK on Linux.
        if let Err(err) = stream.set_nonblocking(true) {
            return debug!(%peer, err = %chain(&err), "cannot make a metrics connection non-blocking; closed");
        }
        let mut pending = Pending { stream, peer, head: Vec::new(), deadline: Instant::now() + HEAD_DEADLINE };
        match pending.read() {
            Progress::Incomplete => {}
            progress => return self.finish(pending, progress),
        }
        self.make_room(peer);
        let token = self.next_token;
        self.next_token += 1;
        if let Err(err) = waiting.add_readable(pending.stream.as_fd(), token) {
            return warn!(%peer, err = %chain(&err), "cannot watch a metrics connection; closed");
        }
        self.pending.insert(token, pending);
    }

    /// Closes the oldest head of `peer` if it is at its share, else the
    /// oldest of all if the table is full.
    fn make_room(&mut self, peer: SocketAddr) {
        let address = peer.ip().to_canonical();
        let mut from_peer = self.pending.iter().filter(|(_, head)| head.peer.ip().to_canonical() == address);
        let oldest_of_peer = from_peer.next().map(|(token, _)| *token);
        let evicted = if from_peer.count() + 1 >= HEADS_PER_PEER {
            oldest_of_peer
        } else if self.pending.len() >= HEADS_PENDING {
            self.pending.keys().next().copied()
        } else {
            None
        };
        if let Some(oldest) = evicted.and_then(|token| self.pending.remove(&token)) {
            debug!(peer = %oldest.peer, "request head closed to make room for a newer one");
        }
    }

    fn read(&mut self, token: u64, waiting: &Waiting) {
        let Some(pending) = self.pending.get_mut(&token) else { return };
        match pending.read() {
            Progress::Incomplete => {}
            progress => {
                if let Some(pending) = self.pending.remove(&token) {
                    // Closing it would do the same; the answer's thread keeps it open.
                    let _ = waiting.remove(pending.stream.as_fd());
                    self.finish(pending, progress);
                }
            }
        }
    }

    /// Closes the heads whose deadline passed (dropping one closes it and
    /// takes it out of epoll).
    fn expire(&mut self) {
        let now = Instant::now();
        while let Some(entry) = self.pending.first_entry() {
            if entry.get().deadline > now {
                return;
            }
            let pending = entry.remove();
            debug!(peer = %pending.peer, bytes = pending.head.len(), "request head not complete in time; closed");
        }
    }

    fn finish(&self, pending: Pending, progress: Progress) {
        let Pending { stream, peer, .. } = pending;
        match progress {
            Progress::Complete(method, path) => answer(stream, peer, method, path, &self.shared),
            Progress::Malformed => reply_now(&stream, peer, &Response::text(400, "malformed HTTP request\n"), false),
            Progress::Incomplete | Progress::Gone => {}
        }
    }
}

impl Pending {
    /// Reads what arrived, without blocking, and parses the head so far.
    fn read(&mut self) -> Progress {
        let mut chunk = [0u8; 1024];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => return Progress::Gone,
                Ok(n) => self.head.extend_from_slice(&chunk[..n]),
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Progress::Gone,
            }
            if self.head.len() >= MAX_HEAD {
                break;
            }
        }
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut request = httparse::Request::new(&mut headers);
        match request.parse(&self.head) {
            Ok(httparse::Status::Complete(_)) => {
                let (Some(method), Some(target)) = (request.method, request.path) else { return Progress::Malformed };
                let path = target.split_once('?').map_or(target, |(path, _)| path);
                Progress::Complete(method.to_owned(), path.to_owned())
            }
            Ok(httparse::Status::Partial) if self.head.len() < MAX_HEAD => Progress::Incomplete,
            Ok(httparse::Status::Partial) | Err(_) => Progress::Malformed,
        }
    }
}

/// Answers a complete request: probes through the one probe answerer,
/// anything else on a thread of its own while [`OTHER_ANSWERS`] allows
/// (503 at once beyond).
fn answer(stream: TcpStream, peer: SocketAddr, method: String, path: String, shared: &Arc<Shared>) {
    let head_only = method == "HEAD";
    if matches!(path.as_str(), "/healthz" | "/readyz") {
        return queue_probe(Request { stream, peer, method, path }, shared);
    }
    let answering = &shared.others_answering;
    if answering.fetch_add(1, Ordering::SeqCst) >= OTHER_ANSWERS {
        answering.fetch_sub(1, Ordering::SeqCst);
        debug!(%peer, %path, "metrics server busy; answered 503");
        return reply_now(&stream, peer, &Response::text(503, "busy: too many requests being answered\n"), head_only);
    }
    let worker = Arc::clone(shared);
    let spawned = std::thread::Builder::new().name("metrics-conn".into()).spawn(move || {
        // Never asked: probes go to the probe answerer.
        let response = route(&method, &path, &worker, &mut || false);
        if let Err(err) = write_response(&stream, &response, head_only) {
            debug!(%peer, err = %chain(&err), "cannot write a metrics answer");
        }
        worker.others_answering.fetch_sub(1, Ordering::SeqCst);
    });
    if let Err(err) = spawned {
        answering.fetch_sub(1, Ordering::SeqCst);
        warn!(%peer, err = %chain(&err), "cannot start a thread for a metrics answer");
    }
}

/// A complete request for `/healthz` or `/readyz`, waiting for its answer.
struct Request {
    stream: TcpStream,
    peer: SocketAddr,
    method: String,
    path: String,
}

/// The probe requests waiting, and whether the answerer thread runs.
#[derive(Default)]
struct Probes {
    waiting: Vec<Request>,
    answering: bool,
}

/// Queues a probe for the answerer, starting it if it is not running.
fn queue_probe(request: Request, shared: &Arc<Shared>) {
    let mut probes = shared.probes.lock().unwrap_or_else(PoisonError::into_inner);
    if probes.waiting.len() >= PROBES_WAITING {
        drop(probes);
        debug!(peer = %request.peer, "too many probes waiting; answered 503");
        let busy = Response::text(503, "busy: too many probes waiting\n");
        return reply_now(&request.stream, request.peer, &busy, request.method == "HEAD");
    }
    probes.waiting.push(request);
    if probes.answering {
        return;
    }
    probes.answering = true;
    drop(probes);
    let worker = Arc::clone(shared);
    if let Err(err) = std::thread::Builder::new().name("metrics-probes".into()).spawn(move || answer_probes(&worker)) {
        let mut probes = shared.probes.lock().unwrap_or_else(PoisonError::into_inner);
        probes.answering = false;
        let dropped = std::mem::take(&mut probes.waiting).len();
        warn!(err = %chain(&err), dropped, "cannot start the thread that answers probes; their connections are closed");
    }
}

/// Answers the waiting probes in rounds until none is left: one ping of
/// the loop per round answers every `/healthz` of it, however many. Each
/// answer is a ping sent after its request came.
fn answer_probes(shared: &Shared) {
    loop {
        let round = {
            let mut probes = shared.probes.lock().unwrap_or_else(PoisonError::into_inner);
            if probes.waiting.is_empty() {
                probes.answering = false;
                return;
            }
            std::mem::take(&mut probes.waiting)
        };
        let mut alive = None;
        let mut is_alive = || {
            *alive.get_or_insert_with(|| {
                let answered = shared.health.is_alive(LIVENESS_WAIT);
                if !answered {
                    let wait_ms = LIVENESS_WAIT.as_millis() as u64;
                    warn!(wait_ms, "liveness check: the supervisor loop did not answer");
                }
                answered
            })
        };
        for request in round {
            let response = route(&request.method, &request.path, shared, &mut is_alive);
            reply_now(&request.stream, request.peer, &response, request.method == "HEAD");
        }
    }
}

/// A short answer written without blocking (from the epoll thread or the
/// probe answerer): a few hundred bytes fit in the empty send buffer of a
/// fresh connection.
fn reply_now(stream: &TcpStream, peer: SocketAddr, response: &Response, head_only: bool) {
    let mut bytes = response_head(response).into_bytes();
    if !head_only {
        bytes.extend_from_slice(response.body.as_bytes());
    }
    match (&*stream).write(&bytes) {
        Ok(written) if written == bytes.len() => {}
        Ok(_) => debug!(%peer, status = response.status, "metrics answer cut short: the send buffer was full"),
        Err(err) => debug!(%peer, err = %chain(&err), "cannot write a metrics answer"),
    }
}

/// Writes all of `response` within [`ANSWER_DEADLINE`], however slowly the
/// client reads.
fn write_response(stream: &TcpStream, response: &Response, head_only: bool) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    let deadline = Instant::now() + ANSWER_DEADLINE;
    let head = response_head(response);
    let body = if head_only { "" } else { response.body.as_str() };
    for mut part in [head.as_bytes(), body.as_bytes()] {
        while !part.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "answer not written in time"));
            }
            stream.set_write_timeout(Some(left))?;
            match (&*stream).write(part) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(written) => part = &part[written..],
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(err),
            }
        }
    }
    Ok(())
}

struct Response {
    status: u16,
    content_type: &'static str,
    body: String,
}

impl Response {
    fn text(status: u16, body: impl Into<String>) -> Self {
        Response { status, content_type: "text/plain; charset=utf-8", body: body.into() }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        500 => "Internal Server Error",
        _ => "Service Unavailable",
    }
}

fn response_head(response: &Response) -> String {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        response.status,
        reason(response.status),
        response.content_type,
        response.body.len()
    );
    if response.status == 405 {
        head.push_str("Allow: GET, HEAD\r\n");
    }
    head.push_str("\r\n");
    head
}

/// The answer to `method` on `path`; `is_alive` asks the loop (only
/// `/healthz` calls it).
fn route(method: &str, path: &str, shared: &Shared, is_alive: &mut dyn FnMut() -> bool) -> Response {
    if !matches!(path, "/metrics" | "/healthz" | "/readyz") {
        return Response::text(404, "not found: try /metrics, /healthz or /readyz\n");
    }
    if !matches!(method, "GET" | "HEAD") {
        return Response::text(405, format!("{method} not allowed on {path}\n"));
    }
    match path {
        "/metrics" => match shared.metrics.encode() {
            Ok(body) => Response { status: 200, content_type: CONTENT_TYPE, body },
            Err(err) => {
                error!(err = %chain(&err), "cannot serve /metrics");
                Response::text(500, format!("{err}\n"))
            }
        },
        "/healthz" if is_alive() => Response::text(200, "ok\n"),
        "/healthz" => Response::text(503, format!("the supervisor loop did not answer within {LIVENESS_WAIT:?}\n")),
        _ if shared.health.is_ready() => match shared.health.state_problem() {
            None => Response::text(200, "ok\n"),
            Some(problem) => Response::text(
                200,
                format!(
                    "ok\n{problem}; healing goes on, but a restarted supervisor will not know what this one learned\n"
                ),
            ),
        },
        _ => Response::text(503, "the first scan of the mount table is not done\n"),
    }
}

#[cfg(test)]
mod tests {
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
        assert_eq!(request(addr, &endless).0, 400);
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

    #[test]
    fn stop_ends_the_server() {
        let health = Arc::new(Health::new());
        let (server, _metrics) = server(&health);
        let addr = server.local_addr();
        drop(server);
        assert!(TcpStream::connect(addr).is_err(), "still listening after stop");
    }
}
