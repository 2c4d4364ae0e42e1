//! The decode cycle: propose → verify in one forward → commit the kept path → emit.
//!
//! A cycle runs `[pending, d1..dk]` through the target in one forward (`pending` is the last emitted token, not
//! yet in the cache; `d1..dk` a proposer's drafts, a chain or a tree under the tree mask), lets the verifier keep
//! a path of the drafts and choose the next token, keeps the path's cache slots (moved down over the rejected
//! ones where the path leaves the first-child line) and tells the proposer. Plain AR decoding is the same cycle
//! with `k = 0`, so the AR route and the speculative routes share every numeric step, and row-exactness of the
//! forward makes their output identical: greedy, and sampled too, since each position's draw is keyed by the
//! seed and the position (see [`crate::speculative::verify`]).

use std::borrow::Cow;
use std::time::Instant;

use super::media::MediaTable;
use super::request::Logprobs;
use super::{Emitted, Engine, GenerateRequest, GenerationStats, Prefilled, Session, StopReason};
use crate::backend::Backend;
use crate::chat::Tokenizer;
use crate::error::{Error, Result};
use crate::model::{Batch, LogitRows};
use crate::speculative::{Controller, Draft, Outcome, Proposer, Verdict, Verifier};

impl<B: Backend> Engine<B> {
    /// Generate a completion of `prompt`. `on_token` receives each completion token as it is produced (with the
    /// tokenizer, for streaming text) and returns `false` to stop.
    pub fn generate(
        &mut self,
        sess: &mut Session<B>,
        prompt: &[u32],
        req: &GenerateRequest,
        mut on_token: impl FnMut(&Tokenizer, &Emitted) -> bool,
    ) -> Result<GenerationStats> {
        if prompt.is_empty() {
            return Err(Error::Invalid("empty prompt".into()));
        }
        let start = Instant::now();
        let verifier = Verifier::new(req.sampling)?;
        if prompt.len() > sess.cache.max_capacity() {
            return Err(Error::Invalid(format!(
                "the prompt ({} tokens) exceeds the context length ({})",
                prompt.len(),
                sess.cache.max_capacity()
            )));
        }
        let media = MediaTable::new(&req.images, self.model.hp.hidden)?;
        media.check(prompt)?;
        let mut proposer = if req.speculate && req.constraint.is_none() {
            self.proposer
                .take_if(|p| media.is_empty() || p.takes_images())
        } else {
            None
        };
        if let Some(p) = proposer.as_mut() {
            p.reset(&req.sampling);
        }
        let result = self
            .prefill(
                sess,
                prompt,
                &media,
                req.store_prefix,
                proposer.as_deref_mut(),
            )
            .and_then(|prefilled| {
                let stats = self.decode(
                    sess,
                    prompt,
                    media.lag(prompt),
                    req,
                    &verifier,
                    proposer.as_deref_mut(),
                    start,
                    &mut on_token,
                )?;
                Ok((prefilled, stats))
            });
        // The proposer goes back whatever happened (the next request resets it).
        if proposer.is_some() {
            self.proposer = proposer;
        }
        let (Prefilled { restored, store_s }, mut stats) = result?;
        stats.prompt_tokens = prompt.len();
        stats.restored_tokens = restored;
        stats.store_s = store_s;
        stats.store_s += self.store_answer(sess, req, prompt.len())?;
        Ok(stats)
    }

