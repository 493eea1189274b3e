//! A scripted upstream: a backend whose every answer a test decides, recording what it received,
//! for byte-level checks of what warmpath sends and relays.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
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
