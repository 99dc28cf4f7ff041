//! A blocking client for the one kubelet call fuse-supervisor makes:
//! `GET https://<node>:10250/pods`.
//!
//! hyper's HTTP/1.1 client over tokio-rustls, on a current-thread runtime
//! made for each call (calls are rare: a restart to confirm, a Job's pods, a
//! pod's name for an Event). Not kube's client: pinning needs a verifier
//! that accepts exactly one serving certificate (kubelets with self-signed
//! certificates are common), which is a rustls `ServerCertVerifier` here
//! ([`super::tls::ExactCert`]), and the kubelet is no API server. One
//! deadline bounds the connect, another the handshake, and a third the
//! whole exchange after it, body included, however slowly its bytes come.
//! rustls runs on the ring provider, which builds without cmake.
use std::collections::BTreeSet;
use std::fmt;
use std::fs;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, CONNECTION, HOST, USER_AGENT};
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use rustls::{CertificateError, ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tracing::{debug, warn};

use super::pods::{ParseError, PodList, SkippedPod};
use super::tls::{ExactCert, read_certs};

/// Where a pod's service-account token is mounted.
pub const DEFAULT_TOKEN_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
/// The kubelet's authenticated HTTPS port.
pub const DEFAULT_PORT: u16 = 10250;
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest `/pods` body accepted: a full node (110 pods) is about 1 MiB.
pub const MAX_BODY: usize = 64 * 1024 * 1024;
/// How much of an error response's body goes into the error message.
const SNIPPET: usize = 200;
/// How much of an error response's body is read, to explain its status.
const ERROR_BODY: usize = 64 * 1024;

#[derive(Clone, Debug)]
pub struct KubeletConfig {
    /// The node's IP or name; the TLS certificate must name it (unless pinned).
    pub host: String,
    pub port: u16,
    /// Bearer token file, re-read on every call; `None` sends no token.
    pub token_file: Option<PathBuf>,
    pub tls: KubeletTls,
    /// Bounds the TCP connect and, again, the TLS handshake.
    pub connect_timeout: Duration,
    /// Bounds the whole exchange after the handshake: request, headers and
    /// the complete body.
    pub read_timeout: Duration,
    pub authz: KubeletAuthz,
}

impl KubeletConfig {
    /// The defaults: port 10250, the pod's service-account token, 2 s to
    /// connect, 5 s for the response, `nodes/pods` authorization.
    pub fn new(host: impl Into<String>, tls: KubeletTls) -> Self {
        Self {
            host: host.into(),
            port: DEFAULT_PORT,
            token_file: Some(PathBuf::from(DEFAULT_TOKEN_FILE)),
            tls,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            read_timeout: DEFAULT_READ_TIMEOUT,
            authz: KubeletAuthz::NodesPods,
        }
    }
}

/// How the kubelet's serving certificate is checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KubeletTls {
    /// PEM file of the CA(s) that sign kubelet serving certificates
    /// (`--kubelet-ca-file`); the certificate must also name the host.
    CaFile(PathBuf),
    /// PEM file whose first certificate is the kubelet's serving certificate:
    /// exactly that certificate is accepted, whatever its names, issuer or
    /// dates (the pin is the trust decision), and the handshake must still
    /// be signed by its key.
    PinnedCertFile(PathBuf),
    /// No verification at all; warns on every client start.
    InsecureSkipVerify,
}

/// Which RBAC rule the service account relies on. The request is the same;
/// this decides what a 403 asks the operator to grant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KubeletAuthz {
    /// `get` on `nodes/pods` (fine-grained kubelet authorization, 1.33+).
    #[default]
    NodesPods,
    /// `get` on `nodes/proxy`: works on older clusters, but also allows exec
    /// into any pod on the node; an explicit opt-in.
    NodesProxy,
}

impl KubeletAuthz {
    fn rule(self) -> &'static str {
        match self {
            Self::NodesPods => {
                "grant `get` on `nodes/pods` to this service account \
                 (needs fine-grained kubelet authorization, Kubernetes 1.33+)"
            }
            Self::NodesProxy => "grant `get` on `nodes/proxy` to this service account",
        }
    }
}

/// The step of a call that ran out of time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeoutPhase {
    Connect,
    Tls,
    Response,
}

