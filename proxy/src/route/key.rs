//! Routing keys from a prepared request: the key of its leading prefix blocks (for
//! `prefix_hash`), its session key (for `session`), and its blocks (for `cache_aware`).

use std::borrow::Cow;

use warmpath_wire::prefix::Blocks;

use super::{Pool, RouteKey};
use crate::request::LlmRequest;

/// The routing key `pool`'s policy asks for, from the prompt's prefix blocks (computed where
/// the policy wants a prefix or blocks; moved into the key, not copied) and the session fields.
pub fn route_key(
    pool: &Pool,
    req: &LlmRequest<'_>,
    session_header: Option<&str>,
    blocks: Option<Blocks>,
) -> RouteKey {
    let prefix =
        blocks.as_ref().filter(|_| pool.policy.wants_prefix()).map(|b| prefix_key(b, pool.prefix_blocks));
    let session = pool
        .policy
        .wants_session()
        .then(|| {
            // A chained response goes where its predecessor is, whatever else names a session.
            if let Some(prev) = req.extra_str("previous_response_id").filter(|p| !p.is_empty()) {
                return Some(response_session(&prev));
            }
            let from_body = || req.extra_str("prompt_cache_key").or_else(|| req.extra_str("user"));
            session_key(session_header, from_body)
        })
        .flatten();
    let mut k = RouteKey { prefix, session, ..RouteKey::default() };
    if let Some(b) = blocks.filter(|_| pool.policy.wants_blocks()) {
        k.tokens = b.units;
        k.per_block = b.per_block;
        k.blocks = b.hashes;
    }
    k
}

/// The `prefix_hash` key: the chained key of the `n`-th block (of the last one when there
/// are fewer), which covers every token before it; the prefix hash when no block is full.
pub fn prefix_key(b: &Blocks, n: usize) -> u64 {
    match b.hashes.len().min(n) {
        0 => b.prefix_hash,
        k => b.hashes[k - 1],
    }
}

/// The session key of a conversation that continues response `id` (`previous_response_id`):
/// the backend that answered with `id` holds it (and, where it stores responses, is the only
/// one that can continue it).
pub fn response_session(id: &str) -> String {
    format!("response:{id}")
}

/// The sticky key: the `x-session-id` header, else what `from_body` finds (`prompt_cache_key`,
/// then `user`).
pub fn session_key<'a>(
    header: Option<&str>,
    from_body: impl FnOnce() -> Option<Cow<'a, str>>,
) -> Option<String> {
    if let Some(h) = header.filter(|h| !h.is_empty()) {
        return Some(h.to_owned());
    }
    from_body().filter(|s| !s.is_empty()).map(Cow::into_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_key_is_the_nth_block_or_the_prefix_hash() {
        let b = Blocks { hashes: vec![1, 2, 3], prefix_hash: 9, units: 50, per_block: 16 };
        assert_eq!(prefix_key(&b, 2), 2);
        assert_eq!(prefix_key(&b, 64), 3);
        assert_eq!(prefix_key(&Blocks { hashes: vec![], prefix_hash: 9, units: 5, per_block: 16 }, 64), 9);
    }

    #[test]
    fn session_key_order() {
        assert_eq!(session_key(Some("hdr"), || Some("pc".into())).as_deref(), Some("hdr"));
        assert_eq!(session_key(None, || Some("pc".into())).as_deref(), Some("pc"));
        assert_eq!(session_key(Some(""), || Some("u1".into())).as_deref(), Some("u1"));
        assert_eq!(session_key(None, || None), None);
        assert_eq!(session_key(None, || Some("".into())), None);
    }
}
