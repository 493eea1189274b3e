//! `[pools.safety]`: the checks a pool's requests and answers go through, and when. Three
//! checks — `rules` (in-process detectors and patterns), `moderation` (an HTTP service with
//! OpenAI's `/v1/moderations` shape) and `guard_model` (a Llama-Guard-style classifier served by
//! one of the policy's own pools) — each run on the input, the output or both; `input` says
//! whether input checks run beside the backend call or before it, `output` how answers are
//! released while their checks run.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::Pattern;

/// The built-in detectors of the `rules` check.
pub const DETECTORS: [&str; 7] =
    ["email", "phone", "payment_card", "iban", "us_ssn", "private_key", "api_key"];

/// `[pools.safety]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SafetyConfig {
    #[serde(default)]
    pub input: InputConfig,
    #[serde(default)]
    pub output: OutputConfig,
    #[serde(default)]
    pub rules: Option<RulesConfig>,
    #[serde(default)]
    pub moderation: Option<ModerationConfig>,
    #[serde(default)]
    pub guard_model: Option<GuardConfig>,
}

impl SafetyConfig {
    /// Any check configured at all.
    pub fn any(&self) -> bool {
        self.rules.is_some() || self.moderation.is_some() || self.guard_model.is_some()
    }
}

/// `[pools.safety.input]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputConfig {
    #[serde(default)]
    pub mode: InputMode,
    #[serde(default)]
    pub refusal: Refusal,
    /// The answer's text when `refusal = "message"`.
    #[serde(default = "default_refusal_message")]
    pub refusal_message: String,
}

impl Default for InputConfig {
    fn default() -> Self {
        InputConfig {
            mode: InputMode::default(),
            refusal: Refusal::default(),
            refusal_message: default_refusal_message(),
        }
    }
}

fn default_refusal_message() -> String {
    "I can't help with that request.".to_owned()
}

/// When input checks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputMode {
    /// Beside the backend call: nothing of the answer is released before the verdict, and a
    /// block cancels the call.
    #[default]
    Concurrent,
    /// Before the backend call (the sequential baseline).
    Before,
}

/// How a blocked input is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Refusal {
    /// 400 `content_policy_violation` in the OpenAI error shape.
    #[default]
    Error,
    /// A normal answer carrying `refusal_message`, finish reason `content_filter`.
    Message,
}

/// `[pools.safety.output]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputConfig {
    #[serde(default)]
    pub release: Release,
    /// Tokens (streamed deltas) per checked window.
    #[serde(default = "default_window")]
    pub window_tokens: usize,
    /// Tokens of the previous window checked again with the next, so that a finding split
    /// across two windows is seen.
    #[serde(default = "default_overlap")]
    pub overlap_tokens: usize,
    /// `release = "buffered"`: tokens held back behind the newest.
    #[serde(default = "default_lag")]
    pub lag_tokens: usize,
}

impl Default for OutputConfig {
    fn default() -> Self {
        OutputConfig {
            release: Release::default(),
            window_tokens: default_window(),
            overlap_tokens: default_overlap(),
            lag_tokens: default_lag(),
        }
    }
}

fn default_window() -> usize {
    32
}
fn default_overlap() -> usize {
    8
}
fn default_lag() -> usize {
    16
}

/// What the client sees of an answer while its output checks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Release {
    /// Each window is held until its verdict: nothing unchecked reaches the client.
    #[default]
    AfterCheck,
    /// Text goes out as it comes; checks trail it and a block cuts the stream there.
    Stream,
    /// Up to `lag_tokens` tokens are held back; a verdict within the lag stops text unseen.
    Buffered,
}

/// Which side of a request a check reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    Input,
    Output,
}

fn both_stages() -> Vec<Stage> {
    vec![Stage::Input, Stage::Output]
}

/// A check that may fail: fail open or closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// The request goes on as if the check had passed (counted).
    #[default]
    Allow,
    /// The request is refused as if the check had blocked it (counted).
    Block,
}

/// `[pools.safety.rules]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesConfig {
    /// Built-in detectors to run; empty: all of them.
    #[serde(default)]
    pub detect: Vec<String>,
    /// Named patterns: a match is a finding of the name's category.
    #[serde(default)]
    pub deny: BTreeMap<String, Pattern>,
    /// A finding whose text one of these matches is dropped.
    #[serde(default)]
    pub allow: Vec<Pattern>,
    /// Category (a detector or a deny name) → what a finding does.
    #[serde(default)]
    pub actions: BTreeMap<String, RuleAction>,
    /// What a finding of a category `actions` does not name does.
    #[serde(default)]
    pub default_action: RuleAction,
    /// Run and count, never block (to try a policy on live traffic).
    #[serde(default)]
    pub audit: bool,
    #[serde(default = "both_stages")]
    pub stages: Vec<Stage>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuleAction {
    /// The request is refused (input) or the answer cut (output).
    Block,
    /// Replaced by `[CATEGORY]`: in the request before it goes out, in the answer's text
    /// before it is released.
    Redact,
    /// Counted only.
    #[default]
    Log,
}

/// `[pools.safety.moderation]`: a service speaking OpenAI's `POST /v1/moderations`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModerationConfig {
    /// The service's base URL (`…/v1/moderations` is appended).
    pub url: super::BackendUrl,
    /// `model` sent with each request, where the service wants one.
    #[serde(default)]
    pub model: Option<String>,
    /// Environment variable holding the service's API key (sent as a bearer token).
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Category → score at or above which it blocks. Empty: the service's own `flagged`.
    #[serde(default)]
    pub thresholds: BTreeMap<String, f64>,
    #[serde(default = "default_check_timeout")]
    pub timeout_ms: u64,
    #[serde(default)]
    pub on_error: OnError,
    #[serde(default)]
    pub audit: bool,
    #[serde(default = "both_stages")]
    pub stages: Vec<Stage>,
}

/// `[pools.safety.guard_model]`: a Llama-Guard-style classifier on one of the policy's pools.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardConfig {
    /// The pool that serves it (by name).
    pub pool: String,
    /// The model name sent to that pool.
    pub model: String,
    /// A prompt template file (`{role}`, `{categories}`, `{conversation}`); default: Llama
    /// Guard 3's.
    #[serde(default)]
    pub template_file: Option<std::path::PathBuf>,
    /// Category code → description, in the prompt; default: Llama Guard 3's S1–S14.
    #[serde(default)]
    pub categories: BTreeMap<String, String>,
    /// Categories that block; empty: every `unsafe` verdict.
    #[serde(default)]
    pub block: Vec<String>,
    /// Earlier messages shown with the new ones, for context.
    #[serde(default = "default_history")]
    pub history_messages: usize,
    #[serde(default = "default_guard_timeout")]
    pub timeout_ms: u64,
    #[serde(default)]
    pub on_error: OnError,
    #[serde(default)]
    pub audit: bool,
    #[serde(default = "both_stages")]
    pub stages: Vec<Stage>,
    /// The template file's text, loaded with the policy file.
    #[serde(skip)]
    pub template: Option<String>,
}

fn default_check_timeout() -> u64 {
    1000
}
fn default_guard_timeout() -> u64 {
    5000
}
fn default_history() -> usize {
    4
}
