//! The engine thread: requests decode together in batched steps, each answer bitwise what it would be alone.
//!
//! A request that arrives while nothing else decodes runs alone, drafting on its speculative route (a verify's
//! rows are that request's). When another request arrives, the one decoding alone stops at its next token and
//! both go on in batched steps (`Engine::decode_step`: one forward carries every request's next row and, with
//! batched drafts on, the drafts it copies from its own context); requests
//! join between steps, up to `max_batch`, and leave when they finish; the last one left goes on alone on its
//! speculative route again. Every route emits AR's tokens and each draw is keyed by the request's seed and
//! position, so these moves change no token of any answer (tested through the HTTP API). A constrained request
//! (a grammar) takes the batched steps too, its grammar masking each of its rows as alone. A newcomer's prompt is prefilled in chunks by the
//! batched steps, beside the others' tokens. A bounded queue keeps latency predictable and answers 503
//! when it is full. Finished requests' sessions stay a while, so a follow-up turn of a recent conversation
//! reuses its cached prefix (others come back from the prefix cache). A request is cancelled as soon as its
//! client goes away (its event channel closes).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;
use verity::backend::Backend;
use verity::chat::{Message, OutputParser, StreamDecoder, TemplateArgs, Tokenizer, ToolCall};
use verity::engine::{
    Decoding, Emitted, Engine, GenerateRequest, GenerationStats, Session, StopReason,
};
use verity::sample::constraint::SharedConstraint;
use verity::vision::ImageLimits;

use crate::api::{Params, ResponseFormat, ToolChoice};
use crate::error::ApiError;
use crate::grammar::Grammars;
use crate::metrics::Metrics;
use crate::Capacity;

pub enum Input {
    /// The messages and the bytes of the images their contents place.
    Chat(Vec<Message>, Vec<Vec<u8>>),
    Text(String),
}

pub struct Job {
    pub input: Input,
    pub params: Params,
    pub events: UnboundedSender<Event>,
}

/// A token's log-probability and the best alternatives, as text.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

#[derive(Debug)]
pub enum Event {
    /// New answer text and reasoning text (either possibly empty when a token completes no character yet),
    /// with its token's log-probability.
    Delta {
        text: String,
        reasoning: String,
        logprob: Option<TokenLogprob>,
    },
    Done {
        finish_reason: &'static str,
        /// The stop string that ended the answer, if one did.
        stop_sequence: Option<String>,
        stats: GenerationStats,
        /// Tool calls parsed from the answer.
        tool_calls: Vec<ToolCall>,
    },
    Error(ApiError),
}

/// What the engine thread is asked to do.
enum Task {
    Generate(Box<Job>),
    /// Forget the cached conversation (the prefix-cache reset endpoint).
    ResetCache,
}

#[derive(Clone)]
pub struct Worker {
    queue: SyncSender<Task>,
    shutdown: Arc<Shutdown>,
}

/// How far a shutdown has gone: draining (no new requests; queued ones answered 503 as the engine reaches
/// them) and then cancelling (the generation in progress stops at its next token, its answer ending as
/// `cancelled`).
#[derive(Default)]
struct Shutdown {
    draining: AtomicBool,
    cancelling: AtomicBool,
}

fn shutting_down() -> ApiError {
    ApiError::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "server_shutting_down",
        "the server is shutting down",
    )
}

impl Worker {
    /// Start the engine thread with a queue of `capacity.queue` waiting requests, decoding up to
    /// `capacity.batch` of them together within `capacity.kv_budget`.
    pub fn start<B: Backend>(engine: Engine<B>, capacity: Capacity, metrics: Arc<Metrics>) -> Self {
        let (tx, rx) = sync_channel::<Task>(capacity.queue);
        let shutdown = Arc::new(Shutdown::default());
        let scheduler = Scheduler {
            engine,
            grammars: None,
            batch: Vec::new(),
            answers: Vec::new(),
            parked: None,
            idle: Vec::new(),
            max_batch: capacity.batch.max(1),
            kv_budget: capacity.kv_budget,
            metrics,
            flags: shutdown.clone(),
        };
        std::thread::Builder::new()
            .name("verity-engine".into())
            .spawn(move || scheduler.run(rx))
            .expect("spawning the engine thread");
        Worker {
            queue: tx,
            shutdown,
        }
    }

