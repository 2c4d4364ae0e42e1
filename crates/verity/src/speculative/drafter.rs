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
//!   conversation). A gap in the reported states (a prefix restored from a checkpoint that kept none) restarts
//!   the context at the first position with states; without the states of every position before `pending` the
//!   drafter proposes nothing.
//! - Greedy drafts are a tree ([`best_tree`]): from the block's per-position distributions, the `k` nodes most
//!   likely to be accepted — each position's best token continues the main line, its second best hangs beside
//!   it — verified in one forward like any tree.
//! - In batched steps the per-request proposers of one drafter queue their greedy drafts ([`Proposer::begin`]),
//!   each with the context rows it has still to add, and the first to run the queue adds every request's rows in
//!   one pass and drafts every block in one forward ([`BlockDrafter::draft_batched`]), each request's context
//!   cache and logits bitwise its own calls'.
//! - With sampling, the draft at position `p` is the drafter's sample from its distribution there with the
//!   request's seed: the keyed race the target's sample at `p` runs (see [`super::verify`]), so the output is
//!   sampled AR's whatever the drafter proposes.

use super::proposer::{Begun, Draft, Outcome, Proposer, Queue, Shared, Slot};
use crate::backend::Backend;
use crate::cache::KvCache;
use crate::error::{Error, Result};
use crate::model::{BlockDraft, BlockDrafter, TargetFeatures};
use crate::sample::{Sampler, SamplerConfig};

/// A drafter and the greedy drafts its per-request proposers queued in a batched step.
type SharedDrafter<B> = Queue<BlockDrafter<B>, BlockJob, KvCache<B>, Vec<f32>>;

/// A block draft's inputs but the cache ([`BlockDraft`]'s).
struct BlockJob {
    context: Vec<f32>,
    pending: u32,
    pos: usize,
    k: usize,
}

pub struct DrafterProposer<B: Backend> {
    /// The drafter, shared with the per-request proposers of batched steps ([`Proposer::for_request`]).
    drafter: Shared<SharedDrafter<B>>,
    /// Its block length, the target layers it reads and their values per position.
    block: usize,
    layers: Vec<usize>,
    state_width: usize,
    context_len: usize,
    /// Its context cache (and a queued draft's logits).
    slot: Shared<Slot<KvCache<B>, Vec<f32>>>,
    /// The width of the greedy draft queued, if any.
    queued: usize,
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
        Self::sharing(Queue::new(drafter), vocab, context_len)
    }

    /// A proposer of its own over a shared drafter.
    fn sharing(
        drafter: Shared<SharedDrafter<B>>,
        vocab: usize,
        context_len: usize,
    ) -> Result<Self> {
        let (cache, block, layers, state_width) = {
            let d = &drafter.lock().model;
            let spec = d.spec();
            let layers = spec.target_layers.clone();
            (
                d.new_cache(context_len),
                spec.block,
                layers,
                d.state_width(),
            )
        };
        Ok(DrafterProposer {
            vocab,
            drafter,
            block,
            layers,
            state_width,
            context_len,
            slot: Slot::new(cache),
            queued: 0,
            first: 0,
            cached: Vec::new(),
            states_start: 0,
            states: Vec::new(),
            sampler: Sampler::new(SamplerConfig::greedy())?,
        })
    }

    fn state_rows(&self) -> usize {
        self.states.len() / self.state_width
    }

    /// Roll the drafter's context back to what agrees with `context` and find what bringing it to every position
    /// before `pending` (the last of `context`, at `n`) takes: `Some(next)`, the positions `next..n` to add
    /// (none where `next == n`), counted as cached from here on; `None` when the target states they need are not
    /// known (or the cache has no room for them and a draft).
    fn catch_up(&mut self, context: &[u32]) -> Option<usize> {
        let n = context.len().checked_sub(1).filter(|&n| n > 0)?;
        let mut slot = self.slot.lock();
        let cache = &mut slot.cache;
        let agree = self
            .cached
            .iter()
            .zip(context[..n].get(self.first..).unwrap_or(&[]))
            .take_while(|(a, b)| a == b)
            .count();
        self.cached.truncate(agree);
        cache.truncate(agree);
        let mut next = self.first + agree;
        let states_end = self.states_start + self.state_rows();
        if next == n {
            return Some(n);
        }
        if self.states.is_empty() || states_end < n || self.states_start >= n {
            return None;
        }
        if next < self.states_start || self.cached.is_empty() {
            // Restart the context where the target's states begin.
            self.first = self.states_start;
            self.cached.clear();
            cache.truncate(0);
            next = self.first;
        }
        if cache.len() + n - next + 1 > cache.max_capacity() {
            return None;
        }
        self.cached.extend_from_slice(&context[next..n]);
        Some(next)
    }

    /// The target states of positions `next..n` (after [`DrafterProposer::catch_up`]).
    fn new_states(&self, next: usize, n: usize) -> &[f32] {
        let w = self.state_width;
        match next {
            _ if next == n => &[],
            _ => &self.states[(next - self.states_start) * w..(n - self.states_start) * w],
        }
    }

    /// Positions `next..n` added (or queued to be): the next cycle needs the target states from `n` on, which
    /// its verify reports.
    fn consumed(&mut self, next: usize, n: usize) {
        if next < n {
            self.states.clear();
            self.states_start = n;
        }
    }

    /// Add the context of positions `next..n` now.
    fn extend(&mut self, next: usize, n: usize) -> Result<()> {
        if next < n {
            let mut shared = self.drafter.lock();
            let mut slot = self.slot.lock();
            shared
                .model
                .extend_context(&mut slot.cache, next, self.new_states(next, n))?;
        }
        self.consumed(next, n);
        Ok(())
    }

    /// The width of a draft of up to `k` positions with `adding` context rows still to add: as many as the
    /// cache has room for.
    fn fit(&self, k: usize, adding: usize) -> usize {
        let slot = self.slot.lock();
        let room = slot.cache.max_capacity() - (slot.cache.len() + adding);
        k.min(room.saturating_sub(1))
    }

    /// The greedy draft from the drafter's logits for `k` positions: the tree of the `k` nodes likeliest accepted.
    fn greedy_tree(drafter: &BlockDrafter<B>, logits: &[f32], k: usize) -> Draft {
        let rows: Vec<[(u32, f32); 2]> = logits
            .chunks_exact(drafter.draft_vocab_len())
            .map(|row| {
                let [(a, pa), (b, pb)] = top2(row);
                [(drafter.token(a), pa), (drafter.token(b), pb)]
            })
            .collect();
        best_tree(&rows, k)
    }
}