impl fmt::Display for TimeoutPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Connect => "accept the connection",
            Self::Tls => "finish the TLS handshake",
            Self::Response => "send the whole /pods response",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("cannot read the kubelet {what} {path}")]
    ReadTrust {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("the kubelet CA file {path} has no usable CA certificate")]
    NoCa { path: PathBuf },
    #[error("kubelet TLS setup failed")]
    TlsSetup(#[source] Box<rustls::Error>),
    #[error("{host:?} is not a valid kubelet host name or IP")]
    BadHost { host: String },
    #[error("cannot resolve the kubelet host {host}: check the node name or pass the node IP")]
    Resolve {
        host: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "cannot connect to the kubelet at {addr}: check the node IP and port, that the kubelet listens there \
         and that no network policy blocks this pod"
    )]
    Connect {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("the kubelet at {addr} did not {phase} within {limit:?}")]
    Timeout { addr: String, phase: TimeoutPhase, limit: Duration },
    #[error("TLS with the kubelet at {addr} failed, verifying against {trust}: {hint}")]
    Tls {
        addr: String,
        trust: String,
        hint: &'static str,
        #[source]
        source: Box<rustls::Error>,
    },
    #[error(
        "the kubelet at {addr} rejected the bearer token{} (401): the token is invalid or expired, \
         or the kubelet does not authenticate service-account tokens (--authentication-token-webhook)",
        token_file.as_ref().map(|file| format!(" from {}", file.display())).unwrap_or_else(|| " (none was sent)".into())
    )]
    Unauthorized { addr: String, token_file: Option<PathBuf> },
    #[error("the kubelet at {addr} forbids reading /pods (403): {} (kubelet said: {body})", authz.rule())]
    Forbidden { addr: String, authz: KubeletAuthz, body: String },
    #[error("the kubelet at {addr} answered /pods with HTTP {code}: {body}")]
    Status { addr: String, code: u16, body: String },
    #[error("the kubelet at {addr} sent a broken HTTP response")]
    Protocol {
        addr: String,
        #[source]
        source: HttpProblem,
    },
    #[error("reading the /pods response from the kubelet at {addr} failed")]
    Read {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("the kubelet at {addr} sent a /pods body that is not a valid PodList")]
    Body {
        addr: String,
        #[source]
        source: ParseError,
    },
    #[error("cannot use the kubelet bearer token file {file}")]
    Token {
        file: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot start the runtime that calls the kubelet")]
    Runtime(#[source] io::Error),
}

/// What was wrong with an HTTP response (opaque; see its message).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct HttpProblem(Problem);

#[derive(Debug, thiserror::Error)]
enum Problem {
    #[error(transparent)]
    Http(hyper::Error),
    /// Also without TLS's close_notify, which the kubelet sends before it
    /// closes: a connection that ends early was dropped.
    #[error("the connection closed before the response was complete")]
    ClosedEarly(#[source] hyper::Error),
    #[error("the body is larger than {limit} bytes")]
    TooLarge { limit: usize },
}

impl KubeletError {
    /// Whether calling again later may succeed without anyone changing the
    /// configuration: network trouble, timeouts, a kubelet restarting
    /// (5xx, 429, a broken response). TLS, 401, 403, a body we cannot read
    /// and token or certificate files are not: they repeat until fixed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Resolve { .. }
            | Self::Connect { .. }
            | Self::Timeout { .. }
            | Self::Protocol { .. }
            | Self::Read { .. }
            | Self::Runtime(_) => true,
            Self::Status { code, .. } => *code >= 500 || *code == 429 || *code == 408,
            Self::ReadTrust { .. }
            | Self::NoCa { .. }
            | Self::TlsSetup(_)
            | Self::BadHost { .. }
            | Self::Tls { .. }
            | Self::Unauthorized { .. }
            | Self::Forbidden { .. }
            | Self::Body { .. }
            | Self::Token { .. } => false,
        }
    }

    /// The HTTP status the kubelet answered with, if it answered: a body
    /// that is not a PodList came with 200. None when no status line came
    /// (no connection, TLS, a timeout, a broken response) or nothing was sent.
    pub fn status_code(&self) -> Option<u16> {
        match self {
            Self::Unauthorized { .. } => Some(401),
            Self::Forbidden { .. } => Some(403),
            Self::Status { code, .. } => Some(*code),
            Self::Body { .. } => Some(200),
            Self::ReadTrust { .. }
            | Self::NoCa { .. }
            | Self::TlsSetup(_)
            | Self::BadHost { .. }
            | Self::Resolve { .. }
            | Self::Connect { .. }
            | Self::Timeout { .. }
            | Self::Tls { .. }
            | Self::Protocol { .. }
            | Self::Read { .. }
            | Self::Token { .. }
            | Self::Runtime(_) => None,
        }
    }
}

