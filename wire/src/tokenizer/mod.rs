//! Tokenizers: the built-in `wp32k`, and those a model's files carry — byte-level BPE
//! (`tokenizer.json`, GGUF `gpt2`) and SentencePiece BPE with byte fallback (GGUF `llama`,
//! `tokenizer.json` with `byte_fallback`, in [`spm`]). The proxy and the engine both tokenize
//! through this one implementation.
//!
//! `wp32k` is a 32,000-id byte-level BPE that needs no download.
//!
//! It is cl100k_base (embedded in the `tiktoken-rs` crate) cut to its first 31,992 merges, plus
//! eight special tokens at the top of the id range. Cutting a BPE rank table keeps a valid BPE:
//! every merge only ever produces tokens of lower rank than the ones it needs, and the 256 single
//! bytes come first, so any byte string still encodes. 32,000 ids match the llama2.c model
//! shapes the engine uses, so a token id is always a valid row of the embedding table.

mod byte_level;
mod gguf;
mod hf;
mod spm;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use tiktoken_rs::{CoreBPE, Rank};

/// Number of `wp32k` ids, special tokens included.
pub const VOCAB_SIZE: usize = 32_000;
/// Number of ordinary (BPE) ids of `wp32k`; special tokens follow them.
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

/// Errors of loading, encoding or decoding.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("token id {0} is outside the vocabulary")]
    UnknownId(u32),
    #[error("building the tokenizer failed: {0}")]
    Build(String),
    #[error("{0}")]
    Unsupported(String),
}

/// A cheap-to-clone handle on a tokenizer: the built-in `wp32k`, or one loaded from a Hugging
/// Face `tokenizer.json` ([`Tokenizer::from_file`]) or a GGUF file ([`Tokenizer::from_gguf`]).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    model: Model,
    /// Special (added) tokens and their ids, longest first so the longest match wins.
    specials: Vec<(String, u32)>,
    /// Ids of `specials`, sorted.
    special_ids: Vec<u32>,
    /// First bytes of the special tokens: a quick test before matching.
    special_starts: [bool; 256],
    vocab_size: usize,
    /// The pre-tokenizer always splits after a newline followed by a non-space (see [`chunks`]).
    splits_lines: bool,
}

/// How ordinary text becomes ids. One per tokenizer, behind its `Arc`: the variants' sizes
/// do not matter.
#[allow(clippy::large_enum_variant)]
enum Model {
    /// Byte-level BPE, on tiktoken's merge loop.
    Bpe(Bpe),
    /// SentencePiece BPE with byte fallback.
    Spm(spm::Spm),
}

struct Bpe {
    /// BPE over ranks; its special-token table is used for decoding only.
    bpe: CoreBPE,
    /// Rank → id where the file's ids are not the BPE ranks (`wp32k`: they are).
    ids: Option<Vec<u32>>,
    /// Id → rank, the inverse of `ids`.
    ranks: Option<HashMap<u32, Rank>>,
    /// Unicode NFC before splitting (the file's normalizer).
    nfc: bool,
    /// Every digit is its own piece before the pattern splits the rest (SmolLM).
    digits: bool,
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

