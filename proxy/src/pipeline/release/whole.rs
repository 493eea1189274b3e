//! A whole (not streamed) answer under the output checks: held until it is judged whole, then
//! released as it is, masked, or emptied (a chat answer's text and calls, a response object
//! `incomplete`).

use bytes::{Bytes, BytesMut};
use pingora::http::ResponseHeader;
use serde_json::Value;

use super::{answer_texts, OutputRelease};
use crate::safety::texts;
use crate::safety::Decision;

impl OutputRelease<'_> {
    /// A whole answer, judged: released as it is, masked, or emptied.
    pub(super) async fn release_whole(
        &mut self,
        mut header: Box<ResponseHeader>,
        body: BytesMut,
    ) -> pingora::Result<()> {
        let Ok(mut v) = serde_json::from_slice::<Value>(&body) else {
            header.insert_header("x-warmpath-safety", "output=unchecked")?;
            self.inner.write_response_header(header, false).await?;
            return self.inner.write_response_body(Some(body.freeze()), true).await;
        };
        let pieces = texts::pieces(&v).pieces;
        let judged: Vec<(String, usize)> = pieces.iter().map(|p| (p.text.clone(), 0)).collect();
        let mut j = self.safety.output(&self.context, &judged);
        let decision = match (&j.now, &mut j.pending) {
            (Decision::Pass, Some(p)) => p.decided().await,
            (d, _) => d.clone(),
        };
        let unsure = j.pending.as_ref().is_some_and(|p| !p.is_verdict());
        let word = if decision.blocks() {
            texts::filter_whole(&mut v);
            "block"
        } else {
            let mut shown = Vec::with_capacity(pieces.len());
            for (p, spans) in pieces.iter().zip(&j.redact) {
                let masked = (!spans.is_empty())
                    .then(|| texts::mask(&p.text, 0, spans, &mut vec![false; spans.len()]));
                if let Some(text) = &masked {
                    texts::put(&mut v, p.choice, p.loc, text.clone());
                }
                shown.push((p.choice, p.loc, masked.unwrap_or_else(|| p.text.clone())));
            }
            if !unsure {
                self.safety.passed_output(&answer_texts(shown.iter().map(|(c, l, t)| (*c, *l, t.as_str()))));
            }
            "pass"
        };
        self.blocked = decision.blocks();
        let out = if decision.blocks() || j.redact.iter().any(|s| !s.is_empty()) {
            Bytes::from(v.to_string())
        } else {
            body.freeze()
        };
        header.remove_header(&http::header::TRANSFER_ENCODING);
        header.insert_header(http::header::CONTENT_LENGTH, out.len().to_string())?;
        header.insert_header("x-warmpath-safety", format!("output={word}"))?;
        self.inner.write_response_header(header, false).await?;
        self.inner.write_response_body(Some(out), true).await
    }
}
