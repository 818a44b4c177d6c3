//! Token sampling: greedy, temperature, top-k, top-p, min-p, repetition, presence and
//! frequency penalties, logit bias, a constraint's mask, seeded.
//!
//! The chain runs in llama.cpp's usual order: mask and bias, penalties, top-k, top-p, min-p,
//! temperature, then a draw. The generator is a seeded xoshiro256**, so the same seed gives the
//! same tokens.

use std::collections::HashMap;

/// Sampling parameters of one session.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 (or less) means greedy: plain argmax of the raw logits.
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0.0 disables.
    pub min_p: f32,
    /// 1.0 disables.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    /// OpenAI's presence penalty: subtracted once from the logit of every token generated so
    /// far (0.0 disables).
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty: subtracted from a token's logit once per time it was
    /// generated (0.0 disables).
    pub frequency_penalty: f32,
    /// Added to the logits of these tokens before anything else (-100 bans a token).
    pub logit_bias: Vec<(u32, f32)>,
    /// How many tokens of the history are the prompt: presence and frequency penalties count
    /// the generated tokens only, as OpenAI and vLLM do.
    pub n_prompt: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            n_prompt: 0,
            seed: 0,
        }
    }
}

/// A session's sampler: parameters plus the counts of generated tokens.
///
/// The draw for a token is a function of the seed and the token's position alone (no
/// generator state carried from token to token), so a session replayed or moved to another
/// route continues with exactly the draws it would have made.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    /// The generated tokens counted in `counts` (the history past `n_prompt`), kept so that a
    /// rewound history is uncounted token by token: the counts cost O(1) per step.
    counted: Vec<u32>,
    counts: HashMap<u32, u32>,
}

/// Whether bit `id` is set in a mask of 32-bit words (bits past its end are not).
pub fn allowed(mask: &[u32], id: usize) -> bool {
    mask.get(id / 32).is_some_and(|w| w & (1 << (id % 32)) != 0)
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Sampler {
            params,
            counted: Vec::new(),
            counts: HashMap::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Forgets the history past its first `len` tokens (the session was rewound); the
    /// tokens after it are counted again when they come back.
    pub fn rewind(&mut self, len: usize) {
        self.uncount(len.saturating_sub(self.params.n_prompt));
    }

    fn uncount(&mut self, keep: usize) {
        if keep >= self.counted.len() {
            return;
        }
        for t in self.counted.drain(keep..) {
            if let Some(c) = self.counts.get_mut(&t) {
                *c -= 1;
                if *c == 0 {
                    self.counts.remove(&t);
                }
            }
        }
    }

    /// Brings the counts of generated tokens to `history` (whose first tokens are those
    /// counted; a rewind says so with [`Sampler::rewind`]).
    fn count(&mut self, history: &[u32]) {
        let generated = history.get(self.params.n_prompt..).unwrap_or(&[]);
        self.uncount(generated.len());
        let keep = self.counted.len();
        for &t in &generated[keep..] {
            *self.counts.entry(t).or_insert(0) += 1;
            self.counted.push(t);
        }
    }

    /// The logits after the mask, the bias and the presence and frequency penalties; `None`
    /// when none applies (the logits are used as they are).
    fn adjusted(&mut self, logits: &[f32], mask: Option<&[u32]>) -> Option<Vec<f32>> {
        let p = &self.params;
        let penalties = p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        if mask.is_none() && p.logit_bias.is_empty() && !penalties {
            return None;
        }
        let mut l = logits.to_vec();
        for &(t, b) in &p.logit_bias {
            if let Some(x) = l.get_mut(t as usize) {
                *x += b;
            }
        }
        if penalties {
            for (&t, &n) in &self.counts {
                if let Some(x) = l.get_mut(t as usize) {
                    *x -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
        }
        if let Some(mask) = mask {
            for (i, x) in l.iter_mut().enumerate() {
                if !allowed(mask, i) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        Some(l)
    }

    /// Picks the next token from `logits`, given the tokens seen so far (prompt and output);
    /// `mask` (bit per token) limits the choice to the tokens a constraint allows, and must
    /// allow at least one.
    pub fn sample(&mut self, logits: &[f32], history: &[u32], mask: Option<&[u32]>) -> u32 {
        if self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0 {
            self.count(history);
        }
        let adjusted = self.adjusted(logits, mask);
        let logits = adjusted.as_deref().unwrap_or(logits);
        let p = &self.params;
        let penalized = p.repeat_penalty != 1.0 && p.repeat_last_n > 0;
        if p.temperature <= 0.0 && !penalized {
            // Greedy without penalties: the first maximum, with no copy of the logits.
            return first_max(logits) as u32;
        }
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        if p.repeat_penalty != 1.0 && p.repeat_last_n > 0 {
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut seen = std::collections::HashSet::new();
            for &t in &history[start..] {
                if seen.insert(t) {
                    if let Some(c) = cand.get_mut(t as usize) {
                        c.1 = if c.1 > 0.0 {
                            c.1 / p.repeat_penalty
                        } else {
                            c.1 * p.repeat_penalty
                        };
                    }
                }
            }
        }
        if p.temperature <= 0.0 {
            return argmax(&cand);
        }
        // Sort best first; ties broken by id so the order is fully determined.
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.truncate(p.top_k);
        }
        let probs = softmax(&cand);
        let mut keep = cand.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|&&pr| pr >= floor).count().max(1));
        }
        cand.truncate(keep);
        // Scaled from the best logit (0 for it, at most 0 for the rest): however small the
        // temperature, nothing overflows.
        let best = cand.first().map_or(0.0, |c| c.1);
        for c in cand.iter_mut() {
            c.1 = (c.1 - best) / p.temperature;
        }
        let probs = softmax(&cand);
        let r = draw(p.seed, history.len());
        let mut cum = 0.0;
        for (c, pr) in cand.iter().zip(&probs) {
            cum += pr;
            if r < cum {
                return c.0;
            }
        }
        // Rounding left the draw past the sum: the last candidate that could be drawn (never
        // one the mask forbids, whose probability is 0).
        cand.iter()
            .zip(&probs)
            .rev()
            .find(|(_, &pr)| pr > 0.0)
            .or(cand.first().zip(probs.first()))
            .map_or(0, |(c, _)| c.0)
    }
}

/// The index of the first largest value, exactly as a scan keeping `best` where
/// `v[i] > v[best]` (NaN is never larger; 0 when `v[0]` is NaN or nothing exceeds it), but as
/// two passes the compiler vectorizes: the maximum in sixteen lanes, then its first position.
/// A vocabulary-sized scan per sampled token is on every decode step's critical path
/// (49,152 logits: ~27 -> ~3 us).
pub fn first_max(v: &[f32]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: the feature was just detected.
        return unsafe { first_max_avx512(v) };
    }
    first_max_lanes(v)
}

