//! The Anthropic Messages API (`POST /v1/messages`) beside the OpenAI one, on one request model: a Messages
//! request is translated into the OpenAI chat request it means and validated as [`api::parse_chat`] validates
//! it, so both APIs accept the same settings with the same checks and reach the worker as the same [`Params`].
//! Answers are rendered as Anthropic messages (`content` blocks: `thinking`, `text`, `tool_use`) or as its
//! stream of named events, and errors as its error bodies (`{"type": "error", "error": {"type", "message"}}`).
//!
//! Mapping: `system` becomes the first message; a user turn's `tool_result` blocks become OpenAI `tool`
//! messages (in order, before the turn's text); an assistant turn's `tool_use` blocks become its `tool_calls`;
//! `stop_sequences` is `stop`; `tool_choice` `auto`/`any`/`tool`/`none` is `auto`/`required`/a named
//! function/`none`; `output_config.format` (a JSON schema) is `response_format`, `output_config.effort` is
//! `reasoning_effort`; `thinking` `enabled`/`disabled` switches the template's `enable_thinking`. Images,
//! documents, server tools and fields verity does not know are refused by name. Sampling (`temperature`,
//! `top_p`, `top_k`, which current clients send through their extra body) and verity's `seed` and
//! `speculation` are accepted as in the OpenAI API, with its defaults.

use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use verity::chat::ToolCall;
use verity::engine::GenerationStats;

use crate::api;
use crate::error::ApiError;
use crate::events::{Events, SseBody};
use crate::worker::Event;

/// A Messages request, as far as verity reads it; any other field is refused rather than ignored.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MessagesRequest {
    /// Checked against the served model by the handler, before parsing.
    #[allow(dead_code)]
    model: Option<String>,
    max_tokens: Option<i64>,
    messages: Vec<InMessage>,
    system: Option<Text>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    thinking: Option<Value>,
    /// `{format: {type: json_schema, schema}, effort}`: structured output, and the reasoning switch.
    output_config: Option<Value>,
    /// Accepted and not used: the caller's tags (`user_id`), a service tier (there is one), prompt-caching
    /// marks (the prefix cache needs none).
    #[allow(dead_code)]
    metadata: Option<Value>,
    #[allow(dead_code)]
    service_tier: Option<Value>,
    #[allow(dead_code)]
    cache_control: Option<Value>,
    /// verity extensions, as in the OpenAI API.
    seed: Option<u64>,
    speculation: Option<String>,
}

#[derive(Debug, Deserialize)]
struct InMessage {
    role: String,
    content: Text,
}

/// A string, or a list of content blocks.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Text {
    Plain(String),
    Blocks(Vec<Value>),
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::invalid(message, None)
}

/// The text of a block list made of `text` blocks only (a system prompt, a tool result).
fn plain_text(t: &Text, what: &str) -> Result<String, ApiError> {
    match t {
        Text::Plain(s) => Ok(s.clone()),
        Text::Blocks(blocks) => {
            let mut out = String::new();
            for b in blocks {
                match (block_type(b)?, b.get("text").and_then(Value::as_str)) {
                    ("text", Some(s)) => out.push_str(s),
                    (kind, _) => {
                        return Err(invalid(format!(
                            "{what}: only text blocks are accepted here, not {kind:?}"
                        )))
                    }
                }
            }
            Ok(out)
        }
    }
}

fn block_type(b: &Value) -> Result<&str, ApiError> {
    b.get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("every content block needs a string `type`"))
}

fn refuse_media(kind: &str) -> ApiError {
    ApiError::unsupported(
        format!("{kind} content blocks are not supported here (text, and images in user turns)"),
        "messages",
    )
}

