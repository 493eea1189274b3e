//! Reading the whole request body under a size limit (413) and a deadline (408), or discarding
//! a small one that an answer does not need.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora::proxy::Session;
use warmpath_wire::openai::ApiError;

use crate::limits::Held;
use crate::pipeline::{self, Downstream};
use crate::state::{AppState, RequestCtx};

/// The client's body, or `None` once the client has its error (413, 408) or is gone.
pub async fn read_client_body(
    state: &AppState,
    session: &mut Session,
    ctx: &mut RequestCtx,
) -> pingora::Result<Option<Bytes>> {
    let limits = &state.cfg.limits;
    let deadline = Duration::from_millis(limits.body_read_timeout_ms);
    let mut held = state.buffered.hold();
    match read_body(session, limits.max_body_bytes, deadline, &mut held).await {
        Ok(b) => {
            state.metrics.request_bytes.observe(b.len() as f64);
            // Held until the request ends: the body is what goes to the backend.
            ctx.held = Some(held);
            Ok(Some(b))
        }
        Err(BodyError::Reject(e)) => {
            let reason = match e.status {
                413 => "too_large",
                408 => "body_timeout",
                503 => "buffers_full",
                _ => "bad_framing",
            };
            // The body was not read to its end: the connection cannot carry another request.
            session.set_keepalive(None);
            let down: &mut dyn Downstream = session;
            pipeline::reject(state, down, ctx, &e, reason).await?;
            if matches!(e.status, 413 | 503) {
                linger(session).await;
            }
            Ok(None)
        }
        Err(BodyError::ClientGone) => {
            state.metrics.client_disconnects.inc();
            ctx.status = 499;
            Ok(None)
        }
    }
}

/// 503: the process holds as many bodies and messages as `[limits] max_buffered_mib` allows.
fn buffers_full() -> ApiError {
    ApiError::unavailable("warmpath holds as many request bodies as it may; retry shortly")
        .with_code("server_busy")
}

/// Why the body could not be read.
#[derive(Debug)]
pub enum BodyError {
    /// Answer this and close.
    Reject(ApiError),
    /// The client broke the connection; there is no one to answer.
    ClientGone,
}

/// A failed body read: the client gone (a read failed or the connection closed), or a body
/// that is not well framed (a malformed chunk), which gets 400 at once.
fn body_error(e: &pingora::Error) -> BodyError {
    use pingora::ErrorType::{ConnectionClosed, ReadError, ReadTimedout};
    match e.etype() {
        ReadError | ConnectionClosed | ReadTimedout => BodyError::ClientGone,
        _ => BodyError::Reject(
            ApiError::invalid_request(format!(
                "the request body is malformed: {}",
                e.context.as_ref().map_or(e.reason_str(), |c| c.as_str())
            ))
            .with_code("bad_framing"),
        ),
    }
}

/// The body length the client declared in `Content-Length`, if it did.
fn declared_length(session: &Session) -> Option<u64> {
    session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
}

/// Largest body read and thrown away before an answer that does not need it.
const MAX_DISCARD_BYTES: u64 = 1 << 20;

/// Reads and discards a request body of known, small length before warmpath answers without
/// it (404, 405, `GET /v1/models` with a body), so the client's keep-alive connection stays
/// usable: pingora closes the connection after any answer given before the body was read.
/// Larger or chunked bodies, or one that does not arrive within `deadline`, still close it.
pub async fn discard_small_body(session: &mut Session, deadline: Duration) {
    if declared_length(session).is_some_and(|n| n > 0 && n <= MAX_DISCARD_BYTES) {
        let _ = tokio::time::timeout(deadline, session.drain_request_body()).await;
    }
}

/// Most bytes a lingering close reads and throws away, and for how long.
const LINGER_MAX_BYTES: usize = 64 << 20;
const LINGER_FOR: Duration = Duration::from_secs(2);

/// A lingering close (RFC 9112 §9.6, nginx's `lingering_close`): after answering before the
/// body was read, keeps reading and discarding what the client still sends, for a bounded time
/// and byte count, before the connection closes. Closing at once would reset a connection
/// whose client is still writing its body (most clients write it all before reading), and the
/// reset destroys the answer in its receive buffer: the client sees a broken pipe, not the 413
/// or 503. Discarded chunks are not held, so this takes nothing from the buffered-bytes budget.
async fn linger(session: &mut Session) {
    let drain = async {
        let mut seen = 0usize;
        while let Ok(Some(chunk)) = session.read_request_body().await {
            seen += chunk.len();
            if seen >= LINGER_MAX_BYTES {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_FOR, drain).await;
}

/// Reads the whole body (at most `limit` bytes, within `deadline`), its bytes taken from the
/// process's budget into `held` as they come (503 when the budget has none left).
pub async fn read_body(
    session: &mut Session,
    limit: usize,
    deadline: Duration,
    held: &mut Held,
) -> Result<Bytes, BodyError> {
    let declared = declared_length(session);
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(BodyError::Reject(ApiError::too_large(limit)));
    }
    if !held.resize(declared.unwrap_or(0) as usize) {
        return Err(BodyError::Reject(buffers_full()));
    }
    let expects_continue = session
        .req_header()
        .headers
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects_continue {
        // curl and others wait for this before sending bodies over 1 KiB.
        session.write_continue_response().await.map_err(|_| BodyError::ClientGone)?;
    }
    let mut buf = BytesMut::with_capacity(declared.unwrap_or(0).min(limit as u64) as usize);
    let read = async {
        while let Some(chunk) = session.read_request_body().await.map_err(|e| body_error(&e))? {
            if buf.len() + chunk.len() > limit {
                return Err(BodyError::Reject(ApiError::too_large(limit)));
            }
            if buf.len() + chunk.len() > held.bytes() && !held.resize(buf.len() + chunk.len()) {
                return Err(BodyError::Reject(buffers_full()));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(())
    };
    match tokio::time::timeout(deadline, read).await {
        Ok(r) => r?,
        Err(_) => {
            let mut e = ApiError::invalid_request(format!("request body not received within {deadline:?}"));
            e.status = 408;
            return Err(BodyError::Reject(e.with_code("request_timeout")));
        }
    }
    Ok(buf.freeze())
}
