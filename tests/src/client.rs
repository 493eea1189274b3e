//! A small blocking HTTP/1.1 client that shows exactly what went over the wire: requests with
//! `Connection: close`, responses parsed as they came (chunked bodies decoded, whether the
//! stream ended cleanly), SSE bodies split, and a polling helper.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::fixtures::chat;

/// An HTTP response as it came off the wire (chunked bodies decoded).
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The body was chunked and ended with the terminating zero-length chunk.
    pub clean_end: bool,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|_| panic!("not JSON ({}): {}", self.status, self.text()))
    }
    /// The JSON body of a 200 (a panic showing the body otherwise).
    pub fn ok(&self) -> serde_json::Value {
        assert_eq!(self.status, 200, "{}", self.text());
        self.json()
    }
}

/// One request as API key `key` (`Authorization: Bearer key`), with a JSON body when given.
pub fn keyed(
    addr: SocketAddr,
    key: &str,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) -> Resp {
    let auth = format!("Bearer {key}");
    let bytes = body.map(serde_json::Value::to_string).unwrap_or_default();
    let mut headers = vec![("authorization", auth.as_str())];
    if body.is_some() {
        headers.push(("content-type", "application/json"));
    }
    request(addr, method, path, &headers, bytes.as_bytes())
}

/// Sends one request with `Connection: close` and reads the whole response.
pub fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
    let raw = exchange(addr, method, path, headers, body).expect("connect and write the request");
    parse_response(&raw)
}

/// Sends one request on a new connection (`connection: close`) and reads until the server
/// closes: the raw answer, or the error connecting or writing.
fn exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Vec<u8>> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    Ok(raw)
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], b"")
}

/// A GET that gives `None` where [`get`] would panic: no connection, or one closed without an
/// answer — what a process still starting gives (warmpath binds its ports once to check them
/// before it serves, and a connection that lands then is reset).
pub fn try_get(addr: SocketAddr, path: &str) -> Option<Resp> {
    let raw = exchange(addr, "GET", path, &[], b"").ok()?;
    raw.windows(4).any(|w| w == b"\r\n\r\n").then(|| parse_response(&raw))
}

pub fn post_json(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Resp {
    request(addr, "POST", path, &[("content-type", "application/json")], body.to_string().as_bytes())
}

/// Parses a raw HTTP/1.1 response.
pub fn parse_response(raw: &[u8]) -> Resp {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let rest = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).expect("status");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let (body, clean_end) = if chunked { dechunk(rest) } else { (rest.to_vec(), false) };
    Resp { status, headers, body, clean_end }
}

fn dechunk(mut b: &[u8]) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else { return (out, false) };
        let size_text = String::from_utf8_lossy(&b[..eol]);
        let Ok(size) = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16) else {
            return (out, false);
        };
        b = &b[eol + 2..];
        if size == 0 {
            return (out, true);
        }
        if b.len() < size + 2 {
            out.extend_from_slice(&b[..b.len().min(size)]);
            return (out, false);
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// The `data:` payloads of an SSE body, and the names of events that had an `event:` line.
pub fn sse(body: &str) -> (Vec<String>, Vec<String>) {
    let (mut data, mut events) = (Vec::new(), Vec::new());
    for ev in body.split("\n\n").filter(|e| !e.trim().is_empty()) {
        for line in ev.lines() {
            if let Some(d) = line.strip_prefix("data: ") {
                data.push(d.to_owned());
            } else if let Some(e) = line.strip_prefix("event: ") {
                events.push(e.to_owned());
            }
        }
    }
    (data, events)
}

/// Polls `f` until it is true or `timeout` passes.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    false
}

/// Starts a streaming chat request for `max_tokens` tokens and returns the open connection with
/// the first bytes of the answer (status line and headers, lowercased), leaving the stream running.
pub fn open_stream(addr: SocketAddr, model: &str, max_tokens: u32) -> (TcpStream, String) {
    let mut body = chat(model, "tell me a story", max_tokens);
    body["stream"] = serde_json::json!(true);
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf).expect("first bytes");
    (s, String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase())
}

/// Reads one response (Content-Length framed) from a kept-alive connection, leaving the
/// connection at the next response.
pub fn read_response(s: &mut TcpStream) -> Resp {
    let mut raw = Vec::new();
    let mut byte = [0u8; 1];
    while !raw.ends_with(b"\r\n\r\n") {
        assert_eq!(
            s.read(&mut byte).expect("read"),
            1,
            "connection closed: {:?}",
            String::from_utf8_lossy(&raw)
        );
        raw.push(byte[0]);
    }
    let head = parse_response(&raw);
    let len: usize = head.header("content-length").and_then(|v| v.parse().ok()).expect("content-length");
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).expect("body");
    Resp { body, ..head }
}
