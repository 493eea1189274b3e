//! Deferred tool discovery end to end, against the bundled engine with scripted model turns
//! (`--script`): a request with 150 tools reaches the engine as its core tools plus
//! `tool_search`; the model's search is answered by warmpath, which appends the matching
//! definitions and calls the engine again within the same client request, streaming or not;
//! the client sees only the real tool call and the answer.

use serde_json::{json, Value};
use warmpath_tests::*;

const DEFER: &str = "policy = \"round_robin\"\n[pools.canon]\nenabled = true\ntokenizer = \"wp32k\"\n\
                     [pools.tools]\ndefer = true\nthreshold = 16\ncore = [\"read_file\"]";
const PASSTHROUGH: &str = "policy = \"round_robin\"";

const VERBS: [&str; 10] =
    ["list", "create", "delete", "update", "archive", "export", "import", "scan", "merge", "tag"];
const NOUNS: [&str; 15] = [
    "invoices", "users", "tickets", "branches", "images", "notes", "alerts", "backups", "queues", "domains",
    "reports", "secrets", "builds", "volumes", "events",
];

/// 150 tools: `read_file`, `get_weather_forecast` and 148 generated ones.
fn tools() -> Vec<Value> {
    let mut t = vec![
        json!({"type": "function", "function": {"name": "read_file", "description": "Read a file from the workspace.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}),
        json!({"type": "function", "function": {"name": "get_weather_forecast",
            "description": "Fetch the weather forecast for a city.",
            "parameters": {"type": "object", "required": ["city"], "properties": {
                "city": {"type": "string", "description": "city name"},
                "forecast_days": {"type": "integer", "description": "days ahead"}}}}}),
    ];
    'outer: for v in VERBS {
        for n in NOUNS {
            if t.len() == 150 {
                break 'outer;
            }
            t.push(json!({"type": "function", "function": {"name": format!("{v}_{n}"),
                "description": format!("{v} the {n} of the account, with paging and filters."),
                "parameters": {"type": "object", "properties": {
                    "page": {"type": "integer", "description": "page number"},
                    "filter": {"type": "string", "description": format!("which {n}")}}}}}));
        }
    }
    t
}

fn script(dir: &TempDir) -> String {
    let path = dir.path().join("script.json");
    let rules = json!([
        // Any turn: search for a weather tool.
        {"when": "", "reply": "<tool_call>\n{\"name\": \"tool_search\", \"arguments\": {\"query\": \"fetch the weather forecast\"}}\n</tool_call>"},
        // Once the definition (its parameter `forecast_days`) is in the prompt: call it.
        {"when": "forecast_days", "reply": "<tool_call>\n{\"name\": \"get_weather_forecast\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"},
        // With the tool's result: answer.
        {"when": "sunny in Oslo", "reply": "The forecast says sunny."},
    ]);
    std::fs::write(&path, rules.to_string()).expect("script");
    path.display().to_string()
}

fn engine(script: &str) -> Engine {
    Engine::sim("m", &["--script", script, "--kv-blocks", "4096", "--max-model-len", "65536"])
}

fn first_turn(stream: bool) -> Value {
    let mut b = json!({"model": "m", "max_tokens": 100, "tools": tools(), "messages": [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "What will the weather be in Oslo?"}]});
    if stream {
        b["stream"] = json!(true);
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

#[test]
fn a_search_is_answered_by_warmpath_and_the_client_sees_the_real_call() {
    let dir = TempDir::new();
    let s = script(&dir);
    let (e, e_full) = (engine(&s), engine(&s));
    let proxy = Proxy::start(&policy("", DEFER, &["m"], &[("e0", e.url())]));
    let full = Proxy::start(&policy("", PASSTHROUGH, &["m"], &[("e1", e_full.url())]));

    // As sent, the engine gets all 150 schemas (so the scripted model sees the weather tool's
    // definition and calls it at once): one round, every schema prefilled.
    let sent = post_json(full.addr, "/v1/chat/completions", &first_turn(false)).json();
    assert_eq!(sent["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_weather_forecast");
    let full_prompt = sent["usage"]["prompt_tokens"].as_u64().expect("usage");

    let r = post_json(proxy.addr, "/v1/chat/completions", &first_turn(false));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let msg = &v["choices"][0]["message"];
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let calls = msg["tool_calls"].as_array().expect("calls");
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["function"]["name"], "get_weather_forecast", "the definition was loaded: {v}");
    assert_eq!(calls[0]["function"]["arguments"], r#"{"city":"Oslo"}"#);
    assert!(!v.to_string().contains("tool_search"), "the client never sees the search: {v}");
    // Two rounds, each far smaller than one round with every schema.
    let prompt = v["usage"]["prompt_tokens"].as_u64().expect("usage");
    assert!(prompt < full_prompt, "two deferred rounds {prompt} vs one full {full_prompt}");

    let m = proxy.metrics();
    assert_eq!(metric(&m, "warmpath_tools_deferred_total{pool=\"main\"}"), Some(149.0), "{m}");
    assert_eq!(metric(&m, "warmpath_tool_searches_total{pool=\"main\",result=\"found\"}"), Some(1.0), "{m}");
    assert!(metric(&m, "warmpath_tools_saved_tokens_total{pool=\"main\"}").unwrap_or(0.0) > 1000.0, "{m}");

    // The client runs the tool and sends the history back: the search goes back in before the
    // call, so the model still sees the definition, and the prefix before it is cached.
    let mut next = first_turn(false);
    let history = next["messages"].as_array_mut().expect("list");
    history.push(msg.clone());
    history.push(json!({"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny in Oslo, 21 C"}));
    let v = post_json(proxy.addr, "/v1/chat/completions", &next).json();
    assert_eq!(v["choices"][0]["message"]["content"], "The forecast says sunny.", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached > 1000, "the stable prefix is served from cache: {v}");
    assert_eq!(metric(&proxy.metrics(), "warmpath_tools_reinserted_total{pool=\"main\"}"), Some(1.0));
}

#[test]
fn a_streamed_search_stays_inside_one_client_stream() {
    let dir = TempDir::new();
    let e = engine(&script(&dir));
    let proxy = Proxy::start(&policy("", DEFER, &["m"], &[("e0", e.url())]));
    let r = post_json(proxy.addr, "/v1/chat/completions", &first_turn(true));
    assert_eq!(r.status, 200, "{}", r.text());
    let text = r.text();
    assert!(!text.contains("tool_search"), "{text}");
    let (events, _) = sse(&text);
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1, "{text}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> =
        events.iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).expect("json")).collect();
    let ids: std::collections::HashSet<&str> = chunks.iter().filter_map(|c| c["id"].as_str()).collect();
    assert_eq!(ids.len(), 1, "one id for the stream: {ids:?}");
    let roles = chunks.iter().filter(|c| c["choices"][0]["delta"]["role"].is_string()).count();
    assert_eq!(roles, 1, "one opening chunk");
    let calls: Vec<&Value> =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(
        (calls[0]["index"].as_u64(), calls[0]["function"]["name"].as_str()),
        (Some(0), Some("get_weather_forecast"))
    );
    let finish: Vec<&str> = chunks.iter().filter_map(|c| c["choices"][0]["finish_reason"].as_str()).collect();
    assert_eq!(finish, ["tool_calls"], "{text}");
    let usage = chunks.iter().rev().find(|c| c["usage"].is_object()).expect("usage chunk");
    let completion = usage["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    assert!(completion > 30, "both rounds' tokens are counted: {usage}");
}

#[test]
fn search_rounds_are_bounded() {
    // A model that only ever searches (no rule loads a tool): after max_search_rounds the
    // client gets a plain end, never a call to tool_search.
    let dir = TempDir::new();
    let path = dir.path().join("script.json");
    std::fs::write(&path, json!([{"when": "", "reply": "<tool_call>\n{\"name\": \"tool_search\", \"arguments\": {\"query\": \"zebra\"}}\n</tool_call>"}]).to_string()).expect("script");
    let e = engine(&path.display().to_string());
    let proxy =
        Proxy::start(&policy("", &format!("{DEFER}\nmax_search_rounds = 2"), &["m"], &[("e0", e.url())]));
    let v = post_json(proxy.addr, "/v1/chat/completions", &first_turn(false)).json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");
    let m = proxy.metrics();
    assert_eq!(metric(&m, "warmpath_tool_searches_total{pool=\"main\",result=\"empty\"}"), Some(2.0), "{m}");
    let streamed = post_json(proxy.addr, "/v1/chat/completions", &first_turn(true)).text();
    assert!(
        !streamed.contains("tool_search") && streamed.contains("\"finish_reason\":\"stop\""),
        "{streamed}"
    );
}

/// The Responses API's own form, for a backend that does not implement it: functions marked
/// `defer_loading` and `{"type": "tool_search"}`. The backend (scripted) gets the core tools and
/// a `tool_search` function, warmpath answers the search, and the client's output shows the
/// search as `tool_search_call` / `tool_search_output` items before the real call. Echoed back
/// next turn, those items reach the backend as the function call and result it knows.
#[test]
fn the_responses_native_tool_search_is_served_for_a_backend_without_it() {
    let up = Scripted::start_with(|body| {
        let text = String::from_utf8_lossy(body);
        let call = if text.contains("forecast_days") {
            json!({"type": "function_call", "call_id": "c_weather", "name": "get_weather_forecast", "arguments": "{\"city\":\"Oslo\"}"})
        } else {
            json!({"type": "function_call", "call_id": "c_search", "name": "tool_search", "arguments": "{\"query\":\"weather forecast\"}"})
        };
        json!({"id": "resp_1", "object": "response", "status": "completed", "output": [call],
               "usage": {"input_tokens": body.len() / 4, "output_tokens": 5, "total_tokens": body.len() / 4 + 5}})
    });
    // The backend's own Responses route (warmpath's own Responses translation is tested in
    // responses.rs).
    let native = format!("responses = \"native\"\n{DEFER}");
    let proxy = Proxy::start(&policy("", &native, &["m"], &[("up", up.url())]));
    let mut tools: Vec<Value> = tools()
        .into_iter()
        .map(|t| {
            let f = &t["function"];
            let name = f["name"].as_str().unwrap_or("");
            json!({"type": "function", "name": name, "description": f["description"], "parameters": f["parameters"],
                   "defer_loading": name != "read_file"})
        })
        .collect();
    tools.push(json!({"type": "tool_search"}));
    let input = vec![json!({"role": "user", "content": "What will the weather be in Oslo?"})];
    let r = post_json(proxy.addr, "/v1/responses", &json!({"model": "m", "input": input, "tools": tools}));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let out = v["output"].as_array().expect("output");
    let kinds: Vec<&str> = out.iter().filter_map(|i| i["type"].as_str()).collect();
    assert_eq!(kinds, ["tool_search_call", "tool_search_output", "function_call"], "{v}");
    assert_eq!(out[0]["arguments"]["query"], "weather forecast");
    assert!(
        out[1]["tools"].as_array().expect("tools").iter().any(|t| t["name"] == "get_weather_forecast"),
        "{v}"
    );
    assert_eq!(out[2]["name"], "get_weather_forecast");

    let bodies = up.bodies.lock().expect("lock").clone();
    assert_eq!(bodies.len(), 2, "two rounds");
    let first: Value = serde_json::from_slice(&bodies[0]).expect("json");
    let names: Vec<&str> =
        first["tools"].as_array().expect("tools").iter().filter_map(|t| t["name"].as_str()).collect();
    assert_eq!(names, ["read_file", "tool_search"], "core tools and the search function only");
    let second = String::from_utf8_lossy(&bodies[1]);
    assert!(second.contains("function_call_output") && second.contains("forecast_days"), "{second}");
    let sum = |b: &[u8]| b.len() as u64 / 4;
    assert_eq!(
        v["usage"]["input_tokens"].as_u64(),
        Some(sum(&bodies[0]) + sum(&bodies[1])),
        "usage of both rounds"
    );

    // Next turn: the client echoes the output back with the tool's result.
    let mut next = vec![json!({"role": "user", "content": "What will the weather be in Oslo?"})];
    next.extend(out.iter().cloned());
    next.push(json!({"type": "function_call_output", "call_id": "c_weather", "output": "sunny in Oslo"}));
    let r = post_json(proxy.addr, "/v1/responses", &json!({"model": "m", "input": next, "tools": tools}));
    assert_eq!(r.status, 200, "{}", r.text());
    let third = String::from_utf8_lossy(&up.bodies.lock().expect("lock")[2]).into_owned();
    assert!(!third.contains("tool_search_call") && !third.contains("tool_search_output"), "{third}");
    assert!(third.contains("\"name\":\"tool_search\"") && third.contains("forecast_days"), "{third}");
}
