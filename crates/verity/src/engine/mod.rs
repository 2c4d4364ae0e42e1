//! The request loop: prompt → prefill (reusing the session's cached prefix) → decode cycles → stream tokens.
//!
//! One loop serves every route. A cycle runs `[pending, d1..dk]` through the target in one forward (`pending` is
//! the last emitted token, not yet in the cache; `d1..dk` a proposer's drafts), lets the verifier keep a prefix
//! of the drafts and choose the next token, truncates the cache to the kept path and tells the proposer. Plain
//! AR decoding is the same cycle with `k = 0`, so the AR route and the speculative routes share every numeric
//! step, and row-exactness of the forward makes their greedy output identical.

mod stats;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

pub use stats::{GenerationStats, StopReason};

use crate::backend::Backend;
use crate::bundle::Bundle;
use crate::cache::{DiskTier, KvCache, KvCheckpoint, PrefixCache};
use crate::chat::{tools, ChatTemplate, Message, TemplateArgs, Tokenizer};
use crate::error::{Error, Result};
use crate::model::{Batch, LogitRows, Model, MtpHead};
use crate::sample::constraint::SharedConstraint;
use crate::sample::SamplerConfig;
use crate::spec::copy::SuffixCopy;
use crate::spec::draft_model::DraftModel;
use crate::spec::mtp::MtpProposer;
use crate::spec::{self, Controller, Plan, Proposer, Route, SpecMode, Verifier};

/// Rows per prefill forward: large enough to amortize weight reads, small enough to bound scratch memory.
pub const PREFILL_CHUNK: usize = 64;

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub max_tokens: usize,
    pub sampling: SamplerConfig,
    /// Keep generating through stop tokens (benchmarks that need a fixed length).
    pub ignore_eos: bool,
    /// Use the engine's speculative route (false = AR for this request).
    pub speculate: bool,
    /// Report the chosen token's log-probability with each token.
    pub want_logprob: bool,
    /// Also report this many most likely alternatives per token.
    pub logprobs: usize,
    /// A grammar the output must follow (decoded on the verified AR path: no drafts).
    pub constraint: Option<SharedConstraint>,
    /// Store a prefix-cache checkpoint after this many prompt tokens (the canonical boundary: the conversation
    /// without the generation prompt), captured during prefill; and one of the state after the answer.
    pub store_prefix: Option<usize>,
}

/// A completion token as it is emitted.
#[derive(Debug, Clone)]
pub struct Emitted {
    pub id: u32,
    pub logprobs: Option<Logprobs>,
}

/// Log-probabilities under the model's distribution (the log-softmax of its logits, before sampling settings).
#[derive(Debug, Clone)]
pub struct Logprobs {
    pub logprob: f32,
    /// The `n` most likely tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

impl Logprobs {
    fn of(logits: &[f32], token: u32, n: usize) -> Self {
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let lse = max
            + logits
                .iter()
                .map(|&v| ((v - max) as f64).exp())
                .sum::<f64>()
                .ln() as f32;
        let mut top: Vec<(u32, f32)> = Vec::with_capacity(n);
        if n > 0 {
            let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
            let n = n.min(idx.len());
            idx.select_nth_unstable_by(n - 1, |&a, &b| {
                logits[b as usize].total_cmp(&logits[a as usize])
            });
            idx.truncate(n);
            idx.sort_by(|&a, &b| {
                logits[b as usize]
                    .total_cmp(&logits[a as usize])
                    .then(a.cmp(&b))
            });
            top = idx
                .into_iter()
                .map(|i| (i, logits[i as usize] - lse))
                .collect();
        }
        Logprobs {
            logprob: logits[token as usize] - lse,
            top,
        }
    }
}

impl GenerateRequest {
    pub fn greedy(max_tokens: usize) -> Self {
        GenerateRequest {
            max_tokens,
            sampling: SamplerConfig::greedy(),
            ignore_eos: false,
            speculate: true,
            want_logprob: false,
            logprobs: 0,
            constraint: None,
            store_prefix: None,
        }
    }
}

/// A conversation rendered for the model.
#[derive(Debug, Clone)]
pub struct ChatPrompt {
    pub tokens: Vec<u32>,
    /// The canonical boundary: the length of the conversation rendered without the generation prompt, when that
    /// rendering is a token prefix of the prompt (where a prefix-cache checkpoint is worth storing).
    pub boundary: Option<usize>,
    /// The prompt ends inside an open reasoning block (the template opened `<think>`).
    pub opens_reasoning: bool,
}

/// A conversation's model state: the cache and the tokens whose K/V it holds.
pub struct Session<B: Backend> {
    pub cache: KvCache<B>,
    pub tokens: Vec<u32>,
    /// The target's final hidden states of committed positions, kept while the route's proposer conditions on
    /// them (an MTP head), so that a follow-up turn's head sees the whole conversation, not only the new part.
    hidden: HiddenTrail,
}

/// Final hidden states of a contiguous run of committed positions `start..start + rows`.
#[derive(Debug, Default)]
struct HiddenTrail {
    start: usize,
    width: usize,
    rows: Vec<f32>,
}

impl HiddenTrail {
    fn end(&self) -> usize {
        self.start + self.rows.len().checked_div(self.width).unwrap_or(0)
    }

