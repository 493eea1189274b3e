//! The Responses API served by warmpath over engines that speak only Chat Completions: turns
//! chained by `previous_response_id` from warmpath's conversation store, function calls as
//! output items, the streaming event sequence, and the errors a client can cause.

use serde_json::{json, Value};
use warmpath_tests::*;

fn post_with_key(proxy: &Proxy, key: &str, body: &Value) -> Resp {
    let auth = format!("Bearer {key}");
    let bytes = body.to_string();
    request(
        proxy.addr,
        "POST",
        "/v1/responses",
        &[("content-type", "application/json"), ("authorization", &auth)],
        bytes.as_bytes(),
    )
}

#[test]
fn a_tool_calling_conversation_continues_from_the_store() {
    let dir = TempDir::new();
    let e = Engine::sim("m", &["--script", &weather_script(dir.path())]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let first = json!({"model": "m", "instructions": "You are a weather agent.",
                       "input": "What will the weather be in Oslo tomorrow?", "tools": weather_tools(), "max_output_tokens": 64});
    let r = post_with_key(&proxy, "k1", &first);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-warmpath-backend"), Some("e0"));
    let v = r.json();
    assert_eq!((v["object"].as_str(), v["status"].as_str()), (Some("response"), Some("completed")), "{v}");
    let id = v["id"].as_str().expect("id").to_owned();
    assert!(id.starts_with("resp_"), "{id}");
    let call = &v["output"][0];
    assert_eq!(
        (call["type"].as_str(), call["name"].as_str()),
        (Some("function_call"), Some("get_weather")),
        "{v}"
    );
    assert_eq!(
        serde_json::from_str::<Value>(call["arguments"].as_str().expect("args")).expect("json"),
        json!({"city": "Oslo"})
    );
    let first_input = v["usage"]["input_tokens"].as_u64().expect("usage");

    // The next turn sends only the tool's result: the conversation comes from the store.
    let next = json!({"model": "m", "instructions": "You are a weather agent.", "previous_response_id": id,
                      "tools": weather_tools(), "max_output_tokens": 64,
                      "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny in Oslo, 21 C"}]});
    let v2 = post_with_key(&proxy, "k1", &next).json();
    assert_eq!(v2["output"][0]["type"], "message", "{v2}");
    assert_eq!(v2["output"][0]["content"][0]["text"], "It will be sunny.", "{v2}");
    assert_eq!(v2["previous_response_id"], json!(id));
    // The engine saw the whole conversation, its first turn served from its prefix cache.
    let input = v2["usage"]["input_tokens"].as_u64().expect("usage");
    let cached = v2["usage"]["input_tokens_details"]["cached_tokens"].as_u64().expect("cached");
    assert!(input > first_input && cached >= first_input / 2, "{first_input} then {input} ({cached} cached)");

    // Another API key cannot continue it, and an unknown id is the same error.
    for (key, prev) in [("k2", id.as_str()), ("k1", "resp_nope")] {
        let mut body = next.clone();
        body["previous_response_id"] = json!(prev);
        let r = post_with_key(&proxy, key, &body);
        assert_eq!(r.status, 404, "{key} {prev}: {}", r.text());
        let err = r.json()["error"].clone();
        assert_eq!(
            (err["code"].as_str(), err["param"].as_str()),
            (Some("previous_response_not_found"), Some("previous_response_id"))
        );
    }
    let m = proxy.metrics();
    assert_eq!(
        metric(&m, "warmpath_responses_turns_total{outcome=\"completed\",transport=\"http\"}"),
        Some(2.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "warmpath_rejections_total{reason=\"previous_response_not_found\"}"),
        Some(2.0),
        "{m}"
    );
}

