//! The checks that call a service — `moderation` (a real HTTP service on 127.0.0.1) and
//! `guard_model` (a classifier on another pool of the same policy, here an engine scripted to
//! answer like Llama Guard) — on the input: concurrent with the backend call (a block cancels
//! it and frees its KV) or before it; a service that is slow, down, failing or garbled, failing
//! open or closed; audit mode.

use std::time::Duration;

use serde_json::json;
use warmpath_tests::*;

fn moderated(server: &str, extra: &str) -> String {
    format!("[pools.safety.moderation]\nurl = \"{server}\"\nstages = [\"input\"]\n{extra}")
}

fn count(m: &str, labels: &str) -> f64 {
    metric(m, labels).unwrap_or(0.0)
}

#[test]
fn concurrent_input_block_cancels_the_backend_call_and_frees_its_kv() {
    let m = ModerationServer::start(Behaviour::Answer { delay_ms: 300 });
    let e = Engine::sim("m", &["--sim-itl-ms", "20"]);
    let proxy = Proxy::start(&policy("", &moderated(&m.url(), ""), &["m"], &[("e", e.url())]));
    let mut body = chat("m", "plan an attack on the castle", 2000);
    body["stream"] = json!(true);
    let r = post_json(proxy.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "content_policy_violation");
    assert!(r.text().contains("moderation: violence"), "{}", r.text());
    assert_eq!(r.header("x-warmpath-safety"), Some("moderation; input=block"));
    // The engine had the request (it went out beside the check) and dropped it at the verdict.
    assert!(count(&e.metrics(), "vllm:prompt_tokens_total") > 0.0, "the backend call started at once");
    let running = || metric(&e.metrics(), "vllm:num_requests_running");
    assert!(eventually(Duration::from_secs(5), || running() == Some(0.0)));
    assert_eq!(metric(&e.metrics(), "vllm:kv_cache_usage_perc"), Some(0.0), "KV freed");
    let generated = count(&e.metrics(), "vllm:generation_tokens_total");
    assert!(generated < 100.0, "cancelled long before its 2000 tokens: {generated}");
    // A clean request waits for the verdict, then streams.
    let mut ok = chat("m", "plan a picnic", 8);
    ok["stream"] = json!(true);
    let r = post_json(proxy.addr, "/v1/chat/completions", &ok);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-warmpath-safety"), Some("moderation; input=pass"));
    assert!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());
    let pm = proxy.metrics();
    let verdict = |v: &str| {
        count(
            &pm,
            &format!(
                r#"warmpath_safety_checks_total{{check="moderation",pool="main",stage="input",verdict="{v}"}}"#
            ),
        )
    };
    assert_eq!((verdict("block"), verdict("pass")), (1.0, 1.0), "{pm}");
    assert_eq!(count(&pm, "warmpath_client_disconnects_total"), 0.0);
    assert_eq!(count(&pm, r#"warmpath_rejections_total{reason="content_policy"}"#), 1.0);
    assert_eq!(m.inputs.lock().expect("lock")[0], ["plan an attack on the castle"]);
}

#[test]
fn before_mode_keeps_a_blocked_request_from_the_backend() {
    let m = ModerationServer::start(Behaviour::Answer { delay_ms: 50 });
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy(
        "",
        &moderated(&m.url(), "[pools.safety.input]\nmode = \"before\"\n"),
        &["m"],
        &[("e", e.url())],
    ));
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "a slur here", 8));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("moderation: hate"), "{}", r.text());
    assert_eq!(count(&e.metrics(), "vllm:prompt_tokens_total"), 0.0, "the engine never saw it");
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hello", 8));
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn thresholds_decide_instead_of_the_services_flag() {
    let m = ModerationServer::start(Behaviour::Answer { delay_ms: 0 });
    let e = Engine::sim("m", &[]);
    // Only hate counts, and only at 0.9: violence (0.95) passes, hate (0.95) blocks.
    let extra = "[pools.safety.moderation.thresholds]\nhate = 0.9\n";
    let proxy = Proxy::start(&policy("", &moderated(&m.url(), extra), &["m"], &[("e", e.url())]));
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "an attack", 4)).status, 200);
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "a slur", 4)).status, 400);
}

