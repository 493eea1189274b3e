//! The HTTP routes of the API listener, each answered on the client's pingora session: the
//! LLM routes through the pipeline ([`serve_llm`]), `POST /v1/responses` as a Responses turn
//! ([`responses`]), `GET /v1/models` merged from the backends ([`models`]), `GET /health`
//! ([`health`]), the routes on stored responses ([`stored`]) and
//! conversations ([`conversations`]). Which route a request is, is decided in `entry.rs`; WebSocket mode, its
//! sibling, is `ws`.

pub mod body;
pub mod conversations;
pub mod health;
pub mod models;
pub mod query;
pub mod responses;
pub mod stored;

use bytes::Bytes;
use pingora::proxy::Session;
use warmpath_wire::openai::ApiError;

use crate::pipeline;
use crate::pipeline::respond::{send_error, send_json};
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

/// A route's answer: its JSON body with 200, or its error.
pub async fn reply(
    session: &mut Session,
    ctx: &mut RequestCtx,
    answer: Result<String, ApiError>,
) -> pingora::Result<()> {
    match answer {
        Ok(body) => {
            ctx.status = 200;
            send_json(session, 200, Bytes::from(body), &[]).await
        }
        Err(e) => {
            ctx.status = e.status;
            send_error(session, &e, &[]).await
        }
    }
}
