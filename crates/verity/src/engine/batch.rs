//! Decoding several requests together, one token each per batched forward (what a continuously batching
//! server steps): requests join between steps ([`Engine::start_decoding`]) and leave when they finish. A
//! newcomer's prompt goes through the same steps in chunks ([`crate::backend::Backend::prefill_rows`] rows a step,
//! beside the others' tokens), so a long prompt does not stall the requests already decoding.
//!
//! Each request's step is the cycle of `decode.rs` — its pending token and its drafts through the target, the
//! verifier's verdict on those rows, the kept path committed — run as its rows of a [`Model::forward_batched`]
//! beside the others' rows. With batched drafts on ([`Engine::set_batch_drafts`]), on a speculative route every
//! request drafts with a proposer of its own ([`Proposer::for_request`]): the route's MTP head or block drafter
//! (their weights and work buffers shared, a cache each, the target states each conditions on returned by the
//! batched forward for its own rows), or copying from its own context where the route's proposer cannot be
//! shared (a draft model). The requests whose proposers share a model draft together: each queues its draft
//! ([`Proposer::begin`]) and one batched call runs them all ([`Proposer::run_queued`]: an MTP head's or a block
//! drafter's forwards then read its weights once for every request). Each request's widths are chosen against
//! what a drafted row costs the whole batch and what drafting costs it, and the steps stop drafting where
//! drafting measurably lost ([`crate::speculative::BatchGate`]). The forward gives each row bitwise its own
//! forward's logits and the draws are keyed by the request's seed and position, so every request gets bitwise the
//! tokens it would get alone, on any route (every route's output is AR's), whichever requests share its steps,
//! whatever they drafted and whenever it joined.

use std::time::{Duration, Instant};

use super::decode::{kept_features, logits_wanted, Cycle};
use super::media::{self, MediaTable};
use super::prefill::PrefillPlan;
use super::{Emitted, Engine, GenerateRequest, GenerationStats, Session, StopReason};
use crate::backend::Backend;
use crate::chat::Tokenizer;
use crate::error::{Error, Result};
use crate::model::{Batch, LogitRows, SeqForward, TargetFeatures};
use crate::speculative::copy::SuffixCopy;
use crate::speculative::{Begun, Controller, Draft, Outcome, Proposer, Route, Verifier};

/// One request being decoded in batched steps.
pub struct Decoding<B: Backend> {
    pub session: Session<B>,
    request: GenerateRequest,
    verifier: Verifier,
    /// Committed tokens and the pending one (its last element, not yet in the cache).
    context: Vec<u32>,
    stats: GenerationStats,
    start: Instant,
    first_at: Option<Instant>,
    done: bool,
    /// The statistics of the answer's part decoded alone before it joined batched steps.
    earlier: Option<GenerationStats>,
    /// The prompt's prefill while it goes on (`None` once the prompt is in the cache).
    prefill: Option<PrefillPlan>,
    /// Its drafts, on a speculative route without a constraint, and their widths (a controller per proposer
    /// source, as alone), the source of this step's draft and what drafting it took.
    proposer: Option<Box<dyn Proposer>>,
    controllers: Vec<Controller>,
    source: usize,
    /// This step's width.
    width: usize,
    draft_s: f64,
    /// The target states its proposer conditions on (none without a proposer).
    features: TargetFeatures,
    /// Where its prompt's image rows take their features from.
    media: MediaTable,
    /// How far the rotary positions of the rows after the prompt's images lag behind their slots
    /// ([`MediaTable::lag`]).
    lag: usize,
}

/// Batched steps' row counts measured apart (the engine's [`crate::speculative::RowCost`]).
pub(super) const STEP_ROWS: usize = 256;

impl<B: Backend> Decoding<B> {
    /// Whether the request has finished (it takes no further steps).
    pub fn is_finished(&self) -> bool {
        self.done
    }

    /// The session (its cache holds the prompt and the completion) and the whole answer's statistics.
    pub fn into_parts(self) -> (Session<B>, GenerationStats) {
        (self.session, whole(self.earlier, self.stats))
    }

