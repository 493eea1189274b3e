//! The safety stage: checks that decide whether a request may go out (issue 23). Built so far:
//! the [`rules`] check on the input of every LLM request (chat, completions, and each backend
//! call of a Responses turn over HTTP or WebSocket all pass through the pipeline that calls
//! [`Safety::check_input`]): built-in detectors for personal data and secrets and a policy's
//! deny/allow patterns, in-process and in microseconds, so it runs before the request goes out
//! at no measurable cost. A finding blocks or is only counted; `audit` counts what would have
//! blocked. Not built yet: output checks and release policies, redaction, the `moderation` and
//! `guard_model` checks, per-turn incremental verdicts.

pub mod rules;

use std::borrow::Cow;
use std::time::Instant;

use prometheus::{Histogram, IntCounter, IntCounterVec};
use serde_json::Value;
use warmpath_wire::openai::ApiError;

use crate::config::{RuleAction, SafetyConfig};
use crate::observe::Metrics;
use crate::request::{ContentView, LlmRequest};
use rules::{Action, Rules, RulesSpec};

/// A pool's checks.
pub struct Safety {
    rules: Rules,
    audit: bool,
    counted: Counted,
}

/// The pool's metric handles, resolved once.
struct Counted {
    pool: String,
    pass: IntCounter,
    block: IntCounter,
    audit_block: IntCounter,
    seconds: Histogram,
    /// By category and action: labelled as findings come.
    findings: IntCounterVec,
}

impl std::fmt::Debug for Safety {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Safety").field("audit", &self.audit).finish_non_exhaustive()
    }
}

impl Safety {
    /// The checks `[pools.safety]` configures for pool `pool`, `None` when it configures none.
    pub fn from_config(c: &SafetyConfig, pool: &str, metrics: &Metrics) -> Result<Option<Safety>, String> {
        let Some(r) = &c.rules else { return Ok(None) };
        let action = |a: RuleAction| match a {
            RuleAction::Block => Action::Block,
            RuleAction::Redact => Action::Redact,
            RuleAction::Log => Action::Log,
        };
        let spec = RulesSpec {
            detect: r.detect.clone(),
            deny: r.deny.iter().map(|(k, p)| (k.clone(), p.0.as_str().to_owned())).collect(),
            allow: r.allow.iter().map(|p| p.0.as_str().to_owned()).collect(),
            actions: r.actions.iter().map(|(k, a)| (k.clone(), action(*a))).collect(),
            default_action: Some(action(r.default_action)),
        };
        let checks =
            |verdict: &str| metrics.safety_checks.with_label_values(&[pool, "rules", "input", verdict]);
        let counted = Counted {
            pool: pool.to_owned(),
            pass: checks("pass"),
            block: checks("block"),
            audit_block: checks("audit_block"),
            seconds: metrics.safety_check_seconds.with_label_values(&["rules"]),
            findings: metrics.safety_findings.clone(),
        };
        Ok(Some(Safety { rules: Rules::new(&spec)?, audit: r.audit, counted }))
    }

    /// Runs the input checks on `req`: what `x-warmpath-safety` says of them, or, where one
    /// blocks the request, that and the error to answer with.
    pub fn check_input(&self, req: &LlmRequest<'_>) -> Result<&'static str, (&'static str, ApiError)> {
        let started = Instant::now();
        let c = &self.counted;
        let mut blocked: Option<String> = None;
        for text in input_texts(req) {
            let verdict = self.rules.check(&text);
            for f in &verdict.findings {
                let taken = match self.rules.action(&f.category) {
                    _ if self.audit => "audit",
                    Action::Block => "block",
                    Action::Redact | Action::Log => "log",
                };
                c.findings.with_label_values(&[&c.pool, "rules", &f.category, taken]).inc();
            }
            blocked = blocked.or(verdict.blocked_by);
        }
        c.seconds.observe(started.elapsed().as_secs_f64());
        match blocked {
            None => {
                c.pass.inc();
                Ok("rules; input=pass")
            }
            Some(_) if self.audit => {
                c.audit_block.inc();
                Ok("rules; input=audit_block")
            }
            Some(category) => {
                c.block.inc();
                let e = ApiError::invalid_request(format!(
                    "the request was refused by this deployment's content policy (input: {category})"
                ));
                Err(("rules; input=block", e.with_code("content_policy_violation")))
            }
        }
    }
}

/// The texts of a request that input checks read: every message's content, the completion
/// prompt, a Responses request's instructions and input (item contents, text parts, tool
/// outputs).
pub fn input_texts<'a>(req: &LlmRequest<'a>) -> Vec<Cow<'a, str>> {
    let mut out = Vec::new();
    for m in &req.messages {
        match &m.content {
            Some(ContentView::Text(t)) => out.push(t.0.clone()),
            // Text parts joined as the template joins them; parts that are not text (an image)
            // do not exempt the text beside them.
            Some(ContentView::Parts(parts)) => out.push(Cow::Owned(
                parts.iter().filter_map(|p| p.text.as_ref()).map(|t| t.0.as_ref()).collect(),
            )),
            _ => {}
        }
    }
    for raw in [req.content, req.instructions].into_iter().flatten() {
        if let Ok(v) = serde_json::from_str::<Value>(raw.get()) {
            strings(v, &mut out);
        }
    }
    out
}

/// The strings of a prompt or input value, moved out of it: itself, a list's, and an item's
/// `content`, `text` and `output`.
fn strings(v: Value, out: &mut Vec<Cow<'_, str>>) {
    match v {
        Value::String(s) => out.push(Cow::Owned(s)),
        Value::Array(a) => a.into_iter().for_each(|x| strings(x, out)),
        Value::Object(mut o) => {
            for key in ["content", "text", "output"] {
                if let Some(x) = o.remove(key) {
                    strings(x, out);
                }
            }
        }
        _ => {}
    }
}
