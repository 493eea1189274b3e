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

/// How one request picks its tokens.
#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f32,
    top_p: f32,
    rng: Rng,
}

impl Sampler {
    /// `temperature` ≤ 1e-5 means greedy. `seed` None draws a fresh one.
    pub fn new(temperature: f32, top_p: f32, seed: Option<u64>) -> Sampler {
        let seed = seed.unwrap_or_else(fresh_seed);
        Sampler { temperature, top_p: top_p.clamp(f32::MIN_POSITIVE, 1.0), rng: Rng::new(seed) }
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
        if self.is_greedy() {
            return argmax(logits);
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for l in logits.iter_mut() {
            *l = ((*l - max) / self.temperature).exp();
            sum += *l;
        }
        let r = self.rng.next_f32();
        if self.top_p >= 1.0 {
            let mut acc = 0.0;
            let target = r * sum;
            for (i, p) in logits.iter().enumerate() {
                acc += p;
                if acc > target {
                    return i as u32;
                }
            }
            return argmax(logits);
        }
        // Nucleus: the smallest set of most likely tokens whose mass reaches top_p.
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
        let target = r * kept;
        let mut acc = 0.0;
        for &i in &order[..n] {
            acc += logits[i as usize];
            if acc > target {
                return i;
            }
        }
        order[0]
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