    /// Loads a Hugging Face `tokenizer.json` of a byte-level BPE model (GPT-2, Llama 3, Qwen 2,
    /// Mistral's tekken and most current models); see the `hf` module for what is accepted.
    pub fn from_file(path: &std::path::Path) -> Result<Tokenizer, TokenizerError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| TokenizerError::Build(format!("cannot read {}: {e}", path.display())))?;
        Self::from_json(&path.display().to_string(), &text)
    }

    /// [`Tokenizer::from_file`] on the file's text; `name` names it in logs.
    pub fn from_json(name: &str, json: &str) -> Result<Tokenizer, TokenizerError> {
        hf::load(name, json)
    }

    /// The tokenizer a GGUF model file carries in its metadata (`tokenizer.ggml.*`); see the
    /// `gguf` module for what is accepted.
    pub fn from_gguf(name: &str, file: &crate::gguf::Gguf) -> Result<Tokenizer, TokenizerError> {
        gguf::load(name, file)
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
        let specials: Vec<(String, u32)> =
            SPECIALS.iter().enumerate().map(|(i, s)| (s.to_string(), BPE_RANKS + i as u32)).collect();
        Parts {
            name: "wp32k".into(),
            encoder,
            specials,
            ids: None,
            vocab_size: VOCAB_SIZE,
            pattern: CL100K_PATTERN,
            digits: false,
            nfc: false,
            splits_lines: true,
        }
        .assemble()
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// Whether [`chunks`] may cut text for this tokenizer: its pre-tokenizer always splits
    /// after a newline that a non-space follows (true of `wp32k` and of the GPT-2, cl100k /
    /// Llama 3 and Qwen 2 patterns; false for any other pattern, which is then encoded whole).
    pub fn splits_lines(&self) -> bool {
        self.inner.splits_lines
    }

    /// Whether encoding `text` (specials included) in two parts cut at byte `at` surely gives
    /// the ids of encoding it whole: at a special token's edge, or after a newline that a
    /// non-space follows where [`Tokenizer::splits_lines`].
    pub fn splits_at(&self, text: &str, at: usize) -> bool {
        if at == 0 || at >= text.len() {
            return true;
        }
        if !text.is_char_boundary(at) {
            return false;
        }
        let (a, b) = text.split_at(at);
        let special_edge =
            self.inner.specials.iter().any(|(s, _)| a.ends_with(s.as_str()) || b.starts_with(s.as_str()));
        special_edge
            || (self.splits_lines()
                && a.ends_with('\n')
                && b.chars().next().is_some_and(|c| !c.is_whitespace()))
    }

    /// Encodes text in which special-token strings are plain text (user content).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_ordinary(text, true)
    }

    /// [`Tokenizer::encode`] of a stretch of text that starts the input (`first`) or follows a
    /// special token: SentencePiece models may put a `▁` in front of the first only.
    fn encode_ordinary(&self, text: &str, first: bool) -> Vec<u32> {
        match &self.inner.model {
            Model::Bpe(b) => b.encode(text),
            Model::Spm(m) => {
                let mut out = Vec::with_capacity(text.len() / 3);
                m.encode(text, first, &mut out);
                out
            }
        }
    }

    /// Encodes text in which special-token strings are the special tokens (rendered
    /// templates): each leftmost, longest special is its id, the text between is [`encode`]d.
    ///
    /// [`encode`]: Tokenizer::encode
    pub fn encode_with_special(&self, text: &str) -> Vec<u32> {
        let i = &self.inner;
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let (mut from, mut at) = (0, 0);
        while at < bytes.len() {
            if i.special_starts[bytes[at] as usize] {
                if let Some((s, id)) = i.specials.iter().find(|(s, _)| bytes[at..].starts_with(s.as_bytes()))
                {
                    if from < at {
                        out.extend(self.encode_ordinary(&text[from..at], from == 0));
                    }
                    out.push(*id);
                    at += s.len();
                    from = at;
                    continue;
                }
            }
            at += 1;
        }
        if from < bytes.len() {
            out.extend(self.encode_ordinary(&text[from..], from == 0));
        }
        out
    }

    /// The id of a special token such as [`EOS`].
    pub fn special_id(&self, token: &str) -> Option<u32> {
        self.inner.specials.iter().find(|(s, _)| s == token).map(|(_, id)| *id)
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.inner.special_ids.binary_search(&id).is_ok()
    }

    /// The bytes of `ids` (special tokens as their strings).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        let i = &self.inner;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= i.vocab_size) {
            return Err(TokenizerError::UnknownId(*bad));
        }
        match &i.model {
            Model::Bpe(b) => b.decode_bytes(ids),
            Model::Spm(m) => {
                let mut out = Vec::with_capacity(ids.len() * 4);
                for &id in ids {
                    out.extend_from_slice(m.piece(id).ok_or(TokenizerError::UnknownId(id))?);
                }
                Ok(out)
            }
        }
    }

    /// Text of `ids`; invalid UTF-8 (a multi-byte character cut between ids) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }
}

