//! What a proposer is: something that guesses the next tokens cheaply. The decode loop knows nothing of how a
//! proposer works; it asks for up to `k` tokens and reports which of them the verifier kept.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::AttnMask;
use crate::error::{Error, Result};
use crate::model::TargetFeatures;
use crate::sample::SamplerConfig;

/// Up to `k` proposed tokens: a chain, or a tree of alternatives that one verify forward checks together.
///
/// The verify forward's rows are the pending token (row 0, the root) and then the drafts (draft `i` is row
/// `i + 1`). Draft `i` continues the row `parents[i] ≤ i`: a chain has `parents[i] = i`. Siblings carry
/// distinct tokens, so at most one of them can be the target's. Proposers list a node's likeliest child first
/// and keep each first-child line contiguous, so an accepted main line needs no cache compaction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Draft {
    tokens: Vec<u32>,
    parents: Vec<usize>,
}

impl Draft {
    /// Drafts that follow one another.
    pub fn chain(tokens: Vec<u32>) -> Self {
        let parents = (0..tokens.len()).collect();
        Draft { tokens, parents }
    }

    /// A tree: draft `i` continues row `parents[i]` (0: the pending token; `j + 1`: draft `j`, with `j < i`).
    pub fn tree(tokens: Vec<u32>, parents: Vec<usize>) -> Result<Self> {
        if tokens.len() != parents.len() {
            return Err(Error::Invalid(format!(
                "draft tree: {} tokens but {} parents",
                tokens.len(),
                parents.len()
            )));
        }
        for (i, (&p, &t)) in parents.iter().zip(&tokens).enumerate() {
            if p > i {
                return Err(Error::Invalid(format!(
                    "draft tree: node {i}'s parent row {p} does not precede it"
                )));
            }
            if (0..i).any(|j| parents[j] == p && tokens[j] == t) {
                return Err(Error::Invalid(format!(
                    "draft tree: node {i} repeats its sibling's token {t}"
                )));
            }
        }
        Ok(Draft { tokens, parents })
    }

    /// Every draft token, in row order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Each draft's parent row.
    pub fn parents(&self) -> &[usize] {
        &self.parents
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn is_chain(&self) -> bool {
        self.parents.iter().enumerate().all(|(i, &p)| p == i)
    }

    /// Keep the first `k` drafts (a node's parent precedes it, so the rest is still a tree).
    pub fn truncate(&mut self, k: usize) {
        self.tokens.truncate(k);
        self.parents.truncate(k);
    }

    /// Merge `tokens` in as a path from the root: it follows the drafts it shares a prefix with and hangs the
    /// rest from where they part, new nodes appended while the draft holds fewer than `cap`.
    pub fn insert_path(&mut self, tokens: &[u32], cap: usize) {
        let mut row = 0;
        for &t in tokens {
            row = match self.child(row, t) {
                Some(i) => i + 1,
                None if self.len() < cap => {
                    self.tokens.push(t);
                    self.parents.push(row);
                    self.len()
                }
                None => return,
            };
        }
    }

    /// Merge every root-to-leaf path of `other` in ([`Draft::insert_path`]), its main line first.
    pub fn merge(&mut self, other: &Draft, cap: usize) {
        for leaf in (0..other.len()).filter(|&i| !other.parents.contains(&(i + 1))) {
            self.insert_path(&other.path(leaf), cap);
        }
    }

    /// The tokens from the root to draft `i`, `i` included.
    pub fn path(&self, i: usize) -> Vec<u32> {
        let mut path = Vec::new();
        let mut row = i + 1;
        while row > 0 {
            path.push(self.tokens[row - 1]);
            row = self.parents[row - 1];
        }
        path.reverse();
        path
    }

    /// The draft among row `row`'s children that carries `token`.
    pub fn child(&self, row: usize, token: u32) -> Option<usize> {
        (0..self.len()).find(|&i| self.parents[i] == row && self.tokens[i] == token)
    }

    /// How many drafts lie on the path from the root to draft `i`, `i` included.
    pub fn depth(&self, i: usize) -> usize {
        let (mut d, mut row) = (0, i + 1);
        while row > 0 {
            d += 1;
            row = self.parents[row - 1];
        }
        d
    }

    /// The longest root-to-leaf path's length.
    pub fn max_depth(&self) -> usize {
        (0..self.len()).map(|i| self.depth(i)).max().unwrap_or(0)
    }

    /// The drafts on the first-child line from the root: how many are at rows `1..` in order (a chain's length).
    pub fn main_line(&self) -> usize {
        self.parents
            .iter()
            .enumerate()
            .take_while(|&(i, &p)| p == i)
            .count()
    }

    /// The verify forward's rows (pending, then the drafts), their positions (`base` is the pending token's; a
    /// node sits one past its parent) and their mask (causal for a chain; each node sees its ancestors).
    pub fn rows(&self, pending: u32, base: usize) -> (Vec<u32>, Vec<usize>, AttnMask) {
        let mut tokens = Vec::with_capacity(self.len() + 1);
        tokens.push(pending);
        tokens.extend_from_slice(&self.tokens);
        let mut positions = vec![base];
        for &p in &self.parents {
            positions.push(positions[p] + 1);
        }
        if self.is_chain() {
            return (tokens, positions, AttnMask::Causal);
        }
        let rows = tokens.len();
        let mut visible = vec![false; rows * rows];
        for r in 0..rows {
            visible[r * rows + r] = true;
            if r > 0 {
                let p = self.parents[r - 1];
                for j in 0..rows {
                    if visible[p * rows + j] {
                        visible[r * rows + j] = true;
                    }
                }
            }
        }
        (tokens, positions, AttnMask::Tree(visible))
    }
}

/// What became of a cycle's draft.
#[derive(Debug, Clone, Copy)]
pub struct Outcome<'a> {
    pub draft: &'a Draft,
    /// The kept drafts: a path from the root, in order.
    pub kept: &'a [usize],
    /// Seconds the cycle spent drafting, and verifying (the target's forward).
    pub draft_s: f64,
    pub verify_s: f64,
}

