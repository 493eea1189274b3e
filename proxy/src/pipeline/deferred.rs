//! The `tool_search` loop of a request whose tools were deferred (`tools::search` holds the
//! logic, this the I/O): each round's response is read — whole, or event by event with the
//! search calls cut out of what the client sees — and while the model only searches, warmpath
//! answers, appends the answer to the conversation and calls the same backend again (its KV
//! cache holds everything before the answer). The client gets one response.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header;
use pingora::http::ResponseHeader;
use serde_json::Value;
use warmpath_wire::openai::ApiError;
use warmpath_wire::sse;

use super::attempt::{self, note_failure, Attempt, Failure, Reached};
use super::downstream::Downstream;
use super::headers::{is_sse, response_header, WarmpathHeaders};
use super::relay::{end_stream, end_stream_with_error, ResponseId, StreamEnd, Tail};
use super::respond::send_error;
use super::Outgoing;
use crate::observe::trace::Kind;
use crate::request::head::RequestTemplate;
use crate::request::LlmRoute;
use crate::route::{self, key, Backend, Selected};
use crate::state::{AppState, RequestCtx};
use crate::tools::search::{self, SearchPlan, StreamRound};
use crate::tools::Api;
use crate::upstream::conn::Conn;
use crate::upstream::FailKind;

/// The request as it goes out round after round.
struct Rounds<'a> {
    state: &'a AppState,
    pool: &'a route::Pool,
    backend: &'a Arc<Backend>,
    /// The backend's place in its pool.
    index: usize,
    template: &'a RequestTemplate,
    plan: SearchPlan,
    body: Bytes,
    /// Rounds answered so far.
    done: usize,
    /// Responses native form: the search items the client is headers.
    search_items: Vec<Value>,
}

/// The model's turn that made the searches.
enum SearchTurn {
    /// Chat Completions: the message's content.
    Chat(Option<String>),
    /// Responses: the output items.
    Items(Vec<Value>),
}

impl Rounds<'_> {
    /// Answers the searches of a round and sends the next one; its response header, or why not.
    async fn next(
        &mut self,
        down: &mut dyn Downstream,
        ctx: &mut RequestCtx,
        turn: SearchTurn,
        calls: &[search::SearchCall],
    ) -> pingora::Result<Result<Option<(Conn, ResponseHeader)>, String>> {
        let t = Instant::now();
        let mut answer = match &turn {
            SearchTurn::Chat(content) => self.plan.answer(content.as_deref(), calls),
            SearchTurn::Items(items) => self.plan.answer_items(items, calls),
        };
        self.search_items.append(&mut answer.search_items);
        self.body = Bytes::from(self.plan.follow_up(&self.body, &answer.messages));
        answer.record(&self.state.metrics, &self.pool.name, t.elapsed());
        self.done += 1;
        let next = match attempt::open(self.state, down, self.backend, self.template, &self.body).await? {
            Reached::Header(up, header) => Ok(Some((up, header))),
            Reached::ClientGone => Ok(None),
            Reached::Failed(f) => Err(f.label().to_owned()),
        };
        if ctx.traced() {
            // The search answered and the next call sent, up to its response header.
            let attrs = vec![
                ("warmpath.round", (self.done as u64).into()),
                ("warmpath.searches", (calls.len() as u64).into()),
                ("warmpath.backend", self.backend.name.as_str().into()),
            ];
            ctx.span("tool_search round", Kind::Internal, t, attrs, next.as_ref().err().cloned());
        }
        Ok(next)
    }
}

/// Serves the rest of a request whose tools were deferred (`plan`), sent to `sel`, whose first
/// response header (status 200) is in.
pub(super) async fn serve(
    out: &Outgoing<'_>,
    sel: &Selected,
    plan: &SearchPlan,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    (up, header): (Conn, ResponseHeader),
    headers: WarmpathHeaders<'_>,
) -> pingora::Result<Attempt> {
    let mut r = Rounds {
        state: out.state,
        pool: &out.pool.route,
        backend: sel.backend(),
        index: sel.index,
        template: out.template,
        plan: plan.clone(),
        body: out.body.clone(),
        done: 0,
        search_items: Vec::new(),
    };
    if is_sse(&header) {
        stream(r, down, ctx, out.route, up, header, headers).await
    } else {
        whole(&mut r, down, ctx, up, header, headers).await
    }
}