    /// Forget positions `pos..`.
    fn truncate(&mut self, pos: usize) {
        if pos <= self.start {
            self.rows.clear();
            self.start = pos;
        } else if pos < self.end() {
            self.rows.truncate((pos - self.start) * self.width);
        }
    }

    /// Rows for positions `pos..`: appended when they continue the run, else they start a new one.
    fn push(&mut self, pos: usize, rows: &[f32], width: usize) {
        if self.width != width || pos != self.end() {
            self.rows.clear();
            self.start = pos;
            self.width = width;
        }
        self.rows.extend_from_slice(rows);
    }
}

pub struct Engine<B: Backend> {
    pub model: Model<B>,
    pub tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    pub plan: Plan,
    proposer: Option<Box<dyn Proposer>>,
    /// Checkpoints of earlier prompts (off until a budget is set).
    prefix: PrefixCache<KvCheckpoint>,
    /// Their persistent copies (off until a folder is set).
    disk: Option<DiskTier>,
    /// Identifies the model's weights in the disk tier ([`Bundle::fingerprint`]).
    fingerprint: u64,
    /// Caches of ended sessions, handed to new ones ([`Engine::end_session`]).
    spare: Vec<KvCache<B>>,
}

/// Ended sessions' caches kept for new ones. A cache keeps its buffers (and the capacity they grew to), so a
/// new session's forwards run on the same buffers as the last one's: a backend that records forwards per
/// buffer set (CUDA graphs) replays them instead of recording every shape again for every request, and no
/// allocation happens per request. More than a worker's session and a spare would only hold memory.
const SPARE_CACHES: usize = 2;

impl<B: Backend> Engine<B> {
    /// Load a bundle and set up the speculative route `mode` resolves to.
    pub fn load(path: &Path, backend: Arc<B>, mode: &SpecMode) -> Result<Self> {
        let bundle = Bundle::open(path)?;
        let tokenizer = Tokenizer::from_bundle(&bundle)?;
        let model = Model::load(&bundle, backend.clone())?;
        if tokenizer.vocab_size() > model.hp.vocab {
            return Err(Error::Invalid(format!(
                "the tokenizer has {} tokens but the model only {}",
                tokenizer.vocab_size(),
                model.hp.vocab
            )));
        }
        let template = match &tokenizer.chat_template {
            Some(src) => {
                let tok_str =
                    |id: Option<u32>| id.and_then(|i| tokenizer.token_str(i)).unwrap_or_default();
                Some(ChatTemplate::new(
                    src,
                    &tok_str(tokenizer.bos),
                    &tok_str(tokenizer.eos),
                )?)
            }
            None => None,
        };
        let mut plan = spec::plan(&bundle, mode)?;
        let fingerprint = bundle.fingerprint();
        let proposer: Option<Box<dyn Proposer>> = match &plan.route {
            Route::Ar => None,
            Route::Copy => Some(Box::new(SuffixCopy::new())),
            Route::Mtp => match MtpHead::load(&bundle, &model) {
                Ok(head) => Some(Box::new(MtpProposer::new(
                    head,
                    model.hp.vocab,
                    model.hp.context_len,
                )?)),
                Err(e) if *mode == SpecMode::Auto => {
                    // A head that looked complete but does not load is not a reason to fail: take the next route.
                    tracing::warn!("MTP head unusable, copying instead: {e}");
                    plan = Plan {
                        route: Route::Copy,
                        reason: format!("MTP head unusable ({e}): copy from the prompt"),
                    };
                    Some(Box::new(SuffixCopy::new()))
                }
                Err(e) => return Err(e),
            },
            Route::DraftModel(p) => {
                let draft_bundle = Bundle::open(p)?;
                let draft_tok = Tokenizer::from_bundle(&draft_bundle)?;
                if draft_tok.vocab_size() != tokenizer.vocab_size() {
                    return Err(Error::Invalid(format!(
                        "draft model {} has another tokenizer ({} tokens, the target has {})",
                        p.display(),
                        draft_tok.vocab_size(),
                        tokenizer.vocab_size()
                    )));
                }
                let draft = Model::load(&draft_bundle, backend)?;
                Some(Box::new(DraftModel::new(draft, model.hp.vocab, None)?))
            }
        };
        Ok(Engine {
            model,
            tokenizer,
            template,
            plan,
            proposer,
            prefix: PrefixCache::new(0),
            disk: None,
            fingerprint,
            spare: Vec::new(),
        })
    }

