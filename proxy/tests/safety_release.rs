//! Output checks and the release policies, against a real engine made to say given things
//! (`--script`): what a client sees of an answer that a check cuts before its first token,
//! mid-stream and after its last, under `after_check`, `stream` and `buffered`; whole answers;
//! redaction of streamed text; Responses over HTTP and WebSocket ending `incomplete`.

use std::time::Duration;

use serde_json::{json, Value};
use warmpath_tests::*;

/// What the scripted engine says, by what the prompt holds.
fn script(dir: &std::path::Path) -> String {
    let path = dir.join("script.json");
    let tail = "and the valley below stayed quiet through the long night while the river ran on and on past \
                the old mill and the sleeping town until morning came at last over the hills omega";
    let rules = json!([
        {"when": "", "reply": "The weather is mild today and the sky is clear over the hills."},
        {"when": "falcon story", "reply": format!("Once upon a time there was a plan. It was called Project Falcon and it was secret, {tail}")},
        {"when": "falcon first", "reply": format!("Project Falcon begins here, {tail}")},
        {"when": "falcon last", "reply": "A short story about nothing at all ends with Project Falcon"},
        {"when": "mail me", "reply": "Write to ann@corp.io for details and have a good day."},
        {"when": "attack story", "reply": format!("Once upon a time there was a castle. Then came the attack on the castle, {tail}")},
        {"when": "weather?", "reply": "The weather is mild today and the sky is clear over the hills."},
    ]);
    std::fs::write(&path, rules.to_string()).expect("script");
    path.display().to_string()
}

const RULES: &str = r#"
[pools.safety.rules]
detect = ["email"]
stages = ["output"]
[pools.safety.rules.deny]
falcon = '(?i)project\s+falcon'
[pools.safety.rules.actions]
falcon = "block"
email = "redact"
"#;

fn output(release: &str, extra: &str) -> String {
    // Text released before its check cannot be masked: `stream` only logs addresses.
    let rules = if release == "stream" {
        RULES.replace("email = \"redact\"", "email = \"log\"")
    } else {
        RULES.to_owned()
    };
    format!("{rules}\n[pools.safety.output]\nrelease = {release:?}\nwindow_tokens = 4\noverlap_tokens = 3\n{extra}")
}

struct Setup {
    _dir: TempDir,
    engine: Engine,
    proxy: Proxy,
}

fn setup(pool_extra: &str, engine_extra: &[&str]) -> Setup {
    let dir = TempDir::new();
    let script = script(dir.path());
    let mut args = vec!["--script", script.as_str()];
    args.extend_from_slice(engine_extra);
    let engine = Engine::sim("m", &args);
    let proxy = Proxy::start(&policy("", pool_extra, &["m"], &[("e", engine.url())]));
    Setup { _dir: dir, engine, proxy }
}

/// A streamed chat's text, its finish reason, and whether `[DONE]` ended it.
fn stream(proxy: &Proxy, prompt: &str) -> (String, Option<String>, bool, Resp) {
    let mut body = chat("m", prompt, 200);
    body["stream"] = json!(true);
    let r = post_json(proxy.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let (data, _) = sse(&r.text());
    let mut text = String::new();
    let mut finish = None;
    for d in &data {
        let Ok(v) = serde_json::from_str::<Value>(d) else { continue };
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_owned());
        }
    }
    let done = data.last().map(String::as_str) == Some("[DONE]");
    (text, finish, done, r)
}

