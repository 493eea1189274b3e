//! Responses API input items: how they render into the prompt, and how warmpath rewrites
//! them on the way out when tools are deferred (native search items translated, searches put
//! back before calls to deferred tools).

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::value::RawValue;
use warmpath_wire::chat_template::{tool_call_text, PromptBuilder};

use crate::request::{json, BodyStr, ContentView};
use crate::tools::def::CanonTool;
use crate::tools::{result_text, DeferredSet, SEARCH_TOOL};

/// One input item, as far as warmpath reads it; the rest stays in its bytes.
#[derive(Deserialize)]
struct ItemView<'a> {
    #[serde(borrow, rename = "type", default)]
    kind: Option<BodyStr<'a>>,
    #[serde(borrow, default)]
    role: Option<BodyStr<'a>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<BodyStr<'a>>,
    /// A JSON string for `function_call`, an object for `tool_search_call`.
    #[serde(borrow, default)]
    arguments: Option<&'a RawValue>,
    #[serde(borrow, default)]
    call_id: Option<BodyStr<'a>>,
    #[serde(borrow, default)]
    output: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tools: Option<Vec<&'a RawValue>>,
}

impl ItemView<'_> {
    fn kind(&self) -> Option<&str> {
        self.kind.as_ref().map(|k| k.0.as_ref())
    }

    fn call_id(&self) -> &str {
        self.call_id.as_ref().map_or("", |s| s.0.as_ref())
    }

    /// The arguments as the JSON text they carry (a string's contents, or an object's text).
    fn arguments(&self) -> Cow<'_, str> {
        match self.arguments.map(RawValue::get) {
            Some(a) if a.starts_with('"') => {
                Cow::Owned(serde_json::from_str::<String>(a).unwrap_or_default())
            }
            Some(a) => json::minify(a),
            None => Cow::Borrowed("{}"),
        }
    }
}

/// The text of a raw content value (Responses items), as [`ContentView::text`] reads it.
pub fn text_of(raw: Option<&str>) -> Option<Cow<'_, str>> {
    serde_json::from_str::<ContentView<'_>>(raw?).ok()?.text()
}

/// One input item into the prompt: messages as turns, function calls and their outputs as tool
/// calls and results.
pub(super) fn render_item(b: &mut PromptBuilder, raw: &RawValue) {
    let Ok(item) = serde_json::from_str::<ItemView<'_>>(raw.get()) else { return };
    match item.kind() {
        Some("function_call") => {
            let name = item.name.as_ref().map_or("", |s| s.0.as_ref());
            let call = tool_call_text(name, &item.arguments());
            b.turn("assistant", "", [call.as_str()]);
        }
        Some("function_call_output") => {
            b.tool_result(item.call_id(), &text_of(item.output.map(RawValue::get)).unwrap_or_default());
        }
        _ => {
            let role = item.role.as_ref().map_or("user", |r| r.0.as_ref());
            b.turn(role, &text_of(item.content.map(RawValue::get)).unwrap_or_default(), []);
        }
    }
}

/// Responses input items as sent on: the client's `tool_search_call` / `tool_search_output`
/// items (the native form, echoed back) become the function call and result the backend
/// knows; before the first call to a deferred tool not loaded yet, a search for it and its
/// result go in.
/// Also returns how many searches went back in.
pub(super) fn input_items(items: &[&RawValue], set: Option<&DeferredSet>) -> (Vec<String>, usize) {
    let mut loaded = HashSet::new();
    let mut out = Vec::with_capacity(items.len());
    let mut reinserted = 0;
    for raw in items {
        let Ok(item) = serde_json::from_str::<ItemView<'_>>(raw.get()) else {
            out.push(json::minify(raw.get()).into_owned());
            continue;
        };
        let call_id = item.call_id();
        match item.kind() {
            Some("tool_search_call") => {
                let args = item.arguments();
                out.push(serde_json::json!({"type": "function_call", "call_id": call_id, "name": SEARCH_TOOL, "arguments": args}).to_string());
            }
            Some("tool_search_output") => {
                let defs: Vec<Arc<CanonTool>> = item
                    .tools
                    .iter()
                    .flatten()
                    .filter_map(|t| CanonTool::parse(t.get()).ok().map(Arc::new))
                    .collect();
                defs.iter().for_each(|t| {
                    loaded.insert(t.name.clone());
                });
                let refs: Vec<&Arc<CanonTool>> = defs.iter().collect();
                let text = result_text("", &refs);
                out.push(
                    serde_json::json!({"type": "function_call_output", "call_id": call_id, "output": text})
                        .to_string(),
                );
            }
            Some("function_call") => {
                let name = item.name.as_ref().map_or("", |s| s.0.as_ref());
                if let Some(t) = set.and_then(|s| s.get(name)).filter(|t| !loaded.contains(&t.name)) {
                    loaded.insert(t.name.clone());
                    let id = format!("ts_{call_id}");
                    let args = serde_json::json!({ "query": t.name }).to_string();
                    out.push(serde_json::json!({"type": "function_call", "call_id": id, "name": SEARCH_TOOL, "arguments": args}).to_string());
                    let text = result_text(&t.name, &[t]);
                    out.push(
                        serde_json::json!({"type": "function_call_output", "call_id": id, "output": text})
                            .to_string(),
                    );
                    reinserted += 1;
                }
                out.push(json::minify(raw.get()).into_owned());
            }
            _ => out.push(json::minify(raw.get()).into_owned()),
        }
    }
    (out, reinserted)
}
