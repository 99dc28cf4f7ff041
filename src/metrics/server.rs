//! A small HTTP/1.1 server for `/metrics`, `/healthz` and `/readyz`.
//!
//! One thread sleeps in epoll on the listener and a shutdown eventfd, and
//! hands each connection to a short-lived thread of its own: a liveness
//! check waits for the loop, and a slow client must not hold up the
//! kubelet's probes. One request per connection (`Connection: close`);
//! scrapers and probes open one per request anyway.
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tracing::{debug, error, warn};

use super::{CONTENT_TYPE, Metrics};
use crate::health::Health;
use crate::watch::thread::{ThreadError, Waiting, Watching, Woken};

/// How long `/healthz` waits for the loop to answer its ping. The
/// manifest's probe allows 5 s; a loop busy for longer than this in one
/// heal fails one probe, and three in a row restart it.
pub const LIVENESS_WAIT: Duration = Duration::from_secs(1);
/// Deadline for reading a request and writing its response.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest request head read; a probe's or scraper's is a few hundred bytes.
const MAX_HEAD: usize = 8 * 1024;
const MAX_HEADERS: usize = 32;
/// Connections served at once; more are closed at once.
const MAX_CONNECTIONS: usize = 16;
/// The pause after an accept error that is not "no more connections"
/// (out of descriptors, say): the listener stays readable, and epoll would
/// otherwise spin on it.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

const LISTENER: u64 = 1;

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
    in_flight: AtomicUsize,
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
        let shared = Arc::new(Shared { metrics, health, in_flight: AtomicUsize::new(0) });
        let watching = Watching::start("metrics", stop, move || accept_loop(&listener, &mut waiting, &shared))?;
        Ok(MetricsServer { addr: local, watching })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and joins the thread. Connections being served
    /// finish on their own threads within their I/O deadline.
    pub fn stop(self) {
        if let Err(err) = self.watching.stop() {
            error!(err = %crate::report::error_chain(&err), "metrics server did not stop cleanly");
        }
    }
}

fn accept_loop(listener: &TcpListener, waiting: &mut Waiting, shared: &Arc<Shared>) {
    loop {
        match waiting.wait(None) {
            Ok(Woken::Ready(_)) => {}
            Ok(Woken::Stop) => return,
            Err(err) => {
                error!(?err, "metrics server cannot wait for connections; it stops");
                return;
            }
        }
        loop {
            match listener.accept() {
                Ok((stream, peer)) => dispatch(stream, peer, shared),
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                Err(err) if matches!(err.kind(), io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted) => {}
                Err(err) => {
                    warn!(?err, "metrics server cannot accept a connection");
                    std::thread::sleep(ACCEPT_BACKOFF);
                    break;
                }
            }
        }
    }
}

/// Serves one connection on a thread of its own, unless too many are open.
fn dispatch(stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>) {
    if shared.in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
        shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        debug!(%peer, "metrics server busy; connection closed");
        return;
    }
    let worker = Arc::clone(shared);
    let spawned = std::thread::Builder::new().name("metrics-conn".into()).spawn(move || {
        if let Err(err) = serve_connection(stream, &worker) {
            debug!(%peer, ?err, "metrics connection failed");
        }
        worker.in_flight.fetch_sub(1, Ordering::SeqCst);
    });
    if let Err(err) = spawned {
        shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        warn!(%peer, ?err, "cannot start a thread for a metrics connection");
    }
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

fn serve_connection(mut stream: TcpStream, shared: &Shared) -> io::Result<()> {
    // Accepted sockets do not inherit the listener's O_NONBLOCK on Linux;
    // said explicitly so the deadlines below apply.
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let (response, head_only) = match read_request(&mut stream)? {
        Some((method, path)) => (route(&method, &path, shared), method == "HEAD"),
        None => (Response::text(400, "malformed HTTP request\n"), false),
    };
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
    stream.write_all(head.as_bytes())?;
    if !head_only {
        stream.write_all(response.body.as_bytes())?;
    }
    stream.flush()
}

/// Reads the request head: Some((method, path without query)), or None if
/// it is not HTTP or too long.
fn read_request(stream: &mut TcpStream) -> io::Result<Option<(String, String)>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed before the request head ended"));
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut request = httparse::Request::new(&mut headers);
        match request.parse(&buf) {
            Ok(httparse::Status::Complete(_)) => {
                let (Some(method), Some(target)) = (request.method, request.path) else { return Ok(None) };
                let path = target.split_once('?').map_or(target, |(path, _)| path);
                return Ok(Some((method.to_owned(), path.to_owned())));
            }
            Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {}
            Ok(httparse::Status::Partial) | Err(_) => return Ok(None),
        }
    }
}

fn route(method: &str, path: &str, shared: &Shared) -> Response {
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
                error!(%err, "cannot serve /metrics");
                Response::text(500, format!("{err}\n"))
            }
        },
        "/healthz" if shared.health.is_alive(LIVENESS_WAIT) => Response::text(200, "ok\n"),
        "/healthz" => {
            warn!(wait_ms = LIVENESS_WAIT.as_millis() as u64, "liveness check: the supervisor loop did not answer");
            Response::text(503, format!("the supervisor loop did not answer within {LIVENESS_WAIT:?}\n"))
        }
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
    use crate::health::Pong;

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

    #[test]
    fn stop_ends_the_server() {
        let health = Arc::new(Health::new());
        let (server, _metrics) = server(&health);
        let addr = server.local_addr();
        drop(server);
        assert!(TcpStream::connect(addr).is_err(), "still listening after stop");
    }
}
