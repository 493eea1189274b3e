//! Sends a workload's requests to a target and times them: open loop (each request at its
//! arrival time, on its own connection, as independent users do) or per session (each session's
//! turns in order, one after the other). Every response streams; TTFT is the time to the first
//! chunk that carries generated text, end-to-end the time to the last byte.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

use crate::workload::Request;

#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub ok: bool,
    pub ttft: Option<Duration>,
    pub e2e: Duration,
    pub output_tokens: usize,
    /// From the final usage chunk: prompt tokens and those served from the prefix cache.
    pub prompt_tokens: Option<usize>,
    pub cached_tokens: Option<usize>,
    /// Bytes the client put on the wire for this request (request line, headers, body).
    pub bytes_sent: usize,
    /// warmpath's `x-warmpath-backend` and `x-warmpath-route` (other targets send none).
    pub backend: Option<String>,
    pub route: Option<String>,
    pub error: Option<String>,
}

/// How clients connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connection {
    /// A new TCP connection per request.
    PerRequest,
    /// One keep-alive connection per session, reused for its turns.
    KeepAlive,
}

/// Progress shared with the progress line.
#[derive(Debug, Default)]
pub struct Progress {
    pub done: AtomicUsize,
    pub errors: AtomicUsize,
    pub in_flight: AtomicUsize,
}

/// A client connection and the count of bytes written to it.
struct Sender {
    send: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    written: Arc<AtomicUsize>,
}

impl Sender {
    fn is_closed(&self) -> bool {
        self.send.is_closed()
    }
}

/// A TCP stream that counts the bytes written to it.
struct Counting {
    inner: tokio::net::TcpStream,
    written: Arc<AtomicUsize>,
}

impl tokio::io::AsyncRead for Counting {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Counting {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        if let std::task::Poll::Ready(Ok(n)) = &r {
            self.written.fetch_add(*n, Ordering::Relaxed);
        }
        r
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

async fn connect(addr: SocketAddr) -> anyhow::Result<Sender> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let written = Arc::new(AtomicUsize::new(0));
    let io = Counting { inner: stream, written: written.clone() };
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(conn);
    Ok(Sender { send, written })
}

/// Scans SSE bytes for the first chunk with generated text and the usage's completion tokens.
#[derive(Debug, Default)]
struct SseScan {
    events: warmpath_wire::sse::Splitter,
    first_text: bool,
    completion_tokens: Option<usize>,
    prompt_tokens: Option<usize>,
    cached_tokens: Option<usize>,
    chunks_with_text: usize,
}

impl SseScan {
    /// Feeds bytes; true when this feed completed the first event that carries text.
    fn feed(&mut self, bytes: &[u8]) -> bool {
        let mut became_first = false;
        for data in self.events.feed(bytes) {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&data) else { continue };
            let choice = &v["choices"][0];
            let text = choice["delta"]["content"].as_str().or_else(|| choice["text"].as_str());
            if text.is_some_and(|t| !t.is_empty()) {
                self.chunks_with_text += 1;
                if !self.first_text {
                    self.first_text = true;
                    became_first = true;
                }
            }
            let usage = &v["usage"];
            if let Some(n) = usage["completion_tokens"].as_u64() {
                self.completion_tokens = Some(n as usize);
                self.prompt_tokens = usage["prompt_tokens"].as_u64().map(|n| n as usize);
                self.cached_tokens =
                    usage["prompt_tokens_details"]["cached_tokens"].as_u64().map(|n| n as usize);
            }
        }
        became_first
    }
}

/// One streaming request on `sender`.
async fn one(sender: &mut Sender, addr: SocketAddr, r: &Request, timeout: Duration) -> Outcome {
    let start = Instant::now();
    let mut out = Outcome::default();
    let req = match hyper::Request::post("/v1/chat/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .header("accept", "text/event-stream")
        .body(Full::new(r.body.clone()))
    {
        Ok(req) => req,
        Err(e) => {
            out.error = Some(e.to_string());
            return out;
        }
    };
    let written_before = sender.written.load(Ordering::Relaxed);
    let work = async {
        let resp = sender.send.send_request(req).await?;
        let status = resp.status().as_u16();
        let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        out.backend = header("x-warmpath-backend");
        out.route = header("x-warmpath-route");
        let mut body = resp.into_body();
        let mut scan = SseScan::default();
        let mut error_body = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame?;
            if let Some(data) = frame.data_ref() {
                if status != 200 {
                    error_body.extend_from_slice(data);
                } else if scan.feed(data) {
                    out.ttft = Some(start.elapsed());
                }
            }
        }
        anyhow::ensure!(status == 200, "status {status}: {}", String::from_utf8_lossy(&error_body));
        anyhow::ensure!(scan.first_text, "stream ended without text");
        out.output_tokens = scan.completion_tokens.unwrap_or(scan.chunks_with_text);
        out.prompt_tokens = scan.prompt_tokens;
        out.cached_tokens = scan.cached_tokens;
        Ok::<_, anyhow::Error>(())
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(Ok(())) => out.ok = true,
        Ok(Err(e)) => out.error = Some(format!("{e:#}")),
        Err(_) => out.error = Some(format!("no complete answer within {timeout:?}")),
    }
    out.e2e = start.elapsed();
    out.bytes_sent = sender.written.load(Ordering::Relaxed) - written_before;
    out
}

