//! The native-MTP proposer: the bundle's multi-token-prediction head drafts by applying itself recursively.
//!
//! Each cycle first *catches up*: the head runs over every position committed since its last cycle, each row
//! conditioned on the target's final hidden state of the position before (reported by the engine through
//! [`Proposer::observe_hidden`]); the last row's prediction is draft 1. Drafts 2..d feed the head its own output
//! state and its previous draft. The controller picks `d` each cycle from measured acceptance per depth and
//! measured verify cost per width (the adaptive-depth governor).
//!
//! Invariants:
//! - **Cache alignment.** Head cache slot `i` holds position `first + i`, and every slot up to the committed
//!   mark was computed from the target's hidden state and a committed token. Recursive drafting writes slots past
//!   the mark; [`Proposer::observe`] truncates back to it, so a rejected (or even an accepted) draft's slot is
//!   never kept — accepted positions are recomputed from the target's hidden state in the next catch-up. (The
//!   reference system's drafter-offset bug was a head cache one position off the target's commits.)
//! - A context that no longer agrees with the head's cached tokens rolls the head back to the agreeing prefix
//!   (also across requests: a follow-up turn keeps the head's cache of the shared conversation);
//!   a gap in the reported hidden states (a restored prefix) restarts the head's cache at the first position it
//!   can condition; without the hidden state of the position before `pending` the head proposes nothing.
//! - Cycles another proposer drafts (the route composes the head with copying and other models:
//!   [`super::chooser::Chooser`]) leave the head idle: the hidden states they report accumulate, and the next
//!   catch-up covers every position since the head last drafted.
//! - With sampling, the draft at position `p` is the head's sample from its processed distribution `q`
//!   with the request's seed: the keyed race the target's sample at `p` runs (see [`super::verify`]).
//! - Greedy drafts run as one chain on the backend ([`MtpHead::draft_greedy`]): each recursive step's token is
//!   the step before's argmax, picked where it lies, so the host queues the catch-up and every step at once and
//!   waits once — the same tokens as stepping through the host.
//! - In batched steps the per-request proposers of one head queue their greedy drafts ([`Proposer::begin`]) and
//!   the first to run the queue drafts for all of them in one batched call ([`MtpHead::draft_greedy_batched`]):
//!   each of the head's forwards then reads its weights once for every request instead of once per request,
//!   with each request's tokens and head cache bitwise what its own draft gives.

use super::proposer::{Begun, Draft, Outcome, Proposer, Queue, Shared, Slot};
use crate::backend::Backend;
use crate::cache::KvCache;
use crate::error::{Error, Result};
use crate::model::{HeadDraft, HeadInput, HeadOutput, MtpHead, TargetFeatures};
use crate::sample::{Sampler, SamplerConfig};

/// The deepest recursion offered to the controller.
pub const MAX_DEPTH: usize = 8;

/// A head and the greedy drafts its per-request proposers queued in a batched step.
type SharedHead<B> = Queue<MtpHead<B>, GreedyDraft, KvCache<B>, Vec<u32>>;

/// A greedy draft's inputs but the cache ([`MtpHead::draft_greedy`]'s).
struct GreedyDraft {
    tokens: Vec<u32>,
    start: usize,
    hidden: Vec<f32>,
    depth: usize,
}

pub struct MtpProposer<B: Backend> {
    /// The head, shared with the per-request proposers of batched steps ([`Proposer::for_request`]).
    head: Shared<SharedHead<B>>,
    /// Its head cache (and a queued draft's tokens).
    slot: Shared<Slot<KvCache<B>, Vec<u32>>>,
    vocab: usize,
    hidden: usize,
    context_len: usize,
    /// Position of head cache slot 0.
    first: usize,
    /// The tokens at the positions the head cache holds (up to the committed mark).
    cached: Vec<u32>,
    /// Slots computed from committed inputs; drafting writes past this mark.
    committed: usize,
    /// Target hidden states for positions `hid_start..`, `rows × hidden`.
    hid_start: usize,
    hid: Vec<f32>,
    sampler: Sampler,
    /// Greedy drafts as one chain on the backend ([`MtpHead::draft_greedy`]); `VERITY_MTP_CHAIN=0`: step by
    /// step, each token through the host (side-by-side measurements).
    chain: bool,
}

impl<B: Backend> MtpProposer<B> {
    pub fn new(head: MtpHead<B>, vocab: usize, context_len: usize) -> Result<Self> {
        Self::sharing(Queue::new(head), vocab, context_len)
    }

