//! HTTP/1.1 as warmpath's backend connections speak it, without I/O: a request head written
//! from its parts, a response head parsed (httparse), and a response body's framing — by
//! `Content-Length`, chunked (RFC 9112 §7.1), or to the end of the connection (§6.3).

use bytes::{Bytes, BytesMut};
use pingora::http::ResponseHeader;
use pingora::{Error, ErrorType, Result};

/// Most bytes of a response head (status line and headers).
pub const MAX_HEAD: usize = 64 * 1024;
/// Most headers in a response.
const MAX_HEADERS: usize = 128;
/// Most bytes of a chunk-size line or a trailer line.
const MAX_LINE: usize = 4 * 1024;
/// Most bytes of a chunked body's trailer section.
const MAX_TRAILERS: usize = 16 * 1024;

fn invalid(what: &'static str) -> Box<Error> {
    Error::explain(ErrorType::InvalidHTTPHeader, what)
}

/// A request head being written: the request line, then each header, then the blank line.
pub struct RequestHead(Vec<u8>);

impl RequestHead {
    /// `method` `base``path` `HTTP/1.1`; `room` is what the headers will need, roughly.
    pub fn new(method: &str, base: &str, path: &[u8], room: usize) -> RequestHead {
        let mut b = Vec::with_capacity(method.len() + base.len() + path.len() + 16 + room);
        b.extend_from_slice(method.as_bytes());
        b.push(b' ');
        b.extend_from_slice(base.as_bytes());
        b.extend_from_slice(path);
        b.extend_from_slice(b" HTTP/1.1\r\n");
        RequestHead(b)
    }

    /// One header line. Names and values come from `http`'s checked types or from the policy
    /// (validated there), so neither holds a line break.
    pub fn header(&mut self, name: &str, value: &[u8]) {
        let b = &mut self.0;
        b.extend_from_slice(name.as_bytes());
        b.extend_from_slice(b": ");
        b.extend_from_slice(value);
        b.extend_from_slice(b"\r\n");
    }

    pub fn content_length(&mut self, len: usize) {
        self.header("content-length", itoa::Buffer::new().format(len).as_bytes());
    }

    /// The head as sent: every line, then the blank one.
    pub fn finish(mut self) -> Vec<u8> {
        self.0.extend_from_slice(b"\r\n");
        self.0
    }

    /// The head written so far (tests).
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// How a response's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// After this many bytes.
    Length(u64),
    /// At the zero-length chunk (and the trailers after it).
    Chunked,
    /// When the backend closes the connection.
    Close,
}

/// A response head read whole.
#[derive(Debug)]
pub struct Head {
    pub header: ResponseHeader,
    /// Bytes of the buffer the head took.
    pub len: usize,
    pub framing: Framing,
    /// Whether the connection may carry another request after this response.
    pub keep_alive: bool,
}

/// Parses the response head at the start of `buf`: `None` while it is incomplete.
pub fn parse_response(buf: &[u8]) -> Result<Option<Head>> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) if n <= MAX_HEAD => n,
        Ok(httparse::Status::Complete(_)) => {
            return Err(invalid("the backend's response head is over 64 KiB"))
        }
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
            return Err(invalid("the backend's response head is over 64 KiB"))
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(invalid("the backend sent over 128 headers")),
        Err(_) => return Err(invalid("the backend's response head is not HTTP/1.x")),
    };
    let status = resp.code.unwrap_or(0);
    let http10 = resp.version == Some(0);
    let mut header = ResponseHeader::build_no_case(status, Some(resp.headers.len()))?;
    if http10 {
        header.set_version(http::Version::HTTP_10);
    }
    let (mut chunked, mut coded, mut length, mut close, mut keep) = (false, false, None, http10, false);
    for h in resp.headers.iter() {
        let name = http::HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| invalid("the backend sent an invalid header name"))?;
        if name == http::header::TRANSFER_ENCODING {
            coded = true;
            // Only the last coding says how the body ends (RFC 9112 §6.3, 4).
            chunked = last_token(h.value).is_some_and(|t| t.eq_ignore_ascii_case(b"chunked"));
        } else if name == http::header::CONTENT_LENGTH {
            let n = parse_length(h.value)?;
            if length.is_some_and(|l| l != n) {
                return Err(invalid("the backend sent two different Content-Length values"));
            }
            length = Some(n);
        } else if name == http::header::CONNECTION {
            for t in h.value.split(|&c| c == b',').map(<[u8]>::trim_ascii) {
                close |= t.eq_ignore_ascii_case(b"close");
                keep |= t.eq_ignore_ascii_case(b"keep-alive");
            }
        }
        let value = http::HeaderValue::from_bytes(h.value)
            .map_err(|_| invalid("the backend sent an invalid header value"))?;
        header.append_header(name, value)?;
    }
    let framing = if status < 200 || status == 204 || status == 304 {
        Framing::Length(0)
    } else if coded {
        if chunked {
            Framing::Chunked
        } else {
            Framing::Close
        }
    } else {
        length.map_or(Framing::Close, Framing::Length)
    };
    let keep_alive = framing != Framing::Close && if http10 { keep } else { !close };
    Ok(Some(Head { header, len, framing, keep_alive }))
}

