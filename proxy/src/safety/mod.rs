//! The safety stage: checks that decide whether a request may go out and what of its answer
//! the client may see (issue 23). Every LLM request of a pool with `[pools.safety]` — chat,
//! completions, and each backend call of a Responses turn over HTTP or WebSocket — meets it in
//! the pipeline, which calls [`Safety::input`] once the request is parsed and wraps the client
//! in the output release policy, which calls [`Safety::output`] per window of the answer.
//!
//! Three checks ([`check`]): `rules` ([`rules`]: in-process detectors and patterns, in
//! microseconds, so they always run inline, before anything goes out, and they alone can
//! redact), `moderation` ([`moderation`]: an HTTP service) and `guard_model` ([`guard`]: a
//! classifier on one of the policy's pools). The two remote checks run as a task beside the
//! backend call ([`Pending`]); the pipeline decides what waits for them.

pub mod check;
pub mod guard;
pub mod moderation;
pub mod rules;
pub mod texts;

use std::sync::Arc;
use std::time::Instant;

use prometheus::{Histogram, IntCounter};
use tokio::task::JoinHandle;

use crate::config::{InputConfig, OutputConfig, Release, RuleAction, RulesConfig, SafetyConfig, Stage};
use crate::observe::Metrics;
use crate::request::head::TurnTexts;
use crate::request::LlmRequest;
use check::{Counted, Remote, RemoteSpec};
pub use check::{Decision, Subject, Turn};
use rules::{Action, Finding, Rules, RulesSpec};

/// A pool's checks and release policy.
pub struct Safety {
    pub input: InputConfig,
    pub output: OutputConfig,
    /// The checks configured, comma-separated (`x-warmpath-safety`).
    pub names: String,
    rules: Option<RulesCheck>,
    remote: Arc<[Arc<Remote>]>,
    /// Output held back waiting for a verdict.
    pub held: Histogram,
    /// Turns that passed (hashed with the checks that passed them): a conversation's earlier
    /// turns are not judged again, so a turn's check cost stays flat as it grows.
    known: Known,
    turns_checked: [IntCounter; 2],
    turns_known: [IntCounter; 2],
}

/// Hashes of turns that passed a stage's checks.
#[derive(Clone)]
struct Known {
    cache: moka::sync::Cache<u64, ()>,
    /// Per stage, which checks ran (a turn passed on one stage counts on the other only where
    /// the same checks run on both).
    sig: [u64; 2],
}

impl Known {
    fn key(&self, stage: Stage, t: &Turn) -> u64 {
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(self.sig[stage as usize]);
        h.update(t.role.as_bytes());
        h.update(&[0]);
        h.update(t.text.as_bytes());
        h.digest()
    }

    fn has(&self, stage: Stage, t: &Turn) -> bool {
        self.cache.contains_key(&self.key(stage, t))
    }

    fn insert_all(&self, keys: &[u64]) {
        for k in keys {
            self.cache.insert(*k, ());
        }
    }
}

/// Most turns remembered as passed, per pool.
const KNOWN_TURNS: u64 = 100_000;

/// The `rules` check with its handles.
struct RulesCheck {
    rules: Rules,
    audit: bool,
    /// Some category redacts.
    redacts: bool,
    input: Option<Counted>,
    output: Option<Counted>,
}

/// What the services a pool's checks call are reached through (built by the server).
pub struct Services {
    pub upstream: Arc<crate::upstream::Upstream>,
    pub upstream_cfg: crate::config::UpstreamConfig,
    /// Where the moderation service's name resolved.
    pub resolved: Arc<crate::upstream::dns::Resolved>,
    /// The guard model's pool, where `guard_model` is configured.
    pub guard: Option<Arc<dyn guard::Complete>>,
}

impl std::fmt::Debug for Safety {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Safety").field("names", &self.names).finish_non_exhaustive()
    }
}