impl<'a> Outcome<'a> {
    /// An outcome without timings (tests, and proposers reporting to an inner one).
    pub fn of(draft: &'a Draft, kept: &'a [usize]) -> Self {
        Outcome {
            draft,
            kept,
            draft_s: 0.0,
            verify_s: 0.0,
        }
    }
}

/// A draft begun in a batched step ([`Proposer::begin`]).
#[derive(Debug)]
pub enum Begun {
    /// Drafted already (by copying, or by a model that drafts alone).
    Ready(Draft),
    /// Its model's forwards wait in a queue shared with other requests' proposers: [`Proposer::run_queued`]
    /// runs them together, then [`Proposer::finish`] returns the draft.
    Queued,
}

pub trait Proposer: Send {
    fn name(&self) -> &'static str;

    /// A new request starts: forget per-request adaptation. `sampling` is the request's sampling. A proposer
    /// that samples draws the draft at position `p` with [`crate::sample::Sampler::sample`] and the request's
    /// seed: the keyed race the target's sample at `p` runs, which makes the two agree as often as their
    /// distributions allow (see [`super::verify`]).
    fn reset(&mut self, _sampling: &SamplerConfig) {}

    /// Drop everything learned from conversations (caches of earlier requests, indexes): the state of a freshly
    /// started process. Requests stay exact either way; this only changes what later drafts can build on.
    fn forget(&mut self) {}

    /// Which of the proposer's sources drafts after `context`: a proposer composed of several (copying and a
    /// model) decides here, before the width is chosen, and the decode loop keeps a width controller per source,
    /// so that each learns its own acceptance. A proposer of one source keeps the default, 0.
    fn source(&mut self, _context: &[u32]) -> usize {
        0
    }

    /// The largest width this proposer would offer now (its own adaptive cap), at most `k`.
    fn width(&self, k: usize) -> usize {
        k
    }

    /// Propose up to `k` tokens (tree nodes) continuing `context` (the prompt and every token generated so
    /// far, including the one that starts the next verify batch).
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Draft>;

    /// [`Proposer::propose`] in a batched step: where the drafting model is shared with other requests'
    /// proposers ([`Proposer::for_request`]), its forwards are queued to run together with theirs (each weight
    /// read once for all of them) and the draft is [`Begun::Queued`]; the same tokens as `propose` either way.
    fn begin(&mut self, context: &[u32], k: usize) -> Result<Begun> {
        self.propose(context, k).map(Begun::Ready)
    }

    /// Run every draft queued on this proposer's shared model, its own and other requests' (nothing where
    /// another request's proposer ran them already).
    fn run_queued(&mut self) -> Result<()> {
        Ok(())
    }

    /// The draft [`Proposer::begin`] queued, once [`Proposer::run_queued`] has run.
    fn finish(&mut self) -> Result<Draft> {
        Err(Error::Invalid(format!(
            "{}: no queued draft to finish",
            self.name()
        )))
    }

