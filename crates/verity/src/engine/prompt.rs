//! Prompts: a conversation rendered through the bundle's chat template (or as raw text for a base model) and
//! tokenized, with the canonical boundary where a prefix-cache checkpoint is worth storing.

use super::Engine;
use crate::backend::Backend;
use crate::chat::{tools, Message, TemplateArgs};
use crate::error::Result;

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

impl<B: Backend> Engine<B> {
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
}