/// One streaming chat request with `body` on a new connection.
pub async fn once(addr: SocketAddr, body: Bytes, timeout: Duration) -> Outcome {
    let r = Request { at: Duration::ZERO, body, tokens: Vec::new(), max_tokens: 0, session: None };
    match connect(addr).await {
        Ok(mut s) => one(&mut s, addr, &r, timeout).await,
        Err(e) => Outcome { error: Some(format!("connect: {e}")), ..Outcome::default() },
    }
}

/// Each request at its arrival time on a new connection; outcomes in request order.
pub async fn open_loop(
    addr: SocketAddr,
    reqs: Arc<Vec<Request>>,
    progress: Arc<Progress>,
    timeout: Duration,
) -> Vec<Outcome> {
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(reqs.len());
    for i in 0..reqs.len() {
        let at = reqs[i].at;
        if let Some(wait) = at.checked_sub(start.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let (reqs, progress) = (reqs.clone(), progress.clone());
        tasks.push(tokio::spawn(async move {
            progress.in_flight.fetch_add(1, Ordering::Relaxed);
            let out = match connect(addr).await {
                Ok(mut s) => one(&mut s, addr, &reqs[i], timeout).await,
                Err(e) => Outcome { error: Some(format!("connect: {e}")), ..Outcome::default() },
            };
            progress.in_flight.fetch_sub(1, Ordering::Relaxed);
            finish(&progress, &out);
            out
        }));
    }
    let mut outs = Vec::with_capacity(tasks.len());
    for t in tasks {
        outs.push(t.await.unwrap_or_else(|e| Outcome { error: Some(e.to_string()), ..Outcome::default() }));
    }
    outs
}

/// Sessions advance turn by turn together: every session's turn t is answered before any
/// turn t + 1 starts, and at each step the target's CPU is read, so the CPU of each turn is
/// known as the conversations grow.
pub struct TurnClock {
    barrier: tokio::sync::Barrier,
    pid: Option<u32>,
    /// (target CPU ns, when) before the first turn and after each.
    pub samples: std::sync::Mutex<Vec<(u64, Instant)>>,
}

impl TurnClock {
    pub fn new(sessions: usize, pid: Option<u32>) -> Arc<TurnClock> {
        let clock = TurnClock {
            barrier: tokio::sync::Barrier::new(sessions.max(1)),
            pid,
            samples: Default::default(),
        };
        clock.sample();
        Arc::new(clock)
    }

    fn sample(&self) {
        let cpu = self.pid.map_or(0, crate::procfs::cpu_ns);
        if let Ok(mut s) = self.samples.lock() {
            s.push((cpu, Instant::now()));
        }
    }

    async fn turn_done(&self) {
        if self.barrier.wait().await.is_leader() {
            self.sample();
        }
        // Nobody starts the next turn before the sample is taken.
        self.barrier.wait().await;
    }

    /// Per turn: the target's CPU (µs) per session, less `idle_rate` (ns/s) over the turn.
    pub fn per_turn_us(&self, sessions: usize, idle_rate: f64) -> Vec<f64> {
        let s = self.samples.lock().map(|s| s.clone()).unwrap_or_default();
        s.windows(2)
            .map(|w| {
                let busy = w[1].0.saturating_sub(w[0].0) as f64
                    - idle_rate * w[1].1.duration_since(w[0].1).as_secs_f64();
                busy.max(0.0) / 1e3 / sessions.max(1) as f64
            })
            .collect()
    }
}

/// One session's client: sends its turns one by one, timing each.
trait SessionClient: Send + 'static {
    fn turn(&mut self, i: usize) -> impl std::future::Future<Output = Outcome> + Send;
}