    /// After verification: what the verifier kept of the draft, and what the cycle cost. The proposer must
    /// forget everything else (its caches roll back to the kept path).
    fn observe(&mut self, outcome: &Outcome);

    /// Whether the proposer drafts on requests with images ([`crate::engine::is_media`] rows in the context):
    /// copying never copies an image's rows; an MTP head or a block drafter reads an image through the target's
    /// states over its rows (the head embeds the model's image token there). A draft model, which would need the
    /// image itself, does not: requests with images decode without it.
    fn takes_images(&self) -> bool {
        false
    }

    /// Which target hidden states the proposer conditions on (an MTP head: the final ones; a block drafter:
    /// several layers'). The engine then runs the target with that output and reports committed rows through
    /// [`Proposer::observe_hidden`].
    fn features(&self) -> TargetFeatures {
        TargetFeatures::none()
    }

    /// The target's [`Proposer::features`] of committed rows at positions `start..`, `rows × width`, row-major.
    /// Called after prefill chunks and after each cycle's commit.
    fn observe_hidden(&mut self, _start: usize, _hidden: &[f32]) {}

    /// A proposer of the same kind for one request of batched steps: the same weights (shared, not copied),
    /// its own caches and adaptation, nothing learned from earlier requests. `None` where this proposer cannot
    /// be shared (the request drafts by copying instead).
    fn for_request(&self) -> Option<Box<dyn Proposer>> {
        None
    }
}

/// A drafting model (an MTP head, a block drafter) shared by the engine's proposer and the per-request ones
/// forked from it ([`Proposer::for_request`]): requests draft one after another or in one batched call, so one
/// set of weights and work buffers serves them all; each proposer keeps its own cache (itself shared with the
/// model's queue while a batched draft waits there).
pub(crate) struct Shared<T>(Arc<Mutex<T>>);

impl<T> Shared<T> {
    pub(crate) fn new(model: T) -> Self {
        Shared(Arc::new(Mutex::new(model)))
    }

    /// Whether another holder than this one is left.
    pub(crate) fn is_shared(&self) -> bool {
        Arc::strong_count(&self.0) > 1
    }

    /// The model, for one drafting step. A lock poisoned by a panic mid-draft is taken over: a draft can only
    /// change how many tokens a cycle keeps, never which.
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Shared(self.0.clone())
    }
}

/// A per-request proposer's cache of a shared drafting model, and what its draft queued for a batched call
/// returned once the queue has run (shared with the model's queue while the draft waits there).
pub(crate) struct Slot<C, R> {
    pub(crate) cache: C,
    pub(crate) drafted: Option<R>,
}

impl<C, R> Slot<C, R> {
    pub(crate) fn new(cache: C) -> Shared<Self> {
        Shared::new(Slot {
            cache,
            drafted: None,
        })
    }
}

/// A draft queued on a shared drafting model ([`Proposer::begin`]): its inputs and its request's slot.
struct Queued<J, C, R> {
    job: J,
    slot: Shared<Slot<C, R>>,
}

/// A drafting model shared by per-request proposers, with the drafts they queued in a batched step: job `J`
/// over a request's cache `C`, giving it `R`.
pub(crate) struct Queue<M, J, C, R> {
    pub(crate) model: M,
    queued: Vec<Queued<J, C, R>>,
}

impl<M, J, C, R> Queue<M, J, C, R> {
    pub(crate) fn new(model: M) -> Shared<Self> {
        Shared::new(Queue {
            model,
            queued: Vec::new(),
        })
    }

    /// Queue `job` over the cache in `slot`.
    pub(crate) fn push(&mut self, job: J, slot: &Shared<Slot<C, R>>) {
        let slot = slot.clone();
        self.queued.push(Queued { job, slot });
    }