    /// Keep prefix-cache checkpoints up to `bytes` in RAM (0 turns the cache off and drops what it holds).
    pub fn set_prefix_cache_budget(&mut self, bytes: usize) {
        self.prefix = PrefixCache::new(bytes);
    }

    /// Persist prefix-cache checkpoints under `root` (a folder per model fingerprint and backend numerics, so a
    /// checkpoint is only restored by the same weights computing the same bits), up to `quota` bytes.
    /// Returns false (with a warning logged) when the folder cannot be used; generation is unaffected.
    pub fn set_prefix_cache_dir(&mut self, root: &Path, quota: u64) -> bool {
        let kv_dim = self.model.hp.n_kv_heads * self.model.hp.head_dim;
        self.disk = DiskTier::open(
            root,
            self.fingerprint,
            &self.model.backend().numerics(),
            self.model.hp.n_layers,
            kv_dim,
            quota,
        );
        self.disk.is_some()
    }

    /// The disk tier, if one is set.
    pub fn prefix_disk(&self) -> Option<&DiskTier> {
        self.disk.as_ref()
    }

    /// Drop every prefix-cache checkpoint, in RAM and on disk.
    pub fn clear_prefix_cache(&mut self) {
        self.prefix.clear();
        if let Some(d) = self.disk.as_mut() {
            d.clear();
        }
    }

    /// Keep a checkpoint of the session's committed state for `tokens`, in RAM and on disk.
    fn store_checkpoint(&mut self, sess: &Session<B>, tokens: &[u32]) -> f64 {
        let t = Instant::now();
        let ckpt = sess.cache.checkpoint(self.model.backend());
        if let Some(d) = self.disk.as_mut() {
            d.store(tokens, &ckpt);
        }
        let bytes = ckpt.bytes();
        self.prefix.insert(tokens, ckpt, bytes);
        t.elapsed().as_secs_f64()
    }

    /// Replace the proposer (tests drive the loop with adversarial proposers through this).
    pub fn set_proposer(&mut self, proposer: Option<Box<dyn Proposer>>) {
        self.proposer = proposer;
    }

    /// An empty session: on an ended session's cache where one is spare, else on a new one.
    pub fn new_session(&mut self) -> Session<B> {
        let cache = match self.spare.pop() {
            Some(mut cache) => {
                cache.truncate(0);
                cache
            }
            None => self.model.new_cache(self.model.hp.context_len),
        };
        Session {
            cache,
            tokens: Vec::new(),
            hidden: HiddenTrail::default(),
        }
    }

