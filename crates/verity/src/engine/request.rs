//! What a caller asks of the engine and what it gets back per token.

use super::media::PromptImage;
use crate::sample::constraint::SharedConstraint;
use crate::sample::SamplerConfig;

/// One generation: how many tokens, how to sample them, and what to report or keep along the way.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub max_tokens: usize,
    pub sampling: SamplerConfig,
    /// Keep generating through stop tokens (benchmarks that need a fixed length).
    pub ignore_eos: bool,
    /// Use the engine's speculative route (false = AR for this request).
    pub speculate: bool,
    /// Draft this many tokens every cycle (at most what the proposer offers) instead of the controller's
    /// timing-driven choice: runs whose acceptance must compare like with like (benchmarks of proposer state).
    pub draft_width: Option<usize>,
    /// Report the chosen token's log-probability with each token.
    pub want_logprob: bool,
    /// Also report this many most likely alternatives per token.
    pub logprobs: usize,
    /// A grammar the output must follow (decoded on the verified AR path: no drafts).
    pub constraint: Option<SharedConstraint>,
    /// Store a prefix-cache checkpoint after this many prompt tokens (the canonical boundary: the conversation
    /// without the generation prompt), captured during prefill; and one of the state after the answer.
    pub store_prefix: Option<usize>,
    /// The images whose rows the prompt holds (their ids, [`PromptImage::ids`], in place of placeholder
    /// tokens). A request with images drafts with the proposers that take them
    /// ([`crate::speculative::Proposer::takes_images`]).
    pub images: Vec<PromptImage>,
}

impl Default for GenerateRequest {
    /// Greedy, 256 tokens, speculation on, nothing extra reported or stored.
    fn default() -> Self {
        GenerateRequest {
            max_tokens: 256,
            sampling: SamplerConfig::greedy(),
            ignore_eos: false,
            speculate: true,
            draft_width: None,
            want_logprob: false,
            logprobs: 0,
            constraint: None,
            store_prefix: None,
            images: Vec::new(),
        }
    }
}

impl GenerateRequest {
    pub fn greedy(max_tokens: usize) -> Self {
        GenerateRequest {
            max_tokens,
            ..Default::default()
        }
    }
}

/// A completion token as it is emitted.
#[derive(Debug, Clone)]
pub struct Emitted {
    pub id: u32,
    pub logprobs: Option<Logprobs>,
}

/// Log-probabilities under the model's distribution (the log-softmax of its logits, before sampling settings).
#[derive(Debug, Clone)]
pub struct Logprobs {
    pub logprob: f32,
    /// The `n` most likely tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

impl Logprobs {
    pub(super) fn of(logits: &[f32], token: u32, n: usize) -> Self {
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let lse = max
            + logits
                .iter()
                .map(|&v| ((v - max) as f64).exp())
                .sum::<f64>()
                .ln() as f32;
        let mut top: Vec<(u32, f32)> = Vec::with_capacity(n);
        if n > 0 {
            let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
            let n = n.min(idx.len());
            idx.select_nth_unstable_by(n - 1, |&a, &b| {
                logits[b as usize].total_cmp(&logits[a as usize])
            });
            idx.truncate(n);
            idx.sort_by(|&a, &b| {
                logits[b as usize]
                    .total_cmp(&logits[a as usize])
                    .then(a.cmp(&b))
            });
            top = idx
                .into_iter()
                .map(|i| (i, logits[i as usize] - lse))
                .collect();
        }
        Logprobs {
            logprob: logits[token as usize] - lse,
            top,
        }
    }
}