/// One Messages turn as OpenAI chat messages.
fn turn(m: &InMessage, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let blocks = match &m.content {
        Text::Plain(s) => {
            out.push(json!({"role": m.role, "content": s}));
            return Ok(());
        }
        Text::Blocks(b) => b,
    };
    let mut text = String::new();
    let mut calls = Vec::new();
    // With images, the user's content as OpenAI parts: text and `image_url` data URLs, in order.
    let mut parts: Vec<Value> = Vec::new();
    for b in blocks {
        match (m.role.as_str(), block_type(b)?) {
            (_, "text") => {
                let t = b
                    .get("text")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid("a text block needs a string `text`"))?;
                text.push_str(t);
                parts.push(json!({"type": "text", "text": t}));
            }
            ("user", "image") => parts.push(image_part(b)?),
            ("user", "tool_result") => {
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid("a tool_result block needs `tool_use_id`"))?;
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => plain_text(
                        &serde_json::from_value(c.clone()).map_err(|_| {
                            invalid("tool_result content is a string or text blocks")
                        })?,
                        "tool_result content",
                    )?,
                };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            ("assistant", "tool_use") => {
                let (Some(id), Some(name)) = (
                    b.get("id").and_then(Value::as_str),
                    b.get("name").and_then(Value::as_str),
                ) else {
                    return Err(invalid("a tool_use block needs `id` and `name`"));
                };
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(json!({"id": id, "type": "function",
                                  "function": {"name": name, "arguments": input}}));
            }
            // Earlier reasoning is not shown to the model again (chat templates drop it too).
            ("assistant", "thinking" | "redacted_thinking") => {}
            (_, kind @ ("image" | "document")) => return Err(refuse_media(kind)),
            (role, kind) => {
                return Err(invalid(format!(
                    "a {role} message cannot hold a {kind:?} block"
                )))
            }
        }
    }
    if !calls.is_empty() {
        out.push(json!({"role": "assistant", "content": text, "tool_calls": calls}));
    } else if parts.iter().any(|p| p["type"] == "image_url") {
        out.push(json!({"role": m.role, "content": parts}));
    } else if !text.is_empty() || m.role == "assistant" || blocks.is_empty() {
        out.push(json!({"role": m.role, "content": text}));
    }
    Ok(())
}

/// An Anthropic `image` block (`{source: {type: "base64", media_type, data}}`) as an OpenAI `image_url` part
/// with a data URL; a URL source is refused (images are never fetched).
fn image_part(b: &Value) -> Result<Value, ApiError> {
    let source = b
        .get("source")
        .ok_or_else(|| invalid("an image block needs a `source`"))?;
    match source.get("type").and_then(Value::as_str) {
        Some("base64") => {}
        Some(kind) => {
            return Err(ApiError::unsupported(
                format!(
                    "image sources of type {kind:?} (images are not fetched: send base64 data)"
                ),
                "messages",
            ))
        }
        None => return Err(invalid("an image source needs a `type`")),
    }
    let (Some(media), Some(data)) = (
        source.get("media_type").and_then(Value::as_str),
        source.get("data").and_then(Value::as_str),
    ) else {
        return Err(invalid(
            "a base64 image source needs `media_type` and `data`",
        ));
    };
    Ok(json!({"type": "image_url", "image_url": {"url": format!("data:{media};base64,{data}")}}))
}

/// An Anthropic tool (`{name, description?, input_schema}`) as an OpenAI function tool.
fn tool(t: &Value) -> Result<Value, ApiError> {
    if let Some(kind) = t.get("type").and_then(Value::as_str) {
        if kind != "custom" {
            return Err(ApiError::unsupported(
                format!("server tools ({kind:?}) are not supported; declare tools by name and input_schema"),
                "tools",
            ));
        }
    }
    let name = t
        .get("name")
        .ok_or_else(|| invalid("each tool needs a `name`"))?;
    let mut f = json!({"name": name});
    if let Some(d) = t.get("description") {
        f["description"] = d.clone();
    }
    if let Some(s) = t.get("input_schema") {
        f["parameters"] = s.clone();
    }
    Ok(json!({"type": "function", "function": f}))
}

fn tool_choice(c: &Value) -> Result<Value, ApiError> {
    let bad = || invalid("tool_choice is {type: auto | any | none} or {type: tool, name}");
    Ok(
        match c.get("type").and_then(Value::as_str).ok_or_else(bad)? {
            "auto" => json!("auto"),
            "any" => json!("required"),
            "none" => json!("none"),
            "tool" => {
                let name = c.get("name").and_then(Value::as_str).ok_or_else(bad)?;
                json!({"type": "function", "function": {"name": name}})
            }
            _ => return Err(bad()),
        },
    )
}

