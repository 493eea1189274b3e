//! The Responses routes on what warmpath stored, answered from its conversation store
//! (`crate::session`, scoped per API key: another key's response is a 404, exactly as an
//! unknown id): `GET` (whole, or its events streamed again from `starting_after`) and `DELETE
//! /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` (a background response), `GET
//! /v1/responses/{id}/input_items`, `POST /v1/responses/input_tokens` (counted with the
//! pool's tokenizer, no backend call) and `POST /v1/responses/compact`.

use pingora::proxy::Session;
use serde_json::json;
use warmpath_wire::openai::ApiError;

use super::body::read_client_body;
use super::query;
use crate::request::head::Head;
use crate::responses::list::ListQuery;
use crate::responses::request::{self, ResponsesRequest};
use crate::responses::{self, store_op, Turn};
use crate::session::tenant;
use crate::state::{AppState, RequestCtx};

/// Which stored-response route a request is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredRoute {
    Retrieve(String),
    Delete(String),
    InputItems(String),
    InputTokens,
    Compact,
    Cancel(String),
}

/// Names under `/v1/responses/` that are routes, not response ids.
const RESERVED: &[&str] = &["input_tokens", "compact"];

impl StoredRoute {
    /// The route of `method path`: `None` when the path is not one of these, `Err(allow)`
    /// when the method is not one the path takes.
    pub fn of(method: &http::Method, path: &str) -> Option<Result<StoredRoute, &'static str>> {
        let rest = path.strip_prefix("/v1/responses/")?;
        let (get, post, delete) =
            (method == http::Method::GET, method == http::Method::POST, method == http::Method::DELETE);
        Some(match rest.split('/').collect::<Vec<_>>()[..] {
            ["input_tokens"] if post => Ok(StoredRoute::InputTokens),
            ["input_tokens"] => Err("POST"),
            ["compact"] if post => Ok(StoredRoute::Compact),
            ["compact"] => Err("POST"),
            [id] if RESERVED.contains(&id) || id.is_empty() => return None,
            [id] if get => Ok(StoredRoute::Retrieve(id.to_owned())),
            [id] if delete => Ok(StoredRoute::Delete(id.to_owned())),
            [_] => Err("GET, DELETE"),
            [id, "input_items"] if get && !id.is_empty() => Ok(StoredRoute::InputItems(id.to_owned())),
            [_, "input_items"] => Err("GET"),
            [id, "cancel"] if post && !id.is_empty() => Ok(StoredRoute::Cancel(id.to_owned())),
            [_, "cancel"] => Err("POST"),
            _ => return None,
        })
    }

    /// Whether the route reads a request body.
    pub fn reads_body(&self) -> bool {
        matches!(self, StoredRoute::InputTokens | StoredRoute::Compact)
    }

    /// The `route` metric label.
    pub fn label(&self) -> &'static str {
        match self {
            StoredRoute::Retrieve(_) => "responses_retrieve",
            StoredRoute::Delete(_) => "responses_delete",
            StoredRoute::InputItems(_) => "responses_input_items",
            StoredRoute::InputTokens => "responses_input_tokens",
            StoredRoute::Cancel(_) => "responses_cancel",
            StoredRoute::Compact => "responses_compact",
        }
    }
}

/// Answers one stored-response route.
pub async fn serve(
    state: &AppState,
    session: &mut Session,
    ctx: &mut RequestCtx,
    route: StoredRoute,
) -> pingora::Result<()> {
    let head = Head::of(session.req_header()).with_key(ctx.key.clone());
    let tenant = tenant(head.owner());
    let pairs = query::pairs(session.req_header().uri.query());
    let answer = match &route {
        StoredRoute::Retrieve(id) => match resume_from(&pairs) {
            Ok(Some(from)) => match state.sessions.runs.get(tenant, id) {
                Some(run) => {
                    ctx.status = 200;
                    return super::responses::follow(session, &run, from).await;
                }
                None => Err(no_events(state, tenant, id).await),
            },
            Ok(None) => retrieve(state, tenant, id).await,
            Err(e) => Err(e),
        },
        StoredRoute::Cancel(id) => cancel(state, tenant, id).await,
        StoredRoute::Delete(id) => delete(state, tenant, id).await,
        StoredRoute::InputItems(id) => input_items(state, tenant, id, &pairs).await,
        StoredRoute::InputTokens => {
            let Some(body) = read_client_body(state, session, ctx).await? else { return Ok(()) };
            input_tokens(state, ctx, tenant, &body).await
        }
        StoredRoute::Compact => {
            let Some(body) = read_client_body(state, session, ctx).await? else { return Ok(()) };
            responses::compact::compact(state, ctx, &head, tenant, &body).await.map(|v| v.to_string())
        }
    };
    super::reply(session, ctx, answer).await
}

