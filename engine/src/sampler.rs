//! Token sampling: greedy, or seeded temperature + top-p, one RNG per request so that a seed
//! gives the same output whatever else is in the batch.

/// SplitMix64: tiny, fast, and stable across versions (the reproducibility of a seed must not
/// depend on a dependency's release).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Most alternatives a request may ask log-probabilities for (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A generated token's log-probability under the model (its raw distribution, before
/// temperature and top-p, as vLLM reports by default), and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// (token, log-probability), most likely first.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// `token`'s log-probability in `logits` and the `top` most likely tokens'.
    pub fn of(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
        let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
        if top > 0 {
            for (i, &l) in logits.iter().enumerate() {
                if best.len() < top || l > best[best.len() - 1].1 {
                    let at = best.partition_point(|b| b.1 >= l);
                    best.insert(at, (i as u32, l));
                    best.truncate(top);
                }
            }
        }
        let logprob = logits.get(token as usize).map_or(f32::NEG_INFINITY, |l| l - lse);
        TokenLogprobs { logprob, top: best.into_iter().map(|(i, l)| (i, l - lse)).collect() }
    }
}

/// How one request picks its tokens.
#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f32,
    top_p: f32,
    rng: Rng,
    /// Alternatives per token whose log-probabilities are kept (`None`: none kept at all).
    logprobs: Option<usize>,
    /// Log-probabilities of the tokens the last verification picked, in order.
    picked: std::collections::VecDeque<TokenLogprobs>,
}

impl Sampler {
    /// `temperature` ≤ 1e-5 means greedy. `seed` None draws a fresh one.
    pub fn new(temperature: f32, top_p: f32, seed: Option<u64>) -> Sampler {
        let seed = seed.unwrap_or_else(fresh_seed);
        Sampler {
            temperature,
            top_p: top_p.clamp(f32::MIN_POSITIVE, 1.0),
            rng: Rng::new(seed),
            logprobs: None,
            picked: Default::default(),
        }
    }

    /// Keeps each picked token's log-probability and those of its `top` likeliest alternatives.
    pub fn with_logprobs(mut self, top: Option<usize>) -> Sampler {
        self.logprobs = top.map(|t| t.min(MAX_TOP_LOGPROBS));
        self
    }

    /// The log-probabilities of the next token the last verification picked (in order; `None`
    /// where the request did not ask for them).
    pub fn take_logprobs(&mut self) -> Option<TokenLogprobs> {
        self.picked.pop_front()
    }

    /// The raw row, kept before sampling overwrites it, where log-probabilities are asked for.
    fn raw(&self, row: &[f32]) -> Option<Vec<f32>> {
        self.logprobs.map(|_| row.to_vec())
    }

    fn keep(&mut self, raw: Option<Vec<f32>>, token: u32) {
        if let (Some(raw), Some(top)) = (raw, self.logprobs) {
            self.picked.push_back(TokenLogprobs::of(&raw, token, top));
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 1e-5
    }

    /// A random number from the request's own stream (the `sim` executor draws its tokens here).
    pub fn rng(&mut self) -> &mut Rng {
        &mut self.rng
    }

    /// Picks a token from `logits` (overwritten as scratch space).
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        let raw = self.raw(logits);
        let token = if self.is_greedy() {
            argmax(logits)
        } else {
            self.distribution(logits);
            self.draw(logits)
        };
        self.keep(raw, token);
        token
    }

    /// Verifies proposed tokens: `logits` holds `drafts.len() + 1` rows, row `i` the logits
    /// after the sequence's known tokens and `drafts[..i]` (overwritten as scratch space).
    /// Returns the drafts' prefix that is kept and one token more: under greedy sampling, what
    /// decoding one token at a time would have produced; otherwise each draft is kept with
    /// the probability the request's distribution gives it, and the token after the last kept
    /// one is drawn from that distribution without the rejected draft (rejection sampling with
    /// a proposal that is certain of its token), so outputs follow the request's distribution.
    pub fn verify(&mut self, logits: &mut [f32], drafts: &[u32]) -> Vec<u32> {
        let vocab = logits.len() / (drafts.len() + 1);
        let mut out = Vec::with_capacity(drafts.len() + 1);
        self.picked.clear();
        for (row, &draft) in logits.chunks_exact_mut(vocab).zip(drafts) {
            let raw = self.raw(row);
            if self.is_greedy() {
                let t = argmax(row);
                out.push(t);
                self.keep(raw, t);
                if t != draft {
                    return out;
                }
                continue;
            }
            self.distribution(row);
            let p = row.get(draft as usize).copied().unwrap_or(0.0);
            if self.rng.next_f32() < p {
                out.push(draft);
                self.keep(raw, draft);
                continue;
            }
            // Rejected: the residual max(p - q, 0) with q certain of `draft` is p without it.
            if let Some(x) = row.get_mut(draft as usize) {
                *x = 0.0;
            }
            let t = self.draw(row);
            out.push(t);
            self.keep(raw, t);
            return out;
        }
        let last = &mut logits[drafts.len() * vocab..];
        out.push(self.sample(last));
        out
    }

