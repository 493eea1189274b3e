//! One check as a request meets it: what it said ([`Decision`]), the text it judged
//! ([`Subject`]), and — for the checks that call a service (`moderation`, `guard_model`) — the
//! deadline and the fail-open or fail-closed rule around the call, with every outcome counted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use prometheus::{Histogram, IntCounter, IntCounterVec};

use crate::config::{OnError, Stage};
use crate::observe::Metrics;

/// What the checks of one stage decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Pass,
    /// `check` found `category` (or failed closed: category `check_error`).
    Block {
        check: &'static str,
        category: String,
    },
}

impl Decision {
    pub fn blocks(&self) -> bool {
        matches!(self, Decision::Block { .. })
    }
}

pub use crate::request::head::Turn;

/// What a check judges: the `judged` turns, with `context` (earlier turns) for checks whose
/// verdict depends on it.
#[derive(Debug, Clone, Default)]
pub struct Subject {
    pub context: Arc<Vec<Turn>>,
    pub judged: Vec<Turn>,
}

/// A service that judges a subject: the categories it flags that block.
#[async_trait]
pub trait Judge: Send + Sync {
    async fn judge(&self, stage: Stage, subject: &Subject) -> Result<Vec<String>, String>;
}

/// A stage's metric handles for one check, resolved when the pool is built.
pub struct Counted {
    pool: String,
    check: &'static str,
    stage: &'static str,
    pass: IntCounter,
    block: IntCounter,
    audit_block: IntCounter,
    error: IntCounter,
    failed: IntCounter,
    timed_out: IntCounter,
    seconds: Histogram,
    findings: IntCounterVec,
}

impl Counted {
    pub fn new(metrics: &Metrics, pool: &str, check: &'static str, stage: Stage) -> Counted {
        let stage = match stage {
            Stage::Input => "input",
            Stage::Output => "output",
        };
        let verdict = |v: &str| metrics.safety_checks.with_label_values(&[pool, check, stage, v]);
        let errors = |k: &str| metrics.safety_check_errors.with_label_values(&[pool, check, stage, k]);
        Counted {
            pool: pool.to_owned(),
            check,
            stage,
            pass: verdict("pass"),
            block: verdict("block"),
            audit_block: verdict("audit_block"),
            error: verdict("error"),
            failed: errors("error"),
            timed_out: errors("timeout"),
            seconds: metrics.safety_check_seconds.with_label_values(&[check]),
            findings: metrics.safety_findings.clone(),
        }
    }

    /// One finding of `category`, and what was done with it.
    pub fn finding(&self, category: &str, action: &str) {
        self.findings.with_label_values(&[&self.pool, self.check, category, action]).inc();
    }

    pub fn took(&self, started: Instant) {
        self.seconds.observe(started.elapsed().as_secs_f64());
    }

    /// Counts the verdict: `blocked` is what the check found; under `audit` it never blocks.
    pub fn verdict(&self, blocked: Option<String>, audit: bool) -> Decision {
        match blocked {
            None => {
                self.pass.inc();
                Decision::Pass
            }
            Some(_) if audit => {
                self.audit_block.inc();
                Decision::Pass
            }
            Some(category) => {
                self.block.inc();
                Decision::Block { check: self.check, category }
            }
        }
    }
}

/// A check that calls a service, with its deadline and error rule.
pub struct Remote {
    pub name: &'static str,
    judge: Box<dyn Judge>,
    timeout: Duration,
    on_error: OnError,
    audit: bool,
    input: Option<Counted>,
    output: Option<Counted>,
}

/// How a remote check is configured, whatever it calls.
pub struct RemoteSpec {
    pub timeout_ms: u64,
    pub on_error: OnError,
    pub audit: bool,
    pub stages: Vec<Stage>,
}

impl Remote {
    pub fn new(
        name: &'static str,
        judge: Box<dyn Judge>,
        spec: RemoteSpec,
        metrics: &Metrics,
        pool: &str,
    ) -> Remote {
        let counted = |s: Stage| spec.stages.contains(&s).then(|| Counted::new(metrics, pool, name, s));
        Remote {
            name,
            judge,
            timeout: Duration::from_millis(spec.timeout_ms),
            on_error: spec.on_error,
            audit: spec.audit,
            input: counted(Stage::Input),
            output: counted(Stage::Output),
        }
    }

    /// Whether it runs on `stage`.
    pub fn runs_on(&self, stage: Stage) -> bool {
        self.counted(stage).is_some()
    }

    fn counted(&self, stage: Stage) -> Option<&Counted> {
        match stage {
            Stage::Input => self.input.as_ref(),
            Stage::Output => self.output.as_ref(),
        }
    }

    /// Judges `subject` within the deadline; an error or a timeout is counted and decided by
    /// `on_error` (never by audit: a check that cannot answer found nothing to audit). The
    /// flag is false for such a decision: it is not a verdict to remember.
    pub async fn run(&self, stage: Stage, subject: &Subject) -> (Decision, bool) {
        let Some(c) = self.counted(stage) else { return (Decision::Pass, true) };
        let started = Instant::now();
        let said = tokio::time::timeout(self.timeout, self.judge.judge(stage, subject)).await;
        c.took(started);
        let failure = match said {
            Ok(Ok(categories)) => {
                let action = if self.audit { "audit" } else { "block" };
                for cat in &categories {
                    c.finding(cat, action);
                }
                return (c.verdict(categories.into_iter().next(), self.audit), true);
            }
            Ok(Err(e)) => {
                c.failed.inc();
                e
            }
            Err(_) => {
                c.timed_out.inc();
                format!("no verdict within {:?}", self.timeout)
            }
        };
        c.error.inc();
        tracing::warn!(check = self.name, stage = c.stage, error = %failure, on_error = ?self.on_error, "safety check failed");
        let d = match self.on_error {
            OnError::Allow => Decision::Pass,
            OnError::Block => Decision::Block { check: self.name, category: "check_error".to_owned() },
        };
        (d, false)
    }
}

/// Runs every check in `checks` that runs on `stage` on `subject` at once: the first block (the
/// others are dropped, their calls cancelled), or a pass when all pass — with whether every
/// check gave a verdict (a pass by `on_error` is not one).
pub async fn run_all(checks: &[Arc<Remote>], stage: Stage, subject: &Subject) -> (Decision, bool) {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    let mut runs: FuturesUnordered<_> =
        checks.iter().filter(|c| c.runs_on(stage)).map(|c| c.run(stage, subject)).collect();
    let mut verdicts = true;
    while let Some((d, verdict)) = runs.next().await {
        if d.blocks() {
            return (d, verdict);
        }
        verdicts &= verdict;
    }
    (Decision::Pass, verdicts)
}
