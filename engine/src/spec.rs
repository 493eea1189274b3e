//! Speculative decoding by n-gram prompt lookup (vLLM's `ngram` method): when the last `n`
//! tokens of a sequence (prompt and output together) occurred earlier in it, the tokens that
//! followed that earlier occurrence are proposed as the next ones. The scheduler appends them to
//! the sequence's step, the executor computes every position in one forward pass, and the
//! sampler keeps the proposal's prefix it agrees with plus one token of its own
//! ([`crate::sampler::Sampler::verify`]); the rejected positions' K/V is simply overwritten
//! later, since the sequence's computed length only counts accepted tokens.
//!
//! Proposals pay where outputs copy their context (tool-call arguments quoting the prompt, code
//! edits, JSON echoed back) and cost a wider step where they do not, so each sequence adapts
//! ([`Drafter`]): its proposal length follows what was accepted, and after proposals that were
//! rejected outright it waits a growing number of steps before proposing again.

use serde::Deserialize;

/// The server's speculative-decoding settings (vLLM's `--speculative-config` JSON, `ngram`
/// method).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecConfig {
    /// Only `ngram`.
    #[serde(default = "ngram")]
    pub method: String,
    /// Most tokens proposed per step.
    pub num_speculative_tokens: usize,
    /// Longest suffix looked up.
    #[serde(default = "default_max")]
    pub prompt_lookup_max: usize,
    /// Shortest suffix looked up (vLLM: equal to `prompt_lookup_max` when only that is given;
    /// here 2 unless set, since one repeated token says little about what follows).
    #[serde(default)]
    pub prompt_lookup_min: Option<usize>,
    /// No proposals while more sequences than this are running (a full batch already keeps the
    /// cores busy; verification rows would displace other sequences' work).
    #[serde(default)]
    pub disable_by_batch_size: Option<usize>,
}

fn ngram() -> String {
    "ngram".into()
}

fn default_max() -> usize {
    4
}

/// Most tokens one step may propose for a sequence.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

impl SpecConfig {
    /// Parses and checks vLLM's JSON form.
    pub fn parse(json: &str) -> anyhow::Result<SpecConfig> {
        let c: SpecConfig = serde_json::from_str(json)
            .map_err(|e| anyhow::anyhow!("--speculative-config: {e} (e.g. {{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}})"))?;
        c.check()?;
        Ok(c)
    }

    /// The settings a request asking for `k` proposed tokens gets on a server without any.
    pub fn with_tokens(k: usize) -> SpecConfig {
        SpecConfig {
            method: ngram(),
            num_speculative_tokens: k,
            prompt_lookup_max: default_max(),
            prompt_lookup_min: None,
            disable_by_batch_size: None,
        }
    }

    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.method == "ngram",
            "speculative method {:?}: only \"ngram\" is supported",
            self.method
        );
        anyhow::ensure!(
            (1..=MAX_SPECULATIVE_TOKENS).contains(&self.num_speculative_tokens),
            "num_speculative_tokens must be within 1..={MAX_SPECULATIVE_TOKENS}, got {}",
            self.num_speculative_tokens
        );
        anyhow::ensure!(
            (1..=self.prompt_lookup_max).contains(&self.lookup_min()),
            "prompt_lookup_min ({}) must be within 1..=prompt_lookup_max ({})",
            self.lookup_min(),
            self.prompt_lookup_max
        );
        Ok(())
    }

    pub fn lookup_min(&self) -> usize {
        self.prompt_lookup_min.unwrap_or(2.min(self.prompt_lookup_max))
    }
}

/// The tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
/// with a length in `min..=max`: at most `k` of them. Empty when no such suffix recurs.
pub fn propose(tokens: &[u32], min: usize, max: usize, k: usize) -> &[u32] {
    let len = tokens.len();
    if k == 0 || min == 0 {
        return &[];
    }
    for n in (min..=max.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // The occurrence must end before the suffix itself starts to propose anything new;
        // searching from the end finds the latest one.
        let found = (0..len - n).rev().find(|&start| &tokens[start..start + n] == suffix);
        if let Some(start) = found {
            let from = start + n;
            return &tokens[from..(from + k).min(len)];
        }
    }
    &[]
}

/// Longest wait, in steps, after proposals rejected outright.
const MAX_BACKOFF: u32 = 32;

