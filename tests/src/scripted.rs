//! A scripted upstream: a backend whose every answer a test decides, recording what it received,
//! for byte-level checks of what warmpath sends and relays.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A scripted upstream: answers every request (but `GET /health`) with `reply_head` (status
/// line and headers, no blank line) and `reply_body` as given, and records what it received.
pub struct Scripted {
    pub addr: SocketAddr,
    pub bodies: Arc<Mutex<Vec<Vec<u8>>>>,
    pub heads: Arc<Mutex<Vec<String>>>,
}

impl Scripted {
    /// Answers each request with the JSON `reply(body)` returns (status 200).
    pub fn start_with(reply: impl Fn(&[u8]) -> serde_json::Value + Send + Sync + 'static) -> Scripted {
        Scripted::start_raw(move |body| ("application/json", reply(body).to_string().into_bytes()))
    }

    /// Answers each request with status 200, the content type and body `reply(body)` returns.
    pub fn start_raw(reply: impl Fn(&[u8]) -> (&'static str, Vec<u8>) + Send + Sync + 'static) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (b2, h2) = (bodies.clone(), heads.clone());
        let reply = Arc::new(reply);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let (b3, h3, reply) = (b2.clone(), h2.clone(), reply.clone());
                std::thread::spawn(move || loop {
                    let Some((head, body)) = read_request(&mut conn) else { return };
                    let out = if head.starts_with("GET ") {
                        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n".to_vec()
                    } else {
                        let (content_type, text) = reply(&body);
                        h3.lock().expect("lock").push(head);
                        b3.lock().expect("lock").push(body);
                        let mut o = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
                            text.len()
                        )
                        .into_bytes();
                        o.extend_from_slice(&text);
                        o
                    };
                    if conn.write_all(&out).is_err() {
                        return;
                    }
                });
            }
        });
        Scripted { addr, bodies, heads }
    }

    pub fn start(reply_head: &'static str, reply_body: Vec<u8>) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (b2, h2) = (bodies.clone(), heads.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let (b3, h3, reply_body) = (b2.clone(), h2.clone(), reply_body.clone());
                std::thread::spawn(move || loop {
                    let Some((head, body)) = read_request(&mut conn) else { return };
                    let out = if head.starts_with("GET /health") || head.starts_with("GET /v1/models") {
                        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n".to_vec()
                    } else {
                        h3.lock().expect("lock").push(head);
                        b3.lock().expect("lock").push(body);
                        let mut o = format!("{reply_head}\r\n\r\n").into_bytes();
                        o.extend_from_slice(&reply_body);
                        o
                    };
                    if conn.write_all(&out).is_err() {
                        return;
                    }
                    if reply_head.to_ascii_lowercase().contains("connection: close") {
                        return; // a close-delimited body ends here
                    }
                });
            }
        });
        Scripted { addr, bodies, heads }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// A backend answering in raw bytes, for the HTTP/1 framing warmpath reads: `answer(n)` is the
/// n-th model request's reply (from 0, counted over every connection), written in `pieces`
/// (each flushed apart) and whether the connection closes after it. Probes (`GET`) get an
/// empty 200. Counts the connections it accepted.
pub struct RawBackend {
    pub addr: SocketAddr,
    pub connections: Arc<AtomicUsize>,
    /// Connections that carried at least one model request.
    pub model_connections: Arc<AtomicUsize>,
    pub requests: Arc<AtomicUsize>,
}

/// One reply of a [`RawBackend`].
pub struct RawReply {
    /// The bytes, in writes of their own (a short pause between them).
    pub pieces: Vec<Vec<u8>>,
    /// Close the connection after it (without saying so in a header).
    pub close: bool,
}

impl RawBackend {
    pub fn start(answer: impl Fn(usize) -> RawReply + Send + Sync + 'static) -> RawBackend {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connections = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(AtomicUsize::new(0));
        let model_connections = Arc::new(AtomicUsize::new(0));
        let (c2, r2, m2, answer) =
            (connections.clone(), requests.clone(), model_connections.clone(), Arc::new(answer));
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                c2.fetch_add(1, Ordering::SeqCst);
                let (r3, m3, answer) = (r2.clone(), m2.clone(), answer.clone());
                let mut carried = false;
                std::thread::spawn(move || loop {
                    let Some((head, _)) = read_request(&mut conn) else { return };
                    if head.starts_with("GET ") {
                        if conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_err() {
                            return;
                        }
                        continue;
                    }
                    if !std::mem::replace(&mut carried, true) {
                        m3.fetch_add(1, Ordering::SeqCst);
                    }
                    let reply = answer(r3.fetch_add(1, Ordering::SeqCst));
                    for (i, piece) in reply.pieces.iter().enumerate() {
                        if i > 0 {
                            std::thread::sleep(std::time::Duration::from_millis(20));
                        }
                        if conn.write_all(piece).and_then(|()| conn.flush()).is_err() {
                            return;
                        }
                    }
                    if reply.close {
                        return;
                    }
                });
            }
        });
        RawBackend { addr, connections, model_connections, requests }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Reads one request with a Content-Length body from a server-side connection.
pub(crate) fn read_request(conn: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if conn.read(&mut byte).ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf[..buf.len() - 4]).into_owned();
    let len = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    conn.read_exact(&mut body).ok()?;
    Some((head, body))
}