/// The OpenAI chat request a Messages request means.
fn to_openai(req: &MessagesRequest) -> Result<Value, ApiError> {
    let max_tokens = req
        .max_tokens
        .ok_or_else(|| invalid("max_tokens: field required"))?;
    if req.temperature.is_some_and(|t| !(0.0..=1.0).contains(&t)) {
        return Err(invalid("temperature must be in [0, 1]"));
    }
    if req.messages.is_empty() {
        return Err(invalid("messages must not be empty"));
    }
    let mut messages = Vec::new();
    if let Some(system) = &req.system {
        messages.push(json!({"role": "system", "content": plain_text(system, "system")?}));
    }
    for m in &req.messages {
        if m.role != "user" && m.role != "assistant" {
            return Err(invalid(format!(
                "message roles are user and assistant, not {:?} (the system prompt is the `system` field)",
                m.role
            )));
        }
        turn(m, &mut messages)?;
    }
    let mut out = Map::new();
    out.insert("messages".into(), messages.into());
    out.insert("max_tokens".into(), max_tokens.into());
    let mut put = |k: &str, v: Option<Value>| {
        if let Some(v) = v {
            out.insert(k.into(), v);
        }
    };
    put("temperature", req.temperature.map(Value::from));
    put("top_p", req.top_p.map(Value::from));
    put("top_k", req.top_k.map(Value::from));
    put("stop", req.stop_sequences.clone().map(Value::from));
    put("stream", req.stream.map(Value::from));
    put("seed", req.seed.map(Value::from));
    put("speculation", req.speculation.clone().map(Value::from));
    if let Some(tools) = &req.tools {
        put(
            "tools",
            Some(
                tools
                    .iter()
                    .map(tool)
                    .collect::<Result<Vec<_>, _>>()?
                    .into(),
            ),
        );
    }
    put(
        "tool_choice",
        req.tool_choice.as_ref().map(tool_choice).transpose()?,
    );
    if let Some(c) = &req.output_config {
        let bad = || invalid("output_config is {format?: {type: json_schema, schema}, effort?}");
        let c = c.as_object().ok_or_else(bad)?;
        for (k, v) in c {
            match (k.as_str(), v) {
                (_, Value::Null) => {}
                ("format", f) => {
                    if f.get("type").and_then(Value::as_str) != Some("json_schema") {
                        return Err(bad());
                    }
                    let schema = f.get("schema").ok_or_else(bad)?;
                    put(
                        "response_format",
                        Some(json!({"type": "json_schema",
                                    "json_schema": {"name": "output", "schema": schema}})),
                    );
                }
                ("effort", Value::String(e)) => put("reasoning_effort", Some(json!(e))),
                _ => return Err(bad()),
            }
        }
    }
    if let Some(t) = &req.thinking {
        let on = match t.get("type").and_then(Value::as_str) {
            Some("enabled") => true,
            Some("disabled") => false,
            _ => return Err(invalid("thinking is {type: enabled | disabled}")),
        };
        put("chat_template_kwargs", Some(json!({"enable_thinking": on})));
    }
    Ok(Value::Object(out))
}

/// A Messages request body as the conversation and the validated settings (the same as the OpenAI chat
/// endpoint's for the same request).
pub fn parse_messages(body: &[u8]) -> Result<api::Chat, ApiError> {
    let req: MessagesRequest = api::parse(body)?;
    api::parse_chat_value(to_openai(&req)?)
}

/// An error as the Messages API writes it.
pub fn error_response(e: &ApiError) -> Response {
    (e.status, Json(error_body(e))).into_response()
}

fn error_body(e: &ApiError) -> Value {
    let kind = match e.status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        s if s.is_server_error() => "api_error",
        _ => "invalid_request_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}})
}

/// Why the answer ended, in the Messages API's words.
fn stop_reason(finish_reason: &str, stop_sequence: &Option<String>) -> &'static str {
    match finish_reason {
        "tool_calls" => "tool_use",
        "length" => "max_tokens",
        _ if stop_sequence.is_some() => "stop_sequence",
        _ => "end_turn",
    }
}

fn usage(stats: &GenerationStats) -> Value {
    json!({
        "input_tokens": stats.prompt_tokens,
        "output_tokens": stats.completion_tokens,
        "cache_read_input_tokens": stats.restored_tokens,
    })
}

