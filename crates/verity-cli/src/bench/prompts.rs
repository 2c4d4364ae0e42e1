//! The benchmark prompt file: JSON lines with `id`, `category` and `messages` (one turn) or `turns` (a
//! conversation whose user turns are run one after another).

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
        if p.messages.is_empty() && p.turns.is_empty() {
            bail!(
                "{}:{}: prompt {} has neither messages nor turns",
                path.display(),
                i + 1,
                p.id
            );
        }
        out.push(p);
    }
    Ok(out)
}
