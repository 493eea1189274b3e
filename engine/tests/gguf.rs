//! GGUF models served for real: a small llama model written as a GGUF file here (quantized
//! weights, a byte-level tokenizer and a ChatML template in its metadata) through the whole
//! server, the files a loader must refuse, and — where `scripts/ensure-deps` installed it — the
//! quick start's SmolLM2, which must answer.

mod common;

use common::*;
use serde_json::json;
use warmpath_engine::config::EngineArgs;
use warmpath_engine::model::{GgufModel, ModelConfig, Weights};
use warmpath_engine::quant::quantize_row;
use warmpath_wire::gguf::{GgmlType, Value, Writer};

const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// GPT-2's byte → printable character table (what byte-level vocabularies are written in).
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(b) {
        return char::from(b);
    }
    let shifted = (0..b).filter(|&c| !printable(c)).count() as u32 + 1;
    char::from_u32(255 + shifted).expect("a char")
}

/// The `micro` shape's dummy weights as a GGUF file: matrices in `ty`, norms f32, a 260-token
/// vocabulary (the 256 bytes, "ab" from its one merge, then three specials), a ChatML template.
fn micro_gguf(ty: GgmlType, arch: &str) -> Vec<u8> {
    let mut cfg = ModelConfig::micro();
    cfg.hidden_dim = 192; // whole 32-blocks
    cfg.vocab_size = 260 + 28; // rows beyond the tokenizer's ids are allowed
    let w = Weights::dummy(&cfg, 7).expect("weights");
    let mut tokens: Vec<Value> = (0..=255u8).map(|b| Value::String(byte_char(b).to_string())).collect();
    for s in ["ab", "<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
        tokens.push(Value::String(s.into()));
    }
    let types: Vec<Value> = (0..260).map(|i| Value::I32(if i <= 256 { 1 } else { 3 })).collect();
    let mut g = Writer::new();
    g.meta("general.architecture", Value::String(arch.into()))
        .meta("general.name", Value::String("micro-gguf".into()))
        .meta(&format!("{arch}.embedding_length"), Value::U32(cfg.dim as u32))
        .meta(&format!("{arch}.feed_forward_length"), Value::U32(cfg.hidden_dim as u32))
        .meta(&format!("{arch}.block_count"), Value::U32(cfg.n_layers as u32))
        .meta(&format!("{arch}.attention.head_count"), Value::U32(cfg.n_heads as u32))
        .meta(&format!("{arch}.attention.head_count_kv"), Value::U32(cfg.n_kv_heads as u32))
        .meta(&format!("{arch}.context_length"), Value::U32(2048))
        .meta("tokenizer.ggml.model", Value::String("gpt2".into()))
        .meta("tokenizer.ggml.pre", Value::String("gpt-2".into()))
        .meta("tokenizer.ggml.tokens", Value::Array(tokens))
        .meta("tokenizer.ggml.token_type", Value::Array(types))
        .meta("tokenizer.ggml.merges", Value::Array(vec![Value::String("a b".into())]))
        .meta("tokenizer.ggml.eos_token_id", Value::U32(259))
        .meta("tokenizer.ggml.bos_token_id", Value::U32(257))
        .meta("tokenizer.chat_template", Value::String(CHATML.into()));
    let mat = |m: &warmpath_engine::model::Matrix| {
        let data = m.as_f32().expect("f32");
        data.chunks_exact(m.cols()).flat_map(|r| quantize_row(ty, r)).collect::<Vec<u8>>()
    };
    let dims = |m: &warmpath_engine::model::Matrix| [m.cols() as u64, m.rows() as u64];
    g.tensor("token_embd.weight", &dims(&w.embed), GgmlType::Q8_0, {
        let data = w.embed.as_f32().expect("f32");
        data.chunks_exact(cfg.dim).flat_map(|r| quantize_row(GgmlType::Q8_0, r)).collect()
    });
    g.f32_tensor("output_norm.weight", &[cfg.dim as u64], &w.rms_final);
    for (i, l) in w.layers.iter().enumerate() {
        g.f32_tensor(&format!("blk.{i}.attn_norm.weight"), &[cfg.dim as u64], &l.rms_att);
        g.f32_tensor(&format!("blk.{i}.ffn_norm.weight"), &[cfg.dim as u64], &l.rms_ffn);
        for (name, m) in [
            ("attn_q", &l.wq),
            ("attn_k", &l.wk),
            ("attn_v", &l.wv),
            ("attn_output", &l.wo),
            ("ffn_gate", &l.w1),
            ("ffn_down", &l.w2),
            ("ffn_up", &l.w3),
        ] {
            g.tensor(&format!("blk.{i}.{name}.weight"), &dims(m), ty, mat(m));
        }
    }
    g.finish()
}