fn tool_use(c: &ToolCall, i: usize, id: &str) -> Value {
    let input: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": format!("toolu_{id}{i}"), "name": c.name, "input": input})
}

/// One answer's identity, and its rendering.
pub struct Reply {
    pub id: String,
    pub model: String,
}

impl Reply {
    /// The whole answer as one message.
    pub async fn whole(&self, mut events: Events) -> Result<Value, ApiError> {
        let (mut text, mut thinking) = (String::new(), String::new());
        loop {
            match events.next().await? {
                Event::Delta {
                    text: t,
                    reasoning: r,
                    ..
                } => {
                    text.push_str(&t);
                    thinking.push_str(&r);
                }
                Event::Error(e) => return Err(e),
                Event::Done {
                    finish_reason,
                    stop_sequence,
                    stats,
                    tool_calls,
                } => {
                    let mut content = Vec::new();
                    if !thinking.is_empty() {
                        content.push(
                            json!({"type": "thinking", "thinking": thinking, "signature": ""}),
                        );
                    }
                    if !text.is_empty() || tool_calls.is_empty() {
                        content.push(json!({"type": "text", "text": text}));
                    }
                    let ids = self.id.trim_start_matches("msg_");
                    content.extend(
                        tool_calls
                            .iter()
                            .enumerate()
                            .map(|(i, c)| tool_use(c, i, ids)),
                    );
                    return Ok(json!({
                        "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                        "content": content,
                        "stop_reason": stop_reason(finish_reason, &stop_sequence),
                        "stop_sequence": stop_sequence,
                        "usage": usage(&stats),
                    }));
                }
            }
        }
    }

    /// The answer as the Messages stream: `message_start`, each content block's `content_block_start`,
    /// deltas and `content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`.
    pub fn stream(self, events: Events) -> SseBody {
        let start = json!({"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0}}});
        let mut blocks = Blocks::default();
        events.into_sse(vec![event(&start)], move |ev| self.render(&mut blocks, ev))
    }

    fn render(&self, blocks: &mut Blocks, ev: Event) -> (Vec<SseEvent>, bool) {
        let mut v = Vec::new();
        match ev {
            Event::Delta {
                text, reasoning, ..
            } => {
                if !reasoning.is_empty() {
                    blocks.open("thinking", &mut v);
                    v.push(blocks.delta(json!({"type": "thinking_delta", "thinking": reasoning})));
                }
                if !text.is_empty() {
                    blocks.open("text", &mut v);
                    v.push(blocks.delta(json!({"type": "text_delta", "text": text})));
                }
                (v, false)
            }
            Event::Error(e) => (vec![event(&error_body(&e))], true),
            Event::Done {
                finish_reason,
                stop_sequence,
                stats,
                tool_calls,
            } => {
                if blocks.next == 0 && tool_calls.is_empty() {
                    blocks.open("text", &mut v); // an empty answer is one empty text block
                }
                blocks.close(&mut v);
                let ids = self.id.trim_start_matches("msg_");
                for (i, c) in tool_calls.iter().enumerate() {
                    let mut start = tool_use(c, i, ids);
                    let input = std::mem::replace(&mut start["input"], json!({}));
                    v.push(event(
                        &json!({"type": "content_block_start", "index": blocks.next,
                                         "content_block": start}),
                    ));
                    v.push(event(&json!({"type": "content_block_delta", "index": blocks.next,
                                         "delta": {"type": "input_json_delta", "partial_json": input.to_string()}})));
                    v.push(event(
                        &json!({"type": "content_block_stop", "index": blocks.next}),
                    ));
                    blocks.next += 1;
                }
                v.push(event(&json!({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason(finish_reason, &stop_sequence), "stop_sequence": stop_sequence},
                    "usage": usage(&stats)})));
                v.push(event(&json!({"type": "message_stop"})));
                (v, true)
            }
        }
    }
}

/// The stream's content blocks: the open one (its kind) and the next index.
#[derive(Default)]
struct Blocks {
    open: Option<&'static str>,
    next: usize,
}

impl Blocks {
    /// Make a block of `kind` the open one, closing another.
    fn open(&mut self, kind: &'static str, v: &mut Vec<SseEvent>) {
        if self.open == Some(kind) {
            return;
        }
        self.close(v);
        let block = match kind {
            "thinking" => json!({"type": "thinking", "thinking": "", "signature": ""}),
            _ => json!({"type": "text", "text": ""}),
        };
        v.push(event(
            &json!({"type": "content_block_start", "index": self.next, "content_block": block}),
        ));
        self.open = Some(kind);
    }

