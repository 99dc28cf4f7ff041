//! The response half of one HTTP/1.1 exchange: status line and headers, then
//! a body framed by `Content-Length`, by chunks (what Go's net/http sends
//! for a large body of unknown length) or by the end of the connection.
use std::io::{self, BufRead, Read};

/// Longest header block accepted; the kubelet's is a few hundred bytes.
const MAX_HEAD: u64 = 64 * 1024;
/// Longest chunk-size or trailer line.
const MAX_LINE: u64 = 4 * 1024;
const MAX_HEADERS: usize = 64;

/// A response that broke off or is not HTTP/1.1 as the kubelet speaks it;
/// `at` is the byte offset in the response (from its first byte) where
/// the framing broke.
#[derive(Debug, thiserror::Error)]
pub(super) enum HttpError {
    #[error("i/o error")]
    Io(#[from] io::Error),
    #[error("the connection closed at byte {at}, before the response headers were complete")]
    ClosedEarly { at: u64 },
    #[error("the connection closed at byte {at}, before the body was complete")]
    Truncated { at: u64 },
    #[error("malformed response at byte {at}: {problem}")]
    Malformed { at: u64, problem: String },
    #[error("the body is larger than {limit} bytes (at byte {at})")]
    TooLarge { at: u64, limit: usize },
}

fn malformed(at: impl TryInto<u64>, problem: impl Into<String>) -> HttpError {
    HttpError::Malformed { at: at.try_into().unwrap_or(u64::MAX), problem: problem.into() }
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
    /// The head's length: the body's offset in the response.
    pub length: u64,
}

/// Reads the status line and headers.
pub(super) fn read_head(reader: &mut impl BufRead) -> Result<Head, HttpError> {
    let mut head = Vec::with_capacity(512);
    loop {
        let start = head.len();
        let n = reader.by_ref().take(MAX_HEAD + 1 - head.len() as u64).read_until(b'\n', &mut head)?;
        if head.len() as u64 > MAX_HEAD {
            return Err(malformed(MAX_HEAD, format!("headers longer than {MAX_HEAD} bytes")));
        }
        if n == 0 {
            return Err(HttpError::ClosedEarly { at: head.len() as u64 });
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
        Ok(httparse::Status::Partial) => return Err(malformed(head.len(), "incomplete header block")),
        Err(err) => return Err(malformed(broken_line(&head), err.to_string())),
    }
    let status = response.code.ok_or_else(|| malformed(0, "no status code"))?;
    // httparse takes any three digits; `020` would pass for a status 20.
    if !(100..=599).contains(&status) {
        let at = head.iter().position(|&byte| byte == b' ').map_or(0, |space| space + 1);
        return Err(malformed(at, format!("status code {status:03} is not an HTTP status (100-599)")));
    }

    let mut framing = Framing::UntilClose;
    for header in response.headers.iter() {
        // Where the value is in the head, for errors.
        let at = (header.value.as_ptr() as usize).saturating_sub(head.as_ptr() as usize);
        let value = std::str::from_utf8(header.value).map_err(|_| malformed(at, "header not UTF-8"))?;
        if header.name.eq_ignore_ascii_case("transfer-encoding") {
            // Chunked, if used, is always the last coding (RFC 9112 6.1).
            if value.rsplit(',').next().is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked")) {
                framing = Framing::Chunked;
            } else {
                return Err(malformed(at, format!("unsupported transfer-encoding {value:?}")));
            }
        } else if header.name.eq_ignore_ascii_case("content-length") && framing != Framing::Chunked {
            let length = value.trim().parse().map_err(|_| malformed(at, format!("bad content-length {value:?}")))?;
            framing = Framing::Length(length);
        }
    }
    Ok(Head { status, framing, length: head.len() as u64 })
}

/// The offset of the first line of `head` that httparse refuses: the
/// parse of the lines before it is only incomplete. Called once the whole
/// head failed to parse, so some line is refused; a head has at most
/// [`MAX_HEADERS`] lines before httparse refuses one for their number.
fn broken_line(head: &[u8]) -> usize {
    let mut start = 0;
    for end in memchr::memchr_iter(b'\n', head) {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        if httparse::Response::new(&mut headers).parse(&head[..=end]).is_err() {
            return start;
        }
        start = end + 1;
    }
    start
}

/// Reads the body of a response whose head was `head`, refusing more than
/// `limit` bytes.
pub(super) fn read_body(reader: &mut impl BufRead, head: &Head, limit: usize) -> Result<Vec<u8>, HttpError> {
    let start = head.length;
    match head.framing {
        Framing::Length(length) => {
            let length = usize::try_from(length)
                .ok()
                .filter(|&length| length <= limit)
                .ok_or(HttpError::TooLarge { at: start, limit })?;
            let mut body = Vec::with_capacity(length);
            reader.take(length as u64).read_to_end(&mut body)?;
            if body.len() < length {
                return Err(HttpError::Truncated { at: start + body.len() as u64 });
            }
            Ok(body)
        }
        Framing::UntilClose => {
            let mut body = Vec::new();
            reader.take(limit as u64 + 1).read_to_end(&mut body)?;
            if body.len() > limit { Err(HttpError::TooLarge { at: start, limit }) } else { Ok(body) }
        }
        Framing::Chunked => read_chunks(reader, start, limit),
    }
}

/// A chunked body that starts at offset `start` of the response.
fn read_chunks(reader: &mut impl BufRead, start: u64, limit: usize) -> Result<Vec<u8>, HttpError> {
    let mut body = Vec::new();
    let mut at = start;
    loop {
        let line_at = at;
        let line = read_line(reader, &mut at)?;
        let size = line.split(';').next().unwrap_or_default().trim();
        let size = u64::from_str_radix(size, 16).map_err(|_| malformed(line_at, format!("bad chunk size {size:?}")))?;
        if size == 0 {
            // Trailers, then the empty line that ends the message.
            while !read_line(reader, &mut at)?.is_empty() {}
            return Ok(body);
        }
        if size > (limit - body.len()) as u64 {
            return Err(HttpError::TooLarge { at: line_at, limit });
        }
        let before = body.len();
        reader.take(size).read_to_end(&mut body)?;
        at += (body.len() - before) as u64;
        if ((body.len() - before) as u64) < size {
            return Err(HttpError::Truncated { at });
        }
        let end_at = at;
        if !read_line(reader, &mut at)?.is_empty() {
            return Err(malformed(end_at, "chunk longer than its size"));
        }
    }
}

/// One CRLF-terminated line without its terminator; it starts at offset
/// `at`, which is moved past it.
fn read_line(reader: &mut impl BufRead, at: &mut u64) -> Result<String, HttpError> {
    let start = *at;
    let mut line = Vec::new();
    reader.take(MAX_LINE).read_until(b'\n', &mut line)?;
    *at += line.len() as u64;
    if line.last() != Some(&b'\n') {
        return Err(if line.len() as u64 >= MAX_LINE {
            malformed(start, "chunk line too long")
        } else {
            HttpError::Truncated { at: *at }
        });
    }
    line.pop();
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    String::from_utf8(line).map_err(|_| malformed(start, "chunk line not UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exchange(raw: &[u8], limit: usize) -> Result<(u16, Vec<u8>), HttpError> {
        let mut reader = raw;
        let head = read_head(&mut reader)?;
        Ok((head.status, read_body(&mut reader, &head, limit)?))
    }

    #[test]
    fn content_length_body() {
        let raw = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(exchange(raw, 100).unwrap(), (200, b"hello".to_vec()));
        let short = b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nhello";
        assert!(matches!(exchange(short, 100), Err(HttpError::Truncated { at: 43 })), "{:?}", exchange(short, 100));
        assert!(matches!(exchange(raw, 4), Err(HttpError::TooLarge { at: 70, limit: 4 })));
    }

    #[test]
    fn chunked_body_like_go_writes_it() {
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nWiki\r\n6;ext=1\r\npedia \r\nE\r\nin \r\n\r\nchunks.\r\n0\r\nX-Trailer: 1\r\n\r\n";
        assert_eq!(exchange(raw, 100).unwrap().1, b"Wikipedia in \r\n\r\nchunks.".to_vec());
        assert!(matches!(exchange(raw, 10), Err(HttpError::TooLarge { .. })));
        let cut = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nWi";
        assert!(matches!(exchange(cut, 100), Err(HttpError::Truncated { at: 52 })), "{:?}", exchange(cut, 100));
        let bad = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nWiki\r\nzz\r\n";
        let err = exchange(bad, 100).unwrap_err();
        assert_eq!(err.to_string(), "malformed response at byte 56: bad chunk size \"zz\"");
        let long = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nWiki\r\n0\r\n\r\n";
        let err = exchange(long, 100).unwrap_err();
        assert_eq!(err.to_string(), "malformed response at byte 52: chunk longer than its size");
    }

    #[test]
    fn body_until_close_and_bad_heads() {
        assert_eq!(exchange(b"HTTP/1.1 500 Internal Server Error\r\n\r\noops", 100).unwrap(), (500, b"oops".to_vec()));
        assert!(matches!(exchange(b"", 100), Err(HttpError::ClosedEarly { at: 0 })));
        assert!(matches!(exchange(b"HTTP/1.1 200 OK\r\nContent-Len", 100), Err(HttpError::ClosedEarly { at: 28 })));
        assert!(matches!(exchange(b"SSH-2.0-OpenSSH\r\n\r\n", 100), Err(HttpError::Malformed { at: 0, .. })));
        let Err(HttpError::Malformed { at: 9, problem }) =
            exchange(b"HTTP/1.1 020 OK\r\nContent-Length: 0\r\n\r\n", 100)
        else {
            panic!("a status of 20 read");
        };
        assert_eq!(problem, "status code 020 is not an HTTP status (100-599)");
        let gzip = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n";
        assert!(matches!(exchange(gzip, 100), Err(HttpError::Malformed { at: 36, .. })));
        let bad_header = b"HTTP/1.1 200 OK\r\nContent-Type: json\r\nBad Header: x\r\n\r\n";
        assert!(matches!(exchange(bad_header, 100), Err(HttpError::Malformed { at: 37, .. })));
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

    /// An error names where in `raw` the framing broke: within it, and at
    /// its end when the connection closed early.
    fn error_names_its_offset(err: &HttpError, raw: &[u8]) {
        let len = raw.len() as u64;
        let at = match *err {
            HttpError::ClosedEarly { at } | HttpError::Truncated { at } => {
                assert_eq!(at, len, "{err}: closed at the end of {len} bytes");
                at
            }
            HttpError::Malformed { at, .. } | HttpError::TooLarge { at, .. } => at,
            HttpError::Io(_) => panic!("{err:?} reading a byte slice"),
        };
        assert!(at <= len, "{err}: beyond the response's {len} bytes");
        assert!(err.to_string().contains(&format!("byte {at}")), "{err}");
    }

    /// The framing fuzzed (see `testbed::fuzz`; `tests/fuzz.rs` has the
    /// other parsers): nothing panics or reads past its limit, an error
    /// names the byte where the framing broke, and a body that reads,
    /// framed anew any way, reads back the same.
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
        let repo = fuse_supervisor_testbed::fuzz::repo();
        fuse_supervisor_testbed::fuzz::Fuzzer::new("http-framing", &repo).corpus(corpus).dictionary(dictionary).run(
            |raw| {
                let (status, body) = match exchange(raw, LIMIT) {
                    Ok(read) => read,
                    Err(err) => return error_names_its_offset(&err, raw),
                };
                assert!((100..=599).contains(&status) && body.len() <= LIMIT, "{status}, {} bytes", body.len());
                for framed in framings(&body) {
                    assert_eq!(exchange(&framed, LIMIT).unwrap(), (200, body.clone()));
                }
            },
        );
    }
}