    /// End `sess`, keeping its cache's buffers for a later [`Engine::new_session`].
    pub fn end_session(&mut self, sess: Session<B>) {
        if self.spare.len() < SPARE_CACHES {
            self.spare.push(sess.cache);
        }
    }

    /// The prompt tokens for a conversation (see [`Engine::render_chat`]).
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        Ok(self.render_chat(messages, &TemplateArgs::default())?.tokens)
    }

    /// Whether the model writes reasoning blocks (`<think>`), which the answer then returns separately.
    pub fn reasoning_tags(&self) -> bool {
        self.template.as_ref().is_some_and(|t| t.knows_reasoning())
    }

    /// The prompt for a conversation: the chat template with a generation prompt, or — for a bundle without a
    /// template (a base model) — the messages' contents as raw text. Tools reach a template that knows none
    /// through its system message ([`crate::chat::tools`]).
    pub fn render_chat(&self, messages: &[Message], args: &TemplateArgs) -> Result<ChatPrompt> {
        let Some(t) = &self.template else {
            let text: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
            return Ok(ChatPrompt {
                tokens: self.tokenizer.encode(&text.join("\n"), true)?,
                boundary: None,
                opens_reasoning: false,
            });
        };
        let adapted;
        let plain_args;
        let (messages, args) = if args.tools.is_some() && !t.knows_tools() {
            adapted = tools::for_plain_template(messages, args.tools.as_ref());
            plain_args = TemplateArgs {
                tools: None,
                kwargs: args.kwargs.clone(),
            };
            (adapted.as_slice(), &plain_args)
        } else {
            (messages, args)
        };
        let text = t.render(messages, true, args)?;
        let tokens = self.tokenizer.encode(&text, true)?;
        let head = self
            .tokenizer
            .encode(&t.render(messages, false, args)?, true)?;
        let boundary =
            (head.len() < tokens.len() && tokens.starts_with(&head)).then_some(head.len());
        Ok(ChatPrompt {
            tokens,
            boundary,
            opens_reasoning: t.knows_reasoning() && text.trim_end().ends_with("<think>"),
        })
    }

