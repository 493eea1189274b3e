//! `/v1/responses` requests: `instructions` is the system prompt, `input` the items; deferral
//! in the threshold form or the API's own (`{"type": "tool_search"}` with `defer_loading`
//! functions), for whole responses.

use std::borrow::Cow;
use std::sync::Arc;

use serde_json::value::RawValue;
use warmpath_wire::chat_template::PromptBuilder;
use warmpath_wire::openai::ApiError;

use super::body::{note_message, user_item, Body};
use super::items::{input_items, render_item, text_of};
use super::{named_tool, Canon, Deferred, Edits, Lookups, Prepared};
use crate::request::{json, BodyStr, LlmRequest};
use crate::tools::def::CanonTool;
use crate::tools::search::SearchPlan;
use crate::tools::Api;

impl Canon {
    pub(super) fn prepare_responses(&self, req: &LlmRequest<'_>, hash: bool) -> Result<Prepared, ApiError> {
        let mut edits = Edits::default();
        let mut lookups = Lookups::default();
        let tools = self.tools(req)?;
        if let Some((_, changed)) = &tools {
            edits.tools_reordered = *changed;
        }
        let instructions = req.instructions.and_then(|r| serde_json::from_str::<BodyStr<'_>>(r.get()).ok());
        let moved = self.split_system(instructions.as_ref().map(|s| s.0.as_ref()), &mut edits);
        let note = moved.as_ref().map(|m| m.lines.join("\n"));
        let items: Option<Vec<&RawValue>> = req.content.and_then(|c| serde_json::from_str(c.get()).ok());

        // Deferral: the client's own form (`{"type": "tool_search"}` with `defer_loading`
        // functions) or the threshold; whole responses only (a streamed Responses turn keeps
        // every tool, less the hosted search tool the backend may not know).
        let list: &[Arc<CanonTool>] = tools.as_ref().map_or(&[], |(t, _)| t.as_slice());
        let hosted = self.rewrite && self.defer.is_some() && list.iter().any(|t| t.hosted_search);
        let stream = req.streams();
        let one = req.extra_raw("n").is_none();
        let tokens = |t: &str| self.count_tokens(t);
        let plan = match &self.defer {
            Some(d) if self.rewrite && !stream && one && hosted => d.plan_marked(list, &tokens),
            Some(d) if self.rewrite && !stream && one => {
                d.plan(list, named_tool(req).as_deref(), Api::Responses, &tokens)
            }
            _ => None,
        };
        let sent_tools: Option<Vec<Arc<CanonTool>>> = match (&plan, &tools) {
            (Some(p), _) => Some(p.kept.clone()),
            (None, Some((t, _))) if hosted => Some(t.iter().filter(|t| !t.hosted_search).cloned().collect()),
            (None, Some((t, _))) => Some(t.clone()),
            (None, None) => None,
        };
        // The input as items, where warmpath changes it: native search items translated into
        // function calls the backend knows, searches put back before calls to deferred tools.
        let mut reinserted = 0;
        let rebuilt: Option<Vec<String>> = (plan.is_some() || hosted).then(|| {
            let set = plan.as_ref().map(|p| p.set.as_ref());
            match (&items, req.content) {
                (Some(items), _) => {
                    let (out, n) = input_items(items, set);
                    reinserted = n;
                    out
                }
                (None, Some(c)) => vec![user_item(c.get())],
                (None, None) => Vec::new(),
            }
        });
        if let Some(p) = &plan {
            edits.deferred = Some(Deferred {
                tools: p.set.tools.len(),
                saved_bytes: p.set.saved_bytes,
                saved_tokens: p.set.saved_tokens,
                reinserted,
            });
        }

        let blocks = hash.then(|| {
            let mut stable = PromptBuilder::default();
            let system = match &moved {
                Some(m) => Some(m.kept.as_str()),
                None => instructions.as_ref().map(|s| s.0.as_ref()),
            };
            let lines = sent_tools.iter().flat_map(|t| t.iter().map(|t| t.line.as_str()));
            stable.system_turn(system, lines);
            let mut rest = PromptBuilder::default();
            match (&rebuilt, &items, req.content) {
                (Some(r), _, _) => {
                    for i in r {
                        if let Ok(raw) = serde_json::from_str::<&RawValue>(i) {
                            render_item(&mut rest, raw);
                        }
                    }
                }
                (None, Some(items), _) => items.iter().for_each(|i| render_item(&mut rest, i)),
                (None, None, Some(c)) => rest.turn("user", &text_of(Some(c.get())).unwrap_or_default(), []),
                (None, None, None) => {}
            }
            if let Some(n) = &note {
                rest.turn(self.note_role, n, []);
            }
            rest.generation_prompt();
            self.blocks(stable.finish(), rest.finish(), req, &mut lookups)
        });

        let mut input_end = 0;
        let body = self.rewrite.then(|| {
            let mut b = Body::new(req.model());
            if let Some(raw) = req.instructions {
                b.key("instructions");
                match &moved {
                    Some(m) => b.out.push_str(&json::string(&m.kept)),
                    None => b.out.push_str(&json::minify(raw.get())),
                }
            }
            let as_list: Option<Vec<Cow<'_, str>>> = match (&rebuilt, &note, &items, req.content) {
                (Some(r), _, _, _) => Some(r.iter().map(|s| Cow::Borrowed(s.as_str())).collect()),
                (None, Some(_), Some(items), _) => {
                    Some(items.iter().map(|i| json::minify(i.get())).collect())
                }
                (None, Some(_), None, Some(c)) => Some(vec![Cow::Owned(user_item(c.get()))]),
                (None, Some(_), None, None) => Some(Vec::new()),
                (None, None, _, _) => None,
            };
            match (as_list, req.content) {
                (Some(list), _) => {
                    b.key("input");
                    b.out.push('[');
                    for (k, i) in list.iter().enumerate() {
                        if k > 0 {
                            b.out.push(',');
                        }
                        b.out.push_str(i);
                    }
                    if let Some(n) = &note {
                        if !list.is_empty() {
                            b.out.push(',');
                        }
                        b.out.push_str(&note_message(self.note_role, n));
                    }
                    input_end = b.out.len();
                    b.out.push(']');
                }
                (None, Some(c)) => {
                    b.key("input");
                    b.out.push_str(&json::minify(c.get()));
                }
                (None, None) => {}
            }
            b.extras(req, sent_tools.as_deref());
            b.finish()
        });
        let search = match (&plan, &self.defer) {
            (Some(p), Some(d)) => Some(SearchPlan {
                set: p.set.clone(),
                limit: d.limit,
                max_rounds: d.max_rounds,
                messages_end: input_end,
                form: Api::Responses,
                native: hosted,
            }),
            _ => None,
        };
        Ok(Prepared { body, blocks, edits, lookups, search })
    }
}
