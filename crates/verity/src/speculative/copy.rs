//! The suffix-copy proposer (prompt lookup): if the recent tokens occurred earlier in the prompt or the answer,
//! propose what followed them then. Free to run, and very effective when the answer copies its input (edits,
//! code refactors, quoting).
//!
//! Where the matched n-gram was followed by different tokens at different places, the draft is a tree: the
//! latest occurrence's continuation is the main line and up to `BRANCHES − 1` others hang beside it, so one
//! verify tries every way the text went on before.
//!
//! Invariants:
//! - The index holds, for each n-gram length in `MIN_MATCH..=MAX_MATCH`, the latest positions (up to
//!   `BRANCHES`, latest first) after which each n-gram was followed by a token, one per distinct following
//!   token; it is extended incrementally as the context grows (O(MAX_MATCH · BRANCHES) per token) and rebuilt
//!   when the context diverges (a rolled-back draft is never indexed: only confirmed context is).
//! - Width adapts per window: start at `MIN_WIDTH`, grow to `MAX_WIDTH` after a fully accepted window, back to
//!   `MIN_WIDTH` after a window with under half accepted; two consecutive first-token misses silence the proposer
//!   for the next `SILENCE` tokens of context (counted in tokens, so silence ends even when nothing is asked).

use std::collections::HashMap;

use super::proposer::{Draft, Outcome, Proposer};
use crate::error::Result;

pub const MIN_MATCH: usize = 2;
pub const MAX_MATCH: usize = 4;
pub const MIN_WIDTH: usize = 3;
pub const MAX_WIDTH: usize = 7;
pub const SILENCE: usize = 8;
/// Distinct continuations kept per n-gram: the main line and the branches beside it.
pub const BRANCHES: usize = 3;
/// The most tokens a branch (not the main line) offers: the less recent continuations are the less likely.
pub const BRANCH_LEN: usize = 3;

#[derive(Debug, Default)]
pub struct SuffixCopy {
    /// `index[n - MIN_MATCH]`: n-gram → end positions (exclusive) of its latest occurrences that have a
    /// successor, one per distinct successor, latest first.
    index: Vec<HashMap<Vec<u32>, Vec<usize>>>,
    /// The context as far as it has been indexed.
    seen: Vec<u32>,
    width: usize,
    first_misses: usize,
    /// Propose nothing until the context reaches this length.
    silent_until: usize,
}

impl SuffixCopy {
    pub fn new() -> Self {
        SuffixCopy {
            index: (MIN_MATCH..=MAX_MATCH).map(|_| HashMap::new()).collect(),
            seen: Vec::new(),
            width: MIN_WIDTH,
            first_misses: 0,
            silent_until: 0,
        }
    }

    /// Bring the index in line with `context`: drop what diverged, index what is new.
    fn sync(&mut self, context: &[u32]) {
        let common = self
            .seen
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count();
        if common < self.seen.len() {
            // Rare (a new conversation): rebuild rather than un-index.
            self.index.iter_mut().for_each(|m| m.clear());
            self.seen.clear();
        }
        for &t in &context[self.seen.len()..] {
            // Position `self.seen.len()` now has a successor: index every n-gram ending there.
            let end = self.seen.len();
            for n in MIN_MATCH..=MAX_MATCH {
                if end >= n {
                    let ends = self.index[n - MIN_MATCH]
                        .entry(self.seen[end - n..end].to_vec())
                        .or_default();
                    ends.retain(|&e| self.seen[e] != t);
                    ends.insert(0, end);
                    ends.truncate(BRANCHES);
                }
            }
            self.seen.push(t);
        }
    }
}

impl SuffixCopy {
    /// The longest earlier match of the context's suffix: its n-gram length and a draft of at most `k` tokens:
    /// up to `width` that followed its latest occurrence, then, while `k` allows, up to `BRANCH_LEN` of what
    /// followed each earlier occurrence that went on differently. `None` while silenced or without a match.
    pub fn lookup(&mut self, context: &[u32], k: usize) -> Option<(usize, Draft)> {
        self.sync(context);
        if context.len() < self.silent_until || k == 0 {
            return None;
        }
        let len = context.len();
        for n in (MIN_MATCH..=MAX_MATCH).rev() {
            if len < n {
                continue;
            }
            // The suffix itself was indexed only once a successor arrived, so every hit is an earlier occurrence.
            let Some(ends) = self.index[n - MIN_MATCH].get(&context[len - n..]) else {
                continue;
            };
            let mut draft = Draft::default();
            for (b, &end) in ends.iter().enumerate() {
                let take = if b == 0 { self.width } else { BRANCH_LEN };
                draft.insert_path(&context[end..(end + take).min(len)], k);
            }
            return (!draft.is_empty()).then_some((n, draft));
        }
        None
    }
}

