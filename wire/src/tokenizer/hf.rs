//! Loading a Hugging Face `tokenizer.json` into the same BPE the built-in tokenizer runs on.
//!
//! Accepted: a `BPE` model over the byte-level alphabet (no byte fallback, no subword
//! prefixes or suffixes), a `ByteLevel` pre-tokenizer (GPT-2's split) or a `Sequence` of one
//! `Split` regex (behaviour `Isolated`) and a `ByteLevel` without its own regex (Llama 3,
//! Qwen 2 and most current models), no normalizer or `NFC`, and added tokens without
//! stripping. Anything else is refused with the reason: a tokenizer that only nearly matches the
//! backend's would give prefix keys that never match its cache. The post-processor is ignored,
//! as vLLM does for chat prompts (the chat template writes the BOS token itself).
//!
//! The merges become ranks: the 256 single bytes first, then each merge's result in merge order,
//! then any other vocabulary entry; encoding merges the lowest-ranked adjacent pair first, which
//! is the file's merge order. (The BPE merges two parts whenever their concatenation is a token,
//! where the file's BPE would only merge listed pairs; for vocabularies learned by BPE the two
//! agree, and the tests check it against the `tokenizers` library's own output.)

use std::collections::HashMap;

use serde_json::Value;

use super::{Parts, Tokenizer, TokenizerError};

/// GPT-2's split, which `ByteLevel` with `use_regex` applies.
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Split patterns known to cut after every newline that a non-space follows; [`super::chunks`]
/// may cut text for them. Compared after removing the file's escaping differences.
const LINE_SPLITTING: &[&str] = &[
    GPT2_PATTERN,
    // Llama 3, cl100k as Hugging Face writes it.
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    // Qwen 2 / 2.5 / 3.
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

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
    let pattern = pattern(doc.get("pre_tokenizer").unwrap_or(&Value::Null))?;

    let alphabet = byte_alphabet();
    let to_bytes = |token: &str| -> Result<Vec<u8>, TokenizerError> {
        token
            .chars()
            .map(|c| alphabet.get(&c).copied())
            .collect::<Option<Vec<u8>>>()
            .ok_or_else(|| unsupported(format!("token {token:?} is not in the byte-level alphabet")))
    };

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
        specials.push((content.to_owned(), id_u32(id)?));
    }
    // A special token holding a newline could be cut in two by a line cut.
    let splits_lines =
        LINE_SPLITTING.contains(&pattern.as_str()) && specials.iter().all(|(s, _)| !s.contains('\n'));
    let special_ids: std::collections::HashSet<u32> = specials.iter().map(|(_, id)| *id).collect();

    let vocab = model.get("vocab").and_then(Value::as_object).ok_or_else(|| unsupported("no model.vocab"))?;
    let mut by_bytes: HashMap<Vec<u8>, u32> = HashMap::with_capacity(vocab.len());
    for (token, id) in vocab {
        let id =
            id_u32(id.as_u64().ok_or_else(|| unsupported(format!("token {token:?} has no numeric id")))?)?;
        if special_ids.contains(&id) {
            continue;
        }
        if by_bytes.insert(to_bytes(token)?, id).is_some() {
            return Err(unsupported(format!("two ids for the bytes of token {token:?}")));
        }
    }

    // Ranks: single bytes, then merge results in merge order, then the rest.
    let mut rank_of: HashMap<Vec<u8>, u32> = HashMap::with_capacity(by_bytes.len());
    let mut ids = Vec::with_capacity(by_bytes.len());
    for b in 0..=255u8 {
        let id = by_bytes.get(&vec![b]).ok_or_else(|| unsupported(format!("byte {b:#04x} has no token")))?;
        rank_of.insert(vec![b], b as u32);
        ids.push(*id);
    }
    for (k, m) in model.get("merges").and_then(Value::as_array).into_iter().flatten().enumerate() {
        let (a, b) = match m {
            Value::String(s) => s.split_once(' ').ok_or_else(|| unsupported(format!("merge {k} {s:?}")))?,
            Value::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                (Some(a), Some(b)) => (a, b),
                _ => return Err(unsupported(format!("merge {k}"))),
            },
            _ => return Err(unsupported(format!("merge {k}"))),
        };
        let mut merged = to_bytes(a)?;
        merged.extend(to_bytes(b)?);
        if rank_of.contains_key(&merged) {
            continue;
        }
        let id = *by_bytes.get(&merged).ok_or_else(|| unsupported(format!("merge {k} yields no token")))?;
        rank_of.insert(merged, ids.len() as u32);
        ids.push(id);
    }
    let mut rest: Vec<(&Vec<u8>, &u32)> =
        by_bytes.iter().filter(|(b, _)| !rank_of.contains_key(*b)).collect();
    rest.sort_by_key(|(_, id)| **id);
    let rest: Vec<(Vec<u8>, u32)> = rest.into_iter().map(|(b, id)| (b.clone(), *id)).collect();
    for (bytes, id) in rest {
        rank_of.insert(bytes, ids.len() as u32);
        ids.push(id);
    }
    // Special tokens take the ranks after the ordinary ones, in `specials` order.
    ids.extend(specials.iter().map(|(_, id)| *id));
    let vocab_size = ids.iter().max().map_or(0, |m| *m as usize + 1);
    let identity = ids.iter().enumerate().all(|(r, id)| r as u32 == *id);
    Parts {
        name: name.to_owned(),
        encoder: rank_of,
        specials,
        ids: (!identity).then_some(ids),
        vocab_size,
        pattern: &pattern,
        nfc,
        splits_lines,
    }
    .assemble()
}

fn id_u32(id: u64) -> Result<u32, TokenizerError> {
    u32::try_from(id).map_err(|_| unsupported(format!("token id {id} is too large")))
}

fn kind(v: &Value) -> String {
    v.get("type").and_then(Value::as_str).unwrap_or("?").to_owned()
}

/// The split regex of a pre-tokenizer.
fn pattern(pre: &Value) -> Result<String, TokenizerError> {
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
            Ok(GPT2_PATTERN.to_owned())
        }
        "Sequence" => {
            let parts = pre.get("pretokenizers").and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
            match parts {
                [split, bl] if kind(split) == "Split" && kind(bl) == "ByteLevel" => {
                    byte_level(bl, false)?;
                    let regex = split.get("pattern").and_then(|p| p.get("Regex")).and_then(Value::as_str);
                    let isolated = split.get("behavior").and_then(Value::as_str) == Some("Isolated");
                    let inverted = split.get("invert").and_then(Value::as_bool) == Some(true);
                    match regex {
                        Some(r) if isolated && !inverted => Ok(r.to_owned()),
                        _ => Err(unsupported("only an Isolated, non-inverted Split regex is supported")),
                    }
                }
                _ => Err(unsupported("pre-tokenizer sequence other than [Split, ByteLevel]")),
            }
        }
        other => Err(unsupported(format!("pre-tokenizer {other:?}"))),
    }
}

/// GPT-2's byte ↔ printable-character table: printable Latin-1 bytes stand for themselves, the
/// others are shifted to U+0100 and up.
fn byte_alphabet() -> HashMap<char, u8> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut map = HashMap::with_capacity(256);
    let mut shifted = 0u32;
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).expect("U+0100..U+0143 are chars")
        };
        map.insert(c, b);
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_gpt2s() {
        let a = byte_alphabet();
        assert_eq!(a[&'Ġ'], b' ');
        assert_eq!(a[&'Ċ'], b'\n');
        assert_eq!(a[&'A'], b'A');
        assert_eq!(a.len(), 256);
    }
}
