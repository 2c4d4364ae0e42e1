//! The verifier: given the target's logits for every draft position, decide how many drafts to keep and which
//! token follows them.
//!
//! One rule for greedy and sampled decoding: at each draft position the verifier computes the token the AR
//! sampler would emit there ([`Sampler::sample`]: the argmax after the penalty, or the winner of the exponential
//! race over the processed distribution keyed by the request's seed and the token's absolute position). It keeps
//! the longest prefix of drafts equal to those tokens; the next token is the target's token at the first
//! mismatch, or the bonus after a fully accepted draft.
//!
//! Why this is lossless: by induction over positions, the kept context before each position is AR's, so the
//! target's distribution there is AR's, and the race keyed by that position is AR's draw. Every route therefore
//! emits AR's tokens, byte for byte, for a given seed — whatever the drafter, its widths or the controller's
//! state — and so AR's distribution. A drafter only decides how many of those tokens one forward confirms.
//! Drafters that sample run the same keyed race over their own distribution `q` ([`crate::sample`]), which
//! couples the two draws: the draft is the target's token whenever both races have the same winner, at least
//! `(1 − TV(p, q)) / (1 + TV(p, q))` of the time, and without the two distributions having to rank their
//! tokens alike. (Rejection sampling, `min(1, p/q)`, keeps a draft `1 − TV` of the time, a little more, but
//! draws its corrections from a stream that shifts with every draft, so a route's output depends on its widths.)
//!
//! Draft trees need no other rule: each row predicts the token after its node's path, and the verifier walks
//! from the root, drawing the target's token at the current row and moving to the child that carries it. The
//! same induction holds along the walked path (siblings carry distinct tokens, so at most one child matches),
//! so a tree is lossless for greedy and sampled decoding alike; siblings only give the one draw more chances to
//! meet a draft. (Tree rejection schemes that resample from residual distributions, as in SpecInfer, are not
//! needed: there is no residual to draw from.)

use super::proposer::Draft;
use crate::model::LogitRows;
use crate::sample::{Sampler, SamplerConfig};

/// The verifier's decision for one cycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The kept drafts (indices into the draft), a path from the root in order.
    pub kept: Vec<usize>,
    /// The token that follows the kept drafts (the correction or the bonus).
    pub next: u32,
}

impl Verdict {
    /// How many drafts were kept.
    pub fn accepted(&self) -> usize {
        self.kept.len()
    }

    /// The verify rows of the kept path: the pending token's (0), then each kept draft's.
    pub fn rows(&self) -> Vec<usize> {
        std::iter::once(0)
            .chain(self.kept.iter().map(|&i| i + 1))
            .collect()
    }
}

pub struct Verifier {
    sampler: Sampler,
}

impl Verifier {
    pub fn new(cfg: SamplerConfig) -> crate::Result<Self> {
        Ok(Verifier {
            sampler: Sampler::new(cfg)?,
        })
    }

    /// `logits`: `draft.len() + 1` rows of `vocab` values, one per verify row (the pending token's, then each
    /// draft's); a row predicts the token after its path (`history`: every token before the first draft, prompt
    /// included, so that its length is the first draft's position). From the root, the target's token at the
    /// current row is drawn; the child carrying it is kept and becomes the current row, until no child does.
    pub fn verify(&self, logits: &[f32], vocab: usize, history: &[u32], draft: &Draft) -> Verdict {
        assert_eq!(logits.len(), (draft.len() + 1) * vocab);
        let mut ctx = history.to_vec();
        let mut kept = Vec::new();
        let mut row = 0;
        loop {
            let t = self
                .sampler
                .sample(&logits[row * vocab..(row + 1) * vocab], &ctx);
            match draft.child(row, t) {
                Some(i) => {
                    kept.push(i);
                    ctx.push(t);
                    row = i + 1;
                }
                None => return Verdict { kept, next: t },
            }
        }
    }

