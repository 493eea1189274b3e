//! Helpers for warmpath's integration tests: real `warmpath-engine` and `warmpath` processes on
//! 127.0.0.1, a scripted upstream for byte-level checks, and a small blocking HTTP/1.1 client
//! that shows exactly what went over the wire.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The `warmpath-engine` binary next to this test's target directory, built once if missing.
pub fn engine_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("test exe");
        let dir = exe.parent().and_then(Path::parent).expect("target dir").to_path_buf();
        let bin = dir.join("warmpath-engine");
        let profile_release = dir.file_name().is_some_and(|n| n == "release");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-q", "-p", "warmpath-engine", "--bin", "warmpath-engine"]);
        if profile_release {
            cmd.arg("--release");
        }
        if bin.exists() {
            // `cargo test --workspace` builds it (the engine's own tests need it); building it
            // here again could resolve features differently and rebuild the world.
            return bin;
        }
        let status = cmd.status().expect("cargo runs");
        assert!(status.success(), "building warmpath-engine failed");
        assert!(bin.exists(), "{} missing after build", bin.display());
        bin
    })
    .clone()
}

/// Output of a child process, kept for failure messages.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<String>>);

impl Log {
    pub fn text(&self) -> String {
        self.0.lock().map(|s| s.clone()).unwrap_or_default()
    }
    fn drain(&self, r: impl Read + Send + 'static) {
        let log = self.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(r).lines().map_while(Result::ok) {
                if let Ok(mut s) = log.0.lock() {
                    s.push_str(&line);
                    s.push('\n');
                }
            }
        });
    }
}

/// A `warmpath-engine` process; killed on drop.
pub struct Engine {
    pub addr: SocketAddr,
    pub child: Child,
    pub log: Log,
    pub args: Vec<String>,
}