impl Proposer for SuffixCopy {
    fn name(&self) -> &'static str {
        "copy"
    }

    fn forget(&mut self) {
        *self = SuffixCopy::new();
    }

    fn for_request(&self) -> Option<Box<dyn Proposer>> {
        Some(Box::new(SuffixCopy::new()))
    }

    fn reset(&mut self, _sampling: &crate::sample::SamplerConfig) {
        self.width = MIN_WIDTH;
        self.first_misses = 0;
        self.silent_until = 0;
    }

    fn width(&self, k: usize) -> usize {
        self.width.min(k)
    }

    fn takes_images(&self) -> bool {
        true
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Draft> {
        // An image's rows are not tokens: a match that would copy one drafts nothing.
        Ok(self
            .lookup(context, k)
            .map(|(_, draft)| draft)
            .filter(|d| !d.tokens().iter().any(|&t| crate::engine::is_media(t)))
            .unwrap_or_default())
    }

    fn observe(&mut self, outcome: &Outcome) {
        let (drafted, accepted) = (outcome.draft.max_depth(), outcome.kept.len());
        if drafted == 0 {
            return;
        }
        if accepted == 0 {
            self.first_misses += 1;
            if self.first_misses >= 2 {
                self.silent_until = self.seen.len() + SILENCE;
                self.first_misses = 0;
            }
        } else {
            self.first_misses = 0;
        }
        if accepted == drafted {
            self.width = MAX_WIDTH;
        } else if accepted * 2 < drafted {
            self.width = MIN_WIDTH;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Report a chain of `drafted` tokens whose first `accepted` were kept.
    fn seen(p: &mut SuffixCopy, drafted: usize, accepted: usize) {
        let kept: Vec<usize> = (0..accepted).collect();
        p.observe(&Outcome::of(&Draft::chain(vec![0; drafted]), &kept));
    }

    #[test]
    fn proposes_what_followed_the_longest_earlier_match() {
        let mut p = SuffixCopy::new();
        // "1 2 3 4 5 6 7 8 9 ... 1 2 3" → propose 4 5 6 (width 3).
        let ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3];
        assert_eq!(p.propose(&ctx, 16).unwrap().tokens(), vec![4, 5, 6]);
        // The longer match wins over a more recent shorter one: "… 9 3 4 0 … 2 3 4" prefers after "2 3 4".
        let mut p = SuffixCopy::new();
        let ctx = [2, 3, 4, 10, 11, 12, 9, 3, 4, 20, 21, 2, 3, 4];
        assert_eq!(p.propose(&ctx, 16).unwrap().tokens(), vec![10, 11, 12]);
    }

    #[test]
    fn earlier_occurrences_that_went_on_differently_become_branches() {
        let mut p = SuffixCopy::new();
        // "1 2" was followed by 3, then by 4, then by 5: the latest (5 6 7) is the main line, 4 8 9 and 3 0 0
        // hang beside it (up to BRANCH_LEN each), every first token distinct.
        let ctx = [1, 2, 3, 0, 0, 1, 2, 4, 8, 9, 1, 2, 5, 6, 7, 1, 2];
        let d = p.propose(&ctx, 16).unwrap();
        assert_eq!(d.tokens(), &[5, 6, 7, 4, 8, 9, 3, 0, 0]);
        assert_eq!(d.parents(), &[0, 1, 2, 0, 4, 5, 0, 7, 8]);
        assert_eq!(d.main_line(), 3);
        // A smaller budget cuts the branches first.
        let d = p.propose(&ctx, 4).unwrap();
        assert_eq!(d.tokens(), &[5, 6, 7, 4]);
        assert_eq!(d.parents(), &[0, 1, 2, 0]);
        // The same successor twice is one branch, the latest.
        let mut p = SuffixCopy::new();
        let ctx = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2];
        assert_eq!(p.propose(&ctx, 16).unwrap(), Draft::chain(vec![3, 8, 1]));
    }

    #[test]
    fn no_match_proposes_nothing() {
        let mut p = SuffixCopy::new();
        assert!(p.propose(&[1, 2, 3, 4, 5], 8).unwrap().is_empty());
    }

    #[test]
    fn width_grows_after_full_acceptance_and_shrinks_after_poor_windows() {
        let mut p = SuffixCopy::new();
        assert_eq!(p.width(16), MIN_WIDTH);
        seen(&mut p, 3, 3);
        assert_eq!(p.width(16), MAX_WIDTH);
        seen(&mut p, 7, 2);
        assert_eq!(p.width(16), MIN_WIDTH);
    }

    #[test]
    fn two_first_token_misses_silence_it_for_a_while() {
        let mut p = SuffixCopy::new();
        let mut ctx = vec![1, 2, 3, 4, 1, 2];
        seen(&mut p, 3, 0);
        assert_eq!(p.propose(&ctx, 8).unwrap().tokens(), vec![3, 4, 1]);
        seen(&mut p, 3, 0);
        // Silent for the next SILENCE tokens of context, however often it is asked.
        for t in 0..SILENCE {
            assert!(p.propose(&ctx, 8).unwrap().is_empty());
            assert!(p.propose(&ctx, 8).unwrap().is_empty());
            ctx.push(if t % 2 == 0 { 1 } else { 2 });
        }
        assert!(!p.propose(&ctx, 8).unwrap().is_empty());
    }

    #[test]
    fn a_diverging_context_rebuilds_the_index() {
        let mut p = SuffixCopy::new();
        p.propose(&[7, 8, 9, 1, 7, 8], 8).unwrap();
        // A different conversation: nothing of the old one may be proposed.
        assert!(p.propose(&[5, 5, 6, 7, 8], 8).unwrap().is_empty());
    }
}
