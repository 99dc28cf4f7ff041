//! gRPC's wire format, as far as the proxy reads it: which CSI call a
//! request path names, a unary message in its length-prefixed frame, and a
//! call's status in `grpc-status` (trailers, or the headers of a
//! trailers-only answer).
use bytes::{BufMut, Bytes, BytesMut};
use http::HeaderMap;
use http::header::{CONTENT_TYPE, HeaderValue};

/// The status codes the proxy answers or looks for itself.
pub mod code {
    pub const OK: i32 = 0;
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    pub const UNIMPLEMENTED: i32 = 12;
    pub const UNAVAILABLE: i32 = 14;
}

const IDENTITY: &str = "/csi.v1.Identity/";
const NODE: &str = "/csi.v1.Node/";

/// The calls the proxy looks into; every other call of the Identity and
/// Node services is [`Call::PassedThrough`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    GetPluginInfo,
    NodeStageVolume,
    NodeUnstageVolume,
    NodePublishVolume,
    NodeUnpublishVolume,
    PassedThrough,
}

impl Call {
    /// The call a request path names, or None for a path outside the
    /// Identity and Node services (the Controller's, say), which a node
    /// plugin's socket is not asked for by the kubelet.
    pub fn of_path(path: &str) -> Option<Call> {
        let method = path.strip_prefix(IDENTITY).or_else(|| path.strip_prefix(NODE))?;
        Some(match (path.starts_with(NODE), method) {
            (false, "GetPluginInfo") => Call::GetPluginInfo,
            (true, "NodeStageVolume") => Call::NodeStageVolume,
            (true, "NodeUnstageVolume") => Call::NodeUnstageVolume,
            (true, "NodePublishVolume") => Call::NodePublishVolume,
            (true, "NodeUnpublishVolume") => Call::NodeUnpublishVolume,
            _ => Call::PassedThrough,
        })
    }

    /// Whether the proxy acts on the call's answer (so reads it whole
    /// before passing it on).
    pub fn is_looked_into(self) -> bool {
        self != Call::PassedThrough
    }

    pub fn name(self) -> &'static str {
        match self {
            Call::GetPluginInfo => "GetPluginInfo",
            Call::NodeStageVolume => "NodeStageVolume",
            Call::NodeUnstageVolume => "NodeUnstageVolume",
            Call::NodePublishVolume => "NodePublishVolume",
            Call::NodeUnpublishVolume => "NodeUnpublishVolume",
            Call::PassedThrough => "other",
        }
    }
}

/// Why a body is not one plain message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("the body is {0} bytes, shorter than a message's 5-byte prefix")]
    Short(usize),
    #[error("the message is compressed")]
    Compressed,
    #[error("the prefix declares {declared} bytes, the body holds {held}")]
    Length { declared: usize, held: usize },
}

/// The 5-byte prefix of an uncompressed message: flag 0, then its length
/// in big-endian.
pub fn frame(message: &impl prost::Message) -> Bytes {
    let length = message.encoded_len();
    let mut framed = BytesMut::with_capacity(5 + length);
    framed.put_u8(0);
    // A message over 4 GiB cannot be sent: gRPC's own limit is far lower.
    framed.put_u32(u32::try_from(length).unwrap_or(u32::MAX));
    message.encode_raw(&mut framed);
    framed.freeze()
}

/// The message of a unary call's body: exactly one uncompressed frame.
pub fn unframe(body: &[u8]) -> Result<&[u8], FrameError> {
    let (prefix, message) = body.split_at_checked(5).ok_or(FrameError::Short(body.len()))?;
    if prefix[0] != 0 {
        return Err(FrameError::Compressed);
    }
    let declared = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if declared != message.len() {
        return Err(FrameError::Length { declared, held: message.len() });
    }
    Ok(message)
}

/// The call's status code: `grpc-status` of the trailers, or of the
/// headers (a trailers-only answer); None if neither has one.
pub fn status_of(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<i32> {
    let value = trailers.and_then(|trailers| trailers.get("grpc-status")).or_else(|| headers.get("grpc-status"))?;
    value.to_str().ok()?.parse().ok()
}

/// The headers of a trailers-only answer with `code` and `message`.
pub fn status_headers(code: i32, message: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert("grpc-status", HeaderValue::from(code));
    // Percent-encoded, as the protocol asks: always a valid header value.
    if let Ok(message) = HeaderValue::from_str(&percent_encode(message)) {
        headers.insert("grpc-message", message);
    }
    headers
}

/// gRPC's percent-encoding of `grpc-message`: every byte outside
/// printable ASCII, and `%` itself.
fn percent_encode(text: &str) -> String {
    let mut encoded = String::with_capacity(text.len());
    for byte in text.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csi::api;

    #[test]
    fn a_framed_message_unframes_to_its_encoding() {
        let request = api::NodeUnstageVolumeRequest { volume_id: "v".into(), staging_target_path: "/s".into() };
        let framed = frame(&request);
        assert_eq!(unframe(&framed).unwrap(), prost::Message::encode_to_vec(&request).as_slice());
        assert_eq!(unframe(&framed[..3]), Err(FrameError::Short(3)));
        assert_eq!(unframe(&framed[..framed.len() - 1]), Err(FrameError::Length { declared: 7, held: 6 }));
        let mut compressed = framed.to_vec();
        compressed[0] = 1;
        assert_eq!(unframe(&compressed), Err(FrameError::Compressed));
    }

    #[test]
    fn paths_name_the_calls_of_the_identity_and_node_services_only() {
        assert_eq!(Call::of_path("/csi.v1.Node/NodeStageVolume"), Some(Call::NodeStageVolume));
        assert_eq!(Call::of_path("/csi.v1.Identity/GetPluginInfo"), Some(Call::GetPluginInfo));
        assert_eq!(Call::of_path("/csi.v1.Node/NodeGetCapabilities"), Some(Call::PassedThrough));
        assert_eq!(Call::of_path("/csi.v1.Identity/NodeStageVolume"), Some(Call::PassedThrough));
        assert_eq!(Call::of_path("/csi.v1.Controller/CreateVolume"), None);
    }

    #[test]
    fn the_status_is_read_from_trailers_first_and_messages_are_percent_encoded() {
        let headers = status_headers(code::UNAVAILABLE, "driver at 100% é");
        assert_eq!(headers["grpc-message"], "driver at 100%25 %C3%A9");
        assert_eq!(status_of(&headers, None), Some(code::UNAVAILABLE));
        let trailers = status_headers(code::OK, "");
        assert_eq!(status_of(&headers, Some(&trailers)), Some(code::OK));
        assert_eq!(status_of(&HeaderMap::new(), None), None);
    }
}
