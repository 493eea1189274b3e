//! `POST /v1/responses` over HTTP: the body read, then one Responses turn (`crate::responses`)
//! whose events go out as SSE or, not streaming, as the final response object; a pool that
//! serves Responses natively gets the request through the pipeline as it is.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;
use serde_json::Value;
use warmpath_wire::openai::ApiError;

use super::body::read_client_body;
use crate::config::ResponsesMode;
use crate::pipeline::respond::{send_error, send_json};
use crate::pipeline::{self, Downstream};
use crate::request::head::Head;
use crate::request::LlmRoute;
use crate::responses::events::Event;
use crate::responses::record::{self, Recorder};
use crate::responses::request::{self, ResponsesRequest};
use crate::responses::{self, EventSink, ProxyHeaders, Turn};
use crate::session::{tenant, Run};
use crate::state::{AppState, RequestCtx};

/// `POST /v1/responses`.
pub async fn serve(
    state: &Arc<AppState>,
    session: &mut Session,
    ctx: &mut RequestCtx,
) -> pingora::Result<()> {
    let Some(body) = read_client_body(state, session, ctx).await? else { return Ok(()) };
    let head = Head::of(session.req_header()).with_key(ctx.key.clone());
    let fields = match request::raw_fields(&body) {
        Ok(f) => f,
        Err(e) => return reject(state, session, ctx, &e).await,
    };
    // A pool that serves Responses natively gets the request as it is.
    let model = request::raw_str(&fields, "model").unwrap_or_default();
    if state.pools.for_model(&model).is_some_and(|p| p.responses == ResponsesMode::Native) {
        return pipeline::run(state, session, ctx, LlmRoute::Responses, body, &head).await;
    }
    let req = match ResponsesRequest::from_fields(fields, false) {
        Ok(r) => r,
        Err(e) => return reject(state, session, ctx, &e).await,
    };
    let tenant = tenant(head.owner());
    let turn = match Turn::prepare(state, req, tenant, None, 404).await {
        Ok(t) => t,
        Err(e) => return reject(state, session, ctx, &e).await,
    };
    if turn.req.background {
        let stream = turn.req.stream;
        let run = match record::background(state, turn, head) {
            Ok(r) => r,
            Err(e) => return reject(state, session, ctx, &e).await,
        };
        ctx.status = 200;
        if stream {
            return follow(session, &run, 0).await;
        }
        let (object, _) = run.response();
        return send_json(session, 200, Bytes::from(object), &[]).await;
    }
    let mut sink = HttpSink { session, stream: turn.req.stream, headers: Vec::new() };
    if !turn.req.store {
        responses::run(state, &mut sink, ctx, &turn, &head, "http").await?;
        return Ok(());
    }
    // A stored response keeps its events, for a client that lost its stream to resume.
    let run = match record::start_run(state, &turn, false) {
        Ok(r) => r,
        Err(e) => return reject(state, session, ctx, &e).await,
    };
    let mut recorder = Recorder::new(run.clone(), Some(&mut sink));
    let result = responses::run(state, &mut recorder, ctx, &turn, &head, "http").await;
    record::finish(state, &run);
    result.map(|_| ())
}

/// SSE as the Responses API writes it: `event: <type>` and `data: <json>` per event.
fn sse<'a>(events: impl Iterator<Item = (&'a str, &'a str)> + Clone) -> String {
    let mut out = String::with_capacity(events.clone().map(|(k, j)| k.len() + j.len() + 16).sum());
    for (kind, json) in events {
        out.push_str("event: ");
        out.push_str(kind);
        out.push_str("\ndata: ");
        out.push_str(json);
        out.push_str("\n\n");
    }
    out
}