/// [`first_max_lanes`] compiled for 512-bit registers (sixteen lanes in one).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn first_max_avx512(v: &[f32]) -> usize {
    first_max_lanes(v)
}

#[inline(always)]
fn first_max_lanes(v: &[f32]) -> usize {
    const L: usize = 16;
    if v.first().is_none_or(|x| x.is_nan()) {
        return 0;
    }
    // The largest value, lane by lane (`x > m` skips NaN, as the scan does)...
    let mut m = [f32::NEG_INFINITY; L];
    let chunks = v.chunks_exact(L);
    let tail = chunks.remainder();
    for chunk in chunks {
        for l in 0..L {
            m[l] = if chunk[l] > m[l] { chunk[l] } else { m[l] };
        }
    }
    let max = m
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |a, &x| if x > a { x } else { a });
    // ...then where it first occurs. Nothing above -inf: index 0, as the scan.
    if max == f32::NEG_INFINITY {
        return 0;
    }
    let mut chunks = v.chunks_exact(L);
    let mut base = 0;
    for chunk in &mut chunks {
        if chunk.iter().fold(false, |any, &x| any | (x == max)) {
            return base + chunk.iter().position(|&x| x == max).expect("found");
        }
        base += L;
    }
    base + chunks
        .remainder()
        .iter()
        .position(|&x| x == max)
        .expect("the maximum is somewhere")
}

fn argmax(cand: &[(u32, f32)]) -> u32 {
    let mut best = 0;
    for (i, c) in cand.iter().enumerate() {
        if c.1 > cand[best].1 {
            best = i;
        }
    }
    cand[best].0
}

fn softmax(cand: &[(u32, f32)]) -> Vec<f64> {
    let max = cand.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.1)) as f64;
    let e: Vec<f64> = cand.iter().map(|c| (c.1 as f64 - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

/// The `k` highest logits, best first (ties by lower id).
pub fn top_k(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(idx.len());
    let cmp = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if k < idx.len() && k > 0 {
        idx.select_nth_unstable_by(k - 1, cmp);
    }
    idx.truncate(k);
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, logits[i as usize])).collect()
}

