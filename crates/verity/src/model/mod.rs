//! Model architectures as compositions of backend operations.
//!
//! [`Model::forward`] is the one entry point every decoding route uses: it takes W ≥ 1 new tokens at given
//! positions with an attention mask, appends their K/V to the cache, and returns logits for the rows asked for
//! (and, on request, the hidden states after chosen layers).

pub mod hparams;
mod llama;
mod mtp;

pub use llama::Model;
pub use mtp::{HeadOutput, MtpHead};

use crate::backend::AttnMask;

/// Forwards of up to this many rows (decode steps, verifies, draft steps) are recorded for replay
/// ([`crate::backend::Backend::replay_or_record`]); longer ones (prefill chunks, whose lengths vary) run directly.
const RECORDED_ROWS: usize = 16;

/// The new rows of one forward.
#[derive(Debug, Clone)]
pub struct Batch {
    pub tokens: Vec<u32>,
    /// Absolute position of each row (RoPE); equal positions are allowed for the siblings of a draft tree.
    pub positions: Vec<usize>,
    pub mask: AttnMask,
}

impl Batch {
    /// `tokens` in sequence starting at position `start`, causally masked.
    pub fn causal(tokens: &[u32], start: usize) -> Self {
        Batch {
            tokens: tokens.to_vec(),
            positions: (start..start + tokens.len()).collect(),
            mask: AttnMask::Causal,
        }
    }

    pub fn rows(&self) -> usize {
        self.tokens.len()
    }
}

/// Which rows get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogitRows {
    /// Every row (verify).
    All,
    /// The last row only (prefill).
    Last,
    /// None (prefill of a prefix whose next token is known).
    None,
}

/// What a forward returns.
#[derive(Debug, Clone, Default)]
pub struct ForwardOutput {
    /// `n × vocab`, row-major, for the rows asked for.
    pub logits: Vec<f32>,
    /// For each requested layer `l`: the residual stream after layer `l`, `rows × hidden`.
    pub hidden: Vec<(usize, Vec<f32>)>,
    /// `rows × hidden`: each row's state after the output norm ([`Model::forward_with_hidden`] only).
    pub final_hidden: Vec<f32>,
}
