//! A kubelet stand-in: HTTPS on `127.0.0.1:<ephemeral>` with a certificate
//! made at start, serving `GET /pods` from a body the test sets, with the
//! faults a real kubelet shows (401, 403, 5xx, slow, broken JSON, a dropped
//! connection). Like Go's net/http it sends large bodies chunked.
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::{ServerConfig, ServerConnection, StreamOwned};
use serde_json::Value;

use fuse_supervisor_engine::kube::Timestamp;

/// Bodies larger than this go out chunked (Go's net/http: 2 KiB).
const CHUNK_ABOVE: usize = 2048;
/// Size of each chunk of a normal response.
const CHUNK: usize = 16 * 1024;
/// How long a connection may sit idle before the stand-in drops it.
const IDLE: Duration = Duration::from_secs(10);
/// A `/pods` body that breaks off in the middle of `items[0].spec.containers`.
pub const MALFORMED_BODY: &str = r#"{"kind":"PodList","apiVersion":"v1","metadata":{},"items":[{"metadata":{"name":"broken"},"spec":{"containers":[}]}"#;

#[derive(Debug, thiserror::Error)]
pub enum StandInError {
    #[error("cannot generate the kubelet stand-in certificate")]
    Certificate(#[source] rcgen::Error),
    #[error("cannot configure TLS for the kubelet stand-in")]
    Tls(#[source] rustls::Error),
    #[error("cannot listen on 127.0.0.1 for the kubelet stand-in")]
    Listen(#[source] io::Error),
    #[error("cannot start the kubelet stand-in thread")]
    Spawn(#[source] io::Error),
}

/// What the stand-in does to the next requests instead of answering normally.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Answer with this status and a body like the kubelet's.
    Status(u16),
    /// Send the status and headers at once, then trickle the body over this
    /// long: every read gets a little, the whole takes too long.
    Slow(Duration),
    /// `200 OK` with [`MALFORMED_BODY`].
    Malformed,
    /// Read the request, then close without answering.
    Close,
    /// Send the head with the whole body's `Content-Length` and half the
    /// body, then close the connection cleanly (with close_notify).
    CutShort,
    /// Send these bytes as the whole response, then close cleanly.
    Raw(Vec<u8>),
}

#[derive(Default)]
struct State {
    pods: Arc<[u8]>,
    fault: Option<Fault>,
    expected_token: Option<String>,
    last_token: Option<String>,
    requests: usize,
    stopping: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Wakes sleeping responders when the stand-in stops.
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent even if a responder panicked.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sleeps, or returns `false` at once if the stand-in is stopping.
    fn sleep(&self, duration: Duration) -> bool {
        let state = self.lock();
        let (state, _) = self
            .wake
            .wait_timeout_while(state, duration, |state| !state.stopping)
            .unwrap_or_else(PoisonError::into_inner);
        !state.stopping
    }
}

/// The kubelet stand-in; stops and joins its threads on drop.
pub struct KubeletStandIn {
    addr: SocketAddr,
    ca_pem: String,
    cert_pem: String,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl KubeletStandIn {
    /// Starts serving an empty `PodList`, accepting any token (or none).
    pub fn start() -> Result<Self, StandInError> {
        let (config, ca_pem, cert_pem) = tls_config()?;
        let listener = TcpListener::bind("127.0.0.1:0").map_err(StandInError::Listen)?;
        let addr = listener.local_addr().map_err(StandInError::Listen)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                pods: Arc::from(&br#"{"kind":"PodList","apiVersion":"v1","metadata":{},"items":[]}"#[..]),
                ..State::default()
            }),
            wake: Condvar::new(),
        });
        let acceptor = {
            let shared = shared.clone();
            thread::Builder::new()
                .name("kubelet-stand-in".into())
                .spawn(move || accept(listener, &config, &shared))
                .map_err(StandInError::Spawn)?
        };
        Ok(Self { addr, ca_pem, cert_pem, shared, acceptor: Some(acceptor) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// PEM of the CA that signed the serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The `run` arguments that point a supervisor at this stand-in, with
    /// its CA and a token written to files under the sandbox's root (in
    /// its namespace, where the supervisor reads them).
    pub fn client_args(&self, sandbox: &super::Sandbox) -> io::Result<Vec<String>> {
        let files = sandbox.root().join("credentials");
        let (ca, token) = (files.join("ca.pem"), files.join("token"));
        let writes = (files, ca.clone(), self.ca_pem.clone(), token.clone());
        sandbox.run(move || {
            std::fs::create_dir_all(&writes.0)?;
            std::fs::write(&writes.1, writes.2)?;
            std::fs::write(&writes.3, "token")
        })?;
        Ok(vec![
            "--kubelet".to_owned(),
            format!("https://127.0.0.1:{}", self.port()),
            "--kubelet-ca-file".to_owned(),
            ca.display().to_string(),
            "--kubelet-token-file".to_owned(),
            token.display().to_string(),
        ])
    }

    /// PEM of the serving certificate itself (for pinning).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The body of the next `200 OK` answers to `/pods`.
    pub fn set_pods(&self, body: impl Into<Vec<u8>>) {
        self.shared.lock().pods = Arc::from(body.into());
    }

    /// `None` answers normally again.
    pub fn set_fault(&self, fault: Option<Fault>) {
        self.shared.lock().fault = fault;
    }

    /// The bearer token requests must carry; `None` accepts anything.
    pub fn set_token(&self, token: Option<&str>) {
        self.shared.lock().expected_token = token.map(str::to_string);
    }

    /// The bearer token of the last request, if it had one.
    pub fn last_token(&self) -> Option<String> {
        self.shared.lock().last_token.clone()
    }

    /// Requests read so far (answered or not).
    pub fn requests(&self) -> usize {
        self.shared.lock().requests
    }
}

impl Drop for KubeletStandIn {
    fn drop(&mut self) {
        self.shared.lock().stopping = true;
        self.shared.wake.notify_all();
        // Unblock accept(); it sees `stopping` and returns.
        let _ = TcpStream::connect(self.addr);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

/// A CA and a serving certificate for `127.0.0.1` and `localhost`.
fn tls_config() -> Result<(Arc<ServerConfig>, String, String), StandInError> {
    let mut ca_params = CertificateParams::default();
    // Unique like the kubelet's own `<host>-ca@<time>`, so that two stand-ins
    // are two different issuers, not one name with two keys.
    static STARTED: AtomicUsize = AtomicUsize::new(0);
    let serial = STARTED.fetch_add(1, Ordering::Relaxed);
    let name = format!("kubelet-stand-in-ca@{}-{serial}", std::process::id());
    ca_params.distinguished_name.push(DnType::CommonName, name);
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().map_err(StandInError::Certificate)?)
        .map_err(StandInError::Certificate)?;

    let key = KeyPair::generate().map_err(StandInError::Certificate)?;
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .map_err(StandInError::Certificate)?;
    params.distinguished_name.push(DnType::CommonName, "kubelet-stand-in");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &ca).map_err(StandInError::Certificate)?;

    let chain = vec![cert.der().clone(), CertificateDer::from(ca.der().to_vec())];
    let private = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let config = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(StandInError::Tls)?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(StandInError::Tls)?;
    Ok((Arc::new(config), ca.pem(), cert.pem()))
}

fn accept(listener: TcpListener, config: &Arc<ServerConfig>, shared: &Arc<Shared>) {
    let mut responders: Vec<JoinHandle<()>> = Vec::new();
    for sock in listener.incoming() {
        if shared.lock().stopping {
            break;
        }
        let Ok(sock) = sock else { continue };
        responders.retain(|responder| !responder.is_finished());
        let (config, shared) = (config.clone(), shared.clone());
        // A responder that cannot start leaves the client to see a reset.
        if let Ok(responder) = thread::Builder::new().name("kubelet-stand-in-conn".into()).spawn(move || {
            // Errors here are the client's doing (it gave up, or refused the
            // certificate); the client's side of the test reports them.
            let _ = respond(sock, config, &shared);
        }) {
            responders.push(responder);
        }
    }
    for responder in responders {
        let _ = responder.join();
    }
}

fn respond(sock: TcpStream, config: Arc<ServerConfig>, shared: &Shared) -> io::Result<()> {
    sock.set_read_timeout(Some(IDLE))?;
    sock.set_write_timeout(Some(IDLE))?;
    let conn = ServerConnection::new(config).map_err(io::Error::other)?;
    let mut tls = StreamOwned::new(conn, sock);
    let token = read_request(&mut tls)?;

    let (pods, fault, authorized) = {
        let mut state = shared.lock();
        state.requests += 1;
        state.last_token = token.clone();
        let authorized = state.expected_token.is_none() || state.expected_token == token;
        (state.pods.clone(), state.fault.clone(), authorized)
    };
    if !authorized {
        write_response(&mut tls, 401, "text/plain; charset=utf-8", b"Unauthorized\n")?;
    } else {
        match fault {
            None => write_response(&mut tls, 200, "application/json", &pods)?,
            Some(Fault::Status(code)) => {
                let body = match code {
                    403 => "Forbidden (user=system:serviceaccount:kube-system:fuse-supervisor, verb=get, \
                            resource=nodes, subresource(s)=[pods])\n"
                        .to_string(),
                    _ => format!("{}\n", reason(code)),
                };
                write_response(&mut tls, code, "text/plain; charset=utf-8", body.as_bytes())?;
            }
            Some(Fault::Slow(duration)) => {
                let pieces = 20;
                write!(tls, "{}", head(200, "application/json", None))?;
                tls.flush()?;
                for piece in pods.chunks(pods.len().div_ceil(pieces).max(1)) {
                    if !shared.sleep(duration / pieces as u32) {
                        return Ok(());
                    }
                    write!(tls, "{:x}\r\n", piece.len())?;
                    tls.write_all(piece)?;
                    tls.write_all(b"\r\n")?;
                    tls.flush()?;
                }
                tls.write_all(b"0\r\n\r\n")?;
            }
            Some(Fault::Malformed) => write_response(&mut tls, 200, "application/json", MALFORMED_BODY.as_bytes())?,
            // Dropped without close_notify, as a crashing kubelet would.
            Some(Fault::Close) => return Ok(()),
            Some(Fault::CutShort) => {
                write!(tls, "{}", head(200, "application/json", Some(pods.len())))?;
                tls.write_all(&pods[..pods.len() / 2])?;
            }
            Some(Fault::Raw(bytes)) => tls.write_all(&bytes)?,
        }
    }
    tls.conn.send_close_notify();
    tls.flush()
}

/// Reads the request head; returns its bearer token.
fn read_request(tls: &mut impl Read) -> io::Result<Option<String>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0; 1024];
    loop {
        let n = tls.read(&mut chunk)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut request = httparse::Request::new(&mut headers);
        match request.parse(&buf) {
            Ok(httparse::Status::Complete(_)) => {
                let token = request
                    .headers
                    .iter()
                    .find(|header| header.name.eq_ignore_ascii_case("authorization"))
                    .and_then(|header| std::str::from_utf8(header.value).ok())
                    .and_then(|value| value.strip_prefix("Bearer "))
                    .map(str::to_string);
                return Ok(token);
            }
            Ok(httparse::Status::Partial) if buf.len() < 64 * 1024 => {}
            _ => return Err(io::ErrorKind::InvalidData.into()),
        }
    }
}

fn write_response(tls: &mut impl Write, code: u16, content_type: &str, body: &[u8]) -> io::Result<()> {
    if body.len() <= CHUNK_ABOVE {
        write!(tls, "{}", head(code, content_type, Some(body.len())))?;
        tls.write_all(body)?;
    } else {
        write!(tls, "{}", head(code, content_type, None))?;
        for chunk in body.chunks(CHUNK) {
            write!(tls, "{:x}\r\n", chunk.len())?;
            tls.write_all(chunk)?;
            tls.write_all(b"\r\n")?;
        }
        tls.write_all(b"0\r\n\r\n")?;
    }
    tls.flush()
}

/// Status line and headers as Go's net/http writes them.
fn head(code: u16, content_type: &str, length: Option<usize>) -> String {
    let framing = match length {
        Some(length) => format!("Content-Length: {length}"),
        None => "Transfer-Encoding: chunked".to_string(),
    };
    format!(
        "HTTP/1.1 {code} {}\r\nConnection: close\r\nContent-Type: {content_type}\r\n\
         Date: Tue, 04 Mar 2025 06:12:50 GMT\r\n{framing}\r\n\r\n",
        reason(code)
    )
}

fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// The fixture node with a JuiceFS mount pod; its pods are the templates.
fn fixture_pods() -> Vec<Value> {
    // The fixture is part of the crate and parsed by the unit tests.
    let fixture: Value = serde_json::from_str(include_str!("../../fixtures/kubelet/juicefs-mount-pod.json"))
        .unwrap_or_else(|err| panic!("fixtures/kubelet/juicefs-mount-pod.json: {err}"));
    fixture["items"].as_array().cloned().unwrap_or_default()
}

fn fixture_pod(pods: &[Value], prefix: &str) -> Value {
    pods.iter()
        .find(|pod| pod["metadata"]["name"].as_str().is_some_and(|name| name.starts_with(prefix)))
        .cloned()
        .unwrap_or_else(|| panic!("the fixture has no {prefix}* pod"))
}

/// A `/pods` body (compact, as the kubelet sends it) holding these pods.
pub fn pod_list_body(items: impl IntoIterator<Item = Value>) -> Vec<u8> {
    let items: Vec<Value> = items.into_iter().collect();
    let list = serde_json::json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items});
    // Serializing a Value cannot fail (its map keys are strings).
    serde_json::to_vec(&list).unwrap_or_default()
}