/// Runs every session concurrently, each with its own client, turn after turn (with `clock`, a
/// turn starts when every session's previous turn is answered).
async fn drive<C: SessionClient>(
    n: usize,
    sessions: Vec<Vec<usize>>,
    progress: Arc<Progress>,
    clock: Option<Arc<TurnClock>>,
    client: impl Fn() -> C,
) -> Vec<Outcome> {
    let tasks: Vec<_> = sessions
        .into_iter()
        .map(|turns| {
            let (mut c, progress, clock) = (client(), progress.clone(), clock.clone());
            tokio::spawn(async move {
                let mut outs = Vec::new();
                for i in turns {
                    progress.in_flight.fetch_add(1, Ordering::Relaxed);
                    let out = c.turn(i).await;
                    progress.in_flight.fetch_sub(1, Ordering::Relaxed);
                    finish(&progress, &out);
                    outs.push((i, out));
                    if let Some(c) = &clock {
                        c.turn_done().await;
                    }
                }
                outs
            })
        })
        .collect();
    gather(n, tasks).await
}

/// A chat client resending the whole conversation each turn, on a new connection per turn or
/// one kept alive.
struct ChatTurns {
    addr: SocketAddr,
    reqs: Arc<Vec<Request>>,
    conn: Connection,
    timeout: Duration,
    sender: Option<Sender>,
}

impl SessionClient for ChatTurns {
    async fn turn(&mut self, i: usize) -> Outcome {
        if self.conn == Connection::PerRequest || self.sender.as_ref().is_none_or(|s| s.is_closed()) {
            self.sender = connect(self.addr).await.ok();
        }
        let out = match self.sender.as_mut() {
            Some(s) => one(s, self.addr, &self.reqs[i], self.timeout).await,
            None => Outcome { error: Some("connect failed".into()), ..Outcome::default() },
        };
        if !out.ok {
            self.sender = None;
        }
        out
    }
}

/// Sessions run concurrently; each sends its turns in order (a turn starts when the previous
/// answer is complete; with `clock`, when every session's previous turn is). `sessions[i]`
/// holds indices into `reqs`.
pub async fn sessions(
    addr: SocketAddr,
    reqs: Arc<Vec<Request>>,
    sessions: Vec<Vec<usize>>,
    conn: Connection,
    progress: Arc<Progress>,
    timeout: Duration,
    clock: Option<Arc<TurnClock>>,
) -> Vec<Outcome> {
    let n = reqs.len();
    drive(n, sessions, progress, clock, || ChatTurns {
        addr,
        reqs: reqs.clone(),
        conn,
        timeout,
        sender: None,
    })
    .await
}

/// A Responses WebSocket client: one connection, each turn only the new items.
struct WsTurns {
    addr: SocketAddr,
    reqs: Arc<Vec<Request>>,
    timeout: Duration,
    conn: Option<crate::ws::WsClient>,
    /// The last response's id and how many of the conversation's messages it holds.
    previous: Option<String>,
    sent: usize,
}

impl WsTurns {
    async fn exchange(&mut self, i: usize, start: Instant, out: &mut Outcome) -> anyhow::Result<()> {
        if self.conn.is_none() {
            self.conn = Some(crate::ws::WsClient::connect(self.addr).await?);
        }
        let c = self.conn.as_mut().expect("connected");
        let (event, n) = crate::ws::response_create(&self.reqs[i].body, self.sent, self.previous.as_deref())?;
        c.send_text(&event).await?;
        loop {
            let Some(text) = c.next_text().await? else { anyhow::bail!("the connection closed") };
            let v: serde_json::Value = serde_json::from_str(&text)?;
            match v["type"].as_str().unwrap_or("") {
                "response.output_text.delta" | "response.function_call_arguments.delta" => {
                    out.ttft.get_or_insert_with(|| start.elapsed());
                }
                "response.completed" | "response.incomplete" => {
                    let r = &v["response"];
                    let u = &r["usage"];
                    out.output_tokens = u["output_tokens"].as_u64().unwrap_or(0) as usize;
                    out.prompt_tokens = u["input_tokens"].as_u64().map(|n| n as usize);
                    out.cached_tokens =
                        u["input_tokens_details"]["cached_tokens"].as_u64().map(|n| n as usize);
                    self.previous = r["id"].as_str().map(str::to_owned);
                    self.sent = n;
                    return Ok(());
                }
                "response.failed" | "error" => anyhow::bail!("{text}"),
                _ => {}
            }
        }
    }
}

