//! The benchmark prompt file: JSON lines with `id`, `category` and `messages` (one turn), `turns` (a
//! conversation whose user turns are run one after another) or `prompt` (raw text, for base models).

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use verity::chat::Message;

#[derive(Debug, Clone, Deserialize)]
pub struct BenchPrompt {
    pub id: String,
    pub category: String,
    #[serde(default)]
    pub messages: Vec<Message>,
    /// Each turn: the messages appended before that turn's answer (usually one user message).
    #[serde(default)]
    pub turns: Vec<TurnMessages>,
    /// Raw text: a model without a chat template reads it as it is (a chat model as one user message).
    #[serde(default)]
    pub prompt: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum TurnMessages {
    One(Message),
    Many(Vec<Message>),
}

impl BenchPrompt {
    /// The turns as lists of messages to append (a single-turn prompt is one turn).
    pub fn turns(&self) -> Vec<Vec<Message>> {
        if let Some(text) = &self.prompt {
            return vec![vec![Message::new("user", text)]];
        }
        if self.turns.is_empty() {
            return vec![self.messages.clone()];
        }
        self.turns
            .iter()
            .map(|t| match t {
                TurnMessages::One(m) => vec![m.clone()],
                TurnMessages::Many(v) => v.clone(),
            })
            .collect()
    }
}

pub fn load(path: &Path) -> Result<Vec<BenchPrompt>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let p: BenchPrompt = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: invalid prompt", path.display(), i + 1))?;
        let given = [
            !p.messages.is_empty(),
            !p.turns.is_empty(),
            p.prompt.is_some(),
        ];
        if given.iter().filter(|&&g| g).count() != 1 {
            bail!(
                "{}:{}: prompt {} needs exactly one of messages, turns and prompt",
                path.display(),
                i + 1,
                p.id
            );
        }
        out.push(p);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_lines(lines: &str) -> Result<Vec<BenchPrompt>> {
        let path =
            std::env::temp_dir().join(format!("verity-prompts-{}.jsonl", std::process::id()));
        std::fs::write(&path, lines).unwrap();
        let out = load(&path);
        std::fs::remove_file(&path).unwrap();
        out
    }

    #[test]
    fn a_raw_text_prompt_is_one_turn_and_a_line_takes_exactly_one_form() {
        let p =
            load_lines(r#"{"id":"r1","category":"prose","prompt":"Once upon a time"}"#).unwrap();
        let turns = p[0].turns();
        assert_eq!(turns.len(), 1);
        assert_eq!(turns[0][0].content, "Once upon a time");
        let both = r#"{"id":"x","category":"prose","prompt":"a","messages":[{"role":"user","content":"b"}]}"#;
        assert!(load_lines(both)
            .unwrap_err()
            .to_string()
            .contains("exactly one"));
        assert!(load_lines(r#"{"id":"y","category":"prose"}"#).is_err());
    }
}
