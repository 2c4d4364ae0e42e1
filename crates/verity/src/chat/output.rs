//! Splitting generated text into what a chat API returns separately: reasoning (`<think>…</think>`), the
//! answer, and tool calls (`<tool_call>{"name": …, "arguments": …}</tool_call>`, the Hermes/Qwen format that
//! verity also teaches models whose templates know no tools).
//!
//! It works on streamed text: a tag split across deltas is held back until it is complete or ruled out, so the
//! concatenation of every piece's text equals the generated text minus the tags (and minus the newlines that
//! separate a closed reasoning block from the answer).

use serde::{Deserialize, Serialize};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

/// A parsed tool call: the function's name and its arguments as JSON text (as OpenAI returns them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// What one push (or the final flush) produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCall>,
}

impl Split {
    /// Add what a later push (or the final flush) produced.
    pub fn append(&mut self, other: Split) {
        self.content.push_str(&other.content);
        self.reasoning.push_str(&other.reasoning);
        self.tool_calls.extend(other.tool_calls);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Reasoning,
    Content,
    ToolCall,
}

/// A streaming splitter for one completion.
#[derive(Debug, Clone)]
pub struct OutputParser {
    mode: Mode,
    reasoning_tags: bool,
    tools: bool,
    held: String,
    /// Drop newlines at the start of the answer after a reasoning block.
    trim_start: bool,
}

impl OutputParser {
    /// `in_reasoning`: the prompt already opened a reasoning block (the template ended with `<think>`).
    /// `reasoning_tags`: the model uses `<think>` blocks at all. `tools`: tool calls are expected.
    pub fn new(in_reasoning: bool, reasoning_tags: bool, tools: bool) -> Self {
        OutputParser {
            mode: if in_reasoning && reasoning_tags {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            reasoning_tags,
            tools,
            held: String::new(),
            trim_start: false,
        }
    }

    /// Feed generated text; returns what can be released now.
    pub fn push(&mut self, text: &str) -> Split {
        self.held.push_str(text);
        let mut out = Split::default();
        loop {
            match self.mode {
                Mode::Reasoning => match self.held.find(THINK_CLOSE) {
                    Some(i) => {
                        out.reasoning.push_str(&self.held[..i]);
                        self.held.drain(..i + THINK_CLOSE.len());
                        self.mode = Mode::Content;
                        self.trim_start = true;
                    }
                    None => {
                        let keep = partial_suffix(&self.held, &[THINK_CLOSE]);
                        let cut = self.held.len() - keep;
                        out.reasoning.push_str(&self.held[..cut]);
                        self.held.drain(..cut);
                        return out;
                    }
                },
                Mode::Content => {
                    if self.trim_start {
                        let t = self.held.trim_start_matches(['\n', '\r']).len();
                        self.held.drain(..self.held.len() - t);
                        if self.held.is_empty() {
                            return out;
                        }
                        self.trim_start = false;
                    }
                    let mut tags: Vec<&str> = Vec::new();
                    if self.reasoning_tags {
                        tags.push(THINK_OPEN);
                    }
                    if self.tools {
                        tags.push(CALL_OPEN);
                    }
                    let hit = tags
                        .iter()
                        .filter_map(|t| self.held.find(t).map(|i| (i, *t)))
                        .min();
                    match hit {
                        Some((i, tag)) => {
                            out.content.push_str(&self.held[..i]);
                            self.held.drain(..i + tag.len());
                            self.mode = if tag == THINK_OPEN {
                                Mode::Reasoning
                            } else {
                                Mode::ToolCall
                            };
                        }
                        None => {
                            let keep = partial_suffix(&self.held, &tags);
                            let cut = self.held.len() - keep;
                            out.content.push_str(&self.held[..cut]);
                            self.held.drain(..cut);
                            return out;
                        }
                    }
                }
                Mode::ToolCall => match self.held.find(CALL_CLOSE) {
                    Some(i) => {
                        let body = self.held[..i].to_string();
                        self.held.drain(..i + CALL_CLOSE.len());
                        match parse_call(&body) {
                            Some(c) => out.tool_calls.push(c),
                            None => out
                                .content
                                .push_str(&format!("{CALL_OPEN}{body}{CALL_CLOSE}")),
                        }
                        self.mode = Mode::Content;
                        self.trim_start = true;
                    }
                    None => return out,
                },
            }
        }
    }

    /// The end of the completion: release what is held. An unclosed tool call whose body parses counts (models
    /// often stop right after the JSON); otherwise it is returned as text.
    pub fn finish(&mut self) -> Split {
        let mut out = self.push("");
        let rest = std::mem::take(&mut self.held);
        match self.mode {
            Mode::Reasoning => out.reasoning.push_str(&rest),
            Mode::Content => out.content.push_str(&rest),
            Mode::ToolCall => match parse_call(&rest) {
                Some(c) => out.tool_calls.push(c),
                None => out.content.push_str(&format!("{CALL_OPEN}{rest}")),
            },
        }
        self.mode = Mode::Content;
        out
    }

    /// Split a whole completion at once.
    pub fn split_all(mut self, text: &str) -> Split {
        let mut out = self.push(text);
        out.append(self.finish());
        out
    }
}

/// The length of the longest suffix of `s` that is a proper prefix of one of `tags`.
fn partial_suffix(s: &str, tags: &[&str]) -> usize {
    let mut keep = 0;
    for t in tags {
        for l in (1..t.len()).rev() {
            if l <= s.len() && s.is_char_boundary(s.len() - l) && s.ends_with(&t[..l]) {
                keep = keep.max(l);
                break;
            }
        }
    }
    keep
}

/// `{"name": …, "arguments": {…} | "…"}` (also `parameters` for `arguments`).
fn parse_call(body: &str) -> Option<ToolCall> {
    let v: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    let arguments = match args {
        None | Some(serde_json::Value::Null) => "{}".to_string(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(p: &mut OutputParser, text: &str, step: usize) -> Split {
        let mut out = Split::default();
        let chars: Vec<char> = text.chars().collect();
        for c in chars.chunks(step) {
            out.append(p.push(&c.iter().collect::<String>()));
        }
        out.append(p.finish());
        out
    }

    #[test]
    fn reasoning_and_answer_are_separated_whatever_the_delta_boundaries() {
        let text = "Let me think.</think>\n\nThe answer is 4.";
        for step in 1..8 {
            let s = stream(&mut OutputParser::new(true, true, false), text, step);
            assert_eq!(s.reasoning, "Let me think.");
            assert_eq!(s.content, "The answer is 4.");
        }
        let s = OutputParser::new(false, true, false).split_all("<think>hm</think>ok");
        assert_eq!((s.reasoning.as_str(), s.content.as_str()), ("hm", "ok"));
    }

    #[test]
    fn tool_calls_are_parsed_and_text_around_them_kept() {
        let text = "Checking.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        for step in 1..6 {
            let s = stream(&mut OutputParser::new(false, false, true), text, step);
            assert_eq!(s.content, "Checking.");
            assert_eq!(
                s.tool_calls,
                vec![ToolCall {
                    name: "get_weather".into(),
                    arguments: "{\"city\":\"Paris\"}".into()
                }]
            );
        }
    }

    #[test]
    fn an_unclosed_call_counts_if_its_json_is_whole_and_is_text_otherwise() {
        let s = OutputParser::new(false, false, true).split_all("<tool_call>{\"name\":\"f\"}");
        assert_eq!(s.tool_calls[0].name, "f");
        assert_eq!(s.tool_calls[0].arguments, "{}");
        let s = OutputParser::new(false, false, true).split_all("<tool_call>{\"name\":");
        assert!(s.tool_calls.is_empty());
        assert_eq!(s.content, "<tool_call>{\"name\":");
        let s = OutputParser::new(false, false, true).split_all("<tool_call>not json</tool_call>");
        assert_eq!(s.content, "<tool_call>not json</tool_call>");
    }

    #[test]
    fn without_tags_text_passes_through_unchanged_even_if_it_looks_like_a_tag_prefix() {
        let s = OutputParser::new(false, false, false).split_all("a <tool_call> b <think>");
        assert_eq!(s.content, "a <tool_call> b <think>");
        let mut p = OutputParser::new(false, false, true);
        assert_eq!(p.push("x <tool").content, "x ");
        assert_eq!(p.push("box").content, "<toolbox");
    }
}