fn parse_length(v: &[u8]) -> Result<u64> {
    let v = v.trim_ascii();
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return Err(invalid("the backend sent an invalid Content-Length"));
    }
    Ok(v.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

fn last_token(v: &[u8]) -> Option<&[u8]> {
    v.split(|&c| c == b',').map(<[u8]>::trim_ascii).rfind(|t| !t.is_empty())
}

/// Where a body's decoding stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// This many bytes of a sized body are left.
    Length(u64),
    /// A chunk-size line comes next.
    Size,
    /// This many bytes of the current chunk are left.
    Data(u64),
    /// The CRLF after a chunk's data comes next.
    DataEnd,
    /// Trailer lines, up to a blank one; the count is the section's bytes so far.
    Trailers(usize),
    /// Everything until the connection ends.
    Close,
    Done,
}

/// Takes a response body out of the bytes read from its connection, framing removed.
#[derive(Debug)]
pub struct BodyDecoder {
    state: State,
}

impl BodyDecoder {
    pub fn new(framing: Framing) -> BodyDecoder {
        let state = match framing {
            Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Size,
            Framing::Close => State::Close,
        };
        BodyDecoder { state }
    }

    /// Whether the body has ended.
    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// The body bytes `buf` holds (taken out of it with their framing): every whole or partial
    /// chunk there, joined — so chunks that arrived together cost one relay step. Empty when
    /// `buf` holds no body bytes yet.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Bytes> {
        let mut out = BytesMut::new();
        loop {
            match self.state {
                State::Done => break,
                State::Close => {
                    out.unsplit(buf.split());
                    break;
                }
                State::Length(left) | State::Data(left) => {
                    if buf.is_empty() {
                        break;
                    }
                    let n = left.min(buf.len() as u64);
                    out.unsplit(buf.split_to(n as usize));
                    let left = left - n;
                    self.state = match self.state {
                        State::Length(_) if left == 0 => State::Done,
                        State::Length(_) => State::Length(left),
                        _ if left == 0 => State::DataEnd,
                        _ => State::Data(left),
                    };
                }
                State::DataEnd => {
                    if buf.len() < 2 {
                        break;
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(invalid("the backend's chunk does not end with CRLF"));
                    }
                    let _ = buf.split_to(2);
                    self.state = State::Size;
                }
                State::Size => {
                    let Some(line) = take_line(buf)? else { break };
                    let size = parse_chunk_size(&line)?;
                    self.state = if size == 0 { State::Trailers(0) } else { State::Data(size) };
                }
                State::Trailers(seen) => {
                    let Some(line) = take_line(buf)? else { break };
                    let seen = seen + line.len() + 2;
                    if seen > MAX_TRAILERS {
                        return Err(invalid("the backend's trailers are over 16 KiB"));
                    }
                    self.state = if line.is_empty() { State::Done } else { State::Trailers(seen) };
                }
            }
        }
        Ok(out.freeze())
    }

    /// The connection ended: the end of a body read to the close, else an error (the body was
    /// cut short).
    pub fn eof(&mut self) -> Result<()> {
        match self.state {
            State::Close | State::Done => {
                self.state = State::Done;
                Ok(())
            }
            _ => {
                Err(Error::explain(ErrorType::ConnectionClosed, "the backend closed the connection mid-body"))
            }
        }
    }
}

/// A CRLF-ended line at the start of `buf`, taken out without its CRLF; `None` while it is
/// incomplete.
fn take_line(buf: &mut BytesMut) -> Result<Option<BytesMut>> {
    match memchr_crlf(buf) {
        Some(i) if i > MAX_LINE => Err(invalid("the backend sent a chunk line over 4 KiB")),
        Some(i) => {
            let line = buf.split_to(i);
            let _ = buf.split_to(2);
            Ok(Some(line))
        }
        None if buf.len() > MAX_LINE => Err(invalid("the backend sent a chunk line over 4 KiB")),
        None => Ok(None),
    }
}

fn memchr_crlf(b: &[u8]) -> Option<usize> {
    b.windows(2).position(|w| w == b"\r\n")
}

