//! The soak's clients, each result sorted into what a user would have seen: chat requests
//! (streamed and not) on kept-alive connections, and Responses WebSockets running turns.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

use crate::load::{connect, Sender};
use crate::ws::{Incoming, WsClient};

/// What one request or turn came to.
#[derive(Debug)]
pub enum Outcome {
    /// A whole answer: a body with choices, a stream that ends `[DONE]` without an error event,
    /// a turn's `response.completed`.
    Ok(Duration),
    /// Refused or failed, and told so: an error status with an OpenAI error body, an error event
    /// before `[DONE]`, a turn's `error` or `response.failed`, a WebSocket close frame with its
    /// code. The label says which.
    Clean(String),
    /// Cut without a word: the connection closed or reset mid-answer, a stream that ends
    /// without `[DONE]`, a body that is not the OpenAI shape.
    Lost(String),
    /// Nothing within the deadline.
    Hung,
}

/// Outcomes counted.
#[derive(Debug, Default)]
pub struct Tally {
    pub ok: Vec<Duration>,
    pub clean: BTreeMap<String, usize>,
    pub lost: BTreeMap<String, usize>,
    pub hung: usize,
}

impl Tally {
    pub fn add(&mut self, o: Outcome) {
        match o {
            Outcome::Ok(d) => self.ok.push(d),
            Outcome::Clean(why) => *self.clean.entry(why).or_default() += 1,
            Outcome::Lost(why) => *self.lost.entry(why).or_default() += 1,
            Outcome::Hung => self.hung += 1,
        }
    }

    pub fn merge(&mut self, o: Tally) {
        self.ok.extend(o.ok);
        for (k, v) in o.clean {
            *self.clean.entry(k).or_default() += v;
        }
        for (k, v) in o.lost {
            *self.lost.entry(k).or_default() += v;
        }
        self.hung += o.hung;
    }

    pub fn total(&self) -> usize {
        self.ok.len() + self.clean.values().sum::<usize>() + self.lost.values().sum::<usize>() + self.hung
    }

    pub fn lost(&self) -> usize {
        self.lost.values().sum()
    }
}

/// The model the soak's engines serve.
pub const MODEL: &str = "soak";

/// Request `i`'s body: one of a few shared system prompts (so the prefix index has something to
/// find) and a question of its own.
fn chat_body(i: usize, stream: bool, max_tokens: u32) -> Bytes {
    let v = json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": format!("You are agent {} of the soak. Answer briefly.", i % 8)},
            {"role": "user", "content": format!("Question number {i}: what comes after {i}?")}
        ],
        "max_tokens": max_tokens,
        "stream": stream,
    });
    Bytes::from(v.to_string())
}

/// What an answer's status and body come to.
fn classify(status: u16, stream: bool, body: &[u8], took: Duration) -> Outcome {
    let code = |v: &Value| {
        let e = &v["error"];
        e["code"].as_str().or(e["type"].as_str()).unwrap_or("?").to_owned()
    };
    if status != 200 {
        return match serde_json::from_slice::<Value>(body) {
            Ok(v) if v["error"].is_object() => Outcome::Clean(format!("{status} {}", code(&v))),
            _ => Outcome::Lost(format!("{status} without an OpenAI error body")),
        };
    }
    if !stream {
        return match serde_json::from_slice::<Value>(body) {
            Ok(v) if v["choices"][0]["message"].is_object() => Outcome::Ok(took),
            _ => Outcome::Lost("200 without choices".into()),
        };
    }
    let text = String::from_utf8_lossy(body);
    let mut done = false;
    let mut error = None;
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            done = true;
        } else if error.is_none() {
            match serde_json::from_str::<Value>(data) {
                Ok(v) if v["error"].is_object() => error = Some(code(&v)),
                Ok(_) => {}
                Err(_) => return Outcome::Lost("an event that is not JSON".into()),
            }
        }
    }
    match (error, done) {
        (None, true) => Outcome::Ok(took),
        (Some(c), true) => Outcome::Clean(format!("stream error event {c}")),
        (Some(c), false) => Outcome::Lost(format!("stream error event {c} without [DONE]")),
        (None, false) => Outcome::Lost("stream ended without [DONE]".into()),
    }
}

