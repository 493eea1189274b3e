//! `/v1/chat/completions` requests: the canonical body (tools sorted, volatile lines moved into a
//! note, searches put back before calls to deferred tools) and the prompt's blocks, rendered as
//! the bundled template renders it (or by an external model's own template).

use std::borrow::Cow;
use std::sync::Arc;

use serde::Deserialize;
use warmpath_wire::chat_template::{tool_call_text, PromptBuilder};
use warmpath_wire::openai::ApiError;

use super::body::{note_message, with_content, Body};
use super::{named_tool, Canon, Deferred, Edits, Lookups, Prepared};
use crate::request::{json, BodyStr, ContentView, LlmRequest, MessageView};
use crate::tools::def::CanonTool;
use crate::tools::search::{self, SearchPlan};
use crate::tools::{Api, DeferredSet, SEARCH_TOOL};

impl Canon {
    pub(super) fn prepare_chat(&self, req: &LlmRequest<'_>, hash: bool) -> Result<Prepared, ApiError> {
        let mut edits = Edits::default();
        let mut lookups = Lookups::default();
        let tools = self.tools(req)?;
        let lead_system =
            req.messages().first().is_some_and(|m| matches!(m.role.0.as_ref(), "system" | "developer"));
        let system_text =
            lead_system.then(|| req.messages()[0].content.as_ref().and_then(ContentView::text)).flatten();
        let moved = self.split_system(system_text.as_deref(), &mut edits);
        let note = moved.as_ref().map(|m| m.lines.join("\n"));
        if let Some((_, changed)) = &tools {
            edits.tools_reordered = *changed;
        }
        // Searches are answered for one choice; with `n` > 1 every tool stays.
        let one_choice = req.extra_raw("n").is_none_or(|n| n.get().trim() == "1" || n.get().trim() == "null");
        let plan = match (&self.defer, &tools) {
            (Some(d), Some((list, _))) if self.rewrite && one_choice => {
                d.plan(list, named_tool(req).as_deref(), Api::Chat, &|t| self.count_tokens(t))
            }
            _ => None,
        };
        let sent_tools: Option<&[Arc<CanonTool>]> =
            plan.as_ref().map(|p| p.kept.as_slice()).or(tools.as_ref().map(|(t, _)| t.as_slice()));
        let reinserts = plan.as_ref().map(|p| reinserts(&p.set, req.messages())).unwrap_or_default();
        if let Some(p) = &plan {
            edits.deferred = Some(Deferred {
                tools: p.set.tools.len(),
                saved_bytes: p.set.saved_bytes,
                saved_tokens: p.set.saved_tokens,
                reinserted: reinserts.iter().flatten().count(),
            });
        }

        let mut messages_end = 0;
        let body = self.rewrite.then(|| {
            let mut b = Body::new(req.model());
            b.key("messages");
            b.out.push('[');
            for (i, raw) in req.raw_messages().iter().enumerate() {
                if i > 0 {
                    b.out.push(',');
                }
                if let Some(Some(r)) = reinserts.get(i) {
                    b.out.push_str(&r.call_json);
                    b.out.push(',');
                    b.out.push_str(&search::tool_message(&r.id, &r.result));
                    b.out.push(',');
                }
                match (&moved, i) {
                    (Some(m), 0) => b.out.push_str(&with_content(raw.get(), &m.kept)),
                    _ => b.out.push_str(&json::minify(raw.get())),
                }
            }
            if let Some(n) = &note {
                b.out.push(',');
                b.out.push_str(&note_message(self.note_role, n));
            }
            messages_end = b.out.len();
            b.out.push(']');
            b.extras(req, sent_tools);
            b.finish()
        });
        // An external template renders the body the backend gets; the built-in layout renders
        // the request views (no second parse).
        let templated = match (&self.template, hash) {
            (Some(t), true) => self.template_blocks(t, body.as_deref(), req, &mut lookups),
            _ => None,
        };
        let blocks = templated.or_else(|| {
            hash.then(|| {
                let mut stable = PromptBuilder::default();
                let system = match (&moved, lead_system) {
                    (Some(m), _) => Some(Cow::Borrowed(m.kept.as_str())),
                    (None, true) => Some(system_text.clone().unwrap_or_default()),
                    (None, false) => None,
                };
                let lines = sent_tools.iter().flat_map(|t| t.iter().map(|t| t.line.as_str()));
                stable.system_turn(system.as_deref(), lines);
                let mut rest = PromptBuilder::default();
                let skip = usize::from(lead_system);
                for (i, m) in req.messages().iter().enumerate().skip(skip) {
                    if let Some(Some(r)) = reinserts.get(i) {
                        rest.turn("assistant", "", [tool_call_text(SEARCH_TOOL, &r.arguments).as_str()]);
                        rest.tool_result(&r.id, &r.result);
                    }
                    render_message(&mut rest, m);
                }
                if let Some(n) = &note {
                    rest.turn(self.note_role, n, []);
                }
                rest.generation_prompt();
                self.blocks(stable.finish(), rest.finish(), req, &mut lookups)
            })
        });
        let search = match (&plan, &self.defer) {
            (Some(p), Some(d)) => Some(SearchPlan {
                set: p.set.clone(),
                limit: d.limit,
                max_rounds: d.max_rounds,
                messages_end,
                form: Api::Chat,
                native: false,
            }),
            _ => None,
        };
        Ok(Prepared { body, blocks, edits, lookups, search })
    }
}

