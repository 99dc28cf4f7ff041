//! One unary gRPC call to a driver's socket, as the agent makes its own
//! (`Probe`, the re-staging `NodeStageVolume`): a new HTTP/2 connection per
//! call, the whole call under one deadline, and the request sent as the
//! bytes given (a recorded request is replayed exactly, fields this
//! version does not know included).
//!
//! Errors carry the status code only: a driver's `grpc-message` may quote
//! the request, secrets included.
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::{BufMut as _, Bytes, BytesMut};
use http::header::{CONTENT_TYPE, HeaderValue, TE};
use http::{Request, Uri};
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::UnixStream;
use tracing::debug;

use super::grpc::{self, FrameError, code};
use crate::errors::chain;

/// Why a call got no successful answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("cannot connect to the driver's socket {socket}")]
    Connect {
        socket: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the driver's socket {socket} does not speak HTTP/2")]
    Handshake {
        socket: PathBuf,
        #[source]
        source: hyper::Error,
    },
    #[error("the driver's socket {socket} ended the call {method}")]
    Call {
        socket: PathBuf,
        method: &'static str,
        #[source]
        source: hyper::Error,
    },
    #[error("the driver did not answer {method} within {deadline:?}")]
    Deadline { method: &'static str, deadline: Duration },
    #[error("the driver answered {method} with status {} ({code})", code_name(*.code))]
    Status { method: &'static str, code: i32 },
    #[error("the driver's answer to {method} has no status")]
    NoStatus { method: &'static str },
    #[error("the driver's answer to {method} is not one message")]
    Frame {
        method: &'static str,
        #[source]
        source: FrameError,
    },
}

impl CallError {
    /// The gRPC status code the driver answered, if it answered one.
    pub fn code(&self) -> Option<i32> {
        match self {
            CallError::Status { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether the driver could not be reached at all (down, or not
    /// listening yet), rather than reached and refusing.
    pub fn unreachable(&self) -> bool {
        matches!(self, CallError::Connect { .. } | CallError::Handshake { .. })
            || self.code() == Some(code::UNAVAILABLE)
    }
}

/// The name gRPC gives a status code.
pub fn code_name(code: i32) -> &'static str {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    usize::try_from(code).ok().and_then(|index| NAMES.get(index).copied()).unwrap_or("UNKNOWN_CODE")
}

/// Calls `method` (`/csi.v1.Node/NodeStageVolume`) on the driver at
/// `socket` with `message` (a request's protobuf encoding) and returns the
/// answer's message, all within `deadline`.
pub async fn call(socket: &Path, method: &'static str, message: &[u8], deadline: Duration) -> Result<Bytes, CallError> {
    match tokio::time::timeout(deadline, call_unbounded(socket, method, message)).await {
        Ok(answered) => answered,
        Err(_) => Err(CallError::Deadline { method, deadline }),
    }
}

async fn call_unbounded(socket: &Path, method: &'static str, message: &[u8]) -> Result<Bytes, CallError> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|source| CallError::Connect { socket: socket.to_path_buf(), source })?;
    let (mut sender, driving) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .map_err(|source| CallError::Handshake { socket: socket.to_path_buf(), source })?;
    // The connection ends with the call: dropped with this future at the
    // deadline, or closed once the sender is.
    let connection = tokio::spawn(async move {
        if let Err(err) = driving.await {
            debug!(err = %chain(&err), "driver connection ended");
        }
    });
    let answered = async {
        let failed = |source| CallError::Call { socket: socket.to_path_buf(), method, source };
        let mut framed = BytesMut::with_capacity(5 + message.len());
        framed.put_u8(0);
        // A CSI request is a few KiB; gRPC's own limit is far under 4 GiB.
        framed.put_u32(u32::try_from(message.len()).unwrap_or(u32::MAX));
        framed.put_slice(message);
        let uri = Uri::builder()
            .scheme("http")
            .authority("localhost")
            .path_and_query(method)
            .build()
            .unwrap_or_else(|_| Uri::from_static("http://localhost/"));
        let mut request = Request::post(uri).body(Full::new(framed.freeze())).unwrap_or_default();
        request.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        request.headers_mut().insert(TE, HeaderValue::from_static("trailers"));
        let answer = sender.send_request(request).await.map_err(failed)?;
        let (parts, body) = answer.into_parts();
        let collected = body.collect().await.map_err(failed)?;
        let trailers = collected.trailers().cloned();
        let data = collected.to_bytes();
        match grpc::status_of(&parts.headers, trailers.as_ref()) {
            Some(code::OK) => {
                let message = grpc::unframe(&data).map_err(|source| CallError::Frame { method, source })?;
                Ok(Bytes::copy_from_slice(message))
            }
            Some(code) => Err(CallError::Status { method, code }),
            None => Err(CallError::NoStatus { method }),
        }
    };
    let answered = answered.await;
    connection.abort();
    answered
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_named_and_unknown_ones_say_so() {
        assert_eq!(code_name(code::UNAVAILABLE), "UNAVAILABLE");
        assert_eq!(code_name(16), "UNAUTHENTICATED");
        assert_eq!(code_name(42), "UNKNOWN_CODE");
        assert_eq!(code_name(-1), "UNKNOWN_CODE");
        let error = CallError::Status { method: "/csi.v1.Node/NodeStageVolume", code: 3 };
        assert_eq!(
            error.to_string(),
            "the driver answered /csi.v1.Node/NodeStageVolume with status INVALID_ARGUMENT (3)"
        );
        assert!(!error.unreachable());
    }
}
