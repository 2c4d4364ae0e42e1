//! Copy first, then a model proposer: when the context's suffix has a full-length (`MAX_MATCH`-gram) earlier
//! match, the suffix-copy proposer's tokens are the cycle's drafts (copying is free, and long matches run long);
//! otherwise the inner proposer drafts, and a shorter match's continuations join its drafts as branches of one
//! tree where the width leaves room. On a copied cycle the inner proposer still catches up
//! ([`Proposer::catch_up`]), so a stateful drafter (an MTP head's cache) stays aligned with the target.
//! The copy proposer learns only from the cycles it drafted (its width, its silence after misses).

use super::copy::{SuffixCopy, MAX_MATCH};
use super::proposer::{Draft, Proposer};
use crate::error::Result;
use crate::sample::SamplerConfig;

pub struct CopyFirst {
    copy: SuffixCopy,
    inner: Box<dyn Proposer>,
    /// Whether the current cycle's drafts are copied.
    copied: bool,
}

impl CopyFirst {
    pub fn new(inner: Box<dyn Proposer>) -> Self {
        CopyFirst {
            copy: SuffixCopy::new(),
            inner,
            copied: false,
        }
    }
}

impl Proposer for CopyFirst {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn forget(&mut self) {
        self.copy.forget();
        self.inner.forget();
    }

    fn reset(&mut self, sampling: &SamplerConfig) {
        self.copy.reset(sampling);
        self.inner.reset(sampling);
    }

    fn width(&self, k: usize) -> usize {
        self.inner.width(k)
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Draft> {
        self.copied = false;
        match self.copy.lookup(context, k) {
            Some((m, draft)) if m == MAX_MATCH && draft.main_line() >= 2 => {
                self.inner.catch_up(context)?;
                self.copied = true;
                Ok(draft)
            }
            shorter => {
                let mut draft = self.inner.propose(context, k)?;
                // A shorter match still names what followed before: its continuations join the inner drafts as
                // branches, in the rows the inner proposer left of the budget.
                if let Some((_, copied)) = shorter {
                    draft.merge(&copied, k);
                }
                Ok(draft)
            }
        }
    }

    fn observe(&mut self, draft: &Draft, kept: &[usize]) {
        if self.copied {
            self.copy.observe(draft, kept);
            self.inner.observe(&Draft::default(), &[]);
        } else {
            self.inner.observe(draft, kept);
        }
        self.copied = false;
    }

    fn catch_up(&mut self, context: &[u32]) -> Result<()> {
        self.inner.catch_up(context)
    }

    fn wants_hidden(&self) -> bool {
        self.inner.wants_hidden()
    }

    fn observe_hidden(&mut self, start: usize, hidden: &[f32]) {
        self.inner.observe_hidden(start, hidden);
    }
}
