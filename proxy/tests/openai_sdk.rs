//! The official `openai` Python SDK (installed by `scripts/ensure-deps` into `.venv`) talks to
//! warmpath in front of real engines: a real client, not a hand-written one.

use std::path::PathBuf;
use std::process::Command;

use warmpath_tests::*;

fn python() -> PathBuf {
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        venv.exists(),
        "{} missing: run scripts/ensure-deps (it installs the openai SDK)",
        venv.display()
    );
    venv
}

fn run_client(base: &str, model: &str, extra: &[&str]) -> serde_json::Value {
    run_script("openai_chat.py", base, model, extra)
}

fn run_script(name: &str, base: &str, model: &str, extra: &[&str]) -> serde_json::Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients").join(name);
    let out =
        Command::new(python()).arg(script).args([base, model]).args(extra).output().expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "client failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.trim()).unwrap_or_else(|_| panic!("client output: {stdout}"))
}

#[test]
fn the_openai_sdk_streams_a_chat_through_warmpath() {
    let a = Engine::sim("m", &[]);
    let b = Engine::sim("m", &[]);
    let proxy =
        Proxy::start(&policy("", "policy = \"least_load\"", &["m"], &[("a", a.url()), ("b", b.url())]));
    let v = run_client(&format!("http://{}/v1", proxy.addr), "m", &[]);
    assert_eq!(v["models"], serde_json::json!(["m"]), "{v}");
    assert!(v["stream_chunks"].as_u64().unwrap_or(0) >= 9, "role chunk, 8 tokens, usage: {v}");
    assert!(!v["stream_text"].as_str().unwrap_or("").is_empty(), "{v}");
    assert_eq!(v["stream_usage"]["completion_tokens"], 8, "{v}");
    assert_eq!(v["finish"], "length");
    assert_eq!(v["completion_tokens"], 4);
    assert!(matches!(v["backend"].as_str(), Some("a" | "b")), "{v}");
    assert_eq!(v["not_found"], "model_not_found", "{v}");
}

#[test]
fn the_openai_sdk_raises_on_a_stream_cut_by_the_backend() {
    let dying = Engine::sim("m", &["--fault-die-after-tokens", "2"]);
    let proxy = Proxy::start(&policy("[health]\nenabled = false\n", "", &["m"], &[("d", dying.url())]));
    let v = run_client(&format!("http://{}/v1", proxy.addr), "m", &["expect-stream-error"]);
    assert_eq!(v["raised"], "APIError", "the SDK surfaces warmpath's error event: {v}");
    assert!(v["message"].as_str().unwrap_or("").contains("stream broke off"), "{v}");
}

