//! `[pools.canon]` (stable prefixes) and `[pools.tools]` (deferred tool discovery).

use std::path::PathBuf;

use serde::Deserialize;

use super::{yes, Pattern};

/// `[pools.canon]`: stable prefixes. Requests are rewritten into their canonical arrangement
/// (tools by name with sorted keys, volatile system-prompt lines moved behind the prefix) and
/// their prompt is cut into prefix blocks whose hashes are the routing key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CanonConfig {
    /// Rewrite requests; off sends them as the client wrote them (block hashes are still
    /// computed where the policy routes by prefix).
    pub enabled: bool,
    /// Tools in name order, keys sorted at every depth, compact JSON.
    pub sort_tools: bool,
    /// Built-in volatile-line rules in force.
    pub volatile: Vec<BuiltinRule>,
    /// Your own volatile-line rules.
    pub rules: Vec<RuleConfig>,
    /// Longest line a rule moves, in bytes; a longer line is content, not a stamp, and stays.
    pub max_moved_line_bytes: usize,
    /// Role of the message that carries the moved lines, placed after the last message.
    pub note_role: NoteRole,
    /// Tokenizer of the prefix blocks.
    pub tokenizer: TokenizerKind,
    /// The backends' model's Hugging Face `tokenizer.json` (relative to the policy file's
    /// directory); takes the place of `tokenizer`.
    pub tokenizer_file: Option<PathBuf>,
    /// Its chat template: a `.jinja` file or a `tokenizer_config.json`. By default the one beside
    /// `tokenizer_file` (`chat_template.jinja`, else `tokenizer_config.json`), else the built-in
    /// ChatML layout.
    pub chat_template: Option<PathBuf>,
    /// Tokens per prefix block (the backends' KV block size).
    pub block_size: usize,
    /// Bytes per block where no tokenizer is known.
    pub chunk_bytes: usize,
    /// Memory for cached token ids of recurring prompt chunks, in MiB.
    pub token_cache_mib: u64,
}

impl Default for CanonConfig {
    fn default() -> Self {
        CanonConfig {
            enabled: false,
            sort_tools: true,
            volatile: vec![BuiltinRule::Date, BuiltinRule::Time, BuiltinRule::RequestId],
            rules: Vec::new(),
            max_moved_line_bytes: 200,
            note_role: NoteRole::System,
            tokenizer: TokenizerKind::Auto,
            tokenizer_file: None,
            chat_template: None,
            block_size: 16,
            chunk_bytes: 64,
            token_cache_mib: 64,
        }
    }
}

/// `[pools.tools]`: deferred tool discovery (needs `[pools.canon] enabled = true`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ToolsConfig {
    /// Replace the tools beyond the core set with `tool_search` when there are many.
    pub defer: bool,
    /// Defer only when a request carries more tools than this.
    pub threshold: usize,
    /// Tools never deferred.
    pub core: Vec<String>,
    /// Most definitions one `tool_search` call loads.
    pub search_limit: usize,
    /// Most `tool_search` rounds warmpath answers within one client request.
    pub max_search_rounds: usize,
    /// Longest one-line summary of a deferred tool in the `tool_search` description.
    pub summary_chars: usize,
}

impl Default for ToolsConfig {
    fn default() -> Self {
        ToolsConfig {
            defer: false,
            threshold: 32,
            core: Vec::new(),
            search_limit: 5,
            max_search_rounds: 3,
            summary_chars: 80,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BuiltinRule {
    /// `2026-12-03`, `12/03/2026`, `Dec 3, 2026`, `3 December 2026`.
    Date,
    /// `10:42:07`, `10:42 PM`, `T10:42`, Unix timestamps.
    Time,
    /// UUIDs and `request id:`-style labels.
    RequestId,
}

/// `[[pools.canon.rules]]`: lines of the system prompt matching `pattern` move behind the prefix.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    /// The `rule` label of the moved-bytes metric.
    pub name: String,
    pub pattern: Pattern,
    #[serde(default = "yes")]
    pub enabled: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NoteRole {
    System,
    Developer,
    User,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// `wp32k` for embedded pools (the bundled engine's tokenizer), `none` otherwise.
    Auto,
    /// The bundled engine's tokenizer and chat template.
    Wp32k,
    /// Fixed-size byte chunks of the canonical prompt text.
    None,
}