    pub fn submit(&self, job: Job, metrics: &Metrics) -> Result<(), ApiError> {
        if self.shutdown.draining.load(Relaxed) {
            return Err(shutting_down());
        }
        self.send(Task::Generate(Box::new(job)), metrics)
    }

    /// The first phase of a shutdown: no new requests, and the queued ones are answered 503; the one in
    /// progress goes on.
    pub fn drain(&self) {
        self.shutdown.draining.store(true, Relaxed);
    }

    /// The second phase: the generation in progress stops at its next token.
    pub fn cancel_in_flight(&self) {
        self.shutdown.cancelling.store(true, Relaxed);
    }

    /// Forget the cached conversation; runs after the requests already queued.
    pub fn reset_cache(&self, metrics: &Metrics) -> Result<(), ApiError> {
        self.send(Task::ResetCache, metrics)
    }

    fn send(&self, task: Task, metrics: &Metrics) -> Result<(), ApiError> {
        metrics
            .queue_depth
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match self.queue.try_send(task) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                metrics
                    .queue_depth
                    .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                metrics
                    .rejected
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Err(ApiError::overloaded())
            }
            Err(TrySendError::Disconnected(_)) => {
                Err(ApiError::internal("the engine thread has stopped"))
            }
        }
    }
}

/// Holds back text that may be the start of a stop string, and cuts at the first stop string.
struct StopScan {
    stops: Vec<String>,
    held: String,
}

impl StopScan {
    /// Returns the text that is safe to emit and the stop string reached, if one was (the earliest in the
    /// text; of two starting there, the first listed).
    fn push(&mut self, text: &str) -> (String, Option<String>) {
        self.held.push_str(text);
        if let Some((cut, stop)) = self
            .stops
            .iter()
            .filter_map(|s| Some((self.held.find(s.as_str())?, s)))
            .min_by_key(|&(at, _)| at)
        {
            let out = self.held[..cut].to_string();
            let stop = stop.clone();
            self.held.clear();
            return (out, Some(stop));
        }
        // Keep the longest suffix that is a proper prefix of a stop string.
        let mut keep = 0;
        for s in &self.stops {
            for l in (1..s.len()).rev() {
                if l <= self.held.len() && s.is_char_boundary(l) && self.held.ends_with(&s[..l]) {
                    keep = keep.max(l);
                    break;
                }
            }
        }
        let emit_to = self.held.len() - keep;
        let out = self.held[..emit_to].to_string();
        self.held.drain(..emit_to);
        (out, None)
    }

    fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// The grammar a request's answer must follow, if any.
fn constraint<B: Backend>(
    engine: &Engine<B>,
    grammars: &mut Option<Grammars>,
    p: &Params,
) -> Result<Option<SharedConstraint>, ApiError> {
    let wanted = p.response_format != ResponseFormat::Text
        || matches!(p.tool_choice, ToolChoice::Required | ToolChoice::Named(_));
    if !wanted {
        return Ok(None);
    }
    if grammars.is_none() {
        let g = Grammars::new(&engine.tokenizer, engine.model.hp.vocab).map_err(|e| {
            ApiError::internal(format!("indexing the vocabulary for grammars: {e}"))
        })?;
        *grammars = Some(g);
    }
    let g = grammars.as_ref().expect("set above");
    let functions: Vec<&serde_json::Value> = p
        .tools
        .as_ref()
        .and_then(|t| t.as_array())
        .into_iter()
        .flatten()
        .filter_map(|t| t.get("function"))
        .collect();
    let grammar = match (&p.response_format, &p.tool_choice) {
        (ResponseFormat::JsonObject, _) => g.json(None),
        (ResponseFormat::JsonSchema(s), _) => g.json(Some(s)),
        (_, ToolChoice::Required) => g.tool_calls(&functions),
        (_, ToolChoice::Named(n)) => {
            let f: Vec<&serde_json::Value> = functions
                .into_iter()
                .filter(|f| f.get("name").and_then(|x| x.as_str()) == Some(n.as_str()))
                .collect();
            g.tool_calls(&f)
        }
        _ => unreachable!("checked by `wanted`"),
    };
    let param = if p.response_format != ResponseFormat::Text {
        "response_format"
    } else {
        "tools"
    };
    grammar
        .map(|g| Some(SharedConstraint::new(g)))
        .map_err(|e| ApiError::invalid(format!("cannot compile the grammar: {e}"), Some(param)))
}

/// A request ready to decode: its generation request and its answer's streaming state (with its prompt).
struct Prepared {
    request: GenerateRequest,
    answer: Answer,
}

/// Tokenize and check a job; build its generation request and answer state.
fn prepare<B: Backend>(
    engine: &Engine<B>,
    grammars: &mut Option<Grammars>,
    job: Job,
) -> Result<Prepared, ApiError> {
    let images = match &job.input {
        Input::Chat(_, images) if !images.is_empty() => {
            let vision = engine.vision.as_ref().ok_or_else(|| {
                ApiError::unsupported("images: this model has no vision tower", "messages")
            })?;
            if job.params.tools.is_some() {
                return Err(ApiError::unsupported("tools with images", "tools"));
            }
            images
                .iter()
                .enumerate()
                .map(|(i, bytes)| {
                    vision
                        .image(bytes, &ImageLimits::default())
                        .map_err(|e| ApiError::invalid(format!("image {i}: {e}"), Some("messages")))
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        _ => Vec::new(),
    };
    let (prompt, boundary, opens_reasoning) = match &job.input {
        Input::Chat(messages, _) if !images.is_empty() => engine
            .render_chat_with_images(messages, &images)
            .map(|p| (p.tokens, p.boundary, p.opens_reasoning)),
        Input::Chat(messages, _) => {
            let args = TemplateArgs {
                tools: job.params.tools.clone(),
                kwargs: job.params.template_kwargs.clone(),
            };
            engine
                .render_chat(messages, &args)
                .map(|p| (p.tokens, p.boundary, p.opens_reasoning))
        }
        Input::Text(text) => engine
            .tokenizer
            .encode(text, true)
            .map(|p| (p, None, false)),
    }
    .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    let constraint = constraint(engine, grammars, &job.params)?;
    let context = engine.model.hp.context_len;
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "the prompt is empty after tokenization",
            Some("messages"),
        ));
    }
    if prompt.len() >= context {
        return Err(ApiError::invalid(
            format!(
                "the prompt ({} tokens) does not fit the context ({context})",
                prompt.len()
            ),
            Some("messages"),
        ));
    }
    let room = context - prompt.len();
    let max_tokens = match job.params.max_tokens {
        Some(m) if m > room => {
            return Err(ApiError::invalid(
                format!(
                "max_tokens {m} exceeds the context left after the prompt ({room} of {context})"
            ),
                Some("max_tokens"),
            ))
        }
        Some(m) => m,
        None => room.min(4096),
    };
    let request = GenerateRequest {
        max_tokens,
        sampling: job.params.sampling,
        ignore_eos: false,
        speculate: job.params.speculate,
        draft_width: None,
        want_logprob: job.params.logprobs.is_some(),
        logprobs: job.params.logprobs.unwrap_or(0),
        constraint,
        store_prefix: boundary,
        images,
    };
    let answer = Answer {
        events: job.events,
        prompt,
        max_tokens,
        ids: Vec::new(),
        decoder: StreamDecoder::new(),
        scan: StopScan {
            stops: job.params.stop.clone(),
            held: String::new(),
        },
        parser: OutputParser::new(
            opens_reasoning,
            engine.reasoning_tags(),
            job.params.tools.is_some(),
        ),
        tool_calls: Vec::new(),
        hit_stop: None,
        failure: None,
        kv_need: 0,
    };
    Ok(Prepared { request, answer })
}

/// An answer as it streams: its text decoder, stop strings, reasoning and tool-call parser, and where its
/// events go.
struct Answer {
    events: UnboundedSender<Event>,
    /// The prompt, the request's token limit, and the completion's tokens so far (a request moving between
    /// decoding alone and batched steps goes on from them).
    prompt: Vec<u32>,
    max_tokens: usize,
    ids: Vec<u32>,
    decoder: StreamDecoder,
    scan: StopScan,
    parser: OutputParser,
    tool_calls: Vec<ToolCall>,
    hit_stop: Option<String>,
    failure: Option<ApiError>,
    /// Bytes of KV cache its session holds at its prompt plus its token limit: what it counts against the KV
    /// budget while it decodes.
    kv_need: usize,
}

impl Answer {
    /// The prompt and the completion so far.
    fn context(&self) -> Vec<u32> {
        self.prompt.iter().chain(&self.ids).copied().collect()
    }