    #[allow(clippy::too_many_arguments)]
    fn decode(
        &mut self,
        sess: &mut Session<B>,
        prompt: &[u32],
        lag: usize,
        req: &GenerateRequest,
        verifier: &Verifier,
        mut proposer: Option<&mut (dyn Proposer + 'static)>,
        start: Instant,
        on_token: &mut impl FnMut(&Tokenizer, &Emitted) -> bool,
    ) -> Result<GenerationStats> {
        let vocab = self.model.hp.vocab;
        let mut stats = GenerationStats::new(proposer.as_ref().map_or("ar", |p| p.name()));
        // One width controller per proposer source (copying and a model learn their own acceptance).
        let mut controllers: Vec<Controller> = Vec::new();
        let mut source = 0;
        // What the proposer conditions on, fixed for the request: the target states each verify reports.
        let features = proposer
            .as_deref()
            .map(|p| p.features())
            .unwrap_or_default();
        let width = features.width(self.model.hp.hidden);
        let wants = logits_wanted(verifier, req);
        // `context` = committed tokens + `pending` (its last element).
        let mut context = prompt.to_vec();
        let mut first_at = None;
        while stats.completion_tokens < req.max_tokens {
            let n = sess.cache.len();
            let Some(room) = sess.cache.max_capacity().checked_sub(n + 1) else {
                stats.stop = StopReason::ContextFull;
                break;
            };
            // Drafting past the token limit or the context is wasted work.
            let limit = (req.max_tokens - stats.completion_tokens - 1).min(room);
            let t0 = Instant::now();
            let draft = match proposer.as_deref_mut() {
                Some(p) => {
                    source = p.source(&context);
                    if controllers.len() <= source {
                        controllers.resize_with(source + 1, Controller::default);
                    }
                    let offered = p.width(limit);
                    let k = match req.draft_width {
                        Some(w) => w.min(offered),
                        None => controllers[source].choose(offered),
                    };
                    if k > 0 {
                        let mut d = p.propose(&context, k)?;
                        d.truncate(k);
                        d
                    } else {
                        Draft::default()
                    }
                }
                None => Draft::default(),
            };
            let t1 = Instant::now();
            let pending = *context.last().expect("non-empty context");
            // Rotary positions lag the slots by what the prompt's images saved ([`MediaTable::lag`]).
            let (rows, positions, mask) = draft.rows(pending, n - lag);
            let batch = Batch {
                tokens: rows,
                positions,
                mask,
                media: Vec::new(),
                spatial: Vec::new(),
            };
            let mut out = self
                .model
                .forward_features(&mut sess.cache, &batch, wants, &features)?;
            if let Some(c) = &req.constraint {
                // Drafts are off under a constraint: the one row is the next token's.
                if !c.mask(&mut out.logits[..vocab])? {
                    sess.cache.truncate(n);
                    stats.stop = StopReason::Stop;
                    break;
                }
            }
            let t2 = Instant::now();
            let verdict = match wants {
                LogitRows::Greedy | LogitRows::Drawn(_) => {
                    verifier.verify_decided(&out.greedy, &draft)
                }
                _ => verifier.verify(&out.logits, vocab, &context, &draft),
            };
            let accepted = verdict.accepted();
            let kept_rows = self.commit(sess, n, pending, &draft, &verdict);
            if let Some(p) = proposer.as_deref_mut() {
                p.observe(&Outcome {
                    draft: &draft,
                    kept: &verdict.kept,
                    draft_s: (t1 - t0).as_secs_f64(),
                    verify_s: (t2 - t1).as_secs_f64(),
                });
                if !features.is_none() {
                    let kept = kept_features(&out.features, &kept_rows, width);
                    p.observe_hidden(n, &kept);
                    sess.hidden.push(n, &kept, &features, width);
                }
            }
            if let Some(c) = controllers.get_mut(source) {
                c.record(
                    draft.len(),
                    accepted,
                    batch.rows(),
                    (t2 - t1).as_secs_f64(),
                    (t1 - t0).as_secs_f64(),
                );
            }
            stats.record_cycle(draft.len(), accepted, t1 - t0, t2 - t1, t2.elapsed());

            let cycle = Cycle {
                n,
                draft: &draft,
                verdict: &verdict,
                logits: &out.logits,
                start,
            };
            if let Some(reason) = self.emit_cycle(
                sess,
                req,
                cycle,
                &mut context,
                &mut stats,
                &mut first_at,
                &mut *on_token,
            )? {
                stats.stop = reason;
                break;
            }
        }
        if let Some(t) = first_at {
            stats.decode_s = t.elapsed().as_secs_f64();
        }
        Ok(stats)
    }
}

/// The states of a cycle's kept rows (`width` values a row) out of its forward's `features`: a prefix of the
/// rows unless the path left the first-child line.
pub(super) fn kept_features<'a>(
    features: &'a [f32],
    kept_rows: &[usize],
    width: usize,
) -> Cow<'a, [f32]> {
    let last = kept_rows.len() - 1;
    if kept_rows[last] == last {
        Cow::Borrowed(&features[..kept_rows.len() * width])
    } else {
        let rows = kept_rows.iter();
        Cow::Owned(
            rows.flat_map(|&r| &features[r * width..(r + 1) * width])
                .copied()
                .collect(),
        )
    }
}

/// What a forward returns for a request: each row's token alone (its argmax, or its draw) where that decides
/// the verdict and nothing else reads the logits (one value per row from the device, not a vocabulary), else
/// every row's logits.
pub(super) fn logits_wanted(verifier: &Verifier, req: &GenerateRequest) -> LogitRows {
    match verifier.decided_rows() {
        Some(rows) if req.constraint.is_none() && req.logprobs == 0 && !req.want_logprob => rows,
        _ => LogitRows::All,
    }
}