async fn whole(
    r: &mut Rounds<'_>,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    mut up: Conn,
    mut header: ResponseHeader,
    headers: WarmpathHeaders<'_>,
) -> pingora::Result<Attempt> {
    let mut earlier: Option<Value> = None;
    loop {
        let bytes = match attempt::read_whole(&mut up).await {
            Ok(b) => b,
            Err(kind) if r.done == 0 => return Ok(Attempt::Failed(Failure::Io(kind))),
            Err(kind) => {
                note_failure(r.state, r.pool, r.backend, kind.label());
                return fail(down, ctx, "the backend failed during a tool_search round").await;
            }
        };
        if up.response_done() {
            r.state.upstream.release(up, &r.backend.peer);
        }
        let parsed: Option<Value> = serde_json::from_slice(&bytes).ok();
        let status = header.status.as_u16();
        let searches = parsed.as_ref().filter(|_| status == 200).and_then(|v| match r.plan.form {
            Api::Chat => search::search_calls(v).map(|(c, calls)| (SearchTurn::Chat(c), calls)),
            Api::Responses => search::search_items(v).map(|(items, calls)| (SearchTurn::Items(items), calls)),
        });
        let out = match (searches, parsed) {
            (Some((turn, calls)), Some(v)) if r.done < r.plan.max_rounds => {
                search::add_usage(&mut earlier, v.get("usage"));
                match r.next(down, ctx, turn, &calls).await? {
                    Ok(Some((next_up, next_header))) => {
                        up = next_up;
                        header = next_header;
                        continue;
                    }
                    Ok(None) => {
                        super::client_left(r.state, down, ctx);
                        ctx.status = 499;
                        return Ok(Attempt::Done);
                    }
                    Err(e) => {
                        tracing::warn!(backend = %r.backend.name, error = %e, "tool_search round failed");
                        return fail(down, ctx, "the backend failed during a tool_search round").await;
                    }
                }
            }
            (Some(_), Some(mut v)) => {
                // Rounds used up: the client must not see a call to a tool it does not have.
                search::strip_searches(&mut v);
                search::final_value(&mut v, earlier, std::mem::take(&mut r.search_items));
                v.to_string().into_bytes()
            }
            (None, Some(mut v)) if earlier.is_some() => {
                search::final_value(&mut v, earlier, std::mem::take(&mut r.search_items));
                v.to_string().into_bytes()
            }
            _ => bytes.to_vec(),
        };
        r.backend.record_success(&r.state.cfg.health, Instant::now());
        let mut resp = response_header(&header, &r.backend.name, headers)?;
        resp.insert_header(header::CONTENT_LENGTH, out.len().to_string())?;
        ctx.status = resp.status.as_u16();
        if let Some((_, rec)) = &mut ctx.recording {
            rec.header(status, header.headers.get(header::CONTENT_TYPE));
            rec.push(&out);
        }
        if let (Api::Responses, 200) = (r.plan.form, status) {
            let mut id = ResponseId::default();
            id.push(&out);
            if let Some(id) = id.take() {
                r.pool.policy.bind(key::response_session(&id), r.index);
            }
        }
        if down.write_response_header(Box::new(resp), false).await.is_err()
            || down.write_response_body(Some(Bytes::from(out)), true).await.is_err()
        {
            super::client_left(r.state, down, ctx);
        } else {
            ctx.first_byte.get_or_insert_with(Instant::now);
            if let Some((_, rec)) = &mut ctx.recording {
                rec.complete();
            }
        }
        return Ok(Attempt::Done);
    }
}

async fn fail(down: &mut dyn Downstream, ctx: &mut RequestCtx, what: &str) -> pingora::Result<Attempt> {
    let mut e = ApiError::internal(what.to_owned()).with_code("upstream_failed");
    e.status = 502;
    ctx.status = 502;
    send_error(down, &e, &[]).await?;
    Ok(Attempt::Done)
}