impl Engine {
    /// Starts an engine with the `sim` executor (fast, no math) and extra flags.
    pub fn sim(name: &str, extra: &[&str]) -> Engine {
        let mut args: Vec<String> =
            ["--executor", "sim", "--served-model-name", name].iter().map(|s| s.to_string()).collect();
        // Defaults a test may override (clap refuses a flag given twice).
        for (flag, value) in [("--kv-blocks", "512"), ("--sim-itl-ms", "2")] {
            if !extra.contains(&flag) {
                args.extend([flag.to_owned(), value.to_owned()]);
            }
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        Engine::start_args(args, 0)
    }

    pub fn start_args(args: Vec<String>, port: u16) -> Engine {
        let mut child = Command::new(engine_bin())
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(&args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("engine spawns");
        let log = Log::default();
        log.drain(child.stderr.take().expect("stderr"));
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = loop {
            line.clear();
            if out.read_line(&mut line).unwrap_or(0) == 0 || Instant::now() > deadline {
                panic!("engine did not start: {}", log.text());
            }
            if let Some(a) = line.trim().rsplit("http://").next().filter(|_| line.contains("serving model")) {
                break a.parse::<SocketAddr>().expect("engine address");
            }
        };
        log.drain(out.into_inner());
        Engine { addr, child, log, args }
    }

    /// Stops the process (the port is freed).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the same engine again on the same port.
    pub fn restart(&mut self) {
        self.kill();
        let port = self.addr.port();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // The port may linger for a moment after the kill.
            if TcpListener::bind(self.addr).is_ok() || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        *self = Engine::start_args(self.args.clone(), port);
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn metrics(&self) -> String {
        String::from_utf8_lossy(&get(self.addr, "/metrics").body).into_owned()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free loopback port (bound and released; a race with other processes is possible but rare).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

/// A `warmpath` process serving a policy file; killed on drop.
pub struct Proxy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub child: Child,
    pub log: Log,
    _dir: TempDir,
}

impl Proxy {
    /// Starts warmpath with `policy` (TOML) and waits until its admin listener answers and, when
    /// `ready`, until `/readyz` says every pool has a backend.
    pub fn start_with(policy: &str, ready: bool) -> Proxy {
        let dir = TempDir::new();
        let file = dir.path().join("policy.toml");
        std::fs::write(&file, policy).expect("write policy");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let mut child = Command::new(env!("CARGO_BIN_EXE_warmpath"))
            .arg("--config")
            .arg(&file)
            .args(["--listen", &addr.to_string(), "--admin", &admin.to_string()])
            .env("RUST_LOG", "warn,warmpath=info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("warmpath spawns");
        let log = Log::default();
        log.drain(child.stdout.take().expect("stdout"));
        log.drain(child.stderr.take().expect("stderr"));
        let proxy = Proxy { addr, admin, child, log, _dir: dir };
        let path = if ready { "/readyz" } else { "/healthz" };
        let up = eventually(Duration::from_secs(30), || {
            TcpStream::connect(admin).is_ok()
                && get(admin, path).status == 200
                && TcpStream::connect(addr).is_ok()
        });
        assert!(up, "warmpath did not become ready:\n{}", proxy.log.text());
        proxy
    }

    pub fn start(policy: &str) -> Proxy {
        Proxy::start_with(policy, true)
    }

    pub fn metrics(&self) -> String {
        String::from_utf8_lossy(&get(self.admin, "/metrics").body).into_owned()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A temporary directory removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("warmpath-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&p).expect("temp dir");
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Health checks every 200 ms, for tests that watch backends come and go.
pub const FAST_HEALTH: &str = "[health]\ninterval_ms = 200\ntimeout_ms = 500\n";

/// A policy file: `global` TOML (tables other than pools) and one pool `main` serving `models`
/// over `backends` (name, url), with `pool_extra` keys (policy, limits, sub-tables) in it.
pub fn policy(global: &str, pool_extra: &str, models: &[&str], backends: &[(&str, String)]) -> String {
    let models: Vec<String> = models.iter().map(|m| format!("{m:?}")).collect();
    let mut s =
        format!("{global}\n[[pools]]\nname = \"main\"\nmodels = [{}]\n{pool_extra}\n", models.join(", "));
    for (name, url) in backends {
        s.push_str(&format!("\n[[pools.backends]]\nname = {name:?}\nurl = {url:?}\n"));
    }
    s
}

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
}

/// Sends one request with `Connection: close` and reads the whole response.
pub fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).expect("write head");
    s.write_all(body).expect("write body");
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse_response(&raw)
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], b"")
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

/// The value of the first metric line starting with `prefix` (name and labels).
pub fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Sum of every metric line starting with `prefix`.
pub fn metric_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next())
        .filter_map(|v| v.parse::<f64>().ok())
        .sum()
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

pub fn chat(model: &str, text: &str, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
}

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
                        let json = reply(&body).to_string();
                        h3.lock().expect("lock").push(head);
                        b3.lock().expect("lock").push(body);
                        let mut o = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                            json.len()
                        )
                        .into_bytes();
                        o.extend_from_slice(json.as_bytes());
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
fn read_request(conn: &mut TcpStream) -> Option<(String, Vec<u8>)> {
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

/// A blocking WebSocket client (RFC 6455, client side), to see exactly what warmpath sends.
pub struct Ws {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

/// A server frame: opcode and payload.
#[derive(Debug, Clone, PartialEq)]
pub struct WsFrame {
    pub opcode: u8,
    pub payload: Vec<u8>,
}

impl WsFrame {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.payload)
            .unwrap_or_else(|_| panic!("not JSON: {:?}", String::from_utf8_lossy(&self.payload)))
    }

    /// A close frame's code.
    pub fn close_code(&self) -> Option<u16> {
        (self.opcode == 8 && self.payload.len() >= 2)
            .then(|| u16::from_be_bytes([self.payload[0], self.payload[1]]))
    }
}

impl Ws {
    /// Connects and upgrades; panics unless the answer is 101 with the right accept key.
    pub fn connect(addr: SocketAddr, headers: &[(&str, &str)]) -> Ws {
        Ws::try_connect(addr, headers)
            .unwrap_or_else(|r| panic!("upgrade refused: {} {}", r.status, r.text()))
    }

    /// Connects; the refusal's response if the server does not upgrade.
    pub fn try_connect(addr: SocketAddr, headers: &[(&str, &str)]) -> Result<Ws, Resp> {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
        let key = "dGhlIHNhbXBsZSBub25jZQ==";
        let mut head = format!(
            "GET /v1/responses HTTP/1.1\r\nhost: {addr}\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
             sec-websocket-key: {key}\r\n"
        );
        if !headers.iter().any(|(k, _)| *k == "sec-websocket-version") {
            head.push_str("sec-websocket-version: 13\r\n");
        }
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).expect("write");
        // Read the response head byte by byte: frames may follow it at once.
        let mut raw = Vec::new();
        let mut b = [0u8; 1];
        while !raw.ends_with(b"\r\n\r\n") {
            if s.read(&mut b).unwrap_or(0) == 0 {
                break;
            }
            raw.push(b[0]);
        }
        let r = parse_response(&raw);
        if r.status != 101 {
            // The refusal's body follows its head.
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
            raw.extend(rest);
            return Err(parse_response(&raw));
        }
        assert_eq!(r.header("sec-websocket-accept"), Some("s3pPLMBiTxaQ9kYGzzhZRbK+xOo="));
        Ok(Ws { stream: s, buf: Vec::new() })
    }

    /// Sends one masked frame.
    pub fn send_frame(&mut self, fin: bool, opcode: u8, payload: &[u8]) {
        let out = warmpath::ws::frame::masked(fin, opcode, payload, [0x5a, 0x13, 0xc4, 0x7e]);
        self.stream.write_all(&out).expect("send frame");
    }

    pub fn send_json(&mut self, v: &serde_json::Value) {
        self.send_frame(true, 1, v.to_string().as_bytes());
    }

    /// The next frame; `None` when the connection ends.
    pub fn read_frame(&mut self) -> Option<WsFrame> {
        loop {
            if self.buf.len() >= 2 {
                let (op, b1) = (self.buf[0] & 0x0F, self.buf[1]);
                assert_eq!(b1 & 0x80, 0, "server frames are not masked");
                let (len, at) = match b1 & 0x7F {
                    126 if self.buf.len() >= 4 => {
                        (u16::from_be_bytes([self.buf[2], self.buf[3]]) as usize, 4)
                    }
                    127 if self.buf.len() >= 10 => {
                        (u64::from_be_bytes(self.buf[2..10].try_into().expect("8")) as usize, 10)
                    }
                    126 | 127 => (usize::MAX, 0),
                    n => (n as usize, 2),
                };
                if len != usize::MAX && self.buf.len() >= at + len {
                    let payload = self.buf[at..at + len].to_vec();
                    self.buf.drain(..at + len);
                    return Some(WsFrame { opcode: op, payload });
                }
            }
            let mut chunk = [0u8; 16384];
            match self.stream.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// The next text message's JSON, answering pings on the way.
    pub fn next_event(&mut self) -> Option<serde_json::Value> {
        loop {
            let f = self.read_frame()?;
            match f.opcode {
                1 => return Some(f.json()),
                9 => self.send_frame(true, 10, &f.payload),
                8 => return None,
                _ => {}
            }
        }
    }

    /// Events up to and including the next terminal one (`response.completed`, `.incomplete`,
    /// `.failed`, or `error`).
    pub fn turn(&mut self) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        while let Some(e) = self.next_event() {
            let t = e["type"].as_str().unwrap_or("").to_owned();
            out.push(e);
            if matches!(
                t.as_str(),
                "response.completed" | "response.incomplete" | "response.failed" | "error"
            ) {
                break;
            }
        }
        out
    }
}

/// A `redis-server` process on a free port, nothing persisted; killed on drop.
pub struct RedisServer {
    pub port: u16,
    child: Child,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// With extra `redis-server` arguments (`--requirepass secret`).
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs (scripts/ensure-deps installs it)");
        let up = eventually(Duration::from_secs(10), || TcpStream::connect(("127.0.0.1", port)).is_ok());
        assert!(up, "redis-server did not listen on {port}");
        RedisServer { port, child }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An engine script for a weather agent (`--script`): any turn calls `get_weather` for Oslo;
/// once the tool's result (`sunny in Oslo`) is in the prompt, the model answers.
pub fn weather_script(dir: &TempDir) -> String {
    let path = dir.path().join("script.json");
    let rules = serde_json::json!([
        {"when": "", "reply": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"},
        {"when": "sunny in Oslo", "reply": "It will be sunny."},
    ]);
    std::fs::write(&path, rules.to_string()).expect("script");
    path.display().to_string()
}

/// The weather agent's one tool, in the Responses form.
pub fn weather_tools() -> serde_json::Value {
    serde_json::json!([{"type": "function", "name": "get_weather", "description": "The weather forecast for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}])
}

/// Resident memory of a process, in kB (`/proc/PID/status`).
pub fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse::<u64>().ok())
        .expect("rss")
}
