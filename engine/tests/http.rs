//! The engine's HTTP API end to end: a real server on 127.0.0.1, a real model (micro), real
//! clients.

mod common;

use std::time::Duration;

use common::*;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use warmpath_tests::metric;

#[tokio::test]
async fn chat_streaming_is_framed_like_openai() {
    let e = micro().await;
    let resp = post_streaming(
        e.addr,
        "/v1/chat/completions",
        json!({"model": "micro", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
               "stream": true, "stream_options": {"include_usage": true}, "temperature": 0}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    let events = sse_data(&String::from_utf8_lossy(&body));
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("json")).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let id = &chunks[0]["id"];
    assert!(chunks.iter().all(|c| &c["id"] == id), "one id per stream");
    let finish: Vec<&Value> =
        chunks.iter().filter(|c| c["choices"][0]["finish_reason"].is_string()).collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "length");
    let usage_chunk = chunks.last().expect("usage chunk");
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 5);
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c["usage"].is_null()), "usage null until the end");
}

#[tokio::test]
async fn a_repeated_prompt_reports_cached_tokens() {
    let e = micro().await;
    let body = json!({"model": "micro", "messages": [{"role": "system", "content": long_text(120)},
                      {"role": "user", "content": "q"}], "max_tokens": 2});
    let (s, first) = post_json(e.addr, "/v1/chat/completions", body.clone()).await;
    assert_eq!(s, 200);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, second) = post_json(e.addr, "/v1/chat/completions", body).await;
    let prompt = second["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached");
    assert!(prompt > 100);
    assert_eq!(cached, (prompt - 1) / 16 * 16, "every full block but the one holding the last token");
    let (_, m) = get(e.addr, "/metrics").await;
    assert_eq!(metric(&m, "vllm:prefix_cache_hits_total{"), Some(cached as f64));
    assert_eq!(metric(&m, "vllm:prefix_cache_queries_total{"), Some(2.0 * prompt as f64));
    assert_eq!(metric(&m, "vllm:request_success_total{"), Some(2.0));
    assert_eq!(metric(&m, "vllm:num_requests_running{"), Some(0.0));
    assert!(m.contains("vllm:time_to_first_token_seconds_bucket"));
    // Two prefills and two decode steps ran: the busy time is positive and below the wall time.
    let busy = metric(&m, "warmpath_engine_busy_seconds_total{").expect("busy counter");
    assert!(busy > 0.0 && busy < 60.0, "{busy}");
}

#[tokio::test]
async fn seeded_sampling_repeats() {
    let e = micro().await;
    let body =
        json!({"model": "micro", "prompt": "once upon", "max_tokens": 12, "temperature": 1.0, "seed": 7});
    let (_, a) = post_json(e.addr, "/v1/completions", body.clone()).await;
    let (_, b) = post_json(e.addr, "/v1/completions", body).await;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    let (_, c) = post_json(
        e.addr,
        "/v1/completions",
        json!({"model": "micro", "prompt": "once upon", "max_tokens": 12, "temperature": 1.0, "seed": 8}),
    )
    .await;
    assert_ne!(a["choices"][0]["text"], c["choices"][0]["text"]);
}