/// One request on `sender`: its outcome, and whether the connection can carry the next.
async fn one(sender: &mut Sender, addr: SocketAddr, body: Bytes, stream: bool) -> (Outcome, bool) {
    let start = Instant::now();
    let req = hyper::Request::post("/v1/chat/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(body))
        .expect("a valid request");
    // A kept-alive connection takes the next request once the last answer is wholly read.
    if let Err(e) = sender.ready().await {
        return (Outcome::Lost(format!("connection not ready ({}: {e:?})", kind(&e))), false);
    }
    let resp = match sender.send_request(req).await {
        Ok(r) => r,
        Err(e) => return (Outcome::Lost(format!("no answer ({}: {e:?})", kind(&e))), false),
    };
    let status = resp.status().as_u16();
    let close = resp
        .headers()
        .get(hyper::header::CONNECTION)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
    match resp.into_body().collect().await {
        Ok(b) => (classify(status, stream, &b.to_bytes(), start.elapsed()), !close),
        Err(e) => (Outcome::Lost(format!("body cut ({})", kind(&e))), false),
    }
}

fn kind(e: &hyper::Error) -> &'static str {
    if e.is_incomplete_message() {
        "incomplete message"
    } else if e.is_closed() {
        "connection closed"
    } else if e.is_canceled() {
        "canceled"
    } else {
        "other"
    }
}

/// What the HTTP clients share: the next request's number, how many are done.
pub struct Work {
    pub addr: SocketAddr,
    pub total: usize,
    pub max_tokens: u32,
    pub next: AtomicUsize,
    pub done: AtomicUsize,
    /// Set when every HTTP request is done (the WebSockets stop after their turn).
    pub finished: AtomicBool,
    pub deadline: Duration,
    /// The WebSockets' mean pause between turns (an agent's tool calls and thinking).
    pub ws_pause_ms: u64,
}

