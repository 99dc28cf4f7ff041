//! An API server stand-in for Events: plain HTTP on `127.0.0.1:<ephemeral>`
//! (reached through a kubeconfig), recording every request and answering
//! like the API server does for events: the object written back, `201` for
//! a create and `200` for a patch (the patch body itself, which is all a
//! client needs from it).
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long a connection may sit idle before the stand-in drops it.
const IDLE: Duration = Duration::from_secs(10);
/// Request heads and bodies larger than this are refused.
const MAX_REQUEST: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ApiServerError {
    #[error("cannot listen on 127.0.0.1 for the API server stand-in")]
    Listen(#[source] io::Error),
    #[error("cannot start the API server stand-in thread")]
    Spawn(#[source] io::Error),
    #[error("no request matching within {waited:?}; requests so far:\n{seen}")]
    Timeout { waited: Duration, seen: String },
}

/// One request as the stand-in saw it.
#[derive(Clone, Debug)]
pub struct ApiRequest {
    pub method: String,
    pub path: String,
    pub body: Value,
}

#[derive(Default)]
struct State {
    requests: Vec<ApiRequest>,
    stopping: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The stand-in; stops and joins its threads on drop.
pub struct ApiServerStandIn {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl ApiServerStandIn {
    pub fn start() -> Result<Self, ApiServerError> {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(ApiServerError::Listen)?;
        let addr = listener.local_addr().map_err(ApiServerError::Listen)?;
        let shared = Arc::new(Shared::default());
        let acceptor = {
            let shared = shared.clone();
            thread::Builder::new()
                .name("apiserver-stand-in".into())
                .spawn(move || accept(&listener, &shared))
                .map_err(ApiServerError::Spawn)?
        };
        Ok(ApiServerStandIn { addr, shared, acceptor: Some(acceptor) })
    }

    /// A kubeconfig that points at the stand-in (no credentials).
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: stand-in\n  cluster:\n    server: http://{}\n\
             contexts:\n- name: stand-in\n  context:\n    cluster: stand-in\n    user: stand-in\n    \
             namespace: default\ncurrent-context: stand-in\nusers:\n- name: stand-in\n  user: {{}}\n",
            self.addr
        )
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<ApiRequest> {
        self.shared.lock().requests.clone()
    }

    /// Waits for a request matching `pred` and returns it.
    pub fn wait_for(
        &self,
        timeout: Duration,
        pred: impl Fn(&ApiRequest) -> bool,
    ) -> Result<ApiRequest, ApiServerError> {
        let deadline = Instant::now() + timeout;
        let mut state = self.shared.lock();
        loop {
            if let Some(request) = state.requests.iter().find(|request| pred(request)) {
                return Ok(request.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let seen: Vec<String> =
                    state.requests.iter().map(|r| format!("{} {} {}", r.method, r.path, r.body)).collect();
                return Err(ApiServerError::Timeout { waited: timeout, seen: seen.join("\n") });
            }
            state = self.shared.changed.wait_timeout(state, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }
}

impl Drop for ApiServerStandIn {
    fn drop(&mut self) {
        self.shared.lock().stopping = true;
        // Unblock accept(); it sees `stopping` and returns.
        let _ = TcpStream::connect(self.addr);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

fn accept(listener: &TcpListener, shared: &Arc<Shared>) {
    let mut connections: Vec<JoinHandle<()>> = Vec::new();
    for sock in listener.incoming() {
        if shared.lock().stopping {
            break;
        }
        let Ok(sock) = sock else { continue };
        connections.retain(|connection| !connection.is_finished());
        let shared = shared.clone();
        if let Ok(connection) = thread::Builder::new().name("apiserver-stand-in-conn".into()).spawn(move || {
            // A client that goes away ends its connection; nothing to report.
            let _ = serve(sock, &shared);
        }) {
            connections.push(connection);
        }
    }
    for connection in connections {
        let _ = connection.join();
    }
}

/// Answers requests on one keep-alive connection until the client closes it.
fn serve(sock: TcpStream, shared: &Shared) -> io::Result<()> {
    sock.set_read_timeout(Some(IDLE))?;
    let mut writer = sock.try_clone()?;
    let mut reader = BufReader::new(sock);
    loop {
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            if reader.read_until(b'\n', &mut head)? == 0 || head.len() > MAX_REQUEST {
                return Ok(());
            }
        }
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut request = httparse::Request::new(&mut headers);
        if !matches!(request.parse(&head), Ok(httparse::Status::Complete(_))) {
            return Err(io::ErrorKind::InvalidData.into());
        }
        let length = request
            .headers
            .iter()
            .find(|header| header.name.eq_ignore_ascii_case("content-length"))
            .and_then(|header| std::str::from_utf8(header.value).ok()?.trim().parse::<usize>().ok())
            .unwrap_or(0);
        if length > MAX_REQUEST {
            return Err(io::ErrorKind::InvalidData.into());
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body)?;
        let method = request.method.unwrap_or_default().to_owned();
        let path = request.path.unwrap_or_default().split('?').next().unwrap_or_default().to_owned();
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let (status, reason) = if method == "POST" { (201, "Created") } else { (200, "OK") };
        let answer = serde_json::to_vec(&body).unwrap_or_default();
        write!(
            writer,
            "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            answer.len()
        )?;
        writer.write_all(&answer)?;
        writer.flush()?;
        shared.lock().requests.push(ApiRequest { method, path, body });
        shared.changed.notify_all();
    }
}