    /// Stream a completion token; `false` ends the answer (a stop string, a failure, the client gone, the
    /// server shutting down).
    fn push(&mut self, tok: &Tokenizer, emitted: &Emitted, cancel: &AtomicBool) -> bool {
        self.ids.push(emitted.id);
        let text = match self.decoder.push(tok, emitted.id) {
            Ok(t) => t.unwrap_or_default(),
            Err(e) => {
                self.failure = Some(ApiError::internal(e.to_string()));
                return false;
            }
        };
        let (text, stop) = self.scan.push(&text);
        let logprob = emitted.logprobs.as_ref().map(|lp| TokenLogprob {
            token: tok.decode_with_special(&[emitted.id]).unwrap_or_default(),
            logprob: lp.logprob,
            top: lp
                .top
                .iter()
                .map(|&(id, l)| (tok.decode_with_special(&[id]).unwrap_or_default(), l))
                .collect(),
        });
        let split = self.parser.push(&text);
        self.tool_calls.extend(split.tool_calls);
        let delta = Event::Delta {
            text: split.content,
            reasoning: split.reasoning,
            logprob,
        };
        if self.events.send(delta).is_err() || cancel.load(Relaxed) {
            return false; // the client went away, or the server is shutting down: cancel
        }
        let stopped = stop.is_some();
        self.hit_stop = stop;
        !stopped
    }

