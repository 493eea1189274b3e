//! `GET /health` on the API port: 200 with an empty body while every pool has a backend that
//! takes traffic, API keys (where on) are read, and the process is not draining (what vLLM's own `/health` answers, so load
//! balancers and Kubernetes probes pointed at the API port work unchanged); 503 otherwise, in
//! the OpenAI error shape, saying why. The admin listener's `/readyz` reports the same.

use pingora::http::ResponseHeader;
use pingora::proxy::Session;
use warmpath_wire::openai::ApiError;

use crate::pipeline::respond::send_error;
use crate::state::AppState;

/// Why the process should not get traffic now; `None` when it should.
pub fn readiness(state: &AppState) -> Option<String> {
    match state.unready().as_slice() {
        _ if state.lifecycle.draining() => Some("draining: warmpath is shutting down".to_owned()),
        [] => None,
        why => Some(format!("not ready: {}", why.join("; "))),
    }
}

/// Answers the probe; the status sent.
pub async fn serve(state: &AppState, session: &mut Session) -> pingora::Result<u16> {
    if let Some(why) = readiness(state) {
        send_error(session, &ApiError::unavailable(why).with_code("not_ready"), &[]).await?;
        return Ok(503);
    }
    let mut h = ResponseHeader::build(200, Some(1))?;
    h.insert_header(http::header::CONTENT_LENGTH, "0")?;
    crate::observe::request_id::stamp(session.req_header(), &mut h);
    session.write_response_header(Box::new(h), true).await?;
    Ok(200)
}
