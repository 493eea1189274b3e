//! The guard model's calls (`[pools.safety.guard_model]`): a completion on one of the policy's
//! own pools, run through this same pipeline — routed, balanced and retried like any request
//! of that pool — with its answer captured instead of sent to a client.

use std::sync::{Arc, OnceLock, Weak};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use pingora::http::{RequestHeader, ResponseHeader};
use serde_json::{json, Value};

use super::downstream::Downstream;
use crate::request::head::Head;
use crate::request::LlmRoute;
use crate::safety::guard::Complete;
use crate::state::{AppState, RequestCtx};

/// The process's state, set once it is built (the pools, and so the checks that call them,
/// are built before it).
pub type LateState = Arc<OnceLock<Weak<AppState>>>;

/// Completions on pool `pool`.
pub struct PoolCompleter {
    pub state: LateState,
    pub pool: String,
}

#[async_trait]
impl Complete for PoolCompleter {
    async fn complete(&self, model: &str, prompt: String, max_tokens: u32) -> Result<String, String> {
        let state = self.state.get().and_then(Weak::upgrade).ok_or("warmpath is not serving yet")?;
        let pool = state
            .pools
            .iter()
            .find(|p| p.name == self.pool)
            .cloned()
            .ok_or_else(|| format!("no pool {:?}", self.pool))?;
        let body = json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
        let mut req = RequestHeader::build("POST", b"/v1/completions", Some(2)).map_err(|e| e.to_string())?;
        req.insert_header(http::header::CONTENT_TYPE, "application/json").map_err(|e| e.to_string())?;
        let head = Head::of(&req);
        let mut capture = Capture::default();
        let mut ctx = RequestCtx::new();
        let body = Bytes::from(body.to_string());
        super::run_on(&state, &pool, &mut capture, &mut ctx, LlmRoute::Completions, body, &head)
            .await
            .map_err(|e| e.to_string())?;
        if capture.status != 200 {
            let head = String::from_utf8_lossy(&capture.body[..capture.body.len().min(200)]).into_owned();
            return Err(format!("the guard pool answered {}: {head}", capture.status));
        }
        let v: Value =
            serde_json::from_slice(&capture.body).map_err(|e| format!("guard answer is not JSON: {e}"))?;
        v.pointer("/choices/0/text")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| "guard answer has no choices[0].text".to_owned())
    }
}

/// A client that keeps what it is sent.
#[derive(Default)]
struct Capture {
    status: u16,
    body: BytesMut,
}

#[async_trait]
impl Downstream for Capture {
    async fn write_response_header(&mut self, header: Box<ResponseHeader>, _: bool) -> pingora::Result<()> {
        self.status = header.status.as_u16();
        Ok(())
    }

    async fn write_response_body(&mut self, body: Option<Bytes>, _: bool) -> pingora::Result<()> {
        if let Some(b) = body {
            self.body.extend_from_slice(&b);
        }
        Ok(())
    }

    async fn gone(&mut self) {
        std::future::pending::<()>().await
    }

    fn close_after(&mut self) {}
}
