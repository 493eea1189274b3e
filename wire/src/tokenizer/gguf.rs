//! The tokenizer a GGUF file carries: `tokenizer.ggml.model = "gpt2"` (byte-level BPE: its
//! tokens in the byte-level alphabet, their types, the merges) with one of the pre-tokenizers
//! `tokenizer.ggml.pre` names that llama.cpp and this loader share (`default`/`gpt-2`, `smollm`,
//! `llama-bpe`, `qwen2`). Control and user-defined tokens are the special tokens. Anything else
//! is refused with the reason, as for `tokenizer.json`.

use super::byte_level::{self, PreSplit, Vocab, GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN};
use super::{Tokenizer, TokenizerError};
use crate::gguf::{Gguf, GgufError, Value};

/// llama.cpp's token types that are matched as special tokens in rendered templates.
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
    if model != "gpt2" {
        return Err(unsupported(format!(
            "tokenizer.ggml.model {model:?}: only byte-level BPE (\"gpt2\") is supported"
        )));
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
    let strings = |key: &str| -> Result<Vec<&str>, TokenizerError> {
        g.array(key)
            .map_err(meta)?
            .iter()
            .map(|v| v.as_str().ok_or_else(|| unsupported(format!("{key} holds a non-string"))))
            .collect()
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let types: Vec<i64> = match g.get("tokenizer.ggml.token_type") {
        Some(Value::Array(a)) => a.iter().map(|t| t.as_i64().unwrap_or(1)).collect(),
        _ => Vec::new(),
    };
    if !types.is_empty() && types.len() != tokens.len() {
        return Err(unsupported(format!("{} token types for {} tokens", types.len(), tokens.len())));
    }
    let mut specials = Vec::new();
    for (id, t) in types.iter().enumerate() {
        if matches!(*t, CONTROL | USER_DEFINED) {
            specials.push((tokens[id].to_owned(), byte_level::id_u32(id as u64)?));
        }
    }
    let merges = strings("tokenizer.ggml.merges")?
        .into_iter()
        .enumerate()
        .map(|(k, m)| m.split_once(' ').ok_or_else(|| unsupported(format!("merge {k} {m:?}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let tokens = tokens.into_iter().enumerate().map(|(id, t)| (t, id as u32)).collect();
    byte_level::build(Vocab { name: name.to_owned(), tokens, merges, specials, split, nfc: false })
}