#[test]
fn a_streamed_response_is_the_responses_event_sequence() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let r = post_json(
        proxy.addr,
        "/v1/responses",
        &json!({"model": "m", "input": "hello", "stream": true, "max_output_tokens": 6}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.header("content-type").is_some_and(|c| c.starts_with("text/event-stream")));
    let text = r.text();
    let mut kinds = Vec::new();
    let mut datas = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let ev = block.lines().find_map(|l| l.strip_prefix("event: ")).expect("event line");
        let data: Value =
            serde_json::from_str(block.lines().find_map(|l| l.strip_prefix("data: ")).expect("data"))
                .expect("json");
        assert_eq!(data["type"], ev, "the event name is the data's type");
        kinds.push(ev.to_owned());
        datas.push(data);
    }
    let deltas = kinds.iter().filter(|k| *k == "response.output_text.delta").count();
    let mut want = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    want.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    want.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]);
    assert_eq!(kinds, want, "{text}");
    assert!(deltas >= 1);
    for (i, d) in datas.iter().enumerate() {
        assert_eq!(d["sequence_number"], i as u64);
    }
    let last = &datas.last().expect("last")["response"];
    assert_eq!(last["incomplete_details"]["reason"], "max_output_tokens", "6 tokens, stopped by the limit");
    assert_eq!(last["usage"]["output_tokens"], 6);
    let joined: String = datas.iter().filter_map(|d| d["delta"].as_str()).collect();
    assert_eq!(last["output"][0]["content"][0]["text"], joined.as_str());
}

#[test]
fn unstored_responses_cannot_be_continued_and_bad_input_is_a_400() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let v = post_json(
        proxy.addr,
        "/v1/responses",
        &json!({"model": "m", "input": "hi", "store": false, "max_output_tokens": 2}),
    )
    .json();
    assert_eq!(v["store"], false);
    let r = post_json(
        proxy.addr,
        "/v1/responses",
        &json!({"model": "m", "input": "more", "previous_response_id": v["id"]}),
    );
    assert_eq!(r.status, 404, "{}", r.text());
    for (body, param) in [
        (json!({"model": "m", "input": [{"type": "function_call", "name": "f"}]}), "input[0]"),
        (json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}), "tools[0].type"),
        (json!({"input": "x"}), "model"),
    ] {
        let r = post_json(proxy.addr, "/v1/responses", &body);
        assert_eq!(
            (r.status, r.json()["error"]["param"].as_str().map(str::to_owned)),
            (400, Some(param.to_owned())),
            "{body}"
        );
    }
    let r = request(proxy.addr, "POST", "/v1/responses", &[], b"{not json");
    assert_eq!(r.status, 400);
    let r = post_json(proxy.addr, "/v1/responses", &json!({"model": "nope", "input": "x"}));
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str().map(str::to_owned)),
        (404, Some("model_not_found".to_owned()))
    );
}

#[test]
fn a_stream_the_backend_cuts_ends_with_response_failed() {
    let dying = Engine::sim("m", &["--fault-die-after-tokens", "2"]);
    let proxy = Proxy::start(&policy("[health]\nenabled = false\n", "", &["m"], &[("d", dying.url())]));
    let r = post_json(
        proxy.addr,
        "/v1/responses",
        &json!({"model": "m", "input": "hello", "stream": true, "max_output_tokens": 16}),
    );
    assert_eq!(r.status, 200);
    let text = r.text();
    let last = text.split("\n\n").filter(|b| !b.trim().is_empty()).last().expect("an event");
    assert!(last.starts_with("event: response.failed"), "{text}");
    assert!(last.contains("upstream_stream_error"), "{last}");
    // Not streamed, the same failure is a 502 error.
    let r = post_json(
        proxy.addr,
        "/v1/responses",
        &json!({"model": "m", "input": "hello", "max_output_tokens": 16}),
    );
    assert_eq!(r.status, 502, "{}", r.text());
}

fn redis_policy(redis: &RedisServer) -> String {
    format!("[session]\nstore = \"redis\"\nredis_url = \"{}\"\nredis_timeout_ms = 500\n", redis.url())
}