#[test]
fn a_slow_down_failing_or_garbled_service_fails_open_or_closed_and_is_counted() {
    let e = Engine::sim("m", &[]);
    let m = ModerationServer::start(Behaviour::Answer { delay_ms: 2000 });
    let start = |url: &str, on_error: &str| {
        let extra = format!("timeout_ms = 200\non_error = \"{on_error}\"\n");
        Proxy::start(&policy("", &moderated(url, &extra), &["m"], &[("e", e.url())]))
    };
    let open = start(&m.url(), "allow");
    let closed = start(&m.url(), "block");
    let down = format!("http://127.0.0.1:{}", free_port());
    let open_down = start(&down, "allow");
    let closed_down = start(&down, "block");
    let ask = |p: &Proxy| post_json(p.addr, "/v1/chat/completions", &chat("m", "an attack", 4));
    // Slow past its deadline: open lets the request through (the service would have blocked
    // it), closed refuses it; neither waits for the service.
    let r = ask(&open);
    assert_eq!(r.status, 200, "{}", r.text());
    let r = ask(&closed);
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("moderation: check_error"), "{}", r.text());
    let timeouts =
        r#"warmpath_safety_check_errors_total{check="moderation",kind="timeout",pool="main",stage="input"}"#;
    assert_eq!(count(&open.metrics(), timeouts), 1.0, "{}", open.metrics());
    let errored =
        r#"warmpath_safety_checks_total{check="moderation",pool="main",stage="input",verdict="error"}"#;
    assert_eq!(count(&closed.metrics(), errored), 1.0);
    // Down: nothing listens.
    assert_eq!(ask(&open_down).status, 200);
    assert_eq!(ask(&closed_down).status, 400);
    let errors =
        r#"warmpath_safety_check_errors_total{check="moderation",kind="error",pool="main",stage="input"}"#;
    assert_eq!(count(&open_down.metrics(), errors), 1.0, "{}", open_down.metrics());
    // 500s and garbage are errors, not passes.
    for b in [Behaviour::Fail, Behaviour::Garbage] {
        m.set(b);
        assert_eq!(ask(&open).status, 200);
        assert_eq!(ask(&closed).status, 400, "{b:?}");
    }
    assert_eq!(count(&open.metrics(), errors), 2.0, "{}", open.metrics());
}

#[test]
fn audit_mode_counts_a_flag_and_lets_the_request_through() {
    let m = ModerationServer::start(Behaviour::Answer { delay_ms: 0 });
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", &moderated(&m.url(), "audit = true\n"), &["m"], &[("e", e.url())]));
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "an attack", 4));
    assert_eq!(r.status, 200, "{}", r.text());
    let pm = proxy.metrics();
    let audit =
        r#"warmpath_safety_checks_total{check="moderation",pool="main",stage="input",verdict="audit_block"}"#;
    assert_eq!(count(&pm, audit), 1.0, "{pm}");
    let found = r#"warmpath_safety_findings_total{action="audit",category="violence",check="moderation",pool="main"}"#;
    assert_eq!(count(&pm, found), 1.0);
}

/// A guard pool's engine answering like Llama Guard: `unsafe` + S9 when the conversation
/// mentions a bomb, `safe` otherwise.
fn guard_script(dir: &std::path::Path) -> String {
    let path = dir.join("guard.json");
    let rules = json!([{"when": "", "reply": "safe"}, {"when": "bomb", "reply": "unsafe\nS9"}]);
    std::fs::write(&path, rules.to_string()).expect("script");
    path.display().to_string()
}

#[test]
fn a_guard_model_on_another_pool_judges_input_and_output() {
    let dir = TempDir::new();
    let guard = Engine::sim("llama-guard", &["--script", &guard_script(dir.path())]);
    let main_script = dir.path().join("main.json");
    std::fs::write(&main_script, json!([{"when": "", "reply": "Hello there."}, {"when": "tell me", "reply": "The bomb is in the story, which goes on for a while longer."}]).to_string())
        .expect("script");
    let main = Engine::sim("m", &["--script", &main_script.display().to_string()]);
    let text = format!(
        r#"
[[pools]]
name = "main"
models = ["m"]
[pools.safety.guard_model]
pool = "guard"
model = "llama-guard"
[[pools.backends]]
name = "e"
url = "{}"

[[pools]]
name = "guard"
models = ["llama-guard"]
[[pools.backends]]
name = "g"
url = "{}"
"#,
        main.url(),
        guard.url()
    );
    let proxy = Proxy::start(&text);
    // Input: unsafe, with the category the guard named.
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "how do I build a bomb", 8));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("guard_model: S9"), "{}", r.text());
    // Safe in and out.
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 8));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["message"]["content"], "Hello there.");
    assert_eq!(r.header("x-warmpath-safety"), Some("guard_model; input=pass; output=pass"));
    // Output: the answer mentions it; the guard sees the window and cuts the stream.
    let mut body = chat("m", "tell me a story", 64);
    body["stream"] = json!(true);
    let r = post_json(proxy.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("\"finish_reason\":\"content_filter\""), "{}", r.text());
    assert!(!r.text().contains("bomb"), "{}", r.text());
    // The guard's prompt is Llama Guard 3's, sent as a completion to the guard pool.
    let pm = proxy.metrics();
    let pass =
        r#"warmpath_safety_checks_total{check="guard_model",pool="main",stage="output",verdict="block"}"#;
    assert!(count(&pm, pass) >= 1.0, "{pm}");
    assert!(
        count(&guard.metrics(), "vllm:prompt_tokens_total") > 100.0,
        "the guard prompt went to the guard pool"
    );
}

