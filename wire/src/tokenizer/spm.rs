//! SentencePiece BPE with byte fallback: the `llama` tokenizer of GGUF files (Llama 1 and 2,
//! Mistral 7B, Phi-3, TinyLlama and their fine-tunes) and the `tokenizer.json` of the same models
//! (a `BPE` model with `byte_fallback`).
//!
//! Text becomes one string of characters in which every space is `▁` (U+2581), with a `▁` put in
//! front where the file asks (llama.cpp's `add_space_prefix`, the `tokenizers` library's
//! `Prepend` normalizer or `Metaspace` pre-tokenizer) — at the start and after every special
//! token, or (`Prefix::First`) at the start only. The pieces start as single characters; the
//! adjacent pair with the best priority merges, leftmost first among equals, until no pair can.
//! The priority is, for a GGUF file, the score of the token the two pieces concatenate to (any
//! ordinary token), and for a `tokenizer.json`, the pair's place in the merge list (listed pairs
//! only). A piece that is no token becomes the `<0xXX>` tokens of its UTF-8 bytes (byte
//! fallback), else the unknown token. The work is a heap of candidate pairs, as in
//! SentencePiece and llama.cpp: O(n log n) in the text's characters, and the text is not
//! pre-split (no merge crosses a special token, nothing else cuts it).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::TokenizerError;

/// SentencePiece's stand-in for a space.
pub(super) const SPACE: char = '\u{2581}';

/// Where a `▁` is put in front of text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Prefix {
    /// At the start of the text and of every stretch that follows a special token.
    Always,
    /// At the start of the text only.
    First,
    Never,
}

/// How two adjacent pieces merge.
pub(super) enum Merges {
    /// Pieces merge when their concatenation is an ordinary token; the token's score is the
    /// priority, higher first (GGUF `tokenizer.ggml.scores`).
    Scores(Vec<f32>),
    /// Only listed pairs merge, earlier in the list first (`tokenizer.json` `merges`).
    Pairs(Vec<(String, String)>),
}

/// A vocabulary as a file gives it.
pub(super) struct SpmVocab {
    /// Every token's text by id (`▁` for spaces, `<0xXX>` for byte tokens).
    pub tokens: Vec<String>,
    /// Ids of the tokens that pieces may become: ordinary ones, not control, byte or unused
    /// tokens.
    pub ordinary: Vec<bool>,
    pub merges: Merges,
    pub unk: Option<u32>,
    pub prefix: Prefix,
    /// Cut before every `▁` before merging (`Metaspace` with `split`).
    pub split_words: bool,
    /// No `▁` in front of text that starts with one already (`Metaspace`; llama.cpp and the
    /// `Prepend` normalizer always put one).
    pub prefix_unless_spaced: bool,
}

/// The loaded tokenizer.
pub(super) struct Spm {
    /// Ordinary token text → id.
    vocab: HashMap<String, u32>,
    /// Id → the bytes it decodes to.
    pieces: Vec<Vec<u8>>,
    scores: Option<Vec<f32>>,
    /// (left id, right id) → (rank, merged id), for [`Merges::Pairs`].
    pairs: HashMap<(u32, u32), (u32, u32)>,
    bytes: [Option<u32>; 256],
    unk: Option<u32>,
    prefix: Prefix,
    split_words: bool,
    prefix_unless_spaced: bool,
}

/// `<0x0A>` → 0x0A.
fn byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}

