//! Deferred tool discovery. An agent request that carries more tool schemas than the policy's
//! threshold keeps its core tools (the policy's list, the one `tool_choice` names) and gets one
//! `tool_search` function instead of the rest, whose description lists the deferred tools by
//! name with a one-line summary. When the model calls `tool_search`, warmpath answers it itself
//! ([`search`]): the best BM25 matches' full definitions go at the END of the conversation, as
//! the search's result, and the backend is called again within the same client request.
//!
//! The stable tool list never changes for a discovered tool: that would change the tool block at
//! the top of the prompt and re-prefill the whole conversation each time. Instead, when a later
//! turn's history holds a call to a deferred tool, the definitions go back in right where they
//! were first loaded — a search call and its result inserted before that assistant message —
//! so the model sees them and every turn's prompt extends the previous one.

pub mod bm25;
pub mod def;
pub mod search;

use std::collections::HashSet;
use std::sync::Arc;

use moka::sync::Cache;
use serde_json::json;
use xxhash_rust::xxh3::Xxh3;

use crate::config::ToolsConfig;
use bm25::Bm25;
use def::CanonTool;

/// The name of the tool warmpath answers.
pub const SEARCH_TOOL: &str = "tool_search";

/// A pool's deferral policy.
#[derive(Debug)]
pub struct Deferrer {
    threshold: usize,
    core: HashSet<String>,
    pub limit: usize,
    pub max_rounds: usize,
    summary_chars: usize,
    sets: Cache<u64, Arc<DeferredSet>>,
}

/// The deferred tools of one tool list, their index and the `tool_search` tool listing them.
#[derive(Debug)]
pub struct DeferredSet {
    pub tools: Vec<Arc<CanonTool>>,
    pub index: Bm25,
    pub search_tool: Arc<CanonTool>,
    /// Bytes of the deferred definitions, minus the search tool's.
    pub saved_bytes: usize,
    /// Tokens of the same, where the tokenizer is known.
    pub saved_tokens: usize,
}

impl DeferredSet {
    pub fn get(&self, name: &str) -> Option<&Arc<CanonTool>> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// The best matches for a query, at most `limit`.
    pub fn search(&self, query: &str, limit: usize) -> Vec<&Arc<CanonTool>> {
        self.index.search(query, limit).into_iter().map(|i| &self.tools[i]).collect()
    }
}

/// The API a request speaks: where tools and calls sit differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// Chat Completions: `{"type":"function","function":{...}}`, calls in `message.tool_calls`.
    Chat,
    /// Responses: `{"type":"function","name":...}`, calls as `function_call` output items.
    Responses,
}

/// A request's tool list after deferral.
#[derive(Debug)]
pub struct Plan {
    /// The core tools and `tool_search`, in canonical order.
    pub kept: Vec<Arc<CanonTool>>,
    pub set: Arc<DeferredSet>,
}

impl Deferrer {
    pub fn new(cfg: &ToolsConfig) -> Option<Deferrer> {
        cfg.defer.then(|| Deferrer {
            threshold: cfg.threshold,
            core: cfg.core.iter().cloned().collect(),
            limit: cfg.search_limit,
            max_rounds: cfg.max_search_rounds,
            summary_chars: cfg.summary_chars,
            sets: Cache::builder().max_capacity(256).build(),
        })
    }

    /// Defers the tools of `tools` (canonical order) beyond the core set, when there are more
    /// than the threshold. `named` is the tool `tool_choice` names. Nothing is deferred when
    /// the client has a tool of the search tool's name, or nothing would be.
    /// `tokens` counts a text's tokens (for the saved-tokens metric; once per distinct set).
    pub fn plan(
        &self,
        tools: &[Arc<CanonTool>],
        named: Option<&str>,
        form: Api,
        tokens: &dyn Fn(&str) -> usize,
    ) -> Option<Plan> {
        if tools.len() <= self.threshold || tools.iter().any(|t| t.name == SEARCH_TOOL) {
            return None;
        }
        let is_core = |t: &CanonTool| self.core.contains(&t.name) || named == Some(t.name.as_str());
        let (kept, deferred): (Vec<_>, Vec<_>) = tools.iter().cloned().partition(|t| is_core(t));
        self.finish_plan(kept, deferred, form, tokens)
    }

    /// The Responses API's own form: the client marked the tools to defer
    /// (`defer_loading: true`) and listed `{"type": "tool_search"}`, which warmpath stands in
    /// for; no threshold applies.
    pub fn plan_marked(&self, tools: &[Arc<CanonTool>], tokens: &dyn Fn(&str) -> usize) -> Option<Plan> {
        let (deferred, kept): (Vec<_>, Vec<_>) =
            tools.iter().filter(|t| !t.hosted_search).cloned().partition(|t| t.defer_loading);
        self.finish_plan(kept, deferred, Api::Responses, tokens)
    }

    fn finish_plan(
        &self,
        mut kept: Vec<Arc<CanonTool>>,
        deferred: Vec<Arc<CanonTool>>,
        form: Api,
        tokens: &dyn Fn(&str) -> usize,
    ) -> Option<Plan> {
        if deferred.is_empty() {
            return None;
        }
        let mut h = Xxh3::new();
        h.update(if form == Api::Chat { b"chat\n" } else { b"resp\n" });
        for t in &deferred {
            h.update(t.json.as_bytes());
            h.update(b"\n");
        }
        let key = h.digest();
        let set = self.sets.get_with(key, || Arc::new(self.build_set(deferred, form, tokens)));
        kept.push(set.search_tool.clone());
        kept.sort_by(|a, b| a.name.cmp(&b.name).then_with(|| a.json.cmp(&b.json)));
        Some(Plan { kept, set })
    }

