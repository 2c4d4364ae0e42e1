//! Turning logits into tokens: greedy, or seeded sampling with repetition penalty, temperature, top-k, top-p and
//! min-p.
//!
//! Invariants:
//! - **A draw is keyed by its position.** The token at absolute position `p` of a sequence (prompt included) is
//!   the winner of an exponential race (the Gumbel-max trick): each token `t` the processed distribution keeps
//!   gets an arrival time `E_t / w_t`, with `w_t` its weight and `E_t ~ Exp(1)` read from a counter-based stream
//!   keyed by `(seed, p, t)` ([`KeyedRace`]), and the earliest arrival wins — with probability exactly
//!   `w_t / Σ w`. The draw does not depend on how many draws came before, so any route that samples position `p`
//!   from the same distribution gets the same token: sampled speculation reproduces sampled AR (see
//!   [`crate::speculative::verify`]). A drafter racing its own distribution `q` on the same `E` agrees with the
//!   target whenever the two races have the same winner, at least `(1 − TV) / (1 + TV)` of the time
//!   and never needing the two distributions to rank their tokens alike.
//! - **The processed distribution is never degenerate.** The sampler works in f64 with the logits shifted by
//!   their maximum before dividing by the temperature, so no setting and no finite logit overflows;
//!   [`Sampler::distribution`] is never empty, never holds NaN, and never lists a token of probability 0 (a logit
//!   of −∞, a token cut by top-k/top-p/min-p), and [`Sampler::sample`] returns only tokens it lists. A NaN logit
//!   counts as −∞.
//! - Temperatures below [`GREEDY_BELOW`] are greedy; the repetition penalty acts within
//!   [`REPETITION_PENALTY_RANGE`].

pub mod constraint;

use std::ops::RangeInclusive;

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

/// Temperatures below this sample greedily. Near zero, softmax(x/T) is one-hot on the argmax to far beyond f32
/// precision (a logit gap of 0.01 at T = 1e-4 is e^-100), so greedy is the same distribution without dividing
/// by a vanishing number.
pub const GREEDY_BELOW: f32 = 1e-4;

