//! Turning logits into tokens: greedy, or seeded sampling with repetition penalty, temperature, top-k, top-p and
//! min-p. [`Sampler::distribution`] exposes the processed distribution so a speculative verifier can run
//! rejection sampling against exactly what the AR sampler would draw from.

pub mod constraint;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerConfig {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// 1 = off. Applied to tokens already in the context, as in llama.cpp / transformers.
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Invalid(m.into()));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature must be a finite number ≥ 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p must be in (0, 1]");
        }
        if !(0.0..1.0).contains(&self.min_p) {
            return bad("min_p must be in [0, 1)");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty must be > 0");
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// The index of the largest value; the lowest index wins ties (so greedy is a pure function of the logits).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Draw from a normalized distribution with a uniform `u ∈ [0, 1)`: the first token whose cumulative
/// probability exceeds `u` (the last one if rounding leaves the sum short of `u`).
pub fn draw(dist: &[(u32, f32)], u: f32) -> u32 {
    let mut acc = 0f32;
    for &(tok, p) in dist {
        acc += p;
        if u < acc {
            return tok;
        }
    }
    dist.last().expect("non-empty distribution").0
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Sampler {
            cfg,
            rng: ChaCha8Rng::seed_from_u64(cfg.seed),
        })
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Apply the repetition penalty in place (positive logits divided, negative multiplied).
    fn penalize(&self, logits: &mut [f32], history: &[u32]) {
        let p = self.cfg.repetition_penalty;
        if p == 1.0 {
            return;
        }
        let mut seen = std::collections::HashSet::new();
        for &t in history {
            if seen.insert(t) {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / p } else { *l * p };
                }
            }
        }
    }

    /// The processed distribution for non-greedy sampling: `(token, probability)` sorted by probability
    /// (descending, ties by token id), normalized, after penalty, temperature, top-k, top-p and min-p.
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Vec<(u32, f32)> {
        let mut l = logits.to_vec();
        self.penalize(&mut l, history);
        let t = self.cfg.temperature.max(f32::MIN_POSITIVE);
        let mut cand: Vec<(u32, f32)> = l
            .iter()
            .enumerate()
            .map(|(i, &x)| (i as u32, x / t))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.cfg.top_k > 0 && self.cfg.top_k < cand.len() {
            cand.truncate(self.cfg.top_k);
        }
        let max = cand[0].1;
        let mut sum = 0f64;
        for c in cand.iter_mut() {
            c.1 = (c.1 - max).exp();
            sum += c.1 as f64;
        }
        for c in cand.iter_mut() {
            c.1 = (c.1 as f64 / sum) as f32;
        }
        if self.cfg.top_p < 1.0 {
            let mut acc = 0f32;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.1;
                if acc >= self.cfg.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
        if self.cfg.min_p > 0.0 {
            let floor = cand[0].1 * self.cfg.min_p;
            cand.retain(|c| c.1 >= floor);
        }
        let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
        for c in cand.iter_mut() {
            c.1 = (c.1 as f64 / total) as f32;
        }
        cand
    }

    /// Draw the next token.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if self.cfg.is_greedy() {
            if self.cfg.repetition_penalty == 1.0 {
                return argmax(logits);
            }
            let mut l = logits.to_vec();
            self.penalize(&mut l, history);
            return argmax(&l);
        }
        let dist = self.distribution(logits, history);
        draw(&dist, self.rng.random())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(f: impl FnOnce(&mut SamplerConfig)) -> Sampler {
        let mut cfg = SamplerConfig {
            temperature: 1.0,
            ..SamplerConfig::default()
        };
        f(&mut cfg);
        Sampler::new(cfg).unwrap()
    }

    const LOGITS: [f32; 6] = [1.0, 3.0, 2.0, 3.0, -1.0, 0.5];

    #[test]
    fn greedy_takes_the_lowest_index_among_ties() {
        assert_eq!(argmax(&LOGITS), 1);
        let mut s = Sampler::new(SamplerConfig::greedy()).unwrap();
        assert_eq!(s.sample(&LOGITS, &[]), 1);
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = Sampler::new(SamplerConfig {
            repetition_penalty: 2.0,
            ..SamplerConfig::greedy()
        })
        .unwrap();
        // 1 and 3 tie at 3.0; penalizing 1 (3.0 → 1.5) leaves 3 on top.
        assert_eq!(s.sample(&LOGITS, &[1, 1]), 3);
        let d = sampler(|c| c.repetition_penalty = 2.0).distribution(&[-1.0, -1.0], &[0]);
        assert_eq!(
            d[0].0, 1,
            "a negative logit is multiplied, so the seen token drops"
        );
    }

    #[test]
    fn top_k_top_p_and_min_p_cut_the_distribution() {
        let d = sampler(|c| c.top_k = 2).distribution(&LOGITS, &[]);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
        assert!((d[0].1 - 0.5).abs() < 1e-6);
        // Softmax of LOGITS: 1 and 3 hold ≈ 0.384 each, 2 ≈ 0.141: top-p 0.7 keeps two tokens, 0.8 three.
        let d = sampler(|c| c.top_p = 0.7).distribution(&LOGITS, &[]);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
        let d = sampler(|c| c.top_p = 0.8).distribution(&LOGITS, &[]);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        let d = sampler(|c| c.min_p = 0.5).distribution(&LOGITS, &[]);
        assert_eq!(
            d.iter().map(|x| x.0).collect::<Vec<_>>(),
            vec![1, 3],
            "2 is e^-1 ≈ 0.37 of the top"
        );
        let total: f32 = d.iter().map(|x| x.1).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    #[test]
    fn temperature_sharpens_and_flattens() {
        let cold = sampler(|c| c.temperature = 0.25).distribution(&LOGITS, &[]);
        let hot = sampler(|c| c.temperature = 4.0).distribution(&LOGITS, &[]);
        let p = |d: &[(u32, f32)], t: u32| d.iter().find(|x| x.0 == t).unwrap().1;
        assert!(p(&cold, 2) < 0.01 && p(&hot, 2) > 0.15);
    }

    #[test]
    fn draws_follow_the_processed_distribution_and_the_seed() {
        let mut s = sampler(|c| c.seed = 42);
        let dist = s.distribution(&LOGITS, &[]);
        let n = 20_000;
        let mut counts = [0usize; 6];
        for _ in 0..n {
            counts[s.sample(&LOGITS, &[]) as usize] += 1;
        }
        for (tok, p) in dist {
            let f = counts[tok as usize] as f32 / n as f32;
            // 5 standard deviations of a binomial proportion.
            let sd = (p * (1.0 - p) / n as f32).sqrt();
            assert!(
                (f - p).abs() <= 5.0 * sd + 1e-4,
                "token {tok}: frequency {f} vs p {p}"
            );
        }
        let mut s9 = sampler(|c| c.seed = 9);
        let b: Vec<u32> = (0..50).map(|_| s9.sample(&LOGITS, &[])).collect();
        let mut s10 = sampler(|c| c.seed = 10);
        let other: Vec<u32> = (0..50).map(|_| s10.sample(&LOGITS, &[])).collect();
        assert_ne!(b, other, "another seed gives another sequence");
        let mut s9b = sampler(|c| c.seed = 9);
        let c: Vec<u32> = (0..50).map(|_| s9b.sample(&LOGITS, &[])).collect();
        assert_eq!(b, c);
    }

    #[test]
    fn invalid_settings_are_rejected() {
        for cfg in [
            SamplerConfig {
                temperature: -1.0,
                ..Default::default()
            },
            SamplerConfig {
                top_p: 0.0,
                ..Default::default()
            },
            SamplerConfig {
                min_p: 1.0,
                ..Default::default()
            },
            SamplerConfig {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            SamplerConfig {
                temperature: f32::NAN,
                ..Default::default()
            },
        ] {
            assert!(Sampler::new(cfg).is_err(), "{cfg:?}");
        }
    }
}
