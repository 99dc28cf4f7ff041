//! The proxy: a unix socket the kubelet dials instead of the driver's, each
//! call passed to the driver's socket as it came and its answer passed back
//! as it went (status code and message included).
//!
//! gRPC is handled as HTTP/2: a request is read whole (CSI calls are
//! unary), sent on one HTTP/2 connection to the driver (made again when
//! the driver's end closed it), and the driver's answer streamed back,
//! except for the calls the proxy acts on, whose answer it reads whole
//! first: a successful `NodeStageVolume`/`NodePublishVolume` is recorded,
//! and a successful `NodeUnstageVolume`/`NodeUnpublishVolume` removes its
//! record, before the kubelet hears of the success; `GetPluginInfo`
//! answers name the driver in the records. A driver that cannot be reached
//! answers `UNAVAILABLE`, as the kubelet expects of a driver that is down.
//!
//! Logs name calls, volumes, paths and record files: never a request's
//! content nor the driver's error messages, which may quote it.
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_TYPE, HeaderValue, TE};
use http::{HeaderMap, Request, Response, Uri};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message as _;
use tokio::net::{UnixListener, UnixStream};
use tracing::{debug, info, warn};

use super::api;
use super::grpc::{self, Call, code};
use super::records::{self, RecordDir, RecordError};
use crate::errors::chain;

/// The largest request passed on: gRPC's default limit of a received
/// message; a CSI request is a few KiB.
const MAX_REQUEST_BYTES: usize = 4 << 20;