/// A client for one kubelet; cheap to call repeatedly, one connection per call.
#[derive(Debug)]
pub struct KubeletClient {
    config: KubeletConfig,
    tls: Arc<ClientConfig>,
    server_name: ServerName<'static>,
    /// `host:port` as written in messages and the `Host` header.
    addr: String,
    /// What the certificate is checked against, for messages.
    trust: String,
    /// The unreadable pods (UID and field) the last call warned about: one
    /// that stays broken is warned about once, not at every call.
    skipped_before: Mutex<BTreeSet<(String, String)>>,
}

impl KubeletClient {
    /// Loads the CA or pinned certificate; the token is read per call.
    pub fn new(config: KubeletConfig) -> Result<Self, KubeletError> {
        let addr = match config.host.parse::<std::net::Ipv6Addr>() {
            Ok(_) => format!("[{}]:{}", config.host, config.port),
            Err(_) => format!("{}:{}", config.host, config.port),
        };
        let server_name = ServerName::try_from(config.host.clone())
            .map_err(|_| KubeletError::BadHost { host: config.host.clone() })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|err| KubeletError::TlsSetup(Box::new(err)))?;
        let (tls, trust) = match &config.tls {
            KubeletTls::CaFile(path) => {
                let mut roots = RootCertStore::empty();
                for cert in read_certs(path, "CA file")? {
                    // Certificates that are not usable trust anchors are
                    // skipped; none at all is an error below.
                    let _ = roots.add(cert);
                }
                if roots.is_empty() {
                    return Err(KubeletError::NoCa { path: path.clone() });
                }
                (builder.with_root_certificates(roots).with_no_client_auth(), format!("the CA in {}", path.display()))
            }
            KubeletTls::PinnedCertFile(path) => {
                let pinned = read_certs(path, "pinned certificate file")?.into_iter().next();
                let verifier = ExactCert { pinned, algorithms: provider.signature_verification_algorithms };
                let trust = format!("the pinned certificate {}", path.display());
                (builder.dangerous().with_custom_certificate_verifier(Arc::new(verifier)).with_no_client_auth(), trust)
            }
            KubeletTls::InsecureSkipVerify => {
                warn!(
                    kubelet = %addr,
                    "kubelet TLS verification is off (insecure skip verify): anyone on the network path \
                     can impersonate the kubelet and decide which heals happen"
                );
                let verifier = ExactCert { pinned: None, algorithms: provider.signature_verification_algorithms };
                let trust = "nothing (verification is off)".to_string();
                (builder.dangerous().with_custom_certificate_verifier(Arc::new(verifier)).with_no_client_auth(), trust)
            }
        };
        Ok(Self { config, tls: Arc::new(tls), server_name, addr, trust, skipped_before: Mutex::default() })
    }

    /// `host:port` of the kubelet.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn config(&self) -> &KubeletConfig {
        &self.config
    }

    /// `GET /pods`: every pod bound to this node, as the kubelet knows it.
    pub fn pods(&self) -> Result<PodList, KubeletError> {
        let token = self.config.token_file.as_deref().map(read_token).transpose()?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(KubeletError::Runtime)?;
        let body = runtime.block_on(self.fetch_pods(token.as_deref()))?;
        let list =
            PodList::from_slice(&body).map_err(|source| KubeletError::Body { addr: self.addr.clone(), source })?;
        self.report_skipped(&list.skipped);
        Ok(list)
    }

    /// Connects, then sends the request and reads the whole answer within
    /// the read timeout.
    async fn fetch_pods(&self, token: Option<&str>) -> Result<Bytes, KubeletError> {
        let stream = self.connect().await?;
        let limit = self.config.read_timeout;
        tokio::time::timeout(limit, self.exchange(stream, token)).await.map_err(|_| KubeletError::Timeout {
            addr: self.addr.clone(),
            phase: TimeoutPhase::Response,
            limit,
        })?
    }

    async fn exchange(&self, stream: TlsStream<TcpStream>, token: Option<&str>) -> Result<Bytes, KubeletError> {
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|err| self.http_error(err))?;
        // Dropped with the runtime when the call ends, whatever state it is in.
        tokio::spawn(connection);
        let mut request = http::Request::get("/pods")
            .header(HOST, &self.addr)
            .header(USER_AGENT, concat!("fuse-supervisor/", env!("CARGO_PKG_VERSION")))
            .header(ACCEPT, "application/json")
            .header(CONNECTION, "close");
        if let Some(token) = token {
            request = request.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        // The host was checked as a server name and the token as printable
        // ASCII: no header value here can be refused.
        let request = request.body(Empty::<Bytes>::new()).map_err(|err| KubeletError::Read {
            addr: self.addr.clone(),
            source: io::Error::new(io::ErrorKind::InvalidInput, err),
        })?;
        let response = sender.send_request(request).await.map_err(|err| self.http_error(err))?;
        let status = response.status().as_u16();
        if status != 200 {
            // The body only explains the status; a broken one does not matter.
            let body = collect(response.into_body(), ERROR_BODY).await.unwrap_or_default();
            return Err(self.status_error(status, &body));
        }
        collect(response.into_body(), MAX_BODY).await.map_err(|err| match err {
            Problem::Http(err) => self.http_error(err),
            problem => KubeletError::Protocol { addr: self.addr.clone(), source: HttpProblem(problem) },
        })
    }

    /// Names the pods the list left out: a warning the first time, debug
    /// while the same pod stays unreadable.
    fn report_skipped(&self, skipped: &[SkippedPod]) {
        let mut before = self.skipped_before.lock().unwrap_or_else(PoisonError::into_inner);
        let mut now = BTreeSet::new();
        for pod in skipped {
            let key = (pod.uid.clone(), pod.field.clone());
            let pod_name = format!("{}/{}", pod.namespace, pod.name);
            if before.contains(&key) {
                debug!(kubelet = %self.addr, pod = %pod_name, uid = %pod.uid, field = %pod.field, "kubelet still lists an unreadable pod; skipped");
            } else {
                warn!(
                    kubelet = %self.addr,
                    pod = %pod_name,
                    uid = %pod.uid,
                    item = pod.index,
                    field = %pod.field,
                    problem = %pod.problem,
                    "kubelet listed a pod that cannot be read; skipped"
                );
            }
            now.insert(key);
        }
        *before = now;
    }

    /// TCP connect and TLS handshake, each within the connect timeout.
    async fn connect(&self) -> Result<TlsStream<TcpStream>, KubeletError> {
        let addrs: Vec<SocketAddr> = (self.config.host.as_str(), self.config.port)
            .to_socket_addrs()
            .map_err(|source| KubeletError::Resolve { host: self.config.host.clone(), source })?
            .collect();
        let limit = self.config.connect_timeout;
        let connected = tokio::time::timeout(limit, async {
            let mut last = io::Error::new(io::ErrorKind::NotFound, "the host resolved to no address");
            for addr in addrs {
                match TcpStream::connect(addr).await {
                    Ok(sock) => return Ok(sock),
                    Err(err) => last = err,
                }
            }
            Err(last)
        })
        .await
        .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()));
        let sock = connected.map_err(|err| self.io_error(err, TimeoutPhase::Connect))?;
        // One small request; do not wait to coalesce it.
        let _ = sock.set_nodelay(true);
        let handshake = TlsConnector::from(self.tls.clone()).connect(self.server_name.clone(), sock);
        match tokio::time::timeout(limit, handshake).await {
            Ok(stream) => stream.map_err(|err| self.io_error(err, TimeoutPhase::Tls)),
            Err(_) => Err(self.io_error(io::ErrorKind::TimedOut.into(), TimeoutPhase::Tls)),
        }
    }

    fn io_error(&self, err: io::Error, phase: TimeoutPhase) -> KubeletError {
        let addr = self.addr.clone();
        if err.kind() == io::ErrorKind::TimedOut {
            let limit =
                if phase == TimeoutPhase::Response { self.config.read_timeout } else { self.config.connect_timeout };
            return KubeletError::Timeout { addr, phase, limit };
        }
        let err = match err.downcast::<rustls::Error>() {
            Ok(source) => {
                let hint = self.tls_hint(&source);
                return KubeletError::Tls { addr, trust: self.trust.clone(), hint, source: Box::new(source) };
            }
            Err(err) => err,
        };
        match phase {
            TimeoutPhase::Connect => KubeletError::Connect { addr, source: err },
            TimeoutPhase::Tls | TimeoutPhase::Response => KubeletError::Read { addr, source: err },
        }
    }

    /// A response cut short or not HTTP as it should be is a protocol
    /// error; another failure of the socket under hyper, a failed read.
    fn http_error(&self, err: hyper::Error) -> KubeletError {
        let addr = self.addr.clone();
        let problem = match io_cause(&err) {
            _ if err.is_incomplete_message() => Problem::ClosedEarly(err),
            Some(io::ErrorKind::UnexpectedEof) => Problem::ClosedEarly(err),
            Some(kind) => return KubeletError::Read { addr, source: io::Error::new(kind, err) },
            None => Problem::Http(err),
        };
        KubeletError::Protocol { addr, source: HttpProblem(problem) }
    }

    fn status_error(&self, code: u16, body: &[u8]) -> KubeletError {
        let addr = self.addr.clone();
        let body = snippet(body);
        match code {
            401 => KubeletError::Unauthorized { addr, token_file: self.config.token_file.clone() },
            403 => KubeletError::Forbidden { addr, authz: self.config.authz, body },
            _ => KubeletError::Status { addr, code, body },
        }
    }

    fn tls_hint(&self, err: &rustls::Error) -> &'static str {
        let rustls::Error::InvalidCertificate(cert) = err else {
            return "the handshake failed; is this the kubelet's HTTPS port?";
        };
        match (cert, &self.config.tls) {
            (CertificateError::ApplicationVerificationFailure, KubeletTls::PinnedCertFile(_)) => {
                "the kubelet presented a different certificate; pin its current serving certificate \
                 (it changes when the kubelet rotates it)"
            }
            (CertificateError::BadSignature, KubeletTls::CaFile(_)) => {
                "the serving certificate is not signed by that CA (a CA of the same name but another key); \
                 give the CA that signs kubelet serving certificates, or pin the serving certificate"
            }
            (CertificateError::UnknownIssuer, _) => {
                "the serving certificate is not signed by that CA; give the CA that signs kubelet serving \
                 certificates, or pin the serving certificate"
            }
            (CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. }, _) => {
                "the serving certificate does not name this host; use the node IP or name it was issued for"
            }
            (CertificateError::Expired | CertificateError::ExpiredContext { .. }, _) => {
                "the serving certificate has expired"
            }
            _ => "the serving certificate was rejected",
        }
    }
}