    /// How a verify's rows can be decided where the logits are, each row then coming back as one token: by
    /// their argmax ([`LogitRows::Greedy`]: greedy without a repetition penalty) or by their draws
    /// ([`LogitRows::Drawn`]: sampling that the race alone decides, [`Sampler::race_spec`]). There
    /// [`Verifier::verify_decided`] on those tokens gives the verdict [`Verifier::verify`] gives on the logits;
    /// `None` where the verdict needs the logits.
    pub fn decided_rows(&self) -> Option<LogitRows> {
        let cfg = self.sampler.config();
        if cfg.is_greedy() && cfg.repetition_penalty == 1.0 {
            return Some(LogitRows::Greedy);
        }
        self.sampler.race_spec().map(LogitRows::Drawn)
    }

    /// The verdict from each row's decided token (`tokens`: `draft.len() + 1`, [`Verifier::decided_rows`]): the
    /// path of drafts equal to the target's tokens, then the target's token after it.
    pub fn verify_decided(&self, tokens: &[u32], draft: &Draft) -> Verdict {
        assert!(self.decided_rows().is_some() && tokens.len() == draft.len() + 1);
        let mut kept = Vec::new();
        let mut row = 0;
        while let Some(i) = draft.child(row, tokens[row]) {
            kept.push(i);
            row = i + 1;
        }
        Verdict {
            kept,
            next: tokens[row],
        }
    }
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
            let v = Verifier::new(SamplerConfig::greedy()).unwrap();
            let greedy: Vec<u32> = logits.chunks(vocab).map(argmax).collect();
            let drafts = Draft::chain(drafts);
            let want = v.verify(&logits, vocab, &[1, 2], &drafts);
            prop_assert_eq!(v.verify_decided(&greedy, &drafts), want);
        }
    }

    /// A random tree of `n` nodes over a small vocabulary (siblings deduplicated by construction).
    fn random_tree(picks: &[(usize, u32)]) -> Draft {
        let (mut tokens, mut parents) = (Vec::new(), Vec::new());
        for &(p, t) in picks {
            let p = p % (tokens.len() + 1);
            if (0..tokens.len()).all(|j| parents[j] != p || tokens[j] != t) {
                tokens.push(t);
                parents.push(p);
            }
        }
        Draft::tree(tokens, parents).unwrap()
    }

    proptest! {
        #[test]
        fn tree_verdicts_follow_the_targets_draw_from_the_root(
            logits in proptest::collection::vec(-2i8..2, 9 * 4),
            picks in proptest::collection::vec((0usize..8, 0u32..4), 8),
            seed in any::<u64>(),
            greedy in any::<bool>(),
        ) {
            // A vocabulary of 4: children often match, and paths run deep.
            let vocab = 4;
            let draft = random_tree(&picks);
            let rows = draft.len() + 1;
            let logits: Vec<f32> = logits[..rows * vocab].iter().map(|&v| v as f32).collect();
            let cfg = if greedy {
                SamplerConfig::greedy()
            } else {
                SamplerConfig { temperature: 1.0, seed, ..SamplerConfig::default() }
            };
            let ar = Sampler::new(cfg).unwrap();
            let v = Verifier::new(cfg).unwrap();
            let history = vec![3u32, 1];
            let verdict = v.verify(&logits, vocab, &history, &draft);
            // Each kept draft is the target's draw at its parent's row given the kept path before it, and no child
            // of the last kept row carries the draw that follows.
            let (mut ctx, mut row) = (history.clone(), 0);
            for &i in &verdict.kept {
                prop_assert_eq!(draft.parents()[i], row);
                let t = ar.sample(&logits[row * vocab..(row + 1) * vocab], &ctx);
                prop_assert_eq!(draft.tokens()[i], t);
                ctx.push(t);
                row = i + 1;
            }
            let next = ar.sample(&logits[row * vocab..(row + 1) * vocab], &ctx);
            prop_assert_eq!(verdict.next, next);
            prop_assert_eq!(draft.child(row, next), None);
            prop_assert_eq!(*verdict.rows().last().unwrap(), row);
            // The same verdict from each row's token decided where the logits are: its argmax, or its draw at
            // the position after its node (the history, then the node's depth).
            let decided: Vec<u32> = match v.decided_rows() {
                Some(LogitRows::Greedy) => logits.chunks(vocab).map(argmax).collect(),
                Some(LogitRows::Drawn(race)) => {
                    let mut depth = vec![0usize; rows];
                    for (i, &p) in draft.parents().iter().enumerate() {
                        depth[i + 1] = depth[p] + 1;
                    }
                    logits
                        .chunks(vocab)
                        .zip(&depth)
                        .map(|(l, d)| race.draw(l, history.len() + d))
                        .collect()
                }
                other => panic!("greedy and temperature-only rows are decided: {other:?}"),
            };
            prop_assert_eq!(v.verify_decided(&decided, &draft), verdict);
        }
    }

    proptest! {
        /// Sampled: the verdict keeps exactly the drafts that equal the tokens AR samples at their positions and
        /// continues with AR's token, so the emitted tokens are AR's whatever was drafted.
        #[test]
        fn sampled_verify_emits_the_tokens_ar_samples_at_those_positions(
            logits in proptest::collection::vec(-3f32..3.0, 5 * 12),
            history in proptest::collection::vec(0u32..12, 1..30),
            wrong_at in proptest::collection::vec(any::<bool>(), 4),
            seed in any::<u64>(),
            temperature in prop_oneof![Just(0.8f32), Just(1.2), Just(5.0)],
            top_p in prop_oneof![Just(1.0f32), Just(0.9)],
        ) {
            let vocab = 12;
            let cfg = SamplerConfig { temperature, top_p, repetition_penalty: 1.1, seed, ..SamplerConfig::default() };
            let ar = Sampler::new(cfg).unwrap();
            let mut ctx = history.clone();
            let mut ar_tokens = Vec::new();
            for row in logits.chunks(vocab) {
                let t = ar.sample(row, &ctx);
                ar_tokens.push(t);
                ctx.push(t);
            }
            let drafts: Vec<u32> = ar_tokens[..4]
                .iter()
                .zip(&wrong_at)
                .map(|(&t, &wrong)| if wrong { (t + 1) % vocab as u32 } else { t })
                .collect();
            let v = Verifier::new(cfg).unwrap().verify(&logits, vocab, &history, &Draft::chain(drafts.clone()));
            let accepted = v.accepted();
            prop_assert_eq!(accepted, wrong_at.iter().position(|&w| w).unwrap_or(4));
            prop_assert_eq!(v.next, ar_tokens[accepted]);
            prop_assert_eq!(&drafts[..accepted], &ar_tokens[..accepted]);
        }
    }

    #[test]
    fn a_repetition_penalty_top_k_and_top_p_need_the_logits() {
        let decided = |cfg: SamplerConfig| Verifier::new(cfg).unwrap().decided_rows();
        let sampled = SamplerConfig {
            temperature: 0.7,
            min_p: 0.05,
            seed: 9,
            ..SamplerConfig::default()
        };
        assert_eq!(decided(SamplerConfig::greedy()), Some(LogitRows::Greedy));
        assert!(matches!(decided(sampled), Some(LogitRows::Drawn(r)) if r.seed == 9));
        for cfg in [
            SamplerConfig {
                repetition_penalty: 1.3,
                ..SamplerConfig::greedy()
            },
            SamplerConfig {
                repetition_penalty: 1.3,
                ..sampled
            },
            SamplerConfig {
                top_k: 40,
                ..sampled
            },
            SamplerConfig {
                top_p: 0.9,
                ..sampled
            },
        ] {
            assert_eq!(decided(cfg), None, "{cfg:?}");
        }
    }
}
