//! A byte-level BPE vocabulary, as a `tokenizer.json` or a GGUF file describes it, assembled into
//! the BPE the built-in tokenizer runs on.
//!
//! The merges become ranks: the 256 single bytes first, then each merge's result in merge order,
//! then any other vocabulary entry; encoding merges the lowest-ranked adjacent pair first, which
//! is the file's merge order. (The BPE merges two parts whenever their concatenation is a token,
//! where the file's BPE would only merge listed pairs; for vocabularies learned by BPE the two
//! agree, and the tests check it against the `tokenizers` library's and llama.cpp's output.)

use std::collections::{HashMap, HashSet};

use super::{Parts, Tokenizer, TokenizerError};

/// GPT-2's split, which `ByteLevel` with `use_regex` applies.
pub(super) const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3's split (cl100k's, as Hugging Face writes it).
pub(super) const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2 / 2.5 / 3's split.
pub(super) const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Split patterns known to cut after every newline that a non-space follows; [`super::chunks`]
/// may cut text for them.
const LINE_SPLITTING: &[&str] = &[GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN];

/// The id of a byte that has no token: left out of the encoding.
pub(super) const DROPPED: u32 = u32::MAX;

/// How text is split before BPE: a regex, after (where `digits`) every digit is cut out alone
/// (the `Digits` pre-tokenizer with `individual_digits`, SmolLM's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PreSplit {
    pub pattern: String,
    pub digits: bool,
}

impl PreSplit {
    pub fn pattern(p: &str) -> PreSplit {
        PreSplit { pattern: p.to_owned(), digits: false }
    }
}

/// A vocabulary as a file gives it.
pub(super) struct Vocab<'a> {
    pub name: String,
    /// Every token in the byte-level alphabet with its id (special ones are skipped).
    pub tokens: Vec<(&'a str, u32)>,
    /// Merges in order.
    pub merges: Vec<(&'a str, &'a str)>,
    /// Special tokens (matched in rendered templates) and their ids.
    pub specials: Vec<(String, u32)>,
    pub split: PreSplit,
    /// Unicode NFC before splitting.
    pub nfc: bool,
}

fn unsupported(what: impl Into<String>) -> TokenizerError {
    TokenizerError::Unsupported(what.into())
}

pub(super) fn id_u32(id: u64) -> Result<u32, TokenizerError> {
    u32::try_from(id).map_err(|_| unsupported(format!("token id {id} is too large")))
}

pub(super) fn build(v: Vocab<'_>) -> Result<Tokenizer, TokenizerError> {
    let alphabet = byte_alphabet();
    let to_bytes = |token: &str| -> Result<Vec<u8>, TokenizerError> {
        token
            .chars()
            .map(|c| alphabet.get(&c).copied())
            .collect::<Option<Vec<u8>>>()
            .ok_or_else(|| unsupported(format!("token {token:?} is not in the byte-level alphabet")))
    };
    // A special token holding a newline could be cut in two by a line cut.
    let splits_lines = LINE_SPLITTING.contains(&v.split.pattern.as_str())
        && v.specials.iter().all(|(s, _)| !s.contains('\n'));
    let special_ids: HashSet<u32> = v.specials.iter().map(|(_, id)| *id).collect();
    let mut by_bytes: HashMap<Vec<u8>, u32> = HashMap::with_capacity(v.tokens.len());
    for (token, id) in &v.tokens {
        if special_ids.contains(id) {
            continue;
        }
        if by_bytes.insert(to_bytes(token)?, *id).is_some() {
            return Err(unsupported(format!("two ids for the bytes of token {token:?}")));
        }
    }
    // Ranks: single bytes, then merge results in merge order, then the rest. A byte without a
    // token of its own (SmolLM's vocabulary lacks 21, control characters and bytes UTF-8 never
    // uses) is dropped from the ids, as the `tokenizers` library drops characters it cannot
    // encode when the model has no unknown token.
    let mut rank_of: HashMap<Vec<u8>, u32> = HashMap::with_capacity(by_bytes.len());
    let mut ids = Vec::with_capacity(by_bytes.len());
    for b in 0..=255u8 {
        rank_of.insert(vec![b], b as u32);
        ids.push(by_bytes.get(&vec![b]).copied().unwrap_or(DROPPED));
    }
    for (k, (a, b)) in v.merges.iter().enumerate() {
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
    ids.extend(v.specials.iter().map(|(_, id)| *id));
    let vocab_size = ids.iter().filter(|&&id| id != DROPPED).max().map_or(0, |m| *m as usize + 1);
    let identity = ids.iter().enumerate().all(|(r, id)| r as u32 == *id);
    Parts {
        name: v.name,
        encoder: rank_of,
        specials: v.specials,
        ids: (!identity).then_some(ids),
        vocab_size,
        pattern: &v.split.pattern,
        digits: v.split.digits,
        nfc: v.nfc,
        splits_lines,
    }
    .assemble()
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
