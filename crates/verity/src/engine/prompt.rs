//! Prompts: a conversation rendered through the bundle's chat template (or as raw text for a base model) and
//! tokenized, with the canonical boundary where a prefix-cache checkpoint is worth storing.

use std::ops::Range;

use super::Engine;
use crate::backend::Backend;
use crate::chat::{tools, ChatTemplate, Message, TemplateArgs};
use crate::error::{Error, Result};

/// Private-use characters that mark where a message's content lies in a rendering, so that special-token text
/// a user wrote is encoded as text ([`crate::chat::Tokenizer::encode_with_literals`]).
const OPEN: char = '\u{F8F0}';
const CLOSE: char = '\u{F8F1}';
/// Where an image goes in a message's content ([`Engine::render_chat_with_images`]).
pub const IMAGE_SLOT: char = '\u{F8F2}';

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

    /// Whether the bundle has a chat template (without one, a base model's, prompts are raw text).
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
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
            // A base model's prompt is all user text: nothing in it is a control token.
            let text: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
            let text = text.join("\n");
            return Ok(ChatPrompt {
                tokens: self.tokenizer.encode_literal(&text, true)?,
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
        let (text, tokens) = self.encode_rendering(t, messages, true, args)?;
        let (_, head) = self.encode_rendering(t, messages, false, args)?;
        let boundary =
            (head.len() < tokens.len() && tokens.starts_with(&head)).then_some(head.len());
        Ok(ChatPrompt {
            tokens,
            boundary,
            opens_reasoning: t.knows_reasoning() && text.trim_end().ends_with("<think>"),
        })
    }

    /// Render `messages` and encode the rendering, with the template's markers as control tokens and the
    /// messages' contents as text. Only where a content holds special-token text does this differ from encoding
    /// the rendering whole: the contents are then located by rendering them between marker characters.
    fn encode_rendering(
        &self,
        t: &ChatTemplate,
        messages: &[Message],
        generation_prompt: bool,
        args: &TemplateArgs,
    ) -> Result<(String, Vec<u32>)> {
        let text = t.render(messages, generation_prompt, args)?;
        if !messages
            .iter()
            .any(|m| self.tokenizer.mentions_special(&m.content))
        {
            let tokens = self.tokenizer.encode(&text, true)?;
            return Ok((text, tokens));
        }
        let marked: Vec<Message> = messages
            .iter()
            .map(|m| {
                if m.content.contains([OPEN, CLOSE]) {
                    return Err(Error::Invalid(
                        "a message holds the private-use characters U+F8F0/U+F8F1".into(),
                    ));
                }
                let mut m = m.clone();
                if self.tokenizer.mentions_special(&m.content) {
                    m.content = format!("{OPEN}{}{CLOSE}", m.content);
                }
                Ok(m)
            })
            .collect::<Result<_>>()?;
        let literals = content_ranges(&t.render(&marked, generation_prompt, args)?, &text)
            .ok_or_else(|| {
                Error::Invalid(
                    "a message holds the text of a control token, and this chat template does not pass \
                     message contents through verbatim, so it cannot be kept as text"
                        .into(),
                )
            })?;
        let tokens = self
            .tokenizer
            .encode_with_literals(&text, &literals, true)?;
        Ok((text, tokens))
    }
}

impl<B: Backend> Engine<B> {
    /// The prompt for a conversation whose contents hold images: each [`IMAGE_SLOT`] character in a content is
    /// where the next of `images` goes, as its processor places it (Gemma 3's: a blank line, `<start_of_image>`,
    /// the image's rows, `<end_of_image>`, a blank line; Qwen2.5-VL's: `<|vision_start|>`, the rows,
    /// `<|vision_end|>`). The text between is encoded in pieces that end and
    /// start at the image's control tokens, which a tokenizer never merges across, so the ids are those of the
    /// whole expanded text. Needs the bundle's vision side and a chat template.
    pub fn render_chat_with_images(
        &self,
        messages: &[Message],
        images: &[super::PromptImage],
    ) -> Result<ChatPrompt> {
        let vision = self.vision.as_ref().ok_or_else(|| {
            Error::Unsupported("images with a bundle that has no vision tower".into())
        })?;
        let t = self.template.as_ref().ok_or_else(|| {
            Error::Unsupported("images with a bundle without a chat template".into())
        })?;
        let slots: usize = messages
            .iter()
            .map(|m| m.content.matches(IMAGE_SLOT).count())
            .sum();
        if slots != images.len() {
            return Err(Error::Invalid(format!(
                "{slots} image places in the messages for {} images",
                images.len()
            )));
        }
        if messages.iter().any(|m| {
            self.tokenizer.mentions_special(&m.content) || m.content.contains([OPEN, CLOSE])
        }) {
            return Err(Error::Unsupported(
                "control-token text in a message that comes with images".into(),
            ));
        }
        let args = TemplateArgs::default();
        let encode = |text: &str| -> Result<Vec<u32>> {
            let pieces: Vec<&str> = text.split(IMAGE_SLOT).collect();
            let mut ids = Vec::new();
            for (i, piece) in pieces.iter().enumerate() {
                let mut piece = piece.to_string();
                if i > 0 {
                    piece.insert_str(0, vision.margin());
                }
                if i + 1 < pieces.len() {
                    piece.push_str(vision.margin());
                }
                ids.extend(self.tokenizer.encode(&piece, i == 0)?);
                if let Some(img) = images.get(i).filter(|_| i + 1 < pieces.len()) {
                    ids.extend(vision.block(img));
                }
            }
            Ok(ids)
        };
        let tokens = encode(&t.render(messages, true, &args)?)?;
        let head = encode(&t.render(messages, false, &args)?)?;
        let boundary =
            (head.len() < tokens.len() && tokens.starts_with(&head)).then_some(head.len());
        Ok(ChatPrompt {
            tokens,
            boundary,
            opens_reasoning: false,
        })
    }
}

/// The byte ranges of `plain` that `marked` (the same rendering with some contents between [`OPEN`] and
/// [`CLOSE`]) marks; `None` unless the markers pair up and removing them gives exactly `plain` (a template that
/// trims or rewrites a content would otherwise shift the ranges).
fn content_ranges(marked: &str, plain: &str) -> Option<Vec<Range<usize>>> {
    let mut stripped = String::with_capacity(plain.len());
    let mut ranges = Vec::new();
    let mut open = None;
    for c in marked.chars() {
        match c {
            OPEN if open.is_none() => open = Some(stripped.len()),
            CLOSE => ranges.push(open.take()?..stripped.len()),
            OPEN => return None,
            c => stripped.push(c),
        }
    }
    (open.is_none() && stripped == plain).then_some(ranges)
}