/// A JuiceFS-style mount pod, shaped like the fixture's, whose container
/// `jfs-mount` publishes `host_path` with Bidirectional propagation, on its
/// `instance`-th start (0 = never restarted) since `started_at`. Each
/// instance has its own container ID; after a restart `lastState` holds the
/// previous one, terminated. For end-to-end tests: the owner of a sandbox's
/// global mount, before and after the FUSE daemon restarts.
pub fn fuse_owner_pod(name: &str, uid: &str, host_path: &str, instance: u32, started_at: SystemTime) -> Value {
    let mut pod = fixture_pod(&fixture_pods(), "juicefs-node-a-");
    pod["metadata"]["name"] = Value::from(name);
    pod["metadata"]["uid"] = Value::from(uid);
    if let Some(volume) = pod["spec"]["volumes"].as_array_mut().and_then(|volumes| volumes.first_mut()) {
        volume["hostPath"]["path"] = Value::from(host_path);
    }
    let id = |instance: u32| format!("containerd://{:064x}", u128::from(instance) << 64 | uid_bits(uid));
    let seconds = |at: SystemTime| {
        Timestamp(UNIX_EPOCH + Duration::from_secs(at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())))
    };
    let status = &mut pod["status"]["containerStatuses"][0];
    status["containerID"] = Value::from(id(instance));
    status["restartCount"] = Value::from(instance);
    status["state"] = serde_json::json!({"running": {"startedAt": seconds(started_at).to_string()}});
    status["lastState"] = if instance == 0 {
        serde_json::json!({})
    } else {
        let finished = seconds(started_at.checked_sub(Duration::from_secs(1)).unwrap_or(started_at)).to_string();
        serde_json::json!({"terminated": {"exitCode": 137, "reason": "Error", "startedAt": finished,
            "finishedAt": finished, "containerID": id(instance - 1)}})
    };
    pod
}

