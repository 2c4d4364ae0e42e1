//! verity's HTTP server (axum + tokio), speaking the OpenAI and Anthropic APIs.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/messages` (Anthropic; see
//! [`anthropic`]), each streaming over SSE or not, `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus
//! text), `POST /v1/cache/reset`.
//! Requests are validated in [`api`] and decoded together in batched steps by the engine thread in [`worker`]; a full queue
//! answers 503, a disconnected client cancels its generation. Before a request reaches its handler, [`access`]
//! checks who sends it and [`limits`] reads its body within a deadline; `transport` runs the connections
//! (timeouts, a connection cap, and JSON bodies for hyper's own protocol errors).

pub mod access;
pub mod anthropic;
pub mod api;
pub mod error;
mod events;
pub mod grammar;
pub mod limits;
pub mod metrics;
mod transport;
pub mod worker;

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::middleware;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::unbounded_channel;
use verity::backend::Backend;
use verity::engine::{Engine, GenerationStats};

use access::Access;
use api::Params;
use error::ApiError;
use events::{Events, SseBody};
use limits::Limits;
use metrics::Metrics;
use worker::{Event, Input, Job, TokenLogprob, Worker};

/// Largest accepted request body.
pub const MAX_BODY: usize = 4 << 20;

pub struct AppState {
    pub model_id: String,
    worker: Worker,
    pub metrics: Arc<Metrics>,
    created: u64,
}

/// The server around an engine: its routes, and its engine thread's handle (for shutting down).
pub struct App {
    pub router: Router,
    worker: Worker,
}

/// How much the engine thread takes on at once.
#[derive(Clone, Copy, Debug)]
pub struct Capacity {
    /// Requests that may wait; more are answered 503.
    pub queue: usize,
    /// Requests that decode together in batched steps.
    pub batch: usize,
    /// Bytes of KV cache the decoding requests may hold together, each counted at its prompt plus its token
    /// limit: a request that would pass it waits, one that alone would is refused. `None`: no limit.
    pub kv_budget: Option<usize>,
}

/// Build the server around an engine.
pub fn app<B: Backend>(engine: Engine<B>, model_id: &str, capacity: Capacity) -> App {
    let metrics = Arc::new(Metrics::default());
    let worker = Worker::start(engine, capacity, metrics.clone());
    let state = Arc::new(AppState {
        model_id: model_id.to_string(),
        worker: worker.clone(),
        metrics,
        created: now(),
    });
    let router = Router::new()
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics_text))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route("/v1/cache/reset", post(reset_cache))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
        })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "method not allowed",
            )
        })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(state);
    App { router, worker }
}

/// Serve `app` on `addrs` (the first that binds) until Ctrl-C or SIGTERM; then stop accepting connections,
/// answer queued requests 503, give the generation in progress up to `grace` to finish (it is cancelled after
/// that, its answer ending as `cancelled`), and return once every connection has closed. Prints the bound
/// address (useful with port 0) on stdout.
pub async fn serve(
    app: App,
    addrs: &[SocketAddr],
    limits: Limits,
    access: Access,
    grace: std::time::Duration,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addrs).await?;
    println!("listening on http://{}", listener.local_addr()?);
    let worker = app.worker;
    let shutdown = async move {
        shutdown_signal().await;
        eprintln!(
            "shutting down: new requests are refused; the one in progress has {} s to finish",
            grace.as_secs_f32()
        );
        worker.drain();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            worker.cancel_in_flight();
        });
    };
    // The last layer added runs first: access is checked before the body is read.
    let app = app
        .router
        .layer(middleware::from_fn_with_state(
            limits,
            limits::bounded_request,
        ))
        .layer(middleware::from_fn_with_state(
            Arc::new(access),
            access::enforce,
        ));
    transport::run(listener, app, limits, shutdown).await
}

/// Ctrl-C, or (on Unix) SIGTERM, which service managers and container runtimes send.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": s.model_id, "object": "model", "created": s.created, "owned_by": "verity"}]}),
    )
}

async fn metrics_text(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
}

async fn reset_cache(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    s.worker.reset_cache(&s.metrics)?;
    Ok(Json(json!({"status": "ok"})))
}

fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            StatusCode::PAYLOAD_TOO_LARGE
        } else {
            StatusCode::BAD_REQUEST
        };
        ApiError::new(
            status,
            "invalid_request_error",
            format!("cannot read the body: {e}"),
        )
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