    /// Bring the session's cache to `prompt[..len - 1]`, reusing the session's cached prefix or the longest
    /// prefix-cache checkpoint, whichever is longer; the last prompt token stays out of the cache (it starts the
    /// first decode cycle). A checkpoint is stored when prefill passes `store_at`. Returns the reused tokens
    /// and the seconds spent storing.
    fn prefill(
        &mut self,
        sess: &mut Session<B>,
        prompt: &[u32],
        store_at: Option<usize>,
        proposer: Option<&mut (dyn Proposer + 'static)>,
    ) -> Result<(usize, f64)> {
        let body = &prompt[..prompt.len() - 1];
        let mut common = sess
            .tokens
            .iter()
            .zip(body)
            .take_while(|(a, b)| a == b)
            .count();
        let in_ram = self.prefix.longest(body).map_or(0, |(m, _)| m);
        let on_disk = self.disk.as_ref().map_or(0, |d| d.best_len(body));
        if on_disk > in_ram.max(common) {
            if let Some((m, ckpt)) = self.disk.as_mut().and_then(|d| d.longest(body)) {
                if m > common {
                    sess.cache.restore(self.model.backend(), &ckpt)?;
                    sess.hidden.truncate(0);
                    sess.tokens.clear();
                    sess.tokens.extend_from_slice(&body[..m]);
                    common = m;
                    let bytes = ckpt.bytes();
                    self.prefix.insert(&body[..m], ckpt, bytes);
                }
            }
        }
        if in_ram > common {
            if let Some((m, ckpt)) = self.prefix.longest(body) {
                sess.cache.restore(self.model.backend(), ckpt)?;
                sess.hidden.truncate(0);
                sess.tokens.clear();
                sess.tokens.extend_from_slice(&body[..m]);
                common = m;
            }
        }
        sess.cache.truncate(common);
        sess.tokens.truncate(common);
        sess.hidden.truncate(common);
        let h = self.model.hp.hidden;
        let caching = self.prefix.budget() > 0 || self.disk.is_some();
        let store_at = store_at.filter(|&b| b > common && b <= body.len() && caching);
        let mut store_s = 0.0;
        let mut pos = common;
        while pos < body.len() {
            // Chunks end at the canonical boundary so the checkpoint is taken exactly there.
            let end = match store_at {
                Some(b) if pos < b => (pos + PREFILL_CHUNK).min(b),
                _ => (pos + PREFILL_CHUNK).min(body.len()),
            };
            let chunk = &body[pos..end];
            let batch = Batch::causal(chunk, pos);
            if proposer.as_deref().is_some_and(|p| p.wants_hidden()) {
                let out =
                    self.model
                        .forward_with_hidden(&mut sess.cache, &batch, LogitRows::None)?;
                sess.hidden.push(pos, &out.final_hidden, h);
            } else {
                self.model
                    .forward(&mut sess.cache, &batch, LogitRows::None, &[])?;
            }
            sess.tokens.extend_from_slice(chunk);
            pos = end;
            if Some(pos) == store_at {
                store_s = self.store_checkpoint(sess, &body[..pos]);
            }
        }
        if let Some(p) = proposer.filter(|p| p.wants_hidden()) {
            if sess.hidden.end() == body.len() && !sess.hidden.rows.is_empty() {
                p.observe_hidden(sess.hidden.start, &sess.hidden.rows);
            }
        }
        Ok((common, store_s))
    }

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
        let mut verifier = Verifier::new(req.sampling)?;
        if prompt.len() > sess.cache.max_capacity() {
            return Err(Error::Invalid(format!(
                "the prompt ({} tokens) exceeds the context length ({})",
                prompt.len(),
                sess.cache.max_capacity()
            )));
        }
        let mut proposer = if req.speculate && req.constraint.is_none() {
            self.proposer.take()
        } else {
            None
        };
        if let Some(p) = proposer.as_mut() {
            p.reset(&req.sampling);
        }
        let prefilled = self.prefill(sess, prompt, req.store_prefix, proposer.as_deref_mut());
        let (restored, store_s) = match prefilled {
            Ok(x) => x,
            Err(e) => {
                if proposer.is_some() {
                    self.proposer = proposer;
                }
                return Err(e);
            }
        };
        let result = self.decode(
            sess,
            prompt,
            req,
            &mut verifier,
            proposer.as_deref_mut(),
            start,
            &mut on_token,
        );
        if proposer.is_some() {
            self.proposer = proposer;
        }
        let mut stats = result?;
        stats.prompt_tokens = prompt.len();
        stats.restored_tokens = restored;
        stats.store_s = store_s;
        if req.store_prefix.is_some()
            && (self.prefix.budget() > 0 || self.disk.is_some())
            && sess.tokens.len() > prompt.len()
        {
            // Also keep the state after the answer: the next turn's prompt usually re-tokenizes it to the same
            // ids, so the follow-up restores the answer too. Taken from the live cache, never by replaying.
            let tokens = sess.tokens.clone();
            stats.store_s += self.store_checkpoint(sess, &tokens);
        }
        Ok(stats)
    }