    /// The answer's last event (`Done`), its remaining text sent first; the engine thread sends it once the
    /// gauges are updated.
    fn finish(mut self, stats: GenerationStats, metrics: &Metrics) -> Result<Event, ApiError> {
        if let Some(e) = self.failure {
            return Err(e);
        }
        let tail = if self.hit_stop.is_some() {
            String::new()
        } else {
            self.scan.flush()
        };
        let mut rest = self.parser.push(&tail);
        rest.append(self.parser.finish());
        self.tool_calls.append(&mut rest.tool_calls);
        if !rest.content.is_empty() || !rest.reasoning.is_empty() {
            let _ = self.events.send(Event::Delta {
                text: rest.content,
                reasoning: rest.reasoning,
                logprob: None,
            });
        }
        let finish_reason = match stats.stop {
            StopReason::Stop | StopReason::MaxTokens if !self.tool_calls.is_empty() => "tool_calls",
            _ if self.hit_stop.is_some() => "stop",
            StopReason::Stop => "stop",
            StopReason::MaxTokens | StopReason::ContextFull => "length",
            StopReason::Cancelled => {
                metrics.cancelled.fetch_add(1, Relaxed);
                "cancelled"
            }
        };
        metrics.record(&stats);
        Ok(Event::Done {
            finish_reason,
            stop_sequence: self.hit_stop,
            stats,
            tool_calls: self.tool_calls,
        })
    }
}

/// The engine thread's state: the requests decoding together, the idle conversation sessions, and the limits.
struct Scheduler<B: Backend> {
    engine: Engine<B>,
    /// Built on the first constrained request: indexing the vocabulary takes a moment.
    grammars: Option<Grammars>,
    /// Requests decoding in batched steps, each with its answer.
    batch: Vec<Decoding<B>>,
    answers: Vec<Answer>,
    /// The request that waits for the KV budget; none is taken from the queue meanwhile (first come, first
    /// served).
    parked: Option<Parked<B>>,
    /// Sessions of finished requests, most recent last: a follow-up turn reuses its conversation's cached prefix.
    idle: Vec<Session<B>>,
    max_batch: usize,
    kv_budget: Option<usize>,
    metrics: Arc<Metrics>,
    flags: Arc<Shutdown>,
}

/// A prepared request waiting for the KV budget, with its session.
struct Parked<B: Backend> {
    request: GenerateRequest,
    answer: Answer,
    session: Session<B>,
}

/// Idle sessions kept between requests (others give their buffers back; the prefix cache keeps their
/// conversations).
const IDLE_SESSIONS: usize = 2;

impl<B: Backend> Scheduler<B> {
    fn run(mut self, rx: Receiver<Task>) {
        loop {
            if let Some(p) = self.parked.take() {
                if self.flags.draining.load(Relaxed) {
                    self.fail(p.answer, shutting_down());
                } else if self.fits(p.answer.kv_need) {
                    self.start(p.request, p.answer, p.session);
                } else {
                    self.parked = Some(p);
                }
            }
            // Take requests while the batch has room; wait for one only when nothing decodes.
            while self.parked.is_none() && self.batch.len() < self.max_batch {
                let task = if self.batch.is_empty() {
                    match rx.recv() {
                        Ok(t) => t,
                        Err(_) => return,
                    }
                } else {
                    match rx.try_recv() {
                        Ok(t) => t,
                        Err(_) => break,
                    }
                };
                self.metrics.queue_depth.fetch_sub(1, Relaxed);
                self.take(task);
            }
            if self.batch.is_empty() {
                continue;
            }
            if self.batch.len() == 1 && !self.waiting() {
                self.continue_alone();
            } else {
                self.step();
            }
        }
    }

    /// Whether a request waits in the queue and may be taken (none waits for the KV budget).
    fn waiting(&self) -> bool {
        self.max_batch > 1 && self.parked.is_none() && self.metrics.queue_depth.load(Relaxed) > 0
    }

    /// Whether a request whose cache needs `need` bytes fits the KV budget beside the batch's.
    fn fits(&self, need: usize) -> bool {
        let held: usize = self.answers.iter().map(|a| a.kv_need).sum();
        self.kv_budget.is_none_or(|budget| held + need <= budget)
    }

    fn take(&mut self, task: Task) {
        let job = match task {
            Task::ResetCache => {
                for s in self.idle.drain(..) {
                    self.engine.end_session(s);
                }
                self.engine.clear_prefix_cache();
                return;
            }
            Task::Generate(job) => *job,
        };
        if job.events.is_closed() {
            return; // the client left while queued
        }
        if self.flags.draining.load(Relaxed) {
            let _ = job.events.send(Event::Error(shutting_down()));
            return;
        }
        let events = job.events.clone();
        let Prepared {
            request,
            mut answer,
        } = match prepare(&self.engine, &mut self.grammars, job) {
            Ok(p) => p,
            Err(e) => {
                let _ = events.send(Event::Error(e));
                return;
            }
        };
        let session = self.session_for(&answer.prompt);
        let slots = answer.prompt.len() + request.max_tokens;
        let rows = self.engine.model.backend().prefill_rows();
        answer.kv_need = session.cache.bytes_holding(slots, rows);
        if let Some(budget) = self.kv_budget.filter(|&b| answer.kv_need > b) {
            let e = ApiError::invalid(
                format!(
                    "the request needs {} MiB of KV cache (a prompt of {} tokens and max_tokens {}), more than \
                     the server's budget of {} MiB",
                    answer.kv_need.div_ceil(1 << 20),
                    answer.prompt.len(),
                    request.max_tokens,
                    budget >> 20
                ),
                Some("max_tokens"),
            );
            self.keep_idle(session);
            return self.fail(answer, e);
        }
        if !self.fits(answer.kv_need) {
            self.metrics.kv_waits.fetch_add(1, Relaxed);
            self.parked = Some(Parked {
                request,
                answer,
                session,
            });
            return;
        }
        self.start(request, answer, session);
    }

