//! The chooser: each cycle, who drafts — copying from the context (free; judged per match length) or the
//! bundle's model proposer (an MTP head, a draft model) — by the tokens per second each has measurably yielded in
//! this request.
//!
//! A cycle's yield is the tokens it emitted (kept drafts and the target's next token) over the seconds it took
//! (drafting and verifying). Where the context's suffix has an earlier match of length `n`, copying competes
//! with the model proposer: the prior until both sides have a few cycles on record (copy a full-length match of
//! two tokens or more, as long matches run long; else the model, with the match's continuations as branches of
//! its draft tree where the width leaves room; each side is tried where the prior would not pick it), then the
//! higher measured rate, the loser retried now and then so that a change in the text is noticed. Without a
//! match the model drafts. The decision comes before the width ([`Proposer::source`]): the decode loop keeps a
//! width controller per source, so the model's acceptance is learned from the model's cycles alone and where
//! its drafts do not pay (prose, for an MTP head) its controller falls back to plain AR steps while copying
//! keeps drafting its matches. (A contest between the model and AR steps decided here from per-cycle wall times
//! was measured to lose to that: too few cycles per request to tell them apart.)
//!
//! On a copied cycle the model proposer still catches up ([`Proposer::catch_up`]), so a stateful drafter (an
//! MTP head's cache) stays aligned with the target; its time counts in the copied cycle's cost. Each proposer
//! learns (widths, silence) only from the cycles it drafted.

use super::copy::{SuffixCopy, MAX_MATCH, MIN_MATCH};
use super::proposer::{Draft, Outcome, Proposer};
use crate::error::Result;
use crate::model::TargetFeatures;
use crate::sample::SamplerConfig;

/// Cycles each side needs on record before measured rates replace the prior.
const TRIES: u32 = 2;
/// A side that loses is retried after this many cycles it could have drafted.
const RETRY_AFTER: u32 = 24;
/// EMA weight of a new cycle.
const ALPHA: f64 = 0.25;

/// Measured yield of one side: EMAs of tokens and seconds per cycle.
#[derive(Debug, Default, Clone, Copy)]
struct Yield {
    tokens: f64,
    seconds: f64,
    cycles: u32,
    /// Cycles this side could have drafted since it last did.
    passed_over: u32,
}

impl Yield {
    fn record(&mut self, tokens: f64, seconds: f64) {
        if self.cycles == 0 {
            (self.tokens, self.seconds) = (tokens, seconds);
        } else {
            self.tokens += ALPHA * (tokens - self.tokens);
            self.seconds += ALPHA * (seconds - self.seconds);
        }
        self.cycles += 1;
        self.passed_over = 0;
    }

    fn rate(&self) -> f64 {
        self.tokens / self.seconds.max(1e-9)
    }

    fn known(&self) -> bool {
        self.cycles >= TRIES
    }
}

/// Who drafts a cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// Copying, after a match of this length.
    Copy(usize),
    Model,
}

/// A cycle's decision: who drafts after a context of `at` tokens, and the copy match seen there (its draft at
/// the widest width, cut to the cycle's width when it drafts).
struct Decision {
    at: usize,
    source: Source,
    matched: Option<(usize, Draft)>,
}

pub struct Chooser {
    copy: SuffixCopy,
    model: Box<dyn Proposer>,
    /// Copying's yield per match length (`MIN_MATCH..=MAX_MATCH`).
    copy_yield: [Yield; MAX_MATCH - MIN_MATCH + 1],
    model_yield: Yield,
    /// The current cycle's decision ([`Proposer::source`]), until it is observed.
    decision: Option<Decision>,
}

/// Whether side `a` drafts rather than side `b`: `prior` until both have a record (a side without one is tried
/// first), then the higher measured rate, the loser retried once it was passed over `RETRY_AFTER` times.
fn first_wins(a: &mut Yield, b: &mut Yield, prior: bool) -> bool {
    let a_wins = match (a.known(), b.known()) {
        (false, true) => true,
        (true, false) => false,
        (false, false) => prior,
        (true, true) if a.rate() >= b.rate() => b.passed_over < RETRY_AFTER,
        (true, true) => a.passed_over >= RETRY_AFTER,
    };
    if a_wins {
        b.passed_over += 1;
    } else {
        a.passed_over += 1;
    }
    a_wins
}

