//! Responses WebSocket mode on `GET /v1/responses`: one persistent connection per client, each
//! `response.create` event a turn of [`crate::responses`], its events sent back as text
//! messages. The connection keeps its latest response, so a turn that continues it
//! (`previous_response_id`) needs no store lookup, and the client sends only new items.
//!
//! One response is in flight per lane (`stream_id`, `lanes.rs`); later `response.create` events
//! of a lane wait in order (up to `[websocket] max_queued`), and up to `max_streams` lanes run
//! side by side. Each turn runs in its own task and hands its events over the connection's
//! bounded channel: a client that reads slowly slows its turns down (and the backends' streams
//! with them) instead of growing a buffer. Bad events get an `error` event and the connection
//! stays open; broken framing closes it with the code that says why (`frame::code`).

mod lanes;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::proxy::Session;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;
use warmpath_wire::openai::ApiError;

use crate::config::ResponsesMode;
use crate::limits::Held;
use crate::pipeline::respond::send_error;
use crate::request::head::Head;
use crate::responses::events::Event;
use crate::responses::request::{raw_fields, raw_str, ResponsesRequest};
use crate::responses::{EventSink, ProxyHeaders, Turn};
use crate::session::{tenant, Conversation};
use crate::state::{AppState, Live, RequestCtx};
use lanes::{tagged, LaneKey, Lanes, Running};
use warmpath_wire::websocket::{self as frame, code, Message, Reader};

/// RFC 6455 §1.3.
const ACCEPT_GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
/// Event batches a turn may have waiting for the client.
const CHANNEL: usize = 16;