async fn chat(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    handle(&s, body, Kind::Chat).await
}

async fn completions(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(&s, body, Kind::Text).await
}

/// Validate a generation request and run it; every failure becomes an OpenAI-style error response.
async fn handle(s: &Arc<AppState>, body: Result<Bytes, BytesRejection>, kind: Kind) -> Response {
    s.metrics.requests.fetch_add(1, Relaxed);
    let r = async {
        let body = body_bytes(body)?;
        api::check_model(api::model_field(&body).as_deref(), &s.model_id)?;
        let (input, params) = match kind {
            Kind::Chat => api::parse_chat(&body).map(|(m, i, p)| (Input::Chat(m, i), p))?,
            Kind::Text => api::parse_completion(&body).map(|(t, p)| (Input::Text(t), p))?,
        };
        generate(s, input, params, kind).await
    }
    .await;
    r.unwrap_or_else(|e| {
        s.metrics.errors.fetch_add(1, Relaxed);
        e.into_response()
    })
}

/// An Anthropic Messages request: validated as the chat endpoint validates its OpenAI equivalent, answered
/// in the Messages API's shapes.
async fn messages(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    s.metrics.requests.fetch_add(1, Relaxed);
    let r = async {
        let body = body_bytes(body)?;
        api::check_model(api::model_field(&body).as_deref(), &s.model_id)?;
        let (messages, images, params) = anthropic::parse_messages(&body)?;
        let stream = params.stream;
        let events = start(&s, Input::Chat(messages, images), params).await?;
        let reply = anthropic::Reply {
            id: format!("msg_{:x}", rand_id()),
            model: s.model_id.clone(),
        };
        Ok(if stream {
            reply.stream(events).into_response()
        } else {
            Json(reply.whole(events).await?).into_response()
        })
    }
    .await;
    r.unwrap_or_else(|e: ApiError| {
        s.metrics.errors.fetch_add(1, Relaxed);
        anthropic::error_response(&e)
    })
}

/// Queue the job and wait for its first event: an error before any token is an HTTP error, not a stream.
async fn start(s: &Arc<AppState>, input: Input, params: Params) -> Result<Events, ApiError> {
    let (tx, mut rx) = unbounded_channel();
    s.worker.submit(
        Job {
            input,
            params,
            events: tx,
        },
        &s.metrics,
    )?;
    let first = rx
        .recv()
        .await
        .ok_or_else(|| ApiError::internal("the engine dropped the request"))?;
    if let Event::Error(e) = first {
        return Err(e);
    }
    Ok(Events::new(first, rx))
}

/// Run an OpenAI request and render its answer.
async fn generate(
    s: &Arc<AppState>,
    input: Input,
    params: Params,
    kind: Kind,
) -> Result<Response, ApiError> {
    let stream = params.stream;
    let include_usage = params.include_usage;
    let want_logprobs = params.logprobs.is_some();
    let events = start(s, input, params).await?;
    let id = format!(
        "{}-{:x}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        rand_id()
    );
    let ctx = Reply {
        id,
        model: s.model_id.clone(),
        created: now(),
        kind,
        want_logprobs,
    };
    if stream {
        Ok(ctx.stream(events, include_usage).into_response())
    } else {
        ctx.whole(events).await.map(|v| Json(v).into_response())
    }
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now());
    h.finish()
}

struct Reply {
    id: String,
    model: String,
    created: u64,
    kind: Kind,
    want_logprobs: bool,
}

fn usage(stats: &GenerationStats) -> Value {
    json!({
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.restored_tokens},
        "verity": {
            "route": stats.route,
            "cycles": stats.cycles,
            "accepted_per_cycle": stats.tokens_per_cycle(),
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "ttft_s": stats.ttft_s,
            "decode_tok_s": stats.decode_tok_s(),
        }
    })
}

/// OpenAI `tool_calls` (with `index` in stream deltas).
fn tool_calls_json(calls: &[verity::chat::ToolCall], indexed: bool) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({"id": format!("call_{:x}{i}", rand_id()), "type": "function",
                               "function": {"name": c.name, "arguments": c.arguments}});
            if indexed {
                v["index"] = i.into();
            }
            v
        })
        .collect()
}