/// An application pod shaped like the fixture's `web-*` pod, under this
/// name, namespace and UID.
pub fn app_pod(namespace: &str, name: &str, uid: &str) -> Value {
    let mut pod = fixture_pod(&fixture_pods(), "web-");
    pod["metadata"]["namespace"] = Value::from(namespace);
    pod["metadata"]["name"] = Value::from(name);
    pod["metadata"]["uid"] = Value::from(uid);
    pod
}

/// [`app_pod`] running `containers`, each `(name, runtime ID)`: the
/// kubelet's `containerID` is `containerd://<ID>`, as the container's cgroup
/// names it, so a process in that cgroup maps to this pod and container.
pub fn app_pod_running(namespace: &str, name: &str, uid: &str, containers: &[(&str, &str)]) -> Value {
    let mut pod = app_pod(namespace, name, uid);
    let (spec, status) = (pod["spec"]["containers"][0].clone(), pod["status"]["containerStatuses"][0].clone());
    let specs = containers.iter().map(|(container, _)| {
        let mut spec = spec.clone();
        spec["name"] = Value::from(*container);
        spec
    });
    pod["spec"]["containers"] = Value::Array(specs.collect());
    let statuses = containers.iter().map(|(container, id)| {
        let mut status = status.clone();
        status["name"] = Value::from(*container);
        status["containerID"] = Value::from(format!("containerd://{id}"));
        status
    });
    pod["status"]["containerStatuses"] = Value::Array(statuses.collect());
    pod
}