/// A pause after a failed accept (out of descriptors, say), so the loop
/// does not spin while it lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// What `fuse-supervisor csi-proxy` was asked.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// The socket the kubelet dials (the registrar's
    /// `--kubelet-registration-path`).
    pub listen: PathBuf,
    /// The driver's own socket.
    pub driver_socket: PathBuf,
    pub record_dir: PathBuf,
    /// Whether records keep the requests' secrets.
    pub record_secrets: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error(transparent)]
    Records(#[from] RecordError),
    #[error("cannot listen on {socket}")]
    Listen {
        socket: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Why a call could not reach the driver, answered as `UNAVAILABLE`.
#[derive(Debug, thiserror::Error)]
enum DriverError {
    #[error("cannot connect to the driver's socket {socket}: {source}")]
    Connect {
        socket: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the driver's socket {socket} does not speak HTTP/2: {source}")]
    Handshake {
        socket: PathBuf,
        #[source]
        source: hyper::Error,
    },
    #[error("the driver's socket {socket} ended the call: {source}")]
    Call {
        socket: PathBuf,
        #[source]
        source: hyper::Error,
    },
}

type ProxyBody = UnsyncBoxBody<Bytes, hyper::Error>;

/// Serves `config.listen` until `shutdown` completes, then removes the
/// socket. A socket file left there by an earlier run is replaced.
pub async fn serve(config: ProxyConfig, shutdown: impl Future<Output = ()>) -> Result<(), ProxyError> {
    let records = RecordDir::create(&config.record_dir)?;
    let listen_error = |source| ProxyError::Listen { socket: config.listen.clone(), source };
    remove_socket(&config.listen).map_err(listen_error)?;
    let listener = UnixListener::bind(&config.listen).map_err(listen_error)?;
    let proxy = Arc::new(Proxy {
        driver: Arc::new(Driver::new(config.driver_socket.clone())),
        records,
        record_secrets: config.record_secrets,
    });
    info!(
        listen = %config.listen.display(),
        driver_socket = %config.driver_socket.display(),
        record_dir = %config.record_dir.display(),
        record_secrets = config.record_secrets,
        "csi proxy listening"
    );
    tokio::spawn(Arc::clone(&proxy.driver).refresh_name());
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    tokio::spawn(Arc::clone(&proxy).serve_connection(stream));
                }
                Err(err) => {
                    warn!(listen = %config.listen.display(), err = %chain(&err), "accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            },
        }
    }
    info!(listen = %config.listen.display(), "csi proxy stopping");
    remove_socket(&config.listen).map_err(listen_error)
}

fn remove_socket(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
        _ => Ok(()),
    }
}

struct Proxy {
    driver: Arc<Driver>,
    records: RecordDir,
    record_secrets: bool,
}

impl Proxy {
    async fn serve_connection(self: Arc<Self>, stream: UnixStream) {
        let service = hyper::service::service_fn(move |request| Arc::clone(&self).handle(request));
        let connection = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(stream), service);
        if let Err(err) = connection.await {
            debug!(err = %chain(&err), "kubelet connection ended");
        }
    }

    async fn handle(self: Arc<Self>, request: Request<Incoming>) -> Result<Response<ProxyBody>, Infallible> {
        let Some(call) = Call::of_path(request.uri().path()) else {
            debug!(path = request.uri().path(), "not a call of the Identity or Node service");
            let message = "fuse-supervisor csi-proxy passes only the CSI Identity and Node services";
            return Ok(status_response(code::UNIMPLEMENTED, message));
        };
        let (parts, body) = request.into_parts();
        let body = match Limited::new(body, MAX_REQUEST_BYTES).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(err) => {
                debug!(call = call.name(), err = %chain(&*err), "request not read");
                let message = format!("fuse-supervisor csi-proxy takes requests of at most {MAX_REQUEST_BYTES} bytes");
                return Ok(status_response(code::RESOURCE_EXHAUSTED, &message));
            }
        };
        let response = match self.driver.forward(parts, body.clone()).await {
            Ok((response, fresh)) => {
                if fresh {
                    tokio::spawn(Arc::clone(&self.driver).refresh_name());
                }
                response
            }
            Err(err) => {
                warn!(call = call.name(), err = %chain(&err), "driver unavailable");
                return Ok(status_response(code::UNAVAILABLE, &err.to_string()));
            }
        };
        if !call.is_looked_into() {
            return Ok(response.map(BodyExt::boxed_unsync));
        }
        let (parts, answer) = response.into_parts();
        let answer = match Answer::read(answer).await {
            Ok(answer) => answer,
            Err(err) => {
                warn!(call = call.name(), err = %chain(&err), "the driver's answer was cut");
                let message = format!("the driver's socket {} cut its answer", self.driver.socket.display());
                return Ok(status_response(code::UNAVAILABLE, &message));
            }
        };
        match grpc::status_of(&parts.headers, answer.trailers.as_ref()) {
            Some(code::OK) => self.after_success(call, &body, &answer.data).await,
            status => debug!(call = call.name(), ?status, "not a success: nothing recorded"),
        }
        Ok(Response::from_parts(parts, answer.into_body()))
    }

    /// What a successful call changes: the records, the driver's name.
    async fn after_success(&self, call: Call, request: &[u8], answer: &[u8]) {
        match call {
            Call::GetPluginInfo => {
                match message_of(call, answer).and_then(|answer| api::GetPluginInfoResponse::decode(answer).ok()) {
                    Some(info) => self.driver.set_name(info.name),
                    None => warn!(call = call.name(), "answer not a CSI message: driver name unchanged"),
                }
            }
            Call::NodeStageVolume | Call::NodePublishVolume => self.record(call, request).await,
            Call::NodeUnstageVolume | Call::NodeUnpublishVolume => self.unrecord(call, request).await,
            Call::PassedThrough => {}
        }
    }

    async fn record(&self, call: Call, body: &[u8]) {
        let Some(message) = message_of(call, body) else { return };
        let decoded = match call {
            Call::NodeStageVolume => api::NodeStageVolumeRequest::decode(message).map(records::Request::Stage),
            _ => api::NodePublishVolumeRequest::decode(message).map(records::Request::Publish),
        };
        let request = match decoded {
            Ok(request) => request,
            Err(err) => return warn!(call = call.name(), err = %chain(&err), "request not a CSI message: not recorded"),
        };
        let driver = match self.driver.name() {
            Some(name) => Some(name),
            None => Arc::clone(&self.driver).refresh_name().await,
        };
        let (volume_id, path) = (request.volume_id().to_owned(), request.path().to_owned());
        let (records, keep_secrets, bytes) = (self.records.clone(), self.record_secrets, message.to_vec());
        let written =
            tokio::task::spawn_blocking(move || records.write(driver.as_deref(), request, &bytes, keep_secrets));
        match written.await {
            Ok(Ok(file)) => info!(call = call.name(), volume_id, path, file = %file.display(), "recorded"),
            Ok(Err(err)) => warn!(call = call.name(), volume_id, path, err = %chain(&err), "not recorded"),
            Err(err) => warn!(call = call.name(), volume_id, path, err = %chain(&err), "the record's writer failed"),
        }
    }

    async fn unrecord(&self, call: Call, body: &[u8]) {
        let Some(message) = message_of(call, body) else { return };
        let decoded = match call {
            Call::NodeUnstageVolume => api::NodeUnstageVolumeRequest::decode(message)
                .map(|request| (records::Call::NodeStageVolume, request.volume_id, request.staging_target_path)),
            _ => api::NodeUnpublishVolumeRequest::decode(message)
                .map(|request| (records::Call::NodePublishVolume, request.volume_id, request.target_path)),
        };
        let (recorded, volume_id, path) = match decoded {
            Ok(key) => key,
            Err(err) => {
                return warn!(call = call.name(), err = %chain(&err), "request not a CSI message: records unchanged");
            }
        };
        let (records, id, at) = (self.records.clone(), volume_id.clone(), path.clone());
        match tokio::task::spawn_blocking(move || records.remove(recorded, &id, &at)).await {
            Ok(Ok(true)) => info!(call = call.name(), volume_id, path, "record removed"),
            Ok(Ok(false)) => debug!(call = call.name(), volume_id, path, "no record to remove"),
            Ok(Err(err)) => warn!(call = call.name(), volume_id, path, err = %chain(&err), "record not removed"),
            Err(err) => warn!(call = call.name(), volume_id, path, err = %chain(&err), "the record's remover failed"),
        }
    }
}

