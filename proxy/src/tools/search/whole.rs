//! Search calls in whole (not streamed) answers, Chat Completions and Responses, and the answer
//! the client gets after the last round.

use serde_json::{json, Value};

use super::SearchCall;
use crate::tools::SEARCH_TOOL;

/// The search calls of a whole chat completion, with its content, when the model made search
/// calls and no real ones (a turn with real calls goes to the client: it must run them).
pub fn search_calls(resp: &Value) -> Option<(Option<String>, Vec<SearchCall>)> {
    let choices = resp.get("choices")?.as_array()?;
    let [choice] = choices.as_slice() else { return None };
    let msg = choice.get("message")?;
    let calls = msg.get("tool_calls")?.as_array()?;
    let mut search = Vec::new();
    for c in calls {
        let f = c.get("function")?;
        if f.get("name")?.as_str()? != SEARCH_TOOL {
            return None;
        }
        search.push(SearchCall {
            id: c.get("id").and_then(Value::as_str).unwrap_or("").to_owned(),
            arguments: f.get("arguments").and_then(Value::as_str).unwrap_or("{}").to_owned(),
        });
    }
    let content = msg.get("content").and_then(Value::as_str).map(str::to_owned);
    (!search.is_empty()).then_some((content, search))
}

/// Responses: the round's output items and its search calls, when the model made search calls
/// and no other function calls.
pub fn search_items(resp: &Value) -> Option<(Vec<Value>, Vec<SearchCall>)> {
    let output = resp.get("output")?.as_array()?;
    let mut search = Vec::new();
    for item in output {
        if item.get("type").and_then(Value::as_str) != Some("function_call") {
            continue;
        }
        if item.get("name").and_then(Value::as_str) != Some(SEARCH_TOOL) {
            return None;
        }
        search.push(SearchCall {
            id: item.get("call_id").and_then(Value::as_str).unwrap_or("").to_owned(),
            arguments: item.get("arguments").and_then(Value::as_str).unwrap_or("{}").to_owned(),
        });
    }
    (!search.is_empty()).then(|| (output.clone(), search))
}

/// Takes the search calls out of a whole response (search rounds used up); a turn left with no
/// call ends as a plain answer.
pub fn strip_searches(resp: &mut Value) {
    if let Some(output) = resp.get_mut("output").and_then(Value::as_array_mut) {
        output.retain(|i| {
            i.get("type").and_then(Value::as_str) != Some("function_call")
                || i.get("name").and_then(Value::as_str) != Some(SEARCH_TOOL)
        });
        return;
    }
    let Some(choices) = resp.get_mut("choices").and_then(Value::as_array_mut) else { return };
    for c in choices {
        let Some(msg) = c.get_mut("message").and_then(Value::as_object_mut) else { continue };
        if let Some(calls) = msg.get_mut("tool_calls").and_then(Value::as_array_mut) {
            calls.retain(|t| t.pointer("/function/name").and_then(Value::as_str) != Some(SEARCH_TOOL));
            if calls.is_empty() {
                msg.remove("tool_calls");
                c["finish_reason"] = json!("stop");
            }
        }
    }
}

/// Adds `more`'s token counts into `total` (OpenAI usage objects).
pub fn add_usage(total: &mut Option<Value>, more: Option<&Value>) {
    let Some(more) = more.filter(|u| u.is_object()) else { return };
    let Some(t) = total.as_mut() else {
        *total = Some(more.clone());
        return;
    };
    // Chat Completions' names and the Responses API's.
    for key in ["prompt_tokens", "completion_tokens", "total_tokens", "input_tokens", "output_tokens"] {
        if t.get(key).is_none() && more.get(key).is_none() {
            continue;
        }
        let sum = t.get(key).and_then(Value::as_u64).unwrap_or(0)
            + more.get(key).and_then(Value::as_u64).unwrap_or(0);
        t[key] = json!(sum);
    }
    for details in ["prompt_tokens_details", "input_tokens_details"] {
        let cached = |u: &Value| u.get(details).and_then(|d| d.get("cached_tokens")).and_then(Value::as_u64);
        if let Some(c) = cached(more) {
            let sum = cached(t).unwrap_or(0) + c;
            match t.get_mut(details).and_then(Value::as_object_mut) {
                Some(d) => {
                    d.insert("cached_tokens".to_owned(), json!(sum));
                }
                None => t[details] = json!({ "cached_tokens": sum }),
            }
        }
    }
}

/// The last round's response with every round's usage and, first in its `output`, the items
/// the searches show (Responses native form).
pub fn final_value(resp: &mut Value, earlier: Option<Value>, search_items: Vec<Value>) {
    if !search_items.is_empty() {
        if let Some(out) = resp.get_mut("output").and_then(Value::as_array_mut) {
            out.splice(0..0, search_items);
        }
    }
    if earlier.is_some() {
        let mut total = earlier;
        add_usage(&mut total, resp.get("usage"));
        if let Some(u) = total {
            resp["usage"] = u;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_responses_with_real_calls_go_to_the_client() {
        let search = json!({"choices": [{"message": {"content": null, "tool_calls": [
            {"id": "a", "function": {"name": "tool_search", "arguments": "{\"query\":\"x\"}"}}]}}]});
        assert_eq!(search_calls(&search).map(|(_, c)| c.len()), Some(1));
        let mixed = json!({"choices": [{"message": {"tool_calls": [
            {"id": "a", "function": {"name": "tool_search", "arguments": "{}"}},
            {"id": "b", "function": {"name": "read_file", "arguments": "{}"}}]}}]});
        assert!(search_calls(&mixed).is_none());
        let mut total = Some(json!({"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
            "prompt_tokens_details": {"cached_tokens": 4}}));
        add_usage(
            &mut total,
            Some(&json!({"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23,
            "prompt_tokens_details": {"cached_tokens": 8}})),
        );
        assert_eq!(
            total.expect("usage"),
            json!({"prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35,
            "prompt_tokens_details": {"cached_tokens": 12}})
        );
    }
}
