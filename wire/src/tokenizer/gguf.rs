//! The tokenizer a GGUF file carries: `tokenizer.ggml.model = "gpt2"` (byte-level BPE: its
//! tokens in the byte-level alphabet, their types, the merges) with one of the pre-tokenizers
//! `tokenizer.ggml.pre` names that llama.cpp and this loader share (`default`/`gpt-2`, `smollm`,
//! `llama-bpe`, `qwen2`), or `"llama"` (SentencePiece BPE with byte fallback: tokens, their
//! scores and types, `add_space_prefix`). Control, user-defined and unknown tokens are the special
//! tokens, as in llama.cpp. Anything else is refused with the reason, as for `tokenizer.json`.

use super::byte_level::{self, PreSplit, Vocab, GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN};
use super::spm::{Merges, Prefix, Spm, SpmVocab};
use super::{Model, Tokenizer, TokenizerError};
use crate::gguf::{Gguf, GgufError, Value};

/// llama.cpp's token types.
const NORMAL: i64 = 1;
const UNKNOWN: i64 = 2;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

fn unsupported(what: impl Into<String>) -> TokenizerError {
    TokenizerError::Unsupported(what.into())
}

fn meta(e: GgufError) -> TokenizerError {
    TokenizerError::Build(e.to_string())
}

pub(super) fn load(name: &str, g: &Gguf) -> Result<Tokenizer, TokenizerError> {
    let model = g.str("tokenizer.ggml.model").map_err(meta)?;
    match model {
        "gpt2" => {}
        "llama" => return load_spm(name, g),
        _ => {
            return Err(unsupported(format!(
                "tokenizer.ggml.model {model:?}: only byte-level BPE (\"gpt2\") and SentencePiece BPE (\"llama\") are supported"
            )))
        }
    }
    let pre = match g.get("tokenizer.ggml.pre") {
        None => "default",
        Some(v) => v.as_str().ok_or_else(|| unsupported("tokenizer.ggml.pre is not a string"))?,
    };
    let split = match pre {
        "default" | "gpt-2" | "gpt2" => PreSplit::pattern(GPT2_PATTERN),
        "smollm" => PreSplit { pattern: GPT2_PATTERN.to_owned(), digits: true },
        "llama3" | "llama-v3" | "llama-bpe" => PreSplit::pattern(LLAMA3_PATTERN),
        "qwen2" => PreSplit::pattern(QWEN2_PATTERN),
        other => return Err(unsupported(format!("tokenizer.ggml.pre {other:?} is not supported"))),
    };
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let types = token_types(g, tokens.len())?;
    let mut specials = Vec::new();
    for (id, t) in types.iter().enumerate() {
        if matches!(*t, CONTROL | USER_DEFINED) {
            specials.push((tokens[id].to_owned(), byte_level::id_u32(id as u64)?));
        }
    }
    let merges = strings(g, "tokenizer.ggml.merges")?
        .into_iter()
        .enumerate()
        .map(|(k, m)| m.split_once(' ').ok_or_else(|| unsupported(format!("merge {k} {m:?}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let tokens = tokens.into_iter().enumerate().map(|(id, t)| (t, id as u32)).collect();
    byte_level::build(Vocab { name: name.to_owned(), tokens, merges, specials, split, nfc: false })
}

fn strings<'g>(g: &'g Gguf, key: &str) -> Result<Vec<&'g str>, TokenizerError> {
    g.array(key)
        .map_err(meta)?
        .iter()
        .map(|v| v.as_str().ok_or_else(|| unsupported(format!("{key} holds a non-string"))))
        .collect()
}

/// `tokenizer.ggml.token_type`, one per token (all normal when the key is absent).
fn token_types(g: &Gguf, tokens: usize) -> Result<Vec<i64>, TokenizerError> {
    let types: Vec<i64> = match g.get("tokenizer.ggml.token_type") {
        Some(Value::Array(a)) => a.iter().map(|t| t.as_i64().unwrap_or(NORMAL)).collect(),
        _ => vec![NORMAL; tokens],
    };
    if types.len() != tokens {
        return Err(unsupported(format!("{} token types for {tokens} tokens", types.len())));
    }
    Ok(types)
}

/// SentencePiece BPE: tokens, scores, types; a `▁` before text unless `add_space_prefix` is
/// false (llama.cpp's default for this model is true).
fn load_spm(name: &str, g: &Gguf) -> Result<Tokenizer, TokenizerError> {
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let types = token_types(g, tokens.len())?;
    let scores = g
        .array("tokenizer.ggml.scores")
        .map_err(meta)?
        .iter()
        .map(|v| v.as_f32().ok_or_else(|| unsupported("tokenizer.ggml.scores holds a non-number")))
        .collect::<Result<Vec<f32>, _>>()?;
    let prefix = match g.get("tokenizer.ggml.add_space_prefix").map(|v| v.as_bool()) {
        None | Some(Some(true)) => Prefix::Always,
        Some(Some(false)) => Prefix::Never,
        Some(None) => return Err(unsupported("tokenizer.ggml.add_space_prefix is not a bool")),
    };
    let unk = match g.get("tokenizer.ggml.unknown_token_id") {
        Some(v) => Some(v.as_u64().ok_or_else(|| unsupported("tokenizer.ggml.unknown_token_id"))?),
        None => tokens.iter().position(|t| *t == "<unk>").map(|p| p as u64),
    }
    .map(byte_level::id_u32)
    .transpose()?;
    let mut specials = Vec::new();
    for (id, t) in types.iter().enumerate() {
        if matches!(*t, CONTROL | USER_DEFINED | UNKNOWN) {
            specials.push((tokens[id].to_owned(), byte_level::id_u32(id as u64)?));
        }
    }
    let vocab_size = tokens.len();
    let spm = Spm::new(SpmVocab {
        ordinary: types.iter().map(|t| matches!(*t, NORMAL | USER_DEFINED)).collect(),
        tokens: tokens.into_iter().map(str::to_owned).collect(),
        merges: Merges::Scores(scores),
        unk,
        prefix,
        split_words: false,
        prefix_unless_spaced: false,
    })?;
    Ok(Tokenizer::assemble(name.to_owned(), Model::Spm(spm), specials, vocab_size, false))
}
