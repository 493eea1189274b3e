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