#[test]
fn after_check_never_releases_a_blocked_window() {
    let s = setup(&output("after_check", ""), &[]);
    // Mid-stream: the text before the window is out, nothing from it on.
    let (text, finish, done, r) = stream(&s.proxy, "tell the falcon story");
    assert_eq!(r.header("x-warmpath-safety"), Some("rules; input=pass; output=after_check"));
    assert_eq!(finish.as_deref(), Some("content_filter"), "{}", r.text());
    assert!(done, "[DONE] ends the cut stream");
    assert!(text.starts_with("Once upon a time"), "{text:?}");
    assert!(!text.contains("Falcon") && !text.contains("omega"), "{text:?}");
    // Before the first token: nothing at all.
    let (text, finish, done, _) = stream(&s.proxy, "falcon first please");
    assert_eq!((text.as_str(), finish.as_deref(), done), ("", Some("content_filter"), true));
    // At the very end: everything before the last window, then the cut.
    let (text, finish, _, _) = stream(&s.proxy, "the falcon last one");
    assert_eq!(finish.as_deref(), Some("content_filter"));
    assert!(text.starts_with("A short story") && !text.contains("Falcon"), "{text:?}");
    // A clean answer is untouched.
    let (text, finish, _, _) = stream(&s.proxy, "weather?");
    assert_eq!(
        (text.as_str(), finish.as_deref()),
        ("The weather is mild today and the sky is clear over the hills.", Some("stop"))
    );
    // The cut stopped the engine's generation (its KV freed) rather than letting it run on.
    let running = || metric(&s.engine.metrics(), "vllm:num_requests_running");
    assert!(eventually(Duration::from_secs(5), || running() == Some(0.0)));
    assert_eq!(metric(&s.engine.metrics(), "vllm:kv_cache_usage_perc"), Some(0.0));
    let m = s.proxy.metrics();
    let blocks = r#"warmpath_safety_checks_total{check="rules",pool="main",stage="output",verdict="block"}"#;
    assert_eq!(metric(&m, blocks), Some(3.0), "{m}");
    assert!(metric(&m, "warmpath_safety_output_held_seconds_count").unwrap_or(0.0) > 0.0, "{m}");
    assert_eq!(
        metric(&m, "warmpath_client_disconnects_total").unwrap_or(0.0),
        0.0,
        "a cut is not a disconnect"
    );
}

#[test]
fn a_cut_stream_stops_the_engine_mid_generation() {
    // Slow tokens: the cut comes while the engine still has most of the answer to generate.
    let s = setup(&output("after_check", ""), &["--sim-itl-ms", "30"]);
    let (_, finish, _, _) = stream(&s.proxy, "tell the falcon story");
    assert_eq!(finish.as_deref(), Some("content_filter"));
    let generated = || metric(&s.engine.metrics(), "vllm:generation_tokens_total").unwrap_or(0.0);
    assert!(eventually(Duration::from_secs(5), || metric(&s.engine.metrics(), "vllm:num_requests_running")
        == Some(0.0)));
    let after = generated();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(generated(), after, "nothing generated after the cut");
    assert!(after < 50.0, "the engine stopped well before the answer's ~60 tokens: {after}");
}

#[test]
fn whole_answers_are_judged_before_any_of_it_goes_out() {
    let s = setup(&output("after_check", ""), &[]);
    let r = post_json(s.proxy.addr, "/v1/chat/completions", &chat("m", "tell the falcon story", 200));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-warmpath-safety"), Some("rules; input=pass; output=block"));
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "content_filter", "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap_or(0) > 0, "usage kept: {v}");
    // Redacted in place.
    let r = post_json(s.proxy.addr, "/v1/chat/completions", &chat("m", "mail me", 200));
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        "Write to [EMAIL] for details and have a good day."
    );
    // Completions, too.
    let r = post_json(
        s.proxy.addr,
        "/v1/completions",
        &json!({"model": "m", "prompt": "the falcon last one", "max_tokens": 100}),
    );
    let v = r.json();
    assert_eq!(
        (v["choices"][0]["text"].as_str(), v["choices"][0]["finish_reason"].as_str()),
        (Some(""), Some("content_filter")),
        "{v}"
    );
}

#[test]
fn streamed_redaction_masks_a_span_split_over_tokens() {
    let s = setup(&output("after_check", ""), &[]);
    let (text, finish, _, _) = stream(&s.proxy, "mail me");
    assert_eq!(text, "Write to [EMAIL] for details and have a good day.");
    assert_eq!(finish.as_deref(), Some("stop"));
}

