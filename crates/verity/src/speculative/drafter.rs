//! The block-drafter proposer: the bundle's DFlash-style drafter proposes a whole block in one forward
//! ([`BlockDrafter`]), conditioned on the target's states at several layers for every committed position.
//!
//! Each cycle first brings the drafter's context up to the pending token: the target states of the positions
//! committed since the last cycle (reported by the engine through [`Proposer::observe_hidden`]) are fused and
//! cached; then one forward over `[pending, mask, …]` drafts every position of the block.
//!
//! Invariants:
//! - **Context alignment.** Drafter cache slot `i` holds the context of position `first + i`, computed from the
//!   target's states at that committed position; the cache never holds anything else (a draft's block rows are
//!   written past its end and never kept), so nothing of a rejected draft survives a cycle.
//! - A context that no longer agrees with the tokens the drafter's context was computed for rolls it back to the
//!   agreeing prefix (also across requests: a follow-up turn keeps the drafter's context of the shared
//!   conversation). A gap in the reported states (a prefix restored from a checkpoint, which keeps final states
//!   only) restarts the context at the first position with states; without the states of every position before
//!   `pending` the drafter proposes nothing.
//! - With sampling, the draft at position `p` is the drafter's sample from its distribution there with the
//!   request's seed: the keyed race the target's sample at `p` runs (see [`super::verify`]), so the output is
//!   sampled AR's whatever the drafter proposes.

use super::proposer::{Draft, Outcome, Proposer};
use crate::backend::Backend;
use crate::cache::KvCache;
use crate::error::Result;
use crate::model::{BlockDrafter, TargetFeatures};
use crate::sample::{Sampler, SamplerConfig};

pub struct DrafterProposer<B: Backend> {
    drafter: BlockDrafter<B>,
    cache: KvCache<B>,
    /// Position of cache slot 0.
    first: usize,
    /// The tokens of the positions whose context the cache holds.
    cached: Vec<u32>,
    /// Target states for positions `states_start..`, `rows × state_width`.
    states_start: usize,
    states: Vec<f32>,
    sampler: Sampler,
    vocab: usize,
}

impl<B: Backend> DrafterProposer<B> {
    pub fn new(drafter: BlockDrafter<B>, vocab: usize, context_len: usize) -> Result<Self> {
        let cache = drafter.new_cache(context_len);
        Ok(DrafterProposer {
            vocab,
            drafter,
            cache,
            first: 0,
            cached: Vec::new(),
            states_start: 0,
            states: Vec::new(),
            sampler: Sampler::new(SamplerConfig::greedy())?,
        })
    }

    fn state_rows(&self) -> usize {
        self.states.len() / self.drafter.state_width()
    }

    /// Bring the drafter's context to every position before `pending` (the last of `context`); false when the
    /// target states it needs are not known.
    fn prepare(&mut self, context: &[u32]) -> Result<bool> {
        let Some(n) = context.len().checked_sub(1).filter(|&n| n > 0) else {
            return Ok(false);
        };
        // Roll back to the slots that still agree with the context.
        let agree = self
            .cached
            .iter()
            .zip(context[..n].get(self.first..).unwrap_or(&[]))
            .take_while(|(a, b)| a == b)
            .count();
        self.cached.truncate(agree);
        self.cache.truncate(agree);
        let mut next = self.first + agree;
        let states_end = self.states_start + self.state_rows();
        if next == n {
            return Ok(true);
        }
        if self.states.is_empty() || states_end < n || self.states_start >= n {
            return Ok(false);
        }
        if next < self.states_start || self.cached.is_empty() {
            // Restart the context where the target's states begin.
            self.first = self.states_start;
            self.cached.clear();
            self.cache.truncate(0);
            next = self.first;
        }
        let w = self.drafter.state_width();
        let rows = &self.states[(next - self.states_start) * w..(n - self.states_start) * w];
        if rows.is_empty() {
            return Ok(true);
        }
        if self.cache.len() + n - next + 1 > self.cache.max_capacity() {
            return Ok(false);
        }
        self.drafter.extend_context(&mut self.cache, next, rows)?;
        self.cached.extend_from_slice(&context[next..n]);
        // Consumed: the next cycle needs the states from `n` on, which its verify reports.
        self.states.clear();
        self.states_start = n;
        Ok(true)
    }
}

impl<B: Backend> Proposer for DrafterProposer<B> {
    fn name(&self) -> &'static str {
        "drafter"
    }

    fn forget(&mut self) {
        self.cache.truncate(0);
        self.cached.clear();
        self.first = 0;
        self.states.clear();
        self.states_start = 0;
    }

    fn reset(&mut self, sampling: &SamplerConfig) {
        self.sampler = Sampler::new(*sampling).expect("validated by the request");
        // The context is kept: the next propose rolls it back to the prefix the new context shares.
        self.states.clear();
        self.states_start = 0;
    }

    fn width(&self, k: usize) -> usize {
        k.min(self.drafter.spec().block - 1)
    }

    fn features(&self) -> TargetFeatures {
        TargetFeatures::Layers(self.drafter.spec().target_layers.clone())
    }

    fn observe_hidden(&mut self, start: usize, hidden: &[f32]) {
        if self.states.is_empty() || start != self.states_start + self.state_rows() {
            self.states.clear();
            self.states_start = start;
        }
        self.states.extend_from_slice(hidden);
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Draft> {
        let k = self.width(k);
        if k == 0 || !self.prepare(context)? {
            return Ok(Draft::default());
        }
        let n = context.len() - 1;
        let room = self.cache.max_capacity() - self.cache.len();
        let k = k.min(room.saturating_sub(1));
        if k == 0 {
            return Ok(Draft::default());
        }
        let greedy = self.sampler.config().is_greedy();
        let out = self
            .drafter
            .draft(&mut self.cache, context[n], n, k, greedy)?;
        if greedy {
            return Ok(Draft::chain(out.greedy));
        }
        // Sampled over the full vocabulary, tokens outside the draft vocabulary at probability 0.
        let n = self.drafter.draft_vocab_len();
        let mut full = vec![f32::NEG_INFINITY; self.vocab];
        let mut history = context.to_vec();
        for row in out.logits.chunks_exact(n) {
            for (i, &l) in row.iter().enumerate() {
                full[self.drafter.token(i) as usize] = l;
            }
            let t = self.sampler.sample(&full, &history);
            history.push(t);
        }
        Ok(Draft::chain(history[context.len()..].to_vec()))
    }

    fn catch_up(&mut self, context: &[u32]) -> Result<()> {
        self.prepare(context).map(|_| ())
    }

    fn observe(&mut self, _outcome: &Outcome) {
        // The cache holds committed context only; the kept positions' context comes from their target states
        // in the next cycle.
        self.cache.truncate(self.cached.len());
    }
}