    /// Turns `logits` into the request's distribution in place: softmax at its temperature,
    /// zero outside the top-p nucleus (the smallest set of most likely tokens whose mass
    /// reaches top_p). Not normalised: [`Self::draw`] scales by the sum.
    fn distribution(&self, logits: &mut [f32]) {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for l in logits.iter_mut() {
            *l = ((*l - max) / self.temperature).exp();
            sum += *l;
        }
        if self.top_p < 1.0 {
            let mut order: Vec<u32> = (0..logits.len() as u32).collect();
            order.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
            let cutoff = self.top_p * sum;
            let mut kept = 0.0;
            let mut n = 0;
            for &i in &order {
                kept += logits[i as usize];
                n += 1;
                if kept >= cutoff {
                    break;
                }
            }
            for &i in &order[n..] {
                logits[i as usize] = 0.0;
            }
        }
        // Normalised so that a draft's acceptance probability reads straight off it.
        let total: f32 = logits.iter().sum();
        if total > 0.0 {
            logits.iter_mut().for_each(|l| *l /= total);
        }
    }

    /// Draws a token from unnormalised weights.
    fn draw(&mut self, weights: &[f32]) -> u32 {
        let total: f32 = weights.iter().sum();
        let target = self.rng.next_f32() * total;
        let mut acc = 0.0;
        for (i, &p) in weights.iter().enumerate() {
            acc += p;
            if acc > target {
                return i as u32;
            }
        }
        argmax(weights)
    }
}

pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

fn fresh_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    Rng::new(t ^ COUNTER.fetch_add(1, Ordering::Relaxed).rotate_left(32)).next_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_log_softmax_with_the_top_alternatives() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let lse = logits.iter().map(|l| l.exp()).sum::<f32>().ln();
        let lp = TokenLogprobs::of(&logits, 2, 3);
        assert!((lp.logprob - (2.0 - lse)).abs() < 1e-6);
        // Most likely first; equal ones in id order.
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 2]);
        assert!((lp.top[0].1 - (3.0 - lse)).abs() < 1e-6);
        assert!(TokenLogprobs::of(&logits, 0, 0).top.is_empty());
        // Kept per picked token, from the rows as they were before sampling overwrote them.
        let mut s = Sampler::new(0.0, 1.0, Some(1)).with_logprobs(Some(2));
        let mut rows = [logits, logits].concat();
        let picked = s.verify(&mut rows, &[1]);
        assert_eq!(picked, [1, 1]);
        assert_eq!(s.take_logprobs(), Some(TokenLogprobs::of(&logits, 1, 2)));
        assert!(s.take_logprobs().is_some() && s.take_logprobs().is_none());
    }

    #[test]
    fn greedy_takes_the_max() {
        let mut s = Sampler::new(0.0, 1.0, Some(1));
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn a_seed_repeats_and_different_seeds_differ() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(1.0, 0.9, Some(seed));
            (0..50).map(|_| s.sample(&mut logits.clone())).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // One token holds almost all the mass: with top_p 0.5 it is the only candidate.
        let logits = [10.0, 0.0, 0.0, 0.0];
        let mut s = Sampler::new(1.0, 0.5, Some(7));
        for _ in 0..200 {
            assert_eq!(s.sample(&mut logits.clone()), 0);
        }
    }

    #[test]
    fn greedy_verification_keeps_the_agreeing_prefix_and_its_own_next_token() {
        let mut s = Sampler::new(0.0, 1.0, None);
        // Rows' argmaxes: 2, 1, 3.
        let rows = [0.0, 0.0, 5.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0];
        assert_eq!(s.verify(&mut rows.clone(), &[2, 1]), vec![2, 1, 3], "all kept, plus the bonus");
        assert_eq!(s.verify(&mut rows.clone(), &[2, 0]), vec![2, 1], "second rejected, replaced");
        assert_eq!(s.verify(&mut rows.clone(), &[0, 1]), vec![2], "first rejected");
        assert_eq!(s.verify(&mut rows[..4].to_vec(), &[]), vec![2], "no drafts: one sampled token");
    }

    #[test]
    fn sampled_verification_preserves_the_distribution() {
        // One position, vocabulary of 3 with probabilities .5/.3/.2; the draft always proposes 1.
        // Accepted with p(1) = .3, otherwise drawn from {0: .5, 2: .2} renormalised: the first
        // token's distribution must stay .5/.3/.2.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln(), 0.0, 0.0, 0.0];
        let mut s = Sampler::new(1.0, 1.0, Some(11));
        let mut counts = [0usize; 3];
        let n = 40_000;
        for _ in 0..n {
            counts[s.verify(&mut logits.clone(), &[1])[0] as usize] += 1;
        }
        for (c, p) in counts.iter().zip([0.5, 0.3, 0.2]) {
            let f = *c as f64 / n as f64;
            assert!((f - p).abs() < 0.01, "frequency {f} for probability {p}: {counts:?}");
        }
    }

    #[test]
    fn temperature_spreads_choices() {
        let logits = [1.0, 1.0, 1.0, 1.0];
        let mut s = Sampler::new(1.0, 1.0, Some(3));
        let mut seen = [false; 4];
        for _ in 0..200 {
            seen[s.sample(&mut logits.clone()) as usize] = true;
        }
        assert!(seen.iter().all(|&x| x));
    }
}