/// Log-probability of each of `ids` under the softmax of `logits`.
pub fn log_probs(logits: &[f32], ids: &[u32]) -> Vec<f32> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l)) as f64;
    let lse = logits
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    ids.iter()
        .map(|&i| (logits[i as usize] as f64 - lse) as f32)
        .collect()
}

/// The uniform draw in [0, 1) for the token after `position` tokens of history.
fn draw(seed: u64, position: usize) -> f64 {
    Xoshiro::seeded(seed ^ (position as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)).next_f64()
}

#[derive(Debug, Clone)]
struct Xoshiro([u64; 4]);

impl Xoshiro {
    fn seeded(seed: u64) -> Self {
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Xoshiro([next(), next(), next(), next()])
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..100).map(|i| ((i * 7919) % 101) as f32 / 10.0).collect()
    }

    /// The lane scan equals the one-at-a-time scan, with ties, NaNs and infinities about.
    #[test]
    fn first_max_is_the_first_largest_value() {
        fn scan(v: &[f32]) -> usize {
            let mut best = 0;
            for (i, &x) in v.iter().enumerate() {
                if x > v[best] {
                    best = i;
                }
            }
            best
        }
        let mut seed = 0x2545_f491u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for n in [1, 15, 16, 17, 31, 33, 100, 49152] {
            for case in 0..6 {
                let v: Vec<f32> = (0..n)
                    .map(|_| match (case, next() % 8) {
                        // Few distinct values: many ties.
                        (0, r) => r as f32,
                        (1, r) if r < 4 => f32::NAN,
                        (2, 0) => f32::NEG_INFINITY,
                        (3, _) => f32::NEG_INFINITY,
                        (4, 0) => f32::INFINITY,
                        _ => next() as f32 / u32::MAX as f32,
                    })
                    .collect();
                assert_eq!(first_max(&v), scan(&v), "n {n} case {case}");
                let mut w = v.clone();
                w[0] = f32::NAN;
                assert_eq!(first_max(&w), scan(&w), "n {n} case {case}, NaN first");
            }
        }
    }

    #[test]
    fn greedy_is_argmax() {
        let l = logits();
        let best = top_k(&l, 1)[0].0;
        assert_eq!(
            Sampler::new(SamplingParams::default()).sample(&l, &[], None),
            best
        );
    }

    #[test]
    fn same_seed_same_tokens_and_different_seed_differs() {
        let l = vec![1.0f32; 1000];
        let p = SamplingParams {
            temperature: 1.0,
            seed: 42,
            ..Default::default()
        };
        let run = |p: SamplingParams| {
            let mut s = Sampler::new(p);
            let mut history = Vec::new();
            for _ in 0..20 {
                let t = s.sample(&l, &history, None);
                history.push(t);
            }
            history
        };
        let a = run(p.clone());
        assert_eq!(a, run(p.clone()));
        assert_ne!(
            a,
            run(SamplingParams {
                seed: 43,
                ..p.clone()
            })
        );
        // The draws depend on the position, not on what the sampler did before: a fresh
        // sampler given the first 10 tokens continues with the same 10 (a replayed session).
        let mut fresh = Sampler::new(p);
        let mut history = a[..10].to_vec();
        for _ in 10..20 {
            let t = fresh.sample(&l, &history, None);
            history.push(t);
        }
        assert_eq!(history, a);
    }

    #[test]
    fn logit_bias_bans_and_forces_tokens_and_the_mask_limits_the_choice() {
        let l = logits();
        let best = top_k(&l, 1)[0].0;
        let greedy =
            |p: SamplingParams, mask: Option<&[u32]>| Sampler::new(p).sample(&l, &[], mask);
        let banned = greedy(
            SamplingParams {
                logit_bias: vec![(best, -100.0)],
                ..Default::default()
            },
            None,
        );
        assert_ne!(banned, best);
        assert_eq!(banned, top_k(&l, 2)[1].0);
        let forced = greedy(
            SamplingParams {
                logit_bias: vec![(0, 100.0)],
                ..Default::default()
            },
            None,
        );
        assert_eq!(forced, 0);
        // Only tokens 33 and 70 allowed (bits in 32-bit words), at any temperature.
        let mut mask = vec![0u32; 4];
        mask[1] |= 1 << 1;
        mask[2] |= 1 << 6;
        let mut hot = Sampler::new(SamplingParams {
            temperature: 2.0,
            seed: 3,
            ..Default::default()
        });
        let mut history = Vec::new();
        for _ in 0..50 {
            let t = hot.sample(&l, &history, Some(&mask));
            assert!(t == 33 || t == 70, "{t}");
            history.push(t);
        }
        let g = greedy(SamplingParams::default(), Some(&mask));
        assert_eq!(g, if l[33] >= l[70] { 33 } else { 70 });
    }

    #[test]
    fn a_tiny_temperature_is_as_greedy_and_never_draws_a_masked_token() {
        let l = logits();
        let best = top_k(&l, 1)[0].0;
        let history = vec![0u32; 64];
        let mut mask = vec![0u32; 4];
        mask[(best / 32) as usize] |= 1 << (best % 32);
        mask[0] |= 1 << 3;
        for t in [1e-30f32, 1e-38, 1e-45] {
            let mut s = Sampler::new(SamplingParams {
                temperature: t,
                seed: 9,
                ..Default::default()
            });
            for n in 0..64 {
                assert_eq!(s.sample(&l, &history[..n], None), best, "t {t}");
                assert_eq!(s.sample(&l, &history[..n], Some(&mask)), best, "t {t}");
            }
        }
    }

    #[test]
    fn presence_and_frequency_penalties_count_generated_tokens_only_and_rewind() {
        let mut l = vec![0.0f32; 10];
        l[3] = 2.0;
        l[5] = 1.5;
        let presence = SamplingParams {
            presence_penalty: 1.0,
            n_prompt: 1,
            ..Default::default()
        };
        // Token 3 in the prompt is not penalized; generated once, it is (2.0 - 1.0 < 1.5).
        assert_eq!(Sampler::new(presence.clone()).sample(&l, &[3], None), 3);
        let mut s = Sampler::new(presence);
        assert_eq!(s.sample(&l, &[3, 3], None), 5);
        // Rewound to the prompt, the count is gone again.
        s.rewind(1);
        assert_eq!(s.sample(&l, &[3], None), 3);
        let frequency = SamplingParams {
            frequency_penalty: 0.3,
            ..Default::default()
        };
        // Once: 1.7 > 1.5; twice: 1.4 < 1.5.
        let mut s = Sampler::new(frequency);
        assert_eq!(s.sample(&l, &[3], None), 3);
        assert_eq!(s.sample(&l, &[3, 3], None), 5);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_and_high_min_p_are_greedy() {
        let l = logits();
        let best = top_k(&l, 1)[0].0;
        for p in [
            SamplingParams {
                top_k: 1,
                ..Default::default()
            },
            SamplingParams {
                top_p: 1e-6,
                ..Default::default()
            },
            SamplingParams {
                min_p: 0.999,
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(SamplingParams {
                temperature: 5.0,
                seed: 7,
                ..p
            });
            let history = [0u32; 20];
            for n in 0..20 {
                assert_eq!(s.sample(&l, &history[..n], None), best);
            }
        }
    }

    #[test]
    fn top_k_restricts_draws_to_the_k_best() {
        let l = logits();
        let allowed: Vec<u32> = top_k(&l, 3).into_iter().map(|c| c.0).collect();
        let mut s = Sampler::new(SamplingParams {
            temperature: 10.0,
            top_k: 3,
            seed: 1,
            ..Default::default()
        });
        // Each position has its own draw.
        let history = vec![0u32; 200];
        for n in 0..200 {
            assert!(allowed.contains(&s.sample(&l, &history[..n], None)));
        }
    }

    #[test]
    fn repetition_penalty_moves_greedy_off_a_repeated_token() {
        let mut l = vec![0.0f32; 10];
        l[3] = 2.0;
        l[5] = 1.5;
        let p = SamplingParams {
            repeat_penalty: 2.0,
            ..Default::default()
        };
        assert_eq!(Sampler::new(p.clone()).sample(&l, &[3], None), 5);
        assert_eq!(Sampler::new(p).sample(&l, &[], None), 3);
    }

    #[test]
    fn log_probs_sum_to_one() {
        let l = logits();
        let ids: Vec<u32> = (0..100).collect();
        let total: f64 = log_probs(&l, &ids).iter().map(|&x| (x as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }
}