/// One sequence's proposer: its settings and how its proposals have fared.
#[derive(Debug, Clone)]
pub struct Drafter {
    cfg: SpecConfig,
    /// Tokens to propose next time.
    k: usize,
    /// Steps left before proposing again.
    wait: u32,
    /// Wait after the next outright rejection.
    backoff: u32,
}

impl Drafter {
    pub fn new(cfg: SpecConfig) -> Drafter {
        Drafter { k: cfg.num_speculative_tokens, cfg, wait: 0, backoff: 1 }
    }

    pub fn config(&self) -> &SpecConfig {
        &self.cfg
    }

    /// Proposes up to `limit` tokens to follow `tokens`, unless this sequence is waiting.
    pub fn propose<'t>(&mut self, tokens: &'t [u32], limit: usize) -> &'t [u32] {
        if self.wait > 0 {
            self.wait -= 1;
            return &[];
        }
        propose(tokens, self.cfg.lookup_min(), self.cfg.prompt_lookup_max, self.k.min(limit))
    }

    /// Learns from a verification: `proposed` tokens of which the first `accepted` were kept.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        let max = self.cfg.num_speculative_tokens;
        if accepted == proposed {
            self.k = (self.k * 2).min(max);
            self.backoff = 1;
        } else if accepted == 0 {
            self.k = 1;
            self.wait = self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        } else {
            self.k = (accepted + 1).min(max);
            self.backoff = 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_occurrence_of_the_longest_suffix() {
        //             0  1  2  3  4  5  6  7  8  9 10
        let tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3];
        // "1 2 3" occurs at 0 and 5 (latest: 5, followed by 7 8 1 2 3).
        assert_eq!(propose(&tokens, 2, 3, 3), &[7, 8, 1]);
        assert_eq!(propose(&tokens, 2, 3, 10), &[7, 8, 1, 2, 3]);
        // The longest suffix wins over a later shorter one: "2 3" alone gives the same place here;
        // with max 1, "3" also recurs latest at 7.
        assert_eq!(propose(&tokens, 1, 1, 2), &[7, 8]);
        // Nothing recurs.
        assert!(propose(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        assert!(propose(&[5], 1, 3, 4).is_empty());
        assert!(propose(&tokens, 2, 3, 0).is_empty());
    }

    #[test]
    fn a_longer_match_is_preferred_to_a_later_shorter_one() {
        // Suffix "4 5 6": a 3-gram at 0 (followed by 100), the 2-gram "5 6" again at 5 (followed by 200).
        let tokens = [4, 5, 6, 100, 0, 5, 6, 200, 4, 5, 6];
        assert_eq!(propose(&tokens, 2, 3, 1), &[100]);
        assert_eq!(propose(&tokens, 2, 2, 1), &[200]);
    }

    #[test]
    fn config_parses_vllm_json_and_refuses_nonsense() {
        let c =
            SpecConfig::parse(r#"{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}"#)
                .expect("valid");
        assert_eq!((c.num_speculative_tokens, c.prompt_lookup_max, c.lookup_min()), (5, 4, 2));
        for bad in [
            r#"{"method": "eagle", "num_speculative_tokens": 5}"#,
            r#"{"num_speculative_tokens": 0}"#,
            r#"{"num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 4}"#,
            r#"{"num_speculative_tokens": 4, "model": "x"}"#,
            "not json",
        ] {
            assert!(SpecConfig::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_drafter_adapts_to_what_is_accepted() {
        let mut d = Drafter::new(SpecConfig::with_tokens(8));
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2];
        assert_eq!(d.propose(&tokens, 100).len(), 8);
        d.record(8, 2);
        assert_eq!(d.propose(&tokens, 100).len(), 3);
        d.record(3, 3);
        assert_eq!(d.propose(&tokens, 100).len(), 6);
        assert_eq!(d.propose(&tokens, 2).len(), 2, "a limit caps the proposal");
        // Outright rejections: a wait of 1, then 2, then 4 steps.
        for wait in [1, 2, 4] {
            d.record(6, 0);
            for _ in 0..wait {
                assert!(d.propose(&tokens, 100).is_empty());
            }
            assert_eq!(d.propose(&tokens, 100).len(), 1);
        }
        d.record(1, 1);
        assert_eq!(d.propose(&tokens, 100).len(), 2);
        d.record(2, 0);
        assert!(d.propose(&tokens, 100).is_empty(), "an acceptance reset the wait to one step");
        assert_eq!(d.propose(&tokens, 100).len(), 1);
    }
}