    #[allow(clippy::too_many_arguments)]
    fn decode(
        &mut self,
        sess: &mut Session<B>,
        prompt: &[u32],
        req: &GenerateRequest,
        verifier: &mut Verifier,
        mut proposer: Option<&mut (dyn Proposer + 'static)>,
        start: Instant,
        on_token: &mut impl FnMut(&Tokenizer, &Emitted) -> bool,
    ) -> Result<GenerationStats> {
        let vocab = self.model.hp.vocab;
        let mut stats = GenerationStats::new(proposer.as_ref().map_or("ar", |p| p.name()));
        let mut controller = Controller::default();
        // Where each row's argmax decides the verdict and nothing else reads the logits, the forward returns the
        // argmax alone (one value per row from the device, not a vocabulary).
        let wants = if verifier.argmax_decides()
            && req.constraint.is_none()
            && req.logprobs == 0
            && !req.want_logprob
        {
            LogitRows::Greedy
        } else {
            LogitRows::All
        };
        // `context` = committed tokens + `pending` (its last element).
        let mut context = prompt.to_vec();
        let mut first_at = None;
        'cycles: while stats.completion_tokens < req.max_tokens {
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
                    let k = controller.choose(p.width(limit));
                    if k > 0 {
                        let mut d = p.propose(&context, k)?;
                        d.tokens.truncate(k);
                        d.q.truncate(k);
                        d
                    } else {
                        spec::Draft::default()
                    }
                }
                None => spec::Draft::default(),
            };
            let t1 = Instant::now();
            let pending = *context.last().expect("non-empty context");
            let mut rows = Vec::with_capacity(1 + draft.tokens.len());
            rows.push(pending);
            rows.extend_from_slice(&draft.tokens);
            let batch = Batch::causal(&rows, n);
            let wants_hidden = proposer.as_deref().is_some_and(|p| p.wants_hidden());
            let mut out = if wants_hidden {
                self.model
                    .forward_with_hidden(&mut sess.cache, &batch, wants)?
            } else {
                self.model.forward(&mut sess.cache, &batch, wants, &[])?
            };
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
                LogitRows::Greedy => verifier.verify_greedy(&out.greedy, &draft.tokens),
                _ => verifier.verify(&out.logits, vocab, &context, &draft.tokens, &draft.q),
            };
            // Commit the kept path: pending + accepted drafts; roll back the rest everywhere.
            sess.cache.truncate(n + 1 + verdict.accepted);
            sess.tokens.push(pending);
            sess.tokens
                .extend_from_slice(&draft.tokens[..verdict.accepted]);
            if let Some(p) = proposer.as_deref_mut() {
                p.observe(draft.tokens.len(), verdict.accepted);
                if wants_hidden {
                    let h = self.model.hp.hidden;
                    let kept = &out.final_hidden[..(1 + verdict.accepted) * h];
                    p.observe_hidden(n, kept);
                    sess.hidden.push(n, kept, h);
                }
            }
            controller.record(
                draft.tokens.len(),
                verdict.accepted,
                rows.len(),
                (t2 - t1).as_secs_f64(),
                (t1 - t0).as_secs_f64(),
            );
            stats.record_cycle(
                draft.tokens.len(),
                verdict.accepted,
                t1 - t0,
                t2 - t1,
                t2.elapsed(),
            );

            let emitted: Vec<u32> = draft.tokens[..verdict.accepted]
                .iter()
                .copied()
                .chain([verdict.next])
                .collect();
            for (j, &tok) in emitted.iter().enumerate() {
                if first_at.is_none() {
                    let now = Instant::now();
                    stats.ttft_s = (now - start).as_secs_f64();
                    first_at = Some(now);
                }
                let stop = if !req.ignore_eos && self.tokenizer.is_stop(tok) {
                    Some(StopReason::Stop)
                } else {
                    context.push(tok);
                    stats.completion_tokens += 1;
                    let logprobs = (req.logprobs > 0 || req.want_logprob).then(|| {
                        Logprobs::of(&out.logits[j * vocab..(j + 1) * vocab], tok, req.logprobs)
                    });
                    let grammar_done = match &req.constraint {
                        Some(c) => {
                            c.commit(tok)?;
                            c.finished()
                        }
                        None => false,
                    };
                    if !on_token(&self.tokenizer, &Emitted { id: tok, logprobs }) {
                        Some(StopReason::Cancelled)
                    } else if grammar_done {
                        Some(StopReason::Stop)
                    } else if stats.completion_tokens == req.max_tokens {
                        Some(StopReason::MaxTokens)
                    } else {
                        None
                    }
                };
                if let Some(reason) = stop {
                    // End exactly where AR would: the cache holds everything before `tok`.
                    sess.cache.truncate(n + 1 + j);
                    sess.tokens.truncate(n + 1 + j);
                    sess.hidden.truncate(n + 1 + j);
                    stats.stop = reason;
                    break 'cycles;
                }
            }
        }
        if let Some(t) = first_at {
            stats.decode_s = t.elapsed().as_secs_f64();
        }
        Ok(stats)
    }
}