/// The input stage's start: refused at once by the rules, or going out — with its body
/// rewritten where the rules redact, and the remote checks' verdict to come where any run.
pub struct Input {
    pub refused: Option<Decision>,
    /// The request body with redacted spans, where any.
    pub body: Option<Vec<u8>>,
    pub pending: Option<Pending>,
    /// The request's turns (redacted), the context of output checks.
    pub turns: Arc<Vec<Turn>>,
}

/// One output window's judgement: the rules' now, the remote checks' to come.
pub struct Judged {
    pub now: Decision,
    /// Per text judged: the spans to mask (byte ranges of the text, overlap included), where the
    /// rules redact.
    pub redact: Vec<Vec<(usize, usize, String)>>,
    pub pending: Option<Pending>,
}

impl Safety {
    /// The checks `[pools.safety]` configures for pool `pool`, `None` when it configures none.
    pub fn from_config(
        c: &SafetyConfig,
        pool: &str,
        metrics: &Metrics,
        services: &Services,
    ) -> Result<Option<Safety>, String> {
        if !c.any() {
            return Ok(None);
        }
        let rules = c.rules.as_ref().map(|r| rules_check(r, pool, metrics)).transpose()?;
        let mut remote = Vec::new();
        let mut names: Vec<&str> = rules.iter().map(|_| "rules").collect();
        if let Some(m) = &c.moderation {
            let judge = moderation::Moderation::new(m, services).map_err(|e| format!("moderation: {e}"))?;
            let spec = RemoteSpec {
                timeout_ms: m.timeout_ms,
                on_error: m.on_error,
                audit: m.audit,
                stages: m.stages.clone(),
            };
            remote.push(Arc::new(Remote::new("moderation", Box::new(judge), spec, metrics, pool)));
            names.push("moderation");
        }
        if let Some(g) = &c.guard_model {
            let complete = services.guard.clone().ok_or("guard_model: its pool is not built")?;
            let judge = guard::Guard::new(g, g.template.clone(), complete);
            let spec = RemoteSpec {
                timeout_ms: g.timeout_ms,
                on_error: g.on_error,
                audit: g.audit,
                stages: g.stages.clone(),
            };
            remote.push(Arc::new(Remote::new("guard_model", Box::new(judge), spec, metrics, pool)));
            names.push("guard_model");
        }
        let stage_sig = |st: Stage| {
            let mut names = String::new();
            if rules.as_ref().is_some_and(|r| r.counted(st).is_some()) {
                names.push_str("rules,");
            }
            for r in remote.iter().filter(|r| r.runs_on(st)) {
                names.push_str(r.name);
                names.push(',');
            }
            xxhash_rust::xxh3::xxh3_64(names.as_bytes())
        };
        let known = Known {
            cache: moka::sync::Cache::builder()
                .max_capacity(KNOWN_TURNS)
                .time_to_idle(std::time::Duration::from_secs(3600))
                .build(),
            sig: [stage_sig(Stage::Input), stage_sig(Stage::Output)],
        };
        let turns = |outcome: &str| {
            [Stage::Input, Stage::Output].map(|st| {
                let stage = if st == Stage::Input { "input" } else { "output" };
                metrics.safety_turns.with_label_values(&[pool, stage, outcome])
            })
        };
        let release = match c.output.release {
            Release::AfterCheck => "after_check",
            Release::Stream => "stream",
            Release::Buffered => "buffered",
        };
        Ok(Some(Safety {
            input: c.input.clone(),
            output: c.output.clone(),
            names: names.join(","),
            rules,
            remote: remote.into(),
            held: metrics.safety_output_held_seconds.with_label_values(&[pool, release]),
            known,
            turns_checked: turns("checked"),
            turns_known: turns("known"),
        }))
    }

    /// Whether any check reads the answer.
    pub fn checks_output(&self) -> bool {
        self.rules.as_ref().is_some_and(|r| r.output.is_some())
            || self.remote.iter().any(|c| c.runs_on(Stage::Output))
    }

    /// Whether the rules may rewrite a request's text (a caller that sends token ids instead
    /// of text must send text).
    pub fn redacts_input(&self) -> bool {
        self.rules.as_ref().is_some_and(|r| r.input.is_some() && r.redacts)
    }