/// A chunk-size line: hex digits, then optional extensions after `;` (ignored).
fn parse_chunk_size(line: &[u8]) -> Result<u64> {
    let digits = line.split(|&c| c == b';').next().unwrap_or_default().trim_ascii();
    if digits.is_empty() || digits.len() > 15 {
        return Err(invalid("the backend sent an invalid chunk size"));
    }
    let mut n = 0u64;
    for &d in digits {
        let v = (d as char).to_digit(16).ok_or_else(|| invalid("the backend sent an invalid chunk size"))?;
        n = n * 16 + u64::from(v);
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(raw: &str) -> Head {
        parse_response(raw.as_bytes()).expect("parses").expect("complete")
    }

    #[test]
    fn the_request_head_is_one_buffer_of_lines() {
        let mut h = RequestHead::new("POST", "/base", b"/v1/chat/completions", 64);
        h.header("host", b"a:1");
        h.content_length(1234567);
        assert_eq!(
            h.finish(),
            b"POST /base/v1/chat/completions HTTP/1.1\r\nhost: a:1\r\ncontent-length: 1234567\r\n\r\n"
        );
        let mut h = RequestHead::new("GET", "", b"/x", 0);
        h.content_length(0);
        assert_eq!(h.as_bytes(), b"GET /x HTTP/1.1\r\ncontent-length: 0\r\n");
    }

    #[test]
    fn framing_follows_rfc_9112() {
        let h = head("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive, h.header.status.as_u16()), (Framing::Length(5), true, 200));
        let h = head("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 5\r\n\r\n");
        assert_eq!(h.framing, Framing::Chunked);
        let h = head("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (Framing::Close, false));
        let h = head("HTTP/1.1 200 OK\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (Framing::Close, false));
        let h = head("HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\n");
        assert_eq!(h.framing, Framing::Length(0));
        let h = head("HTTP/1.1 200 OK\r\nConnection: Close\r\nContent-Length: 1\r\n\r\n");
        assert!(!h.keep_alive);
        let h = head("HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n");
        assert!(!h.keep_alive);
        let h = head("HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n");
        assert!(h.keep_alive);
        assert_eq!(h.len, "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n".len());
        assert_eq!(h.header.headers.get("connection").map(|v| v.as_bytes()), Some(&b"keep-alive"[..]));
    }

    #[test]
    fn bad_heads_are_errors_and_partial_ones_wait() {
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Le").unwrap().is_none());
        for bad in [
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n",
            "SMTP ready\r\n\r\n",
        ] {
            assert!(parse_response(bad.as_bytes()).is_err(), "{bad}");
        }
        let huge = format!("HTTP/1.1 200 OK\r\nX: {}", "a".repeat(MAX_HEAD));
        assert!(parse_response(huge.as_bytes()).is_err(), "incomplete");
        assert!(parse_response(format!("{huge}\r\n\r\n").as_bytes()).is_err(), "complete");
    }

    /// Decodes `wire` fed `step` bytes at a time; the body and whether it ended.
    fn decode(framing: Framing, wire: &[u8], step: usize) -> Result<(Vec<u8>, bool)> {
        let mut d = BodyDecoder::new(framing);
        let (mut buf, mut body) = (BytesMut::new(), Vec::new());
        for piece in wire.chunks(step.max(1)) {
            buf.extend_from_slice(piece);
            body.extend_from_slice(&d.decode(&mut buf)?);
        }
        Ok((body, d.done()))
    }

    #[test]
    fn chunked_bodies_decode_however_the_bytes_arrive() {
        let wire = b"5;ext=1\r\nhello\r\n7\r\n, world\r\nA\r\n0123456789\r\n0\r\nX-T: 1\r\n\r\n";
        for step in [1, 2, 3, 7, 64] {
            let (body, done) = decode(Framing::Chunked, wire, step).unwrap();
            assert_eq!(body, b"hello, world0123456789", "step {step}");
            assert!(done);
        }
        let (body, done) = decode(Framing::Chunked, b"5\r\nhel", 64).unwrap();
        assert_eq!((body.as_slice(), done), (&b"hel"[..], false));
        assert!(decode(Framing::Chunked, b"5\r\nhelloXX", 64).is_err());
        assert!(decode(Framing::Chunked, b"zz\r\n", 64).is_err());
        assert!(decode(Framing::Chunked, &[b'1'; MAX_LINE + 8], 64).is_err());
    }

    #[test]
    fn sized_and_closed_bodies() {
        let (body, done) = decode(Framing::Length(5), b"hello", 2).unwrap();
        assert_eq!((body.as_slice(), done), (&b"hello"[..], true));
        let mut d = BodyDecoder::new(Framing::Length(5));
        let mut buf = BytesMut::from(&b"helloNEXT"[..]);
        assert_eq!(&d.decode(&mut buf).unwrap()[..], b"hello");
        assert_eq!(&buf[..], b"NEXT", "bytes past the body stay in the buffer");
        let mut d = BodyDecoder::new(Framing::Close);
        let mut buf = BytesMut::from(&b"all of it"[..]);
        assert_eq!(&d.decode(&mut buf).unwrap()[..], b"all of it");
        assert!(!d.done());
        d.eof().unwrap();
        assert!(d.done());
        let mut d = BodyDecoder::new(Framing::Length(5));
        assert!(d.eof().is_err(), "a sized body cut short is an error");
    }
}