#[tokio::test]
async fn completions_take_token_ids_n_and_stop() {
    let e = micro().await;
    let (s, r) = post_json(
        e.addr,
        "/v1/completions",
        json!({"model": "micro", "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4, "n": 2, "seed": 1}),
    )
    .await;
    assert_eq!(s, 200, "{r}");
    let idx: Vec<u64> = r["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| c["index"].as_u64().expect("index"))
        .collect();
    assert_eq!(idx, vec![0, 1, 2, 3]);
    assert_eq!(r["usage"]["prompt_tokens"], 5, "each prompt counted once");
    assert_eq!(r["usage"]["completion_tokens"], 16);
    // Find what greedy decoding produces, then stop on a piece of it.
    let greedy =
        json!({"model": "micro", "prompt": "abc", "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let (_, g) = post_json(e.addr, "/v1/completions", greedy.clone()).await;
    let text = g["choices"][0]["text"].as_str().expect("text").to_owned();
    assert!(text.chars().count() >= 4, "8 tokens make at least 4 characters: {text:?}");
    let stop: String = text.chars().skip(2).take(2).collect();
    let mut with_stop = greedy;
    with_stop["stop"] = json!([stop]);
    let (_, st) = post_json(e.addr, "/v1/completions", with_stop).await;
    let cut = st["choices"][0]["text"].as_str().expect("text");
    assert!(!cut.contains(&stop) && text.starts_with(cut), "{cut:?} vs {text:?} stop {stop:?}");
    assert!(cut.len() < text.len());
    assert_eq!(st["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn bad_input_gets_openai_errors_and_the_server_keeps_serving() {
    let mut args = warmpath_engine::config::EngineArgs::for_tests("micro");
    args.max_model_len = 64;
    args.max_body_bytes = 4096;
    let e = start(args).await;
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("/v1/chat/completions", "{not json".into(), 400, "invalid JSON"),
        ("/v1/chat/completions", r#"{"model":"micro","messages":"hi"}"#.into(), 400, "invalid request"),
        ("/v1/chat/completions", r#"{"model":"micro"}"#.into(), 400, "missing field"),
        ("/v1/chat/completions", r#"{"model":"micro","messages":[]}"#.into(), 400, "empty"),
        (
            "/v1/chat/completions",
            r#"{"model":"nope","messages":[{"role":"user","content":"x"}]}"#.into(),
            404,
            "does not exist",
        ),
        ("/v1/completions", r#"{"model":"micro","prompt":"x","max_tokens":0}"#.into(), 400, "max_tokens"),
        ("/v1/completions", r#"{"model":"micro","prompt":"x","max_tokens":-3}"#.into(), 400, "max_tokens"),
        (
            "/v1/completions",
            json!({"model":"micro","prompt":long_text(80),"max_tokens":1}).to_string(),
            400,
            "maximum context length",
        ),
        ("/v1/completions", r#"{"model":"micro","prompt":[99999999]}"#.into(), 400, "vocabulary"),
        ("/v1/completions", r#"{"model":"micro","prompt":"x","temperature":9}"#.into(), 400, "temperature"),
        ("/v1/completions", r#"{"model":"micro","prompt":""}"#.into(), 400, "empty"),
        ("/v1/completions", json!({"model":"micro","prompt":"x".repeat(5000)}).to_string(), 413, "exceeds"),
        ("/v1/nothing", "{}".into(), 404, "no route"),
    ];
    for (path, body, status, needle) in cases {
        let (s, text) = post(e.addr, path, body.clone()).await;
        assert_eq!(s, status, "{path} {body:.80}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        let msg = v["error"]["message"].as_str().expect("message");
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
        assert!(v["error"]["type"].is_string());
    }
    let (s, _) = post(
        e.addr,
        "/v1/completions",
        r#"{"model":"micro","prompt":"ok","max_tokens":2,"unknown_field":{"a":1}}"#,
    )
    .await;
    assert_eq!(s, 200, "unknown fields are ignored and the server still serves");
}

#[tokio::test]
async fn client_disconnect_aborts_and_frees_blocks() {
    let e = micro().await;
    let resp = post_streaming(
        e.addr,
        "/v1/completions",
        json!({"model": "micro", "prompt": long_text(60), "max_tokens": 3000, "stream": true, "ignore_eos": true}),
    )
    .await;
    let mut body = resp.into_body();
    let first = body.frame().await.expect("a frame").expect("ok");
    assert!(first.data_ref().is_some());
    let (_, m) = get(e.addr, "/metrics").await;
    assert_eq!(metric(&m, "vllm:num_requests_running{"), Some(1.0));
    drop(body); // the client goes away
    let freed = eventually(Duration::from_secs(5), || async {
        let (_, m) = get(e.addr, "/metrics").await;
        metric(&m, "vllm:num_requests_running{") == Some(0.0)
            && metric(&m, "vllm:kv_cache_usage_perc{") == Some(0.0)
    })
    .await;
    assert!(freed, "request aborted and its blocks freed");
    let (_, m) = get(e.addr, "/metrics").await;
    let generated = metric(&m, "vllm:generation_tokens_total{").expect("counter");
    assert!(generated < 3000.0, "stopped early: {generated}");
}

#[tokio::test]
async fn models_health_tokenize_and_render() {
    let e = micro().await;
    let (s, models) = get(e.addr, "/v1/models").await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&models).expect("json");
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "micro");
    assert_eq!(get(e.addr, "/health").await.0, 200);
    let (_, t) = post_json(e.addr, "/tokenize", json!({"prompt": "hello world"})).await;
    let ids = t["tokens"].clone();
    assert_eq!(t["count"], ids.as_array().expect("array").len());
    let (_, d) = post_json(e.addr, "/detokenize", json!({"tokens": ids})).await;
    assert_eq!(d["prompt"], "hello world");
    let chat = json!({"model": "micro", "messages": [{"role": "user", "content": "hi"}]});
    let (_, r) = post_json(e.addr, "/v1/chat/completions/render", chat.clone()).await;
    let (_, t) = post_json(e.addr, "/tokenize", json!({"messages": chat["messages"]})).await;
    assert_eq!(r["token_ids"], t["tokens"], "render and tokenize agree");
    let (_, c) =
        post_json(e.addr, "/v1/completions/render", json!({"model": "micro", "prompt": ["a", "b c"]})).await;
    assert_eq!(c.as_array().expect("array").len(), 2);
    // vLLM's GenerateRequest: the sampling parameters under its names, chat's logprobs as a count.
    let asked = json!({"model": "micro", "messages": chat["messages"], "max_completion_tokens": 7,
        "temperature": 0.5, "stop": ["x"], "logprobs": true, "top_logprobs": 3, "stream": true});
    let (_, g) = post_json(e.addr, "/v1/chat/completions/render", asked).await;
    assert_eq!(
        g["sampling_params"],
        json!({"max_tokens": 7, "temperature": 0.5, "stop": ["x"], "logprobs": 3}),
        "{g}"
    );
    assert_eq!(
        (g["model"].as_str(), g["stream"].as_bool(), g["priority"].as_i64()),
        (Some("micro"), Some(true), Some(0))
    );
    assert_eq!(g["request_id"].as_str().map(str::len), Some(16), "{g}");
    assert_eq!(c[1]["model"], "micro");
    // The rendered prompt is exactly what generation counts.
    let (_, g) = post_json(
        e.addr,
        "/v1/chat/completions",
        json!({"model": "micro", "messages": chat["messages"], "max_tokens": 1}),
    )
    .await;
    assert_eq!(g["usage"]["prompt_tokens"], r["token_ids"].as_array().expect("ids").len());
}

#[tokio::test]
async fn the_sim_executor_serves_the_same_api_with_real_cache_accounting() {
    let mut args = warmpath_engine::config::EngineArgs::for_tests("micro");
    args.executor = warmpath_engine::config::ExecutorKind::Sim;
    args.sim_itl_ms = 1.0;
    args.sim_prefill_us_per_token = 50.0;
    let e = start(args).await;
    let body = json!({"model": "micro", "prompt": long_text(100), "max_tokens": 6});
    let (s, first) = post_json(e.addr, "/v1/completions", body.clone()).await;
    assert_eq!(s, 200, "{first}");
    assert_eq!(first["usage"]["completion_tokens"], 6, "sim never stops early");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, second) = post_json(e.addr, "/v1/completions", body).await;
    let prompt = second["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"], (prompt - 1) / 16 * 16);
    let (_, m) = get(e.addr, "/metrics").await;
    assert_eq!(metric(&m, "vllm:generation_tokens_total{"), Some(12.0));
}

#[tokio::test]
async fn a_chat_stream_opens_only_after_its_prefill() {
    // As vLLM's: the role chunk goes out with the first token, so the first byte of an answer
    // tells a router the backend's prefill of it is done (warmpath counts queued prefill work
    // until then). The sim prefill of this prompt takes about 0.5 s: the first body byte cannot
    // come sooner (a lower bound; a slow machine only makes it later).
    let mut args = warmpath_engine::config::EngineArgs::for_tests("micro");
    args.executor = warmpath_engine::config::ExecutorKind::Sim;
    args.sim_prefill_us_per_token = 5000.0;
    let e = start(args).await;
    let body = json!({"model": "micro", "messages": [{"role": "user", "content": long_text(100)}],
                      "max_tokens": 2, "stream": true});
    let sent = std::time::Instant::now();
    let resp = post_streaming(e.addr, "/v1/chat/completions", body).await;
    let mut body = resp.into_body();
    let first = loop {
        let frame = body.frame().await.expect("a frame").expect("frame");
        if let Ok(data) = frame.into_data() {
            if !data.is_empty() {
                break data;
            }
        }
    };
    let waited = sent.elapsed();
    let chunk: Value = serde_json::from_str(&sse_data(&String::from_utf8_lossy(&first))[0]).expect("json");
    assert_eq!(chunk["choices"][0]["delta"]["role"], "assistant", "the opening still comes first");
    assert!(waited >= Duration::from_millis(400), "first byte after {waited:?}, before the prefill ended");
}

#[tokio::test]
async fn a_choice_ended_by_a_stop_string_is_aborted_while_its_siblings_run_on() {
    // With micro's dummy weights, greedy "alpha" continues " Soft Soft ..." and "zzz qq"
    // continues " chr chr ... 563563": "Soft" stops only the first choice, at once.
    let e = micro().await;
    let mut generated = 0.0;
    for stream in [false, true] {
        let body = json!({"model": "micro", "prompt": ["alpha", "zzz qq"], "max_tokens": 100, "temperature": 0,
                          "stop": ["Soft"], "ignore_eos": true, "stream": stream});
        let (s, text) = post(e.addr, "/v1/completions", body.to_string()).await;
        assert_eq!(s, 200);
        let finishes: Vec<Value> = if stream {
            sse_data(&text)
                .iter()
                .filter(|d| *d != "[DONE]")
                .map(|d| serde_json::from_str::<Value>(d).expect("json"))
                .filter(|c| c["choices"][0]["finish_reason"].is_string())
                .map(|c| c["choices"][0].clone())
                .collect()
        } else {
            serde_json::from_str::<Value>(&text).expect("json")["choices"]
                .as_array()
                .expect("choices")
                .clone()
        };
        let reason = |i: u64| finishes.iter().find(|c| c["index"] == i).map(|c| c["finish_reason"].clone());
        assert_eq!(reason(0), Some(json!("stop")), "{text}");
        assert_eq!(reason(1), Some(json!("length")), "{text}");
        let (_, m) = get(e.addr, "/metrics").await;
        let now = metric(&m, "vllm:generation_tokens_total{").expect("counter");
        // 100 for the second choice; the first is aborted once the front end has seen its first
        // token (on a loaded machine the engine may step on a few dozen times before that).
        // Had it run on to the end, this would be 200.
        assert!(now - generated < 180.0, "stream={stream}: {} tokens generated", now - generated);
        generated = now;
    }
}

/// Log-probabilities, as OpenAI's routes give them: one entry per generated token, the greedy
/// pick the likeliest of its alternatives, tokens that spell the text; also streamed, and with
/// speculative decoding (a verification step's tokens each get their own row's values).
#[tokio::test]
async fn logprobs_follow_the_generated_tokens() {
    let e = micro().await;
    let check_entries = |content: &[Value], text: &str, n: usize| {
        assert_eq!(content.len(), n, "one entry per token");
        let spelled: String = content.iter().map(|c| c["token"].as_str().expect("token")).collect();
        assert_eq!(spelled, text);
        for c in content {
            let lp = c["logprob"].as_f64().expect("logprob");
            let top = c["top_logprobs"].as_array().expect("top");
            assert_eq!(top.len(), 3);
            assert!(
                lp <= 0.0 && (top[0]["logprob"].as_f64().expect("lp") - lp).abs() < 1e-5,
                "greedy: the likeliest"
            );
            assert!(top.windows(2).all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
            assert_eq!(c["bytes"].as_array().map(Vec::len), Some(c["token"].as_str().expect("t").len()));
        }
    };
    for extra in [json!({}), json!({"num_speculative_tokens": 3})] {
        let mut body = json!({"model": "micro", "messages": [{"role": "user", "content": "a b a b a b a b"}],
                              "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 3,
                              "ignore_eos": true});
        body.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        let (s, r) = post_json(e.addr, "/v1/chat/completions", body.clone()).await;
        assert_eq!(s, 200, "{r}");
        let text = r["choices"][0]["message"]["content"].as_str().expect("text").to_owned();
        let content = r["choices"][0]["logprobs"]["content"].as_array().expect("content").clone();
        check_entries(&content, &text, 12);
        // Streamed: the same entries, spread over the chunks.
        body["stream"] = json!(true);
        let resp = post_streaming(e.addr, "/v1/chat/completions", body).await;
        let raw = resp.into_body().collect().await.expect("body").to_bytes();
        let events = sse_data(&String::from_utf8_lossy(&raw));
        let streamed: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str::<Value>(e).expect("json"))
            .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
            .flatten()
            .collect();
        assert_eq!(streamed, content, "{extra}");
    }
    let (_, m) = get(e.addr, "/metrics").await;
    assert!(
        metric(&m, "vllm:spec_decode_num_accepted_tokens_total{").is_some_and(|a| a > 0.0),
        "proposals were kept"
    );
    // Completions: tokens, token_logprobs, top_logprobs (maps), text_offset.
    let body = json!({"model": "micro", "prompt": "once upon a time", "max_tokens": 6, "temperature": 0,
                      "logprobs": 2, "ignore_eos": true});
    let (s, r) = post_json(e.addr, "/v1/completions", body).await;
    assert_eq!(s, 200, "{r}");
    let lp = &r["choices"][0]["logprobs"];
    let tokens: Vec<&str> =
        lp["tokens"].as_array().expect("tokens").iter().map(|t| t.as_str().expect("t")).collect();
    assert_eq!(tokens.concat(), r["choices"][0]["text"].as_str().expect("text"));
    assert_eq!(lp["token_logprobs"].as_array().map(Vec::len), Some(6));
    assert!(lp["top_logprobs"]
        .as_array()
        .expect("top")
        .iter()
        .all(|m| m.as_object().is_some_and(|m| !m.is_empty() && m.len() <= 2)));
    let offsets: Vec<u64> =
        lp["text_offset"].as_array().expect("offsets").iter().map(|o| o.as_u64().expect("o")).collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    // Without the fields: null, as before.
    let (_, r) =
        post_json(e.addr, "/v1/completions", json!({"model": "micro", "prompt": "x", "max_tokens": 2})).await;
    assert!(r["choices"][0]["logprobs"].is_null());
    // Bad values: 400 naming the field.
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 50}),
            "top_logprobs",
        ),
        ("/v1/completions", json!({"prompt": "x", "logprobs": -1}), "logprobs"),
    ] {
        let mut body = body;
        body["model"] = json!("micro");
        let (s, r) = post_json(e.addr, path, body).await;
        assert_eq!(s, 400, "{r}");
        assert_eq!(r["error"]["param"], param);
    }
}
