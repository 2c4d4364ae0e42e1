//! The chooser: each cycle, who drafts — copying from the context (free; judged per match length) or one of
//! the bundle's model proposers (an MTP head, a block drafter, a draft model) — by the tokens per second each
//! has measurably yielded in this request.
//!
//! A cycle's yield is the tokens it emitted (kept drafts and the target's next token) over the seconds it took
//! (drafting and verifying). The model proposers compete among themselves every cycle: each is tried (in the
//! bundle's order) until all have a few cycles on record, then the one with the highest measured rate drafts,
//! the others retried now and then so that a change in the text is noticed; this ranking carries over from one
//! request to the next (a request is too short to explore every model again). Where the context's suffix has an
//! earlier match of length `n`, copying competes with that model: the prior until both sides have a few cycles
//! on record (copy a full-length match of two tokens or more, as long matches run long; else the model, with the
//! match's continuations as branches of its draft tree where the width leaves room; each side is tried where
//! the prior would not pick it), then the higher measured rate, the loser retried likewise. The decision comes
//! before the width ([`Proposer::source`]): the decode loop keeps a width controller per source, so each
//! model's acceptance is learned from its own cycles and where its drafts do not pay (prose, for an MTP head)
//! its controller falls back to plain AR steps while copying keeps drafting its matches. (A contest between a
//! model and AR steps decided here from per-cycle wall times was measured to lose to that: too few cycles per
//! request to tell them apart.)
//!
//! A model proposer that does not draft a cycle does no work in it: it keeps the target states the cycles
//! report (contiguous rows) and brings its own state (an MTP head's cache, a block drafter's context) up to the
//! context when it drafts next, in one multi-row pass whose time counts in that cycle's cost — against copying,
//! which it alternates with cycle by cycle, but not in the ranking of the models: a model back from idling would
//! otherwise pay for every cycle it sat out in its one retried cycle and could hardly win back the lead (one
//! reason `auto` kept a block drafter, tried first, over a faster MTP head: BENCHMARKS.md section 2). A model's
//! first cycle after another model's (or in a request) is not ranked, so a try or a retry takes two cycles in a
//! row. The target
//! reports the union of the models' hidden states ([`TargetFeatures::union`]), and each model receives its own
//! part. Each proposer learns (widths, silence) only from the cycles it drafted.

use super::copy::{SuffixCopy, MAX_MATCH, MIN_MATCH};
use super::proposer::{Begun, Draft, Outcome, Proposer};
use crate::error::{Error, Result};
use crate::model::TargetFeatures;
use crate::sample::SamplerConfig;

/// Cycles each side needs on record before measured rates replace the prior.
const TRIES: u32 = 2;
/// A side that loses is retried after this many cycles it could have drafted.
const RETRY_AFTER: u32 = 24;
/// The same for a model that loses to another model (their ranking is kept over requests: it changes slowly).
const MODEL_RETRY_AFTER: u32 = 4 * RETRY_AFTER;
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
    /// The model proposer of this index.
    Model(usize),
}

/// A cycle's decision: who drafts after a context of `at` tokens, and the copy match seen there (its draft at
/// the widest width, cut to the cycle's width when it drafts).
struct Decision {
    at: usize,
    source: Source,
    matched: Option<(usize, Draft)>,
}

pub struct Chooser {
    /// The route's name, as statistics report it.
    name: &'static str,
    copy: SuffixCopy,
    /// The model proposers, in the bundle's order of preference (the order they are first tried in).
    models: Vec<Box<dyn Proposer>>,
    /// What the target reports: the union of the models' states, and each model's own.
    features: TargetFeatures,
    model_features: Vec<TargetFeatures>,
    /// Values per target state (the target's hidden size).
    hidden: usize,
    /// Copying's yield per match length (`MIN_MATCH..=MAX_MATCH`).
    copy_yield: [Yield; MAX_MATCH - MIN_MATCH + 1],
    /// Each model's yield in this request (against copying, whose yield depends on the text).
    model_yield: Vec<Yield>,
    /// Each model's yield over requests (against the other models: their relative speed is the hardware's and
    /// the models' more than one text's, and a request is too short to explore them all again).
    model_rank: Vec<Yield>,
    /// The current cycle's decision ([`Proposer::source`]), until it is observed.
    decision: Option<Decision>,
    /// A model's draft queued in a batched step ([`Proposer::begin`]): the model, and the copy match's draft
    /// that joins it as branches, within the width.
    queued: Option<(usize, Option<Draft>, usize)>,
    /// The model that drafted the request's last model cycle.
    last_model: Option<usize>,
}

