//! OpenAI request types and their validation into engine settings. Every field is checked here, so that a bad
//! request is a 4xx with the offending parameter named, before it reaches the engine.

use serde::Deserialize;
use serde_json::Value;
use verity::chat::Message;
use verity::sample::{SamplerConfig, REPETITION_PENALTY_RANGE};

use crate::error::ApiError;

/// `stop`: a string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Message content: a string or a list of parts (text, and images as `image_url` parts holding a base64 `data:`
/// URL; a remote URL is never fetched).
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
    pub image_url: Option<Value>,
}

/// The bytes of an `image_url` part's `data:` URL (`{"url": "data:image/png;base64,..."}`, or the URL string).
pub fn data_url_bytes(v: &Value) -> Result<Vec<u8>, ApiError> {
    use base64::Engine as _;
    let url = v
        .get("url")
        .unwrap_or(v)
        .as_str()
        .ok_or_else(|| ApiError::invalid("image_url must hold a url", Some("messages")))?;
    let Some(rest) = url.strip_prefix("data:") else {
        return Err(ApiError::invalid(
            "image URLs are not fetched: send the image inline as a data:image/...;base64,... URL",
            Some("messages"),
        ));
    };
    let (meta, data) = rest
        .split_once(',')
        .ok_or_else(|| ApiError::invalid("a data: URL without a comma", Some("messages")))?;
    if !meta.ends_with(";base64") {
        return Err(ApiError::invalid(
            "image data: URLs must be base64",
            Some("messages"),
        ));
    }
    base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| ApiError::invalid(format!("image data: {e}"), Some("messages")))
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant turn's calls: `[{id, type: "function", function: {name, arguments: "<json>"}}]`.
    pub tool_calls: Option<Vec<Value>>,
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
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
    /// Extra chat-template variables (e.g. `{"enable_thinking": false}`).
    pub chat_template_kwargs: Option<Value>,
    /// `none`/`minimal` turn reasoning off (`enable_thinking = false`), other efforts on.
    pub reasoning_effort: Option<String>,
    // OpenAI fields verity does not implement: accepted only at their neutral values, so that a request
    // asking for them is refused rather than silently answered without them.
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
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
    // Not implemented; accepted only at their neutral values.
    pub echo: Option<bool>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub common: Common,
}

/// Which API a request came through: the two differ in how they ask for log-probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    /// `logprobs: bool` and `top_logprobs: 0..=20`.
    Chat,
    /// The legacy `logprobs: <count of alternatives>`.
    Completions,
}

/// Which tool calls the answer may or must make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Tools are not offered.
    None,
    /// The model decides.
    Auto,
    /// At least one call, to any tool (enforced by a grammar).
    Required,
    /// A call to this function (enforced by a grammar).
    Named(String),
}

/// The shape the answer must take.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    Text,
    /// Any JSON object.
    JsonObject,
    /// A value of this JSON schema.
    JsonSchema(Value),
}

/// What the worker needs for one request, validated.
#[derive(Debug, Clone)]
pub struct Params {
    /// The `tools` array, when tools are offered (`tool_choice` is not `none`).
    pub tools: Option<Value>,
    pub tool_choice: ToolChoice,
    pub response_format: ResponseFormat,
    /// Chat-template variables.
    pub template_kwargs: serde_json::Map<String, Value>,
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

/// A request body as `T`: JSON, an object, of `T`'s shape.
pub(crate) fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
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

/// A chat request: its messages (an image's place in a content is [`verity::engine::IMAGE_SLOT`]), the images'
/// bytes in order, and the validated settings.
pub type Chat = (Vec<Message>, Vec<Vec<u8>>, Params);

pub fn parse_chat(body: &[u8]) -> Result<Chat, ApiError> {
    chat(parse(body)?)
}

/// A chat request already read as JSON (what the Messages API's request translates into).
pub(crate) fn parse_chat_value(v: Value) -> Result<Chat, ApiError> {
    chat(
        serde_json::from_value(v)
            .map_err(|e| ApiError::invalid(format!("invalid request: {e}"), None))?,
    )
}

fn chat(req: ChatRequest) -> Result<Chat, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    let mut images = Vec::new();
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
                        ("image_url", _) if m.role == "user" => {
                            let url = p.image_url.as_ref().ok_or_else(|| {
                                ApiError::invalid(
                                    "an image_url part without image_url",
                                    Some("messages"),
                                )
                            })?;
                            images.push(data_url_bytes(url)?);
                            t.push(verity::engine::IMAGE_SLOT);
                        }
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
        let mut msg = Message::new(role, &text);
        if let Some(calls) = &m.tool_calls {
            if role != "assistant" {
                return Err(ApiError::invalid(
                    "only assistant messages carry tool_calls",
                    Some("messages"),
                ));
            }
            msg.tool_calls = Some(calls.iter().map(template_call).collect::<Result<_, _>>()?);
        }
        msg.tool_call_id = m.tool_call_id.clone();
        msg.name = m.name.clone();
        messages.push(msg);
    }
    let params = params(&req.common, Endpoint::Chat)?;
    Ok((messages, images, params))
}

