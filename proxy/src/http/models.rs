//! `GET /v1/models`: the union of what every backend that takes traffic lists, keeping each
//! backend's own entry (vLLM's `max_model_len` and the like), and only the models warmpath
//! would route to that backend's pool (and, with API keys, that the caller's key may use).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pingora::proxy::Session;
use serde_json::Value;

use crate::pipeline::respond::{send_error, send_json};
use crate::state::{AppState, RequestCtx};
use crate::upstream::get;

pub async fn serve(state: &AppState, session: &mut Session, ctx: &mut RequestCtx) -> pingora::Result<()> {
    let timeout = Duration::from_millis(state.cfg.upstream.models_timeout_ms);
    let now = Instant::now();
    let calls = state.fleet.backends().filter(|b| b.is_up(now)).map(|b| async move {
        let r = get(&state.upstream, &b.peer, "/v1/models", timeout).await;
        (b, r)
    });
    let results = futures_util::future::join_all(calls).await;
    let mut seen = HashSet::new();
    let mut data = Vec::new();
    let mut answered = 0;
    for (b, r) in results {
        let body = match r {
            Ok((200, body)) => body,
            Ok((status, _)) => {
                tracing::warn!(backend = %b.name, status, "GET /v1/models failed");
                continue;
            }
            Err(e) => {
                tracing::warn!(backend = %b.name, error = %e, "GET /v1/models failed");
                continue;
            }
        };
        let Ok(list) = serde_json::from_slice::<Value>(&body) else { continue };
        answered += 1;
        for m in list.get("data").and_then(Value::as_array).into_iter().flatten() {
            let Some(id) = m.get("id").and_then(Value::as_str) else { continue };
            let routed_here = state.pools.for_model(id).is_some_and(|p| p.name == b.pool);
            // A key limited to some models lists only those.
            let allowed = ctx.key.as_deref().is_none_or(|k| state.auth.may_use(k, &b.pool, id));
            if routed_here && allowed && seen.insert(id.to_owned()) {
                data.push(m.clone());
            }
        }
    }
    if answered == 0 {
        ctx.status = 503;
        let e = warmpath_wire::openai::ApiError::unavailable("no backend answered GET /v1/models")
            .with_code("no_healthy_backend");
        return send_error(session, &e, &[]).await;
    }
    ctx.status = 200;
    let body = serde_json::json!({ "object": "list", "data": data }).to_string();
    send_json(session, 200, Bytes::from(body), &[]).await
}