impl Spm {
    pub fn new(v: SpmVocab) -> Result<Spm, TokenizerError> {
        if v.ordinary.len() != v.tokens.len() {
            return Err(TokenizerError::Build("token kinds do not match the tokens".into()));
        }
        let mut bytes = [None; 256];
        let mut pieces = Vec::with_capacity(v.tokens.len());
        let mut vocab = HashMap::with_capacity(v.tokens.len());
        for (id, t) in v.tokens.iter().enumerate() {
            let id = id as u32;
            match byte_token(t) {
                Some(b) => {
                    bytes[b as usize].get_or_insert(id);
                    pieces.push(vec![b]);
                }
                None => {
                    pieces.push(t.replace(SPACE, " ").into_bytes());
                    // The last of equal texts wins, as in llama.cpp's token table.
                    if v.ordinary[id as usize] {
                        vocab.insert(t.clone(), id);
                    }
                }
            }
        }
        let (scores, pairs) = match v.merges {
            Merges::Scores(s) => {
                if s.len() != v.tokens.len() {
                    return Err(TokenizerError::Build(format!(
                        "{} scores for {} tokens",
                        s.len(),
                        v.tokens.len()
                    )));
                }
                (Some(s), HashMap::new())
            }
            Merges::Pairs(list) => {
                let mut pairs = HashMap::with_capacity(list.len());
                for (rank, (a, b)) in list.iter().enumerate() {
                    let id = |t: &str| {
                        vocab.get(t).copied().ok_or_else(|| {
                            TokenizerError::Unsupported(format!(
                                "merge {rank} ({a:?} {b:?}): {t:?} is no token"
                            ))
                        })
                    };
                    let merged = id(&format!("{a}{b}"))?;
                    pairs.entry((id(a)?, id(b)?)).or_insert((rank as u32, merged));
                }
                (None, pairs)
            }
        };
        Ok(Spm {
            vocab,
            pieces,
            scores,
            pairs,
            bytes,
            unk: v.unk,
            prefix: v.prefix,
            split_words: v.split_words,
            prefix_unless_spaced: v.prefix_unless_spaced,
        })
    }

    /// The bytes of token `id`, `None` outside the vocabulary.
    pub fn piece(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize).map(Vec::as_slice)
    }

    /// Appends the ids of `text` (no special tokens in it); `first` says whether the text starts
    /// the whole input (else it follows a special token).
    pub fn encode(&self, text: &str, first: bool, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let prefix = match self.prefix {
            Prefix::Always => true,
            Prefix::First => first,
            Prefix::Never => false,
        } && !(self.prefix_unless_spaced && text.starts_with([' ', SPACE]));
        let mut s = String::with_capacity(text.len() + 3 + text.matches(' ').count() * 2);
        if prefix {
            s.push(SPACE);
        }
        s.extend(text.chars().map(|c| if c == ' ' { SPACE } else { c }));
        if !self.split_words {
            return self.encode_word(&s, out);
        }
        let mut from = 0;
        for (at, _) in s.match_indices(SPACE) {
            if at > from {
                self.encode_word(&s[from..at], out);
                from = at;
            }
        }
        self.encode_word(&s[from..], out);
    }

    /// Merges the characters of `s` into tokens.
    fn encode_word(&self, s: &str, out: &mut Vec<u32>) {
        let mut syms: Vec<Sym> = s
            .char_indices()
            .enumerate()
            .map(|(k, (at, c))| Sym {
                start: at,
                end: at + c.len_utf8(),
                prev: k.checked_sub(1),
                next: Some(k + 1),
                id: self.vocab.get(&s[at..at + c.len_utf8()]).copied(),
            })
            .collect();
        if let Some(last) = syms.last_mut() {
            last.next = None;
        }
        let mut heap = BinaryHeap::with_capacity(syms.len());
        for k in 1..syms.len() {
            self.push_pair(s, &syms, k - 1, k, &mut heap);
        }
        while let Some(p) = heap.pop() {
            let (l, r) = (&syms[p.left], &syms[p.right]);
            // Stale: one side was merged away or grew since the pair was pushed.
            if l.start == l.end || r.start == r.end || l.next != Some(p.right) || r.end - l.start != p.len {
                continue;
            }
            let (next, end) = (syms[p.right].next, syms[p.right].end);
            let left = &mut syms[p.left];
            left.end = end;
            left.next = next;
            left.id = Some(p.id);
            let right = &mut syms[p.right];
            right.start = right.end;
            if let Some(n) = next {
                syms[n].prev = Some(p.left);
            }
            if let Some(prev) = syms[p.left].prev {
                self.push_pair(s, &syms, prev, p.left, &mut heap);
            }
            if let Some(n) = next {
                self.push_pair(s, &syms, p.left, n, &mut heap);
            }
        }
        let mut at = (!syms.is_empty()).then_some(0);
        while let Some(k) = at {
            let sym = &syms[k];
            match sym.id {
                Some(id) => out.push(id),
                None => {
                    for b in s[sym.start..sym.end].bytes() {
                        // A byte with no token is the unknown token, or left out without one.
                        if let Some(id) = self.bytes[b as usize].or(self.unk) {
                            out.push(id);
                        }
                    }
                }
            }
            at = sym.next;
        }
    }

    fn push_pair(&self, s: &str, syms: &[Sym], left: usize, right: usize, heap: &mut BinaryHeap<Pair>) {
        let (l, r) = (&syms[left], &syms[right]);
        let len = r.end - l.start;
        let found = match &self.scores {
            Some(scores) => {
                self.vocab.get(&s[l.start..r.end]).map(|&id| (f64::from(scores[id as usize]), id))
            }
            None => match (l.id, r.id) {
                (Some(a), Some(b)) => self.pairs.get(&(a, b)).map(|&(rank, id)| (-f64::from(rank), id)),
                _ => None,
            },
        };
        if let Some((priority, id)) = found {
            heap.push(Pair { priority, left, right, len, id });
        }
    }
}

