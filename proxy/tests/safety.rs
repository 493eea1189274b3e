//! The safety stage's input rules in front of a scripted backend: a blocked request never
//! reaches a backend and gets the OpenAI error shape (or, by policy, a refusal message), a
//! logged finding goes out unchanged and is counted, a redacted one goes out masked with the
//! bytes before it untouched, audit mode counts without blocking, and bad rules are refused
//! with the file's line.

use serde_json::json;
use warmpath::config::parse;
use warmpath_tests::*;

const RULES: &str = r#"
[pools.safety.rules]
detect = ["email", "api_key", "payment_card"]
allow = ['@example\.com$']
default_action = "log"
[pools.safety.rules.deny]
falcon = '(?i)\bproject falcon\b'
[pools.safety.rules.actions]
api_key = "block"
falcon = "block"
"#;

fn answer(_: &[u8]) -> serde_json::Value {
    json!({"id": "x", "object": "chat.completion", "model": "m",
           "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
}

#[test]
fn input_rules_block_before_the_backend_and_count_what_they_log() {
    let up = Scripted::start_with(answer);
    let proxy = Proxy::start(&policy("", RULES, &["m"], &[("s", up.url())]));
    // A secret in a user message: refused, nothing sent.
    let r = post_json(
        proxy.addr,
        "/v1/chat/completions",
        &chat("m", "use key sk-proj-abcdefghijklmnopqrstuvwx1234", 4),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let e = r.json();
    assert_eq!(e["error"]["code"], "content_policy_violation");
    assert!(e["error"]["message"].as_str().expect("message").contains("api_key"), "{e}");
    assert_eq!(r.header("x-warmpath-safety"), Some("rules; input=block"));
    assert!(e["error"]["message"].as_str().expect("message").contains("rules: api_key"), "{e}");
    // Beside an image: text parts are checked whatever else the message holds.
    let parts = json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "key AKIAIOSFODNN7EXAMPLE"}]}]});
    let r = post_json(proxy.addr, "/v1/chat/completions", &parts);
    assert_eq!(r.status, 400, "{}", r.text());
    // A deny pattern in a completion prompt, and in a Responses input item.
    let r = post_json(
        proxy.addr,
        "/v1/completions",
        &json!({"model": "m", "prompt": ["fine", "about PROJECT FALCON"]}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let r = post_json(
        proxy.addr,
        "/v1/responses",
        &json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "project falcon?"}]}]}),
    );
    assert!(r.status >= 400, "{} {}", r.status, r.text());
    assert!(r.text().contains("content_policy_violation"), "{}", r.text());
    assert!(up.bodies.lock().expect("lock").is_empty(), "no blocked request reached the backend");
    // Logged findings (an address; an allowed one is none): the request goes out as it was.
    let body = chat("m", "mail ops@corp.io or dev@example.com, card 4111 1111 1111 1111", 4);
    let r = post_json(proxy.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    // The answer is whole and was checked before it went out.
    assert_eq!(r.header("x-warmpath-safety"), Some("rules; input=pass; output=pass"));
    let sent: serde_json::Value = serde_json::from_slice(&up.bodies.lock().expect("lock")[0]).expect("json");
    assert_eq!(sent["messages"], body["messages"]);
    let m = proxy.metrics();
    let count =
        |labels: &str| metric(&m, &format!("warmpath_safety_findings_total{{{labels}")).unwrap_or(0.0);
    assert_eq!(count(r#"action="log",category="email",check="rules",pool="main"}"#), 1.0, "{m}");
    assert_eq!(count(r#"action="log",category="payment_card",check="rules",pool="main"}"#), 1.0);
    assert_eq!(count(r#"action="block",category="api_key",check="rules",pool="main"}"#), 2.0);
    assert_eq!(count(r#"action="block",category="falcon",check="rules",pool="main"}"#), 2.0);
    let checks = |verdict: &str| {
        metric(
            &m,
            &format!(
                r#"warmpath_safety_checks_total{{check="rules",pool="main",stage="input",verdict="{verdict}"}}"#
            ),
        )
    };
    assert_eq!((checks("block"), checks("pass")), (Some(4.0), Some(1.0)));
    assert_eq!(metric(&m, "warmpath_rejections_total{reason=\"content_policy\"}"), Some(4.0));
}

#[test]
fn audit_mode_counts_what_it_would_block_and_lets_it_through() {
    let up = Scripted::start_with(answer);
    let proxy = Proxy::start(&policy(
        "",
        &RULES.replace("default_action = \"log\"\n", "default_action = \"log\"\naudit = true\n"),
        &["m"],
        &[("s", up.url())],
    ));
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "key AKIAIOSFODNN7EXAMPLE", 4));
    assert_eq!(r.status, 200, "{}", r.text());
    // Audit never blocks: the header says what the client got.
    assert_eq!(r.header("x-warmpath-safety"), Some("rules; input=pass; output=pass"));
    assert_eq!(up.bodies.lock().expect("lock").len(), 1);
    let m = proxy.metrics();
    assert_eq!(
        metric(
            &m,
            r#"warmpath_safety_findings_total{action="audit",category="api_key",check="rules",pool="main"}"#
        ),
        Some(1.0)
    );
    let audit_block =
        r#"warmpath_safety_checks_total{check="rules",pool="main",stage="input",verdict="audit_block"}"#;
    assert_eq!(metric(&m, audit_block), Some(1.0), "{m}");
}

#[test]
fn bad_rules_are_refused_at_load_with_their_place() {
    let bad = |rules: &str| {
        let text = policy("", rules, &["m"], &[("s", "http://127.0.0.1:9".into())]);
        match parse("p.toml", &text) {
            Ok(_) => panic!("accepted: {rules}"),
            Err(e) => e.to_string(),
        }
    };
    let e = bad("[pools.safety.rules]\ndetect = [\"dna\"]\n");
    assert!(e.contains("p.toml:") && e.contains("unknown detector \"dna\""), "{e}");
    let e = bad("[pools.safety.rules.deny]\nx = '('\n");
    assert!(e.contains("p.toml:") && e.contains("bad pattern"), "{e}");
    let e = bad("[pools.safety.output]\nwindow_tokens = 8\noverlap_tokens = 8\n");
    assert!(e.contains("overlap_tokens") && e.contains("must be below window_tokens"), "{e}");
    let e = bad("[pools.safety.rules]\nstages = []\n");
    assert!(e.contains("must name input, output or both"), "{e}");
    let e = bad("[pools.safety.moderation]\nurl = \"http://127.0.0.1:9\"\n[pools.safety.moderation.thresholds]\nviolence = 2.0\n");
    assert!(e.contains("not a score between 0 and 1"), "{e}");
    let e = bad("[pools.safety.guard_model]\npool = \"nowhere\"\nmodel = \"g\"\n");
    assert!(e.contains("no pool is named \"nowhere\""), "{e}");
    let e = bad("[pools.safety.guard_model]\npool = \"main\"\nmodel = \"g\"\n");
    assert!(e.contains("cannot be its own guard"), "{e}");
    let e = bad("[pools.safety.input]\nmode = \"sometimes\"\n");
    assert!(e.contains("p.toml:") && e.contains("sometimes"), "{e}");
    let e = bad("[pools.safety.rules.actions]\nnobody = \"block\"\n");
    assert!(e.contains("names neither a detector nor a deny pattern"), "{e}");
}

#[test]
fn input_redaction_masks_the_span_and_keeps_the_bytes_before_it() {
    let up = Scripted::start_with(answer);
    let rules = "[pools.safety.rules]\ndetect = [\"email\", \"us_ssn\"]\n[pools.safety.rules.actions]\nemail = \"redact\"\nus_ssn = \"redact\"\n";
    let proxy = Proxy::start(&policy("", rules, &["m"], &[("s", up.url())]));
    // A system prompt with an escape, then the user's turn with two findings.
    let body = r#"{"model":"m","messages":[{"role":"system","content":"You are terse. \u00e9"},{"role":"user","content":"I am ann@corp.io, SSN 123-45-6789."}],"max_tokens":4}"#;
    let r = request(
        proxy.addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let sent = String::from_utf8(up.bodies.lock().expect("lock")[0].clone()).expect("utf8");
    let first = r#"{"model":"m","messages":[{"role":"system","content":"You are terse. \u00e9"},"#;
    assert!(sent.starts_with(first), "the bytes before the redacted message go out as sent: {sent}");
    let v: serde_json::Value = serde_json::from_str(&sent).expect("json");
    assert_eq!(v["messages"][1]["content"], "I am [EMAIL], SSN [US_SSN].");
    assert_eq!(v["max_tokens"], 4);
    let m = proxy.metrics();
    let redacted =
        r#"warmpath_safety_findings_total{action="redact",category="email",check="rules",pool="main"}"#;
    assert_eq!(metric(&m, redacted), Some(1.0), "{m}");
}

#[test]
fn a_refusal_message_answers_in_the_routes_shape() {
    let up = Scripted::start_with(answer);
    let extra =
        format!("{RULES}\n[pools.safety.input]\nrefusal = \"message\"\nrefusal_message = \"Not here.\"\n");
    let proxy = Proxy::start(&policy("", &extra, &["m"], &[("s", up.url())]));
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "about project falcon", 4));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], "Not here.");
    assert_eq!(v["choices"][0]["finish_reason"], "content_filter");
    assert_eq!(r.header("x-warmpath-safety"), Some("rules; input=block"));
    // Streamed: chunks and [DONE].
    let mut body = chat("m", "about project falcon", 4);
    body["stream"] = json!(true);
    let r = post_json(proxy.addr, "/v1/chat/completions", &body);
    let (events, _) = sse(&r.text());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{}", r.text());
    let first: serde_json::Value = serde_json::from_str(&events[0]).expect("json");
    assert_eq!(first["choices"][0]["delta"]["content"], "Not here.");
    assert!(r.text().contains("\"finish_reason\":\"content_filter\""));
    // Completions: `text`.
    let r = post_json(proxy.addr, "/v1/completions", &json!({"model": "m", "prompt": "project falcon"}));
    assert_eq!(r.json()["choices"][0]["text"], "Not here.", "{}", r.text());
    assert!(up.bodies.lock().expect("lock").is_empty());
}
