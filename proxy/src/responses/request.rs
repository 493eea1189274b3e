//! A Responses request (`POST /v1/responses` body, or a WebSocket `response.create` event) and
//! its translation into the Chat Completions request every OpenAI-compatible backend speaks.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::value::RawValue;
use serde_json::{json, Map, Value};
use warmpath_wire::openai::ApiError;

pub use super::chat::messages_of;
use super::chat::{chat_tool, chat_tool_choice, check_item, push_item, response_format, ToolView};

/// A request's top-level fields as raw JSON: each field parsed only as far as it is read.
pub type RawFields = BTreeMap<String, Box<RawValue>>;

/// Parses a body or event into its top-level fields (400 unless it is a JSON object).
pub fn raw_fields(text: &[u8]) -> Result<RawFields, ApiError> {
    serde_json::from_slice::<RawFields>(text).map_err(|e| {
        let what =
            if e.is_syntax() || e.is_eof() { "invalid JSON" } else { "the body must be a JSON object" };
        ApiError::invalid_request(format!("{what}: {e}")).with_code("invalid_json")
    })
}

/// A string field of raw fields (`None` when absent or not a string).
pub fn raw_str<'a>(f: &'a RawFields, k: &str) -> Option<Cow<'a, str>> {
    f.get(k).and_then(|v| serde_json::from_str::<Cow<'a, str>>(v.get()).ok())
}

/// What `include` may ask for. warmpath keeps items as they were sent or generated, so each
/// is either already there or has nothing to add on a self-hosted backend (no hosted tools, no
/// encrypted reasoning) — but the output text's log-probabilities, which are asked of the
/// backend.
pub const INCLUDABLE: &[&str] = &[
    "message.input_image.image_url",
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "file_search_call.results",
    "web_search_call.action.sources",
    "web_search_call.results",
];

/// Checks items given to a conversation (`param`: where they were, for the error): each one
/// an item a turn could take.
pub fn check_items(items: &[Value], param: &str) -> Result<(), ApiError> {
    for (i, item) in items.iter().enumerate() {
        check_item(item).map_err(|m| ApiError::invalid_param(m, &format!("{param}[{i}]")))?;
    }
    Ok(())
}

/// The fields warmpath acts on; the rest of the request is ignored, as OpenAI ignores fields a
/// model does not use.
#[derive(Debug, Clone)]
pub struct ResponsesRequest {
    pub model: String,
    /// The new input items (a string input is one user message).
    pub input: Vec<Value>,
    /// The system prompt of this turn; not carried over by `previous_response_id`.
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    /// The conversation (`/v1/conversations`) this response reads and appends to.
    pub conversation: Option<String>,
    /// Keep the response for later `previous_response_id` (OpenAI's default: true).
    pub store: bool,
    pub stream: bool,
    /// Run detached from the request (`GET` polls it, `cancel` stops it).
    pub background: bool,
    /// `truncation: "auto"`: the oldest items are left out of a prompt that does not fit.
    pub truncation_auto: bool,
    /// `include: ["message.output_text.logprobs"]`: the output text's log-probabilities, with
    /// `top_logprobs` alternatives each.
    pub logprobs: bool,
    pub top_logprobs: Option<u64>,
    /// WebSocket warm-up (`generate: false`): a response id to chain from, no output.
    pub generate: bool,
    /// Function tools in the Responses form, as their JSON text: a hundred schemas are most of
    /// an agent's request, and they are only copied, never looked into past their names.
    pub tools: Vec<Box<RawValue>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub max_output_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub prompt_cache_key: Option<String>,
    pub metadata: Option<Value>,
    /// `text.format`: plain text, or a JSON object / schema (`response_format` in chat).
    pub text: Option<Value>,
    pub user: Option<String>,
}

fn opt_str(o: &Map<String, Value>, k: &str) -> Result<Option<String>, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::invalid_param(format!("`{k}` must be a string"), k)),
    }
}

fn opt_bool(o: &Map<String, Value>, k: &str) -> Result<Option<bool>, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid_param(format!("`{k}` must be a boolean"), k)),
    }
}

fn opt_f64(o: &Map<String, Value>, k: &str) -> Result<Option<f64>, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(_) => Err(ApiError::invalid_param(format!("`{k}` must be a number"), k)),
    }
}