    /// What is left of the request (its token limit counts from where it joined batched steps).
    pub fn request(&self) -> &GenerateRequest {
        &self.request
    }

    /// This step's drafts, each drafted row costing the step `row_s` seconds at the batch's `rate` tokens per
    /// second: none while its prompt is prefilled or without a proposer, none past its token limit or the
    /// context (wasted there), none while the batch does not draft (`open` false) unless the request fixed its
    /// width. A draft its proposer queued to run with other requests' is completed by [`Decoding::finish_draft`].
    fn begin_draft(&mut self, row_s: f64, rate: f64, open: bool) -> Result<Begun> {
        self.draft_s = 0.0;
        self.width = 0;
        let nothing = Ok(Begun::Ready(Draft::default()));
        let (Some(p), None) = (&mut self.proposer, &self.prefill) else {
            return nothing;
        };
        if !open && self.request.draft_width.is_none() {
            return nothing;
        }
        let t = Instant::now();
        self.source = p.source(&self.context);
        if self.controllers.len() <= self.source {
            self.controllers
                .resize_with(self.source + 1, Controller::default);
        }
        let room = self.session.cache.max_capacity() - (self.session.cache.len() + 1);
        let limit = (self.request.max_tokens - self.stats.completion_tokens - 1).min(room);
        let offered = p.width(limit);
        let k = match self.request.draft_width {
            Some(w) => w.min(offered),
            None => self.controllers[self.source].choose_in_batch(offered, row_s, rate),
        };
        let begun = match k {
            0 => Begun::Ready(Draft::default()),
            _ => p.begin(&self.context, k)?,
        };
        self.width = k;
        self.draft_s = t.elapsed().as_secs_f64();
        Ok(begun)
    }

    /// The step's draft: `begun` itself, or the queued one (its share of the queue's run, `shared_s` seconds,
    /// counted in its drafting time).
    fn finish_draft(&mut self, begun: Begun, shared_s: f64) -> Result<Draft> {
        let mut draft = match begun {
            Begun::Ready(draft) => draft,
            Begun::Queued => {
                self.draft_s += shared_s;
                self.proposer
                    .as_mut()
                    .expect("a queued draft has a proposer")
                    .finish()?
            }
        };
        draft.truncate(self.width);
        Ok(draft)
    }

    /// After the prompt is in the cache: the target states of every position before its pending token, where
    /// the session holds them all (restored, kept from earlier turns, or from the prefill's chunks), go to the
    /// proposer, as alone.
    fn prompt_states_to_proposer(&mut self) {
        if let Some(p) = self.proposer.as_deref_mut() {
            let body = self.context.len() - 1;
            self.session.hidden.hand_to(p, &self.features, body);
        }
    }
}

impl<B: Backend> Engine<B> {
    /// Make a request ready for batched steps: what `session` or the prefix cache holds of `prompt` is
    /// restored now, the rest is prefilled by the steps. A grammar constraint masks each step's row as it does
    /// alone (drafts are off under one, as alone).
    pub fn start_decoding(
        &mut self,
        mut session: Session<B>,
        prompt: &[u32],
        request: GenerateRequest,
    ) -> Result<Decoding<B>> {
        if prompt.is_empty() {
            return Err(Error::Invalid("empty prompt".into()));
        }
        if prompt.len() > session.cache.max_capacity() {
            return Err(Error::Invalid(format!(
                "the prompt ({} tokens) exceeds the context length ({})",
                prompt.len(),
                session.cache.max_capacity()
            )));
        }
        let start = Instant::now();
        let verifier = Verifier::new(request.sampling)?;
        let media = MediaTable::new(&request.images, self.model.hp.hidden)?;
        media.check(prompt)?;
        let mut proposer = (self.batch_drafts
            && self.plan.route != Route::Ar
            && request.speculate
            && request.constraint.is_none())
        .then(|| {
            let own = self.proposer.as_ref().and_then(|p| p.for_request());
            own.unwrap_or_else(|| Box::new(SuffixCopy::new()))
        })
        // A proposer that cannot read the prompt's image rows leaves the request to copying.
        .map(|p| {
            if media.is_empty() || p.takes_images() {
                p
            } else {
                Box::new(SuffixCopy::new()) as Box<dyn Proposer>
            }
        });
        if let Some(p) = proposer.as_mut() {
            p.reset(&request.sampling);
        }
        let features = proposer.as_ref().map(|p| p.features()).unwrap_or_default();
        let plan = self.prefill_plan(&mut session, prompt, request.store_prefix, &features)?;
        let mut stats = GenerationStats::new(proposer.as_ref().map_or("ar", |p| p.name()));
        stats.prompt_tokens = prompt.len();
        stats.restored_tokens = plan.done.restored;
        let prefill = plan.next_end(prompt.len() - 1).map(|_| plan);
        let done = request.max_tokens == 0;
        let mut d = Decoding {
            session,
            request,
            verifier,
            context: prompt.to_vec(),
            stats,
            start,
            first_at: None,
            done,
            earlier: None,
            prefill,
            proposer,
            controllers: Vec::new(),
            source: 0,
            width: 0,
            draft_s: 0.0,
            features,
            lag: media.lag(prompt),
            media,
        };
        if d.prefill.is_none() {
            d.prompt_states_to_proposer();
        }
        Ok(d)
    }

