//! Helpers for the engine's integration tests: start a real engine server on 127.0.0.1 and
//! talk HTTP/1.1 to it.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use warmpath_engine::config::EngineArgs;

/// A running engine; the server task stops when this is dropped.
pub struct TestEngine {
    pub addr: SocketAddr,
    pub kv_events: Option<String>,
    pub kv_replay: Option<String>,
    /// Where the engine serves its K/V to decode replicas (`--kv-transfer-port`).
    pub kv_transfer: Option<SocketAddr>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

pub async fn start(args: EngineArgs) -> TestEngine {
    let server = warmpath_engine::launch(args).await.expect("engine starts");
    let addr = server.addr;
    let kv_events = server.kv_events_endpoint.clone();
    let kv_replay = server.kv_events_replay_endpoint.clone();
    let kv_transfer = server.kv_transfer_addr;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.run_until(async move {
        let _ = rx.await;
    }));
    TestEngine { addr, kv_events, kv_replay, kv_transfer, _stop: tx }
}

pub async fn micro() -> TestEngine {
    start(EngineArgs::for_tests("micro")).await
}

async fn send(addr: SocketAddr, req: Request<Full<Bytes>>) -> hyper::Response<hyper::body::Incoming> {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
    tokio::spawn(conn);
    sender.send_request(req).await.expect("response")
}

/// POSTs JSON; returns status and body text.
pub async fn post(addr: SocketAddr, path: &str, body: impl Into<Bytes>) -> (u16, String) {
    let req = Request::post(path)
        .header("host", "127.0.0.1")
        .header("content-type", "application/json")
        .body(Full::new(body.into()))
        .expect("request");
    let resp = send(addr, req).await;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

pub async fn post_json(addr: SocketAddr, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    let (status, text) = post(addr, path, body.to_string()).await;
    (status, serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}")))
}

pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let req = Request::get(path).header("host", "127.0.0.1").body(Full::new(Bytes::new())).expect("request");
    let resp = send(addr, req).await;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// POSTs and returns the response with its body still streaming.
pub async fn post_streaming(
    addr: SocketAddr,
    path: &str,
    body: serde_json::Value,
) -> hyper::Response<hyper::body::Incoming> {
    let req = Request::post(path)
        .header("host", "127.0.0.1")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    send(addr, req).await
}

/// Splits an SSE body into its `data:` payloads.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("bad SSE event {e:?}")).to_owned())
        .collect()
}

/// Polls `f` until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// A user prompt of about `words` words.
pub fn long_text(words: usize) -> String {
    (0..words).map(|i| format!("word{} ", i % 97)).collect()
}