/// An OpenAI tool call as chat templates read it: `arguments` as an object, not JSON text.
fn template_call(c: &Value) -> Result<Value, ApiError> {
    let bad = || {
        ApiError::invalid(
            "tool_calls entries are {id, type: \"function\", function: {name, arguments}}",
            Some("messages"),
        )
    };
    let f = c.get("function").ok_or_else(bad)?;
    let name = f.get("name").and_then(Value::as_str).ok_or_else(bad)?;
    let arguments = match f.get("arguments") {
        Some(Value::String(s)) => {
            serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone()))
        }
        Some(v) => v.clone(),
        None => serde_json::json!({}),
    };
    let mut out =
        serde_json::json!({"type": "function", "function": {"name": name, "arguments": arguments}});
    if let Some(id) = c.get("id") {
        out["id"] = id.clone();
    }
    Ok(out)
}

pub fn parse_completion(body: &[u8]) -> Result<(String, Params), ApiError> {
    let req: CompletionRequest = parse(body)?;
    if req.common.tools.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(ApiError::invalid(
            "tools need /v1/chat/completions",
            Some("tools"),
        ));
    }
    if req.echo == Some(true) {
        return Err(ApiError::unsupported("echo is not supported", "echo"));
    }
    if req.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(
            "only best_of = 1 is supported",
            Some("best_of"),
        ));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported("suffix is not supported", "suffix"));
    }
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
    Ok((prompt, params(&req.common, Endpoint::Completions)?))
}

/// Refuse the OpenAI fields verity does not implement when they ask for something.
fn refuse_unimplemented(c: &Common) -> Result<(), ApiError> {
    for (value, param) in [
        (c.presence_penalty, "presence_penalty"),
        (c.frequency_penalty, "frequency_penalty"),
    ] {
        if value.is_some_and(|v| v != 0.0) {
            return Err(ApiError::unsupported(
                format!("{param} is not supported (repetition_penalty is)"),
                param,
            ));
        }
    }
    let asks = |v: &Option<Value>| match v {
        None | Some(Value::Null) => false,
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    };
    if asks(&c.logit_bias) {
        return Err(ApiError::unsupported(
            "logit_bias is not supported",
            "logit_bias",
        ));
    }
    if asks(&c.functions) || asks(&c.function_call) {
        return Err(ApiError::unsupported(
            "functions and function_call are superseded: use tools and tool_choice",
            "functions",
        ));
    }
    Ok(())
}

/// The number of alternatives to report per token (`None`: no log-probabilities), as each endpoint asks.
fn logprobs(c: &Common, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
    let in_range = |n: i64, param: &'static str| {
        if (0..=20).contains(&n) {
            Ok(n as usize)
        } else {
            Err(ApiError::invalid(
                format!("{param} must be in [0, 20]"),
                Some(param),
            ))
        }
    };
    match endpoint {
        Endpoint::Chat => {
            let on = match &c.logprobs {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::invalid(
                        "logprobs must be a boolean (top_logprobs sets the alternatives)",
                        Some("logprobs"),
                    ))
                }
            };
            match (on, c.top_logprobs) {
                (false, None) => Ok(None),
                (false, Some(_)) => Err(ApiError::invalid(
                    "top_logprobs needs logprobs: true",
                    Some("top_logprobs"),
                )),
                (true, top) => in_range(top.unwrap_or(0), "top_logprobs").map(Some),
            }
        }
        Endpoint::Completions => {
            if c.top_logprobs.is_some() {
                return Err(ApiError::invalid(
                    "top_logprobs belongs to chat completions; here logprobs takes the number of alternatives",
                    Some("top_logprobs"),
                ));
            }
            match &c.logprobs {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Number(n)) => match n.as_i64() {
                    Some(n) => in_range(n, "logprobs").map(Some),
                    None => Err(ApiError::invalid(
                        "logprobs must be in [0, 20]",
                        Some("logprobs"),
                    )),
                },
                Some(_) => Err(ApiError::invalid(
                    "logprobs must be the number of alternatives per token, in [0, 20]",
                    Some("logprobs"),
                )),
            }
        }
    }
}