/// One HTTP client: takes request numbers until none are left; even ones stream.
pub async fn http_client(work: Arc<Work>) -> Tally {
    let mut tally = Tally::default();
    let mut sender: Option<Sender> = None;
    loop {
        let i = work.next.fetch_add(1, Ordering::Relaxed);
        if i >= work.total {
            break;
        }
        let stream = i % 2 == 0;
        let body = chat_body(i, stream, work.max_tokens);
        if sender.as_ref().is_none_or(|s| s.is_closed()) {
            sender = match tokio::time::timeout(work.deadline, connect(work.addr)).await {
                Ok(Ok(s)) => Some(s),
                Ok(Err(e)) => {
                    tally.add(Outcome::Lost(format!("connect: {e}")));
                    work.done.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Err(_) => {
                    tally.add(Outcome::Hung);
                    work.done.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
        }
        let s = sender.as_mut().expect("connected above");
        let (outcome, reusable) =
            match tokio::time::timeout(work.deadline, one(s, work.addr, body, stream)).await {
                Ok(r) => r,
                Err(_) => (Outcome::Hung, false),
            };
        if !reusable || !matches!(outcome, Outcome::Ok(_)) {
            sender = None;
        }
        tally.add(outcome);
        work.done.fetch_add(1, Ordering::Relaxed);
    }
    tally
}

/// One WebSocket client: turns on one connection (each continuing the previous response) until
/// the HTTP requests are done, at least `min_turns`, with a pause between turns (half to one and
/// a half times `ws_pause_ms`); a new connection after one is closed or lost.
pub async fn ws_client(work: Arc<Work>, id: usize, min_turns: usize) -> Tally {
    let mut tally = Tally::default();
    let mut ws: Option<WsClient> = None;
    let mut previous: Option<String> = None;
    let mut turn = 0usize;
    while turn < min_turns || !work.finished.load(Ordering::Relaxed) {
        // Different per connection and turn.
        let mean = work.ws_pause_ms.max(1);
        let pause = mean / 2 + ((id * 7919 + turn * 104_729) as u64) % mean;
        tokio::time::sleep(Duration::from_millis(pause)).await;
        turn += 1;
        if ws.is_none() {
            match tokio::time::timeout(work.deadline, WsClient::connect(work.addr)).await {
                Ok(Ok(c)) => ws = Some(c),
                Ok(Err(e)) => {
                    let e = e.to_string();
                    tally.add(match e.strip_prefix("upgrade refused: ") {
                        Some(status) => Outcome::Clean(format!("upgrade refused {status}")),
                        None => Outcome::Lost(format!("upgrade: {e}")),
                    });
                    continue;
                }
                Err(_) => {
                    tally.add(Outcome::Hung);
                    continue;
                }
            }
        }
        let c = ws.as_mut().expect("connected above");
        let start = Instant::now();
        let mut create = json!({
            "type": "response.create",
            "model": MODEL,
            "instructions": format!("You are soak agent {}.", id % 8),
            "input": [{"type": "message", "role": "user", "content": format!("Turn {turn} of connection {id}.")}],
            "max_output_tokens": work.max_tokens,
        });
        if let Some(p) = &previous {
            create["previous_response_id"] = json!(p);
        }
        let r = tokio::time::timeout(work.deadline, turn_on(c, &create, previous.as_deref(), start)).await;
        match r {
            Ok(Ok((outcome, prev, open))) => {
                tally.add(outcome);
                previous = prev;
                if !open {
                    ws = None;
                }
            }
            Ok(Err(e)) => {
                tally.add(Outcome::Lost(format!("websocket: {e}")));
                ws = None;
            }
            Err(_) => {
                tally.add(Outcome::Hung);
                ws = None;
            }
        }
    }
    if let Some(c) = ws {
        c.close().await;
    }
    tally
}

/// One turn on `c`: its outcome, the response the next turn continues, and whether the
/// connection stays open.
async fn turn_on(
    c: &mut WsClient,
    create: &Value,
    previous: Option<&str>,
    start: Instant,
) -> anyhow::Result<(Outcome, Option<String>, bool)> {
    let previous = previous.map(str::to_owned);
    c.send_text(&create.to_string()).await?;
    loop {
        let v: Value = match c.next_incoming().await? {
            Incoming::Text(t) => serde_json::from_str(&t)?,
            Incoming::Close(code) => {
                return Ok((Outcome::Clean(format!("closed {}", code.unwrap_or(1005))), previous, false))
            }
            Incoming::End => {
                return Ok((
                    Outcome::Lost("websocket ended mid-turn without a close frame".into()),
                    None,
                    false,
                ))
            }
        };
        let e = if v["error"].is_object() { &v["error"] } else { &v["response"]["error"] };
        let code = e["code"].as_str().or(e["type"].as_str()).unwrap_or("?");
        let kind = v["type"].as_str().unwrap_or("");
        let id = v["response"]["id"].as_str().map(str::to_owned);
        match kind {
            "response.completed" => return Ok((Outcome::Ok(start.elapsed()), id, true)),
            // Stopped at `max_output_tokens`: a whole answer of the length asked for.
            "response.incomplete" if v["response"]["incomplete_details"]["reason"] == "max_output_tokens" => {
                return Ok((Outcome::Ok(start.elapsed()), id, true))
            }
            "response.failed" | "response.incomplete" => {
                let why = v["response"]["incomplete_details"]["reason"].as_str().unwrap_or(code);
                return Ok((Outcome::Clean(format!("{kind} {why}")), previous, true));
            }
            "error" => {
                // A conversation the store lost starts again.
                let keep = if code == "previous_response_not_found" { None } else { previous };
                return Ok((Outcome::Clean(format!("error event {code}")), keep, true));
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_sorted_as_a_user_would_see_them() {
        let t = Duration::from_millis(1);
        let ok = |o: Outcome| matches!(o, Outcome::Ok(_));
        assert!(ok(classify(200, false, br#"{"choices":[{"message":{"content":"x"}}]}"#, t)));
        assert!(ok(classify(200, true, b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n", t)));
        let label = |o: Outcome| format!("{o:?}");
        assert_eq!(
            label(classify(429, false, br#"{"error":{"code":"backends_saturated"}}"#, t)),
            label(Outcome::Clean("429 backends_saturated".into()))
        );
        assert_eq!(
            label(classify(
                200,
                true,
                b"data: {\"error\":{\"code\":\"upstream_stream_error\"}}\n\ndata: [DONE]\n\n",
                t
            )),
            label(Outcome::Clean("stream error event upstream_stream_error".into()))
        );
        assert!(matches!(classify(200, true, b"data: {\"choices\":[]}\n\n", t), Outcome::Lost(_)));
        assert!(matches!(classify(502, false, b"<html>bad gateway</html>", t), Outcome::Lost(_)));
        assert!(matches!(classify(200, false, b"{\"object\":\"x\"}", t), Outcome::Lost(_)));
    }
}
