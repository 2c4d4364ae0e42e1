//! The request loop: prompt → prefill (reusing the session's cached prefix) → decode → stream tokens, with stop
//! conditions and timing. Plain autoregressive decoding lives here; speculative routes plug in beside it.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::backend::Backend;
use crate::bundle::Bundle;
use crate::cache::KvCache;
use crate::chat::{ChatTemplate, Message, Tokenizer};
use crate::error::{Error, Result};
use crate::model::{Batch, LogitRows, Model};
use crate::sample::{Sampler, SamplerConfig};

/// Rows per prefill forward: large enough to amortize weight reads, small enough to bound scratch memory.
pub const PREFILL_CHUNK: usize = 64;

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub max_tokens: usize,
    pub sampling: SamplerConfig,
    /// Keep generating through stop tokens (benchmarks that need a fixed length).
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token (EOS / end of turn) was produced; it is not part of the completion.
    Stop,
    MaxTokens,
    ContextFull,
    /// The token callback asked to stop.
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens whose K/V were already in the session cache.
    pub restored_tokens: usize,
    pub completion_tokens: usize,
    pub ttft_s: f64,
    /// From the first completion token to the last.
    pub decode_s: f64,
    pub stop: StopReason,
}

impl GenerationStats {
    /// Completion tokens after the first, per second of decode time.
    pub fn decode_tok_s(&self) -> f64 {
        if self.completion_tokens > 1 && self.decode_s > 0.0 {
            (self.completion_tokens - 1) as f64 / self.decode_s
        } else {
            0.0
        }
    }
}

/// A conversation's model state: the cache and the tokens whose K/V it holds.
pub struct Session<B: Backend> {
    pub cache: KvCache<B>,
    pub tokens: Vec<u32>,
}

pub struct Engine<B: Backend> {
    pub model: Model<B>,
    pub tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
}

impl<B: Backend> Engine<B> {
    pub fn load(path: &Path, backend: Arc<B>) -> Result<Self> {
        let bundle = Bundle::open(path)?;
        let tokenizer = Tokenizer::from_bundle(&bundle)?;
        let model = Model::load(&bundle, backend)?;
        if tokenizer.vocab_size() > model.hp.vocab {
            return Err(Error::Invalid(format!(
                "the tokenizer has {} tokens but the model only {}",
                tokenizer.vocab_size(),
                model.hp.vocab
            )));
        }
        let template = match &tokenizer.chat_template {
            Some(src) => {
                let tok_str =
                    |id: Option<u32>| id.and_then(|i| tokenizer.token_str(i)).unwrap_or_default();
                Some(ChatTemplate::new(
                    src,
                    &tok_str(tokenizer.bos),
                    &tok_str(tokenizer.eos),
                )?)
            }
            None => None,
        };
        Ok(Engine {
            model,
            tokenizer,
            template,
        })
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    pub fn new_session(&self) -> Session<B> {
        Session {
            cache: self.model.new_cache(self.model.hp.context_len),
            tokens: Vec::new(),
        }
    }

    /// The prompt tokens for a conversation: the chat template with a generation prompt, or — for a bundle
    /// without a template (a base model) — the messages' contents as raw text.
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        match &self.template {
            Some(t) => {
                let text = t.render(messages, true)?;
                self.tokenizer.encode(&text, true)
            }
            None => {
                let text: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
                self.tokenizer.encode(&text.join("\n"), true)
            }
        }
    }

    /// Prefill `prompt` into the session (reusing the longest cached prefix) and return the last row's logits.
    pub fn prefill(&mut self, sess: &mut Session<B>, prompt: &[u32]) -> Result<(Vec<f32>, usize)> {
        if prompt.is_empty() {
            return Err(Error::Invalid("empty prompt".into()));
        }
        // Keep at least the last prompt token to recompute: its logits start the completion.
        let common = sess
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1);
        sess.cache.truncate(common);
        sess.tokens.truncate(common);
        let mut logits = Vec::new();
        let mut pos = common;
        for chunk in prompt[common..].chunks(PREFILL_CHUNK) {
            let last = pos + chunk.len() == prompt.len();
            let rows = if last {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            let out = self
                .model
                .forward(&mut sess.cache, &Batch::causal(chunk, pos), rows, &[])?;
            sess.tokens.extend_from_slice(chunk);
            pos += chunk.len();
            logits = out.logits;
        }
        Ok((logits, common))
    }

    /// Generate a completion of `prompt` by plain autoregressive decoding. `on_token` receives each completion
    /// token as it is produced (with the tokenizer, for streaming text) and returns `false` to stop.
    pub fn generate(
        &mut self,
        sess: &mut Session<B>,
        prompt: &[u32],
        req: &GenerateRequest,
        mut on_token: impl FnMut(&Tokenizer, u32) -> bool,
    ) -> Result<GenerationStats> {
        let start = Instant::now();
        let mut sampler = Sampler::new(req.sampling)?;
        let (mut logits, restored) = self.prefill(sess, prompt)?;
        let mut stats = GenerationStats {
            prompt_tokens: prompt.len(),
            restored_tokens: restored,
            completion_tokens: 0,
            ttft_s: 0.0,
            decode_s: 0.0,
            stop: StopReason::MaxTokens,
        };
        let mut first_at = None;
        while stats.completion_tokens < req.max_tokens {
            let tok = sampler.sample(&logits, &sess.tokens);
            if first_at.is_none() {
                let now = Instant::now();
                stats.ttft_s = (now - start).as_secs_f64();
                first_at = Some(now);
            }
            if !req.ignore_eos && self.tokenizer.is_stop(tok) {
                stats.stop = StopReason::Stop;
                break;
            }
            stats.completion_tokens += 1;
            if !on_token(&self.tokenizer, tok) {
                stats.stop = StopReason::Cancelled;
                break;
            }
            if stats.completion_tokens == req.max_tokens {
                break;
            }
            if sess.cache.len() + 1 > sess.cache.max_capacity() {
                stats.stop = StopReason::ContextFull;
                break;
            }
            let pos = sess.tokens.len();
            let out = self.model.forward(
                &mut sess.cache,
                &Batch::causal(&[tok], pos),
                LogitRows::Last,
                &[],
            )?;
            sess.tokens.push(tok);
            logits = out.logits;
        }
        if let Some(t) = first_at {
            stats.decode_s = t.elapsed().as_secs_f64();
        }
        Ok(stats)
    }
}