fn params(c: &Common, endpoint: Endpoint) -> Result<Params, ApiError> {
    if c.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only n = 1 is supported", Some("n")));
    }
    refuse_unimplemented(c)?;
    if let (Some(a), Some(b)) = (c.max_completion_tokens, c.max_tokens) {
        if a != b {
            return Err(ApiError::invalid(
                format!("max_completion_tokens ({a}) and max_tokens ({b}) disagree; send one"),
                Some("max_tokens"),
            ));
        }
    }
    let stream = c.stream.unwrap_or(false);
    if c.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options needs stream: true",
            Some("stream_options"),
        ));
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
    // The sampler acts within its range only; a value it would clamp is refused here rather than changed.
    let penalties = REPETITION_PENALTY_RANGE;
    if !penalties.contains(&repetition_penalty) {
        return Err(ApiError::invalid(
            format!(
                "repetition_penalty must be in [{}, {}]",
                penalties.start(),
                penalties.end()
            ),
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
    let logprobs = logprobs(c, endpoint)?;
    let response_format = match &c.response_format {
        None | Some(Value::Null) => ResponseFormat::Text,
        Some(rf) => match rf.get("type").and_then(|t| t.as_str()) {
            Some("text") => ResponseFormat::Text,
            Some("json_object") => ResponseFormat::JsonObject,
            Some("json_schema") => match rf.get("json_schema").and_then(|j| j.get("schema")) {
                Some(schema) if schema.is_object() || schema.is_boolean() => {
                    ResponseFormat::JsonSchema(schema.clone())
                }
                _ => return Err(ApiError::invalid(
                    "response_format json_schema needs json_schema.schema (a JSON schema object)",
                    Some("response_format"),
                )),
            },
            _ => {
                return Err(ApiError::invalid(
                    "response_format.type must be text, json_object or json_schema",
                    Some("response_format"),
                ))
            }
        },
    };
    let (tools, tool_choice) = tools(c)?;
    if response_format != ResponseFormat::Text
        && matches!(tool_choice, ToolChoice::Required | ToolChoice::Named(_))
    {
        return Err(ApiError::invalid(
            "a forced tool call and response_format cannot be combined",
            Some("tool_choice"),
        ));
    }
    let mut template_kwargs = match &c.chat_template_kwargs {
        None | Some(Value::Null) => serde_json::Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                "chat_template_kwargs must be an object",
                Some("chat_template_kwargs"),
            ))
        }
    };
    if let Some(effort) = &c.reasoning_effort {
        let on = match effort.as_str() {
            "none" | "minimal" => false,
            "low" | "medium" | "high" => true,
            _ => {
                return Err(ApiError::invalid(
                    "reasoning_effort must be none, minimal, low, medium or high",
                    Some("reasoning_effort"),
                ))
            }
        };
        template_kwargs
            .entry("enable_thinking")
            .or_insert(Value::Bool(on));
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
        tools,
        tool_choice,
        response_format,
        template_kwargs,
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
        stream,
        include_usage: c
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        logprobs,
        speculate,
    })
}

