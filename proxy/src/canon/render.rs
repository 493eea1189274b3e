//! Prompt → prefix blocks. Where the backend's tokenizer is known (the bundled engine's always
//! is) the prompt is rendered with the shared chat template, tokenized and cut into blocks of
//! `block_size` tokens hashed chained, exactly as the engine keys its prefix cache; elsewhere
//! the rendered text is cut into fixed-size byte chunks, hashed the same way.
//!
//! Tokenizing a 60 KB agent prompt from scratch costs milliseconds, and agent loops resend
//! almost all of it every turn, so content is tokenized in chunks (cut where the tokenizer
//! always splits, see [`warmpath_wire::tokenizer::chunks`]) whose ids are cached by the
//! xxh3-128 of their bytes: a turn tokenizes only what it adds.

use std::sync::Arc;

use moka::sync::Cache;
use warmpath_wire::chat_template::Piece;
use warmpath_wire::prefix::{block_hash, block_hashes, root_hash, Blocks};
use warmpath_wire::tokenizer::{chunks, Tokenizer};
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

/// Smallest chunk whose ids are cached; most tool definitions and messages are one chunk.
const MIN_CHUNK: usize = 256;

/// Token-cache lookups of one prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lookups {
    pub hits: u64,
    pub misses: u64,
}

/// How one pool turns prompts into blocks.
#[derive(Debug)]
pub enum Encoder {
    Tokens { tok: Tokenizer, block_size: usize, cache: TokenCache },
    Bytes { chunk: usize },
}

impl Encoder {
    /// Blocks of a prompt given as its stable part and the rest.
    pub fn blocks(&self, stable: &[Piece], rest: &[Piece], salt: Option<&str>) -> Blocks {
        self.blocks_counted(stable, rest, salt, &mut Lookups::default())
    }

    /// [`Encoder::blocks`], counting token-cache lookups into `lookups`.
    pub fn blocks_counted(
        &self,
        stable: &[Piece],
        rest: &[Piece],
        salt: Option<&str>,
        lookups: &mut Lookups,
    ) -> Blocks {
        match self {
            Encoder::Tokens { tok, block_size, cache } => {
                let mut ids = Vec::new();
                for p in stable {
                    cache.encode_piece(tok, p, &mut ids, lookups);
                }
                let stable_len = ids.len();
                for p in rest {
                    cache.encode_piece(tok, p, &mut ids, lookups);
                }
                let hashes = block_hashes(&ids, *block_size, salt);
                let full = stable_len / block_size;
                let parent = if full == 0 { root_hash(salt) } else { hashes[full - 1] };
                let prefix_hash = block_hash(parent, &ids[full * block_size..stable_len], None);
                Blocks { hashes, prefix_hash, units: ids.len(), per_block: *block_size }
            }
            Encoder::Bytes { chunk } => {
                let mut text = Vec::new();
                for p in stable {
                    text.extend_from_slice(piece_text(p).as_bytes());
                }
                let stable_len = text.len();
                for p in rest {
                    text.extend_from_slice(piece_text(p).as_bytes());
                }
                let mut hashes = Vec::with_capacity(text.len() / chunk);
                let mut parent = root_hash(salt);
                for c in text.chunks_exact(*chunk) {
                    parent = bytes_hash(parent, c);
                    hashes.push(parent);
                }
                let full = stable_len / chunk;
                let parent = if full == 0 { root_hash(salt) } else { hashes[full - 1] };
                let prefix_hash = bytes_hash(parent, &text[full * chunk..stable_len]);
                Blocks { hashes, prefix_hash, units: text.len(), per_block: *chunk }
            }
        }
    }

    /// Blocks of a prompt given as token ids (`/v1/completions` accepts them).
    /// Token ids of prompt pieces through the chunk cache; `None` without a tokenizer.
    pub fn ids(&self, pieces: &[Piece]) -> Option<Vec<u32>> {
        let Encoder::Tokens { tok, cache, .. } = self else { return None };
        let mut ids = Vec::new();
        let mut n = Lookups::default();
        for p in pieces {
            cache.encode_piece(tok, p, &mut ids, &mut n);
        }
        Some(ids)
    }

    pub fn blocks_of_ids(&self, ids: &[u32], salt: Option<&str>) -> Blocks {
        let block_size = match self {
            Encoder::Tokens { block_size, .. } => *block_size,
            Encoder::Bytes { chunk } => (*chunk / 4).max(1),
        };
        let hashes = block_hashes(ids, block_size, salt);
        let full = ids.len() / block_size;
        let parent = if full == 0 { root_hash(salt) } else { hashes[full - 1] };
        Blocks {
            prefix_hash: block_hash(parent, &ids[full * block_size..], None),
            hashes,
            units: ids.len(),
            per_block: block_size,
        }
    }

    /// Units ([`Blocks::units`]) per block: tokens, or bytes without a tokenizer.
    pub fn block_units(&self) -> usize {
        match self {
            Encoder::Tokens { block_size, .. } => *block_size,
            Encoder::Bytes { chunk } => *chunk,
        }
    }

    /// Blocks are cut from the backends' own tokens (not estimated from bytes).
    pub fn exact_tokens(&self) -> bool {
        matches!(self, Encoder::Tokens { .. })
    }