fn logprob_json(lp: &TokenLogprob) -> Value {
    json!({
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": lp.token.as_bytes(),
        "top_logprobs": lp.top.iter().map(|(t, l)| json!({"token": t, "logprob": l, "bytes": t.as_bytes()})).collect::<Vec<_>>(),
    })
}

impl Reply {
    async fn whole(&self, mut events: Events) -> Result<Value, ApiError> {
        let mut text = String::new();
        let mut reasoning = String::new();
        let mut lps = Vec::new();
        loop {
            match events.next().await? {
                Event::Delta {
                    text: t,
                    reasoning: r,
                    logprob,
                } => {
                    text.push_str(&t);
                    reasoning.push_str(&r);
                    if let Some(lp) = logprob {
                        lps.push(logprob_json(&lp));
                    }
                }
                Event::Error(e) => return Err(e),
                Event::Done {
                    finish_reason,
                    stats,
                    tool_calls,
                    ..
                } => {
                    let logprobs = if self.want_logprobs {
                        json!({"content": lps})
                    } else {
                        Value::Null
                    };
                    let choice = match self.kind {
                        Kind::Chat => {
                            let mut message = json!({"role": "assistant", "content": text});
                            if !reasoning.is_empty() {
                                message["reasoning_content"] = reasoning.into();
                            }
                            if !tool_calls.is_empty() {
                                if text.is_empty() {
                                    message["content"] = Value::Null;
                                }
                                message["tool_calls"] = tool_calls_json(&tool_calls, false);
                            }
                            json!({"index": 0, "message": message, "logprobs": logprobs,
                                   "finish_reason": finish_reason})
                        }
                        Kind::Text => {
                            json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
                        }
                    };
                    let object = if self.kind == Kind::Chat {
                        "chat.completion"
                    } else {
                        "text_completion"
                    };
                    return Ok(
                        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
                                     "choices": [choice], "usage": usage(&stats)}),
                    );
                }
            }
        }
    }

    fn chunk(&self, choices: Value, usage: Option<Value>) -> SseEvent {
        let object = if self.kind == Kind::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let mut v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        SseEvent::default().data(v.to_string())
    }

    /// The answer as SSE chunks (a first chunk with the assistant role, for chat).
    fn stream(self, events: Events, include_usage: bool) -> SseBody {
        let mut opening = Vec::new();
        if self.kind == Kind::Chat {
            let role = json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
            opening.push(self.chunk(role, None));
        }
        events.into_sse(opening, move |ev| self.render(ev, include_usage))
    }

    /// The SSE events for one engine event, and whether it ends the stream.
    fn render(&self, ev: Event, include_usage: bool) -> (Vec<SseEvent>, bool) {
        match ev {
            Event::Delta {
                text,
                reasoning,
                logprob,
            } => {
                if text.is_empty() && reasoning.is_empty() && logprob.is_none() {
                    return (Vec::new(), false);
                }
                let lp = logprob.map_or(Value::Null, |l| json!({"content": [logprob_json(&l)]}));
                let choice = match self.kind {
                    Kind::Chat => {
                        let mut delta = json!({"content": text});
                        if !reasoning.is_empty() {
                            delta["reasoning_content"] = reasoning.into();
                        }
                        json!([{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": null}])
                    }
                    Kind::Text => {
                        json!([{"index": 0, "text": text, "logprobs": lp, "finish_reason": null}])
                    }
                };
                (vec![self.chunk(choice, None)], false)
            }
            Event::Error(e) => (
                vec![
                    SseEvent::default().data(e.body().to_string()),
                    SseEvent::default().data("[DONE]"),
                ],
                true,
            ),
            Event::Done {
                finish_reason,
                stats,
                tool_calls,
                ..
            } => {
                let mut v = Vec::new();
                if !tool_calls.is_empty() {
                    let delta = json!({"tool_calls": tool_calls_json(&tool_calls, true)});
                    v.push(self.chunk(
                        json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}]),
                        None,
                    ));
                }
                let choice = match self.kind {
                    Kind::Chat => {
                        json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish_reason}])
                    }
                    Kind::Text => {
                        json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": finish_reason}])
                    }
                };
                v.push(self.chunk(choice, None));
                if include_usage {
                    v.push(self.chunk(json!([]), Some(usage(&stats))));
                }
                v.push(SseEvent::default().data("[DONE]"));
                (v, true)
            }
        }
    }
}