/// Validate `tools` and `tool_choice`: the tools offered (none when `tool_choice` is `none`) and the choice.
fn tools(c: &Common) -> Result<(Option<Value>, ToolChoice), ApiError> {
    let list = match &c.tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(ApiError::invalid("tools must be an array", Some("tools"))),
    };
    let mut names = Vec::with_capacity(list.len());
    for t in &list {
        let f = t.get("function");
        let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
        let ok_name = name.is_some_and(|n| {
            !n.is_empty()
                && n.len() <= 64
                && n.chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == '-')
        });
        let params_ok = f
            .and_then(|f| f.get("parameters"))
            .is_none_or(|p| p.is_object());
        if t.get("type").and_then(Value::as_str) != Some("function") || !ok_name || !params_ok {
            return Err(ApiError::invalid(
                "each tool is {type: \"function\", function: {name: [A-Za-z0-9_-]{1,64}, description?, parameters?: object}}",
                Some("tools"),
            ));
        }
        names.push(name.unwrap_or_default().to_string());
    }
    let choice = match &c.tool_choice {
        None | Some(Value::Null) => {
            if list.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => return Err(ApiError::invalid(
                "tool_choice must be none, auto, required or {type: function, function: {name}}",
                Some("tool_choice"),
            )),
        },
        Some(v) => match v
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
        {
            Some(n) => ToolChoice::Named(n.to_string()),
            None => return Err(ApiError::invalid(
                "tool_choice must be none, auto, required or {type: function, function: {name}}",
                Some("tool_choice"),
            )),
        },
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Auto if list.is_empty() => {
            return Err(ApiError::invalid(
                "tool_choice needs tools",
                Some("tool_choice"),
            ))
        }
        ToolChoice::Named(n) if !names.contains(n) => {
            return Err(ApiError::invalid(
                format!("tool_choice names {n:?}, which is not among the tools"),
                Some("tool_choice"),
            ))
        }
        _ => {}
    }
    let offered = (choice != ToolChoice::None && !list.is_empty()).then(|| Value::Array(list));
    Ok((offered, choice))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(extra: &str) -> Result<Params, ApiError> {
        let body = format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{extra}}}"#);
        parse_chat(body.as_bytes()).map(|(_, _, p)| p)
    }

    fn completion(extra: &str) -> Result<Params, ApiError> {
        let body = format!(r#"{{"prompt":"hi"{extra}}}"#);
        parse_completion(body.as_bytes()).map(|(_, p)| p)
    }

    fn refused(r: Result<Params, ApiError>) -> Option<&'static str> {
        r.err().map(|e| e.param.unwrap_or("-"))
    }

    #[test]
    fn top_logprobs_needs_logprobs_and_a_count_in_range() {
        assert_eq!(
            chat(r#","logprobs":true,"top_logprobs":3"#)
                .unwrap()
                .logprobs,
            Some(3)
        );
        assert_eq!(chat(r#","logprobs":true"#).unwrap().logprobs, Some(0));
        assert_eq!(chat(r#","logprobs":false"#).unwrap().logprobs, None);
        assert_eq!(refused(chat(r#","top_logprobs":3"#)), Some("top_logprobs"));
        assert_eq!(
            refused(chat(r#","logprobs":false,"top_logprobs":0"#)),
            Some("top_logprobs")
        );
        assert_eq!(
            refused(chat(r#","logprobs":true,"top_logprobs":21"#)),
            Some("top_logprobs")
        );
        assert_eq!(
            refused(chat(r#","logprobs":true,"top_logprobs":-1"#)),
            Some("top_logprobs")
        );
        assert_eq!(refused(chat(r#","logprobs":5"#)), Some("logprobs"));
    }

    #[test]
    fn a_repetition_penalty_the_sampler_would_clamp_is_refused() {
        for ok in ["0.01", "1.3", "100"] {
            let extra = format!(r#","repetition_penalty":{ok}"#);
            assert!(chat(&extra).is_ok(), "{ok}");
        }
        for bad in ["0", "1e-45", "0.009", "100.5", "-1"] {
            let extra = format!(r#","repetition_penalty":{bad}"#);
            assert_eq!(refused(chat(&extra)), Some("repetition_penalty"), "{bad}");
        }
    }

    #[test]
    fn legacy_completions_take_a_count_of_logprobs() {
        assert_eq!(completion(r#","logprobs":2"#).unwrap().logprobs, Some(2));
        assert_eq!(refused(completion(r#","logprobs":21"#)), Some("logprobs"));
        assert_eq!(refused(completion(r#","logprobs":true"#)), Some("logprobs"));
        assert_eq!(
            refused(completion(r#","logprobs":1,"top_logprobs":1"#)),
            Some("top_logprobs")
        );
    }

    #[test]
    fn fields_that_would_be_silently_ignored_are_refused() {
        for (extra, param) in [
            (r#","n":2"#, "n"),
            (r#","n":0"#, "n"),
            (r#","max_tokens":-5"#, "max_tokens"),
            (
                r#","max_tokens":8,"max_completion_tokens":16"#,
                "max_tokens",
            ),
            (
                r#","stream_options":{"include_usage":true}"#,
                "stream_options",
            ),
            (r#","presence_penalty":0.5"#, "presence_penalty"),
            (r#","frequency_penalty":-1"#, "frequency_penalty"),
            (r#","logit_bias":{"50256":-100}"#, "logit_bias"),
            (r#","functions":[{"name":"f"}]"#, "functions"),
        ] {
            assert_eq!(refused(chat(extra)), Some(param), "{extra}");
        }
        for (extra, param) in [
            (r#","echo":true"#, "echo"),
            (r#","best_of":3"#, "best_of"),
            (r#","suffix":"end""#, "suffix"),
        ] {
            assert_eq!(refused(completion(extra)), Some(param), "{extra}");
        }
    }

    #[test]
    fn neutral_values_of_unimplemented_fields_pass() {
        let p = chat(
            r#","presence_penalty":0,"frequency_penalty":0.0,"logit_bias":{},"functions":null,"max_tokens":8,"max_completion_tokens":8,"stream":true,"stream_options":{"include_usage":true}"#,
        )
        .unwrap();
        assert_eq!(p.max_tokens, Some(8));
        assert!(p.stream && p.include_usage);
        completion(r#","echo":false,"best_of":1,"suffix":"""#).unwrap();
    }
}
