//! The draft-model proposer: a second (smaller) bundle with the same tokenizer drafts `k` tokens
//! autoregressively with its own KV cache.
//!
//! Invariants: the draft cache holds exactly the K/V of `cached` (a prefix of the context). Before drafting it
//! catches up with the context in one batched forward; after verification it is truncated to the kept path, so
//! a rejected draft never leaves state behind. With sampling, the draft at position `p` is the drafter's sample
//! from its own processed distribution `q` (its own settings may differ from the target's) with the request's
//! seed, so it runs the keyed race the target's sample at `p` runs (see [`super::verify`]).

use super::proposer::{Draft, Outcome, Proposer};
use crate::backend::Backend;
use crate::cache::KvCache;
use crate::error::{Error, Result};
use crate::model::{Batch, LogitRows, Model};
use crate::sample::{argmax, Sampler, SamplerConfig};

pub struct DraftModel<B: Backend> {
    model: Model<B>,
    cache: KvCache<B>,
    /// Tokens whose K/V the draft cache holds.
    cached: Vec<u32>,
    /// Context length when the last draft was made (to roll back to on observe).
    base: usize,
    sampler: Sampler,
    /// Fixed drafting settings (their seed aside); `None` = follow each request's sampling.
    fixed: Option<SamplerConfig>,
}

impl<B: Backend> DraftModel<B> {
    /// `fixed`: drafting settings that differ from the requests' (e.g. a hotter drafter); `None` drafts with
    /// each request's own sampling settings. The seed is always the request's, so that drafts and the target's
    /// samples share each position's keyed race.
    pub fn new(model: Model<B>, target_vocab: usize, fixed: Option<SamplerConfig>) -> Result<Self> {
        let sampling = fixed.unwrap_or_default();
        if model.hp.vocab > target_vocab {
            return Err(Error::Invalid(format!(
                "the draft model's vocabulary ({}) is larger than the target's ({target_vocab}): not the same tokenizer",
                model.hp.vocab
            )));
        }
        let cache = model.new_cache(model.hp.context_len);
        Ok(DraftModel {
            model,
            cache,
            cached: Vec::new(),
            base: 0,
            sampler: Sampler::new(sampling)?,
            fixed,
        })
    }
}

impl<B: Backend> Proposer for DraftModel<B> {
    fn name(&self) -> &'static str {
        "draft-model"
    }

    fn forget(&mut self) {
        self.cache.truncate(0);
        self.cached.clear();
        self.base = 0;
    }

    fn reset(&mut self, sampling: &SamplerConfig) {
        let cfg = SamplerConfig {
            seed: sampling.seed,
            ..self.fixed.unwrap_or(*sampling)
        };
        self.sampler = Sampler::new(cfg).expect("validated by the request");
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Draft> {
        if k == 0 || context.is_empty() {
            return Ok(Draft::default());
        }
        // Roll back to the common prefix, then catch up in one batched forward.
        let common = self
            .cached
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len() - 1);
        let common = self.cache.truncate(common);
        self.cached.truncate(common);
        let room = self.cache.max_capacity().saturating_sub(context.len() + k);
        if room == 0 {
            return Ok(Draft::default());
        }
        let out = self.model.forward(
            &mut self.cache,
            &Batch::causal(&context[common..], common),
            LogitRows::Last,
            &[],
        )?;
        self.cached.extend_from_slice(&context[common..]);
        self.base = context.len();
        let mut logits = out.logits;
        let mut tokens = Vec::with_capacity(k);
        let mut history = context.to_vec();
        for i in 0..k {
            // Greedy drafts take the plain argmax (no penalty: a draft's quality, not the output, depends on it).
            let tok = if self.sampler.config().is_greedy() {
                argmax(&logits)
            } else {
                self.sampler.sample(&logits, &history)
            };
            tokens.push(tok);
            history.push(tok);
            if i + 1 < k {
                let pos = self.cached.len();
                logits = self
                    .model
                    .forward(
                        &mut self.cache,
                        &Batch::causal(&[tok], pos),
                        LogitRows::Last,
                        &[],
                    )?
                    .logits;
                self.cached.push(tok);
            }
        }
        Ok(Draft::chain(tokens))
    }

    fn observe(&mut self, outcome: &Outcome) {
        // Keep the context plus the accepted drafts that the cache already holds (its drafts are one chain).
        let accepted = outcome
            .kept
            .iter()
            .enumerate()
            .take_while(|&(i, &d)| i == d)
            .count();
        let keep = (self.base + accepted).min(self.cached.len());
        let keep = self.cache.truncate(keep);
        self.cached.truncate(keep);
    }
}