    /// A proposer of its own over a shared head.
    fn sharing(head: Shared<SharedHead<B>>, vocab: usize, context_len: usize) -> Result<Self> {
        let (cache, hidden) = {
            let h = &head.lock().model;
            (h.new_cache(context_len), h.hidden_size())
        };
        Ok(MtpProposer {
            head,
            slot: Slot::new(cache),
            vocab,
            hidden,
            context_len,
            first: 0,
            cached: Vec::new(),
            committed: 0,
            hid_start: 0,
            hid: Vec::new(),
            sampler: Sampler::new(SamplerConfig::greedy())?,
            chain: !matches!(std::env::var("VERITY_MTP_CHAIN").as_deref(), Ok("0")),
        })
    }

    fn hidden_rows(&self) -> usize {
        self.hid.len() / self.hidden
    }

    /// Whether drafts are the head's argmax (greedy sampling).
    fn greedy(&self) -> bool {
        self.sampler.config().is_greedy()
    }

    /// Roll the head back to slots that still agree with `context`.
    fn align(&mut self, context: &[u32]) {
        let agree = self
            .cached
            .iter()
            .zip(context.get(self.first..).unwrap_or(&[]))
            .take_while(|(a, b)| a == b)
            .count();
        self.cached.truncate(agree);
        self.slot.lock().cache.truncate(agree);
        self.committed = agree;
    }

    /// Pick the token at position `history.len()` from a head step's output (over the draft vocabulary). Greedy
    /// drafts are the head's argmax (no penalty: a draft's quality, not the output, depends on it), which the
    /// step returns alone ([`MtpProposer::greedy`]); sampled ones are the head's sample with the request's
    /// seed at that position, tokens outside the draft vocabulary at probability 0.
    fn choose(&self, out: &HeadOutput, history: &[u32]) -> u32 {
        let head = &self.head.lock().model;
        if let Some(t) = out.greedy {
            return head.token(t as usize);
        }
        let mut full = vec![f32::NEG_INFINITY; self.vocab];
        for (i, &l) in out.logits.iter().enumerate() {
            full[head.token(i) as usize] = l;
        }
        self.sampler.sample(&full, history)
    }

    /// Align the head with `context` and find the positions its catch-up covers, `next..=n` (`n`: the position
    /// of `pending`); `None` when the target's hidden state before `pending` is not known yet.
    fn prepare(&mut self, context: &[u32]) -> Option<(usize, usize)> {
        if context.len() < 2 {
            return None;
        }
        let n = context.len() - 1;
        self.align(context);
        let hid_end = self.hid_start + self.hidden_rows(); // hidden known for positions < hid_end
        if self.hid.is_empty() || hid_end < n || self.hid_start >= n {
            return None;
        }
        let mut next = self.first + self.cached.len();
        if self.cached.is_empty() || next < self.hid_start + 1 {
            // Start (or restart) the head's cache where the target's hidden states begin.
            self.first = self.hid_start + 1;
            self.cached.clear();
            self.slot.lock().cache.truncate(0);
            next = self.first;
        } else if next > n {
            // Asked again without a commit in between: redo position `n` only.
            let keep = n - self.first;
            self.cached.truncate(keep);
            self.slot.lock().cache.truncate(keep);
            next = n;
        }
        Some((next, n))
    }

    /// The target states a catch-up over positions `next..=n` conditions on (row `i`: the state of the position
    /// before `next + i`).
    fn catch_up_states(&self, next: usize, n: usize) -> &[f32] {
        let h = self.hidden;
        &self.hid[(next - 1 - self.hid_start) * h..(n - self.hid_start) * h]
    }

    /// The depth of a greedy draft of up to `k` tokens after a catch-up over positions `next..=n` (as deep as the
    /// head cache has room for); the catch-up counts as committed from here on.
    fn commit_catch_up(&mut self, context: &[u32], next: usize, n: usize, k: usize) -> usize {
        let caught = n + 1 - next;
        let slot = self.slot.lock();
        let before = slot.cache.len();
        let room = slot.cache.max_capacity().saturating_sub(before + caught);
        self.cached.extend_from_slice(&context[next..=n]);
        self.committed = before + caught;
        k.min(MAX_DEPTH).min(room + 1)
    }

    /// The head over positions `next..=n`, each row conditioned on the target's hidden state of the one before;
    /// the last row's output predicts draft 1.
    fn run_catch_up(&mut self, context: &[u32], next: usize, n: usize) -> Result<HeadOutput> {
        let greedy = self.greedy();
        let rows = self.catch_up_states(next, n);
        let mut head = self.head.lock();
        let mut slot = self.slot.lock();
        let out = head.model.draft(
            &mut slot.cache,
            &context[next..=n],
            next,
            HeadInput::Host(rows),
            greedy,
        )?;
        self.cached.extend_from_slice(&context[next..=n]);
        self.committed = slot.cache.len();
        // Consumed: the next catch-up starts at n + 1 and needs h_n onwards, which the next verify reports.
        self.hid.clear();
        Ok(out)
    }
}