    /// Continue in batched steps a request that decoded alone until its caller stopped it to make room for
    /// others ([`Engine::generate`] returned [`StopReason::Cancelled`]): `context` is its prompt and every token it
    /// emitted, `request` what is left of it (`max_tokens` less those tokens), `earlier` its statistics so far.
    /// Every route emits AR's tokens, and the draws are keyed by seed and position, so the answer goes on exactly
    /// as it would have alone.
    pub fn resume_decoding(
        &mut self,
        session: Session<B>,
        context: &[u32],
        request: GenerateRequest,
        earlier: GenerationStats,
    ) -> Result<Decoding<B>> {
        let mut d = self.start_decoding(session, context, request)?;
        // Its first token came long ago.
        d.first_at = Some(d.start);
        d.earlier = Some(earlier);
        Ok(d)
    }

    /// Decode the rest of `d` alone with [`Engine::generate`], on the request's speculative route (a batch that
    /// has shrunk to one request: drafting pays again). Returns the session and the whole answer's statistics;
    /// the caller may stop it again and [`Engine::resume_decoding`] it. The tokens are the ones batched steps
    /// would have given.
    pub fn continue_alone(
        &mut self,
        d: Decoding<B>,
        on_token: impl FnMut(&Tokenizer, &Emitted) -> bool,
    ) -> Result<(Session<B>, GenerationStats)> {
        let Decoding {
            mut session,
            mut request,
            context,
            mut stats,
            first_at,
            earlier,
            ..
        } = d;
        if let Some(t) = first_at {
            stats.decode_s = t.elapsed().as_secs_f64();
        }
        request.max_tokens -= stats.completion_tokens;
        let so_far = whole(earlier, stats);
        let later = self.generate(&mut session, &context, &request, on_token)?;
        Ok((session, so_far.then(&later)))
    }

