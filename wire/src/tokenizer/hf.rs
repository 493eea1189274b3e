//! Loading a Hugging Face `tokenizer.json` into the same BPE the built-in tokenizer runs on.
//!
//! Accepted: a `BPE` model with `byte_fallback` (SentencePiece style: Llama 2, Mistral, Gemma;
//! see [`load_spm`] for the normalizers and pre-tokenizers it takes), or a `BPE` model over the
//! byte-level alphabet (no subword prefixes or suffixes), a `ByteLevel` pre-tokenizer (GPT-2's split), a `Sequence` of one
//! `Split` regex (behaviour `Isolated`) and a `ByteLevel` without its own regex (Llama 3,
//! Qwen 2 and most current models), or a `Sequence` of `Digits` (each digit alone) and a
//! `ByteLevel` (SmolLM), no normalizer or `NFC`, and added tokens without stripping. Anything
//! else is refused with the reason: a tokenizer that only nearly matches the backend's would give
//! prefix keys that never match its cache. The post-processor is ignored, as vLLM does for chat
//! prompts (the chat template writes the BOS token itself). The vocabulary becomes ranks as
//! [`super::byte_level`] says.

use serde_json::Value;

use super::byte_level::{self, PreSplit, Vocab, GPT2_PATTERN};
use super::spm::{Merges, Prefix, Spm, SpmVocab, SPACE};
use super::{Model, Tokenizer, TokenizerError};

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
        return load_spm(name, &doc, model);
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

    let specials = added_tokens(&doc)?;
    let vocab = model.get("vocab").and_then(Value::as_object).ok_or_else(|| unsupported("no model.vocab"))?;
    let mut tokens = Vec::with_capacity(vocab.len());
    for (token, id) in vocab {
        let id = id.as_u64().ok_or_else(|| unsupported(format!("token {token:?} has no numeric id")))?;
        tokens.push((token.as_str(), byte_level::id_u32(id)?));
    }
    let merges = merges(model)?;
    byte_level::build(Vocab { name: name.to_owned(), tokens, merges, specials, split, nfc })
}

/// The added tokens: the special ones, matched in rendered templates.
fn added_tokens(doc: &Value) -> Result<Vec<(String, u32)>, TokenizerError> {
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
    Ok(specials)
}

/// The merge list, as `"a b"` strings or `["a", "b"]` pairs.
fn merges(model: &Value) -> Result<Vec<(&str, &str)>, TokenizerError> {
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
    Ok(merges)
}

/// A `BPE` model with `byte_fallback`. Spaces become `▁` by a `Replace(" ", "▁")` normalizer
/// (with a `Prepend("▁")` before it: the prefix on every stretch of text, Llama 2's and Mistral
/// v0.1's files) or by a `Metaspace` pre-tokenizer (`prepend_scheme` `always`, `first` or
/// `never`; `split` cuts before every `▁`, Mistral v0.3's and newer files).
fn load_spm(name: &str, doc: &Value, model: &Value) -> Result<Tokenizer, TokenizerError> {
    let space = SPACE.to_string();
    let normalizers: Vec<&Value> = match doc.get("normalizer") {
        None | Some(Value::Null) => Vec::new(),
        Some(n) if kind(n) == "Sequence" => {
            n.get("normalizers").and_then(Value::as_array).map(|a| a.iter().collect()).unwrap_or_default()
        }
        Some(n) => vec![n],
    };
    let mut prefix = None;
    let mut replaces = false;
    for n in normalizers {
        match kind(n).as_str() {
            "Prepend" if n.get("prepend").and_then(Value::as_str) == Some(&space) && !replaces => {
                prefix = Some(Prefix::Always)
            }
            "Replace"
                if n.get("pattern").and_then(|p| p.get("String")).and_then(Value::as_str) == Some(" ")
                    && n.get("content").and_then(Value::as_str) == Some(&space) =>
            {
                replaces = true
            }
            other => return Err(unsupported(format!("normalizer {other:?} with byte_fallback"))),
        }
    }
    let mut split_words = false;
    let mut metaspace = false;
    match doc.get("pre_tokenizer") {
        None | Some(Value::Null) if replaces => {}
        Some(p) if kind(p) == "Metaspace" && !replaces => {
            if p.get("replacement").and_then(Value::as_str) != Some(&space) {
                return Err(unsupported("Metaspace with a replacement other than \"▁\""));
            }
            let legacy = p.get("add_prefix_space").and_then(Value::as_bool);
            prefix = Some(match (p.get("prepend_scheme").and_then(Value::as_str), legacy) {
                (Some("always"), _) | (None, Some(true) | None) => Prefix::Always,
                (Some("first"), _) => Prefix::First,
                (Some("never"), _) | (None, Some(false)) => Prefix::Never,
                (Some(other), _) => return Err(unsupported(format!("Metaspace prepend_scheme {other:?}"))),
            });
            split_words = p.get("split").and_then(Value::as_bool).unwrap_or(true);
            metaspace = true;
        }
        Some(p) => return Err(unsupported(format!("pre-tokenizer {} with byte_fallback", kind(p)))),
        None => {
            return Err(unsupported("byte_fallback without a Replace normalizer or Metaspace pre-tokenizer"))
        }
    }
    let specials = added_tokens(doc)?;
    let vocab = model.get("vocab").and_then(Value::as_object).ok_or_else(|| unsupported("no model.vocab"))?;
    let size = vocab
        .values()
        .filter_map(Value::as_u64)
        .chain(specials.iter().map(|(_, id)| u64::from(*id)))
        .max()
        .map_or(0, |m| m as usize + 1);
    let mut tokens = vec![String::new(); size];
    let mut ordinary = vec![false; size];
    for (token, id) in vocab {
        let id =
            id.as_u64().ok_or_else(|| unsupported(format!("token {token:?} has no numeric id")))? as usize;
        tokens[id] = token.clone();
        ordinary[id] = true;
    }
    for (s, id) in &specials {
        tokens[*id as usize] = s.clone();
        ordinary[*id as usize] = false;
    }
    let unk = match model.get("unk_token").and_then(Value::as_str) {
        Some(u) => Some(
            vocab.get(u).and_then(Value::as_u64).ok_or_else(|| unsupported(format!("unk_token {u:?}")))?,
        ),
        None => None,
    }
    .map(byte_level::id_u32)
    .transpose()?;
    let merges = merges(model)?.into_iter().map(|(a, b)| (a.to_owned(), b.to_owned())).collect();
    let spm = Spm::new(SpmVocab {
        tokens,
        ordinary,
        merges: Merges::Pairs(merges),
        unk,
        prefix: prefix.unwrap_or(Prefix::Never),
        split_words,
        prefix_unless_spaced: metaspace,
    })?;
    Ok(Tokenizer::assemble(name.to_owned(), Model::Spm(spm), specials, size, false))
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