impl<B: Backend> Proposer for MtpProposer<B> {
    fn name(&self) -> &'static str {
        "mtp"
    }

    fn forget(&mut self) {
        self.slot.lock().cache.truncate(0);
        self.cached.clear();
        self.first = 0;
        self.committed = 0;
        self.hid.clear();
        self.hid_start = 0;
    }

    fn reset(&mut self, sampling: &SamplerConfig) {
        self.sampler = Sampler::new(*sampling).expect("validated by the request");
        // The head's cache is kept: the next propose rolls it back to the prefix the new context shares (a
        // follow-up turn continues where the last one ended instead of recomputing the conversation).
        self.hid.clear();
        self.hid_start = 0;
    }

    fn width(&self, k: usize) -> usize {
        k.min(MAX_DEPTH)
    }

    fn features(&self) -> TargetFeatures {
        TargetFeatures::final_state()
    }

    fn takes_images(&self) -> bool {
        self.head.lock().model.reads_images()
    }

    fn observe_hidden(&mut self, start: usize, hidden: &[f32]) {
        if !self.hid.is_empty() && start == self.hid_start + self.hidden_rows() {
            self.hid.extend_from_slice(hidden);
        } else {
            self.hid_start = start;
            self.hid.clear();
            self.hid.extend_from_slice(hidden);
        }
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Draft> {
        if k == 0 {
            return Ok(Draft::default());
        }
        let Some((next, n)) = self.prepare(context) else {
            return Ok(Draft::default());
        };
        let greedy = self.greedy();
        if greedy && self.chain {
            // Every draft step's inputs but its token are known ahead: the catch-up and the recursive steps run
            // as one chain on the backend, with one download (as many steps as the head cache holds).
            let depth = self.commit_catch_up(context, next, n, k);
            let tokens = {
                let rows = self.catch_up_states(next, n);
                let mut slot = self.slot.lock();
                let head = &mut self.head.lock().model;
                head.draft_greedy(&mut slot.cache, &context[next..=n], next, rows, depth)?
            };
            // Consumed: the next catch-up starts at n + 1 and needs h_n onwards, which the next verify reports.
            self.hid.clear();
            return Ok(Draft::chain(tokens));
        }
        let mut out = self.run_catch_up(context, next, n)?;
        let mut tokens = Vec::new();
        let mut history = context.to_vec();
        for i in 0..k.min(MAX_DEPTH) {
            let tok = self.choose(&out, &history);
            tokens.push(tok);
            history.push(tok);
            if i + 1 < k.min(MAX_DEPTH) {
                let mut head = self.head.lock();
                let mut slot = self.slot.lock();
                if slot.cache.len() + 1 > slot.cache.max_capacity() {
                    break;
                }
                // The head's own output state, left on the device by the step before.
                out = head.model.draft(
                    &mut slot.cache,
                    &[tok],
                    n + 1 + i,
                    HeadInput::Last,
                    greedy,
                )?;
            }
        }
        Ok(Draft::chain(tokens))
    }

    fn begin(&mut self, context: &[u32], k: usize) -> Result<Begun> {
        if k == 0 || !(self.greedy() && self.chain) {
            return self.propose(context, k).map(Begun::Ready);
        }
        let Some((next, n)) = self.prepare(context) else {
            return Ok(Begun::Ready(Draft::default()));
        };
        let job = GreedyDraft {
            depth: self.commit_catch_up(context, next, n, k),
            tokens: context[next..=n].to_vec(),
            start: next,
            hidden: self.catch_up_states(next, n).to_vec(),
        };
        self.hid.clear();
        self.head.lock().push(job, &self.slot);
        Ok(Begun::Queued)
    }

    fn run_queued(&mut self) -> Result<()> {
        self.head.lock().run(|head, jobs| {
            let mut drafts: Vec<HeadDraft<B>> = jobs
                .iter_mut()
                .map(|(j, cache)| HeadDraft::new(cache, &j.tokens, j.start, &j.hidden, j.depth))
                .collect();
            head.draft_greedy_batched(&mut drafts)
        })
    }

    fn finish(&mut self) -> Result<Draft> {
        match self.slot.lock().drafted.take() {
            Some(tokens) => Ok(Draft::chain(tokens)),
            None => Err(Error::Invalid("mtp: the queued draft has not run".into())),
        }
    }

    fn observe(&mut self, _outcome: &Outcome) {
        let mut slot = self.slot.lock();
        slot.drafted = None;
        slot.cache.truncate(self.committed);
    }

    fn for_request(&self) -> Option<Box<dyn Proposer>> {
        let mut p = Self::sharing(self.head.clone(), self.vocab, self.context_len).ok()?;
        p.chain = self.chain;
        Some(Box::new(p))
    }
}