    /// Starts the input checks of `req` (parsed from `body`): the rules now, the remote
    /// checks as a task. Only turns not known to have passed are judged: `given` (a Responses
    /// turn's new items, its history as context) or, from the body, every turn not seen
    /// before.
    pub fn input(&self, req: &LlmRequest<'_>, body: &[u8], given: Option<&TurnTexts>) -> Input {
        let known = |t: &Turn| self.known.has(Stage::Input, t);
        let (context, candidates) = match given {
            Some(g) => (g.context.clone(), g.new.clone()),
            None => texts::input_turns(req).into_iter().partition(known),
        };
        let (seen, mut judged): (Vec<Turn>, Vec<Turn>) = candidates.into_iter().partition(known);
        self.turns_known[0].inc_by((context.len() + seen.len()) as u64);
        self.turns_checked[0].inc_by(judged.len() as u64);
        let mut out = Input { refused: None, body: None, pending: None, turns: Arc::default() };
        // Turns that pass go into `known`, but for those the rules rewrote: the client sends
        // them again as they were, and they must be masked again each time.
        let mut keys: Vec<u64> = Vec::new();
        if let Some(r) = &self.rules {
            if let Some(c) = &r.input {
                let started = Instant::now();
                let mut blocked = None;
                let mut redacts = false;
                for t in &mut judged {
                    let v = r.rules.check(&t.text);
                    for f in &v.findings {
                        c.finding(&f.category, r.taken(&f.category));
                    }
                    blocked = blocked.or(v.blocked_by);
                    match v.redacted.filter(|_| !r.audit) {
                        Some(red) => {
                            t.text = red;
                            redacts = true;
                        }
                        None => keys.push(self.known.key(Stage::Input, t)),
                    }
                }
                let decision = c.verdict(blocked, r.audit);
                if redacts && !decision.blocks() {
                    out.body = texts::rewrite_body(body, req, &mut |s| r.rules.check(s).redacted);
                }
                c.took(started);
                if decision.blocks() {
                    out.refused = Some(decision);
                    return out;
                }
            }
        } else {
            keys = judged.iter().map(|t| self.known.key(Stage::Input, t)).collect();
        }
        let mut all = context;
        all.extend(seen);
        let remote = !judged.is_empty() && self.remote.iter().any(|c| c.runs_on(Stage::Input));
        all.extend(judged.iter().cloned());
        out.turns = Arc::new(all);
        if remote {
            let n = out.turns.len() - judged.len();
            let subject = Subject { context: Arc::new(out.turns[..n].to_vec()), judged };
            out.pending =
                Some(Pending::spawn(self.remote.clone(), Stage::Input, subject, (self.known.clone(), keys)));
        } else {
            self.known.insert_all(&keys);
        }
        out
    }

    /// Remembers an answer's texts as passed (its output checks all passed), so that the next
    /// turn, which sends them back as history, does not judge them again.
    pub fn passed_output(&self, texts: &[String]) {
        let keys: Vec<u64> = texts
            .iter()
            .filter(|t| !t.is_empty())
            .map(|t| self.known.key(Stage::Output, &Turn { role: "assistant".into(), text: t.clone() }))
            .collect();
        self.turns_checked[1].inc_by(keys.len() as u64);
        self.known.insert_all(&keys);
    }

