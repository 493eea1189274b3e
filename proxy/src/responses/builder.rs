//! A backend's Chat Completions stream, chunk by chunk, into the Responses streaming events:
//! `response.created`, `response.in_progress`, output items opened, deltas, items done, and
//! `response.completed` (or `incomplete`, `failed`) with the whole response, every event
//! numbered by `sequence_number`. A whole chat answer goes through the same steps at once.

use serde_json::{json, Map, Value};

use super::events::{new_id, Event, Outcome};
use super::request::ResponsesRequest;

#[derive(Debug, Clone)]
enum Item {
    /// `logprobs`: the text's log-probabilities, where they were asked for.
    Message {
        id: String,
        text: String,
        open: bool,
        logprobs: Option<Vec<Value>>,
    },
    Call {
        id: String,
        chat_index: u64,
        call_id: String,
        name: String,
        arguments: String,
        open: bool,
    },
}

impl Item {
    fn value(&self, status: &str) -> Value {
        match self {
            Item::Message { id, text, open, logprobs } => {
                let content = if *open && text.is_empty() {
                    json!([])
                } else {
                    json!([text_part(text, logprobs.as_deref())])
                };
                json!({"id": id, "type": "message", "status": status, "role": "assistant", "content": content})
            }
            Item::Call { id, call_id, name, arguments, .. } => json!({
                "id": id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
                "arguments": arguments,
            }),
        }
    }
}

/// An `output_text` part, with its log-probabilities where they were asked for.
fn text_part(text: &str, logprobs: Option<&[Value]>) -> Value {
    let mut part = json!({"type": "output_text", "text": text, "annotations": []});
    if let Some(l) = logprobs {
        part["logprobs"] = json!(l);
    }
    part
}

/// One response being built from a chat stream.
#[derive(Debug)]
pub struct Builder {
    pub id: String,
    created_at: u64,
    /// The request's fields echoed in the response object, serialized once (`"model":…,`
    /// without braces): with a hundred tools they are most of each response object.
    echo: String,
    /// The request's `metadata`, with warmpath's own notes added (`warmpath_safety`).
    metadata: Value,
    seq: u64,
    items: Vec<Item>,
    usage: Option<Value>,
    finish: Option<String>,
    outcome: Option<Outcome>,
    /// The request asked for the output text's log-probabilities.
    logprobs: bool,
}