fn write(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).expect("dir");
    let p = dir.join(name);
    std::fs::write(&p, bytes).expect("write");
    p
}

fn temp_dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("wp-gguf-{}", std::process::id()))
}

#[tokio::test]
async fn a_quantized_gguf_model_is_served_with_its_own_tokenizer_and_template() {
    let dir = temp_dir();
    for ty in [GgmlType::Q4_1, GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::F16] {
        let path = write(&dir, &format!("micro-{ty:?}.gguf"), &micro_gguf(ty, "llama"));
        let mut args = EngineArgs::for_tests(path.to_str().expect("utf-8"));
        args.max_model_len = 1024;
        let e = start(args).await;
        let (status, models) = get(e.addr, "/v1/models").await;
        assert_eq!(status, 200);
        assert!(models.contains(&format!("micro-{ty:?}")), "served under the file's stem: {models}");
        let req = json!({"model": format!("micro-{ty:?}"), "messages": [{"role": "user", "content": "ab ab"}],
            "max_tokens": 5, "temperature": 0});
        let (status, body) = post_json(e.addr, "/v1/chat/completions", req.clone()).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 5);
        // The template and the tokenizer of the file: its specials, the merged "ab".
        let (_, t) = post_json(e.addr, "/tokenize", json!({"messages": req["messages"]})).await;
        let ids: Vec<u64> = t["tokens"].as_array().expect("ids").iter().filter_map(|v| v.as_u64()).collect();
        assert_eq!(ids[0], 258, "<|im_start|>");
        assert_eq!(ids.iter().filter(|&&i| i == 259).count(), 1, "one <|im_end|>");
        assert_eq!(ids.iter().filter(|&&i| i == 256).count(), 2, "\"ab\" is one token: {ids:?}");
        // Greedy decoding is deterministic.
        let (_, again) = post_json(e.addr, "/v1/chat/completions", req).await;
        assert_eq!(again["choices"][0]["message"]["content"], body["choices"][0]["message"]["content"]);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn files_the_engine_cannot_run_are_refused_with_the_reason() {
    let dir = temp_dir().join("bad");
    let err = |bytes: &[u8], name: &str| {
        GgufModel::load(&write(&dir, name, bytes)).expect_err("refused").to_string()
    };
    let e = err(&micro_gguf(GgmlType::Q4_1, "gpt2"), "arch.gguf");
    assert!(e.contains("architecture \"gpt2\" is not supported"), "{e}");
    let good = micro_gguf(GgmlType::Q4_1, "llama");
    let e = err(&good[..good.len() / 2], "cut.gguf");
    assert!(e.contains("truncated") && e.contains("cut.gguf"), "{e}");
    let mut missing = good.clone();
    let at = missing.windows(12).position(|w| w == b"blk.1.ffn_up").expect("a tensor name");
    missing[at..at + 12].copy_from_slice(b"blk.1.ffn_UP");
    let e = err(&missing, "missing.gguf");
    assert!(e.contains("tensor blk.1.ffn_up.weight is missing"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The quick start's model, where installed: it answers the README's question.
#[tokio::test]
async fn smollm2_answers() {
    if warmpath_wire::models::smollm2_path().is_none() {
        return;
    }
    let mut args = EngineArgs::for_tests(warmpath_wire::models::SMOLLM2);
    args.max_model_len = 2048;
    let e = start(args).await;
    let req = json!({"model": "smollm2-135m-instruct", "max_tokens": 24, "temperature": 0, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]});
    let (status, body) = post_json(e.addr, "/v1/chat/completions", req).await;
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["message"]["content"].as_str().expect("text");
    assert!(text.contains("Paris"), "{text}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "ends its turn with <|im_end|>");
}