/// Who drafts this cycle, at its width.
enum Turn {
    /// Copying, with this draft.
    Copied(Draft),
    /// The model of this index, with the copy match's draft (cut to the width) to merge in, if any.
    Model(usize, Option<Draft>),
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
    /// A chooser over copying and `models` (at least one), preferred in their order until measured, for a
    /// target of `hidden` values per state.
    pub fn new(models: Vec<Box<dyn Proposer>>, hidden: usize) -> Self {
        assert!(!models.is_empty(), "a chooser needs a model proposer");
        let model_features: Vec<TargetFeatures> = models.iter().map(|m| m.features()).collect();
        let features = model_features
            .iter()
            .fold(TargetFeatures::none(), |all, f| all.union(f));
        Chooser {
            name: models[0].name(),
            copy: SuffixCopy::new(),
            model_yield: vec![Yield::default(); models.len()],
            model_rank: vec![Yield::default(); models.len()],
            models,
            features,
            model_features,
            hidden,
            copy_yield: Default::default(),
            decision: None,
            queued: None,
            last_model: None,
        }
    }

    /// The chooser reported as route `name` (several models: the first model's name would not say it).
    pub fn named(self, name: &'static str) -> Self {
        Chooser { name, ..self }
    }

    /// The model that drafts where copying does not: each tried in order until it has a record, then the
    /// highest measured rate, one passed over `MODEL_RETRY_AFTER` times retried. The others count a pass.
    fn best_model(&mut self) -> usize {
        let y = &self.model_rank;
        let m = if let Some(untried) = y.iter().position(|y| !y.known()) {
            untried
        } else if let Some(due) = y.iter().position(|y| y.passed_over >= MODEL_RETRY_AFTER) {
            due
        } else {
            // The first of the highest rates.
            (0..y.len()).fold(0, |best, i| {
                if y[i].rate() > y[best].rate() {
                    i
                } else {
                    best
                }
            })
        };
        for (i, y) in self.model_rank.iter_mut().enumerate() {
            if i != m {
                y.passed_over += 1;
            }
        }
        m
    }

    /// Who drafts after `context`: the best model, against copying where the context has a copy match. Decided
    /// once per cycle.
    fn decide(&mut self, context: &[u32]) -> Source {
        if let Some(d) = self.decision.as_ref().filter(|d| d.at == context.len()) {
            return d.source;
        }
        let matched = self.copy.lookup(context, super::controller::MAX_K);
        let m = self.best_model();
        let source = match &matched {
            Some((n, draft)) => {
                let prior = *n == MAX_MATCH && draft.main_line() >= 2;
                if first_wins(
                    &mut self.copy_yield[n - MIN_MATCH],
                    &mut self.model_yield[m],
                    prior,
                ) {
                    Source::Copy(*n)
                } else {
                    Source::Model(m)
                }
            }
            None => Source::Model(m),
        };
        self.decision = Some(Decision {
            at: context.len(),
            source,
            matched,
        });
        source
    }
}

impl Chooser {
    /// Who drafts after `context` at width `k`: copying (its match's draft, cut to this width: the nodes it would
    /// have had were it looked up at `k`), or a model.
    fn turn(&mut self, context: &[u32], k: usize) -> Turn {
        let source = self.decide(context);
        let copied = self
            .decision
            .as_ref()
            .and_then(|d| d.matched.as_ref())
            .map(|(_, draft)| {
                let mut draft = draft.clone();
                draft.truncate(k);
                draft
            });
        match (source, copied) {
            (Source::Copy(_), Some(draft)) => Turn::Copied(draft),
            (Source::Model(m), copied) => Turn::Model(m, copied),
            (Source::Copy(_), None) => unreachable!("copying decided on a match"),
        }
    }
}

/// A model's draft with the copy match's continuations joined as branches, in the rows it left of width `k`.
fn with_branches(mut draft: Draft, copied: Option<Draft>, k: usize) -> Draft {
    if let Some(copied) = copied {
        draft.merge(&copied, k);
    }
    draft
}