    /// Start a prepared request: alone, or joining the batch.
    fn start(&mut self, request: GenerateRequest, answer: Answer, session: Session<B>) {
        // A request decodes alone while nothing else runs: alone, it drafts on its speculative route; it moves
        // into batched steps when others come.
        if self.batch.is_empty() {
            let (rest, prompt) = (request.clone(), answer.prompt.clone());
            let decode =
                move |e: &mut Engine<B>, on: &mut dyn FnMut(&Tokenizer, &Emitted) -> bool| {
                    let mut session = session;
                    e.generate(&mut session, &prompt, &request, on)
                        .map(|stats| (session, stats))
                };
            return self.alone(decode, rest, answer);
        }
        match self.engine.start_decoding(session, &answer.prompt, request) {
            Ok(d) => self.join(d, answer),
            Err(e) => self.fail(answer, ApiError::invalid(e.to_string(), None)),
        }
    }

    /// The idle session whose conversation shares the longest prefix with `prompt`, or a new one.
    fn session_for(&mut self, prompt: &[u32]) -> Session<B> {
        let shared = |s: &Session<B>| {
            s.tokens
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count()
        };
        match (0..self.idle.len()).max_by_key(|&i| (shared(&self.idle[i]), i)) {
            Some(i) => self.idle.remove(i),
            None => self.engine.new_session(),
        }
    }

    fn join(&mut self, d: Decoding<B>, answer: Answer) {
        self.batch.push(d);
        self.answers.push(answer);
        self.metrics.active.store(self.batch.len() as i64, Relaxed);
    }

    /// Decode a request alone (`decode`: from its start, or continuing a batched one; `rest` its request)
    /// until it finishes, or until a request waits and this one may share the batch: then it resumes in batched
    /// steps.
    fn alone(
        &mut self,
        decode: impl FnOnce(
            &mut Engine<B>,
            &mut dyn FnMut(&Tokenizer, &Emitted) -> bool,
        ) -> AloneResult<B>,
        mut rest: GenerateRequest,
        mut answer: Answer,
    ) {
        self.metrics
            .active
            .store(1 + self.batch.len() as i64, Relaxed);
        let may_hand_over = self.max_batch > 1 && self.parked.is_none();
        let mut handed = false;
        let (cancel, depth) = (&self.flags.cancelling, &self.metrics.queue_depth);
        let result = decode(&mut self.engine, &mut |tok, e| {
            if !answer.push(tok, e, cancel) {
                return false;
            }
            handed = may_hand_over && depth.load(Relaxed) > 0;
            !handed
        });
        let (session, stats) = match result {
            Ok(r) => r,
            Err(e) => return self.fail(answer, ApiError::invalid(e.to_string(), None)),
        };
        if !handed || stats.stop != StopReason::Cancelled {
            return self.finish(session, answer, stats);
        }
        rest.max_tokens = answer.max_tokens - answer.ids.len();
        match self
            .engine
            .resume_decoding(session, &answer.context(), rest, stats)
        {
            Ok(d) if d.is_finished() => {
                let (session, stats) = d.into_parts();
                self.finish(session, answer, stats)
            }
            Ok(d) => {
                self.metrics.handovers.fetch_add(1, Relaxed);
                self.join(d, answer)
            }
            Err(e) => self.fail(answer, ApiError::invalid(e.to_string(), None)),
        }
    }