/// Streams a run's events from index `from` (its `sequence_number`) as they are kept, until it
/// ends or the client leaves (which leaves the run as it is).
pub async fn follow(session: &mut Session, run: &Run, from: usize) -> pingora::Result<()> {
    let mut h = ResponseHeader::build(200, Some(4))?;
    h.insert_header(http::header::CONTENT_TYPE, "text/event-stream")?;
    h.insert_header(http::header::TRANSFER_ENCODING, "chunked")?;
    crate::observe::request_id::stamp(session.req_header(), &mut h);
    session.write_response_header(Box::new(h), false).await?;
    let mut at = from;
    loop {
        let (events, done) = run.events_from(at);
        at += events.len();
        if !events.is_empty() || done {
            let text = sse(events.iter().map(|e| (e.kind.as_str(), e.json.as_str())));
            session.write_response_body(Some(Bytes::from(text)), done).await?;
        }
        if done {
            return Ok(());
        }
        tokio::select! {
            () = run.changed(at) => {}
            () = Downstream::gone(session) => return Ok(()),
        }
    }
}

async fn reject(
    state: &AppState,
    session: &mut Session,
    ctx: &mut RequestCtx,
    e: &ApiError,
) -> pingora::Result<()> {
    let reason = if e.body.error.code.as_deref() == Some("previous_response_not_found") {
        "previous_response_not_found"
    } else {
        "bad_request"
    };
    state.metrics.refused(reason);
    ctx.status = e.status;
    send_error(session, e, &[]).await
}

/// An HTTP client: SSE events (`event: <type>` / `data: <json>`), or, not streaming, the final
/// response object (a failed one as a 502 error).
struct HttpSink<'a> {
    session: &'a mut Session,
    stream: bool,
    headers: ProxyHeaders,
}

impl HttpSink<'_> {
    fn header(
        &self,
        status: u16,
        content_type: &str,
        len: Option<usize>,
        headers: &ProxyHeaders,
    ) -> pingora::Result<ResponseHeader> {
        let mut h = ResponseHeader::build(status, Some(4 + headers.len()))?;
        h.insert_header(http::header::CONTENT_TYPE, content_type)?;
        match len {
            Some(n) => h.insert_header(http::header::CONTENT_LENGTH, n.to_string())?,
            None => h.insert_header(http::header::TRANSFER_ENCODING, "chunked")?,
        }
        for (k, v) in headers {
            h.insert_header(k.clone(), v.as_str())?;
        }
        crate::observe::request_id::stamp(self.session.req_header(), &mut h);
        Ok(h)
    }
}

#[async_trait]
impl EventSink for HttpSink<'_> {
    async fn begin(&mut self, headers: &ProxyHeaders) -> pingora::Result<()> {
        if self.stream {
            let h = self.header(200, "text/event-stream", None, headers)?;
            self.session.write_response_header(Box::new(h), false).await?;
        } else {
            self.headers = headers.clone();
        }
        Ok(())
    }

    async fn events(&mut self, events: Vec<Event>, last: bool) -> pingora::Result<()> {
        if self.stream {
            let out = sse(events.iter().map(|e| (e.kind, e.json.as_str())));
            return self.session.write_response_body(Some(Bytes::from(out)), last).await;
        }
        if !last {
            return Ok(());
        }
        let Some(terminal) = events.last() else { return Ok(()) };
        let Some(text) = terminal.response() else { return Ok(()) };
        if terminal.kind == "response.failed" {
            let response: Value = serde_json::from_str(text).unwrap_or_default();
            let msg = response["error"]["message"].as_str().unwrap_or("the backend failed").to_owned();
            let code = response["error"]["code"].as_str().unwrap_or("upstream_error").to_owned();
            let mut e = ApiError::internal(msg).with_code(&code);
            e.status = 502;
            let headers = std::mem::take(&mut self.headers);
            return self.error(502, Bytes::from(e.to_json()), &headers).await;
        }
        let body = Bytes::copy_from_slice(text.as_bytes());
        let h = self.header(200, "application/json", Some(body.len()), &self.headers)?;
        self.session.write_response_header(Box::new(h), false).await?;
        self.session.write_response_body(Some(body), true).await
    }

    async fn error(&mut self, status: u16, body: Bytes, headers: &ProxyHeaders) -> pingora::Result<()> {
        let h = self.header(status, "application/json", Some(body.len()), headers)?;
        self.session.write_response_header(Box::new(h), body.is_empty()).await?;
        if !body.is_empty() {
            self.session.write_response_body(Some(body), true).await?;
        }
        Ok(())
    }

    async fn gone(&mut self) {
        Downstream::gone(self.session).await
    }
}
