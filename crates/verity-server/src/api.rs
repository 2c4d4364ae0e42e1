//! OpenAI request types and their validation into engine settings. Every field is checked here, so that a bad
//! request is a 4xx with the offending parameter named, before it reaches the engine.

use serde::Deserialize;
use serde_json::Value;
use verity::chat::Message;
use verity::sample::SamplerConfig;

use crate::error::ApiError;

/// `stop`: a string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Message content: a string or a list of parts (only text parts are accepted).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Fields shared by chat and text completions.
#[derive(Debug, Clone, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<i64>,
    pub response_format: Option<Value>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    /// verity extension: `auto` or `off`.
    pub speculation: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Value,
    #[serde(flatten)]
    pub common: Common,
}

/// What the worker needs for one request, validated.
#[derive(Debug, Clone)]
pub struct Params {
    pub max_tokens: Option<usize>,
    pub sampling: SamplerConfig,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// `None`: no logprobs; `Some(n)`: the chosen token's and `n` alternatives.
    pub logprobs: Option<usize>,
    pub speculate: bool,
}

const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];
/// Hard cap on a request's completion length, whatever the context allows.
pub const MAX_COMPLETION: usize = 1 << 16;

fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("malformed JSON: {e}"), None))?;
    if !v.is_object() {
        return Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
        ));
    }
    serde_json::from_value(v).map_err(|e| ApiError::invalid(format!("invalid request: {e}"), None))
}

pub fn parse_chat(body: &[u8]) -> Result<(Vec<Message>, Params), ApiError> {
    let req: ChatRequest = parse(body)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for m in &req.messages {
        if !ROLES.contains(&m.role.as_str()) {
            return Err(ApiError::invalid(
                format!("unknown role {:?}", m.role),
                Some("messages"),
            ));
        }
        let text = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut t = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(s)) => t.push_str(s),
                        (kind, _) => {
                            return Err(ApiError::unsupported(
                                format!("content part type {kind:?}"),
                                "messages",
                            ))
                        }
                    }
                }
                t
            }
        };
        let role = if m.role == "developer" {
            "system"
        } else {
            m.role.as_str()
        };
        messages.push(Message::new(role, &text));
    }
    Ok((messages, params(&req.common)?))
}

pub fn parse_completion(body: &[u8]) -> Result<(String, Params), ApiError> {
    let req: CompletionRequest = parse(body)?;
    let prompt = match &req.prompt {
        Value::String(s) if !s.is_empty() => s.clone(),
        Value::Array(a) if a.len() == 1 && a[0].as_str().is_some_and(|s| !s.is_empty()) => {
            a[0].as_str().unwrap_or_default().to_string()
        }
        _ => {
            return Err(ApiError::invalid(
                "prompt must be a non-empty string",
                Some("prompt"),
            ))
        }
    };
    Ok((prompt, params(&req.common)?))
}

fn params(c: &Common) -> Result<Params, ApiError> {
    if c.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only n = 1 is supported", Some("n")));
    }
    let max = match (c.max_completion_tokens, c.max_tokens) {
        (Some(v), _) | (None, Some(v)) => {
            if v < 1 {
                return Err(ApiError::invalid(
                    "max_tokens must be at least 1",
                    Some("max_tokens"),
                ));
            }
            if v as u64 > MAX_COMPLETION as u64 {
                return Err(ApiError::invalid(
                    format!("max_tokens {v} exceeds the limit of {MAX_COMPLETION} (and the model's context)"),
                    Some("max_tokens"),
                ));
            }
            Some(v as usize)
        }
        (None, None) => None,
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature must be in [0, 2]",
            Some("temperature"),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p must be in (0, 1]", Some("top_p")));
    }
    let top_k = match c.top_k {
        None | Some(-1) => 0,
        Some(k) if k >= 0 => k as usize,
        Some(_) => {
            return Err(ApiError::invalid(
                "top_k must be ≥ 0 (or -1 for off)",
                Some("top_k"),
            ))
        }
    };
    let min_p = c.min_p.unwrap_or(0.0);
    if !(0.0..1.0).contains(&min_p) {
        return Err(ApiError::invalid("min_p must be in [0, 1)", Some("min_p")));
    }
    let repetition_penalty = c.repetition_penalty.unwrap_or(1.0);
    if !(repetition_penalty > 0.0 && repetition_penalty <= 10.0) {
        return Err(ApiError::invalid(
            "repetition_penalty must be in (0, 10]",
            Some("repetition_penalty"),
        ));
    }
    let stop = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > 4 || stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid(
            "stop takes up to 4 non-empty strings",
            Some("stop"),
        ));
    }
    let logprobs = match &c.logprobs {
        None | Some(Value::Null) | Some(Value::Bool(false)) => None,
        Some(Value::Bool(true)) => Some(c.top_logprobs.unwrap_or(0)),
        // The legacy completions API takes an integer.
        Some(Value::Number(n)) => Some(n.as_i64().unwrap_or(-1)),
        Some(_) => {
            return Err(ApiError::invalid(
                "logprobs must be a boolean",
                Some("logprobs"),
            ))
        }
    };
    let logprobs = match logprobs {
        None => None,
        Some(n) if (0..=20).contains(&n) => Some(n as usize),
        Some(_) => {
            return Err(ApiError::invalid(
                "top_logprobs must be in [0, 20]",
                Some("top_logprobs"),
            ))
        }
    };
    if let Some(rf) = &c.response_format {
        match rf.get("type").and_then(|t| t.as_str()) {
            Some("text") => {}
            Some(t @ ("json_object" | "json_schema")) => {
                return Err(ApiError::unsupported(
                    format!("response_format {t} (constrained decoding is not built yet)"),
                    "response_format",
                ))
            }
            _ => {
                return Err(ApiError::invalid(
                    "response_format.type must be text, json_object or json_schema",
                    Some("response_format"),
                ))
            }
        }
    }
    if c.tools
        .as_ref()
        .is_some_and(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty()))
    {
        return Err(ApiError::unsupported(
            "tools (tool calling is not built yet)",
            "tools",
        ));
    }
    let speculate = match c.speculation.as_deref() {
        None | Some("auto") => true,
        Some("off") => false,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("speculation {other:?}: expected auto or off"),
                Some("speculation"),
            ))
        }
    };
    Ok(Params {
        max_tokens: max,
        sampling: SamplerConfig {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            seed: c.seed.unwrap_or(0),
        },
        stop,
        stream: c.stream.unwrap_or(false),
        include_usage: c
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        logprobs,
        speculate,
    })
}

/// The model a request names must be the one served (a missing name means the served one).
pub fn check_model(c_model: Option<&str>, served: &str) -> Result<(), ApiError> {
    match c_model {
        None => Ok(()),
        Some(m) if m == served => Ok(()),
        Some(m) => Err(ApiError::not_found(format!(
            "model {m:?} is not served here (this server runs {served:?})"
        ))),
    }
}

/// The `model` field of a raw body, if present (checked before full parsing so a wrong model is a 404).
pub fn model_field(body: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(body).ok()?;
    v.get("model")?.as_str().map(String::from)
}