impl Proposer for Chooser {
    fn name(&self) -> &'static str {
        self.name
    }

    fn forget(&mut self) {
        self.copy.forget();
        self.models.iter_mut().for_each(|m| m.forget());
        self.model_rank = vec![Yield::default(); self.models.len()];
    }

    fn reset(&mut self, sampling: &SamplerConfig) {
        self.copy.reset(sampling);
        self.models.iter_mut().for_each(|m| m.reset(sampling));
        self.copy_yield = Default::default();
        self.model_yield = vec![Yield::default(); self.models.len()];
        self.queued = None;
        self.last_model = None;
    }

    fn source(&mut self, context: &[u32]) -> usize {
        match self.decide(context) {
            Source::Model(m) => m,
            Source::Copy(n) => self.models.len() + n - MIN_MATCH,
        }
    }

    fn width(&self, k: usize) -> usize {
        match self.decision.as_ref().map(|d| d.source) {
            Some(Source::Model(m)) => self.models[m].width(k),
            _ => self.models[0].width(k),
        }
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Draft> {
        match self.turn(context, k) {
            Turn::Copied(draft) => Ok(draft),
            Turn::Model(m, copied) => {
                let draft = self.models[m].propose(context, k)?;
                Ok(with_branches(draft, copied, k))
            }
        }
    }

    fn begin(&mut self, context: &[u32], k: usize) -> Result<Begun> {
        match self.turn(context, k) {
            Turn::Copied(draft) => Ok(Begun::Ready(draft)),
            Turn::Model(m, copied) => match self.models[m].begin(context, k)? {
                Begun::Ready(draft) => Ok(Begun::Ready(with_branches(draft, copied, k))),
                Begun::Queued => {
                    self.queued = Some((m, copied, k));
                    Ok(Begun::Queued)
                }
            },
        }
    }

    fn run_queued(&mut self) -> Result<()> {
        match self.queued {
            Some((m, ..)) => self.models[m].run_queued(),
            None => Ok(()),
        }
    }

    fn finish(&mut self) -> Result<Draft> {
        let Some((m, copied, k)) = self.queued.take() else {
            return Err(Error::Invalid(format!(
                "{}: no queued draft to finish",
                self.name
            )));
        };
        let draft = self.models[m].finish()?;
        Ok(with_branches(draft, copied, k))
    }

    fn observe(&mut self, outcome: &Outcome) {
        self.queued = None;
        let tokens = (outcome.kept.len() + 1) as f64;
        let seconds = outcome.draft_s + outcome.verify_s;
        let source = self.decision.take().map_or(Source::Model(0), |d| d.source);
        // A cycle that drafted nothing (the controller's AR step) measures no side.
        if !outcome.draft.is_empty() {
            match source {
                Source::Copy(n) => self.copy_yield[n - MIN_MATCH].record(tokens, seconds),
                Source::Model(m) => {
                    self.model_yield[m].record(tokens, seconds);
                    if self.last_model == Some(m) {
                        self.model_rank[m].record(tokens, seconds);
                    }
                    self.last_model = Some(m);
                }
            }
        }
        let nothing = Draft::default();
        let idle = Outcome::of(&nothing, &[]);
        if let Source::Copy(_) = source {
            self.copy.observe(outcome);
        }
        for (i, model) in self.models.iter_mut().enumerate() {
            model.observe(if source == Source::Model(i) {
                outcome
            } else {
                &idle
            });
        }
    }

    fn features(&self) -> TargetFeatures {
        self.features.clone()
    }

    fn takes_images(&self) -> bool {
        self.copy.takes_images() && self.models.iter().all(|m| m.takes_images())
    }

    fn observe_hidden(&mut self, start: usize, hidden: &[f32]) {
        for (model, part) in self.models.iter_mut().zip(&self.model_features) {
            if *part == self.features {
                model.observe_hidden(start, hidden);
            } else if !part.is_none() {
                model.observe_hidden(start, &self.features.extract(part, hidden, self.hidden));
            }
        }
    }

    /// A chooser over the models' per-request proposers (all of them, or none), knowing what this one has
    /// measured of their speeds relative to each other (the hardware's more than a text's).
    fn for_request(&self) -> Option<Box<dyn Proposer>> {
        let models = self.models.iter().map(|m| m.for_request());
        let mut c = Chooser::new(models.collect::<Option<_>>()?, self.hidden).named(self.name);
        c.model_rank.clone_from(&self.model_rank);
        Some(Box::new(c))
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
                token: 9,
                proposals: n.clone(),
                features: TargetFeatures::none(),
                seen: Arc::default(),
            }),
            n,
        )
    }

    /// A model proposer that always drafts `[token, token]`, counts its drafts and keeps the hidden states it is
    /// handed.
    struct Fixed {
        token: u32,
        proposals: Arc<AtomicUsize>,
        features: TargetFeatures,
        seen: Arc<std::sync::Mutex<Vec<f32>>>,
    }

    impl Proposer for Fixed {
        fn name(&self) -> &'static str {
            "fixed"
        }
        fn propose(&mut self, _context: &[u32], _k: usize) -> Result<Draft> {
            self.proposals.fetch_add(1, Ordering::Relaxed);
            Ok(Draft::chain(vec![self.token, self.token]))
        }
        fn observe(&mut self, _outcome: &Outcome) {}
        fn features(&self) -> TargetFeatures {
            self.features.clone()
        }
        fn observe_hidden(&mut self, _start: usize, hidden: &[f32]) {
            self.seen.lock().unwrap().extend_from_slice(hidden);
        }
    }

    /// Two model proposers drafting `[7, 7]` and `[8, 8]`, reading the final state and layers 3 and 1, with
    /// their draft counters and the states each was handed.
    #[allow(clippy::type_complexity)]
    fn two_models() -> (
        Vec<Box<dyn Proposer>>,
        [Arc<AtomicUsize>; 2],
        [Arc<std::sync::Mutex<Vec<f32>>>; 2],
    ) {
        let counters = [Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0))];
        let seen: [Arc<std::sync::Mutex<Vec<f32>>>; 2] = Default::default();
        let features = [
            TargetFeatures::final_state(),
            TargetFeatures::layers(vec![3, 1]),
        ];
        let models = (0..2)
            .map(|i| {
                Box::new(Fixed {
                    token: 7 + i as u32,
                    proposals: counters[i].clone(),
                    features: features[i].clone(),
                    seen: seen[i].clone(),
                }) as Box<dyn Proposer>
            })
            .collect();
        (models, counters, seen)
    }

    #[test]
    fn the_model_that_yields_more_tokens_per_second_drafts_and_the_others_idle_until_retried() {
        let (models, counters, _) = two_models();
        let mut c = Chooser::new(models, 4);
        let r = MODEL_RETRY_AFTER as usize;
        // No copy match. Model 8 keeps both drafts in a second (3 tokens/s), model 7 none (1 token/s).
        let drafted: Vec<u32> = (0..300)
            .map(|_| {
                let d = c.propose(&[5, 6], 8).unwrap();
                let first = d.tokens()[0];
                let kept = if first == 8 { vec![0, 1] } else { vec![] };
                c.observe(&Outcome {
                    draft: &d,
                    kept: &kept,
                    draft_s: 0.0,
                    verify_s: 1.0,
                });
                first
            })
            .collect();
        // Each tried in order until it has a record (its first cycle unranked), then the faster; the slower
        // retried for two cycles each time it was passed over MODEL_RETRY_AFTER times (from cycle 3 on).
        assert_eq!(&drafted[..6], &[7, 7, 7, 8, 8, 8]);
        let retried: Vec<usize> = (6..300).filter(|&i| drafted[i] == 7).collect();
        let t = 3 + r;
        assert_eq!(
            retried,
            vec![t, t + 1, t + 2 + r, t + 3 + r, t + 4 + 2 * r, t + 5 + 2 * r]
        );
        // A model ran only in the cycles it drafted.
        let by = |t| drafted.iter().filter(|&&d| d == t).count();
        assert_eq!(counters[0].load(Ordering::Relaxed), by(7));
        assert_eq!(counters[1].load(Ordering::Relaxed), by(8));
    }

    #[test]
    fn a_model_back_from_idling_is_ranked_without_its_catch_up() {
        let (models, _, _) = two_models();
        let mut c = Chooser::new(models, 4);
        // Both keep one of two drafts; model 7 in 1 s a cycle, model 8 in 0.5 s, but 8's first cycle after
        // model 7's (its state catching up with the context) takes 30 s.
        let mut last = 0;
        let drafted: Vec<u32> = (0..400)
            .map(|_| {
                let d = c.propose(&[5, 6], 8).unwrap();
                let first = d.tokens()[0];
                let seconds = match (first, last) {
                    (7, _) => 1.0,
                    (_, 7) => 30.0,
                    _ => 0.5,
                };
                c.observe(&Outcome {
                    draft: &d,
                    kept: &[0],
                    draft_s: 0.0,
                    verify_s: seconds,
                });
                last = first;
                first
            })
            .collect();
        // Model 8 drafts from its try on, model 7 only in its retries.
        let sevens = drafted[6..].iter().filter(|&&d| d == 7).count();
        assert!(
            sevens <= 2 * (400 / MODEL_RETRY_AFTER as usize + 1),
            "{sevens}"
        );
        assert_eq!(&drafted[3..6], &[8, 8, 8]);
    }

    #[test]
    fn the_target_reports_the_union_of_the_models_states_and_each_model_gets_its_own() {
        let (models, _, seen) = two_models();
        let mut c = Chooser::new(models, 2);
        let f = c.features();
        assert_eq!(
            f,
            TargetFeatures {
                layers: vec![3, 1],
                final_state: true
            }
        );
        assert_eq!(f.tag(), "layers:3,1+final");
        assert_eq!(TargetFeatures::from_tag(&f.tag()), Some(f.clone()));
        // Two rows of [layer 3, layer 1, final], two values each.
        let rows: Vec<f32> = (0..12).map(|v| v as f32).collect();
        c.observe_hidden(0, &rows);
        assert_eq!(*seen[0].lock().unwrap(), vec![4.0, 5.0, 10.0, 11.0]);
        assert_eq!(
            *seen[1].lock().unwrap(),
            vec![0.0, 1.0, 2.0, 3.0, 6.0, 7.0, 8.0, 9.0]
        );
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
        let mut c = Chooser::new(vec![fixed().0], 4);
        let ctx = [1, 2, 3, 4, 5, 6, 1, 2];
        let sides: Vec<Side> = (0..60).map(|_| cycle(&mut c, &ctx)).collect();
        // The prior twice, then copying's two tries, then copying with the model retried each time it was
        // passed over RETRY_AFTER times (from cycle 2 on).
        assert_eq!(&sides[..4], &[Model, Model, Copy, Copy]);
        let others: Vec<usize> = (4..60).filter(|&i| sides[i] != Copy).collect();
        assert_eq!(others, vec![2 + r, 3 + 2 * r]);
        // No match: the model drafts every cycle.
        let mut c = Chooser::new(vec![fixed().0], 4);
        assert!((0..30).all(|_| cycle(&mut c, &[7, 8]) == Model));
    }

    #[test]
    fn the_source_is_decided_once_per_cycle_before_the_width() {
        let mut c = Chooser::new(vec![fixed().0], 4);
        assert_eq!(c.source(&[7, 8]), 0, "no match: the model");
        // A full-length match: copying, reported as its match length's source, and the draft is the copy.
        let ctx = [1, 2, 3, 4, 3, 5, 6, 1, 2, 3, 4];
        assert_eq!(c.source(&ctx), 1 + MAX_MATCH - MIN_MATCH);
        let passed_over = c.model_yield[0].passed_over;
        assert_eq!(c.propose(&ctx, 8).unwrap().tokens(), &[3, 5, 6]);
        assert_eq!(
            c.model_yield[0].passed_over, passed_over,
            "propose kept the decision"
        );
    }

    #[test]
    fn a_full_length_match_is_copied_first_and_the_model_idles() {
        let (model, proposals) = fixed();
        let mut c = Chooser::new(vec![model], 4);
        let ctx = [1, 2, 3, 4, 3, 5, 6, 1, 2, 3, 4];
        let d = c.propose(&ctx, 8).unwrap();
        assert_eq!(d.tokens(), &[3, 5, 6]);
        c.observe(&Outcome::of(&d, &[]));
        assert_eq!(proposals.load(Ordering::Relaxed), 0);
        // Without a match the model drafts, alone (its prior against AR steps).
        assert_eq!(c.propose(&[7, 8], 8).unwrap().tokens(), &[9, 9]);
        assert_eq!(proposals.load(Ordering::Relaxed), 1);
    }
}
