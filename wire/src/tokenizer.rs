//! The built-in tokenizer, `wp32k`: a 32,000-id byte-level BPE that needs no download.
//!
//! It is cl100k_base (embedded in the `tiktoken-rs` crate) cut to its first 31,992 merges, plus
//! eight special tokens at the top of the id range. Cutting a BPE rank table keeps a valid BPE:
//! every merge only ever produces tokens of lower rank than the ones it needs, and the 256 single
//! bytes come first, so any byte string still encodes. 32,000 ids match the llama2.c model
//! shapes the engine uses, so a token id is always a valid row of the embedding table.

use std::collections::HashSet;
use std::sync::{Arc, OnceLock};

use tiktoken_rs::{CoreBPE, Rank};

/// Number of ids, special tokens included.
pub const VOCAB_SIZE: usize = 32_000;
/// Number of ordinary (BPE) ids; special tokens follow them.
const BPE_RANKS: u32 = 31_992;

/// Begin of sequence.
pub const BOS: &str = "<|bos|>";
/// End of text: generation stops here.
pub const EOS: &str = "<|endoftext|>";
/// Opens a chat turn: `<|im_start|>role\n`.
pub const IM_START: &str = "<|im_start|>";
/// Closes a chat turn; also ends generation of an assistant turn.
pub const IM_END: &str = "<|im_end|>";

const SPECIALS: [&str; 8] =
    [BOS, EOS, IM_START, IM_END, "<|reserved_0|>", "<|reserved_1|>", "<|reserved_2|>", "<|reserved_3|>"];

/// Errors of encoding or decoding.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("token id {0} is outside the vocabulary (size {VOCAB_SIZE})")]
    UnknownId(u32),
    #[error("building the tokenizer failed: {0}")]
    Build(String),
}

/// A cheap-to-clone handle on the shared `wp32k` tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    bpe: Arc<CoreBPE>,
    specials: Arc<HashSet<&'static str>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("name", &self.name()).finish()
    }
}

impl Tokenizer {
    /// The process-wide `wp32k` tokenizer (built once, ~0.2 s).
    pub fn wp32k() -> Tokenizer {
        static CELL: OnceLock<Tokenizer> = OnceLock::new();
        CELL.get_or_init(|| Self::build().expect("the embedded cl100k table always loads")).clone()
    }

    fn build() -> Result<Tokenizer, TokenizerError> {
        let full = tiktoken_rs::cl100k_base().map_err(|e| TokenizerError::Build(e.to_string()))?;
        let mut encoder = std::collections::HashMap::default();
        for rank in 0..BPE_RANKS {
            let bytes = full.decode_bytes(&[rank]).map_err(|e| TokenizerError::Build(e.to_string()))?;
            encoder.insert(bytes, rank);
        }
        // Guard the claim in the module doc: every single byte must stay encodable.
        for b in 0..=255u8 {
            if !encoder.contains_key(&vec![b]) {
                return Err(TokenizerError::Build(format!("byte {b} has no token")));
            }
        }
        let mut special = std::collections::HashMap::default();
        for (i, s) in SPECIALS.iter().enumerate() {
            special.insert(s.to_string(), BPE_RANKS + i as u32);
        }
        let bpe = CoreBPE::new(encoder, special, CL100K_PATTERN)
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        Ok(Tokenizer { bpe: Arc::new(bpe), specials: Arc::new(SPECIALS.into_iter().collect()) })
    }

    pub fn name(&self) -> &'static str {
        "wp32k"
    }

    pub fn vocab_size(&self) -> usize {
        VOCAB_SIZE
    }

    /// Encodes text in which special-token strings are plain text (user content).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// Encodes text in which special-token strings are the special tokens (rendered templates).
    pub fn encode_with_special(&self, text: &str) -> Vec<u32> {
        self.bpe.encode(text, &self.specials).map(|(ids, _)| ids).unwrap_or_else(|_| self.encode(text))
    }

    /// The id of a special token such as [`EOS`].
    pub fn special_id(&self, token: &str) -> Option<u32> {
        SPECIALS.iter().position(|s| *s == token).map(|i| BPE_RANKS + i as u32)
    }

    pub fn is_special(&self, id: u32) -> bool {
        (BPE_RANKS..VOCAB_SIZE as u32).contains(&id)
    }

    /// The bytes of `ids` (special tokens as their strings).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= VOCAB_SIZE) {
            return Err(TokenizerError::UnknownId(*bad));
        }
        self.bpe.decode_bytes(ids as &[Rank]).map_err(|e| TokenizerError::UnknownId(e.token))
    }

    /// Text of `ids`; invalid UTF-8 (a multi-byte character cut between ids) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }
}