    /// Run the queue as one batched call: `run` takes the model and every job with its request's cache and
    /// returns each one's result in order, which goes to the request's slot ([`Proposer::finish`] takes it from
    /// there). A job whose request is gone (its step failed before the queue ran, and its proposer with it) is
    /// dropped unrun.
    pub(crate) fn run(
        &mut self,
        run: impl FnOnce(&mut M, &mut [(&J, &mut C)]) -> Result<Vec<R>>,
    ) -> Result<()> {
        let mut queue = std::mem::take(&mut self.queued);
        queue.retain(|q| q.slot.is_shared());
        if queue.is_empty() {
            return Ok(());
        }
        let mut slots: Vec<MutexGuard<Slot<C, R>>> = queue.iter().map(|q| q.slot.lock()).collect();
        let mut jobs: Vec<(&J, &mut C)> = queue
            .iter()
            .zip(slots.iter_mut())
            .map(|(q, slot)| (&q.job, &mut slot.cache))
            .collect();
        let drafted = run(&mut self.model, &mut jobs)?;
        drop(jobs);
        for (slot, d) in slots.iter_mut().zip(drafted) {
            slot.drafted = Some(d);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_is_a_causal_run_of_positions() {
        let d = Draft::chain(vec![7, 8, 9]);
        assert!(d.is_chain());
        assert_eq!(d.main_line(), 3);
        assert_eq!(d.max_depth(), 3);
        let (tokens, positions, mask) = d.rows(5, 10);
        assert_eq!(tokens, vec![5, 7, 8, 9]);
        assert_eq!(positions, vec![10, 11, 12, 13]);
        assert_eq!(mask, AttnMask::Causal);
    }

    #[test]
    fn a_tree_node_sees_its_ancestors_and_sits_one_past_its_parent() {
        // root ─ a(1) ─ b(2) ─ c(3)
        //      └ d(4) ─ e(5)
        //        a    └ f(6)
        let d = Draft::tree(vec![1, 2, 3, 4, 5, 6], vec![0, 1, 2, 0, 4, 1]).unwrap();
        assert!(!d.is_chain());
        assert_eq!(d.main_line(), 3);
        assert_eq!(d.max_depth(), 3);
        assert_eq!(d.child(0, 4), Some(3));
        assert_eq!(d.child(1, 6), Some(5));
        assert_eq!(d.child(1, 4), None);
        let (_, positions, mask) = d.rows(0, 100);
        assert_eq!(positions, vec![100, 101, 102, 103, 101, 102, 102]);
        let sees = |i, j| mask.sees(7, i, j);
        assert!(sees(6, 0) && sees(6, 1) && sees(6, 6));
        assert!(!sees(6, 2) && !sees(6, 4) && !sees(6, 5));
        assert!(sees(5, 4) && sees(5, 0) && !sees(5, 1));
        assert!(sees(3, 2) && sees(3, 1) && !sees(3, 4));
    }

    #[test]
    fn inserted_paths_share_their_common_prefix() {
        let mut d = Draft::chain(vec![1, 2, 3]);
        d.insert_path(&[1, 2, 4, 5], 16);
        d.insert_path(&[6], 16);
        d.insert_path(&[1, 2, 3], 16);
        assert_eq!(d.tokens(), &[1, 2, 3, 4, 5, 6]);
        assert_eq!(d.parents(), &[0, 1, 2, 2, 4, 0]);
        assert_eq!(d.path(4), vec![1, 2, 4, 5]);
        let mut m = Draft::chain(vec![1, 2]);
        m.merge(&d, 16);
        assert_eq!(m, d, "merged in leaf order: the same tree");
        // The cap stops new nodes, not the walk along shared ones.
        d.insert_path(&[1, 7, 8], 7);
        d.insert_path(&[9], 7);
        assert_eq!(d.tokens(), &[1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(d.parents(), &[0, 1, 2, 2, 4, 0, 1]);
    }

    #[test]
    fn a_queued_draft_whose_proposer_is_gone_is_not_run() {
        let queue: Shared<Queue<u32, u32, Vec<u32>, u32>> = Queue::new(100);
        let live = Slot::new(vec![1]);
        let gone = Slot::new(vec![2]);
        queue.lock().push(10, &live);
        queue.lock().push(20, &gone);
        drop(gone);
        let mut ran = Vec::new();
        queue
            .lock()
            .run(|model, jobs| {
                ran = jobs.iter().map(|(j, c)| (**j, c[0])).collect();
                Ok(jobs.iter().map(|(j, _)| *model + **j).collect())
            })
            .unwrap();
        assert_eq!(ran, vec![(10, 1)]);
        assert_eq!(live.lock().drafted, Some(110));
        assert!(queue.lock().queued.is_empty(), "a run empties the queue");
    }

    #[test]
    fn malformed_trees_are_refused() {
        assert!(Draft::tree(vec![1, 2], vec![0]).is_err());
        assert!(
            Draft::tree(vec![1, 2], vec![0, 2]).is_err(),
            "parent after the node"
        );
        assert!(
            Draft::tree(vec![1, 1], vec![0, 0]).is_err(),
            "twin siblings"
        );
        assert!(Draft::tree(vec![1, 1], vec![0, 1]).is_ok());
    }
}