#[test]
fn stream_releases_at_once_and_cuts_where_the_verdict_lands() {
    // Tokens spaced apart, as a real model sends them: each event is released as it comes,
    // before its window closes. (Events that arrive in one read are judged together first.)
    let s = setup(&output("stream", ""), &["--sim-itl-ms", "10"]);
    let (text, finish, done, _) = stream(&s.proxy, "tell the falcon story");
    // The window holding the finding went out before its verdict; nothing after it did.
    assert!(text.contains("Project Falcon"), "{text:?}");
    assert!(!text.contains("omega"), "{text:?}");
    assert_eq!((finish.as_deref(), done), (Some("content_filter"), true));
}

/// A moderation service that takes longer than a few tokens: where the policies differ.
fn slow_moderation(release: &str, extra: &str) -> (ModerationServer, Setup) {
    let m = ModerationServer::start(Behaviour::Answer { delay_ms: 150 });
    let pool = format!(
        "[pools.safety.moderation]\nurl = \"{}\"\nstages = [\"output\"]\n[pools.safety.output]\nrelease = {release:?}\nwindow_tokens = 4\noverlap_tokens = 2\n{extra}",
        m.url()
    );
    (m, setup(&pool, &["--sim-itl-ms", "10"]))
}

#[test]
fn with_a_slow_check_after_check_and_buffered_hold_and_stream_does_not() {
    let (_m, s) = slow_moderation("after_check", "");
    let (text, finish, _, _) = stream(&s.proxy, "the attack story");
    assert_eq!(finish.as_deref(), Some("content_filter"));
    assert!(text.starts_with("Once upon") && !text.contains("attack"), "{text:?}");
    let (text, finish, _, _) = stream(&s.proxy, "weather?");
    assert_eq!(
        (text.as_str(), finish.as_deref()),
        ("The weather is mild today and the sky is clear over the hills.", Some("stop"))
    );

    // Buffered with a lag longer than the check: the verdict stops the text unseen.
    let (_m, s) = slow_moderation("buffered", "lag_tokens = 40");
    let (text, finish, _, _) = stream(&s.proxy, "the attack story");
    assert_eq!(finish.as_deref(), Some("content_filter"));
    assert!(!text.contains("attack"), "{text:?}");

    // Stream: the text is out before the verdict.
    let (_m, s) = slow_moderation("stream", "");
    let (text, finish, _, _) = stream(&s.proxy, "the attack story");
    assert_eq!(finish.as_deref(), Some("content_filter"));
    assert!(text.contains("attack"), "{text:?}");
    assert!(!text.contains("omega"), "cut before the end: {text:?}");
}

#[test]
fn responses_end_incomplete_over_http_and_websocket_and_the_socket_stays_open() {
    let s = setup(&output("after_check", ""), &[]);
    let r =
        post_json(s.proxy.addr, "/v1/responses", &json!({"model": "m", "input": "tell the falcon story"}));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(
        (v["status"].as_str(), v["incomplete_details"]["reason"].as_str()),
        (Some("incomplete"), Some("content_filter")),
        "{v}"
    );
    let said = v["output"][0]["content"][0]["text"].as_str().unwrap_or("").to_owned();
    assert!(said.starts_with("Once upon") && !said.contains("Falcon"), "{v}");
    // What was released is what the conversation holds: the next turn continues from it.
    let next = post_json(
        s.proxy.addr,
        "/v1/responses",
        &json!({"model": "m", "input": "weather?", "previous_response_id": v["id"]}),
    );
    assert_eq!(next.json()["status"], "completed", "{}", next.text());

    let mut ws = Ws::connect(s.proxy.addr, &[]);
    ws.send_json(&json!({"type": "response.create", "model": "m", "input": "tell the falcon story"}));
    let events = ws.turn();
    let last = events.last().expect("events");
    assert_eq!(last["type"], "response.incomplete", "{events:?}");
    assert_eq!(last["response"]["incomplete_details"]["reason"], "content_filter");
    // A WebSocket has no headers: the response's metadata says which checks ran.
    assert_eq!(events[0]["response"]["metadata"]["warmpath_safety"], "rules; input=pass; output=after_check");
    assert_eq!(last["response"]["metadata"]["warmpath_safety"], "rules; input=pass; output=after_check");
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    assert!(!deltas.contains("Falcon"), "{deltas:?}");
    // The connection goes on.
    ws.send_json(&json!({"type": "response.create", "model": "m", "input": "weather?", "previous_response_id": last["response"]["id"]}));
    let events = ws.turn();
    assert_eq!(events.last().expect("events")["type"], "response.completed", "{events:?}");
}