/// Cuts `text` into chunks of at least `min_len` bytes (the last one may be shorter), each cut
/// right after a newline that a non-whitespace character follows. The cl100k pre-tokenizer
/// always splits there and no merge crosses a split, so encoding the chunks one by one gives
/// exactly the ids of encoding `text` whole: a caller may cache chunk ids and reuse them
/// wherever the same chunk recurs (the proxy does, for the prompts of agent loops). The cuts
/// depend only on the text from the previous cut on, so equal texts cut equally.
pub fn chunks(text: &str, min_len: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let bytes = rest.as_bytes();
        let mut i = min_len.max(1).min(rest.len());
        let cut = loop {
            match bytes[i - 1..].iter().position(|&b| b == b'\n') {
                None => break rest.len(),
                Some(p) => {
                    let after = i + p; // index just past the newline
                    match rest[after..].chars().next() {
                        None => break rest.len(),
                        Some(c) if !c.is_whitespace() => break after,
                        Some(_) => i = after + 1,
                    }
                }
            }
        };
        let (chunk, tail) = rest.split_at(cut);
        rest = tail;
        Some(chunk)
    })
}

/// Turns a stream of ids into text pieces without splitting multi-byte characters: bytes are
/// held back until they form complete UTF-8.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// The text that `id` completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.pending.extend(tok.decode_bytes(&[id])?);
        Ok(self.take_valid())
    }

    fn take_valid(&mut self) -> String {
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                let out = s.to_owned();
                self.pending.clear();
                out
            }
            Err(e) if e.error_len().is_none() => {
                // An incomplete character at the end: emit what precedes it.
                let valid = e.valid_up_to();
                let rest = self.pending.split_off(valid);
                let out = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending = rest;
                out
            }
            Err(_) => {
                // Invalid bytes that no later byte can fix: replace them now.
                let out = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                out
            }
        }
    }

    /// Whatever is still held back, at the end of the stream.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// cl100k_base's pre-tokenizer split (as tiktoken-rs uses it).
const CL100K_PATTERN: &str = "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}++|\\p{N}{1,3}+| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*+|\\s++$|\\s*[\\r\\n]|\\s+(?!\\S)|\\s";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_text_and_stays_in_vocab() {
        let t = Tokenizer::wp32k();
        let text = "Hello, world! Ünïcödé ✓ 12345 {\"json\": [1, 2]}\n\tcode();";
        let ids = t.encode(text);
        assert!(ids.iter().all(|&i| (i as usize) < BPE_RANKS as usize));
        assert_eq!(t.decode(&ids).expect("decodes"), text);
        assert!(ids.len() < text.len(), "BPE merges bytes");
    }

    #[test]
    fn specials_only_when_asked() {
        let t = Tokenizer::wp32k();
        let s = format!("{IM_START}user\nhi{IM_END}");
        let with = t.encode_with_special(&s);
        assert_eq!(with[0], t.special_id(IM_START).expect("special"));
        assert!(with.contains(&t.special_id(IM_END).expect("special")));
        let plain = t.encode(&s);
        assert!(plain.iter().all(|&i| !t.is_special(i)));
        assert_eq!(t.decode(&with).expect("decodes"), s);
    }

    proptest::proptest! {
        #[test]
        fn chunked_encoding_equals_whole_encoding(
            text in "[ab1 \t\r\n.'é中<>{}\"]{0,200}",
            min_len in 1usize..24,
        ) {
            let t = Tokenizer::wp32k();
            let parts: Vec<&str> = chunks(&text, min_len).collect();
            proptest::prop_assert_eq!(parts.concat(), text.clone());
            let chunked: Vec<u32> = parts.iter().flat_map(|c| t.encode(c)).collect();
            proptest::prop_assert_eq!(chunked, t.encode(&text));
        }
    }

    #[test]
    fn chunks_are_cut_after_newlines_before_text() {
        let text = "line one\nline two\n\n  indented\nend";
        let parts: Vec<&str> = chunks(text, 4).collect();
        assert_eq!(parts, ["line one\n", "line two\n\n  indented\n", "end"]);
        assert_eq!(chunks(text, 1000).collect::<Vec<_>>(), [text]);
        assert_eq!(chunks("", 4).count(), 0);
    }

    #[test]
    fn out_of_vocab_ids_are_errors() {
        let t = Tokenizer::wp32k();
        assert!(t.decode(&[VOCAB_SIZE as u32]).is_err());
    }

    #[test]
    fn stream_decoder_never_splits_characters() {
        let t = Tokenizer::wp32k();
        let text = "日本語のテキスト and emoji 🎉🎉";
        let ids = t.encode(text);
        let mut d = StreamDecoder::new();
        let mut out = String::new();
        for id in ids {
            let piece = d.push(&t, id).expect("in vocab");
            assert!(!piece.contains('\u{FFFD}'));
            out.push_str(&piece);
        }
        out.push_str(&d.finish());
        assert_eq!(out, text);
    }
}
