//! The engine thread: one request at a time from a bounded queue.
//!
//! A request's speculative verify fills each decode step with several rows of that request. The engine can
//! also step several requests together (`Engine::decode_step`, each answer bitwise its solo one); this thread
//! does not schedule requests into such steps yet. A bounded queue keeps latency predictable and answers 503
//! when it is full. The worker keeps one session, so a follow-up turn of the last conversation reuses its
//! cached prefix. A request is cancelled as soon as its client goes away (its event channel closes).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;
use verity::backend::Backend;
use verity::chat::{Message, OutputParser, StreamDecoder, TemplateArgs, ToolCall};
use verity::engine::{Engine, GenerateRequest, GenerationStats, StopReason};
use verity::sample::constraint::SharedConstraint;

use crate::api::{Params, ResponseFormat, ToolChoice};
use crate::error::ApiError;
use crate::grammar::Grammars;
use crate::metrics::Metrics;

pub enum Input {
    Chat(Vec<Message>),
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
    /// Start the engine thread with a queue of `capacity` waiting requests.
    pub fn start<B: Backend>(
        mut engine: Engine<B>,
        capacity: usize,
        metrics: Arc<Metrics>,
    ) -> Self {
        let (tx, rx) = sync_channel::<Task>(capacity);
        let shutdown = Arc::new(Shutdown::default());
        let flags = shutdown.clone();
        std::thread::Builder::new()
            .name("verity-engine".into())
            .spawn(move || {
                let mut session = engine.new_session();
                // Built on the first constrained request: indexing the vocabulary takes a moment.
                let mut grammars: Option<Grammars> = None;
                while let Ok(task) = rx.recv() {
                    metrics
                        .queue_depth
                        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                    let job = match task {
                        Task::ResetCache => {
                            engine.end_session(session);
                            session = engine.new_session();
                            engine.clear_prefix_cache();
                            continue;
                        }
                        Task::Generate(job) => *job,
                    };
                    if job.events.is_closed() {
                        continue; // the client left while queued
                    }
                    if flags.draining.load(Relaxed) {
                        let _ = job.events.send(Event::Error(shutting_down()));
                        continue;
                    }
                    let events = job.events.clone();
                    let cancel = &flags.cancelling;
                    metrics.active.store(1, Relaxed);
                    let last = run(
                        &mut engine,
                        &mut session,
                        &mut grammars,
                        job,
                        cancel,
                        &metrics,
                    );
                    // The gauges before the answer's last event: a client that has its answer sees them settled.
                    metrics.active.store(0, Relaxed);
                    let (entries, bytes) = engine.prefix_cache_ram();
                    metrics
                        .kv_bytes
                        .store(session.cache.bytes() as u64, Relaxed);
                    metrics.prefix_entries.store(entries as u64, Relaxed);
                    metrics.prefix_bytes.store(bytes as u64, Relaxed);
                    let _ = events.send(last.unwrap_or_else(Event::Error));
                }
            })
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

/// Generate the job's answer, sending its deltas as they come; returns its last event (`Done`), which the
/// engine thread sends once the gauges are updated.
fn run<B: Backend>(
    engine: &mut Engine<B>,
    session: &mut verity::engine::Session<B>,
    grammars: &mut Option<Grammars>,
    job: Job,
    cancel: &AtomicBool,
    metrics: &Metrics,
) -> Result<Event, ApiError> {
    let (prompt, boundary, opens_reasoning) = match &job.input {
        Input::Chat(messages) => {
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
    let req = GenerateRequest {
        max_tokens,
        sampling: job.params.sampling,
        ignore_eos: false,
        speculate: job.params.speculate,
        draft_width: None,
        want_logprob: job.params.logprobs.is_some(),
        logprobs: job.params.logprobs.unwrap_or(0),
        constraint,
        store_prefix: boundary,
    };
    let mut decoder = StreamDecoder::new();
    let mut scan = StopScan {
        stops: job.params.stop.clone(),
        held: String::new(),
    };
    let mut parser = OutputParser::new(
        opens_reasoning,
        engine.reasoning_tags(),
        job.params.tools.is_some(),
    );
    let mut tool_calls = Vec::new();
    let mut hit_stop = None;
    let mut failure = None;
    let events = &job.events;
    let stats = engine
        .generate(session, &prompt, &req, |tok, emitted| {
            let text = match decoder.push(tok, emitted.id) {
                Ok(t) => t.unwrap_or_default(),
                Err(e) => {
                    failure = Some(ApiError::internal(e.to_string()));
                    return false;
                }
            };
            let (text, stop) = scan.push(&text);
            let logprob = emitted.logprobs.as_ref().map(|lp| TokenLogprob {
                token: tok.decode_with_special(&[emitted.id]).unwrap_or_default(),
                logprob: lp.logprob,
                top: lp
                    .top
                    .iter()
                    .map(|&(id, l)| (tok.decode_with_special(&[id]).unwrap_or_default(), l))
                    .collect(),
            });
            let split = parser.push(&text);
            tool_calls.extend(split.tool_calls);
            let delta = Event::Delta {
                text: split.content,
                reasoning: split.reasoning,
                logprob,
            };
            if events.send(delta).is_err() || cancel.load(Relaxed) {
                return false; // the client went away, or the server is shutting down: cancel
            }
            let stopped = stop.is_some();
            hit_stop = stop;
            !stopped
        })
        .map_err(|e| ApiError::invalid(e.to_string(), None))?;
    if let Some(e) = failure {
        return Err(e);
    }
    let tail = if hit_stop.is_some() {
        String::new()
    } else {
        scan.flush()
    };
    let mut rest = parser.push(&tail);
    rest.append(parser.finish());
    tool_calls.append(&mut rest.tool_calls);
    if !rest.content.is_empty() || !rest.reasoning.is_empty() {
        let _ = events.send(Event::Delta {
            text: rest.content,
            reasoning: rest.reasoning,
            logprob: None,
        });
    }
    let finish_reason = match stats.stop {
        StopReason::Stop | StopReason::MaxTokens if !tool_calls.is_empty() => "tool_calls",
        _ if hit_stop.is_some() => "stop",
        StopReason::Stop => "stop",
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        StopReason::Cancelled => {
            metrics
                .cancelled
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            "cancelled"
        }
    };
    metrics.record(&stats);
    Ok(Event::Done {
        finish_reason,
        stop_sequence: hit_stop,
        stats,
        tool_calls,
    })
}

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
