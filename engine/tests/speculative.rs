//! Speculative decoding through the whole server: under greedy sampling the output is the
//! output without it, token for token; proposals are counted under vLLM's metric names; a
//! request can turn it off or on for itself; bad settings are refused. With SmolLM2 installed,
//! the real model copying its prompt keeps most of what is proposed.

mod common;

use common::*;
use serde_json::json;
use warmpath_engine::config::EngineArgs;
use warmpath_engine::spec::SpecConfig;

fn with_spec(model: &str, k: usize) -> EngineArgs {
    let mut a = EngineArgs::for_tests(model);
    a.speculative_config = Some(SpecConfig::with_tokens(k));
    a
}

async fn completion(e: &TestEngine, body: serde_json::Value) -> String {
    let (status, b) = post_json(e.addr, "/v1/completions", body).await;
    assert_eq!(status, 200, "{b}");
    b["choices"][0]["text"].as_str().unwrap_or_default().to_owned()
}

/// A counter's value in the engine's /metrics (0 when absent).
async fn counter(e: &TestEngine, name: &str) -> f64 {
    let (_, text) = get(e.addr, "/metrics").await;
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn greedy_output_is_the_same_with_and_without_proposals() {
    let e = start(with_spec("micro", 4)).await;
    // Prompts with repeats, so that lookup finds something to propose.
    let prompts: Vec<Vec<u32>> = vec![
        [5, 6, 7, 8, 9, 10].repeat(6),
        (0..40).map(|i| 20 + (i * 7 % 11)).collect(),
        [300, 301, 302].repeat(10),
    ];
    for p in &prompts {
        let body = |k: usize| {
            json!({"model": "micro", "prompt": p, "max_tokens": 48, "temperature": 0, "ignore_eos": true,
                   "num_speculative_tokens": k})
        };
        let plain = completion(&e, body(0)).await;
        let fast = completion(&e, body(4)).await;
        assert_eq!(plain, fast, "prompt {p:?}");
    }
    let drafts = counter(&e, "vllm:spec_decode_num_drafts_total").await;
    let proposed = counter(&e, "vllm:spec_decode_num_draft_tokens_total").await;
    let accepted = counter(&e, "vllm:spec_decode_num_accepted_tokens_total").await;
    let per_pos = counter(&e, "vllm:spec_decode_num_accepted_tokens_per_pos_total").await;
    assert!(drafts > 0.0 && proposed >= drafts, "drafts {drafts}, proposed {proposed}");
    assert!(accepted <= proposed);
    assert_eq!(per_pos, accepted, "per-position counts add up to the accepted tokens");
}

#[tokio::test]
async fn a_request_turns_speculation_on_for_itself_and_bad_values_are_refused() {
    let e = micro().await;
    let p = [5, 6, 7, 8, 9, 10].repeat(6);
    let body = |k: serde_json::Value| {
        json!({"model": "micro", "prompt": p, "max_tokens": 32, "temperature": 0, "ignore_eos": true,
               "num_speculative_tokens": k})
    };
    let plain = completion(&e, body(json!(null))).await;
    assert_eq!(counter(&e, "vllm:spec_decode_num_drafts_total").await, 0.0, "off by default");
    let fast = completion(&e, body(json!(3))).await;
    assert_eq!(plain, fast);
    assert!(counter(&e, "vllm:spec_decode_num_drafts_total").await > 0.0);
    for bad in [json!(-1), json!(99), json!("4"), json!(1.5)] {
        let (status, b) = post_json(e.addr, "/v1/completions", body(bad.clone())).await;
        assert_eq!(status, 400, "{bad}: {b}");
        assert_eq!(b["error"]["param"], "num_speculative_tokens", "{b}");
    }
    // Sampled requests verify by rejection sampling: they run and stay reproducible by seed.
    let sampled = json!({"model": "micro", "prompt": p, "max_tokens": 32, "temperature": 0.8, "seed": 7,
                         "ignore_eos": true, "num_speculative_tokens": 4});
    let a = completion(&e, sampled.clone()).await;
    let b = completion(&e, sampled).await;
    assert_eq!(a, b);
}

#[test]
fn the_server_refuses_a_speculative_config_it_cannot_run() {
    use clap::Parser;
    for bad in
        [r#"{"method": "eagle", "num_speculative_tokens": 2}"#, r#"{"num_speculative_tokens": 0}"#, "{"]
    {
        let r = EngineArgs::try_parse_from(["warmpath-engine", "--speculative-config", bad]);
        assert!(r.is_err(), "{bad}");
    }
    let ok = EngineArgs::try_parse_from([
        "warmpath-engine",
        "--speculative-config",
        r#"{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}"#,
    ])
    .expect("valid");
    assert_eq!(ok.speculative_config.map(|c| (c.num_speculative_tokens, c.lookup_min())), Some((5, 1)));
}

/// The real model asked to copy JSON: the same text with and without proposals, most proposals
/// kept.
#[tokio::test]
async fn smollm2_copying_its_prompt_keeps_what_is_proposed() {
    if warmpath_wire::models::smollm2_path().is_none() {
        return;
    }
    let mut args = with_spec(warmpath_wire::models::SMOLLM2, 5);
    args.max_model_len = 2048;
    let e = start(args).await;
    let doc = r#"{"name": "deploy-service", "arguments": {"service": "billing-api", "region": "eu-west-1", "replicas": 3, "image": "registry.example.com/billing-api:2.14.1"}}"#;
    let body = |k: usize| {
        json!({"model": "smollm2-135m-instruct", "max_tokens": 64, "temperature": 0, "num_speculative_tokens": k,
               "messages": [{"role": "system", "content": "You are a helpful assistant."},
                            {"role": "user", "content": format!("Repeat this JSON exactly, nothing else:\n{doc}")}]})
    };
    let (s1, plain) = post_json(e.addr, "/v1/chat/completions", body(0)).await;
    let (s2, fast) = post_json(e.addr, "/v1/chat/completions", body(5)).await;
    assert_eq!((s1, s2), (200, 200));
    let text =
        |b: &serde_json::Value| b["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_owned();
    assert_eq!(text(&plain), text(&fast));
    assert!(text(&plain).contains("billing-api"), "{}", text(&plain));
    let proposed = counter(&e, "vllm:spec_decode_num_draft_tokens_total").await;
    let accepted = counter(&e, "vllm:spec_decode_num_accepted_tokens_total").await;
    eprintln!("smollm2: accepted {accepted} of {proposed}: {}", text(&fast));
    assert!(accepted > 0.5 * proposed && accepted >= 20.0, "accepted {accepted} of {proposed}");
}
