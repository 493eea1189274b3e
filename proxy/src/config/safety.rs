//! `[pools.safety]`: the checks a pool's requests go through. So far the `rules` check on the
//! input: built-in detectors and the policy's own patterns, each finding blocking the request
//! or only counted.

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
    pub rules: Option<RulesConfig>,
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuleAction {
    /// The request is refused (400 `content_policy_violation`).
    Block,
    /// Replaced by `[CATEGORY]` (not yet supported on the input: refused at load).
    Redact,
    /// Counted only.
    #[default]
    Log,
}