impl Builder {
    pub fn new(id: String, req: &ResponsesRequest) -> Builder {
        let mut echo = Map::new();
        echo.insert("model".into(), json!(req.model));
        echo.insert("instructions".into(), json!(req.instructions));
        echo.insert("previous_response_id".into(), json!(req.previous_response_id));
        echo.insert("conversation".into(), json!(req.conversation.as_ref().map(|id| json!({"id": id}))));
        echo.insert("tool_choice".into(), req.tool_choice.clone().unwrap_or(json!("auto")));
        echo.insert("parallel_tool_calls".into(), json!(req.parallel_tool_calls.unwrap_or(true)));
        echo.insert("max_output_tokens".into(), json!(req.max_output_tokens));
        echo.insert("temperature".into(), json!(req.temperature.unwrap_or(1.0)));
        echo.insert("top_p".into(), json!(req.top_p.unwrap_or(1.0)));
        echo.insert("store".into(), json!(req.store));
        echo.insert("background".into(), json!(req.background));
        echo.insert("top_logprobs".into(), json!(req.top_logprobs));
        echo.insert("truncation".into(), json!(if req.truncation_auto { "auto" } else { "disabled" }));
        echo.insert("text".into(), req.text.clone().unwrap_or(json!({"format": {"type": "text"}})));
        echo.insert("prompt_cache_key".into(), json!(req.prompt_cache_key));
        echo.insert("user".into(), json!(req.user));
        let mut text = Value::Object(echo).to_string();
        text.pop();
        // The tools, serialized where they are rather than copied into the map.
        text.push_str(r#","tools":"#);
        text.push_str(&req.tools_json());
        let echo = text[1..].to_owned();
        let created_at =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let metadata = req.metadata.clone().filter(Value::is_object).unwrap_or(json!({}));
        Builder {
            id,
            created_at,
            echo,
            metadata,
            seq: 0,
            items: Vec::new(),
            usage: None,
            finish: None,
            outcome: None,
            logprobs: req.logprobs,
        }
    }

    /// Adds `key` to the response's `metadata` (where a WebSocket client, which has no response
    /// headers, reads what `x-warmpath-*` headers say over HTTP).
    pub fn note(&mut self, key: &str, value: &str) {
        if let Some(m) = self.metadata.as_object_mut() {
            m.insert(key.to_owned(), json!(value));
        }
    }

    fn event(&mut self, kind: &'static str, mut fields: Map<String, Value>) -> Event {
        fields.insert("type".into(), json!(kind));
        fields.insert("sequence_number".into(), json!(self.seq));
        self.seq += 1;
        Event::plain(kind, Value::Object(fields).to_string())
    }

    /// An event that carries the response object as it stands.
    fn response_event(&mut self, kind: &'static str) -> Event {
        let mut json = format!(r#"{{"type":"{kind}","sequence_number":{},"response":"#, self.seq);
        let start = json.len();
        json.push_str(&self.response_json());
        let end = json.len();
        json.push('}');
        self.seq += 1;
        Event { kind, json, response: Some(start..end) }
    }

    /// The response object as it stands, as JSON text.
    pub fn response_json(&self) -> String {
        let (status, incomplete, error) = match &self.outcome {
            None => ("in_progress", Value::Null, Value::Null),
            Some(Outcome::Completed) => ("completed", Value::Null, Value::Null),
            Some(Outcome::Incomplete(why)) => ("incomplete", json!({"reason": why}), Value::Null),
            Some(Outcome::Failed { code, message }) => {
                ("failed", Value::Null, json!({"code": code, "message": message}))
            }
        };
        let item_status = if self.outcome.is_some() { "completed" } else { "in_progress" };
        let mut o = Map::new();
        o.insert("id".into(), json!(self.id));
        o.insert("object".into(), json!("response"));
        o.insert("created_at".into(), json!(self.created_at));
        o.insert("status".into(), json!(status));
        o.insert("error".into(), error);
        o.insert("incomplete_details".into(), incomplete);
        o.insert("output".into(), Value::Array(self.items.iter().map(|i| i.value(item_status)).collect()));
        o.insert("usage".into(), self.usage.clone().unwrap_or(Value::Null));
        o.insert("metadata".into(), self.metadata.clone());
        let mut text = Value::Object(o).to_string();
        text.pop();
        text.push(',');
        text.push_str(&self.echo);
        text.push('}');
        text
    }

    /// The opening events.
    pub fn start(&mut self) -> Vec<Event> {
        let created = self.response_event("response.created");
        let progress = self.response_event("response.in_progress");
        vec![created, progress]
    }

    /// One chat completion chunk's events.
    pub fn chunk(&mut self, chunk: &Value, out: &mut Vec<Event>) {
        if let Some(u) = chunk.get("usage").filter(|u| u.is_object()) {
            self.add_usage(u);
        }
        let Some(choice) = chunk.get("choices").and_then(|c| c.get(0)) else { return };
        let delta = choice.get("delta").or_else(|| choice.get("message"));
        if let Some(text) =
            delta.and_then(|d| d.get("content")).and_then(Value::as_str).filter(|t| !t.is_empty())
        {
            // Chat's log-probability entries are the Responses ones (token, logprob, bytes,
            // top_logprobs).
            let logprobs = choice.pointer("/logprobs/content").and_then(Value::as_array);
            self.text_with(text, logprobs.map(Vec::as_slice), out);
        }
        if let Some(calls) = delta.and_then(|d| d.get("tool_calls")).and_then(Value::as_array) {
            for (k, c) in calls.iter().enumerate() {
                let f = c.get("function");
                self.call(
                    c.get("index").and_then(Value::as_u64).unwrap_or(k as u64),
                    c.get("id").and_then(Value::as_str),
                    f.and_then(|f| f.get("name")).and_then(Value::as_str),
                    f.and_then(|f| f.get("arguments")).and_then(Value::as_str).unwrap_or(""),
                    out,
                );
            }
        }
        if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason(f);
        }
    }

    /// Why the backend stopped (`stop`, `length`, `tool_calls`, `content_filter`).
    pub fn finish_reason(&mut self, reason: &str) {
        self.finish = Some(reason.to_owned());
    }

    /// A backend usage object (chat or completions form), summed: a turn whose tool searches
    /// warmpath answered is several backend calls.
    pub fn add_usage(&mut self, u: &Value) {
        let new = usage(u);
        self.usage = Some(match self.usage.take() {
            None => new,
            Some(old) => sum_usage(&old, &new),
        });
    }

    /// Output text, appended to the open message (opened first where none is).
    pub fn text(&mut self, text: &str, out: &mut Vec<Event>) {
        self.text_with(text, None, out)
    }

    /// [`Builder::text`] with the text's log-probability entries.
    fn text_with(&mut self, text: &str, logprobs: Option<&[Value]>, out: &mut Vec<Event>) {
        let open = matches!(self.items.last(), Some(Item::Message { open: true, .. }));
        if !open {
            self.close_open(out);
            let id = new_id("msg_");
            let kept = self.logprobs.then(Vec::new);
            self.items.push(Item::Message {
                id: id.clone(),
                text: String::new(),
                open: true,
                logprobs: kept,
            });
            let index = self.items.len() - 1;
            let item = self.items[index].value("in_progress");
            let e = self
                .event("response.output_item.added", obj([("output_index", json!(index)), ("item", item)]));
            out.push(e);
            let part = json!({"type": "output_text", "text": "", "annotations": []});
            let e = self.event(
                "response.content_part.added",
                obj([
                    ("item_id", json!(id)),
                    ("output_index", json!(index)),
                    ("content_index", json!(0)),
                    ("part", part),
                ]),
            );
            out.push(e);
        }
        let index = self.items.len() - 1;
        let Some(Item::Message { id, text: all, logprobs: kept, .. }) = self.items.last_mut() else { return };
        all.push_str(text);
        let these = logprobs.filter(|_| kept.is_some()).unwrap_or(&[]);
        if let Some(k) = kept {
            k.extend_from_slice(these);
        }
        let id = id.clone();
        let e = self.event(
            "response.output_text.delta",
            obj([
                ("item_id", json!(id)),
                ("output_index", json!(index)),
                ("content_index", json!(0)),
                ("delta", json!(text)),
                ("logprobs", json!(these)),
            ]),
        );
        out.push(e);
    }

    /// A tool call delta: `chat_index` keys the call; its id and name come with the first
    /// delta, then argument fragments (a whole call is one delta).
    pub fn call(
        &mut self,
        chat_index: u64,
        call_id: Option<&str>,
        name: Option<&str>,
        args: &str,
        out: &mut Vec<Event>,
    ) {
        let at = self
            .items
            .iter()
            .position(|i| matches!(i, Item::Call { chat_index: n, open: true, .. } if *n == chat_index));
        let index = match at {
            Some(i) => i,
            None => {
                self.close_open(out);
                let call_id = call_id.map_or_else(|| new_id("call_"), str::to_owned);
                self.items.push(Item::Call {
                    id: new_id("fc_"),
                    chat_index,
                    call_id,
                    name: name.unwrap_or("").to_owned(),
                    arguments: String::new(),
                    open: true,
                });
                let index = self.items.len() - 1;
                let item = self.items[index].value("in_progress");
                let e = self.event(
                    "response.output_item.added",
                    obj([("output_index", json!(index)), ("item", item)]),
                );
                out.push(e);
                index
            }
        };
        if args.is_empty() {
            return;
        }
        let Item::Call { id, arguments, .. } = &mut self.items[index] else { return };
        arguments.push_str(args);
        let id = id.clone();
        let e = self.event(
            "response.function_call_arguments.delta",
            obj([("item_id", json!(id)), ("output_index", json!(index)), ("delta", json!(args))]),
        );
        out.push(e);
    }

    /// Closes every open item, in order.
    fn close_open(&mut self, out: &mut Vec<Event>) {
        for index in 0..self.items.len() {
            let events: Vec<(&'static str, Map<String, Value>)> = match &mut self.items[index] {
                Item::Message { id, text, open, logprobs } if *open => {
                    *open = false;
                    let part = text_part(text, logprobs.as_deref());
                    let all = json!(logprobs.as_deref().unwrap_or(&[]));
                    let at = |extra: Vec<(&str, Value)>| {
                        let mut m = obj([
                            ("item_id", json!(id)),
                            ("output_index", json!(index)),
                            ("content_index", json!(0)),
                        ]);
                        m.extend(extra.into_iter().map(|(k, v)| (k.to_owned(), v)));
                        m
                    };
                    vec![
                        ("response.output_text.done", at(vec![("text", json!(text)), ("logprobs", all)])),
                        ("response.content_part.done", at(vec![("part", part)])),
                    ]
                }
                Item::Call { id, name, arguments, open, .. } if *open => {
                    *open = false;
                    vec![(
                        "response.function_call_arguments.done",
                        obj([
                            ("item_id", json!(id)),
                            ("output_index", json!(index)),
                            ("name", json!(name)),
                            ("arguments", json!(arguments)),
                        ]),
                    )]
                }
                _ => continue,
            };
            for (kind, fields) in events {
                let e = self.event(kind, fields);
                out.push(e);
            }
            let item = self.items[index].value("completed");
            let e = self
                .event("response.output_item.done", obj([("output_index", json!(index)), ("item", item)]));
            out.push(e);
        }
    }

    /// The closing events: open items done, then the terminal event with the whole response.
    /// `failure` is set when the backend's stream failed.
    pub fn finish(&mut self, failure: Option<(String, String)>, out: &mut Vec<Event>) {
        self.close_open(out);
        let (outcome, kind) = match (failure, self.finish.as_deref()) {
            (Some((code, message)), _) => (Outcome::Failed { code, message }, "response.failed"),
            (None, Some("length")) => (Outcome::Incomplete("max_output_tokens"), "response.incomplete"),
            (None, Some("content_filter")) => (Outcome::Incomplete("content_filter"), "response.incomplete"),
            (None, _) => (Outcome::Completed, "response.completed"),
        };
        self.outcome = Some(outcome);
        let e = self.response_event(kind);
        out.push(e);
    }

    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    /// The output items as a later turn's input takes them back.
    pub fn output_items(&self) -> Vec<Value> {
        self.items.iter().map(|i| i.value("completed")).collect()
    }
}

fn obj<const N: usize>(pairs: [(&str, Value); N]) -> Map<String, Value> {
    pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

/// Chat usage → Responses usage.
fn sum_usage(a: &Value, b: &Value) -> Value {
    let n = |v: &Value, p: &str| v.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    let f = |p: &str| n(a, p) + n(b, p);
    json!({
        "input_tokens": f("/input_tokens"),
        "input_tokens_details": {"cached_tokens": f("/input_tokens_details/cached_tokens")},
        "output_tokens": f("/output_tokens"),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": f("/total_tokens"),
    })
}

fn usage(u: &Value) -> Value {
    let n = |v: Option<&Value>| v.and_then(Value::as_u64).unwrap_or(0);
    let input = n(u.get("prompt_tokens"));
    let output = n(u.get("completion_tokens"));
    let cached = n(u.get("prompt_tokens_details").and_then(|d| d.get("cached_tokens")));
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": n(u.get("total_tokens")).max(input + output),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builder() -> Builder {
        let fields = super::super::request::raw_fields(br#"{"model": "m", "input": "hi"}"#).expect("fields");
        let req = ResponsesRequest::from_fields(fields, false).expect("parse");
        Builder::new("resp_1".into(), &req)
    }

    fn kinds(events: &[Event]) -> Vec<&str> {
        events.iter().map(|e| e.kind).collect()
    }

    fn values(events: &[Event]) -> Vec<Value> {
        events.iter().map(|e| serde_json::from_str(&e.json).expect("json")).collect()
    }

    #[test]
    fn a_text_stream_becomes_the_responses_event_sequence() {
        let mut b = builder();
        let mut ev = b.start();
        for c in [
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
            json!({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
            json!({"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]}),
            json!({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                                            "prompt_tokens_details": {"cached_tokens": 4}}}),
        ] {
            b.chunk(&c, &mut ev);
        }
        b.finish(None, &mut ev);
        assert_eq!(
            kinds(&ev),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        let v = values(&ev);
        let seqs: Vec<u64> = v.iter().filter_map(|e| e["sequence_number"].as_u64()).collect();
        assert_eq!(seqs, (0..ev.len() as u64).collect::<Vec<_>>());
        let done = &v.last().expect("last")["response"];
        let slice = ev.last().and_then(Event::response).expect("the terminal event carries the response");
        assert_eq!(&serde_json::from_str::<Value>(slice).expect("json"), done);
        assert_eq!(ev[2].response(), None);
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(done["usage"]["input_tokens_details"]["cached_tokens"], 4);
        assert_eq!(done["usage"]["total_tokens"], 9);
        assert_eq!(v[0]["response"]["status"], "in_progress");
        assert_eq!(v[6]["text"], "Hello");
    }

    #[test]
    fn tool_calls_become_function_call_items_after_the_text() {
        let mut b = builder();
        let mut ev = Vec::new();
        for c in [
            json!({"choices": [{"delta": {"content": "Let me check."}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "get_time", "arguments": "{}"}}]}, "finish_reason": "tool_calls"}]}),
        ] {
            b.chunk(&c, &mut ev);
        }
        b.finish(None, &mut ev);
        let k = kinds(&ev);
        let first_call =
            k.iter().position(|&e| e == "response.function_call_arguments.delta").expect("delta");
        let message_done = k.iter().position(|&e| e == "response.output_text.done").expect("text done");
        assert!(message_done < first_call, "the message closes before the call opens: {k:?}");
        let items = b.output_items();
        assert_eq!(items.len(), 3);
        assert_eq!(items[1]["type"], "function_call");
        assert_eq!(
            (items[1]["call_id"].as_str(), items[1]["arguments"].as_str()),
            (Some("call_a"), Some("{\"city\":\"Oslo\"}"))
        );
        assert_eq!(
            (items[2]["name"].as_str(), items[2]["arguments"].as_str()),
            (Some("get_time"), Some("{}"))
        );
        let v = values(&ev);
        let arg_done: Vec<&Value> =
            v.iter().filter(|e| e["type"] == "response.function_call_arguments.done").collect();
        assert_eq!(arg_done.len(), 2);
        assert_eq!(arg_done[0]["arguments"], "{\"city\":\"Oslo\"}");
        assert_eq!(v.last().expect("last")["type"], "response.completed");
    }

    #[test]
    fn length_is_incomplete_and_a_broken_stream_fails() {
        let mut b = builder();
        let mut ev = Vec::new();
        b.chunk(&json!({"choices": [{"delta": {"content": "x"}, "finish_reason": "length"}]}), &mut ev);
        b.finish(None, &mut ev);
        let v = values(&ev);
        let r = &v.last().expect("last")["response"];
        assert_eq!(
            (r["status"].as_str(), r["incomplete_details"]["reason"].as_str()),
            (Some("incomplete"), Some("max_output_tokens"))
        );

        let mut b = builder();
        let mut ev = Vec::new();
        b.chunk(&json!({"choices": [{"delta": {"content": "x"}}]}), &mut ev);
        b.finish(Some(("upstream_stream_error".into(), "cut".into())), &mut ev);
        let v = values(&ev);
        let last = v.last().expect("last");
        assert_eq!(last["type"], "response.failed");
        assert_eq!(last["response"]["error"]["code"], "upstream_stream_error");
        assert_eq!(
            kinds(&ev)[..3],
            ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
        );
    }

    #[test]
    fn ids_are_random_and_prefixed() {
        let (a, b) = (new_id("resp_"), new_id("resp_"));
        assert!(a.starts_with("resp_") && a.len() == 53 && a != b, "{a} {b}");
    }
}