#[test]
fn a_cached_answer_is_released_only_through_the_checks() {
    let s = setup(
        &format!("{}\n[pools.response_cache]\nenabled = true\nttl_s = 60\n", output("after_check", "")),
        &[],
    );
    let mut body = chat("m", "tell the falcon story", 200);
    body["temperature"] = json!(0);
    for (round, cache) in [(0, "miss"), (1, "hit")] {
        let r = post_json(s.proxy.addr, "/v1/chat/completions", &body);
        assert_eq!(r.header("x-warmpath-cache"), Some(cache), "round {round}");
        // The backend's answer is what the cache keeps; what the client gets is judged each time.
        assert_eq!(r.json()["choices"][0]["finish_reason"], "content_filter", "round {round}: {}", r.text());
        assert_eq!(r.json()["choices"][0]["message"]["content"], "");
        let entries = || metric(&s.proxy.metrics(), "warmpath_response_cache_entries{pool=\"main\"}");
        assert!(eventually(Duration::from_secs(5), || entries() == Some(1.0)), "stored");
    }
    // A stream cut short is never complete, so never kept.
    body["stream"] = json!(true);
    for _ in 0..2 {
        let r = post_json(s.proxy.addr, "/v1/chat/completions", &body);
        assert_eq!(r.header("x-warmpath-cache"), Some("miss"));
        assert!(
            r.text().contains("\"finish_reason\":\"content_filter\"") && !r.text().contains("Falcon"),
            "{}",
            r.text()
        );
    }
}

#[test]
fn the_openai_sdk_sees_content_filter_and_incomplete_in_each_api() {
    let venv = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(venv.exists(), "{} missing: run scripts/ensure-deps", venv.display());
    // Both stages, and secrets blocked on the input.
    let rules = output("after_check", "")
        .replace("falcon = \"block\"", "falcon = \"block\"\napi_key = \"block\"")
        .replace("stages = [\"output\"]\n", "")
        .replace("detect = [\"email\"]", "detect = [\"email\", \"api_key\"]");
    let s = setup(&rules, &[]);
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_safety.py");
    let out = std::process::Command::new(venv)
        .arg(script)
        .args([format!("http://{}/v1", s.proxy.addr), "m".to_owned()])
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "client failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(stdout.trim()).expect("json line");
    assert_eq!(v["chat_stream_finish"], "content_filter", "{v}");
    let streamed = v["chat_stream_text"].as_str().unwrap_or("");
    assert!(streamed.starts_with("Once upon") && !streamed.contains("Falcon"), "{v}");
    assert_eq!(
        (v["chat_finish"].as_str(), v["chat_content"].as_str()),
        (Some("content_filter"), Some("")),
        "{v}"
    );
    assert_eq!(v["input_block"], "content_policy_violation", "{v}");
    assert_eq!(
        (v["http_status"].as_str(), v["http_reason"].as_str()),
        (Some("incomplete"), Some("content_filter")),
        "{v}"
    );
    assert!(!v["http_text"].as_str().unwrap_or("Falcon").contains("Falcon"), "{v}");
    assert_eq!(v["http_stream_status"], "incomplete", "{v}");
    assert_eq!(
        (v["ws_first"].as_str(), v["ws_reason"].as_str()),
        (Some("response.incomplete"), Some("content_filter")),
        "{v}"
    );
    assert_eq!(v["ws_second"], "response.completed", "{v}");
    assert_eq!(v["ws_second_text"], "The weather is mild today and the sky is clear over the hills.", "{v}");
}