/// Two warmpath replicas share a Redis server: a conversation started over a WebSocket on one
/// continues on the other after the connection drops; another API key still cannot read it.
#[test]
fn a_conversation_continues_on_another_replica_through_redis() {
    let dir = TempDir::new();
    let e = Engine::sim("m", &["--script", &weather_script(dir.path())]);
    let redis = RedisServer::start();
    let a = Proxy::start(&policy(&redis_policy(&redis), "", &["m"], &[("e0", e.url())]));
    let b = Proxy::start(&policy(&redis_policy(&redis), "", &["m"], &[("e0", e.url())]));

    let mut ws = Ws::connect(a.addr, &[("authorization", "Bearer k1")]);
    ws.send_json(&json!({"type": "response.create", "model": "m", "input": "What will the weather be in Oslo tomorrow?", "tools": weather_tools()}));
    let done = ws.turn().last().expect("events")["response"].clone();
    assert_eq!(done["status"], "completed", "{done}");
    drop(ws);

    let call = &done["output"][0];
    let next = |prev: &Value| {
        json!({"type": "response.create", "model": "m", "previous_response_id": prev, "tools": weather_tools(),
               "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny in Oslo"}]})
    };
    let mut other = Ws::connect(b.addr, &[("authorization", "Bearer k2")]);
    other.send_json(&next(&done["id"]));
    let refused = other.turn();
    assert_eq!(refused[0]["error"]["code"], "previous_response_not_found", "{refused:?}");

    let mut ws = Ws::connect(b.addr, &[("authorization", "Bearer k1")]);
    ws.send_json(&next(&done["id"]));
    let events = ws.turn();
    let second = events.last().expect("events")["response"].clone();
    assert!(!second.is_null(), "{events:?}");
    assert_eq!(second["output"][0]["content"][0]["text"], "It will be sunny.", "{second}");
    assert!(second["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) > 0, "{second}");
    assert_eq!(metric(&b.metrics(), "warmpath_session_store_ops_total{op=\"put\",result=\"ok\"}"), Some(1.0));
}

/// Redis gone: a turn that needs the store gets 503 `session_store_unavailable`; one that does
/// not is served, its store write failing on the side.
#[test]
fn a_lost_redis_is_a_503_for_continuations_only() {
    let e = Engine::sim("m", &[]);
    let mut redis = RedisServer::start();
    let proxy = Proxy::start(&policy(&redis_policy(&redis), "", &["m"], &[("e0", e.url())]));
    let v =
        post_json(proxy.addr, "/v1/responses", &json!({"model": "m", "input": "hi", "max_output_tokens": 2}))
            .json();
    redis.kill();
    let r = post_json(
        proxy.addr,
        "/v1/responses",
        &json!({"model": "m", "input": "more", "previous_response_id": v["id"]}),
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "session_store_unavailable");
    let r = post_json(
        proxy.addr,
        "/v1/responses",
        &json!({"model": "m", "input": "new", "max_output_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let m = proxy.metrics();
    assert_eq!(metric(&m, "warmpath_session_store_ops_total{op=\"get\",result=\"error\"}"), Some(1.0), "{m}");
    assert_eq!(metric(&m, "warmpath_session_store_ops_total{op=\"put\",result=\"error\"}"), Some(1.0), "{m}");
}

/// A Redis that needs a password: `[redis] password` (here from the environment) or the URL's
/// (`[session] redis_url`, the older spelling) authenticates every connection; a wrong one is
/// a store failure (503 for a continuation), not a crash or a silent loss.
#[test]
fn redis_with_a_password() {
    let e = Engine::sim("m", &[]);
    let redis = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let store = |pw: &str| {
        format!(
            "[session]\nstore = \"redis\"\nredis_url = \"redis://:{pw}@127.0.0.1:{}/2\"\nredis_timeout_ms = 500\n",
            redis.port
        )
    };
    // The password from the environment (`[redis] password = "$NAME"`), kept out of the file.
    std::env::set_var("WARMPATH_TEST_REDIS_PASSWORD", "s3cret");
    let from_env = format!(
        "[redis]\nurl = \"redis://127.0.0.1:{}/2\"\npassword = \"$WARMPATH_TEST_REDIS_PASSWORD\"\n\n[session]\nstore = \"redis\"\n",
        redis.port
    );
    let good = Proxy::start(&policy(&from_env, "", &["m"], &[("e0", e.url())]));
    let bad = Proxy::start(&policy(&store("wrong"), "", &["m"], &[("e0", e.url())]));
    let v =
        post_json(good.addr, "/v1/responses", &json!({"model": "m", "input": "hi", "max_output_tokens": 2}))
            .json();
    let next =
        json!({"model": "m", "input": "more", "previous_response_id": v["id"], "max_output_tokens": 2});
    let r = post_json(good.addr, "/v1/responses", &next);
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post_json(bad.addr, "/v1/responses", &next);
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("session_store_unavailable"), "{}", r.text());
}

/// The token ids of a `/v1/completions` body.
fn prompt_ids(body: &[u8]) -> Vec<u64> {
    let v: Value = serde_json::from_slice(body).expect("json");
    v["prompt"].as_array().expect("ids").iter().filter_map(Value::as_u64).collect()
}

const WP32K: &str = "[pools.canon]\ntokenizer = \"wp32k\"";

/// Where the pool renders prompts exactly as its backends, a turn goes out as a token-id
/// completion: the stored conversation's ids, then only the new items'. Tool calls are read
/// out of the completion's text.
#[test]
fn token_id_turns_send_the_stored_ids_and_read_tool_calls_from_the_text() {
    let n = std::sync::atomic::AtomicUsize::new(0);
    let up = Scripted::start_with(move |_| {
        let text = match n.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
            0 => {
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"
            }
            _ => "It will be sunny.",
        };
        json!({"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})
    });
    let proxy = Proxy::start(&policy("", WP32K, &["m"], &[("up", up.url())]));
    let mut ws = Ws::connect(proxy.addr, &[]);
    ws.send_json(
        &json!({"type": "response.create", "model": "m", "instructions": "You are a weather agent.",
                         "input": "Weather in Oslo?", "tools": weather_tools()}),
    );
    let first = ws.turn();
    let done = &first.last().expect("events")["response"];
    let call = &done["output"][0];
    assert_eq!(
        (call["type"].as_str(), call["name"].as_str()),
        (Some("function_call"), Some("get_weather")),
        "{done}"
    );
    assert_eq!(call["arguments"], "{\"city\":\"Oslo\"}");
    ws.send_json(&json!({"type": "response.create", "model": "m", "instructions": "You are a weather agent.",
                         "previous_response_id": done["id"], "tools": weather_tools(),
                         "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]}));
    let second = ws.turn();
    assert_eq!(
        second.last().expect("events")["response"]["output"][0]["content"][0]["text"],
        "It will be sunny."
    );

    let heads = up.heads.lock().expect("lock").clone();
    let bodies = up.bodies.lock().expect("lock").clone();
    assert!(heads.iter().all(|h| h.starts_with("POST /v1/completions ")), "{heads:?}");
    let (p1, p2) = (prompt_ids(&bodies[0]), prompt_ids(&bodies[1]));
    // The second prompt is the first (less its generation prompt) plus the new turns.
    let kept = p1.len() - 4;
    assert_eq!(p2[..kept], p1[..kept], "the stored ids come back as they were sent");
    assert!(p2.len() > p1.len() + 20, "{} then {}", p1.len(), p2.len());
}

/// Against the bundled engine: the second turn's prompt is served from the prefix cache, as the
/// stored ids are exactly the ones the engine computed.
#[test]
fn token_id_turns_hit_the_engines_prefix_cache() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", WP32K, &["m"], &[("e0", e.url())]));
    let mut ws = Ws::connect(proxy.addr, &[]);
    let system = "You are a careful assistant. ".repeat(20);
    ws.send_json(&json!({"type": "response.create", "model": "m", "instructions": system, "input": "hello there", "max_output_tokens": 8}));
    let first = ws.turn().last().expect("events")["response"].clone();
    let p1 = first["usage"]["input_tokens"].as_u64().expect("usage");
    ws.send_json(&json!({"type": "response.create", "model": "m", "instructions": system, "previous_response_id": first["id"],
                         "input": "and again", "max_output_tokens": 8}));
    let second = ws.turn().last().expect("events")["response"].clone();
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"].as_u64().expect("cached");
    assert!(cached >= p1 - 16, "turn 1 had {p1} prompt tokens, turn 2 found {cached} cached: {second}");
}

/// Token-id turns with deferred tools: the backend sees the core tools and `tool_search`; when
/// the model only searches, warmpath answers, appends the search and its result to the ids and
/// calls again, and the client sees one response with the real call. The next turn's prompt
/// starts with everything before, the search included.
#[test]
fn token_id_turns_answer_tool_searches_inside_the_turn() {
    let n = std::sync::atomic::AtomicUsize::new(0);
    let up = Scripted::start_with(move |_| {
        let text = match n.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
            0 => "<tool_call>\n{\"name\": \"tool_search\", \"arguments\": {\"query\": \"weather forecast\"}}\n</tool_call>",
            1 => "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>",
            _ => "It will be sunny.",
        };
        json!({"choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}})
    });
    let pool = "[pools.canon]\nenabled = true\ntokenizer = \"wp32k\"\n[pools.tools]\ndefer = true\nthreshold = 2\ncore = [\"read_file\"]";
    let proxy = Proxy::start(&policy("", pool, &["m"], &[("up", up.url())]));
    let mut many = weather_tools().as_array().expect("tools").clone();
    for name in ["read_file", "list_dir", "run_tests"] {
        many.push(
            json!({"type": "function", "name": name, "description": format!("{name} on the workspace"),
                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}),
        );
    }
    let mut ws = Ws::connect(proxy.addr, &[]);
    ws.send_json(
        &json!({"type": "response.create", "model": "m", "input": "Weather in Oslo?", "tools": many}),
    );
    let first = ws.turn();
    let text = serde_json::to_string(&first).expect("json");
    assert!(!text.contains("tool_search"), "the client never sees the search: {text}");
    let done = &first.last().expect("events")["response"];
    assert_eq!(done["output"].as_array().map(Vec::len), Some(1), "{done}");
    assert_eq!(done["output"][0]["name"], "get_weather", "{done}");
    assert_eq!(done["usage"]["input_tokens"], 200, "two backend calls: {done}");
    ws.send_json(&json!({"type": "response.create", "model": "m", "previous_response_id": done["id"], "tools": many,
                         "input": [{"type": "function_call_output", "call_id": done["output"][0]["call_id"], "output": "sunny"}]}));
    let second = ws.turn();
    assert_eq!(
        second.last().expect("events")["response"]["output"][0]["content"][0]["text"],
        "It will be sunny."
    );

    let bodies = up.bodies.lock().expect("lock").clone();
    assert_eq!(bodies.len(), 3, "search round, answer round, next turn");
    let (p1, p2, p3) = (prompt_ids(&bodies[0]), prompt_ids(&bodies[1]), prompt_ids(&bodies[2]));
    let k1 = p1.len() - 4;
    assert_eq!(p2[..k1], p1[..k1], "the answer round extends the search round");
    let k2 = p2.len() - 4;
    assert_eq!(p3[..k2], p2[..k2], "the next turn extends both, the search included");
    let m = proxy.metrics();
    assert_eq!(metric(&m, "warmpath_tool_searches_total{pool=\"main\",result=\"found\"}"), Some(1.0), "{m}");
    assert!(metric(&m, "warmpath_tools_loaded_total{pool=\"main\"}").unwrap_or(0.0) >= 1.0, "{m}");
}