/// The token, trimmed; it must be non-empty and fit in a header.
fn read_token(file: &Path) -> Result<String, KubeletError> {
    let fail = |source| KubeletError::Token { file: file.to_path_buf(), source };
    let token = fs::read_to_string(file).map_err(fail)?;
    let token = token.trim();
    if token.is_empty() {
        return Err(fail(io::Error::new(io::ErrorKind::InvalidData, "the file is empty")));
    }
    if !token.bytes().all(|byte| byte.is_ascii_graphic()) {
        return Err(fail(io::Error::new(io::ErrorKind::InvalidData, "the token has spaces or control characters")));
    }
    Ok(token.to_string())
}

/// The start of an error body, on one line.
fn snippet(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match text.char_indices().nth(SNIPPET) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

/// A whole body, refusing more than `limit` bytes.
async fn collect(body: Incoming, limit: usize) -> Result<Bytes, Problem> {
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) => match err.downcast::<hyper::Error>() {
            Ok(err) => Err(Problem::Http(*err)),
            // Limited's error is the body's (hyper's) or its own limit.
            Err(_) => Err(Problem::TooLarge { limit }),
        },
    }
}

/// The kind of the socket error under a hyper error, if one is.
fn io_cause(err: &hyper::Error) -> Option<io::ErrorKind> {
    std::iter::successors(std::error::Error::source(err), |cause| cause.source())
        .find_map(|cause| cause.downcast_ref::<io::Error>().map(io::Error::kind))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snippets_are_short_and_on_one_line() {
        assert_eq!(snippet(b"Internal\n  Server Error\n"), "Internal Server Error");
        let long = "x".repeat(500);
        assert_eq!(snippet(long.as_bytes()).chars().count(), SNIPPET + 1);
    }

    #[test]
    fn tokens_are_trimmed_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        fs::write(&file, "abc.def\n").unwrap();
        assert_eq!(read_token(&file).unwrap(), "abc.def");
        fs::write(&file, " \n").unwrap();
        let err = read_token(&file).unwrap_err();
        assert!(err.to_string().contains(&file.display().to_string()), "{err}");
        assert!(format!("{:?}", err).contains("empty"));
        fs::write(&file, "abc\r\nX-Evil: 1").unwrap();
        assert!(read_token(&file).is_err());
        assert!(matches!(read_token(&dir.path().join("missing")), Err(KubeletError::Token { .. })));
    }

    #[test]
    fn ipv6_hosts_are_bracketed() {
        let client = KubeletClient::new(KubeletConfig::new("fd00::17", KubeletTls::InsecureSkipVerify)).unwrap();
        assert_eq!(client.addr(), "[fd00::17]:10250");
        assert!(KubeletClient::new(KubeletConfig::new("bad host", KubeletTls::InsecureSkipVerify)).is_err());
    }
}