/// A piece of the text being merged: a doubly linked list over the characters.
struct Sym {
    start: usize,
    end: usize,
    prev: Option<usize>,
    next: Option<usize>,
    /// The token this piece is, if it is one.
    id: Option<u32>,
}

/// A candidate merge of two adjacent pieces.
struct Pair {
    priority: f64,
    left: usize,
    right: usize,
    /// Bytes the two cover together: a later merge of either makes the pair stale.
    len: usize,
    /// The merged token.
    id: u32,
}

impl Ord for Pair {
    /// Higher priority first, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.priority.total_cmp(&other.priority).then(other.left.cmp(&self.left))
    }
}

impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Pair {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary small enough to follow by hand.
    fn tiny(merges: Merges, prefix: Prefix) -> Spm {
        let tokens: Vec<String> =
            ["<unk>", "<s>", "<0x0A>", "<0xC3>", "<0xA9>", "▁", "a", "b", "▁a", "ab", "▁ab", "bb"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        let ordinary = tokens.iter().map(|t| !t.starts_with('<')).collect();
        let v = SpmVocab {
            tokens,
            ordinary,
            merges,
            unk: Some(0),
            prefix,
            split_words: false,
            prefix_unless_spaced: false,
        };
        Spm::new(v).expect("builds")
    }

    fn ids(t: &Spm, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        t.encode(text, true, &mut out);
        out
    }

    #[test]
    fn merges_by_score_then_leftmost() {
        // Scores: "▁a" beats "ab", so "▁ab" is reached through "▁a" + "b".
        let scores = vec![0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -5.0];
        let t = tiny(Merges::Scores(scores), Prefix::Always);
        assert_eq!(ids(&t, "ab"), [10]);
        // "bbb": both pairs tie, the leftmost merges: "bb" + "b".
        assert_eq!(ids(&t, "bbb"), [5, 11, 7]);
        // Unknown characters fall back to their bytes; a newline is its byte token.
        assert_eq!(ids(&t, "é\n"), [5, 3, 4, 2]);
        assert_eq!(ids(&t, ""), Vec::<u32>::new());
        assert_eq!(t.piece(8), Some(&b" a"[..]));
        assert_eq!(t.piece(2), Some(&b"\n"[..]));
    }

    #[test]
    fn merges_listed_pairs_in_list_order() {
        let pairs = [("a", "b"), ("▁", "ab"), ("▁", "a")];
        let list = pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
        let t = tiny(Merges::Pairs(list), Prefix::Never);
        // Not listed: "bb" is never formed, though it is a token.
        assert_eq!(ids(&t, "bb"), [7, 7]);
        assert_eq!(ids(&t, " ab"), [10]);
        // An unknown byte with no byte token is the unknown token.
        assert_eq!(ids(&t, "c"), [0]);
    }

    #[test]
    fn long_text_merges_in_n_log_n() {
        let scores = vec![0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -5.0];
        let t = tiny(Merges::Scores(scores), Prefix::First);
        let text = "ab ".repeat(20_000);
        let got = ids(&t, &text);
        assert_eq!(got.len(), 20_001);
        assert!(got[..20_000].iter().all(|&id| id == 10));
    }
}