/// The message of a unary body, or None (logged) if it is not one plain
/// message.
fn message_of(call: Call, body: &[u8]) -> Option<&[u8]> {
    grpc::unframe(body).map_err(|err| warn!(call = call.name(), err = %chain(&err), "not a plain gRPC message")).ok()
}

/// A trailers-only answer: the status in the headers, no body.
fn status_response(code: i32, message: &str) -> Response<ProxyBody> {
    let mut response = Response::new(Empty::new().map_err(|never| match never {}).boxed_unsync());
    *response.headers_mut() = grpc::status_headers(code, message);
    response
}

/// An answer read whole: its data and its trailers.
struct Answer {
    data: Bytes,
    trailers: Option<HeaderMap>,
}

impl Answer {
    async fn read(mut body: Incoming) -> Result<Answer, hyper::Error> {
        let (mut data, mut trailers) = (BytesMut::new(), None);
        while let Some(frame) = body.frame().await {
            match frame?.into_data() {
                Ok(chunk) => data.extend_from_slice(&chunk),
                Err(frame) => trailers = frame.into_trailers().ok().or(trailers),
            }
        }
        Ok(Answer { data: data.freeze(), trailers })
    }

    /// The same answer as a body to pass on.
    fn into_body(self) -> ProxyBody {
        let mut frames = vec![Ok(Frame::data(self.data))];
        frames.extend(self.trailers.map(|trailers| Ok(Frame::trailers(trailers))));
        StreamBody::new(futures::stream::iter(frames)).boxed_unsync()
    }
}

/// The driver's socket: one HTTP/2 connection, made again once closed,
/// and the name the driver last gave.
struct Driver {
    socket: PathBuf,
    connection: tokio::sync::Mutex<Option<SendRequest<Full<Bytes>>>>,
    name: Mutex<Option<String>>,
}