/// Low bits of a container ID, so that pods with different UIDs differ.
fn uid_bits(uid: &str) -> u128 {
    uid.bytes().fold(0u64, |hash, byte| hash.wrapping_mul(31).wrapping_add(u64::from(byte))).into()
}

/// A `/pods` body for a full node of `pods` pods (the kubelet's default
/// maximum is 110), made from the fixture pods with fresh names, UIDs and
/// container IDs: per 10 pods, one JuiceFS mount pod and nine apps, plus
/// kube-proxy and the CSI node pod.
pub fn full_node_pods(pods: usize) -> Vec<u8> {
    let templates = fixture_pods();
    let (proxy, csi, mount, app) = (
        fixture_pod(&templates, "kube-proxy-"),
        fixture_pod(&templates, "juicefs-csi-node-"),
        fixture_pod(&templates, "juicefs-node-a-"),
        fixture_pod(&templates, "web-"),
    );
    pod_list_body((0..pods).map(|i| {
        let mut pod = match i {
            0 => proxy.clone(),
            1 => csi.clone(),
            _ if i % 10 == 2 => mount.clone(),
            _ => app.clone(),
        };
        if i > 1 {
            let name = pod["metadata"]["name"].as_str().unwrap_or_default().to_string();
            pod["metadata"]["name"] = Value::from(format!("{name}-{i}"));
        }
        pod["metadata"]["uid"] = Value::from(format!("00000000-0000-4000-a000-{i:012x}"));
        let statuses = pod["status"]["containerStatuses"].as_array_mut().map(|s| s.iter_mut());
        for (c, status) in statuses.into_iter().flatten().enumerate() {
            status["containerID"] = Value::from(format!("containerd://{:064x}", i * 16 + c));
        }
        pod
    }))
}