impl Chooser {
    pub fn new(model: Box<dyn Proposer>) -> Self {
        Chooser {
            copy: SuffixCopy::new(),
            model,
            copy_yield: Default::default(),
            model_yield: Yield::default(),
            decision: None,
        }
    }

    /// Who drafts after `context`: the copy-or-model contest where the context has a copy match. Decided once
    /// per cycle.
    fn decide(&mut self, context: &[u32]) -> Source {
        if let Some(d) = self.decision.as_ref().filter(|d| d.at == context.len()) {
            return d.source;
        }
        let matched = self.copy.lookup(context, super::controller::MAX_K);
        let source = match &matched {
            Some((n, draft)) => {
                let prior = *n == MAX_MATCH && draft.main_line() >= 2;
                if first_wins(
                    &mut self.copy_yield[n - MIN_MATCH],
                    &mut self.model_yield,
                    prior,
                ) {
                    Source::Copy(*n)
                } else {
                    Source::Model
                }
            }
            None => Source::Model,
        };
        self.decision = Some(Decision {
            at: context.len(),
            source,
            matched,
        });
        source
    }
}

impl Proposer for Chooser {
    fn name(&self) -> &'static str {
        self.model.name()
    }

    fn forget(&mut self) {
        self.copy.forget();
        self.model.forget();
    }

    fn reset(&mut self, sampling: &SamplerConfig) {
        self.copy.reset(sampling);
        self.model.reset(sampling);
        self.copy_yield = Default::default();
        self.model_yield = Yield::default();
    }

    fn source(&mut self, context: &[u32]) -> usize {
        match self.decide(context) {
            Source::Model => 0,
            Source::Copy(n) => 1 + n - MIN_MATCH,
        }
    }

    fn width(&self, k: usize) -> usize {
        self.model.width(k)
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Draft> {
        let source = self.decide(context);
        // The match's draft, cut to this width: the nodes it would have had were it looked up at `k`.
        let copied = self
            .decision
            .as_ref()
            .and_then(|d| d.matched.as_ref())
            .map(|(_, draft)| {
                let mut draft = draft.clone();
                draft.truncate(k);
                draft
            });
        if let (Source::Copy(_), Some(draft)) = (source, &copied) {
            self.model.catch_up(context)?;
            return Ok(draft.clone());
        }
        let mut draft = self.model.propose(context, k)?;
        // The match's continuations join the model's drafts as branches, in the rows it left of the width.
        if let Some(copied) = copied {
            draft.merge(&copied, k);
        }
        Ok(draft)
    }

    fn observe(&mut self, outcome: &Outcome) {
        let tokens = (outcome.kept.len() + 1) as f64;
        let seconds = outcome.draft_s + outcome.verify_s;
        let source = self.decision.take().map_or(Source::Model, |d| d.source);
        // A cycle that drafted nothing (the controller's AR step) measures neither side.
        if !outcome.draft.is_empty() {
            match source {
                Source::Copy(n) => self.copy_yield[n - MIN_MATCH].record(tokens, seconds),
                Source::Model => self.model_yield.record(tokens, seconds),
            }
        }
        match source {
            Source::Copy(_) => {
                self.copy.observe(outcome);
                self.model.observe(&Outcome::of(&Draft::default(), &[]));
            }
            Source::Model => self.model.observe(outcome),
        }
    }

    fn catch_up(&mut self, context: &[u32]) -> Result<()> {
        self.model.catch_up(context)
    }

    fn features(&self) -> TargetFeatures {
        self.model.features()
    }

    fn observe_hidden(&mut self, start: usize, hidden: &[f32]) {
        self.model.observe_hidden(start, hidden);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn fixed() -> (Box<dyn Proposer>, Arc<AtomicUsize>) {
        let n = Arc::new(AtomicUsize::new(0));
        (
            Box::new(Fixed {
                catch_ups: n.clone(),
            }),
            n,
        )
    }

    /// A model proposer that always drafts `[9, 9]` and counts its catch-ups.
    struct Fixed {
        catch_ups: Arc<AtomicUsize>,
    }

    impl Proposer for Fixed {
        fn name(&self) -> &'static str {
            "fixed"
        }
        fn propose(&mut self, _context: &[u32], _k: usize) -> Result<Draft> {
            Ok(Draft::chain(vec![9, 9]))
        }
        fn observe(&mut self, _outcome: &Outcome) {}
        fn catch_up(&mut self, _context: &[u32]) -> Result<()> {
            self.catch_ups.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }

    /// Who drafted a cycle.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Side {
        Copy,
        Model,
    }

    /// One cycle on `context` under fixed costs: copying's drafts keep 2 tokens in a second (3 tokens a
    /// second), the model's none in 1.5 s (0.67).
    fn cycle(c: &mut Chooser, context: &[u32]) -> Side {
        let d = c.propose(context, 8).unwrap();
        let (side, kept, seconds) = match d.tokens()[0] {
            3 => (Side::Copy, vec![0, 1], 1.0),
            _ => (Side::Model, vec![], 1.5),
        };
        c.observe(&Outcome {
            draft: &d,
            kept: &kept,
            draft_s: 0.0,
            verify_s: seconds,
        });
        side
    }

    #[test]
    fn the_side_that_yields_more_tokens_per_second_drafts_and_the_other_is_retried() {
        use Side::*;
        let r = RETRY_AFTER as usize;
        // "1 2" was followed by 3 before: a 2-token match, which the prior leaves to the model.
        let mut c = Chooser::new(fixed().0);
        let ctx = [1, 2, 3, 4, 5, 6, 1, 2];
        let sides: Vec<Side> = (0..60).map(|_| cycle(&mut c, &ctx)).collect();
        // The prior twice, then copying's two tries, then copying with the model retried each time it was
        // passed over RETRY_AFTER times (from cycle 2 on).
        assert_eq!(&sides[..4], &[Model, Model, Copy, Copy]);
        let others: Vec<usize> = (4..60).filter(|&i| sides[i] != Copy).collect();
        assert_eq!(others, vec![2 + r, 3 + 2 * r]);
        // No match: the model drafts every cycle.
        let mut c = Chooser::new(fixed().0);
        assert!((0..30).all(|_| cycle(&mut c, &[7, 8]) == Model));
    }

    #[test]
    fn the_source_is_decided_once_per_cycle_before_the_width() {
        let mut c = Chooser::new(fixed().0);
        assert_eq!(c.source(&[7, 8]), 0, "no match: the model");
        // A full-length match: copying, reported as its match length's source, and the draft is the copy.
        let ctx = [1, 2, 3, 4, 3, 5, 6, 1, 2, 3, 4];
        assert_eq!(c.source(&ctx), 1 + MAX_MATCH - MIN_MATCH);
        let passed_over = c.model_yield.passed_over;
        assert_eq!(c.propose(&ctx, 8).unwrap().tokens(), &[3, 5, 6]);
        assert_eq!(
            c.model_yield.passed_over, passed_over,
            "propose kept the decision"
        );
    }

    #[test]
    fn a_full_length_match_is_copied_first_and_the_model_catches_up() {
        let (model, catch_ups) = fixed();
        let mut c = Chooser::new(model);
        let ctx = [1, 2, 3, 4, 3, 5, 6, 1, 2, 3, 4];
        let d = c.propose(&ctx, 8).unwrap();
        assert_eq!(d.tokens(), &[3, 5, 6]);
        c.observe(&Outcome::of(&d, &[]));
        assert_eq!(catch_ups.load(Ordering::Relaxed), 1);
        // Without a match the model drafts, alone (its prior against AR steps).
        assert_eq!(c.propose(&[7, 8], 8).unwrap().tokens(), &[9, 9]);
    }
}
