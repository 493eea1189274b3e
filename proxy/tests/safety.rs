//! The safety stage's input rules in front of a scripted backend: a blocked request never
//! reaches a backend and gets the OpenAI error shape, a logged finding goes out unchanged and is
//! counted, audit mode counts without blocking, and bad rules are refused with the file's line.

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
    assert_eq!(r.header("x-warmpath-safety"), Some("rules; input=pass"));
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
    assert_eq!(r.header("x-warmpath-safety"), Some("rules; input=audit_block"));
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
    let e = bad("[pools.safety.rules.actions]\nemail = \"redact\"\n");
    assert!(e.contains("redact is not supported yet"), "{e}");
    let e = bad("[pools.safety.rules.actions]\nnobody = \"block\"\n");
    assert!(e.contains("names neither a detector nor a deny pattern"), "{e}");
}