impl SessionClient for WsTurns {
    async fn turn(&mut self, i: usize) -> Outcome {
        let start = Instant::now();
        let mut out = Outcome::default();
        let written_before = self.conn.as_ref().map_or(0, |c| c.written);
        match tokio::time::timeout(self.timeout, self.exchange(i, start, &mut out)).await {
            Ok(Ok(())) => out.ok = out.ttft.is_some(),
            Ok(Err(e)) => out.error = Some(format!("{e:#}")),
            Err(_) => out.error = Some(format!("no complete answer within {:?}", self.timeout)),
        }
        out.e2e = start.elapsed();
        out.bytes_sent = self.conn.as_ref().map_or(0, |c| c.written).saturating_sub(written_before);
        if !out.ok {
            out.error.get_or_insert_with(|| "no output".into());
            // Start over: a new connection, the whole conversation.
            self.conn = None;
            self.previous = None;
            self.sent = 0;
        }
        out
    }
}

/// The agent workload over Responses WebSocket mode: one connection per session, each turn only
/// the new items (see [`crate::ws`]). TTFT is the first text or arguments delta; prompt and
/// cached tokens come from the response's usage.
pub async fn ws_sessions(
    addr: SocketAddr,
    reqs: Arc<Vec<Request>>,
    sessions: Vec<Vec<usize>>,
    progress: Arc<Progress>,
    timeout: Duration,
    clock: Option<Arc<TurnClock>>,
) -> Vec<Outcome> {
    let n = reqs.len();
    let client = || WsTurns { addr, reqs: reqs.clone(), timeout, conn: None, previous: None, sent: 0 };
    drive(n, sessions, progress, clock, client).await
}

/// The sessions' outcomes, in request order.
async fn gather(n: usize, tasks: Vec<tokio::task::JoinHandle<Vec<(usize, Outcome)>>>) -> Vec<Outcome> {
    let mut outs = vec![Outcome::default(); n];
    for t in tasks {
        if let Ok(v) = t.await {
            for (i, o) in v {
                outs[i] = o;
            }
        }
    }
    outs
}

fn finish(p: &Progress, out: &Outcome) {
    p.done.fetch_add(1, Ordering::Relaxed);
    if !out.ok {
        p.errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// A progress bar (`label [###  ] done/total, in flight, errors`) redrawn every half second
/// while stderr is a terminal; elsewhere (CI logs) one line when the run ends. The task ends
/// when `done` reaches `total`.
pub fn progress_line(label: String, total: usize, p: Arc<Progress>) -> tokio::task::JoinHandle<()> {
    use std::io::IsTerminal;
    let tty = std::io::stderr().is_terminal();
    tokio::spawn(async move {
        let start = Instant::now();
        loop {
            if !tty {
                if p.done.load(Ordering::Relaxed) >= total {
                    eprintln!(
                        "{label}: {total} requests, {} errors, {:.0} s",
                        p.errors.load(Ordering::Relaxed),
                        start.elapsed().as_secs_f64()
                    );
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            let done = p.done.load(Ordering::Relaxed);
            let width = 30;
            let filled = (done * width).checked_div(total).unwrap_or(width);
            eprint!(
                "\r{label:<34} [{}{}] {done}/{total}  in flight {:>3}  errors {}  {:>4.0} s ",
                "#".repeat(filled),
                " ".repeat(width - filled.min(width)),
                p.in_flight.load(Ordering::Relaxed),
                p.errors.load(Ordering::Relaxed),
                start.elapsed().as_secs_f64()
            );
            if done >= total {
                eprintln!();
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_scan_finds_first_text_and_usage_across_splits() {
        let stream = b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n\
data: {\"choices\":[{\"delta\":{\"content\":\" there\"}}]}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\ndata: [DONE]\n\n";
        let mut s = SseScan::default();
        let mut first_at = None;
        for (i, chunk) in stream.chunks(7).enumerate() {
            if s.feed(chunk) {
                assert!(first_at.is_none());
                first_at = Some(i);
            }
        }
        let cut = stream.windows(4).position(|w| w == b"\"Hi\"").unwrap_or(0);
        assert!(first_at.is_some_and(|i| i * 7 > cut), "the role chunk is not text");
        assert_eq!(s.completion_tokens, Some(2));
        assert_eq!((s.prompt_tokens, s.cached_tokens), (Some(9), Some(4)));
        assert_eq!(s.chunks_with_text, 2);
    }
}