/// A verified cycle: the forward's rows were `[pending, drafts]` at cache position `n`.
pub(super) struct Cycle<'a> {
    pub(super) n: usize,
    pub(super) draft: &'a Draft,
    pub(super) verdict: &'a Verdict,
    /// Every row's logits, or none (the greedy verdict came from the rows' argmax alone).
    pub(super) logits: &'a [f32],
    /// When the request started.
    pub(super) start: Instant,
}

impl<B: Backend> Engine<B> {
    /// Commit a cycle's kept path: the pending token and the accepted drafts stay in the cache (moved down over
    /// rejected rows where the path leaves the first-child line) and join the session's tokens; the rest rolls
    /// back. Returns the kept rows.
    pub(super) fn commit(
        &self,
        sess: &mut Session<B>,
        n: usize,
        pending: u32,
        draft: &Draft,
        verdict: &Verdict,
    ) -> Vec<usize> {
        let kept_rows = verdict.rows();
        sess.cache.keep_rows(self.model.backend(), n, &kept_rows);
        sess.tokens.push(pending);
        sess.tokens
            .extend(verdict.kept.iter().map(|&i| draft.tokens()[i]));
        kept_rows
    }

    /// Emit a committed cycle's tokens — the kept drafts, then the verifier's next — in order. Where one ends
    /// the request, the session ends just before it, exactly where AR would have stopped; returns why.
    #[allow(clippy::too_many_arguments)] // a cycle's session, request, context, statistics and sink
    pub(super) fn emit_cycle(
        &self,
        sess: &mut Session<B>,
        req: &GenerateRequest,
        c: Cycle,
        context: &mut Vec<u32>,
        stats: &mut GenerationStats,
        first_at: &mut Option<Instant>,
        on_token: &mut dyn FnMut(&Tokenizer, &Emitted) -> bool,
    ) -> Result<Option<StopReason>> {
        let vocab = self.model.hp.vocab;
        let kept_rows = c.verdict.rows();
        let emitted = c.verdict.kept.iter().map(|&i| c.draft.tokens()[i]);
        for (j, tok) in emitted.chain([c.verdict.next]).enumerate() {
            let r = kept_rows[j];
            let e = Emission {
                token: tok,
                logits: c.logits.get(r * vocab..(r + 1) * vocab),
                start: c.start,
            };
            if let Some(reason) = self.emit(req, e, context, stats, first_at, on_token)? {
                // The cache holds everything before `tok`.
                sess.truncate(c.n + 1 + j);
                return Ok(Some(reason));
            }
        }
        Ok(None)
    }
}

/// A token the verifier chose, with its row's logits where the forward returned them.
pub(super) struct Emission<'a> {
    pub(super) token: u32,
    pub(super) logits: Option<&'a [f32]>,
    /// When the request started (its time to first token is measured from here).
    pub(super) start: Instant,
}

impl<B: Backend> Engine<B> {
    /// Hand a chosen token to the request: a stop token ends it; any other joins `context` and the
    /// completion, advances its grammar, goes to `on_token` with its log-probabilities, and ends the request
    /// where the caller, the grammar or the token limit says so. The first token sets the time to first token.
    #[allow(clippy::too_many_arguments)] // one token's request, context, statistics and sink
    pub(super) fn emit(
        &self,
        req: &GenerateRequest,
        e: Emission,
        context: &mut Vec<u32>,
        stats: &mut GenerationStats,
        first_at: &mut Option<Instant>,
        on_token: &mut dyn FnMut(&Tokenizer, &Emitted) -> bool,
    ) -> Result<Option<StopReason>> {
        let tok = e.token;
        if first_at.is_none() {
            let now = Instant::now();
            stats.ttft_s = (now - e.start).as_secs_f64();
            *first_at = Some(now);
        }
        if !req.ignore_eos && self.tokenizer.is_stop(tok) {
            return Ok(Some(StopReason::Stop));
        }
        context.push(tok);
        stats.completion_tokens += 1;
        let logprobs = (req.logprobs > 0 || req.want_logprob).then(|| {
            let logits = e.logits.expect("log-probabilities need the row's logits");
            Logprobs::of(logits, tok, req.logprobs)
        });
        let grammar_done = match &req.constraint {
            Some(c) => {
                c.commit(tok)?;
                c.finished()
            }
            None => false,
        };
        Ok(
            if !on_token(&self.tokenizer, &Emitted { id: tok, logprobs }) {
                Some(StopReason::Cancelled)
            } else if grammar_done {
                Some(StopReason::Stop)
            } else if stats.completion_tokens == req.max_tokens {
                Some(StopReason::MaxTokens)
            } else {
                None
            },
        )
    }
}