    fn build_set(
        &self,
        tools: Vec<Arc<CanonTool>>,
        form: Api,
        tokens: &dyn Fn(&str) -> usize,
    ) -> DeferredSet {
        let mut listing = String::new();
        for t in &tools {
            listing.push_str("\n- ");
            listing.push_str(&t.name);
            let summary = summary(&t.description, self.summary_chars);
            if !summary.is_empty() {
                listing.push_str(": ");
                listing.push_str(&summary);
            }
        }
        let description = format!(
            "Loads the full definitions of more tools, which you can then call like any other. \
             Call it with what you need a tool for (or tool names); the best matches come back \
             as its result. Tools available this way:{listing}"
        );
        let parameters = json!({"type": "object", "required": ["query"], "properties": {
            "query": {"type": "string", "description": "What you need a tool for, in a few words, or tool names."},
            "limit": {"type": "integer", "description": format!("Most tools to load (at most {}).", self.limit)},
        }});
        let def = match form {
            Api::Chat => json!({"type": "function", "function": {
                "name": SEARCH_TOOL, "description": description, "parameters": parameters}}),
            Api::Responses => json!({"type": "function", "name": SEARCH_TOOL, "description": description,
                "parameters": parameters}),
        };
        let search_tool = Arc::new(CanonTool::parse(&def.to_string()).expect("the search tool is an object"));
        let saved_bytes =
            tools.iter().map(|t| t.json.len() + 1).sum::<usize>().saturating_sub(search_tool.json.len());
        let saved_tokens = tools
            .iter()
            .map(|t| tokens(&format!("{}\n", t.line)))
            .sum::<usize>()
            .saturating_sub(tokens(&format!("{}\n", search_tool.line)));
        DeferredSet { index: Bm25::new(&tools), tools, search_tool, saved_bytes, saved_tokens }
    }
}

/// The first sentence of `text`, at most `max` characters (cut at a word).
fn summary(text: &str, max: usize) -> String {
    let line = text.lines().next().unwrap_or("").trim();
    let sentence = match line.find(". ") {
        Some(i) => &line[..=i],
        None => line,
    };
    if sentence.chars().count() <= max {
        return sentence.to_owned();
    }
    let cut: String = sentence.chars().take(max).collect();
    match cut.rfind(' ') {
        Some(i) if i > max / 2 => format!("{}…", &cut[..i]),
        _ => format!("{cut}…"),
    }
}

/// The content of a `tool_search` result: the definitions, one canonical JSON per line.
pub fn result_text(query: &str, found: &[&Arc<CanonTool>]) -> String {
    if found.is_empty() {
        return format!("No tool matches {query:?}. The tool_search description lists every tool available.");
    }
    let mut out = format!("Loaded {} tool definitions; call them like any other tool:", found.len());
    for t in found {
        out.push('\n');
        out.push_str(&t.json);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ToolsConfig;

    fn tool(name: &str, desc: &str) -> Arc<CanonTool> {
        let def = json!({"type": "function", "function": {"name": name, "description": desc,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}});
        Arc::new(CanonTool::parse(&def.to_string()).expect("tool"))
    }

    fn deferrer(threshold: usize, core: &[&str]) -> Deferrer {
        let cfg = ToolsConfig {
            defer: true,
            threshold,
            core: core.iter().map(|s| s.to_string()).collect(),
            ..ToolsConfig::default()
        };
        Deferrer::new(&cfg).expect("on")
    }

    #[test]
    fn above_the_threshold_core_tools_stay_and_the_rest_is_listed() {
        let tools: Vec<_> =
            (0..10).map(|i| tool(&format!("t{i}"), &format!("Does thing {i}. More words."))).collect();
        let d = deferrer(4, &["t3"]);
        let plan = d.plan(&tools, Some("t7"), Api::Chat, &|_| 0).expect("deferred");
        let kept: Vec<&str> = plan.kept.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(kept, ["t3", "t7", "tool_search"]);
        assert_eq!(plan.set.tools.len(), 8);
        let desc = &plan.set.search_tool.description;
        assert!(desc.contains("\n- t0: Does thing 0.") && !desc.contains("More words"), "{desc}");
        assert!(plan.set.saved_bytes > 0);
        // The same tool list reuses the built set.
        assert!(Arc::ptr_eq(
            &plan.set,
            &d.plan(&tools, Some("t7"), Api::Chat, &|_| 0).expect("deferred").set
        ));
        assert!(
            d.plan(&tools[..4], None, Api::Chat, &|_| 0).is_none(),
            "at the threshold nothing is deferred"
        );
        let mut clash = tools.clone();
        clash.push(tool("tool_search", "the client's own"));
        assert!(d.plan(&clash, None, Api::Chat, &|_| 0).is_none());
    }

    #[test]
    fn summaries_are_short() {
        assert_eq!(summary("Reads a file. Then more.", 80), "Reads a file.");
        assert_eq!(summary(&"word ".repeat(40), 20), "word word word word…");
        assert_eq!(summary("", 20), "");
    }
}