    /// Judges one window of the answer: `texts` per choice, each `(text, new_from)` where the
    /// bytes before `new_from` are the overlap with the previous window (already judged: a
    /// finding wholly inside it is not counted again).
    pub fn output(&self, context: &Arc<Vec<Turn>>, texts: &[(String, usize)]) -> Judged {
        let mut out = Judged { now: Decision::Pass, redact: vec![Vec::new(); texts.len()], pending: None };
        if let Some(r) = &self.rules {
            if let Some(c) = &r.output {
                let started = Instant::now();
                let mut blocked = None;
                for (i, (text, new_from)) in texts.iter().enumerate() {
                    let findings: Vec<Finding> =
                        r.rules.scan(text).into_iter().filter(|f| f.end > *new_from).collect();
                    for f in &findings {
                        c.finding(&f.category, r.taken(&f.category));
                        match r.rules.action(&f.category) {
                            Action::Block => blocked = blocked.or(Some(f.category.clone())),
                            Action::Redact if !r.audit => {
                                out.redact[i].push((f.start, f.end, f.category.to_uppercase()))
                            }
                            _ => {}
                        }
                    }
                }
                out.now = c.verdict(blocked, r.audit);
                c.took(started);
            }
        }
        if !out.now.blocks() && self.remote.iter().any(|c| c.runs_on(Stage::Output)) {
            let judged = texts
                .iter()
                .filter(|(t, _)| !t.is_empty())
                .map(|(t, _)| Turn { role: "assistant".into(), text: t.clone() })
                .collect();
            let subject = Subject { context: context.clone(), judged };
            out.pending = Some(Pending::spawn(
                self.remote.clone(),
                Stage::Output,
                subject,
                (self.known.clone(), Vec::new()),
            ));
        }
        out
    }
}

impl RulesCheck {
    fn counted(&self, stage: Stage) -> Option<&Counted> {
        match stage {
            Stage::Input => self.input.as_ref(),
            Stage::Output => self.output.as_ref(),
        }
    }

    /// The `action` label of a finding of `category`.
    fn taken(&self, category: &str) -> &'static str {
        match self.rules.action(category) {
            _ if self.audit => "audit",
            Action::Block => "block",
            Action::Redact => "redact",
            Action::Log => "log",
        }
    }
}

fn rules_check(r: &RulesConfig, pool: &str, metrics: &Metrics) -> Result<RulesCheck, String> {
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
    let counted = |s: Stage| r.stages.contains(&s).then(|| Counted::new(metrics, pool, "rules", s));
    let redacts =
        r.default_action == RuleAction::Redact || r.actions.values().any(|a| *a == RuleAction::Redact);
    Ok(RulesCheck {
        rules: Rules::new(&spec)?,
        audit: r.audit,
        redacts,
        input: counted(Stage::Input),
        output: counted(Stage::Output),
    })
}

/// The remote checks' verdict on one subject, computed by a task of its own (so it runs while
/// the request goes on); dropping it cancels the checks.
pub struct Pending {
    task: JoinHandle<(Decision, bool)>,
    done: Option<(Decision, bool)>,
}

impl Pending {
    /// Runs `checks` on `subject`; on a pass, `keys` go into `known`.
    fn spawn(
        checks: Arc<[Arc<Remote>]>,
        stage: Stage,
        subject: Subject,
        (known, keys): (Known, Vec<u64>),
    ) -> Pending {
        let task = tokio::spawn(async move {
            let (d, verdicts) = check::run_all(&checks, stage, &subject).await;
            // A pass only because a check failed open is not remembered.
            if !d.blocks() && verdicts {
                known.insert_all(&keys);
            }
            (d, verdicts)
        });
        Pending { task, done: None }
    }

    /// The verdict, waiting for it. Cancel-safe.
    pub async fn decided(&mut self) -> Decision {
        if let Some((d, _)) = &self.done {
            return d.clone();
        }
        let done = match (&mut self.task).await {
            Ok(d) => d,
            // The task panicked: a check that cannot answer, failed closed.
            Err(_) => (Decision::Block { check: "safety", category: "check_error".into() }, false),
        };
        self.done = Some(done.clone());
        done.0
    }

    /// The decision came from every check's own verdict (none failed open or closed).
    pub fn is_verdict(&self) -> bool {
        self.done.as_ref().is_some_and(|d| d.1)
    }

    /// The verdict where it is in, without waiting.
    pub fn ready(&mut self) -> Option<Decision> {
        if self.done.is_none() && !self.task.is_finished() {
            return None;
        }
        futures_util::FutureExt::now_or_never(self.decided())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `x-warmpath-safety`'s word for a stage's decision.
pub fn said(d: &Decision) -> &'static str {
    if d.blocks() {
        "block"
    } else {
        "pass"
    }
}
