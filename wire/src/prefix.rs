//! Prefix block hashing: the cache key of a block of `block_size` token ids is a hash of its
//! parent's key and its own tokens, so equal keys mean equal whole prefixes (vLLM v1's scheme).
//!
//! Only full blocks get a key. The engine's block pool and the proxy's routers both call
//! [`block_hashes`], which is what lets a router predict an engine's cache hits.

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// A block's cache key.
pub type BlockHash = u64;

/// A prompt cut into blocks: what routing keys on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Blocks {
    /// Chained keys of the full blocks.
    pub hashes: Vec<BlockHash>,
    /// Chained key of the stable prefix (the leading system turn, with the tool block), its
    /// last partial block included: equal for requests whose stable prefixes are equal.
    pub prefix_hash: u64,
    /// Tokens (or bytes, where the tokenizer is not known) of the whole prompt.
    pub units: usize,
    /// Units per block.
    pub per_block: usize,
}

/// The parent key of the first block when no `cache_salt` is given.
pub const NONE_HASH: BlockHash = 0x7761_726d_7061_7468; // "warmpath"

/// The key of one block: xxh3-64 over the parent key, the token ids (little-endian u32) and,
/// when given, extra key bytes (LoRA name, multimodal ids).
pub fn block_hash(parent: BlockHash, tokens: &[u32], extra: Option<&[u8]>) -> BlockHash {
    const MAX: usize = 64;
    if extra.is_none() && tokens.len() <= MAX {
        // The same bytes in one shot: the streaming state costs more than the hashing.
        let mut buf = [0u8; 8 + 4 * MAX];
        buf[..8].copy_from_slice(&parent.to_le_bytes());
        for (i, t) in tokens.iter().enumerate() {
            buf[8 + 4 * i..12 + 4 * i].copy_from_slice(&t.to_le_bytes());
        }
        return xxh3_64(&buf[..8 + 4 * tokens.len()]);
    }
    let mut h = Xxh3::new();
    h.update(&parent.to_le_bytes());
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    if let Some(extra) = extra {
        h.update(&(extra.len() as u64).to_le_bytes());
        h.update(extra);
    }
    h.digest()
}

/// The parent key of the first block: [`NONE_HASH`], or a key derived from a `cache_salt`
/// so that requests with different salts never share blocks.
pub fn root_hash(cache_salt: Option<&str>) -> BlockHash {
    match cache_salt {
        None => NONE_HASH,
        Some(salt) => block_hash(NONE_HASH, &[], Some(salt.as_bytes())),
    }
}

/// Keys of every full block of `tokens`, in order, each chained to the one before.
pub fn block_hashes(tokens: &[u32], block_size: usize, cache_salt: Option<&str>) -> Vec<BlockHash> {
    let mut hashes = Vec::with_capacity(tokens.len() / block_size.max(1));
    extend_block_hashes(&mut hashes, tokens, block_size, cache_salt);
    hashes
}

/// Extends `hashes` (the keys of the first `hashes.len()` full blocks of `tokens`) with the keys
/// of the blocks that became full since. Lets a growing sequence hash only its new blocks.
pub fn extend_block_hashes(
    hashes: &mut Vec<BlockHash>,
    tokens: &[u32],
    block_size: usize,
    cache_salt: Option<&str>,
) {
    assert!(block_size > 0, "block_size must be positive");
    let full = tokens.len() / block_size;
    let mut parent = hashes.last().copied().unwrap_or_else(|| root_hash(cache_salt));
    for i in hashes.len()..full {
        parent = block_hash(parent, &tokens[i * block_size..(i + 1) * block_size], None);
        hashes.push(parent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_full_blocks_are_hashed() {
        let toks: Vec<u32> = (0..40).collect();
        assert_eq!(block_hashes(&toks, 16, None).len(), 2);
        assert_eq!(block_hashes(&toks[..15], 16, None).len(), 0);
    }

    #[test]
    fn keys_chain_over_the_whole_prefix() {
        let a: Vec<u32> = (0..32).collect();
        let mut b = a.clone();
        b[0] = 999; // differs only in the first block
        let ha = block_hashes(&a, 16, None);
        let hb = block_hashes(&b, 16, None);
        assert_ne!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1], "second block's key must depend on the first block");
        assert_eq!(ha, block_hashes(&a, 16, None), "stable");
    }

    #[test]
    fn one_shot_and_streaming_keys_agree() {
        let toks: Vec<u32> = (0..16).map(|i| i * 977).collect();
        let mut h = Xxh3::new();
        h.update(&NONE_HASH.to_le_bytes());
        toks.iter().for_each(|t| h.update(&t.to_le_bytes()));
        assert_eq!(block_hash(NONE_HASH, &toks, None), h.digest());
        let long: Vec<u32> = (0..100).collect();
        let mut h = Xxh3::new();
        h.update(&1u64.to_le_bytes());
        long.iter().for_each(|t| h.update(&t.to_le_bytes()));
        assert_eq!(block_hash(1, &long, None), h.digest());
    }

    #[test]
    fn salt_separates_tenants() {
        let a: Vec<u32> = (0..16).collect();
        assert_ne!(block_hashes(&a, 16, Some("t1")), block_hashes(&a, 16, Some("t2")));
        assert_ne!(block_hashes(&a, 16, Some("t1")), block_hashes(&a, 16, None));
    }

    #[test]
    fn extending_equals_hashing_from_scratch() {
        let toks: Vec<u32> = (0..100).map(|i| i * 7 % 13).collect();
        let mut h = block_hashes(&toks[..37], 16, None);
        extend_block_hashes(&mut h, &toks, 16, None);
        assert_eq!(h, block_hashes(&toks, 16, None));
    }
}