async fn stream(
    mut r: Rounds<'_>,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    route: LlmRoute,
    mut up: Conn,
    header: ResponseHeader,
    headers: WarmpathHeaders<'_>,
) -> pingora::Result<Attempt> {
    let mut resp = response_header(&header, &r.backend.name, headers)?;
    resp.insert_header(header::TRANSFER_ENCODING, "chunked")?;
    ctx.status = header.status.as_u16();
    if down.write_response_header(Box::new(resp), false).await.is_err() {
        super::client_left(r.state, down, ctx);
        return Ok(Attempt::Done);
    }
    if let Some((_, rec)) = &mut ctx.recording {
        rec.header(ctx.status, header.headers.get(header::CONTENT_TYPE));
    }
    let mut round = StreamRound::default();
    let mut usage: Option<Value> = None;
    let mut tail = Tail::default();
    let mut closing = r.state.lifecycle.closing();
    let closed = closing.wait_for(|c| *c);
    tokio::pin!(closed);
    loop {
        let mut split = sse::Splitter::default();
        loop {
            if up.response_done() {
                break;
            }
            let chunk = tokio::select! {
                biased;
                c = up.read_response_body() => Some(c),
                _ = down.gone() => {
                    super::client_left(r.state, down, ctx);
                    return Ok(Attempt::Done);
                }
                _ = &mut closed => None,
            };
            let Some(chunk) = chunk else {
                let msg = "warmpath is shutting down: the stream was cut; retry the request";
                let _ = end_stream(down, route, &tail, msg, StreamEnd::Shutdown).await;
                return Ok(Attempt::Done);
            };
            match chunk {
                Ok(Some(bytes)) => {
                    let mut out = String::new();
                    for data in split.feed(&bytes) {
                        if let Some(ev) = round.event(&data) {
                            out.push_str("data: ");
                            out.push_str(&ev);
                            out.push_str("\n\n");
                        }
                    }
                    if !out.is_empty() {
                        tail.push(out.as_bytes());
                        if let Some((_, rec)) = &mut ctx.recording {
                            rec.push(out.as_bytes());
                        }
                        if down.write_response_body(Some(Bytes::from(out)), false).await.is_err() {
                            super::client_left(r.state, down, ctx);
                            return Ok(Attempt::Done);
                        }
                        ctx.first_byte.get_or_insert_with(Instant::now);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    let kind = FailKind::of(&e);
                    note_failure(r.state, r.pool, r.backend, "stream_cut");
                    let msg = format!("the backend's stream broke off ({})", kind.label());
                    let _ = end_stream_with_error(down, route, &tail, &msg).await;
                    return Ok(Attempt::Done);
                }
            }
        }
        if up.response_done() {
            r.state.upstream.release(up, &r.backend.peer);
        }
        search::add_usage(&mut usage, round.usage.as_ref());
        if !round.done {
            note_failure(r.state, r.pool, r.backend, "stream_cut");
            let _ = end_stream_with_error(down, route, &tail, "the backend ended the stream without [DONE]")
                .await;
            return Ok(Attempt::Done);
        }
        let mut end = String::new();
        match round.searches() {
            Some((content, calls)) if r.done < r.plan.max_rounds => {
                match r.next(down, ctx, SearchTurn::Chat(content), &calls).await? {
                    Ok(Some((next_up, h))) if h.status.as_u16() == 200 && is_sse(&h) => {
                        up = next_up;
                        round = round.next_round();
                        continue;
                    }
                    Ok(Some((_, h))) => {
                        let msg = format!("the backend answered a tool_search round with {}", h.status);
                        let _ = end_stream_with_error(down, route, &tail, &msg).await;
                        return Ok(Attempt::Done);
                    }
                    Ok(None) => {
                        super::client_left(r.state, down, ctx);
                        return Ok(Attempt::Done);
                    }
                    Err(e) => {
                        tracing::warn!(backend = %r.backend.name, error = %e, "tool_search round failed");
                        let _ = end_stream_with_error(
                            down,
                            route,
                            &tail,
                            "the backend failed during a tool_search round",
                        )
                        .await;
                        return Ok(Attempt::Done);
                    }
                }
            }
            Some(_) => {
                // Rounds used up: end the turn warmpath held open.
                if let Some(c) = round.stop_chunk() {
                    end.push_str(&format!("data: {c}\n\n"));
                }
            }
            None => {}
        }
        r.backend.record_success(&r.state.cfg.health, Instant::now());
        let n = |u: &Value, k: &str| u.get(k).and_then(Value::as_u64);
        ctx.usage = usage.as_ref().and_then(|u| Some((n(u, "prompt_tokens")?, n(u, "completion_tokens")?)));
        end.push_str(&search::closing(usage, round.last_chunk.as_ref(), round.id.as_deref()));
        if let Some((_, rec)) = &mut ctx.recording {
            rec.push(end.as_bytes());
        }
        if down.write_response_body(Some(Bytes::from(end)), true).await.is_err() {
            super::client_left(r.state, down, ctx);
        } else if let Some((_, rec)) = &mut ctx.recording {
            rec.complete();
        }
        return Ok(Attempt::Done);
    }
}
