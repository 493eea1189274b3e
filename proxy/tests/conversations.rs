//! `/v1/conversations`: created, read, updated, deleted, items added, listed, read and removed,
//! scoped per API key; responses that name a conversation read it as their history and append
//! their items, over HTTP and WebSocket, from memory or Redis.

use serde_json::{json, Value};
use warmpath_tests::*;

fn texts(list: &Value) -> Vec<String> {
    list["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|i| match i["type"].as_str() {
            Some("message") => format!(
                "{}:{}",
                i["role"].as_str().unwrap_or(""),
                i["content"][0]["text"].as_str().unwrap_or("")
            ),
            other => other.unwrap_or("").to_owned(),
        })
        .collect()
}

#[test]
fn a_conversation_is_managed_by_its_key_only() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let conv = keyed(proxy.addr,
        "k1",
        "POST",
        "/v1/conversations",
        Some(
            &json!({"metadata": {"topic": "demo"}, "items": [{"type": "message", "role": "user", "content": "Hello!"}]}),
        ),
    ).ok();
    let id = conv["id"].as_str().expect("id").to_owned();
    assert!(id.starts_with("conv_"), "{conv}");
    assert_eq!(
        (conv["object"].as_str(), &conv["metadata"]),
        (Some("conversation"), &json!({"topic": "demo"}))
    );
    let path = format!("/v1/conversations/{id}");
    assert_eq!(keyed(proxy.addr, "k1", "GET", &path, None).ok(), conv);
    // Another key: every route is a 404, as for an unknown id.
    for (method, p) in [("GET", path.clone()), ("DELETE", path.clone()), ("GET", format!("{path}/items"))] {
        let r = keyed(proxy.addr, "k2", method, &p, None);
        assert_eq!(r.status, 404, "{method} {p}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "conversation_not_found");
    }
    assert_eq!(
        keyed(
            proxy.addr,
            "k2",
            "POST",
            &format!("{path}/items"),
            Some(&json!({"items": [{"role": "user", "content": "x"}]}))
        )
        .status,
        404
    );

    // Items added, listed (newest first by default, paged), read and removed.
    let added = keyed(proxy.addr,
        "k1",
        "POST",
        &format!("{path}/items"),
        Some(
            &json!({"items": [{"role": "assistant", "content": "Hi, how can I help?"}, {"role": "user", "content": "Tell me a joke."}]}),
        ),
    ).ok();
    assert_eq!(texts(&added), ["assistant:Hi, how can I help?", "user:Tell me a joke."]);
    let all = keyed(proxy.addr, "k1", "GET", &format!("{path}/items"), None).ok();
    assert_eq!(texts(&all), ["user:Tell me a joke.", "assistant:Hi, how can I help?", "user:Hello!"]);
    let page = keyed(proxy.addr, "k1", "GET", &format!("{path}/items?limit=1&order=asc"), None).ok();
    assert_eq!((texts(&page), page["has_more"].as_bool()), (vec!["user:Hello!".to_owned()], Some(true)));
    let item_id = added["data"][0]["id"].as_str().expect("item id").to_owned();
    let item = keyed(proxy.addr, "k1", "GET", &format!("{path}/items/{item_id}"), None).ok();
    assert_eq!(item, added["data"][0]);
    assert_eq!(
        keyed(proxy.addr, "k1", "DELETE", &format!("{path}/items/{item_id}"), None).ok()["id"],
        json!(id)
    );
    assert_eq!(keyed(proxy.addr, "k1", "GET", &format!("{path}/items/{item_id}"), None).status, 404);
    assert_eq!(
        texts(&keyed(proxy.addr, "k1", "GET", &format!("{path}/items"), None).ok()),
        ["user:Tell me a joke.", "user:Hello!"]
    );

    // Metadata replaced; bad input is a 400 naming the field.
    let updated = keyed(proxy.addr, "k1", "POST", &path, Some(&json!({"metadata": {"topic": "jokes"}}))).ok();
    assert_eq!(updated["metadata"], json!({"topic": "jokes"}));
    for (body, param) in [
        (json!({"metadata": {"n": 1}}), "metadata"),
        (json!({"items": [{"role": "robot", "content": "x"}]}), "items[0]"),
        (json!({"items": "hello"}), "items"),
    ] {
        let r = keyed(proxy.addr, "k1", "POST", "/v1/conversations", Some(&body));
        assert_eq!((r.status, r.json()["error"]["param"].as_str()), (400, Some(param)), "{body}");
    }
    let r = request(proxy.addr, "POST", "/v1/conversations", &[("authorization", "Bearer k1")], b"{not json");
    assert_eq!(r.status, 400, "{}", r.text());

    // Deleted: gone for every route.
    assert_eq!(
        keyed(proxy.addr, "k1", "DELETE", &path, None).ok(),
        json!({"id": id, "object": "conversation.deleted", "deleted": true})
    );
    assert_eq!(keyed(proxy.addr, "k1", "GET", &path, None).status, 404);
    assert_eq!(keyed(proxy.addr, "k1", "GET", "/v1/conversations", None).status, 405);
}

