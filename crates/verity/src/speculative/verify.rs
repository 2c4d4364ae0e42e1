//! The verifier: given the target's logits for every draft position, decide how many drafts to keep and which
//! token follows them.
//!
//! Greedy (temperature 0): keep the longest prefix where each draft equals the target's argmax (after the same
//! repetition penalty AR applies); the next token is the target's choice at the first mismatch, or the bonus
//! after a fully accepted draft. This makes greedy speculative output identical to AR output.
//!
//! Sampled: standard speculative rejection sampling (Leviathan et al.; Chen et al.). Draft `x` with proposer
//! probability `q(x)` is kept with probability `min(1, p(x)/q(x))`, where `p` is the target's *processed*
//! distribution — exactly what the AR sampler draws from ([`Sampler::distribution`]). On rejection the next token
//! is drawn from `normalize(max(0, p − q))`; after a fully accepted draft the bonus is drawn from `p`. Each
//! emitted token is then distributed exactly as AR sampling would produce it.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::sample::{draw, Sampler, SamplerConfig};

/// A proposer's distribution for one drafted token: `None` for a deterministic proposer (one-hot on the token).
pub type DraftDist = Option<Vec<(u32, f32)>>;

/// The verifier's decision for one cycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// How many drafts were kept.
    pub accepted: usize,
    /// The token that follows the kept drafts (the correction or the bonus).
    pub next: u32,
}

pub struct Verifier {
    sampler: Sampler,
    rng: ChaCha8Rng,
}

impl Verifier {
    pub fn new(cfg: SamplerConfig) -> crate::Result<Self> {
        Ok(Verifier {
            sampler: Sampler::new(cfg)?,
            // A stream distinct from the AR sampler's, derived from the same seed: reproducible per route.
            rng: ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x5eed_5eed_5eed_5eed),
        })
    }

    /// `logits`: `drafts.len() + 1` rows of `vocab` values; row `i` predicts the token after
    /// `history + drafts[..i]`. `q[i]` is the proposer's distribution for `drafts[i]`.
    pub fn verify(
        &mut self,
        logits: &[f32],
        vocab: usize,
        history: &[u32],
        drafts: &[u32],
        q: &[DraftDist],
    ) -> Verdict {
        assert_eq!(logits.len(), (drafts.len() + 1) * vocab);
        let mut ctx = history.to_vec();
        let greedy = self.sampler.config().is_greedy();
        for (i, &d) in drafts.iter().enumerate() {
            let row = &logits[i * vocab..(i + 1) * vocab];
            if greedy {
                let t = self.sampler.sample(row, &ctx);
                if t != d {
                    return Verdict {
                        accepted: i,
                        next: t,
                    };
                }
            } else {
                let p = self.sampler.distribution(row, &ctx);
                let px = prob(&p, d);
                let qx = q
                    .get(i)
                    .and_then(|q| q.as_ref())
                    .map_or(1.0, |q| prob(q, d));
                let u: f32 = self.rng.random();
                // accept with probability min(1, p/q); qx > 0 always holds for a token the proposer drew
                if qx <= 0.0 || u * qx >= px {
                    let residual = residual(&p, q.get(i).and_then(|q| q.as_ref()), d);
                    return Verdict {
                        accepted: i,
                        next: self.draw(&residual),
                    };
                }
            }
            ctx.push(d);
        }
        let last = &logits[drafts.len() * vocab..];
        let next = if greedy {
            self.sampler.sample(last, &ctx)
        } else {
            let p = self.sampler.distribution(last, &ctx);
            self.draw(&p)
        };
        Verdict {
            accepted: drafts.len(),
            next,
        }
    }

    /// Whether each row's argmax decides a verify: greedy without a repetition penalty, where
    /// [`Verifier::verify_greedy`] on the rows' argmax ([`crate::model::LogitRows::Greedy`]) gives the verdict
    /// [`Verifier::verify`] gives on their logits.
    pub fn argmax_decides(&self) -> bool {
        let cfg = self.sampler.config();
        cfg.is_greedy() && cfg.repetition_penalty == 1.0
    }

    /// The verdict from each row's argmax (`greedy`: `drafts.len() + 1` tokens), when
    /// [`Verifier::argmax_decides`]: the longest prefix of drafts equal to the target's tokens, then the target's
    /// token after it.
    pub fn verify_greedy(&self, greedy: &[u32], drafts: &[u32]) -> Verdict {
        assert!(self.argmax_decides() && greedy.len() == drafts.len() + 1);
        let accepted = drafts
            .iter()
            .zip(greedy)
            .take_while(|(d, g)| d == g)
            .count();
        Verdict {
            accepted,
            next: greedy[accepted],
        }
    }

    fn draw(&mut self, dist: &[(u32, f32)]) -> u32 {
        draw(dist, self.rng.random())
    }
}

fn prob(dist: &[(u32, f32)], t: u32) -> f32 {
    dist.iter().find(|x| x.0 == t).map_or(0.0, |x| x.1)
}

/// `normalize(max(0, p − q))`; for a one-hot `q` on `rejected`, that is `p` without `rejected`.
fn residual(p: &[(u32, f32)], q: Option<&Vec<(u32, f32)>>, rejected: u32) -> Vec<(u32, f32)> {
    let mut r: Vec<(u32, f32)> = p
        .iter()
        .map(|&(t, pt)| {
            let qt = match q {
                Some(q) => prob(q, t),
                None => (t == rejected) as u32 as f32,
            };
            (t, (pt - qt).max(0.0))
        })
        .filter(|x| x.1 > 0.0)
        .collect();
    let total: f32 = r.iter().map(|x| x.1).sum();
    if total <= 0.0 {
        // p ≤ q everywhere can only happen through rounding when p == q; then p itself is the residual's limit.
        return p.to_vec();
    }
    for x in r.iter_mut() {
        x.1 /= total;
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::argmax;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn the_rows_argmax_gives_the_verdict_the_logits_give(
            logits in proptest::collection::vec(-4i8..4, 5 * 12),
            drafts in proptest::collection::vec(0u32..12, 4),
        ) {
            // Few distinct values over a small vocabulary: ties are common, and the lowest index must win them.
            let (vocab, logits) = (12, logits.iter().map(|&v| v as f32).collect::<Vec<_>>());
            let mut v = Verifier::new(SamplerConfig::greedy()).unwrap();
            let greedy: Vec<u32> = logits.chunks(vocab).map(argmax).collect();
            let want = v.verify(&logits, vocab, &[1, 2], &drafts, &[None, None, None, None]);
            prop_assert_eq!(v.verify_greedy(&greedy, &drafts), want);
        }
    }

    #[test]
    fn a_repetition_penalty_needs_the_logits() {
        let cfg = SamplerConfig {
            repetition_penalty: 1.3,
            ..SamplerConfig::greedy()
        };
        assert!(!Verifier::new(cfg).unwrap().argmax_decides());
        assert!(Verifier::new(SamplerConfig::greedy())
            .unwrap()
            .argmax_decides());
    }
}