    /// The batch's last request, alone now that nobody waits: it goes on on its speculative route.
    fn continue_alone(&mut self) {
        let d = self.batch.pop().expect("one request");
        let answer = self.answers.pop().expect("its answer");
        let rest = d.request().clone();
        self.alone(|e, on| e.continue_alone(d, on), rest, answer);
    }

    /// One token of every request in the batch; the finished ones leave it with their last event.
    fn step(&mut self) {
        let (answers, cancel) = (&mut self.answers, &self.flags.cancelling);
        let tokens = &self.metrics.batch_tokens;
        let stepped = self.engine.decode_step(&mut self.batch, |i, tok, e| {
            tokens.fetch_add(1, Relaxed);
            answers[i].push(tok, e, cancel)
        });
        self.metrics.batch_steps.fetch_add(1, Relaxed);
        if let Err(e) = stepped {
            // A failed forward fails every request it carried.
            let e = ApiError::internal(e.to_string());
            while let Some(answer) = self.answers.pop() {
                let d = self.batch.pop().expect("one decoding per answer");
                self.engine.end_session(d.into_parts().0);
                self.fail(answer, e.clone());
            }
            return;
        }
        for i in (0..self.batch.len()).rev() {
            if self.batch[i].is_finished() {
                let (session, stats) = self.batch.remove(i).into_parts();
                let answer = self.answers.remove(i);
                self.finish(session, answer, stats);
            }
        }
    }

    /// Send an answer's last event, once the gauges count it out, and keep its session for a follow-up turn.
    fn finish(&mut self, session: Session<B>, answer: Answer, stats: GenerationStats) {
        let events = answer.events.clone();
        let last = answer.finish(stats, &self.metrics);
        self.keep_idle(session);
        self.update_gauges();
        let _ = events.send(last.unwrap_or_else(Event::Error));
    }

    /// Keep a session for a follow-up turn; the oldest beyond `IDLE_SESSIONS` gives its buffers back.
    fn keep_idle(&mut self, session: Session<B>) {
        self.idle.push(session);
        if self.idle.len() > IDLE_SESSIONS {
            let oldest = self.idle.remove(0);
            self.engine.end_session(oldest);
        }
    }

    fn fail(&mut self, answer: Answer, e: ApiError) {
        self.update_gauges();
        let _ = answer.events.send(Event::Error(e));
    }

    fn update_gauges(&self) {
        let m = &self.metrics;
        m.active.store(self.batch.len() as i64, Relaxed);
        let sessions = self.idle.iter().map(|s| s.cache.bytes()).sum::<usize>()
            + self
                .batch
                .iter()
                .map(|d| d.session.cache.bytes())
                .sum::<usize>();
        m.kv_bytes.store(sessions as u64, Relaxed);
        let (entries, bytes) = self.engine.prefix_cache_ram();
        m.prefix_entries.store(entries as u64, Relaxed);
        m.prefix_bytes.store(bytes as u64, Relaxed);
    }
}

/// What decoding a request alone gives: its session and statistics.
type AloneResult<B> = verity::Result<(Session<B>, GenerationStats)>;

#[cfg(test)]
mod tests {
    use super::StopScan;

    #[test]
    fn stop_strings_are_cut_even_across_deltas() {
        let mut s = StopScan {
            stops: vec!["END".into()],
            held: String::new(),
        };
        assert_eq!(s.push("hello E"), ("hello ".to_string(), None));
        assert_eq!(s.push("N"), (String::new(), None));
        assert_eq!(s.push("D more"), (String::new(), Some("END".to_string())));
        let mut s = StopScan {
            stops: vec!["END".into()],
            held: String::new(),
        };
        assert_eq!(s.push("hello E"), ("hello ".to_string(), None));
        assert_eq!(s.push("x"), ("Ex".to_string(), None));
    }

    #[test]
    fn the_stop_string_reached_first_is_the_one_reported() {
        let mut s = StopScan {
            stops: vec!["two".into(), "one".into(), "on".into()],
            held: String::new(),
        };
        assert_eq!(
            s.push("zero one two"),
            ("zero ".to_string(), Some("one".to_string()))
        );
    }
}