/// The repetition penalties the sampler applies; a setting outside is clamped to the nearest end. Logits of real
/// models span tens of units, so a factor of 100 either way already decides whether a seen token can win; more
/// would only push logits towards ±∞.
pub const REPETITION_PENALTY_RANGE: RangeInclusive<f32> = 0.01..=100.0;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerConfig {
    /// Below [`GREEDY_BELOW`] (e.g. 0) = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// 1 = off. Applied to tokens already in the context, as in llama.cpp / transformers; clamped to
    /// [`REPETITION_PENALTY_RANGE`].
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
            return bad("repetition_penalty must be a finite number > 0");
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW
    }

    /// The penalty the sampler applies: the setting clamped to [`REPETITION_PENALTY_RANGE`].
    fn penalty(&self) -> f64 {
        let (lo, hi) = REPETITION_PENALTY_RANGE.into_inner();
        self.repetition_penalty.clamp(lo, hi) as f64
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

/// A token whose log-weight is below this relative to the top's can never win a race: an arrival time `E / w`
/// has `E` within `[5.6e-17, 37.5]` (53-bit uniforms kept off 0 and 1), so the top token (`w = 1`) arrives by
/// 37.5 and a token with `w < e^-42` after 5.6e-17 · e^42 ≈ 97. Skipping such tokens changes no draw.
const UNREACHABLE_LOG_WEIGHT: f64 = -42.0;

/// The exponential variates that decide the draw at one position: `E_t = −ln(1 − u_t)` for token `t`, with `u_t`
/// the 53-bit uniform at word `2t` of ChaCha8 stream `position` keyed by the seed — a pure function of
/// `(seed, position, t)`, independent across positions and tokens.
struct KeyedRace {
    rng: ChaCha8Rng,
    /// The token whose variate the stream yields next.
    next: u64,
}

impl KeyedRace {
    fn new(seed: u64, position: usize) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(position as u64);
        rng.set_word_pos(0);
        KeyedRace { rng, next: 0 }
    }

    /// `u_t`. Asked in increasing token order, the stream is read straight through (a dense vocabulary costs one
    /// pass); a token behind or far ahead seeks.
    fn uniform(&mut self, token: u32) -> f64 {
        let t = token as u64;
        if t < self.next || t > self.next + 32 {
            self.rng.set_word_pos(2 * t as u128);
        } else {
            for _ in self.next..t {
                self.rng.next_u64();
            }
        }
        self.next = t + 1;
        ((self.rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

/// `E_t` from `u_t`.
fn exponential(u: f64) -> f64 {
    -(-u).ln_1p()
}

/// A lower bound on `ln u` for `u` in (0, 1): its binary exponent times ln 2 (no logarithm computed).
fn ln_floor(u: f64) -> f64 {
    let exponent = ((u.to_bits() >> 52) & 0x7ff) as i64 - 1023;
    exponent as f64 * std::f64::consts::LN_2
}

/// Slack on the race's skip test, far above the rounding of the few f64 operations on either side of it, so a
/// skipped token's computed arrival is always strictly later than the best one's.
const SKIP_MARGIN: f64 = 1e-6;

/// The log-weight below which min-p cuts a token: `ln(min_p)` relative to the top's 0 (−∞ without min-p).
fn min_p_floor(min_p: f32) -> f64 {
    if min_p > 0.0 {
        (min_p as f64).ln()
    } else {
        f64::NEG_INFINITY
    }
}

/// A draw's settings where the race alone decides it ([`Sampler::race_spec`]): what a device needs to draw a
/// row of logits itself, bitwise as the host would.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RaceSpec {
    pub seed: u64,
    /// At least [`GREEDY_BELOW`].
    pub temperature: f32,
    /// 0 = off.
    pub min_p: f32,
}

// Validated settings are finite numbers, so equality by value is an equivalence; the hash agrees with it by
// hashing each value's bits with -0.0 as 0.0 (adding 0.0 turns -0.0 into 0.0 and leaves every other value).
impl Eq for RaceSpec {}

impl std::hash::Hash for RaceSpec {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        let bits = |x: f32| (x + 0.0).to_bits();
        (self.seed, bits(self.temperature), bits(self.min_p)).hash(h)
    }
}

impl RaceSpec {
    /// The ChaCha8 key of the race's streams: the seed expanded as `ChaCha8Rng::seed_from_u64` expands it, as
    /// eight little-endian words.
    pub fn key(&self) -> [u32; 8] {
        let seed = ChaCha8Rng::seed_from_u64(self.seed).get_seed();
        std::array::from_fn(|i| u32::from_le_bytes(seed[4 * i..4 * i + 4].try_into().unwrap()))
    }

    /// The log-weight below which min-p cuts a token (−∞ without min-p).
    pub fn floor(&self) -> f64 {
        min_p_floor(self.min_p)
    }

    /// The token drawn from one row of `logits` at absolute position `position`: what [`Sampler::sample`] with
    /// these settings draws there.
    pub fn draw(&self, logits: &[f32], position: usize) -> u32 {
        let sampler = Sampler {
            cfg: SamplerConfig {
                temperature: self.temperature,
                min_p: self.min_p,
                seed: self.seed,
                ..SamplerConfig::default()
            },
        };
        sampler.sample_at(logits, &[], position)
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Sampler { cfg })
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// The logits in f64 (NaN as −∞) after the repetition penalty: positive logits of seen tokens divided by it,
    /// negative ones multiplied. In f64 even the largest f32 logit over the smallest penalty stays finite.
    fn penalized(&self, logits: &[f32], history: &[u32]) -> Vec<f64> {
        let mut l: Vec<f64> = logits
            .iter()
            .map(|&x| {
                if x.is_nan() {
                    f64::NEG_INFINITY
                } else {
                    x as f64
                }
            })
            .collect();
        let p = self.cfg.penalty();
        if p != 1.0 {
            let mut seen = std::collections::HashSet::new();
            for &t in history {
                if seen.insert(t) {
                    if let Some(x) = l.get_mut(t as usize) {
                        *x = if *x > 0.0 { *x / p } else { *x * p };
                    }
                }
            }
        }
        l
    }

    /// The greedy choice after the penalty: the largest penalized logit, the lowest index among ties (token 0
    /// when none is above −∞).
    fn greedy(&self, logits: &[f32], history: &[u32]) -> u32 {
        if self.cfg.penalty() == 1.0 {
            return argmax(logits);
        }
        let l = self.penalized(logits, history);
        let mut best = 0;
        for (i, &x) in l.iter().enumerate() {
            if x > l[best] {
                best = i;
            }
        }
        best as u32
    }

    /// The tokens the processed distribution keeps, in token id order, with their log-weights
    /// `z = (l − max) / T` (the top at 0; f64, so nothing overflows): all tokens of finite logit without top-k,
    /// top-p and min-p; else the top-k by weight (ties by id), then the shortest prefix holding `top_p` of their
    /// mass, then those with weight ≥ `min_p` × the top's. Greedy settings, or every logit −∞ (or NaN), keep the
    /// greedy token alone.
    fn support(&self, logits: &[f32], history: &[u32]) -> Vec<(u32, f64)> {
        let l = self.penalized(logits, history);
        let max = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if self.cfg.is_greedy() || max == f64::NEG_INFINITY {
            return vec![(self.greedy(logits, history), 0.0)];
        }
        let t = self.cfg.temperature as f64;
        // Logits at +∞ (only from a broken model) share the mass equally, the limit of large finite ones.
        let mut cand: Vec<(u32, f64)> = l
            .iter()
            .enumerate()
            .filter_map(|(i, &x)| {
                let z = if max == f64::INFINITY {
                    if x == max {
                        0.0
                    } else {
                        f64::NEG_INFINITY
                    }
                } else {
                    (x - max) / t
                };
                (z > f64::NEG_INFINITY).then_some((i as u32, z))
            })
            .collect();
        let cfg = &self.cfg;
        if cfg.top_k == 0 && cfg.top_p >= 1.0 && cfg.min_p == 0.0 {
            return cand;
        }
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if cfg.top_k > 0 && cfg.top_k < cand.len() {
            cand.truncate(cfg.top_k);
        }
        if cfg.top_p < 1.0 {
            let total: f64 = cand.iter().map(|c| c.1.exp()).sum();
            let target = cfg.top_p as f64 * total;
            let mut acc = 0f64;
            let keep = cand
                .iter()
                .position(|c| {
                    acc += c.1.exp();
                    acc >= target
                })
                .map_or(cand.len(), |i| i + 1);
            cand.truncate(keep);
        }
        if cfg.min_p > 0.0 {
            // The top weighs e^0 = 1.
            let floor = min_p_floor(cfg.min_p);
            cand.retain(|c| c.1 >= floor);
        }
        cand.sort_unstable_by_key(|c| c.0);
        cand
    }

    /// The processed distribution: `(token, probability)` sorted by probability (descending, ties by token id),
    /// normalized, after penalty, temperature, top-k, top-p and min-p; only tokens of probability > 0. Greedy
    /// settings, or every logit −∞ (or NaN), give the greedy token all the mass.
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Vec<(u32, f32)> {
        let support = self.support(logits, history);
        let total: f64 = support.iter().map(|c| c.1.exp()).sum();
        // The top weighs 1 and the total at most the vocabulary, so the top survives the narrowing to f32.
        let mut d: Vec<(u32, f32)> = support
            .iter()
            .map(|&(tok, z)| (tok, (z.exp() / total) as f32))
            .filter(|c| c.1 > 0.0)
            .collect();
        d.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        d
    }

    /// The token at absolute position `history.len()` (`history`: every token before it, prompt included): the
    /// greedy choice, or the winner of the race keyed by the seed and that position over
    /// [`Sampler::distribution`]'s tokens (the lowest id among equal arrival times).
    pub fn sample(&self, logits: &[f32], history: &[u32]) -> u32 {
        self.sample_at(logits, history, history.len())
    }

    /// [`Sampler::sample`] keyed by `position` (the history counts only for the repetition penalty).
    fn sample_at(&self, logits: &[f32], history: &[u32], position: usize) -> u32 {
        let cfg = &self.cfg;
        if cfg.is_greedy() {
            return self.greedy(logits, history);
        }
        if cfg.top_k == 0 && cfg.top_p >= 1.0 {
            if let Some(token) = self.race_uncut(logits, history, position) {
                return token;
            }
        }
        self.race(self.support(logits, history), position)
    }

    /// The race's settings where the race alone decides every draw, so that a device holding the logits can
    /// draw the rows itself ([`crate::backend::Backend::draw`]): sampling with a temperature and at most min-p
    /// — no top-k or top-p (a sort of the vocabulary) and no repetition penalty (the history).
    pub fn race_spec(&self) -> Option<RaceSpec> {
        let cfg = &self.cfg;
        let race_only =
            !cfg.is_greedy() && cfg.top_k == 0 && cfg.top_p >= 1.0 && cfg.penalty() == 1.0;
        race_only.then_some(RaceSpec {
            seed: cfg.seed,
            temperature: cfg.temperature,
            min_p: cfg.min_p,
        })
    }

    /// The race over `support` (token id order) at `position`: the earliest arrival, the lowest id among equal
    /// ones.
    fn race(&self, support: Vec<(u32, f64)>, position: usize) -> u32 {
        let mut race = KeyedRace::new(self.cfg.seed, position);
        let mut first = (f64::INFINITY, 0);
        for (tok, z) in support {
            if z >= UNREACHABLE_LOG_WEIGHT {
                let arrival = exponential(race.uniform(tok)) / z.exp();
                if arrival < first.0 {
                    first = (arrival, tok);
                }
            }
        }
        first.1
    }

    /// [`Sampler::race`] over every token of finite logit (no top-k or top-p; min-p cuts the tokens of weight
    /// below `min_p` × the top's, as [`Sampler::support`] does), the same winner without
    /// building the support or computing most tokens' arrivals: the top token runs first, and a later token's
    /// arrival `E_t / w_t` is computed only where it could still come first. Since `E_t = −ln(1 − u_t) ≥ u_t`,
    /// a token with `u_t > best · w_t` arrives after `best`, and `ln u_t` is bounded below by `u_t`'s binary
    /// exponent — so most of a vocabulary costs its uniform, a subtraction and a comparison, no `exp` or `ln`
    /// (sampling SmolLM2's 49,152 logits at temperature 0.7 took 0.9 ms a token before, a GPU's whole step).
    /// `None` where every logit is −∞ or one is +∞ (the general path's cases).
    fn race_uncut(&self, logits: &[f32], history: &[u32], position: usize) -> Option<u32> {
        if logits.is_empty() {
            return None;
        }
        let penalized = (self.cfg.penalty() != 1.0).then(|| self.penalized(logits, history));
        let logit = |i: usize| match &penalized {
            Some(l) => l[i],
            None if logits[i].is_nan() => f64::NEG_INFINITY,
            None => logits[i] as f64,
        };
        let mut top = 0;
        for i in 1..logits.len() {
            if logit(i) > logit(top) {
                top = i;
            }
        }
        let max = logit(top);
        if !max.is_finite() {
            return None;
        }
        let t = self.cfg.temperature as f64;
        let floor = min_p_floor(self.cfg.min_p);
        let mut race = KeyedRace::new(self.cfg.seed, position);
        // The top's log-weight is 0: its arrival is E itself.
        let mut best = (exponential(race.uniform(top as u32)), top as u32);
        let mut ln_best = best.0.ln();
        for i in (0..logits.len()).filter(|&i| i != top) {
            let z = (logit(i) - max) / t;
            // (z is never NaN: max is finite and −∞ logits give −∞.)
            if z < UNREACHABLE_LOG_WEIGHT || z < floor {
                continue;
            }
            let u = race.uniform(i as u32);
            // ln u ≥ ln_floor(u) > ln best + z: u > best · w, so E / w > best.
            if ln_floor(u) > ln_best + z + SKIP_MARGIN {
                continue;
            }
            let arrival = exponential(u) / z.exp();
            if arrival < best.0 || (arrival == best.0 && (i as u32) < best.1) {
                best = (arrival, i as u32);
                ln_best = best.0.ln();
            }
        }
        Some(best.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
        let s = Sampler::new(SamplerConfig::greedy()).unwrap();
        assert_eq!(s.sample(&LOGITS, &[]), 1);
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let s = Sampler::new(SamplerConfig {
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
    fn a_repetition_penalty_outside_its_range_acts_as_the_nearest_end() {
        let (lo, hi) = REPETITION_PENALTY_RANGE.into_inner();
        for (given, acts_as) in [(1e-45, lo), (1e30, hi), (f32::MAX, hi)] {
            let logits = [2.0, 1.5, -0.5, 0.25];
            let history = [0, 2];
            let got = sampler(|c| c.repetition_penalty = given).distribution(&logits, &history);
            let want = sampler(|c| c.repetition_penalty = acts_as).distribution(&logits, &history);
            assert_eq!(got, want, "penalty {given}");
        }
        // Even at the smallest penalty the largest logits stay finite and ordered: a seen token with the top
        // logit takes the mass; it does not tie with every other seen token at +∞.
        let s = sampler(|c| c.repetition_penalty = 1e-45);
        let d = s.distribution(&[f32::MAX, 3e38, -3e38, 1.0], &[0, 1, 2]);
        assert_eq!(d, vec![(0, 1.0)]);
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
    fn a_temperature_below_the_threshold_is_greedy_and_one_just_above_is_finite() {
        let extreme = [3e38, -3e38, 3e38 - 1e32, 0.0, -1.0];
        for t in [0.0, 1e-45, 1e-38, 1e-10, GREEDY_BELOW * 0.99] {
            let s = sampler(|c| c.temperature = t);
            assert!(s.config().is_greedy(), "{t}");
            for pos in 0..8 {
                assert_eq!(s.sample(&extreme, &vec![4; pos]), 0, "{t}");
            }
        }
        // Just above the threshold, (x − max) / T of logits ±3e38 apart stays finite: the top token takes all
        // the mass, no NaN, no random token.
        let s = sampler(|c| c.temperature = GREEDY_BELOW);
        assert!(!s.config().is_greedy());
        assert_eq!(s.distribution(&extreme, &[]), vec![(0, 1.0)]);
        assert!((0..8).all(|pos| s.sample(&extreme, &vec![4; pos]) == 0));
        let d = s.distribution(&[1.0, 1.0, 0.0], &[]);
        assert_eq!(d, vec![(0, 0.5), (1, 0.5)], "ties share the mass");
    }

    #[test]
    fn masked_tokens_are_never_in_the_distribution_and_all_masked_falls_back_to_greedy() {
        let ninf = f32::NEG_INFINITY;
        let d =
            sampler(|c| c.temperature = 1e6).distribution(&[ninf, 0.0, ninf, f32::NAN, 1.0], &[]);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![4, 1]);
        assert_eq!(
            sampler(|_| ()).distribution(&[ninf; 3], &[]),
            vec![(0, 1.0)]
        );
    }

    #[test]
    fn the_race_variates_depend_on_seed_position_and_token_only() {
        let straight: Vec<f64> = {
            let mut r = KeyedRace::new(42, 9);
            (0..200).map(|t| exponential(r.uniform(t))).collect()
        };
        // Asked backwards, with gaps, and with long jumps: the same variates.
        let mut r = KeyedRace::new(42, 9);
        for t in (0..200).rev().chain([3, 5, 40, 41, 150, 7]) {
            assert_eq!(exponential(r.uniform(t)), straight[t as usize], "token {t}");
        }
        assert!(straight.iter().all(|e| (5e-17..38.0).contains(e)));
        let mean = straight.iter().sum::<f64>() / 200.0;
        assert!((0.75..1.25).contains(&mean), "Exp(1) has mean 1: {mean}");
        assert_ne!(exponential(KeyedRace::new(43, 9).uniform(0)), straight[0]);
        assert_ne!(exponential(KeyedRace::new(42, 10).uniform(0)), straight[0]);
        // A sample at position p does not depend on what was sampled before, only on p.
        let s = sampler(|c| c.seed = 42);
        let forward: Vec<u32> = (0..64).map(|p| s.sample(&LOGITS, &vec![5; p])).collect();
        let backward: Vec<u32> = (0..64)
            .rev()
            .map(|p| s.sample(&LOGITS, &vec![5; p]))
            .collect();
        assert_eq!(forward, backward.into_iter().rev().collect::<Vec<_>>());
        let other: Vec<u32> = (0..64)
            .map(|p| sampler(|c| c.seed = 43).sample(&LOGITS, &vec![5; p]))
            .collect();
        assert_ne!(forward, other, "another seed, other draws");
    }

    /// The largest deviation, in standard deviations of a binomial proportion, of a token's frequency among
    /// `samples` from `reference`'s probability for it.
    fn worst_deviation(samples: &[u32], reference: &[(u32, f32)]) -> f32 {
        let n = samples.len() as f32;
        reference
            .iter()
            .map(|&(tok, p)| {
                let f = samples.iter().filter(|&&t| t == tok).count() as f32 / n;
                (f - p).abs() / (p * (1.0 - p) / n).sqrt()
            })
            .fold(0.0, f32::max)
    }

    #[test]
    fn draws_follow_the_processed_distribution_over_positions_and_over_seeds() {
        for f in [
            (|c: &mut SamplerConfig| c.top_k = 5) as fn(&mut SamplerConfig),
            |c| c.top_p = 0.9,
            |c| c.temperature = 0.7,
        ] {
            let s = sampler(f);
            let dist = s.distribution(&LOGITS, &[]);
            let n = 20_000;
            let history = vec![0; n];
            let over_positions: Vec<u32> =
                (0..n).map(|p| s.sample(&LOGITS, &history[..p])).collect();
            let over_seeds: Vec<u32> = (0..n as u64)
                .map(|seed| {
                    sampler(|c| {
                        f(c);
                        c.seed = seed
                    })
                    .sample(&LOGITS, &[0; 7])
                })
                .collect();
            let (a, b) = (
                worst_deviation(&over_positions, &dist),
                worst_deviation(&over_seeds, &dist),
            );
            assert!(a < 5.0 && b < 5.0, "{dist:?}: {a} / {b} sd");
            // The power to see a wrong sampler: against a distribution 0.05 off, the same draws are 10+ sd away.
            let skewed: Vec<(u32, f32)> = dist
                .iter()
                .enumerate()
                .map(|(i, &(t, p))| (t, p + [0.05, -0.05].get(i).unwrap_or(&0.0)))
                .collect();
            let off = worst_deviation(&over_positions, &skewed);
            assert!(off > 10.0, "a skew of 0.05 must be seen ({off} sd)");
        }
    }

    /// Without top-k or top-p, `sample` runs the one-pass race: it must pick the support race's winner for any
    /// logits, temperature, penalty, min-p, seed and position. Vocabularies of thousands of tokens whose logits
    /// span tens of units (as a model's do), with ties and masked tokens, at temperatures from near-greedy to
    /// nearly flat; the extreme logits of the property test below as well.
    #[test]
    fn the_one_pass_race_picks_the_support_races_winner() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut skipped_cases = 0;
        for case in 0..400 {
            let n = 1 + (next() % 4000) as usize;
            let spread = [1.0, 10.0, 40.0, 200.0][case % 4];
            let logits: Vec<f32> = (0..n)
                .map(|_| match next() % 50 {
                    0 => f32::NEG_INFINITY,
                    1 => f32::NAN,
                    2 => 3.0, // ties
                    _ => ((next() % 100_000) as f32 / 100_000.0 - 0.5) * spread,
                })
                .collect();
            let temperature = [0.01, 0.3, 0.7, 1.0, 2.5, 80.0][case % 6];
            let penalty = [1.0, 1.0, 1.3][case % 3];
            let min_p = [0.0, 0.0, 0.02, 0.4][case / 7 % 4];
            let s = sampler(|c| {
                c.temperature = temperature;
                c.repetition_penalty = penalty;
                c.min_p = min_p;
                c.seed = next();
            });
            let history: Vec<u32> = (0..(next() % 300) as u32)
                .map(|t| t * 7 % n as u32)
                .collect();
            let reference = s.race(s.support(&logits, &history), history.len());
            match s.race_uncut(&logits, &history, history.len()) {
                Some(t) => assert_eq!(
                    t, reference,
                    "case {case}: n {n}, T {temperature}, penalty {penalty}, min-p {min_p}"
                ),
                None => skipped_cases += 1,
            }
            assert_eq!(s.sample(&logits, &history), reference);
        }
        assert!(
            skipped_cases < 10,
            "the one-pass race ran in most cases ({skipped_cases} fell back)"
        );
    }

    /// ChaCha8 as a device computes it (`kernels.cu`'s `chacha8_block`): the block at `counter` of stream
    /// `stream` under `key`, the djb layout (64-bit counter, 64-bit stream), four double rounds, then the input
    /// added.
    fn chacha8_block(key: &[u32; 8], counter: u64, stream: u64) -> [u32; 16] {
        let mut input = [0u32; 16];
        input[..4].copy_from_slice(&[0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574]);
        input[4..12].copy_from_slice(key);
        input[12..].copy_from_slice(&[
            counter as u32,
            (counter >> 32) as u32,
            stream as u32,
            (stream >> 32) as u32,
        ]);
        let mut x = input;
        let quarter = |x: &mut [u32; 16], a: usize, b: usize, c: usize, d: usize| {
            x[a] = x[a].wrapping_add(x[b]);
            x[d] = (x[d] ^ x[a]).rotate_left(16);
            x[c] = x[c].wrapping_add(x[d]);
            x[b] = (x[b] ^ x[c]).rotate_left(12);
            x[a] = x[a].wrapping_add(x[b]);
            x[d] = (x[d] ^ x[a]).rotate_left(8);
            x[c] = x[c].wrapping_add(x[d]);
            x[b] = (x[b] ^ x[c]).rotate_left(7);
        };
        for _ in 0..4 {
            quarter(&mut x, 0, 4, 8, 12);
            quarter(&mut x, 1, 5, 9, 13);
            quarter(&mut x, 2, 6, 10, 14);
            quarter(&mut x, 3, 7, 11, 15);
            quarter(&mut x, 0, 5, 10, 15);
            quarter(&mut x, 1, 6, 11, 12);
            quarter(&mut x, 2, 7, 8, 13);
            quarter(&mut x, 3, 4, 9, 14);
        }
        std::array::from_fn(|i| x[i].wrapping_add(input[i]))
    }

    /// A device draws a row from the race's variates without the host's generator: token `t`'s 64 bits at
    /// position `p` are words `2t` (low) and `2t + 1` of stream `p` under [`RaceSpec::key`], i.e. words
    /// `2(t mod 8)` and `2(t mod 8) + 1` of ChaCha8 block `t / 8`. Checked against the generator the host races
    /// with, over seeds, positions and tokens in any order.
    #[test]
    fn the_race_variates_are_chacha8_blocks_of_the_key_the_seed_expands_to() {
        for (seed, position) in [
            (0u64, 0usize),
            (7, 1),
            (0xdead_beef, 4095),
            (u64::MAX, 123_456),
        ] {
            let spec = RaceSpec {
                seed,
                temperature: 1.0,
                min_p: 0.0,
            };
            let key = spec.key();
            let mut race = KeyedRace::new(seed, position);
            for t in [0u32, 1, 7, 8, 9, 63, 64, 1000, 49_151, 262_143, 5] {
                let block = chacha8_block(&key, t as u64 / 8, position as u64);
                let j = 2 * (t as usize % 8);
                let bits = u64::from(block[j]) | (u64::from(block[j + 1]) << 32);
                let u = ((bits >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                assert_eq!(
                    race.uniform(t).to_bits(),
                    u.to_bits(),
                    "seed {seed} position {position} token {t}"
                );
            }
        }
    }

    /// A race's settings draw what the sampler samples, at any position, wherever the race alone decides; and
    /// only there is a race spec given.
    #[test]
    fn a_race_spec_draws_what_the_sampler_samples() {
        let logits: Vec<f32> = (0..3000)
            .map(|i| ((i * 7919) % 1000) as f32 / 97.0)
            .collect();
        for (temperature, min_p) in [(0.7, 0.0), (1.3, 0.05), (0.2, 0.0)] {
            let s = sampler(|c| {
                c.temperature = temperature;
                c.min_p = min_p;
                c.seed = 42;
            });
            let spec = s
                .race_spec()
                .expect("temperature and min-p: the race decides");
            for len in [0usize, 1, 17, 400] {
                let history: Vec<u32> = (0..len as u32).collect();
                assert_eq!(spec.draw(&logits, len), s.sample(&logits, &history));
            }
        }
        for f in [
            (|c: &mut SamplerConfig| c.top_k = 40) as fn(&mut SamplerConfig),
            |c| c.top_p = 0.9,
            |c| c.repetition_penalty = 1.1,
            |c| c.temperature = 0.0,
        ] {
            assert!(sampler(f).race_spec().is_none());
        }
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
                repetition_penalty: f32::INFINITY,
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

    /// Logits with extremes, ties and masked tokens; at least one token is unmasked.
    fn extreme_logits() -> impl Strategy<Value = Vec<f32>> {
        let value = prop_oneof![
            Just(3e38f32),
            Just(-3e38f32),
            Just(f32::MAX),
            Just(0.0f32),
            Just(1.0f32),
            Just(f32::NEG_INFINITY),
            Just(f32::MIN_POSITIVE),
            -50f32..50.0,
            -3e38f32..3e38,
        ];
        proptest::collection::vec(value, 1..40).prop_filter("one unmasked token", |l| {
            l.iter().any(|x| *x > f32::NEG_INFINITY)
        })
    }

    fn extreme_config() -> impl Strategy<Value = SamplerConfig> {
        let temperature = prop_oneof![
            Just(0.0f32),
            Just(1e-38f32),
            Just(GREEDY_BELOW),
            Just(1e6f32),
            Just(f32::MAX),
            (-40f32..7.0).prop_map(|e| 10f32.powf(e)),
        ];
        let top_p = prop_oneof![
            Just(1.0f32),
            Just(1e-30f32),
            Just(f32::MIN_POSITIVE),
            0.0f32..=1.0
        ]
        .prop_filter("top_p in (0, 1]", |p| *p > 0.0);
        let min_p = prop_oneof![Just(0.0f32), Just(0.999_999f32), 0.0f32..1.0];
        let penalty = prop_oneof![
            Just(1.0f32),
            Just(1e-45f32),
            Just(1e30f32),
            (-45f32..30.0).prop_map(|e| 10f32.powf(e)),
        ]
        .prop_filter("penalty > 0", |p| *p > 0.0 && p.is_finite());
        (temperature, 0usize..45, top_p, min_p, penalty, any::<u64>()).prop_map(
            |(temperature, top_k, top_p, min_p, repetition_penalty, seed)| SamplerConfig {
                temperature,
                top_k,
                top_p,
                min_p,
                repetition_penalty,
                seed,
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, .. ProptestConfig::default() })]

        /// Whatever the settings and logits: a normalized, sorted distribution of distinct tokens, none masked,
        /// none beyond top-k, no NaN; and every sample is a token of that distribution (greedy: an unmasked one).
        #[test]
        fn extreme_settings_never_give_a_degenerate_distribution_or_a_zero_probability_token(
            cfg in extreme_config(),
            logits in extreme_logits(),
            history in proptest::collection::vec(0u32..45, 0..12),
        ) {
            let s = Sampler::new(cfg).unwrap();
            let d = s.distribution(&logits, &history);
            prop_assert!(!d.is_empty());
            prop_assert!(d.iter().all(|&(_, p)| p.is_finite() && p > 0.0), "{:?}", d);
            let total: f64 = d.iter().map(|&(_, p)| p as f64).sum();
            prop_assert!((total - 1.0).abs() < 1e-5, "sum {}", total);
            prop_assert!(d.windows(2).all(|w| w[0].1 >= w[1].1), "sorted: {:?}", d);
            let tokens: std::collections::HashSet<u32> = d.iter().map(|x| x.0).collect();
            prop_assert_eq!(tokens.len(), d.len());
            prop_assert!(d.iter().all(|&(t, _)| logits[t as usize] > f32::NEG_INFINITY), "masked token in {:?}", d);
            if cfg.top_k > 0 {
                prop_assert!(d.len() <= cfg.top_k);
            }
            for pos in [0, 1, history.len(), history.len() + 3] {
                let mut h = history.clone();
                h.resize(pos, 0);
                let t = s.sample(&logits, &h);
                prop_assert!(logits[t as usize] > f32::NEG_INFINITY, "sampled a masked token {}", t);
                if h == history && !cfg.is_greedy() {
                    prop_assert!(tokens.contains(&t), "sampled {} outside {:?}", t, d);
                }
            }
            if cfg.top_k == 0 && cfg.top_p >= 1.0 && cfg.min_p == 0.0 && !cfg.is_greedy() {
                let reference = s.race(s.support(&logits, &history), history.len());
                prop_assert_eq!(s.sample(&logits, &history), reference);
            }
            let far = exponential(KeyedRace::new(cfg.seed, 1 << 40).uniform(0));
            prop_assert!(far.is_finite() && far > 0.0);
        }
    }
}