    fn close(&mut self, v: &mut Vec<SseEvent>) {
        if self.open.take().is_some() {
            v.push(event(
                &json!({"type": "content_block_stop", "index": self.next}),
            ));
            self.next += 1;
        }
    }

    fn delta(&self, delta: Value) -> SseEvent {
        event(&json!({"type": "content_block_delta", "index": self.next, "delta": delta}))
    }
}

/// An SSE event named by its payload's `type`, as the Messages stream names them.
fn event(v: &Value) -> SseEvent {
    let name = v.get("type").and_then(Value::as_str).unwrap_or("message");
    SseEvent::default().event(name).data(v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn openai(body: Value) -> Result<Value, ApiError> {
        let req: MessagesRequest =
            serde_json::from_value(body).map_err(|e| invalid(e.to_string()))?;
        to_openai(&req)
    }

    #[test]
    fn a_conversation_with_tools_becomes_the_openai_request_it_means() {
        let v = openai(json!({
            "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "temperature": 0.5, "top_k": 4,
            "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "-3 C"}]},
                    {"type": "text", "text": "And tomorrow?"}]}]
        }))
        .unwrap();
        assert_eq!(
            v["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "-3 C"},
                {"role": "user", "content": "And tomorrow?"}
            ])
        );
        assert_eq!(v["stop"], json!(["END"]));
        assert_eq!(v["tool_choice"], json!("required"));
        assert_eq!(
            v["tools"][0],
            json!({"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {"type": "object"}}})
        );
        assert_eq!(
            (v["max_tokens"].as_i64(), v["top_k"].as_i64()),
            (Some(64), Some(4))
        );
    }

    #[test]
    fn what_the_messages_api_requires_or_verity_lacks_is_refused_by_name() {
        let base = |extra: Value| {
            let mut v = json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            openai(v).err().map(|e| e.message)
        };
        assert_eq!(base(json!({})), None);
        let missing =
            openai(json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}));
        assert!(missing.unwrap_err().message.contains("max_tokens"));
        assert!(base(json!({"temperature": 1.5}))
            .unwrap()
            .contains("temperature"));
        assert!(base(json!({"unknown_field": 1}))
            .unwrap()
            .contains("unknown_field"));
        let image = json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]);
        assert!(base(json!({"messages": image})).unwrap().contains("image"));
        let server_tool = json!([{"type": "web_search_20250305", "name": "web_search"}]);
        assert!(base(json!({"tools": server_tool}))
            .unwrap()
            .contains("server tools"));
        assert!(base(json!({"tool_choice": {"type": "sometimes"}}))
            .unwrap()
            .contains("tool_choice"));
        let system_role = json!([{"role": "system", "content": "x"}]);
        assert!(base(json!({"messages": system_role}))
            .unwrap()
            .contains("`system` field"));
    }

    #[test]
    fn stop_reasons_follow_the_messages_api() {
        assert_eq!(stop_reason("stop", &None), "end_turn");
        assert_eq!(stop_reason("stop", &Some("END".into())), "stop_sequence");
        assert_eq!(stop_reason("length", &None), "max_tokens");
        assert_eq!(stop_reason("tool_calls", &None), "tool_use");
    }

    #[test]
    fn errors_take_the_messages_api_shape_and_types() {
        let e = ApiError::invalid("bad", Some("x"));
        assert_eq!(
            error_body(&e),
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}})
        );
        assert_eq!(
            error_body(&ApiError::overloaded())["error"]["type"],
            "overloaded_error"
        );
        assert_eq!(
            error_body(&ApiError::not_found("m"))["error"]["type"],
            "not_found_error"
        );
        assert_eq!(
            error_body(&ApiError::internal("x"))["error"]["type"],
            "api_error"
        );
    }
}