/// A search put back into the history: before the assistant message that first calls deferred
/// tools, a `tool_search` call for them and its result, so that the model sees the definitions
/// of the tools it uses.
#[derive(Debug)]
struct Reinsert {
    id: String,
    arguments: String,
    call_json: String,
    result: String,
}

/// One call of an assistant message's `tool_calls`, read leniently.
#[derive(Deserialize)]
struct CallView<'a> {
    #[serde(borrow, default)]
    id: Option<BodyStr<'a>>,
    #[serde(borrow)]
    function: FunctionView<'a>,
}

#[derive(Deserialize)]
struct FunctionView<'a> {
    #[serde(borrow)]
    name: BodyStr<'a>,
    #[serde(borrow, default)]
    arguments: Option<BodyStr<'a>>,
}

/// A message's tool calls; none when they do not parse.
fn calls_of<'a>(m: &MessageView<'a>) -> Vec<CallView<'a>> {
    m.tool_calls.and_then(|r| serde_json::from_str(r.get()).ok()).unwrap_or_default()
}

/// Per message, the search to put before it.
fn reinserts(set: &DeferredSet, messages: &[MessageView<'_>]) -> Vec<Option<Reinsert>> {
    let mut loaded = std::collections::HashSet::new();
    messages
        .iter()
        .map(|m| {
            let calls = calls_of(m);
            let mut missing: Vec<&Arc<CanonTool>> = Vec::new();
            for c in &calls {
                if let Some(t) = set.get(&c.function.name.0) {
                    if loaded.insert(t.name.clone()) {
                        missing.push(t);
                    }
                }
            }
            if missing.is_empty() {
                return None;
            }
            let first = calls.first().and_then(|c| c.id.as_ref()).map_or("", |s| s.0.as_ref());
            let id = format!("ts_{first}");
            let query = missing.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(" ");
            let (call_json, arguments) = search::synthetic_call(&id, &query);
            let result = crate::tools::result_text(&query, &missing);
            Some(Reinsert { id, arguments, call_json, result })
        })
        .collect()
}

/// One chat message into the prompt, the way the bundled template renders it.
pub(super) fn render_message(b: &mut PromptBuilder, m: &MessageView<'_>) {
    let text = m.content.as_ref().and_then(ContentView::text).unwrap_or_default();
    if m.role.0 == "tool" {
        b.tool_result(m.tool_call_id.as_ref().map_or("", |s| s.0.as_ref()), &text);
        return;
    }
    let calls: Vec<String> = calls_of(m)
        .iter()
        .map(|c| {
            tool_call_text(&c.function.name.0, c.function.arguments.as_ref().map_or("", |a| a.0.as_ref()))
        })
        .collect();
    b.turn(&m.role.0, &text, calls.iter().map(String::as_str));
}