#[test]
fn a_streamed_answer_that_passed_is_not_judged_again_as_history() {
    // Rules on both stages: an answer passed as output counts as passed input.
    let s = setup(&output("after_check", "").replace("stages = [\"output\"]\n", ""), &[]);
    let (answer, _, _, _) = stream(&s.proxy, "weather?");
    assert!(!answer.is_empty());
    let turns = |stage: &str, outcome: &str| {
        let m = s.proxy.metrics();
        metric(
            &m,
            &format!(r#"warmpath_safety_turns_total{{outcome="{outcome}",pool="main",stage="{stage}"}}"#),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(turns("output", "checked"), 1.0, "the released answer is remembered");
    let history = json!({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and tomorrow?"}]});
    let known = turns("input", "known");
    let r = post_json(s.proxy.addr, "/v1/chat/completions", &history);
    assert_eq!(r.status, 200, "{}", r.text());
    // The first question and the answer are known; only the new question is judged.
    assert_eq!(turns("input", "known") - known, 2.0);
}

/// A backend's own Responses stream of `text` (a word per delta), as vLLM sends it.
fn native_stream(text: &str) -> Vec<u8> {
    let item = json!({"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant", "content": []});
    let part = |t: &str| json!({"type": "output_text", "text": t, "annotations": []});
    let done_item = json!({"id": "msg_1", "type": "message", "status": "completed", "role": "assistant", "content": [part(text)]});
    let response = |status: &str, output: Value| json!({"id": "resp_n", "object": "response", "status": status, "model": "m", "output": output, "metadata": {}});
    let mut events = vec![
        json!({"type": "response.created", "response": response("in_progress", json!([]))}),
        json!({"type": "response.in_progress", "response": response("in_progress", json!([]))}),
        json!({"type": "response.output_item.added", "output_index": 0, "item": item}),
        json!({"type": "response.content_part.added", "output_index": 0, "content_index": 0, "item_id": "msg_1", "part": part("")}),
    ];
    for w in text.split_inclusive(' ') {
        events.push(json!({"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "item_id": "msg_1", "delta": w}));
    }
    events.extend([
        json!({"type": "response.output_text.done", "output_index": 0, "content_index": 0, "item_id": "msg_1", "text": text}),
        json!({"type": "response.content_part.done", "output_index": 0, "content_index": 0, "item_id": "msg_1", "part": part(text)}),
        json!({"type": "response.output_item.done", "output_index": 0, "item": done_item}),
        json!({"type": "response.completed", "response": response("completed", json!([done_item]))}),
    ]);
    let mut out = String::new();
    for (n, mut e) in events.into_iter().enumerate() {
        e["sequence_number"] = json!(n);
        out.push_str(&format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap_or("")));
    }
    out.into_bytes()
}

/// A backend that serves Responses itself: what it says depends on the request's input, streamed
/// or whole as asked.
fn native_backend() -> Scripted {
    Scripted::start_raw(|body| {
        let req: Value = serde_json::from_slice(body).unwrap_or_default();
        let input = req["input"].as_str().unwrap_or("");
        let text = if input.contains("mail") {
            "Write to ann@corp.io for details and have a good day."
        } else if input.contains("falcon") {
            "Once upon a time there was a plan. It was called Project Falcon and it was secret, and then more."
        } else {
            "The weather is mild today."
        };
        if req["stream"] == json!(true) {
            return ("text/event-stream", native_stream(text));
        }
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        let whole = json!({"id": "resp_w", "object": "response", "status": "completed", "model": "m",
                           "output": [{"id": "msg_1", "type": "message", "status": "completed", "role": "assistant", "content": [part]}]});
        ("application/json", whole.to_string().into_bytes())
    })
}

#[test]
fn a_pool_that_serves_responses_natively_has_its_answers_checked() {
    let up = native_backend();
    let pool = format!("responses = \"native\"\n{}", output("after_check", ""));
    let proxy = Proxy::start(&policy("", &pool, &["m"], &[("s", up.url())]));
    let ask = |input: &str, stream: bool| {
        let r =
            post_json(proxy.addr, "/v1/responses", &json!({"model": "m", "input": input, "stream": stream}));
        assert_eq!(r.status, 200, "{}", r.text());
        r
    };
    let events = |r: &Resp| -> Vec<Value> {
        sse(&r.text()).0.iter().filter_map(|d| serde_json::from_str(d).ok()).collect()
    };
    let deltas = |evs: &[Value]| -> String {
        evs.iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .filter_map(|e| e["delta"].as_str())
            .collect()
    };

    // Redaction: the deltas are masked, and so is every event that states the text again.
    let r = ask("mail me", true);
    assert_eq!(r.header("x-warmpath-safety"), Some("rules; input=pass; output=after_check"));
    assert!(!r.text().contains("ann@corp.io"), "{}", r.text());
    let evs = events(&r);
    let masked = "Write to [EMAIL] for details and have a good day.";
    assert_eq!(deltas(&evs), masked);
    let of = |kind: &str| evs.iter().find(|e| e["type"] == kind).cloned().unwrap_or_default();
    assert_eq!(of("response.output_text.done")["text"], masked);
    assert_eq!(of("response.content_part.done")["part"]["text"], masked);
    assert_eq!(of("response.output_item.done")["item"]["content"][0]["text"], masked);
    assert_eq!(of("response.completed")["response"]["output"][0]["content"][0]["text"], masked);

    // A block mid-stream: the text before the finding, then `response.incomplete` holding it.
    let r = ask("tell the falcon story", true);
    assert!(!r.text().contains("Falcon") && !r.text().contains("response.completed"), "{}", r.text());
    let evs = events(&r);
    let last = evs.last().expect("events");
    assert_eq!(last["type"], "response.incomplete", "{evs:?}");
    assert_eq!(sse(&r.text()).1.last().map(String::as_str), Some("response.incomplete"));
    assert_eq!(last["response"]["incomplete_details"]["reason"], "content_filter");
    assert_eq!(last["response"]["id"], "resp_n");
    let seen = deltas(&evs);
    assert!(seen.starts_with("Once upon"), "{seen:?}");
    assert_eq!(last["response"]["output"][0]["content"][0]["text"], seen.as_str(), "what the client saw");
    assert_eq!(last["response"]["output"][0]["status"], "incomplete");
    let before = evs[evs.len() - 2]["sequence_number"].as_u64().expect("numbered");
    assert_eq!(last["sequence_number"], before + 1);

    // Whole answers: masked, or emptied and incomplete.
    let v = ask("mail me", false).json();
    assert_eq!(v["output"][0]["content"][0]["text"], masked, "{v}");
    let r = ask("tell the falcon story", false);
    assert_eq!(r.header("x-warmpath-safety"), Some("rules; input=pass; output=block"));
    let v = r.json();
    assert_eq!(
        (v["status"].as_str(), v["incomplete_details"]["reason"].as_str()),
        (Some("incomplete"), Some("content_filter"))
    );
    assert_eq!(v["output"][0]["content"][0]["text"], "", "{v}");
    // A clean answer goes through as the backend wrote it.
    let r = ask("weather?", true);
    assert!(r.text().contains("response.completed") && r.text().contains("The weather is mild today."));
    let m = proxy.metrics();
    let blocks = r#"warmpath_safety_checks_total{check="rules",pool="main",stage="output",verdict="block"}"#;
    assert_eq!(metric(&m, blocks), Some(2.0), "{m}");
}

#[test]
fn time_to_first_token_counts_what_the_release_held() {
    // after_check releases nothing before the first window (4 tokens, 40 ms apart) is judged:
    // the client's first byte comes at least three token gaps after the backend's.
    let s = setup(&output("after_check", ""), &["--sim-itl-ms", "40"]);
    let (text, _, _, _) = stream(&s.proxy, "weather?");
    assert!(text.starts_with("The weather"), "{text:?}");
    let m = s.proxy.metrics();
    let ttft = metric_sum(&m, "warmpath_ttft_seconds_sum{");
    assert!(ttft > 0.0, "observed: {m}");
    assert!(ttft >= 0.12, "the TTFT warmpath reports includes the hold: {ttft}");
}
