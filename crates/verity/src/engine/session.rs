//! A conversation's model state between turns.

use crate::backend::Backend;
use crate::cache::KvCache;
use crate::model::TargetFeatures;
use crate::speculative::Proposer;

/// A conversation's model state: the cache and the tokens whose K/V it holds.
pub struct Session<B: Backend> {
    pub cache: KvCache<B>,
    pub tokens: Vec<u32>,
    /// The target's hidden states of committed positions that the route's proposer conditions on (an MTP
    /// head's final states, a block drafter's layers), kept so that a follow-up turn's proposer sees the whole
    /// conversation, not only the new part.
    pub(super) hidden: HiddenTrail,
}

impl<B: Backend> Session<B> {
    pub(super) fn new(cache: KvCache<B>) -> Self {
        Session {
            cache,
            tokens: Vec::new(),
            hidden: HiddenTrail::default(),
        }
    }

    /// Forget everything from position `pos` on: cache, tokens and hidden states; returns the fill kept (`pos`,
    /// or 0 where the cache's rings no longer hold the window before `pos`).
    pub(super) fn truncate(&mut self, pos: usize) -> usize {
        let kept = self.cache.truncate(pos);
        self.tokens.truncate(kept);
        self.hidden.truncate(kept);
        kept
    }
}

/// Hidden states (of one [`TargetFeatures`] kind) of a contiguous run of committed positions `start..start + rows`.
#[derive(Debug, Default)]
pub(super) struct HiddenTrail {
    pub(super) start: usize,
    pub(super) kind: TargetFeatures,
    width: usize,
    pub(super) rows: Vec<f32>,
}

impl HiddenTrail {
    pub(super) fn end(&self) -> usize {
        self.start + self.rows.len().checked_div(self.width).unwrap_or(0)
    }

    /// The rows of positions `0..len`, where the run starts at 0 and reaches `len`.
    pub(super) fn leading_rows(&self, len: usize) -> Option<&[f32]> {
        (self.start == 0 && self.end() >= len && len > 0).then(|| &self.rows[..len * self.width])
    }

    /// Hand a proposer conditioning on `kind` the states of every position up to `end` (a prompt's body, once
    /// it is in the cache), where the run holds them and reaches exactly there.
    pub(super) fn hand_to(&self, p: &mut dyn Proposer, kind: &TargetFeatures, end: usize) {
        if !kind.is_none() && self.kind == *kind && self.end() == end && !self.rows.is_empty() {
            p.observe_hidden(self.start, &self.rows);
        }
    }

    /// Forget positions `pos..`.
    pub(super) fn truncate(&mut self, pos: usize) {
        if pos <= self.start {
            self.rows.clear();
            self.start = pos;
        } else if pos < self.end() {
            self.rows.truncate((pos - self.start) * self.width);
        }
    }

    /// Rows of `kind` (`width` values each) for positions `pos..`: appended when they continue the run, else
    /// they start a new one.
    pub(super) fn push(&mut self, pos: usize, rows: &[f32], kind: &TargetFeatures, width: usize) {
        if self.kind != *kind || self.width != width || pos != self.end() {
            self.rows.clear();
            self.start = pos;
            self.kind = kind.clone();
            self.width = width;
        }
        self.rows.extend_from_slice(rows);
    }
}