/// The two likeliest entries of a row of logits, with their softmax probabilities (the first of equal logits
/// first, as the argmax picks it).
fn top2(logits: &[f32]) -> [(usize, f32); 2] {
    let (mut a, mut b) = (0, usize::MAX);
    for (i, &l) in logits.iter().enumerate().skip(1) {
        if l > logits[a] {
            b = a;
            a = i;
        } else if b == usize::MAX || l > logits[b] {
            b = i;
        }
    }
    let b = if b == usize::MAX { a } else { b };
    let z: f32 = logits.iter().map(|&l| (l - logits[a]).exp()).sum();
    [(a, 1.0 / z), (b, (logits[b] - logits[a]).exp() / z)]
}

/// The `k` drafts most likely to be accepted, from each drafted position's two likeliest tokens and their
/// probabilities (`rows[d]`: position `d + 1` after the pending token). A node's value is the probability that
/// the path to it is accepted, by the drafter's estimate: the main line's node at depth `d` is worth the product
/// of the best probabilities to `d`; the second best at depth `d`, a leaf beside it, is worth the main line's
/// value at `d - 1` times its own probability. The `k` most valuable nodes form a tree (a node is worth less than
/// its parent), laid out main line first.
pub fn best_tree(rows: &[[(u32, f32); 2]], k: usize) -> Draft {
    // (value, depth, alternate?) of every candidate node.
    let mut nodes = Vec::with_capacity(2 * rows.len());
    let mut line = 1.0f32;
    for (d, [(_, p1), (t2, p2)]) in rows.iter().enumerate() {
        if *t2 != rows[d][0].0 {
            nodes.push((line * p2, d, true));
        }
        line *= p1;
        nodes.push((line, d, false));
    }
    // Most valuable first; among equals the shallower, and the main line before its alternate.
    nodes.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    nodes.truncate(k);
    let depth = nodes.iter().filter(|n| !n.2).count();
    let mut tokens: Vec<u32> = rows[..depth].iter().map(|r| r[0].0).collect();
    let mut parents: Vec<usize> = (0..depth).collect();
    let mut alternates: Vec<usize> = nodes.iter().filter(|n| n.2).map(|n| n.1).collect();
    alternates.sort_unstable();
    for d in alternates.into_iter().filter(|&d| d <= depth) {
        tokens.push(rows[d][1].0);
        parents.push(d);
    }
    Draft::tree(tokens, parents).expect("distinct siblings, parents before children")
}