/// Responses in a conversation read its items and append theirs; the conversation is the
/// routing key and, where turns go as token ids, its ids follow it (the engine's prefix cache
/// hits on the next turn). `previous_response_id` with `conversation` is a 400.
fn responses_append_to_their_conversation(redis: Option<&RedisServer>) {
    let store = redis
        .map_or(String::new(), |r| format!("[session]\nstore = \"redis\"\nredis_url = \"{}\"\n", r.url()));
    let store = store.as_str();
    let dir = TempDir::new();
    let e = Engine::sim("m", &["--script", &weather_script(dir.path())]);
    let a = Proxy::start(&policy(store, "[pools.canon]\ntokenizer = \"wp32k\"", &["m"], &[("e0", e.url())]));
    let b = Proxy::start(&policy(store, "[pools.canon]\ntokenizer = \"wp32k\"", &["m"], &[("e0", e.url())]));
    let conv = keyed(
        a.addr,
        "k1",
        "POST",
        "/v1/conversations",
        Some(&json!({"items": [{"role": "user", "content": "I live in Oslo."}]})),
    )
    .ok();
    let id = conv["id"].as_str().expect("id").to_owned();
    let turn = |proxy: &Proxy, key: &str, text: &str| {
        keyed(
            proxy.addr,
            key,
            "POST",
            "/v1/responses",
            Some(
                &json!({"model": "m", "conversation": id, "input": text, "instructions": "Be brief.", "max_output_tokens": 8}),
            ),
        )
    };
    let r1 = turn(&a, "k1", "What is the weather like?").ok();
    assert_eq!(r1["conversation"], json!({"id": id}), "{r1}");
    let r2 = turn(&a, "k1", "And tomorrow?").ok();
    assert!(r2["usage"]["input_tokens"].as_u64() > r1["usage"]["input_tokens"].as_u64(), "the history grew");
    assert!(r2["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) > 0, "{r2}");
    // Over a WebSocket too, on another replica where the store is shared.
    let mut ws =
        Ws::connect(if store.is_empty() { a.addr } else { b.addr }, &[("authorization", "Bearer k1")]);
    ws.send_json(&json!({"type": "response.create", "model": "m", "conversation": {"id": id}, "input": "Thanks!", "max_output_tokens": 4}));
    let done = ws.turn().last().expect("events")["response"].clone();
    assert_eq!(done["status"], "incomplete", "{done}");
    let items =
        keyed(a.addr, "k1", "GET", &format!("/v1/conversations/{id}/items?order=asc&limit=100"), None).ok();
    let t = texts(&items);
    assert_eq!(t.len(), 7, "{t:?}");
    assert_eq!(
        (t[0].as_str(), t[1].as_str(), t[3].as_str(), t[5].as_str()),
        ("user:I live in Oslo.", "user:What is the weather like?", "user:And tomorrow?", "user:Thanks!"),
        "{t:?}"
    );
    assert!(
        t[2].starts_with("assistant:") && t[4].starts_with("assistant:") && t[6].starts_with("assistant:"),
        "{t:?}"
    );
    // In Redis, the token ids kept cover every item (each turn read the conversation as it was).
    if let Some(r) = redis {
        let key = format!("warmpath:conversation:{{{id}}}");
        assert_eq!(r.cli(&["HGET", &key, "tokens_len"]).trim(), "7");
        assert_eq!(r.cli(&["LLEN", &format!("{key}:items")]).trim(), "7");
    }
    // The second response's input items are the conversation before its output.
    let input = keyed(
        a.addr,
        "k1",
        "GET",
        &format!("/v1/responses/{}/input_items?order=asc", r2["id"].as_str().unwrap_or("")),
        None,
    )
    .ok();
    assert_eq!(texts(&input), t[..4].to_vec());
    // Another key cannot write into it; both ways of continuing at once are refused.
    let r = turn(&a, "k2", "hi");
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (404, Some("conversation_not_found")),
        "{}",
        r.text()
    );
    let r = keyed(
        a.addr,
        "k1",
        "POST",
        "/v1/responses",
        Some(&json!({"model": "m", "conversation": id, "previous_response_id": r1["id"], "input": "x"})),
    );
    assert_eq!((r.status, r.json()["error"]["param"].as_str()), (400, Some("conversation")), "{}", r.text());
}

#[test]
fn responses_append_to_their_conversation_in_memory() {
    responses_append_to_their_conversation(None);
}

#[test]
fn responses_append_to_their_conversation_through_redis() {
    responses_append_to_their_conversation(Some(&RedisServer::start()));
}

/// Redis gone: the conversations and stored-response routes answer 503
/// `session_store_unavailable` in the OpenAI shape, promptly, and warmpath serves on.
#[test]
fn a_lost_redis_is_a_503_on_every_stored_route() {
    let e = Engine::sim("m", &[]);
    let mut redis = RedisServer::start();
    let store =
        format!("[session]\nstore = \"redis\"\nredis_url = \"{}\"\nredis_timeout_ms = 300\n", redis.url());
    let proxy = Proxy::start(&policy(&store, "", &["m"], &[("e0", e.url())]));
    let conv = keyed(proxy.addr, "k1", "POST", "/v1/conversations", Some(&json!({}))).ok();
    let id = conv["id"].as_str().expect("id").to_owned();
    redis.kill();
    for (method, path, body) in [
        ("GET", format!("/v1/conversations/{id}"), None),
        (
            "POST",
            format!("/v1/conversations/{id}/items"),
            Some(json!({"items": [{"role": "user", "content": "x"}]})),
        ),
        ("POST", "/v1/conversations".to_owned(), Some(json!({}))),
        ("GET", "/v1/responses/resp_x".to_owned(), None),
        ("GET", "/v1/responses/resp_x/input_items".to_owned(), None),
        ("DELETE", "/v1/responses/resp_x".to_owned(), None),
        ("POST", "/v1/responses".to_owned(), Some(json!({"model": "m", "conversation": id, "input": "x"}))),
    ] {
        let r = keyed(proxy.addr, "k1", method, &path, body.as_ref());
        assert_eq!(
            (r.status, r.json()["error"]["code"].as_str()),
            (503, Some("session_store_unavailable")),
            "{method} {path}: {}",
            r.text()
        );
    }
    // What needs no store is served.
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 2)).status, 200);
}
