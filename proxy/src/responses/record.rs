//! Keeping a response's events while it runs ([`Recorder`], an [`EventSink`] in front of the
//! client's, or of none), and running a response in the background ([`background`]): detached
//! from the request that made it, its events kept for whoever follows them, cancelled by
//! aborting its task (which drops the backend connection, so the backend frees the request's
//! KV blocks).

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use serde_json::{json, Value};
use warmpath_wire::openai::ApiError;

use super::builder::Builder;
use super::events::Event;
use super::translate::{EventSink, ProxyHeaders};
use super::turn::Turn;
use crate::request::head::Head;
use crate::session::{Logged, Run};
use crate::state::{AppState, RequestCtx};

/// Keeps every event of a response in its [`Run`], passing them on to `inner` (the client), if
/// any; without a client, it is never gone.
pub struct Recorder<'a> {
    inner: Option<&'a mut dyn EventSink>,
    run: Arc<Run>,
}

impl<'a> Recorder<'a> {
    pub fn new(run: Arc<Run>, inner: Option<&'a mut dyn EventSink>) -> Recorder<'a> {
        Recorder { inner, run }
    }
}

#[async_trait]
impl EventSink for Recorder<'_> {
    async fn begin(&mut self, headers: &ProxyHeaders) -> pingora::Result<()> {
        match &mut self.inner {
            Some(s) => s.begin(headers).await,
            None => Ok(()),
        }
    }

    async fn events(&mut self, events: Vec<Event>, last: bool) -> pingora::Result<()> {
        let response = events.iter().rev().find_map(|e| e.response().map(str::to_owned));
        self.run
            .push(events.iter().map(|e| Logged { kind: e.kind.to_owned(), json: e.json.clone() }), response);
        match &mut self.inner {
            Some(s) => s.events(events, last).await,
            None => Ok(()),
        }
    }

    async fn error(&mut self, status: u16, body: Bytes, headers: &ProxyHeaders) -> pingora::Result<()> {
        // Failed before it began: the object says so.
        let (now, _) = self.run.response();
        self.run.finish(Some(failed(&now, &body)));
        match &mut self.inner {
            Some(s) => s.error(status, body, headers).await,
            None => Ok(()),
        }
    }

    async fn gone(&mut self) {
        match &mut self.inner {
            Some(s) => s.gone().await,
            None => std::future::pending().await,
        }
    }
}

/// `response` (an object's JSON text) marked failed with the error of an OpenAI error body.
fn failed(response: &str, error_body: &[u8]) -> String {
    let mut o: Value = serde_json::from_str(response).unwrap_or_else(|_| json!({}));
    let err: Value = serde_json::from_slice(error_body).unwrap_or_default();
    let code = err["error"]["code"].as_str().or(err["error"]["type"].as_str()).unwrap_or("server_error");
    let message = err["error"]["message"].as_str().unwrap_or("the response failed");
    o["status"] = json!("failed");
    o["error"] = json!({"code": code, "message": message});
    o.to_string()
}

/// Starts a run for `turn` (its first object as the response begins); `background`: counted
/// against the key's running ones (429 past `[session] max_background_per_key`).
pub fn start_run(state: &AppState, turn: &Turn, background: bool) -> Result<Arc<Run>, ApiError> {
    let mut first = Builder::new(turn.id.clone(), &turn.req).response_json();
    if background {
        // Not started yet: OpenAI's first status for a background response.
        first = first.replacen(r#""status":"in_progress""#, r#""status":"queued""#, 1);
    }
    state.sessions.runs.start(&turn.id, turn.tenant, background, first).map_err(|t| {
        let mut e = ApiError::invalid_request(format!(
            "{} background responses of this API key are running, the most allowed; wait for one to end or cancel one",
            t.0
        ))
        .with_code("too_many_background_responses");
        e.status = 429;
        e
    })
}

/// Runs `turn` detached from the request that made it; its events go to the returned run.
pub fn background(state: &Arc<AppState>, turn: Turn, head: Head) -> Result<Arc<Run>, ApiError> {
    let run = start_run(state, &turn, true)?;
    let (state, task_run) = (state.clone(), run.clone());
    let task = tokio::spawn(async move {
        // However the task ends — done, cancelled (aborted), or a panic — the run ends with it,
        // and its key's place is freed.
        let _ended = Ended { state: state.clone(), run: task_run.clone() };
        let mut ctx = RequestCtx::new();
        ctx.route = "responses";
        let mut sink = Recorder::new(task_run.clone(), None);
        let _ = super::run::run(&state, &mut sink, &mut ctx, &turn, &head, "background").await;
    });
    run.set_abort(task.abort_handle());
    Ok(run)
}

/// The run ended: its object is the last one its events carried. One that had already ended
/// (cancelled, or deleted) is left as it is — a deleted one is not kept again.
pub fn finish(state: &AppState, run: &Arc<Run>) {
    let (last, _) = run.response();
    if run.finish(Some(last)) {
        state.sessions.runs.ended(run);
    }
}

/// Ends a background run when its task ends, however it ends.
struct Ended {
    state: Arc<AppState>,
    run: Arc<Run>,
}

impl Drop for Ended {
    fn drop(&mut self) {
        finish(&self.state, &self.run);
    }
}
