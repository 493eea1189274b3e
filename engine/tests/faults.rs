//! The engine's fault knobs, which tests of the proxy rely on: each must really misbehave.

mod common;

use common::*;
use http_body_util::BodyExt;
use serde_json::json;
use warmpath_engine::config::EngineArgs;

fn args() -> EngineArgs {
    EngineArgs::for_tests("micro")
}

#[tokio::test]
async fn error_rate_one_fails_every_request_with_a_500() {
    let mut a = args();
    a.faults.fault_error_rate = 1.0;
    let e = start(a).await;
    for _ in 0..3 {
        let (s, body) = post(
            e.addr,
            "/v1/completions",
            json!({"model": "micro", "prompt": "x", "max_tokens": 2}).to_string(),
        )
        .await;
        assert_eq!(s, 500);
        let v: serde_json::Value = serde_json::from_str(&body).expect("OpenAI error JSON");
        assert_eq!(v["error"]["type"], "server_error");
    }
}

#[tokio::test]
async fn die_after_tokens_cuts_the_stream_without_done() {
    let mut a = args();
    a.faults.fault_die_after_tokens = Some(2);
    let e = start(a).await;
    let resp = post_streaming(
        e.addr,
        "/v1/completions",
        json!({"model": "micro", "prompt": "x", "max_tokens": 50, "stream": true, "ignore_eos": true}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut text = String::new();
    let mut broke = false;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                text.push_str(&String::from_utf8_lossy(f.data_ref().map(|b| b.as_ref()).unwrap_or_default()))
            }
            Err(_) => {
                broke = true;
                break;
            }
        }
    }
    assert!(broke, "the connection was cut mid-body");
    assert!(!text.contains("[DONE]"));
    let events = text.matches("data: ").count();
    assert!((1..=2).contains(&events), "at most the 2 promised tokens, got {events}");
}

#[tokio::test]
async fn malformed_rate_one_sends_broken_json() {
    let mut a = args();
    a.faults.fault_malformed_rate = 1.0;
    let e = start(a).await;
    let (s, body) = post(
        e.addr,
        "/v1/completions",
        json!({"model": "micro", "prompt": "x", "max_tokens": 2}).to_string(),
    )
    .await;
    assert_eq!(s, 200);
    assert!(serde_json::from_str::<serde_json::Value>(&body).is_err(), "{body}");
}

#[tokio::test]
async fn delay_holds_the_response_back() {
    let mut a = args();
    a.faults.fault_delay_ms = 300;
    let e = start(a).await;
    let t = std::time::Instant::now();
    let (s, _) = post(
        e.addr,
        "/v1/completions",
        json!({"model": "micro", "prompt": "x", "max_tokens": 1}).to_string(),
    )
    .await;
    assert_eq!(s, 200);
    // A lower bound only: a delay can never make a response faster.
    assert!(t.elapsed() >= std::time::Duration::from_millis(300));
}

/// The `--script` hook forces a reply; with tools offered, a scripted Hermes block comes back
/// as a real tool call, whole or streamed.
#[tokio::test]
async fn a_scripted_tool_call_comes_back_as_tool_calls() {
    let dir = std::env::temp_dir().join(format!("wp-script-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let script = dir.join("script.json");
    let call = "Looking.\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"/etc/hosts\"}}\n</tool_call>";
    std::fs::write(
        &script,
        json!([{"when": "", "reply": "plain answer"}, {"when": "read the hosts file", "reply": call}])
            .to_string(),
    )
    .expect("write");
    let mut a = args();
    a.faults.script = Some(script);
    let e = start(a).await;
    let tools =
        json!([{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]);
    let body = |q: &str, stream: bool| {
        json!({"model": "micro", "messages": [{"role": "user", "content": q}], "tools": tools,
               "max_tokens": 200, "stream": stream})
    };

    let (s, v) = post_json(e.addr, "/v1/chat/completions", body("please read the hosts file", false)).await;
    assert_eq!(s, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["message"]["content"], "Looking.");
    assert_eq!(choice["message"]["tool_calls"][0]["function"]["name"], "read_file");
    assert_eq!(choice["message"]["tool_calls"][0]["function"]["arguments"], r#"{"path":"/etc/hosts"}"#);

    let (_, v) = post_json(e.addr, "/v1/chat/completions", body("hello", false)).await;
    assert_eq!(v["choices"][0]["message"]["content"], "plain answer", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let resp = post_streaming(e.addr, "/v1/chat/completions", body("please read the hosts file", true)).await;
    let raw = resp.into_body().collect().await.expect("body").to_bytes();
    let events = sse_data(&String::from_utf8_lossy(&raw));
    let chunks: Vec<serde_json::Value> =
        events.iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).expect("json")).collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect::<Vec<_>>()
        .concat();
    assert_eq!(text, "Looking.\n", "the call's text is not content");
    let calls: Vec<&serde_json::Value> =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
    assert_eq!(calls.len(), 1, "{events:?}");
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"]["name"], "read_file");
    let finish: Vec<&str> = chunks.iter().filter_map(|c| c["choices"][0]["finish_reason"].as_str()).collect();
    assert_eq!(finish, ["tool_calls"]);
    let _ = std::fs::remove_dir_all(&dir);
}