/// What a tokenizer is made of, before it is assembled.
struct Parts<'a> {
    name: String,
    /// Ordinary token bytes → rank (merge order: a merge only yields a higher rank).
    encoder: std::collections::HashMap<Vec<u8>, Rank>,
    /// Special tokens → id.
    specials: Vec<(String, u32)>,
    /// Rank → id; `None` when they are equal. Special tokens take the ranks after the
    /// ordinary ones, in `specials` order.
    ids: Option<Vec<u32>>,
    vocab_size: usize,
    pattern: &'a str,
    digits: bool,
    nfc: bool,
    splits_lines: bool,
}

impl Parts<'_> {
    fn assemble(self) -> Result<Tokenizer, TokenizerError> {
        let ordinary = self.encoder.len() as Rank;
        let special_encoder = self
            .specials
            .iter()
            .enumerate()
            .map(|(k, (s, id))| (s.clone(), if self.ids.is_some() { ordinary + k as Rank } else { *id }))
            .collect();
        let encoder = self.encoder.into_iter().collect();
        let bpe = CoreBPE::new(encoder, special_encoder, self.pattern)
            .map_err(|e| TokenizerError::Build(format!("pre-tokenizer pattern: {e}")))?;
        let ranks =
            self.ids.as_ref().map(|ids| ids.iter().enumerate().map(|(r, id)| (*id, r as Rank)).collect());
        let model = Model::Bpe(Bpe { bpe, ids: self.ids, ranks, nfc: self.nfc, digits: self.digits });
        Ok(Tokenizer::assemble(self.name, model, self.specials, self.vocab_size, self.splits_lines))
    }
}

impl Tokenizer {
    /// The handle on a model and its special tokens.
    fn assemble(
        name: String,
        model: Model,
        mut specials: Vec<(String, u32)>,
        vocab_size: usize,
        splits_lines: bool,
    ) -> Tokenizer {
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(&b.0)));
        let mut special_ids: Vec<u32> = specials.iter().map(|(_, id)| *id).collect();
        special_ids.sort_unstable();
        let mut special_starts = [false; 256];
        for (s, _) in &specials {
            if let Some(&b) = s.as_bytes().first() {
                special_starts[b as usize] = true;
            }
        }
        Tokenizer {
            inner: Arc::new(Inner {
                name,
                model,
                specials,
                special_ids,
                special_starts,
                vocab_size,
                splits_lines,
            }),
        }
    }
}

impl Bpe {
    fn encode(&self, text: &str) -> Vec<u32> {
        let mut ranks = if self.nfc && !text.is_ascii() {
            use unicode_normalization::UnicodeNormalization;
            self.encode_pieces(&text.nfc().collect::<String>())
        } else {
            self.encode_pieces(text)
        };
        if let Some(ids) = &self.ids {
            for r in &mut ranks {
                *r = ids[*r as usize];
            }
            ranks.retain(|&id| id != byte_level::DROPPED);
        }
        ranks
    }

    /// Ranks of `text`: each digit alone first where the pre-tokenizer cuts them out, the pieces
    /// between split by the pattern.
    fn encode_pieces(&self, text: &str) -> Vec<Rank> {
        let bpe = &self.bpe;
        if !self.digits {
            return bpe.encode_ordinary(text);
        }
        let mut out = Vec::new();
        let mut from = 0;
        for (at, c) in text.char_indices().filter(|(_, c)| c.is_numeric()) {
            if from < at {
                out.extend(bpe.encode_ordinary(&text[from..at]));
            }
            let end = at + c.len_utf8();
            out.extend(bpe.encode_ordinary(&text[at..end]));
            from = end;
        }
        if from < text.len() {
            out.extend(bpe.encode_ordinary(&text[from..]));
        }
        out
    }

    fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        match &self.ranks {
            None => self.bpe.decode_bytes(ids as &[Rank]).map_err(|e| TokenizerError::UnknownId(e.token)),
            Some(ranks) => {
                let rs: Vec<Rank> = ids
                    .iter()
                    .map(|id| ranks.get(id).copied().ok_or(TokenizerError::UnknownId(*id)))
                    .collect::<Result<_, _>>()?;
                self.bpe.decode_bytes(&rs).map_err(|e| TokenizerError::UnknownId(e.token))
            }
        }
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