    /// One cycle of every unfinished request of `batch` whose prompt is in its cache (its pending token and its
    /// drafts), and the next chunk of every prompt still being prefilled, in one batched forward.
    /// `emit(i, tokenizer, token)` receives request `i`'s tokens and returns `false` to cancel that request. A request that finishes (a stop
    /// token, its token limit, the context's end, cancelled) is marked so and takes no further steps.
    pub fn decode_step(
        &mut self,
        batch: &mut [Decoding<B>],
        mut emit: impl FnMut(usize, &Tokenizer, &Emitted) -> bool,
    ) -> Result<()> {
        let vocab = self.model.hp.vocab;
        for d in batch.iter_mut() {
            if !d.done
                && d.prefill.is_none()
                && d.session.cache.len() + 1 > d.session.cache.max_capacity()
            {
                d.done = true;
                d.stats.stop = StopReason::ContextFull;
            }
        }
        let live: Vec<usize> = (0..batch.len()).filter(|&i| !batch[i].done).collect();
        if live.is_empty() {
            return Ok(());
        }
        // A prefilling request's rows: its prompt's next chunk, no logits (the last prompt token is the pending
        // row of its first decode step).
        let chunk_end = |d: &Decoding<B>| {
            d.prefill.as_ref().map(|p| {
                let body = &d.context[..d.context.len() - 1];
                let end = p.next_end(body.len());
                let end = media::chunk_end(body, end.expect("a prefill under way has rows left"));
                (p.pos, end)
            })
        };
        // Each decoding request's drafts. A drafted row is worth its expected acceptance against what it costs:
        // the step's seconds per extra row and the request's own drafting, in tokens at the batch's rate
        // without drafts.
        let decoding = live.iter().filter(|&&i| batch[i].prefill.is_none()).count();
        let base_rows: usize = live
            .iter()
            .map(|&i| chunk_end(&batch[i]).map_or(1, |(pos, end)| end - pos))
            .sum();
        let drafters = live.iter().any(|&i| batch[i].proposer.is_some());
        let open = self.batch_gate.drafting();
        let t0 = Instant::now();
        let (row_s, rate) = if drafters {
            (
                self.step_cost.per_row_near(base_rows),
                decoding as f64 / self.step_cost.cost(base_rows),
            )
        } else {
            (0.0, 0.0) // nobody drafts
        };
        let begun = live
            .iter()
            .map(|&i| batch[i].begin_draft(row_s, rate, open))
            .collect::<Result<Vec<Begun>>>()?;
        // The drafts queued on a shared model run together (the first of its requests runs them all), their
        // time shared among them.
        let queued: Vec<usize> = live
            .iter()
            .zip(&begun)
            .filter(|(_, b)| matches!(b, Begun::Queued))
            .map(|(&i, _)| i)
            .collect();
        let tq = Instant::now();
        for &i in &queued {
            let p = batch[i]
                .proposer
                .as_mut()
                .expect("a queued draft has a proposer");
            p.run_queued()?;
        }
        let shared_s = tq.elapsed().as_secs_f64() / queued.len().max(1) as f64;
        let drafts = live
            .iter()
            .zip(begun)
            .map(|(&i, b)| batch[i].finish_draft(b, shared_s))
            .collect::<Result<Vec<Draft>>>()?;
        let t1 = Instant::now();
        let rows: Vec<Batch> = live
            .iter()
            .zip(&drafts)
            .map(|(&i, draft)| {
                let d = &batch[i];
                match chunk_end(d) {
                    Some((pos, end)) => d.media.batch(&d.context, pos, end),
                    None => {
                        let pending = *d.context.last().expect("non-empty context");
                        let (tokens, positions, mask) =
                            draft.rows(pending, d.session.cache.len() - d.lag);
                        Ok(Batch {
                            tokens,
                            positions,
                            mask,
                            media: Vec::new(),
                            spatial: Vec::new(),
                        })
                    }
                }
            })
            .collect::<Result<_>>()?;
        let wants: Vec<LogitRows> = live
            .iter()
            .map(|&i| match batch[i].prefill {
                Some(_) => LogitRows::None,
                None => logits_wanted(&batch[i].verifier, &batch[i].request),
            })
            .collect();
        let mut outs = {
            // The live requests in order, as `live` lists them.
            let mut seqs: Vec<SeqForward<B>> = batch
                .iter_mut()
                .filter(|d| !d.done)
                .zip(rows.iter().zip(&wants))
                .map(|(d, (rows, &logits))| SeqForward {
                    cache: &mut d.session.cache,
                    batch: rows,
                    logits,
                    features: d.features.clone(),
                })
                .collect();
            self.model.forward_batched(&mut seqs)?
        };
        let t2 = Instant::now();
        let rows_total: usize = rows.iter().map(Batch::rows).sum();
        // Only steps of decoding requests price a row: a prompt's chunk brings cache growth and copies with it.
        let priced = decoding == live.len();
        if priced {
            self.step_cost.record(rows_total, (t2 - t1).as_secs_f64());
        }
        let mut emitted = 0;
        for (((&i, out), want), draft) in live.iter().zip(outs.iter_mut()).zip(&wants).zip(&drafts)
        {
            let d = &mut batch[i];
            let width = d.features.width(self.model.hp.hidden);
            if let Some((pos, end)) = chunk_end(d) {
                if !d.features.is_none() {
                    d.session
                        .hidden
                        .push(pos, &out.features, &d.features, width);
                }
                let plan = d.prefill.as_mut().expect("prefilling");
                let body = &d.context[..d.context.len() - 1];
                self.prefilled_chunk(&mut d.session, body, plan, end)?;
                if plan.next_end(body.len()).is_none() {
                    d.stats.store_s += plan.done.store_s;
                    d.prefill = None;
                    d.prompt_states_to_proposer();
                }
                continue;
            }
            // The forward appended the request's rows: the pending token's, then its drafts'.
            let n = d.session.cache.len() - 1 - draft.len();
            if let Some(c) = &d.request.constraint {
                // As alone: where the grammar admits no token the request ends, its pending row undone.
                if !c.mask(&mut out.logits[..vocab])? {
                    d.session.cache.truncate(n);
                    self.finish_step(d, StopReason::Stop)?;
                    continue;
                }
            }
            let verdict = match want {
                LogitRows::Greedy | LogitRows::Drawn(_) => {
                    d.verifier.verify_decided(&out.greedy, draft)
                }
                _ => d.verifier.verify(&out.logits, vocab, &d.context, draft),
            };
            let pending = *d.context.last().expect("non-empty context");
            let kept_rows = self.commit(&mut d.session, n, pending, draft, &verdict);
            emitted += kept_rows.len();
            // Its own drafting time; the forward's time is the batch's, shared by its requests.
            if let Some(p) = d.proposer.as_mut() {
                p.observe(&Outcome {
                    draft,
                    kept: &verdict.kept,
                    draft_s: d.draft_s,
                    verify_s: (t2 - t1).as_secs_f64(),
                });
                if !d.features.is_none() {
                    let kept = kept_features(&out.features, &kept_rows, width);
                    p.observe_hidden(n, &kept);
                    d.session.hidden.push(n, &kept, &d.features, width);
                }
            }
            d.stats.record_cycle(
                draft.len(),
                verdict.accepted(),
                Duration::from_secs_f64(d.draft_s),
                t2 - t1,
                Duration::ZERO,
            );
            if let Some(c) = d.controllers.get_mut(d.source) {
                c.record(
                    draft.len(),
                    verdict.accepted(),
                    draft.len() + 1,
                    (t2 - t1).as_secs_f64(),
                    d.draft_s,
                );
            }
            let cycle = Cycle {
                n,
                draft,
                verdict: &verdict,
                logits: &out.logits,
                start: d.start,
            };
            let stop = self.emit_cycle(
                &mut d.session,
                &d.request,
                cycle,
                &mut d.context,
                &mut d.stats,
                &mut d.first_at,
                &mut |tok, emitted| emit(i, tok, emitted),
            )?;
            if let Some(reason) = stop {
                self.finish_step(d, reason)?;
            }
        }
        // What drafting gave this step, against the same step without drafts (where that was measured).
        if let (true, true, Some(ar_s)) = (drafters, priced, self.step_cost.measured(base_rows)) {
            let secs = (t2 - t0).as_secs_f64();
            self.batch_gate.record(decoding, emitted, secs, ar_s);
        }
        Ok(())
    }

    /// `d` ends for `reason`: its statistics are closed and its answer is stored in the prefix cache.
    fn finish_step(&mut self, d: &mut Decoding<B>, reason: StopReason) -> Result<()> {
        d.done = true;
        d.stats.stop = reason;
        if let Some(t) = d.first_at {
            d.stats.decode_s = t.elapsed().as_secs_f64();
        }
        d.stats.store_s += self.store_answer(&d.session, &d.request, d.stats.prompt_tokens)?;
        Ok(())
    }
}

/// An answer's statistics: those of the part decoded alone before it joined batched steps, if any, then this
/// part's.
fn whole(earlier: Option<GenerationStats>, part: GenerationStats) -> GenerationStats {
    match earlier {
        Some(e) => e.then(&part),
        None => part,
    }
}
