//! The response half of one HTTP/1.1 exchange: status line and headers, then
//! a body framed by `Content-Length`, by chunks (what Go's net/http sends
//! for a large body of unknown length) or by the end of the connection.
use std::io::{self, BufRead, Read};

/// Longest header block accepted; the kubelet's is a few hundred bytes.
const MAX_HEAD: u64 = 64 * 1024;
/// Longest chunk-size or trailer line.
const MAX_LINE: u64 = 4 * 1024;
const MAX_HEADERS: usize = 64;

#[derive(Debug, thiserror::Error)]
pub(super) enum HttpError {
    #[error("i/o error")]
    Io(#[source] io::Error),
    #[error("the connection closed before the response headers were complete")]
    ClosedEarly,
    #[error("the connection closed before the body was complete")]
    Truncated,
    #[error("malformed response: {0}")]
    Malformed(String),
    #[error("the body is larger than {limit} bytes")]
    TooLarge { limit: usize },
}

impl From<io::Error> for HttpError {
    fn from(err: io::Error) -> Self {
        if err.kind() == io::ErrorKind::UnexpectedEof { Self::Truncated } else { Self::Io(err) }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Framing {
    Length(u64),
    Chunked,
    UntilClose,
}

#[derive(Debug, PartialEq, Eq)]
pub(super) struct Head {
    pub status: u16,
    pub framing: Framing,
}

/// Reads the status line and headers.
pub(super) fn read_head(reader: &mut impl BufRead) -> Result<Head, HttpError> {
    let mut head = Vec::with_capacity(512);
    loop {
        let start = head.len();
        let n = reader.by_ref().take(MAX_HEAD + 1 - head.len() as u64).read_until(b'\n', &mut head)?;
        if head.len() as u64 > MAX_HEAD {
            return Err(HttpError::Malformed(format!("headers longer than {MAX_HEAD} bytes")));
        }
        if n == 0 {
            return Err(HttpError::ClosedEarly);
        }
        let line = &head[start..];
        if line == b"\r\n" || line == b"\n" {
            break;
        }
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    match response.parse(&head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(HttpError::Malformed("incomplete header block".into())),
        Err(err) => return Err(HttpError::Malformed(err.to_string())),
    }
    let status = response.code.ok_or_else(|| HttpError::Malformed("no status code".into()))?;
    // httparse takes any three digits; `020` would pass for a status 20.
    if !(100..=599).contains(&status) {
        return Err(HttpError::Malformed(format!("status code {status:03} is not an HTTP status (100-599)")));
    }

    let mut framing = Framing::UntilClose;
    for header in response.headers.iter() {
        let value = std::str::from_utf8(header.value).map_err(|_| HttpError::Malformed("header not UTF-8".into()))?;
        if header.name.eq_ignore_ascii_case("transfer-encoding") {
            // Chunked, if used, is always the last coding (RFC 9112 6.1).
            if value.rsplit(',').next().is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked")) {
                framing = Framing::Chunked;
            } else {
                return Err(HttpError::Malformed(format!("unsupported transfer-encoding {value:?}")));
            }
        } else if header.name.eq_ignore_ascii_case("content-length") && framing != Framing::Chunked {
            let length =
                value.trim().parse().map_err(|_| HttpError::Malformed(format!("bad content-length {value:?}")))?;
            framing = Framing::Length(length);
        }
    }
    Ok(Head { status, framing })
}

/// Reads the body, refusing more than `limit` bytes.
pub(super) fn read_body(reader: &mut impl BufRead, framing: Framing, limit: usize) -> Result<Vec<u8>, HttpError> {
    let too_large = HttpError::TooLarge { limit };
    match framing {
        Framing::Length(length) => {
            let length = usize::try_from(length).ok().filter(|&length| length <= limit).ok_or(too_large)?;
            let mut body = vec![0; length];
            reader.read_exact(&mut body)?;
            Ok(body)
        }
        Framing::UntilClose => {
            let mut body = Vec::new();
            reader.take(limit as u64 + 1).read_to_end(&mut body)?;
            if body.len() > limit { Err(too_large) } else { Ok(body) }
        }
        Framing::Chunked => {
            let mut body = Vec::new();
            loop {
                let line = read_line(reader)?;
                let size = line.split(';').next().unwrap_or_default().trim();
                let size = u64::from_str_radix(size, 16)
                    .map_err(|_| HttpError::Malformed(format!("bad chunk size {size:?}")))?;
                if size == 0 {
                    // Trailers, then the empty line that ends the message.
                    while !read_line(reader)?.is_empty() {}
                    return Ok(body);
                }
                if size > (limit - body.len()) as u64 {
                    return Err(too_large);
                }
                let before = body.len();
                reader.take(size).read_to_end(&mut body)?;
                if ((body.len() - before) as u64) < size {
                    return Err(HttpError::Truncated);
                }
                if !read_line(reader)?.is_empty() {
                    return Err(HttpError::Malformed("chunk longer than its size".into()));
                }
            }
        }
    }
}

/// One CRLF-terminated line without its terminator.
fn read_line(reader: &mut impl BufRead) -> Result<String, HttpError> {
    let mut line = Vec::new();
    reader.take(MAX_LINE).read_until(b'\n', &mut line)?;
    if line.last() != Some(&b'\n') {
        return Err(if line.len() as u64 >= MAX_LINE {
            HttpError::Malformed("chunk line too long".into())
        } else {
            HttpError::Truncated
        });
    }
    line.pop();
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    String::from_utf8(line).map_err(|_| HttpError::Malformed("chunk line not UTF-8".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exchange(raw: &[u8], limit: usize) -> Result<(u16, Vec<u8>), HttpError> {
        let mut reader = raw;
        let head = read_head(&mut reader)?;
        Ok((head.status, read_body(&mut reader, head.framing, limit)?))
    }

    #[test]
    fn content_length_body() {
        let raw = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(exchange(raw, 100).unwrap(), (200, b"hello".to_vec()));
        let short = b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nhello";
        assert!(matches!(exchange(short, 100), Err(HttpError::Truncated)));
        assert!(matches!(exchange(raw, 4), Err(HttpError::TooLarge { limit: 4 })));
    }

    #[test]
    fn chunked_body_like_go_writes_it() {
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nWiki\r\n6;ext=1\r\npedia \r\nE\r\nin \r\n\r\nchunks.\r\n0\r\nX-Trailer: 1\r\n\r\n";
        assert_eq!(exchange(raw, 100).unwrap().1, b"Wikipedia in \r\n\r\nchunks.".to_vec());
        assert!(matches!(exchange(raw, 10), Err(HttpError::TooLarge { .. })));
        let cut = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nWi";
        assert!(matches!(exchange(cut, 100), Err(HttpError::Truncated)));
        let bad = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n";
        assert!(matches!(exchange(bad, 100), Err(HttpError::Malformed(_))));
    }

    #[test]
    fn body_until_close_and_bad_heads() {
        assert_eq!(exchange(b"HTTP/1.1 500 Internal Server Error\r\n\r\noops", 100).unwrap(), (500, b"oops".to_vec()));
        assert!(matches!(exchange(b"", 100), Err(HttpError::ClosedEarly)));
        assert!(matches!(exchange(b"HTTP/1.1 200 OK\r\nContent-Len", 100), Err(HttpError::ClosedEarly)));
        assert!(matches!(exchange(b"SSH-2.0-OpenSSH\r\n\r\n", 100), Err(HttpError::Malformed(_))));
        let Err(HttpError::Malformed(status)) = exchange(b"HTTP/1.1 020 OK\r\nContent-Length: 0\r\n\r\n", 100) else {
            panic!("a status of 20 read");
        };
        assert_eq!(status, "status code 020 is not an HTTP status (100-599)");
        let gzip = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n";
        assert!(matches!(exchange(gzip, 100), Err(HttpError::Malformed(_))));
    }

    /// `body` framed each way the kubelet may frame it, in random pieces
    /// for chunks.
    fn framings(body: &[u8]) -> [Vec<u8>; 3] {
        let mut length = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len()).into_bytes();
        length.extend_from_slice(body);
        let mut chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        for (index, piece) in body.chunks(1 + body.len() % 7).enumerate() {
            chunked.extend_from_slice(
                format!("{:x}{}\r\n", piece.len(), if index % 2 == 1 { ";x=y" } else { "" }).as_bytes(),
            );
            chunked.extend_from_slice(piece);
            chunked.extend_from_slice(b"\r\n");
        }
        chunked.extend_from_slice(b"0\r\n\r\n");
        let mut until_close = b"HTTP/1.1 200 OK\r\n\r\n".to_vec();
        until_close.extend_from_slice(body);
        [length, chunked, until_close]
    }

    /// The framing fuzzed (see `testbed::fuzz`; `tests/fuzz.rs` has the
    /// other parsers): nothing panics or reads past its limit, and a body
    /// that reads, framed anew any way, reads back the same.
    #[test]
    fn fuzz_http_response_framing() {
        const LIMIT: usize = 4096;
        let corpus = [
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\nhello".to_vec(),
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nWiki\r\n6;ext=1\r\npedia \r\n0\r\nX-Trailer: 1\r\n\r\n".to_vec(),
            b"HTTP/1.1 500 Internal Server Error\r\nConnection: close\r\n\r\n{\"kind\":\"Status\"}".to_vec(),
            b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n".to_vec(),
        ];
        let dictionary = [
            "\r\n",
            "Content-Length: ",
            "Transfer-Encoding: ",
            "chunked",
            "gzip, chunked",
            "ffffffffffffffff",
            ";",
            "0\r\n\r\n",
            "HTTP/1.1 ",
        ];
        let repo = crate::testbed::fuzz::repo();
        crate::testbed::fuzz::Fuzzer::new("http-framing", &repo).corpus(corpus).dictionary(dictionary).run(|raw| {
            let Ok((status, body)) = exchange(raw, LIMIT) else { return };
            assert!((100..=599).contains(&status) && body.len() <= LIMIT, "{status}, {} bytes", body.len());
            for framed in framings(&body) {
                assert_eq!(exchange(&framed, LIMIT).unwrap(), (200, body.clone()));
            }
        });
    }
}