/// `Response with id '…' not found.` (404), for an unknown id and another key's alike.
pub fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("Response with id '{id}' not found.")).with_code("response_not_found")
}

/// `stream=true`: the index of the first event to send (`starting_after` + 1, else 0);
/// `None` when not streaming.
fn resume_from(q: &[(String, String)]) -> Result<Option<usize>, ApiError> {
    let value = |k: &str| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    if value("stream") != Some("true") {
        return Ok(None);
    }
    match value("starting_after") {
        None => Ok(Some(0)),
        Some(n) => n.parse::<usize>().map(|n| Some(n + 1)).map_err(|_| {
            ApiError::invalid_param("`starting_after` must be a sequence number", "starting_after")
        }),
    }
}

/// A stream asked of a response whose events this process does not keep.
async fn no_events(state: &AppState, tenant: u64, id: &str) -> ApiError {
    match responses::lookup(state, tenant, id).await {
        Ok(Some(_)) => ApiError::invalid_param(
            "this response's events are not kept here (made by another replica, or kept past their time): retrieve it without `stream`",
            "stream",
        ),
        Ok(None) => not_found(id),
        Err(e) => e,
    }
}

/// A background response's object as it stands (from its run), else the stored response's.
async fn retrieve(state: &AppState, tenant: u64, id: &str) -> Result<String, ApiError> {
    if let Some(run) = state.sessions.runs.get(tenant, id).filter(|r| r.background) {
        return Ok(run.response().0);
    }
    let c = responses::lookup(state, tenant, id).await?.ok_or_else(|| not_found(id))?;
    c.response.clone().ok_or_else(|| not_found(id))
}

/// Cancels a background response still running (its backend call dropped); one that ended is
/// returned as it ended.
async fn cancel(state: &AppState, tenant: u64, id: &str) -> Result<String, ApiError> {
    match state.sessions.runs.get(tenant, id) {
        Some(run) if run.background => {
            let (object, cancelled) = run.cancel();
            if cancelled {
                state.metrics.responses_turns.with_label_values(&["background", "cancelled"]).inc();
                state.sessions.runs.ended(&run);
            }
            Ok(object)
        }
        _ => match responses::lookup(state, tenant, id).await? {
            Some(_) => Err(ApiError::invalid_param(
                "only responses created with background=true can be cancelled",
                "response_id",
            )),
            None => Err(not_found(id)),
        },
    }
}

async fn delete(state: &AppState, tenant: u64, id: &str) -> Result<String, ApiError> {
    let run = state.sessions.runs.get(tenant, id);
    if let Some(r) = &run {
        r.cancel();
        state.sessions.runs.forget(id);
    }
    let found = store_op(state, "delete", state.sessions.responses.delete(tenant, id).await)?;
    if !found && run.is_none() {
        return Err(not_found(id));
    }
    Ok(json!({"id": id, "object": "response", "deleted": true}).to_string())
}

async fn input_items(
    state: &AppState,
    tenant: u64,
    id: &str,
    q: &[(String, String)],
) -> Result<String, ApiError> {
    let list = ListQuery::from_pairs(q.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
    let c = responses::lookup(state, tenant, id).await?.ok_or_else(|| not_found(id))?;
    Ok(list.page(&c.input_items())?.to_string())
}

async fn input_tokens(
    state: &AppState,
    ctx: &RequestCtx,
    tenant: u64,
    body: &[u8],
) -> Result<String, ApiError> {
    let req = ResponsesRequest::from_fields(request::raw_fields(body)?, false)?;
    let pool = state.pools.for_model(&req.model).ok_or_else(|| ApiError::model_not_found(&req.model))?;
    if let Some(key) = ctx.key.as_deref() {
        if !state.auth.may_use(key, &pool.name, &req.model) {
            return Err(crate::auth::answers::forbidden_model(&req.model));
        }
    }
    let turn = Turn::prepare(state, req, tenant, None, 404).await?;
    Ok(responses::input_tokens(pool, &turn)?.to_string())
}