impl ResponsesRequest {
    /// Reads a request body; `event` is true for a WebSocket `response.create` (where `type`
    /// is the event's, and events always stream whatever `stream` says).
    /// Reads a request from its top-level fields; `event` is true for a WebSocket
    /// `response.create` (where `type` is the event's, and events always stream whatever
    /// `stream` says). Tools stay raw; every other field is parsed.
    pub fn from_fields(mut f: RawFields, event: bool) -> Result<ResponsesRequest, ApiError> {
        let raw_tools = f.remove("tools");
        let mut o = Map::new();
        for (k, v) in f {
            let v: Value = serde_json::from_str(v.get())
                .map_err(|e| ApiError::invalid_request(format!("invalid JSON: {e}")))?;
            o.insert(k, v);
        }
        let mut r = Self::from_json(o, event)?;
        match raw_tools.as_deref().map(RawValue::get).map(str::trim) {
            None | Some("null") => {}
            Some(t) if t.starts_with('[') => {
                let list: Vec<Box<RawValue>> = serde_json::from_str(t)
                    .map_err(|_| ApiError::invalid_param("`tools` must be an array", "tools"))?;
                for (i, tool) in list.into_iter().enumerate() {
                    let view: ToolView<'_> = serde_json::from_str(tool.get()).map_err(|_| {
                        ApiError::invalid_param("a tool must be an object", &format!("tools[{i}]"))
                    })?;
                    match view.kind.as_deref() {
                        Some("function") => {
                            if view.name.as_deref().is_none_or(str::is_empty) {
                                return Err(ApiError::invalid_param(
                                    "a function tool needs a `name`",
                                    &format!("tools[{i}].name"),
                                ));
                            }
                            r.tools.push(tool);
                        }
                        // The hosted search over deferred tools: warmpath's own deferral
                        // (`[pools.tools] defer`) does that job on the translated request.
                        Some("tool_search") => {}
                        other => {
                            return Err(ApiError::invalid_param(
                                format!(
                                    "tool type {:?} is not supported: only function tools",
                                    other.unwrap_or("")
                                ),
                                &format!("tools[{i}].type"),
                            ))
                        }
                    }
                }
            }
            Some(_) => return Err(ApiError::invalid_param("`tools` must be an array", "tools")),
        }
        Ok(r)
    }

    /// The request from its parsed fields, tools excepted (see [`Self::from_fields`]).
    fn from_json(mut o: Map<String, Value>, event: bool) -> Result<ResponsesRequest, ApiError> {
        let o = &mut o;
        let model =
            opt_str(o, "model")?.ok_or_else(|| ApiError::invalid_param("`model` is required", "model"))?;
        let input = match o.remove("input") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![json!({"type": "message", "role": "user", "content": s})],
            Some(Value::Array(items)) => {
                check_items(&items, "input")?;
                items
            }
            Some(_) => {
                return Err(ApiError::invalid_param("`input` must be a string or an array of items", "input"))
            }
        };
        let max_output_tokens = match o.get("max_output_tokens") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().filter(|&n| n > 0).ok_or_else(|| {
                ApiError::invalid_param("`max_output_tokens` must be a positive integer", "max_output_tokens")
            })?),
        };
        let seed = match o.get("seed") {
            None | Some(Value::Null) => None,
            Some(v) => {
                Some(v.as_i64().ok_or_else(|| ApiError::invalid_param("`seed` must be an integer", "seed"))?)
            }
        };
        let conversation = match o.get("conversation") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Object(c)) if c.get("id").is_some_and(Value::is_string) => {
                c.get("id").and_then(Value::as_str).map(str::to_owned)
            }
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "`conversation` must be a conversation id or {\"id\": ...}",
                    "conversation",
                ))
            }
        };
        if conversation.is_some() && o.get("previous_response_id").is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid_param(
                "Mutually exclusive parameters: Ensure you are only providing one of: 'previous_response_id' or 'conversation'.",
                "conversation",
            )
            .with_code("mutually_exclusive_parameters"));
        }
        let background = opt_bool(o, "background")?.unwrap_or(false);
        if background && (event || opt_bool(o, "store")? == Some(false)) {
            let why = if event { "over a WebSocket" } else { "with store=false" };
            return Err(ApiError::invalid_param(
                format!("background mode is not available {why}"),
                "background",
            ));
        }
        let truncation_auto = match o.get("truncation") {
            None | Some(Value::Null) => false,
            Some(Value::String(t)) if t == "auto" => true,
            Some(Value::String(t)) if t == "disabled" => false,
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "`truncation` must be \"auto\" or \"disabled\"",
                    "truncation",
                ))
            }
        };
        let mut logprobs = false;
        match o.get("include") {
            None | Some(Value::Null) => {}
            Some(Value::Array(list)) => {
                for v in list {
                    match v.as_str() {
                        Some("message.output_text.logprobs") => logprobs = true,
                        Some(k) if INCLUDABLE.contains(&k) => {}
                        _ => {
                            return Err(ApiError::invalid_param(
                                format!("`include` value {v} is not one warmpath knows"),
                                "include",
                            ))
                        }
                    }
                }
            }
            Some(_) => return Err(ApiError::invalid_param("`include` must be an array", "include")),
        }
        let top_logprobs = match o.get("top_logprobs") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().filter(|&n| n <= 20).ok_or_else(|| {
                ApiError::invalid_param("`top_logprobs` must be an integer from 0 to 20", "top_logprobs")
            })?),
        };
        Ok(ResponsesRequest {
            model,
            conversation,
            background,
            truncation_auto,
            logprobs,
            top_logprobs,
            input,
            instructions: opt_str(o, "instructions")?,
            previous_response_id: opt_str(o, "previous_response_id")?,
            store: opt_bool(o, "store")?.unwrap_or(true),
            stream: event || opt_bool(o, "stream")?.unwrap_or(false),
            generate: opt_bool(o, "generate")?.unwrap_or(true),
            tools: Vec::new(),
            tool_choice: o.get("tool_choice").filter(|v| !v.is_null()).cloned(),
            parallel_tool_calls: opt_bool(o, "parallel_tool_calls")?,
            max_output_tokens,
            temperature: opt_f64(o, "temperature")?,
            top_p: opt_f64(o, "top_p")?,
            seed,
            prompt_cache_key: opt_str(o, "prompt_cache_key")?,
            metadata: o.get("metadata").filter(|v| !v.is_null()).cloned(),
            text: o.get("text").filter(|v| !v.is_null()).cloned(),
            user: opt_str(o, "user")?,
        })
    }

    /// The request a warm-up sends its backend: the same prompt, one token asked for.
    pub fn warm_up(&self) -> ResponsesRequest {
        ResponsesRequest { max_output_tokens: Some(1), generate: true, ..self.clone() }
    }

    /// The Chat Completions request for this turn over `history` (the stored conversation's
    /// items) and the new input. Always streamed, with usage, whatever the client asked: the
    /// translation reads one form.
    pub fn to_chat(&self, history: &[&Value]) -> Result<String, ApiError> {
        let mut messages = Vec::with_capacity(history.len() + self.input.len() + 1);
        if let Some(i) = &self.instructions {
            messages.push(json!({"role": "system", "content": i}));
        }
        for item in history.iter().copied().chain(&self.input) {
            push_item(&mut messages, item)?;
        }
        let mut body = Map::new();
        body.insert("model".into(), json!(self.model));
        body.insert("messages".into(), Value::Array(messages));
        if let Some(c) = &self.tool_choice {
            body.insert("tool_choice".into(), chat_tool_choice(c));
        }
        if let Some(p) = self.parallel_tool_calls {
            body.insert("parallel_tool_calls".into(), json!(p));
        }
        self.sampling(&mut body);
        if let Some(f) = self.text.as_ref().and_then(|t| t.get("format")) {
            if let Some(rf) = response_format(f) {
                body.insert("response_format".into(), rf);
            }
        }
        let mut text = Value::Object(body).to_string();
        if !self.tools.is_empty() {
            text.pop();
            text.push_str(r#","tools":["#);
            for (i, t) in self.tools.iter().enumerate() {
                if i > 0 {
                    text.push(',');
                }
                chat_tool(t, &mut text);
            }
            text.push_str("]}");
        }
        Ok(text)
    }

    /// The sampling fields both request forms share, and the stream with usage that the
    /// translation reads.
    fn sampling(&self, body: &mut Map<String, Value>) {
        if let Some(n) = self.max_output_tokens {
            body.insert("max_tokens".into(), json!(n));
        }
        if let Some(t) = self.temperature {
            body.insert("temperature".into(), json!(t));
        }
        if let Some(p) = self.top_p {
            body.insert("top_p".into(), json!(p));
        }
        if let Some(s) = self.seed {
            body.insert("seed".into(), json!(s));
        }
        if let Some(u) = &self.user {
            body.insert("user".into(), json!(u));
        }
        if self.logprobs || self.top_logprobs.is_some_and(|n| n > 0) {
            body.insert("logprobs".into(), json!(true));
            body.insert("top_logprobs".into(), json!(self.top_logprobs.unwrap_or(0)));
        }
        body.insert("stream".into(), json!(true));
        body.insert("stream_options".into(), json!({"include_usage": true}));
    }

    /// Whether the turn can go to the backend as a token-id completion: nothing a raw
    /// completion cannot honour (a forced or forbidden tool, a response format).
    pub fn completion_ok(&self) -> bool {
        let choice_ok = match &self.tool_choice {
            None => true,
            Some(Value::String(s)) => s == "auto",
            Some(_) => false,
        };
        let text_ok = self
            .text
            .as_ref()
            .and_then(|t| t.get("format"))
            .is_none_or(|f| f.get("type").and_then(Value::as_str) == Some("text"));
        // (Log-probabilities come in chat's form, which the translation reads.)
        choice_ok && text_ok && !self.logprobs && self.top_logprobs.is_none_or(|n| n == 0)
    }

    /// The tools in the Chat Completions form, one JSON text each.
    pub fn chat_tools(&self) -> Vec<String> {
        self.tools
            .iter()
            .map(|t| {
                let mut s = String::new();
                chat_tool(t, &mut s);
                s
            })
            .collect()
    }

    /// The `/v1/completions` request for a token-id prompt: the same sampling fields, always
    /// streamed with usage.
    pub fn to_completion(&self, prompt: &[u32]) -> String {
        let mut body = Map::new();
        body.insert("model".into(), json!(self.model));
        self.sampling(&mut body);
        let mut text = Value::Object(body).to_string();
        text.pop();
        text.push_str(r#","prompt":["#);
        for (i, id) in prompt.iter().enumerate() {
            if i > 0 {
                text.push(',');
            }
            let _ = write!(text, "{id}");
        }
        text.push_str("]}");
        text
    }

    /// The tools as one JSON array, as the client sent them.
    pub fn tools_json(&self) -> String {
        let mut out = String::with_capacity(self.tools.iter().map(|t| t.get().len() + 1).sum::<usize>() + 2);
        out.push('[');
        for (i, t) in self.tools.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(t.get());
        }
        out.push(']');
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> Result<ResponsesRequest, ApiError> {
        ResponsesRequest::from_fields(raw_fields(v.to_string().as_bytes())?, false)
    }

    #[test]
    fn a_string_input_is_one_user_message_and_defaults_are_openais() {
        let r = req(json!({"model": "m", "input": "hi"})).expect("parse");
        assert_eq!(r.input, vec![json!({"type": "message", "role": "user", "content": "hi"})]);
        assert!(r.store && r.generate && !r.stream);
        let chat: Value = serde_json::from_str(&r.to_chat(&[]).expect("chat")).expect("json");
        assert_eq!(chat["messages"], json!([{"role": "user", "content": "hi"}]));
        assert_eq!(chat["stream"], true);
        assert_eq!(chat["stream_options"]["include_usage"], true);
    }

    #[test]
    fn items_become_chat_messages_with_tool_calls_joined() {
        let r = req(json!({
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "developer", "content": "house rules"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather "}, {"type": "input_text", "text": "in Oslo?"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"},
                {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
                {"type": "reasoning", "summary": []}
            ],
            "tools": [{"type": "function", "name": "get_weather", "description": "d", "parameters": {"type": "object"}, "strict": null},
                      {"type": "tool_search"}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 50,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}
        }))
        .expect("parse");
        let chat: Value = serde_json::from_str(&r.to_chat(&[]).expect("chat")).expect("json");
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "be brief"},
                {"role": "system", "content": "house rules"},
                {"role": "user", "content": "weather in Oslo?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}},
                    {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "c2", "content": "noon"}
            ])
        );
        assert_eq!(
            chat["tools"],
            json!([{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {"type": "object"}}}])
        );
        assert_eq!(chat["tool_choice"], json!({"type": "function", "function": {"name": "get_weather"}}));
        assert_eq!(chat["max_tokens"], 50);
        assert_eq!(chat["response_format"]["json_schema"]["name"], "w");
    }

    #[test]
    fn history_comes_before_the_new_input_and_instructions_first() {
        let r = req(json!({"model": "m", "input": "next", "instructions": "sys"})).expect("parse");
        let history = [
            json!({"role": "user", "content": "first"}),
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}),
        ];
        let history: Vec<&Value> = history.iter().collect();
        let m = serde_json::from_str::<Value>(&r.to_chat(&history).expect("chat")).expect("json")["messages"]
            .clone();
        let roles: Vec<&str> = m.as_array().expect("a").iter().filter_map(|m| m["role"].as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
    }

    #[test]
    fn bad_requests_name_the_field() {
        let cases = [
            (json!({"input": "x"}), "model"),
            (json!({"model": "m", "input": 3}), "input"),
            (json!({"model": "m", "input": [{"role": "wizard", "content": "x"}]}), "input[0]"),
            (json!({"model": "m", "input": [{"type": "function_call", "name": "f"}]}), "input[0]"),
            (json!({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}), "input[0]"),
            (json!({"model": "m", "tools": [{"type": "web_search"}]}), "tools[0].type"),
            (json!({"model": "m", "max_output_tokens": -1}), "max_output_tokens"),
            (json!({"model": "m", "store": "yes"}), "store"),
        ];
        for (body, param) in cases {
            let e = req(body.clone()).expect_err("rejected");
            assert_eq!((e.status, e.body.error.param.as_deref()), (400, Some(param)), "{body}: {e}");
        }
        let r = ResponsesRequest::from_fields(
            raw_fields(br#"{"model": "m", "stream": false}"#).expect("f"),
            true,
        )
        .expect("an event may say stream");
        assert!(r.stream, "events always stream");
    }
}
