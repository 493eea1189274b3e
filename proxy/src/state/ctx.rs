//! One request's context (pingora's `CTX`): what the `logging` phase reports once the request
//! is over, filled in by the stages as it goes.

use std::sync::Arc;
use std::time::Instant;

use super::Pool;
use crate::cache::Recording;
use crate::limits::Held;
use crate::observe::trace::{Attr, Kind, Span, Trace};
use crate::observe::Active;

#[derive(Debug)]
pub struct RequestCtx {
    pub start: Instant,
    /// `x-request-id`: the client's, or one warmpath made (set before anything reads it).
    pub request_id: String,
    /// The `route` label: an LLM route, `models`, or `other`.
    pub route: &'static str,
    pub backend: Option<String>,
    /// The pool of that backend (the histograms' `pool` label): shared, not copied per request.
    pub pool: Option<Arc<Pool>>,
    /// The status the client got; 499 when it left first.
    pub status: u16,
    pub first_byte: Option<Instant>,
    pub client_gone: bool,
    /// A body with a length was cut short (the connection was closed).
    pub truncated: bool,
    /// The answer being copied aside for the pool's response cache (kept, or not, when the
    /// request is over).
    pub recording: Option<(Arc<Pool>, Recording)>,
    /// The caller's API key name (`[auth]` on).
    pub key: Option<Arc<str>>,
    /// The answer's `usage`: prompt and completion tokens, where it said.
    pub usage: Option<(u64, u64)>,
    /// Counts the request as being served (a drain waits for none).
    _active: Active,
    /// Its body's bytes, held against `[limits] max_buffered_mib` until the request ends.
    pub held: Option<Held>,
    /// Its trace, where `[tracing]` is on and it was sampled: the stages add spans to it.
    pub trace: Option<Trace>,
}

impl RequestCtx {
    pub fn new() -> RequestCtx {
        RequestCtx {
            start: Instant::now(),
            request_id: String::new(),
            route: "other",
            backend: None,
            pool: None,
            status: 0,
            first_byte: None,
            client_gone: false,
            truncated: false,
            recording: None,
            key: None,
            usage: None,
            _active: Active::start(),
            held: None,
            trace: None,
        }
    }
}

impl RequestCtx {
    /// A span of the request's trace, from `start` to now (nothing when it is not traced).
    pub fn span(
        &mut self,
        name: &'static str,
        kind: Kind,
        start: Instant,
        attrs: Vec<(&'static str, Attr)>,
        error: Option<String>,
    ) {
        if let Some(t) = &mut self.trace {
            t.span(name, kind, (start, Instant::now()), attrs, error);
        }
    }

    pub fn traced(&self) -> bool {
        self.trace.is_some()
    }

    /// Its trace (taken out of it) closes: the request's own span (named `name`, with `attrs`
    /// and what the context knows — route, request id, pool, backend) and, where a first byte
    /// went out, the wait for it as a span.
    pub fn close_trace(
        &self,
        mut trace: Trace,
        name: &'static str,
        mut attrs: Vec<(&'static str, Attr)>,
        error: Option<String>,
    ) -> Vec<Span> {
        if let Some(t) = self.first_byte {
            trace.span(
                "first token",
                Kind::Internal,
                (self.start, t),
                vec![("warmpath.route", self.route.into())],
                None,
            );
        }
        attrs.push(("warmpath.route", self.route.into()));
        if !self.request_id.is_empty() {
            attrs.push(("warmpath.request_id", self.request_id.as_str().into()));
        }
        attrs.extend(self.pool.as_ref().map(|p| ("warmpath.pool", p.name.as_str().into())));
        attrs.extend(self.backend.as_deref().map(|b| ("warmpath.backend", b.into())));
        if self.client_gone {
            attrs.push(("warmpath.client_gone", true.into()));
        }
        trace.finish_as(name, Instant::now(), attrs, error)
    }
}

impl Default for RequestCtx {
    fn default() -> Self {
        RequestCtx::new()
    }
}