/// `client.responses.connect()` and `client.responses.create(previous_response_id=...)`,
/// unchanged, run a tool-calling conversation through warmpath's Responses API over an engine
/// that speaks only chat.
#[test]
fn the_openai_sdk_runs_a_tool_calling_conversation_over_websocket_and_http() {
    let dir = TempDir::new();
    let e = Engine::sim("m", &["--script", &weather_script(dir.path())]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let v = run_script("openai_responses.py", &format!("http://{}/v1", proxy.addr), "m", &[]);
    let kinds: Vec<&str> =
        v["ws_first_kinds"].as_array().expect("kinds").iter().filter_map(|k| k.as_str()).collect();
    assert_eq!(kinds[..2], ["response.created", "response.in_progress"], "{v}");
    assert_eq!(
        v["ws_call"],
        serde_json::json!({"name": "get_weather", "arguments": {"city": "Oslo"}}),
        "{v}"
    );
    assert_eq!(
        (v["ws_text"].as_str(), v["ws_final"].as_str()),
        (Some("It will be sunny."), Some("It will be sunny.")),
        "{v}"
    );
    assert!(v["ws_cached"].as_u64().unwrap_or(0) > 0, "{v}");
    assert_eq!(v["ws_error_code"], "previous_response_not_found", "{v}");
    assert_eq!(v["ws_lanes"], serde_json::json!(["left", "right"]), "{v}");
    assert_eq!(
        (v["http_call"].as_str(), v["http_final"].as_str()),
        (Some("get_weather"), Some("It will be sunny.")),
        "{v}"
    );
    assert!(v["http_cached"].as_u64().unwrap_or(0) > 0, "{v}");
    assert_eq!(v["http_stream_status"], "completed", "{v}");
    assert_eq!(v["http_not_found"], "previous_response_not_found", "{v}");
}

/// The SDK's own calls on stored responses: `retrieve`, `input_items.list` (auto-paged),
/// `input_tokens.count` (equal to the usage the next call reports), `cancel` of a background
/// response, `retrieve(stream=True, starting_after=…)`, `compact`, `delete`; another key sees
/// nothing.
#[test]
fn the_openai_sdk_retrieves_lists_counts_and_deletes_stored_responses() {
    let e = Engine::sim("m", &["--sim-itl-ms", "20"]);
    let proxy = Proxy::start(&policy("", "[pools.canon]\ntokenizer = \"wp32k\"", &["m"], &[("e0", e.url())]));
    let v = run_script("openai_responses_api.py", &format!("http://{}/v1", proxy.addr), "m", &[]);
    assert!(v["reported"].as_u64().unwrap_or(0) > 0, "{v}");
    assert_eq!(v["counted"], v["reported"], "{v}");
    assert_eq!(
        (v["retrieved_same"].as_bool(), v["retrieved_text"].as_bool()),
        (Some(true), Some(true)),
        "{v}"
    );
    // Newest first: the second question, the first answer, the first question.
    assert_eq!(
        v["items"],
        serde_json::json!([["message", "user"], ["message", "assistant"], ["message", "user"]]),
        "{v}"
    );
    assert_eq!(v["items_asc_first"], "Say hello.", "{v}");
    assert_eq!(
        (v["bg_status"].as_str(), v["cancelled"].as_str(), v["after_cancel"].as_str()),
        (Some("queued"), Some("cancelled"), Some("cancelled")),
        "{v}"
    );
    assert_eq!(v["resumed"], serde_json::json!([3, "response.incomplete"]), "{v}");
    assert_eq!(v["compacted"], serde_json::json!(["message", "message", "compaction"]), "{v}");
    assert_eq!(v["after_compact"], "incomplete", "{v}");
    assert_eq!(
        (v["other_key"].as_str(), v["after_delete"].as_str()),
        (Some("not found"), Some("not found")),
        "{v}"
    );
}

/// The SDK's conversations calls, and responses continuing by `conversation`.
#[test]
fn the_openai_sdk_manages_conversations_and_continues_by_them() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let v = run_script("openai_conversations.py", &format!("http://{}/v1", proxy.addr), "m", &[]);
    assert_eq!(v["created"], serde_json::json!(["conversation", {"topic": "demo"}]), "{v}");
    assert_eq!(
        (v["response_conversation"].as_bool(), v["history_grew"].as_bool()),
        (Some(true), Some(true)),
        "{v}"
    );
    assert_eq!(v["added"], serde_json::json!(["Bye."]), "{v}");
    // The first item, two turns of question and answer, the added one.
    let roles = serde_json::json!([
        ["message", "user"],
        ["message", "user"],
        ["message", "assistant"],
        ["message", "user"],
        ["message", "assistant"],
        ["message", "user"]
    ]);
    assert_eq!(v["items"], roles, "{v}");
    assert_eq!(
        (v["first_text"].as_str(), v["after_item_delete"].as_u64()),
        (Some("My name is Ada."), Some(5)),
        "{v}"
    );
    assert_eq!(v["updated"], true, "{v}");
    assert_eq!(v["deleted"], serde_json::json!(["conversation.deleted", true]), "{v}");
    assert_eq!(
        (v["other_key"].as_str(), v["after_delete"].as_str()),
        (Some("not found"), Some("not found")),
        "{v}"
    );
}