    /// Units per token before the pool has learnt its own: 1 with a tokenizer, 4 bytes a token
    /// (English prose) without one.
    pub fn units_per_token_guess(&self) -> f64 {
        match self {
            Encoder::Tokens { .. } => 1.0,
            Encoder::Bytes { .. } => 4.0,
        }
    }

    pub fn cache(&self) -> Option<&TokenCache> {
        match self {
            Encoder::Tokens { cache, .. } => Some(cache),
            Encoder::Bytes { .. } => None,
        }
    }
}

fn piece_text(p: &Piece) -> &str {
    match p {
        Piece::Template(s) | Piece::Content(s) | Piece::Rendered(s) => s,
    }
}

fn bytes_hash(parent: u64, bytes: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(&parent.to_le_bytes());
    h.update(bytes);
    h.digest()
}

/// Token ids of recurring chunks, bounded in bytes.
#[derive(Debug)]
pub struct TokenCache {
    cache: Cache<u128, Arc<[u32]>>,
}

impl TokenCache {
    pub fn new(max_bytes: u64) -> TokenCache {
        let cache = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_, ids: &Arc<[u32]>| (ids.len() * 4 + 64) as u32)
            .build();
        TokenCache { cache }
    }

    /// Bytes held (moka's estimate, for the gauge).
    pub fn weighted_size(&self) -> u64 {
        self.cache.weighted_size()
    }

    fn encode_piece(&self, tok: &Tokenizer, p: &Piece, out: &mut Vec<u32>, n: &mut Lookups) {
        match p {
            // Template text holds special tokens and is never cut; it is short and recurs.
            Piece::Template(s) => self.encode_cached(s, 1, out, n, || tok.encode_with_special(s)),
            Piece::Content(s) => {
                for c in chunks(s, MIN_CHUNK) {
                    self.encode_cached(c, 0, out, n, || tok.encode(c));
                }
            }
            // A whole prompt from an external template: cut where this tokenizer allows.
            Piece::Rendered(s) => {
                let min = if tok.splits_lines() { MIN_CHUNK } else { usize::MAX };
                for c in chunks(s, min) {
                    self.encode_cached(c, 2, out, n, || tok.encode_with_special(c));
                }
            }
        }
    }

    fn encode_cached(
        &self,
        text: &str,
        tag: u128,
        out: &mut Vec<u32>,
        n: &mut Lookups,
        encode: impl FnOnce() -> Vec<u32>,
    ) {
        let key = xxh3_128(text.as_bytes()) ^ tag;
        if let Some(ids) = self.cache.get(&key) {
            n.hits += 1;
            out.extend_from_slice(&ids);
            return;
        }
        n.misses += 1;
        let ids: Arc<[u32]> = encode().into();
        out.extend_from_slice(&ids);
        self.cache.insert(key, ids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warmpath_wire::chat_template::{render_pieces, render_tokens};
    use warmpath_wire::openai::{ChatMessage, Role};

    fn tokens() -> Encoder {
        Encoder::Tokens { tok: Tokenizer::wp32k(), block_size: 16, cache: TokenCache::new(1 << 20) }
    }

    #[test]
    fn cached_chunked_tokens_equal_the_engine_render() {
        let long = "a line of words in the system prompt\n".repeat(40);
        let msgs = vec![
            ChatMessage::text(Role::System, long.clone()),
            ChatMessage::text(Role::User, "hello\n".repeat(100)),
        ];
        let tok = Tokenizer::wp32k();
        let expect = block_hashes(&render_tokens(&tok, &msgs, &[], true), 16, None);
        let enc = tokens();
        let pieces = render_pieces(&msgs, &[], true);
        let (stable, rest) = pieces.split_at(3);
        let mut n = Lookups::default();
        let first = enc.blocks_counted(stable, rest, None, &mut n);
        assert_eq!(first.hashes, expect);
        assert!(n.misses > 0 && n.hits > 0, "repeated lines recur within the prompt: {n:?}");
        let mut n = Lookups::default();
        let again = enc.blocks_counted(stable, rest, None, &mut n);
        assert_eq!(again, first);
        assert_eq!(n.misses, 0, "a repeated prompt is not tokenized again");
    }

    #[test]
    fn the_prefix_hash_covers_only_the_stable_part() {
        let enc = tokens();
        let sys = |s: &str| vec![Piece::Template("<|im_start|>system\n".into()), Piece::Content(s.into())];
        let rest = |s: &str| vec![Piece::Content(s.into())];
        let a = enc.blocks(&sys("stable"), &rest("one"), None);
        let b = enc.blocks(&sys("stable"), &rest("two"), None);
        let c = enc.blocks(&sys("other"), &rest("one"), None);
        assert_eq!(a.prefix_hash, b.prefix_hash);
        assert_ne!(a.prefix_hash, c.prefix_hash);
        let bytes = Encoder::Bytes { chunk: 4 };
        let a = bytes.blocks(&sys("stable"), &rest("one two three"), None);
        let b = bytes.blocks(&sys("stable"), &rest("one two four"), None);
        assert_eq!(a.prefix_hash, b.prefix_hash);
        assert_eq!(a.hashes[..7], b.hashes[..7]);
        assert_ne!(a.hashes, b.hashes);
    }
}
