//! Decoding several requests together, one token each per batched forward (what a continuously batching
//! server steps): requests join between steps ([`Engine::start_decoding`]) and leave when they finish.
//!
//! Each request's step is the AR cycle of `decode.rs` with no drafts — its pending token through the target, the
//! verifier's draw from that row — run as one row of a [`Model::forward_batched`] beside the others' rows. The
//! forward gives each row bitwise its own forward's logits and the draw is keyed by the request's seed and
//! position, so every request gets bitwise the tokens it would get alone, on any route (every route's output
//! is AR's), whichever requests share its steps and whenever it joined.

use std::time::{Duration, Instant};

use super::decode::{logits_wanted, Emission};
use super::{Emitted, Engine, GenerateRequest, GenerationStats, Session, StopReason};
use crate::backend::Backend;
use crate::chat::Tokenizer;
use crate::error::{Error, Result};
use crate::model::{Batch, LogitRows, SeqForward};
use crate::speculative::{Draft, Verifier};

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
}

impl<B: Backend> Decoding<B> {
    /// The request's statistics once it has finished (`None` while it decodes).
    pub fn finished(&self) -> Option<&GenerationStats> {
        self.done.then_some(&self.stats)
    }

    /// The session (its cache holds the prompt and the completion) and the statistics.
    pub fn into_parts(self) -> (Session<B>, GenerationStats) {
        (self.session, self.stats)
    }

    /// What is left of the request (its token limit counts from where it joined batched steps).
    pub fn request(&self) -> &GenerateRequest {
        &self.request
    }
}

impl<B: Backend> Engine<B> {
    /// Prefill `prompt` into `session` (restoring what the prefix cache holds) and make the request ready to
    /// decode in batched steps. Requests with a grammar constraint decode alone ([`Engine::generate`]).
    pub fn start_decoding(
        &mut self,
        mut session: Session<B>,
        prompt: &[u32],
        request: GenerateRequest,
    ) -> Result<Decoding<B>> {
        if prompt.is_empty() {
            return Err(Error::Invalid("empty prompt".into()));
        }
        if request.constraint.is_some() {
            return Err(Error::Invalid(
                "a constrained request decodes alone, not in a batch".into(),
            ));
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
        let prefilled = self.prefill(&mut session, prompt, request.store_prefix, None)?;
        let mut stats = GenerationStats::new("ar");
        stats.prompt_tokens = prompt.len();
        stats.restored_tokens = prefilled.restored;
        stats.store_s = prefilled.store_s;
        let done = request.max_tokens == 0;
        Ok(Decoding {
            session,
            request,
            verifier,
            context: prompt.to_vec(),
            stats,
            start,
            first_at: None,
            done,
            earlier: None,
        })
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
        if d.done {
            d.stats = earlier.then(&d.stats);
        } else {
            d.earlier = Some(earlier);
        }
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
        let so_far = match earlier {
            Some(e) => e.then(&stats),
            None => stats,
        };
        let later = self.generate(&mut session, &context, &request, on_token)?;
        Ok((session, so_far.then(&later)))
    }

    /// One token of every unfinished request of `batch`, in one batched forward. `emit(i, tokenizer, token)`
    /// receives request `i`'s token and returns `false` to cancel that request. A request that finishes (a stop
    /// token, its token limit, the context's end, cancelled) is marked so and takes no further steps.
    pub fn decode_step(
        &mut self,
        batch: &mut [Decoding<B>],
        mut emit: impl FnMut(usize, &Tokenizer, &Emitted) -> bool,
    ) -> Result<()> {
        let vocab = self.model.hp.vocab;
        for d in batch.iter_mut() {
            if !d.done && d.session.cache.len() + 1 > d.session.cache.max_capacity() {
                d.done = true;
                d.stats.stop = StopReason::ContextFull;
            }
        }
        let live: Vec<usize> = (0..batch.len()).filter(|&i| !batch[i].done).collect();
        if live.is_empty() {
            return Ok(());
        }
        let t0 = Instant::now();
        let rows: Vec<Batch> = live
            .iter()
            .map(|&i| {
                let d = &batch[i];
                let pending = *d.context.last().expect("non-empty context");
                Batch::causal(&[pending], d.session.cache.len())
            })
            .collect();
        let wants: Vec<LogitRows> = live
            .iter()
            .map(|&i| logits_wanted(&batch[i].verifier, &batch[i].request))
            .collect();
        let outs = {
            // The live requests in order, as `live` lists them.
            let mut seqs: Vec<SeqForward<B>> = batch
                .iter_mut()
                .filter(|d| !d.done)
                .zip(rows.iter().zip(&wants))
                .map(|(d, (rows, &logits))| SeqForward {
                    cache: &mut d.session.cache,
                    batch: rows,
                    logits,
                })
                .collect();
            self.model.forward_batched(&mut seqs)?
        };
        let verify = t0.elapsed();
        for ((&i, out), want) in live.iter().zip(&outs).zip(&wants) {
            let d = &mut batch[i];
            let no_draft = Draft::default();
            let verdict = match want {
                LogitRows::Greedy => d.verifier.verify_greedy(&out.greedy, &no_draft),
                _ => d.verifier.verify(&out.logits, vocab, &d.context, &no_draft),
            };
            let pending = *d.context.last().expect("non-empty context");
            d.session.tokens.push(pending);
            d.stats
                .record_cycle(0, 0, Duration::ZERO, verify, Duration::ZERO);
            let stop = self.emit(
                &d.request,
                Emission {
                    token: verdict.next,
                    logits: out.logits.get(..vocab),
                    start: d.start,
                },
                &mut d.context,
                &mut d.stats,
                &mut d.first_at,
                &mut |tok, emitted| emit(i, tok, emitted),
            )?;
            if let Some(reason) = stop {
                d.done = true;
                d.stats.stop = reason;
                if let Some(t) = d.first_at {
                    d.stats.decode_s = t.elapsed().as_secs_f64();
                }
                d.stats.store_s +=
                    self.store_answer(&d.session, &d.request, d.stats.prompt_tokens)?;
                if let Some(earlier) = d.earlier.take() {
                    d.stats = earlier.then(&d.stats);
                }
            }
        }
        Ok(())
    }
}
