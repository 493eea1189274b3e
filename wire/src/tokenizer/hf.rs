//! Loading a Hugging Face `tokenizer.json` into the same BPE the built-in tokenizer runs on.
//!
//! Accepted: a `BPE` model over the byte-level alphabet (no byte fallback, no subword
//! prefixes or suffixes), a `ByteLevel` pre-tokenizer (GPT-2's split), a `Sequence` of one
//! `Split` regex (behaviour `Isolated`) and a `ByteLevel` without its own regex (Llama 3,
//! Qwen 2 and most current models), or a `Sequence` of `Digits` (each digit alone) and a
//! `ByteLevel` (SmolLM), no normalizer or `NFC`, and added tokens without stripping. Anything
//! else is refused with the reason: a tokenizer that only nearly matches the backend's would give
//! prefix keys that never match its cache. The post-processor is ignored, as vLLM does for chat
//! prompts (the chat template writes the BOS token itself). The vocabulary becomes ranks as
//! [`super::byte_level`] says.

use serde_json::Value;

use super::byte_level::{self, PreSplit, Vocab, GPT2_PATTERN};
use super::{Tokenizer, TokenizerError};

fn unsupported(what: impl Into<String>) -> TokenizerError {
    TokenizerError::Unsupported(what.into())
}

pub(super) fn load(name: &str, json: &str) -> Result<Tokenizer, TokenizerError> {
    let doc: Value =
        serde_json::from_str(json).map_err(|e| TokenizerError::Build(format!("not JSON: {e}")))?;
    let model = doc.get("model").ok_or_else(|| unsupported("no \"model\""))?;
    if let Some(t) = model.get("type").and_then(Value::as_str) {
        if t != "BPE" {
            return Err(unsupported(format!("model type {t:?}: only byte-level BPE is supported")));
        }
    }
    if model.get("byte_fallback").and_then(Value::as_bool) == Some(true) {
        return Err(unsupported("byte_fallback BPE (SentencePiece style) is not supported"));
    }
    for key in ["continuing_subword_prefix", "end_of_word_suffix"] {
        if model.get(key).is_some_and(|v| !v.is_null() && v != "") {
            return Err(unsupported(format!("model.{key} is not supported")));
        }
    }
    let nfc = match doc.get("normalizer") {
        None | Some(Value::Null) => false,
        Some(n) if n.get("type").and_then(Value::as_str) == Some("NFC") => true,
        Some(n) => return Err(unsupported(format!("normalizer {}: only none or NFC", kind(n)))),
    };
    let split = pre_split(doc.get("pre_tokenizer").unwrap_or(&Value::Null))?;

    let mut specials = Vec::new();
    for t in doc.get("added_tokens").and_then(Value::as_array).into_iter().flatten() {
        let content = t
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| unsupported("added token without content"))?;
        let id = t.get("id").and_then(Value::as_u64).ok_or_else(|| unsupported("added token without id"))?;
        for flag in ["lstrip", "rstrip", "single_word"] {
            if t.get(flag).and_then(Value::as_bool) == Some(true) {
                return Err(unsupported(format!("added token {content:?} sets {flag}")));
            }
        }
        specials.push((content.to_owned(), byte_level::id_u32(id)?));
    }
    let vocab = model.get("vocab").and_then(Value::as_object).ok_or_else(|| unsupported("no model.vocab"))?;
    let mut tokens = Vec::with_capacity(vocab.len());
    for (token, id) in vocab {
        let id = id.as_u64().ok_or_else(|| unsupported(format!("token {token:?} has no numeric id")))?;
        tokens.push((token.as_str(), byte_level::id_u32(id)?));
    }
    let mut merges = Vec::new();
    for (k, m) in model.get("merges").and_then(Value::as_array).into_iter().flatten().enumerate() {
        merges.push(match m {
            Value::String(s) => s.split_once(' ').ok_or_else(|| unsupported(format!("merge {k} {s:?}")))?,
            Value::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                (Some(a), Some(b)) => (a, b),
                _ => return Err(unsupported(format!("merge {k}"))),
            },
            _ => return Err(unsupported(format!("merge {k}"))),
        });
    }
    byte_level::build(Vocab { name: name.to_owned(), tokens, merges, specials, split, nfc })
}

fn kind(v: &Value) -> String {
    v.get("type").and_then(Value::as_str).unwrap_or("?").to_owned()
}

/// How a pre-tokenizer splits text.
fn pre_split(pre: &Value) -> Result<PreSplit, TokenizerError> {
    let byte_level = |v: &Value, own_regex: bool| -> Result<(), TokenizerError> {
        if v.get("add_prefix_space").and_then(Value::as_bool) == Some(true) {
            return Err(unsupported("ByteLevel add_prefix_space is not supported"));
        }
        if v.get("use_regex").and_then(Value::as_bool).unwrap_or(true) != own_regex {
            return Err(unsupported("this ByteLevel use_regex arrangement is not supported"));
        }
        Ok(())
    };
    match kind(pre).as_str() {
        "ByteLevel" => {
            byte_level(pre, true)?;
            Ok(PreSplit::pattern(GPT2_PATTERN))
        }
        "Sequence" => {
            let parts = pre.get("pretokenizers").and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
            match parts {
                [digits, bl] if kind(digits) == "Digits" && kind(bl) == "ByteLevel" => {
                    if digits.get("individual_digits").and_then(Value::as_bool) != Some(true) {
                        return Err(unsupported("Digits without individual_digits is not supported"));
                    }
                    byte_level(bl, true)?;
                    Ok(PreSplit { pattern: GPT2_PATTERN.to_owned(), digits: true })
                }
                [split, bl] if kind(split) == "Split" && kind(bl) == "ByteLevel" => {
                    byte_level(bl, false)?;
                    let regex = split.get("pattern").and_then(|p| p.get("Regex")).and_then(Value::as_str);
                    let isolated = split.get("behavior").and_then(Value::as_str) == Some("Isolated");
                    let inverted = split.get("invert").and_then(Value::as_bool) == Some(true);
                    match regex {
                        Some(r) if isolated && !inverted => Ok(PreSplit::pattern(r)),
                        _ => Err(unsupported("only an Isolated, non-inverted Split regex is supported")),
                    }
                }
                _ => Err(unsupported(
                    "pre-tokenizer sequence other than [Split, ByteLevel] or [Digits, ByteLevel]",
                )),
            }
        }
        other => Err(unsupported(format!("pre-tokenizer {other:?}"))),
    }
}