impl Driver {
    fn new(socket: PathBuf) -> Driver {
        Driver { socket, connection: tokio::sync::Mutex::new(None), name: Mutex::new(None) }
    }

    fn name(&self) -> Option<String> {
        self.name.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn set_name(&self, name: String) {
        let mut known = self.name.lock().unwrap_or_else(PoisonError::into_inner);
        if known.as_deref() != Some(name.as_str()) {
            info!(driver = name, "driver named");
            *known = Some(name);
        }
    }

    /// Sends `parts` with `body` to the driver, on a new connection if the
    /// last one closed; true with the answer when the connection is new
    /// (the caller then asks the driver's name again: it may be another
    /// driver's now).
    async fn forward(
        &self,
        mut parts: http::request::Parts,
        body: Bytes,
    ) -> Result<(Response<Incoming>, bool), DriverError> {
        let (mut sender, fresh) = self.sender().await?;
        if parts.uri.scheme().is_none() || parts.uri.authority().is_none() {
            parts.uri = driver_uri(parts.uri.path());
        }
        let request = Request::from_parts(parts, Full::new(body));
        let answer = sender.send_request(request).await;
        let answer = answer.map_err(|source| DriverError::Call { socket: self.socket.clone(), source })?;
        Ok((answer, fresh))
    }

    async fn sender(&self) -> Result<(SendRequest<Full<Bytes>>, bool), DriverError> {
        let mut connection = self.connection.lock().await;
        if let Some(sender) = connection.as_mut()
            && sender.ready().await.is_ok()
        {
            return Ok((sender.clone(), false));
        }
        *connection = None;
        let stream = UnixStream::connect(&self.socket)
            .await
            .map_err(|source| DriverError::Connect { socket: self.socket.clone(), source })?;
        let (sender, driving) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .map_err(|source| DriverError::Handshake { socket: self.socket.clone(), source })?;
        let socket = self.socket.clone();
        tokio::spawn(async move {
            if let Err(err) = driving.await {
                debug!(driver_socket = %socket.display(), err = %chain(&err), "driver connection ended");
            }
        });
        *connection = Some(sender.clone());
        Ok((sender, true))
    }

    /// Asks the driver's name (`GetPluginInfo`) and keeps it; None (logged)
    /// if the driver does not answer.
    async fn refresh_name(self: Arc<Self>) -> Option<String> {
        let mut request = Request::post(driver_uri("/csi.v1.Identity/GetPluginInfo")).body(()).ok()?;
        request.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        request.headers_mut().insert(TE, HeaderValue::from_static("trailers"));
        let (parts, ()) = request.into_parts();
        let body = grpc::frame(&api::GetPluginInfoRequest {});
        let asked = async {
            let (answer, _) = self.forward(parts, body).await?;
            let (parts, answer) = answer.into_parts();
            let answer = Answer::read(answer)
                .await
                .map_err(|source| DriverError::Call { socket: self.socket.clone(), source })?;
            Ok::<_, DriverError>((grpc::status_of(&parts.headers, answer.trailers.as_ref()), answer.data))
        };
        let name = match asked.await {
            Ok((Some(code::OK), data)) => grpc::unframe(&data)
                .ok()
                .and_then(|message| api::GetPluginInfoResponse::decode(message).ok())
                .map(|info| info.name),
            Ok((status, _)) => {
                warn!(driver_socket = %self.socket.display(), ?status, "GetPluginInfo refused");
                None
            }
            Err(err) => {
                warn!(driver_socket = %self.socket.display(), err = %chain(&err), "GetPluginInfo not answered");
                None
            }
        };
        if let Some(name) = &name {
            self.set_name(name.clone());
        }
        name
    }
}

/// The URI of a call to the driver: gRPC on a unix socket names the host
/// `localhost`.
fn driver_uri(path: &str) -> Uri {
    Uri::builder()
        .scheme("http")
        .authority("localhost")
        .path_and_query(path)
        .build()
        .unwrap_or_else(|_| Uri::from_static("http://localhost/"))
}