impl<B: Backend> Proposer for DrafterProposer<B> {
    fn name(&self) -> &'static str {
        "drafter"
    }

    fn forget(&mut self) {
        self.slot.lock().cache.truncate(0);
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
        k.min(self.block - 1)
    }

    fn features(&self) -> TargetFeatures {
        TargetFeatures::layers(self.layers.clone())
    }

    /// The drafter reads the context through the target's states alone; the one token it embeds is the pending
    /// one, never an image's row (a prompt does not end inside an image).
    fn takes_images(&self) -> bool {
        true
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
        let Some(next) = (k > 0).then(|| self.catch_up(context)).flatten() else {
            return Ok(Draft::default());
        };
        let n = context.len() - 1;
        self.extend(next, n)?;
        let k = self.fit(k, 0);
        if k == 0 {
            return Ok(Draft::default());
        }
        let mut shared = self.drafter.lock();
        let drafter = &mut shared.model;
        let logits = drafter.draft(&mut self.slot.lock().cache, context[n], n, k)?;
        if self.sampler.config().is_greedy() {
            return Ok(Self::greedy_tree(drafter, &logits, k));
        }
        // Sampled over the full vocabulary, tokens outside the draft vocabulary at probability 0.
        let mut full = vec![f32::NEG_INFINITY; self.vocab];
        let mut history = context.to_vec();
        for row in logits.chunks_exact(drafter.draft_vocab_len()) {
            for (i, &l) in row.iter().enumerate() {
                full[drafter.token(i) as usize] = l;
            }
            let t = self.sampler.sample(&full, &history);
            history.push(t);
        }
        Ok(Draft::chain(history[context.len()..].to_vec()))
    }

    fn begin(&mut self, context: &[u32], k: usize) -> Result<Begun> {
        if !self.sampler.config().is_greedy() {
            return self.propose(context, k).map(Begun::Ready);
        }
        let k = self.width(k);
        let Some(next) = (k > 0).then(|| self.catch_up(context)).flatten() else {
            return Ok(Begun::Ready(Draft::default()));
        };
        let n = context.len() - 1;
        let k = self.fit(k, n - next);
        if k == 0 {
            // Nothing to draft: the context still catches up, as in `propose`.
            self.extend(next, n)?;
            return Ok(Begun::Ready(Draft::default()));
        }
        let job = BlockJob {
            context: self.new_states(next, n).to_vec(),
            pending: context[n],
            pos: n,
            k,
        };
        self.consumed(next, n);
        self.drafter.lock().push(job, &self.slot);
        self.queued = k;
        Ok(Begun::Queued)
    }

    fn run_queued(&mut self) -> Result<()> {
        self.drafter.lock().run(|drafter, jobs| {
            let mut drafts: Vec<BlockDraft<B>> = jobs
                .iter_mut()
                .map(|(j, cache)| BlockDraft {
                    cache,
                    context: &j.context,
                    pending: j.pending,
                    pos: j.pos,
                    k: j.k,
                })
                .collect();
            drafter.draft_batched(&mut drafts)
        })
    }

    fn finish(&mut self) -> Result<Draft> {
        let logits = self.slot.lock().drafted.take();
        match logits {
            Some(logits) => {
                let shared = self.drafter.lock();
                Ok(Self::greedy_tree(&shared.model, &logits, self.queued))
            }
            None => Err(Error::Invalid(
                "drafter: the queued draft has not run".into(),
            )),
        }
    }

    fn observe(&mut self, _outcome: &Outcome) {
        // The cache holds committed context only; the kept positions' context comes from their target states
        // in the next cycle.
        let mut slot = self.slot.lock();
        slot.drafted = None;
        slot.cache.truncate(self.cached.len());
    }

    fn for_request(&self) -> Option<Box<dyn Proposer>> {
        let p = Self::sharing(self.drafter.clone(), self.vocab, self.context_len).ok()?;
        Some(Box::new(p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top2_takes_the_first_of_equal_logits_and_normalises() {
        let [(a, pa), (b, pb)] = top2(&[0.0, 2.0, 2.0, 1.0]);
        assert_eq!((a, b), (1, 2));
        assert!((pa - pb).abs() < 1e-7 && pa > 0.3 && pa < 0.5);
    }

    #[test]
    fn confident_positions_make_a_chain_and_doubtful_ones_branch() {
        // Sure of every position: the k best nodes are the main line.
        let sure = [[(10, 0.95), (11, 0.03)]; 5];
        let d = best_tree(&sure, 4);
        assert!(d.is_chain());
        assert_eq!(d.tokens(), [10, 10, 10, 10]);
        // A coin flip at the first position: its second best beats the deep main line.
        let rows = [
            [(1, 0.5), (2, 0.45)],
            [(3, 0.9), (4, 0.05)],
            [(5, 0.9), (6, 0.05)],
            [(7, 0.9), (8, 0.05)],
        ];
        let d = best_tree(&rows, 4);
        assert_eq!(d.tokens(), [1, 3, 5, 2]);
        assert_eq!(d.parents(), [0, 1, 2, 0]);
        assert_eq!(best_tree(&rows, 1).tokens(), [1]);
    }
}