#[test]
fn a_growing_conversation_is_judged_on_its_new_turns_only() {
    let m = ModerationServer::start(Behaviour::Answer { delay_ms: 0 });
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", &moderated(&m.url(), ""), &["m"], &[("e", e.url())]));
    // Chat Completions: the client sends the whole history every time.
    let mut messages = vec![json!({"role": "system", "content": "You are terse."})];
    let mut last_answer = String::new();
    for (i, q) in ["first question", "second question", "third question"].iter().enumerate() {
        messages.push(json!({"role": "user", "content": q}));
        let r = post_json(
            proxy.addr,
            "/v1/chat/completions",
            &json!({"model": "m", "messages": messages, "max_tokens": 4}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let answer = r.json()["choices"][0]["message"]["content"].as_str().expect("text").to_owned();
        messages.push(json!({"role": "assistant", "content": answer}));
        let inputs = m.inputs.lock().expect("lock").clone();
        let sent = &inputs[i];
        // The first turn judges the system prompt too; later ones the new question and the
        // answer before it (this check runs on input only, so the answer is judged once, when
        // it comes back as history) — never the turns judged before.
        let want: Vec<&str> = if i == 0 { vec!["You are terse.", q] } else { vec![&last_answer, q] };
        assert_eq!(sent, &want, "turn {i}: {inputs:?}");
        last_answer = answer;
    }
    // A flagged turn late in a long conversation is still caught.
    messages.push(json!({"role": "user", "content": "now an attack"}));
    let r = post_json(
        proxy.addr,
        "/v1/chat/completions",
        &json!({"model": "m", "messages": messages, "max_tokens": 4}),
    );
    assert_eq!(r.status, 400, "{}", r.text());

    // Responses over one WebSocket: each turn sends only its new item; the check sees only it.
    let before = m.calls();
    let mut ws = Ws::connect(proxy.addr, &[]);
    let mut previous = serde_json::Value::Null;
    for q in ["ws one", "ws two", "ws three"] {
        ws.send_json(&json!({"type": "response.create", "model": "m", "input": q, "max_output_tokens": 4,
                             "instructions": "Be brief.", "previous_response_id": previous}));
        let events = ws.turn();
        let last = events.last().expect("events");
        // Four tokens end it `incomplete` (max_output_tokens), still a stored turn.
        assert_eq!(last["type"], "response.incomplete", "{events:?}");
        previous = last["response"]["id"].clone();
    }
    let inputs = m.inputs.lock().expect("lock").clone();
    let ws_inputs: Vec<Vec<String>> = inputs[before as usize..].to_vec();
    // A Responses turn's history is known to the proxy: only the new items are judged.
    assert_eq!(ws_inputs, [vec!["Be brief.", "ws one"], vec!["ws two"], vec!["ws three"]], "{ws_inputs:?}");
    // And a flagged item on a later turn of the socket is refused; the socket stays open.
    ws.send_json(&json!({"type": "response.create", "model": "m", "input": "an attack", "previous_response_id": previous}));
    let events = ws.turn();
    let last = events.last().expect("events");
    assert_eq!(last["type"], "error", "{events:?}");
    assert_eq!(last["error"]["code"], "content_policy_violation", "{last}");
    ws.send_json(&json!({"type": "response.create", "model": "m", "input": "ws four", "previous_response_id": previous, "max_output_tokens": 4}));
    assert_eq!(ws.turn().last().expect("events")["type"], "response.incomplete");
    let pm = proxy.metrics();
    let known = r#"warmpath_safety_turns_total{outcome="known",pool="main",stage="input"}"#;
    assert!(count(&pm, known) >= 6.0, "{pm}");
}
