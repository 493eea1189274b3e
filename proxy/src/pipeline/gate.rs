//! The input gate: a [`Downstream`] in front of the client that lets nothing of the answer
//! through until the input checks still running beside the backend call have decided
//! (`input.mode = "concurrent"`). A pass opens it, and the header gets `x-warmpath-safety`; a
//! block stops the answer — writes fail and `gone` resolves, so the forwarding code drops the
//! backend call at once (the backend frees its KV as on a client disconnect) — and the pipeline
//! then answers the client with the refusal.

use std::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::{Error, ErrorType};

use super::downstream::Downstream;
use crate::safety::{said, Decision, Pending};

pub(super) struct InputGate<'d> {
    inner: &'d mut dyn Downstream,
    pending: Option<Pending>,
    decision: Option<Decision>,
    /// The checks' names, the front of `x-warmpath-safety`.
    names: &'d str,
    /// When the client got the first bytes of the body (what the release policy held back is
    /// not sent until it lets go of it).
    first_sent: Option<Instant>,
    /// When the checks decided (for the trace's safety span).
    decided_at: Option<Instant>,
}

impl<'d> InputGate<'d> {
    /// `pending` is the verdict to wait for (none: the input already passed).
    pub fn new(inner: &'d mut dyn Downstream, pending: Option<Pending>, names: &'d str) -> InputGate<'d> {
        let decision = pending.is_none().then_some(Decision::Pass);
        InputGate { inner, pending, decision, names, first_sent: None, decided_at: None }
    }

    async fn decide(&mut self) -> &Decision {
        if self.decision.is_none() {
            let d = match &mut self.pending {
                Some(p) => p.decided().await,
                None => Decision::Pass,
            };
            self.decision = Some(d);
            self.decided_at = Some(Instant::now());
        }
        self.decision.get_or_insert(Decision::Pass)
    }

    /// The input's verdict, waiting for it.
    pub async fn verdict(&mut self) -> Decision {
        self.decide().await.clone()
    }

    /// When the checks still running beside the backend call decided (none: they had decided
    /// before it began, or nobody asked yet).
    pub fn decided_at(&self) -> Option<Instant> {
        self.decided_at
    }

    /// When the client got the first bytes of the answer's body.
    pub fn first_sent(&self) -> Option<Instant> {
        self.first_sent
    }

    /// The client, for the refusal.
    pub fn into_inner(self) -> &'d mut dyn Downstream {
        self.inner
    }

    fn refused() -> Box<Error> {
        Error::explain(ErrorType::WriteError, "the answer was stopped by an input safety check")
    }
}

#[async_trait]
impl Downstream for InputGate<'_> {
    async fn write_response_header(
        &mut self,
        mut header: Box<ResponseHeader>,
        end: bool,
    ) -> pingora::Result<()> {
        let d = self.decide().await.clone();
        if d.blocks() {
            return Err(Self::refused());
        }
        // The output release policy (where one runs) wrote its part already.
        let mut value = format!("{}; input={}", self.names, said(&d));
        if let Some(out) = header.headers.get("x-warmpath-safety").and_then(|v| v.to_str().ok()) {
            value = format!("{value}; {out}");
        }
        header.insert_header("x-warmpath-safety", value)?;
        self.inner.write_response_header(header, end).await
    }

    async fn write_response_body(&mut self, body: Option<Bytes>, end: bool) -> pingora::Result<()> {
        if self.decide().await.blocks() {
            return Err(Self::refused());
        }
        let some = body.as_ref().is_some_and(|b| !b.is_empty());
        self.inner.write_response_body(body, end).await?;
        if some {
            self.first_sent.get_or_insert_with(Instant::now);
        }
        Ok(())
    }

    async fn gone(&mut self) {
        if self.decision.is_none() {
            if let Some(p) = &mut self.pending {
                tokio::select! {
                    _ = self.inner.gone() => return,
                    d = p.decided() => self.decision = Some(d),
                }
            }
        }
        if self.decision.as_ref().is_some_and(Decision::blocks) {
            return;
        }
        self.inner.gone().await
    }

    fn close_after(&mut self) {
        self.inner.close_after();
    }

    fn stopped(&self) -> bool {
        self.decision.as_ref().is_some_and(Decision::blocks) || self.inner.stopped()
    }
}
