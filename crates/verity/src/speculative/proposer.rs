//! What a proposer is: something that guesses the next tokens cheaply. The decode loop knows nothing of how a
//! proposer works; it asks for up to `k` tokens and reports what the verifier kept.

use crate::error::Result;
use crate::sample::SamplerConfig;

/// Up to `k` proposed tokens.
#[derive(Debug, Clone, Default)]
pub struct Draft {
    pub tokens: Vec<u32>,
}

impl Draft {
    pub fn new(tokens: Vec<u32>) -> Self {
        Draft { tokens }
    }
}

pub trait Proposer: Send {
    fn name(&self) -> &'static str;

    /// A new request starts: forget per-request adaptation. `sampling` is the request's sampling. A proposer
    /// that samples draws the draft at position `p` with [`crate::sample::Sampler::sample`] and the request's
    /// seed: the keyed race the target's sample at `p` runs, which makes the two agree as often as their
    /// distributions allow (see [`super::verify`]).
    fn reset(&mut self, _sampling: &SamplerConfig) {}

    /// The largest width this proposer would offer now (its own adaptive cap), at most `k`.
    fn width(&self, k: usize) -> usize {
        k
    }

    /// Propose up to `k` tokens continuing `context` (the prompt and every token generated so far, including the
    /// one that starts the next verify batch).
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Draft>;

    /// After verification: `drafted` tokens were offered and the first `accepted` were kept. The proposer must
    /// forget everything past them (its caches roll back to the kept path).
    fn observe(&mut self, drafted: usize, accepted: usize);

    /// Bring the proposer's own state up to `context` without drafting (a cycle another proposer drafts; see
    /// [`super::copy_first::CopyFirst`]). Stateless proposers have nothing to do.
    fn catch_up(&mut self, _context: &[u32]) -> Result<()> {
        Ok(())
    }

    /// Whether the proposer conditions on the target's final hidden states (an MTP head). The engine then runs
    /// the target with hidden-state output and reports committed rows through [`Proposer::observe_hidden`].
    fn wants_hidden(&self) -> bool {
        false
    }

    /// The target's final hidden states (after its output norm) of committed rows at positions `start..`,
    /// `rows × hidden`, row-major. Called after prefill chunks and after each cycle's commit.
    fn observe_hidden(&mut self, _start: usize, _hidden: &[f32]) {}
}
