//! The HTTP routes of the API listener, each answered on the client's pingora session: the
//! LLM routes through the pipeline ([`serve_llm`]), `POST /v1/responses` as a Responses turn
//! ([`responses`]), `GET /v1/models` merged from the backends ([`models`]), `GET /health`
//! ([`health`]), the routes on stored responses ([`stored`]). Which route a request is, is decided in `entry.rs`; WebSocket mode, its
//! sibling, is `ws`.

pub mod body;
pub mod health;
pub mod models;
pub mod query;
pub mod responses;
pub mod stored;

use pingora::proxy::Session;

use crate::pipeline;
use crate::request::head::Head;
use crate::request::LlmRoute;
use crate::state::{AppState, RequestCtx};

/// `POST` on an LLM route (`/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`): the
/// body read, then the pipeline.
pub async fn serve_llm(
    state: &AppState,
    session: &mut Session,
    ctx: &mut RequestCtx,
    route: LlmRoute,
) -> pingora::Result<()> {
    let Some(body) = body::read_client_body(state, session, ctx).await? else { return Ok(()) };
    let head = Head::of(session.req_header()).with_key(ctx.key.clone());
    pipeline::run(state, session, ctx, route, body, &head).await
}