/// A `GET` asking to upgrade to WebSocket.
pub fn is_upgrade(req: &RequestHeader) -> bool {
    req.headers
        .get(http::header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
}

/// `Sec-WebSocket-Accept` for a client's key.
pub fn accept_key(key: &str) -> String {
    let mut h = sha1_smol::Sha1::new();
    h.update(key.as_bytes());
    h.update(ACCEPT_GUID.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(h.digest().bytes())
}

fn handshake_error(req: &RequestHeader) -> Option<(ApiError, Option<(&'static str, String)>)> {
    let header = |n: &str| req.headers.get(n).and_then(|v| v.to_str().ok());
    if req.version != http::Version::HTTP_11 {
        return Some((ApiError::invalid_request("WebSocket needs HTTP/1.1"), None));
    }
    let connection_upgrade =
        header("connection").is_some_and(|c| c.split(',').any(|t| t.trim().eq_ignore_ascii_case("upgrade")));
    if !connection_upgrade {
        return Some((ApiError::invalid_request("`Connection: Upgrade` is missing"), None));
    }
    if header("sec-websocket-version") != Some("13") {
        let mut e = ApiError::invalid_request("only WebSocket version 13 is spoken here");
        e.status = 426;
        return Some((e, Some(("sec-websocket-version", "13".to_owned()))));
    }
    let key_ok = header("sec-websocket-key")
        .and_then(|k| base64::engine::general_purpose::STANDARD.decode(k.trim()).ok())
        .is_some_and(|k| k.len() == 16);
    if !key_ok {
        return Some((ApiError::invalid_request("`Sec-WebSocket-Key` is missing or malformed"), None));
    }
    None
}

/// Serves one WebSocket connection, from the upgrade to the close.
pub async fn serve(live: &Arc<Live>, session: &mut Session, ctx: &mut RequestCtx) -> pingora::Result<()> {
    let state = &live.load();
    ctx.route = "responses_ws";
    // A refused upgrade ends the connection: the client meant to leave HTTP on it.
    session.set_keepalive(None);
    let cfg = &state.cfg.websocket;
    if !cfg.enabled {
        ctx.status = 404;
        let e = ApiError::not_found("WebSocket mode is off ([websocket] enabled = false)");
        return send_error(session, &e, &[]).await;
    }
    if let Some((e, extra)) = handshake_error(session.req_header()) {
        ctx.status = e.status;
        state.metrics.refused("bad_upgrade");
        return send_error(session, &e, extra.as_slice()).await;
    }
    let Ok(slot) = state.ws.open(cfg.max_connections) else {
        ctx.status = 503;
        state.metrics.refused("websocket_connections");
        let e = ApiError::unavailable(format!(
            "{} WebSocket connections are open, the most allowed",
            cfg.max_connections
        ))
        .with_code("websocket_connection_limit_reached");
        return send_error(session, &e, &[]).await;
    };
    // The caller's key holds one of its WebSocket slots while the connection is open.
    let _key_slot = match ctx.key.as_deref() {
        None => None,
        Some(k) => match state.auth.open_websocket(k).await {
            Ok(s) => Some(s),
            Err(r) => {
                ctx.status = r.error.status;
                let reason = if r.error.status == 429 { "rate_limited" } else { "limits_unavailable" };
                state.metrics.refused(reason);
                return send_error(session, &r.error, &r.headers).await;
            }
        },
    };
    let key =
        session.req_header().headers.get("sec-websocket-key").and_then(|v| v.to_str().ok()).unwrap_or("");
    let mut h = ResponseHeader::build(101, Some(4))?;
    h.insert_header(http::header::UPGRADE, "websocket")?;
    h.insert_header(http::header::CONNECTION, "Upgrade")?;
    h.insert_header("sec-websocket-accept", accept_key(key.trim()))?;
    crate::observe::request_id::stamp(session.req_header(), &mut h);
    session.write_response_header(Box::new(h), false).await?;
    ctx.status = 101;
    let head = Head::of(session.req_header()).with_key(ctx.key.clone());
    let tenant = tenant(head.owner());
    let (tx, rx) = mpsc::channel(CHANNEL);
    let mut conn = Conn {
        state: state.clone(),
        live: live.clone(),
        head: Arc::new(head),
        tenant,
        reader: Reader::new(cfg.max_message_kib as usize * 1024),
        held: state.buffered.hold(),
        lanes: Lanes::default(),
        tx,
        rx,
    };
    let close = conn.run(session).await;
    // A client that left mid-turn: dropping the tasks' backend connections cancels the
    // generations.
    conn.lanes.abort_all();
    state.metrics.ws_closed.with_label_values(&[&close.to_string()]).inc();
    let who = ctx.key.as_deref().map(|k| format!("key {k}")).unwrap_or_default();
    state.metrics.recent.push("websocket", "", "", &close.to_string(), who);
    drop(slot);
    Ok(())
}

/// What a turn's task hands the connection.
enum TurnOutput {
    Events(Vec<Event>),
    /// The turn is over: the conversation after it, where it succeeded.
    Done(Option<Arc<Conversation>>),
}

struct Conn {
    /// The state the connection opened with (its limits).
    state: Arc<AppState>,
    /// Each turn runs under the state current when it starts (a reload applies to the next).
    live: Arc<Live>,
    head: Arc<Head>,
    tenant: u64,
    reader: Reader,
    /// The reader's bytes of messages not yet whole, against `[limits] max_buffered_mib`.
    held: Held,
    lanes: Lanes,
    /// Every running turn's events, by lane.
    tx: mpsc::Sender<(LaneKey, TurnOutput)>,
    rx: mpsc::Receiver<(LaneKey, TurnOutput)>,
}

/// Why the loop ended: the close code sent (or 1006 when the peer vanished).
type CloseCode = u16;

impl Conn {
    async fn run(&mut self, session: &mut Session) -> CloseCode {
        let cfg = self.state.cfg.websocket.clone();
        let ping_every = Duration::from_secs(cfg.ping_interval_s);
        let mut ping = tokio::time::interval_at(Instant::now() + ping_every, ping_every);
        let age_limit = Instant::now() + Duration::from_secs(cfg.max_age_s);
        let idle = Duration::from_secs(cfg.idle_timeout_s);
        let mut last_message = Instant::now();
        let mut last_frame = Instant::now();
        let mut aged = false;
        let mut drain = self.state.ws.draining();
        let mut draining = *drain.borrow();
        loop {
            let busy = self.lanes.busy();
            tokio::select! {
                r = session.read_request_body() => {
                    let bytes = match r {
                        Ok(Some(b)) => b,
                        Ok(None) | Err(_) => return 1006,
                    };
                    last_frame = Instant::now();
                    if let Some(code) = self.on_bytes(session, &bytes, draining, &mut last_message).await {
                        return code;
                    }
                }
                Some((lane, out)) = self.rx.recv() => {
                    match out {
                        TurnOutput::Events(events) => {
                            for e in &events {
                                match send(session, &tagged(&e.json, &lane)).await {
                                    Ok(n) => self.state.metrics.ws_bytes.with_label_values(&["out"]).inc_by(n as u64),
                                    Err(_) => return 1006,
                                }
                            }
                        }
                        TurnOutput::Done(c) => self.finish_turn(&lane, c),
                    }
                    if !self.lanes.running() {
                        if draining {
                            return close(session, code::RESTART, "server restarting").await;
                        }
                        if aged {
                            return self.age_out(session).await;
                        }
                    }
                }
                _ = ping.tick() => {
                    if last_frame.elapsed() > 2 * ping_every + Duration::from_secs(1) {
                        return close(session, code::GOING_AWAY, "no pong").await;
                    }
                    let p = frame::encode(frame::PING, b"warmpath");
                    if session.write_response_body(Some(Bytes::from(p)), false).await.is_err() {
                        return 1006;
                    }
                }
                _ = tokio::time::sleep_until(last_message + idle), if !busy => {
                    return close(session, code::NORMAL, "idle timeout").await;
                }
                _ = drain.changed(), if !draining => {
                    draining = true;
                    self.lanes.clear_queues();
                    if !self.lanes.running() {
                        return close(session, code::RESTART, "server restarting").await;
                    }
                }
                _ = tokio::time::sleep_until(age_limit), if !aged => {
                    aged = true;
                    self.lanes.clear_queues();
                    if !self.lanes.running() {
                        return self.age_out(session).await;
                    }
                }
            }
        }
    }

    /// Client bytes: each whole message handled; `Some` with the close code when the connection
    /// ends. Of the pings in one read only the latest is answered (a ping flood gets one pong
    /// per read, not one per ping).
    async fn on_bytes(
        &mut self,
        session: &mut Session,
        bytes: &[u8],
        draining: bool,
        last_message: &mut Instant,
    ) -> Option<CloseCode> {
        self.reader.push(bytes);
        // Past the process's budget for buffered messages: close (1013, try again later) rather
        // than grow.
        if !self.held.resize(self.reader.buffered()) {
            self.state.metrics.refused("buffers_full");
            return Some(
                close(session, code::TRY_AGAIN_LATER, "warmpath holds too much; try again later").await,
            );
        }
        let mut ping: Option<Vec<u8>> = None;
        loop {
            let msg = match self.reader.next_message() {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(v) => return Some(close(session, v.code, v.reason).await),
            };
            match msg {
                Message::Text(t) => {
                    *last_message = Instant::now();
                    self.state.metrics.ws_bytes.with_label_values(&["in"]).inc_by(t.len() as u64);
                    let result = if draining {
                        Err((
                            ApiError::unavailable("the server is restarting; reconnect")
                                .with_code("server_restarting"),
                            None,
                        ))
                    } else {
                        self.on_text(&t)
                    };
                    if let Err((e, lane)) = result {
                        if send(session, &tagged(&error_event(&e).json, &lane)).await.is_err() {
                            return Some(1006);
                        }
                    }
                }
                Message::Binary(_) => {
                    return Some(
                        close(session, code::UNSUPPORTED, "binary messages are not spoken here").await,
                    )
                }
                Message::Ping(p) => ping = Some(p),
                Message::Pong(_) => {}
                // Echo the peer's code, as RFC 6455 §5.5.1 asks.
                Message::Close(c, _) => return Some(close(session, c.unwrap_or(code::NORMAL), "").await),
            }
        }
        // Whole messages were taken out: what is left is held.
        self.held.resize(self.reader.buffered());
        if let Some(p) = ping {
            let pong = Bytes::from(frame::encode(frame::PONG, &p));
            if session.write_response_body(Some(pong), false).await.is_err() {
                return Some(1006);
            }
        }
        None
    }

    async fn age_out(&self, session: &mut Session) -> CloseCode {
        let mut e = ApiError::invalid_request(format!(
            "the connection reached its {} s limit; open a new one",
            self.state.cfg.websocket.max_age_s
        ))
        .with_code("websocket_connection_limit_reached");
        e.status = 400;
        let _ = send(session, &error_event(&e).json).await;
        close(session, code::GOING_AWAY, "websocket_connection_limit_reached").await
    }

    /// One client event. `Err` is the error event it gets, and the lane it concerns.
    fn on_text(&mut self, text: &str) -> Result<(), (ApiError, LaneKey)> {
        let fields = raw_fields(text.as_bytes()).map_err(|e| (e, None))?;
        let lane: LaneKey = raw_str(&fields, "stream_id").map(|s| Arc::from(s.as_ref()));
        let fail = |e: ApiError| (e, lane.clone());
        match raw_str(&fields, "type").as_deref() {
            Some("response.create") => {}
            Some(t) => {
                return Err(fail(
                    ApiError::invalid_request(format!("unknown event type {t:?}"))
                        .with_param("type")
                        .with_code("unknown_event_type"),
                ))
            }
            None => {
                return Err(fail(ApiError::invalid_request("an event needs a `type`").with_param("type")))
            }
        }
        let req = ResponsesRequest::from_fields(fields, true).map_err(fail)?;
        if self.state.pools.for_model(&req.model).is_some_and(|p| p.responses == ResponsesMode::Native) {
            return Err(fail(
                ApiError::invalid_request(format!(
                    "model {:?} is served by its backends' own Responses API; WebSocket mode needs responses = \"translate\"",
                    req.model
                ))
                .with_param("model"),
            ));
        }
        let cfg = &self.state.cfg.websocket;
        if let Some(req) =
            self.lanes.admit(lane.clone(), req, cfg.max_queued, cfg.max_streams).map_err(fail)?
        {
            self.start(lane, req);
        }
        Ok(())
    }

    fn start(&mut self, lane: LaneKey, req: ResponsesRequest) {
        let tx = self.tx.clone();
        let state = self.live.load();
        let head = self.head.clone();
        let (tenant, cached) = (self.tenant, self.lanes.cached(req.previous_response_id.as_deref()));
        let previous = req.previous_response_id.clone();
        let key = lane.clone();
        let task = tokio::spawn(async move {
            let mut sink = WsSink { tx: tx.clone(), lane: key.clone() };
            let done = match Turn::prepare(&state, req, tenant, cached.as_ref(), 400).await {
                Ok(turn) => {
                    let mut ctx = RequestCtx::new();
                    ctx.route = "responses_ws";
                    // A traced connection's turns are children of its span (the traceparent
                    // warmpath set on the upgrade).
                    ctx.trace = state.metrics.tracer.start(head.template.header("traceparent"), ctx.start);
                    let done = crate::responses::run(&state, &mut sink, &mut ctx, &turn, &head, "websocket")
                        .await
                        .ok()
                        .flatten();
                    if let Some(trace) = ctx.trace.take() {
                        let error = done.is_none().then(|| "the turn failed".to_owned());
                        state.metrics.tracer.submit(ctx.close_trace(
                            trace,
                            "websocket turn",
                            Vec::new(),
                            error,
                        ));
                    }
                    done
                }
                Err(e) => {
                    state.metrics.responses_turns.with_label_values(&["websocket", "error"]).inc();
                    let _ = tx.send((key.clone(), TurnOutput::Events(vec![error_event(&e)]))).await;
                    None
                }
            };
            let _ = tx.send((key, TurnOutput::Done(done))).await;
        });
        self.lanes.started(lane, Running { task, previous });
    }

    fn finish_turn(&mut self, lane: &LaneKey, done: Option<Arc<Conversation>>) {
        if let Some(next) = self.lanes.finished(lane, done) {
            self.start(lane.clone(), next);
        }
    }
}

/// A text message with one event; its payload's length.
async fn send(session: &mut Session, event: &str) -> pingora::Result<usize> {
    let f = frame::encode(frame::TEXT, event.as_bytes());
    session.write_response_body(Some(Bytes::from(f)), false).await.map(|()| event.len())
}

/// Sends a close frame and ends the body; returns the code.
async fn close(session: &mut Session, c: u16, reason: &str) -> CloseCode {
    let f = frame::close_frame(c, reason);
    let _ = session.write_response_body(Some(Bytes::from(f)), true).await;
    c
}

/// `{"type": "error", "status", "error": {...}}`.
pub fn error_event(e: &ApiError) -> Event {
    Event::plain("error", json!({"type": "error", "status": e.status, "error": e.body.error}).to_string())
}

/// A turn's events into the connection's channel, on its lane.
struct WsSink {
    tx: mpsc::Sender<(LaneKey, TurnOutput)>,
    lane: LaneKey,
}

#[async_trait]
impl EventSink for WsSink {
    async fn begin(&mut self, _headers: &ProxyHeaders) -> pingora::Result<()> {
        Ok(())
    }

    async fn events(&mut self, events: Vec<Event>, _last: bool) -> pingora::Result<()> {
        self.tx
            .send((self.lane.clone(), TurnOutput::Events(events)))
            .await
            .or_else(|_| pingora::Error::e_explain(pingora::ErrorType::ConnectionClosed, "websocket closed"))
    }

    async fn error(&mut self, status: u16, body: Bytes, _headers: &ProxyHeaders) -> pingora::Result<()> {
        let error = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v.get("error").cloned())
            .unwrap_or_else(|| json!({"type": "server_error", "code": "upstream_error", "message": String::from_utf8_lossy(&body), "param": null}));
        let event =
            Event::plain("error", json!({"type": "error", "status": status, "error": error}).to_string());
        self.events(vec![event], true).await
    }

    async fn gone(&mut self) {
        self.tx.closed().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rfc_accept_key() {
        assert_eq!(accept_key("dGhlIHNhbXBsZSBub25jZQ=="), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
    }

    #[test]
    fn error_events_carry_status_and_code() {
        let e = crate::responses::previous_not_found("resp_x", 400);
        let v: Value = serde_json::from_str(&error_event(&e).json).expect("json");
        assert_eq!(v["type"], "error");
        assert_eq!(v["status"], 400);
        assert_eq!(v["error"]["code"], "previous_response_not_found");
        assert_eq!(v["error"]["param"], "previous_response_id");
    }
}
