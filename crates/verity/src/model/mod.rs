//! Model architectures as compositions of backend operations.
//!
//! [`Model::forward`] is the one entry point every decoding route uses: it takes W ≥ 1 new tokens at given
//! positions with an attention mask, appends their K/V to the cache, and returns logits for the rows asked for
//! (and, on request, the hidden states after chosen layers).

mod batched;
mod decoder;
mod delta_net;
mod drafter;
mod moe;
mod mtp;

pub use batched::SeqForward;
pub use decoder::{Model, MAX_STATE_LAYERS};
pub use drafter::{BlockDraft, BlockDrafter};
pub use mtp::{HeadDraft, HeadInput, HeadOutput, MtpHead, MAX_CHAIN};

use std::hash::{Hash, Hasher};

use crate::backend::{AttnMask, Backend};
use crate::bundle::hparams::HParams;
use crate::bundle::safetensors::SafetensorsSet;
use crate::bundle::st_matrix;
use crate::cache::{CacheShape, KvCache};
use crate::error::Result;
use crate::quant::{GgmlType, QMatrix, WeightFormat};
use crate::sample::RaceSpec;

/// A drafting network's weight matrix (an MTP head's, a block drafter's) from its safetensors: float weights
/// are re-encoded as Q8_0, since every draft reads every weight and a drafter's numerics never reach the output.
fn drafting_matrix<B: Backend>(
    be: &B,
    tensors: &SafetensorsSet,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<B::Matrix> {
    be.load_matrix(drafting_qmatrix(tensors, name, rows, cols)?)
}

/// [`drafting_matrix`] before it goes to the backend.
fn drafting_qmatrix(
    tensors: &SafetensorsSet,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<QMatrix> {
    let module = name.strip_suffix(".weight").unwrap_or(name);
    let mut q = st_matrix(tensors, None, module, name, rows, cols)?;
    if matches!(
        q.format,
        WeightFormat::Ggml(GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    ) && cols.is_multiple_of(32)
    {
        q = q.to_q8_0()?;
    }
    Ok(q)
}

/// The vocabulary a drafting network drafts from: a sorted subset of the target's (a frequency-ranked list the
/// bundle ships), or all of it. The verifier judges every draft against the full target distribution, so a
/// smaller drafting vocabulary costs acceptance, never correctness.
#[derive(Debug, Clone)]
pub(crate) struct DraftVocab {
    /// `None`: the whole vocabulary of `full` tokens.
    ids: Option<Vec<u32>>,
    full: usize,
}

impl DraftVocab {
    /// The list named `name` in `tensors` (`None`: the whole vocabulary of `full` tokens).
    fn load(tensors: &SafetensorsSet, name: Option<&str>, full: usize) -> Result<Self> {
        let ids = match name {
            Some(n) => {
                let mut ids = crate::bundle::st_token_ids(tensors, n, full)?;
                ids.sort_unstable();
                ids.dedup();
                if ids.is_empty() {
                    return Err(crate::error::Error::tensor(n, "empty draft vocabulary"));
                }
                Some(ids)
            }
            None => None,
        };
        Ok(DraftVocab { ids, full })
    }

    pub(crate) fn len(&self) -> usize {
        self.ids.as_ref().map_or(self.full, Vec::len)
    }

    /// The token id of logit `i`.
    pub(crate) fn token(&self, i: usize) -> u32 {
        match &self.ids {
            Some(ids) => ids[i],
            None => i as u32,
        }
    }

    pub(crate) fn ids(&self) -> Option<&[u32]> {
        self.ids.as_deref()
    }

    /// The target's output matrix restricted to the draft vocabulary's rows, on the backend.
    fn output_head<B: Backend>(&self, be: &B, bundle: &crate::bundle::Bundle) -> Result<B::Matrix> {
        use crate::bundle::TensorKey;
        let key = if bundle.has(TensorKey::Output) {
            TensorKey::Output
        } else {
            TensorKey::TokenEmbedding
        };
        let hp = &bundle.hparams;
        let full = bundle.matrix(key, hp.vocab, hp.hidden)?;
        be.load_matrix(match &self.ids {
            Some(ids) => full.select_rows(ids)?,
            None => full,
        })
    }
}

/// A drafting network's own KV cache: `layers` layers of `hp`'s attention shape, for up to `max_tokens`.
fn drafting_cache<B: Backend>(
    be: &B,
    hp: &HParams,
    layers: usize,
    max_tokens: usize,
) -> KvCache<B> {
    KvCache::new(
        be,
        CacheShape {
            n_layers: layers,
            n_heads: hp.n_heads,
            n_kv_heads: hp.n_kv_heads,
            head_dim: hp.head_dim,
        },
        max_tokens.min(hp.context_len).max(1),
    )
}

/// Forwards of up to this many rows (decode steps, verifies, draft steps) are recorded for replay
/// ([`Backend::replay_or_record`]); longer ones (prefill chunks, whose lengths vary) run directly.
const RECORDED_ROWS: usize = 16;

/// Run `work` (a forward of `rows` rows whose inputs are in its step) through the backend's recording when it is
/// short enough, keyed by `key`: everything besides the step that the recorded operations depend on (the
/// buffer-set ids of scratch and cache, the width, what is computed).
fn run_recorded<B: Backend>(be: &B, rows: usize, key: impl Hash, work: &mut dyn FnMut()) {
    if rows > RECORDED_ROWS {
        return work();
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    be.replay_or_record(h.finish(), work);
}

/// The new rows of one forward.
#[derive(Debug, Clone)]
pub struct Batch {
    pub tokens: Vec<u32>,
    /// Absolute position of each row (RoPE); equal positions are allowed for the siblings of a draft tree.
    pub positions: Vec<usize>,
    pub mask: AttnMask,
    /// Rows whose input is an image's features instead of their token's embedding.
    pub media: Vec<MediaRows>,
    /// Multimodal rotary positions (Qwen2.5-VL): each row's height and width positions beside `positions`;
    /// empty unless the forward holds an image's rows at such positions.
    pub spatial: Vec<[usize; 2]>,
}

/// One image's rows of a batch: `values` (`rows × hidden`, the vision side's output) are these rows' inputs to
/// the first layer, in place of their placeholder tokens' embeddings.
#[derive(Debug, Clone)]
pub struct MediaRows {
    pub first_row: usize,
    pub rows: usize,
    pub values: std::sync::Arc<Vec<f32>>,
}

impl Batch {
    /// `tokens` in sequence starting at position `start`, causally masked.
    pub fn causal(tokens: &[u32], start: usize) -> Self {
        Batch {
            tokens: tokens.to_vec(),
            positions: (start..start + tokens.len()).collect(),
            mask: AttnMask::Causal,
            media: Vec::new(),
            spatial: Vec::new(),
        }
    }

    /// `tokens` from position `start` with images in them: each row sees the rows before it, and an image's
    /// rows also see each other both ways (Gemma 3's attention over an image; the whole image must be in one
    /// batch).
    pub fn with_media(tokens: &[u32], start: usize, media: Vec<MediaRows>) -> Self {
        let rows = tokens.len();
        let mut visible = vec![false; rows * rows];
        for i in 0..rows {
            for j in 0..=i {
                visible[i * rows + j] = true;
            }
        }
        for m in &media {
            for i in m.first_row..(m.first_row + m.rows).min(rows) {
                for j in m.first_row..(m.first_row + m.rows).min(rows) {
                    visible[i * rows + j] = true;
                }
            }
        }
        Batch {
            tokens: tokens.to_vec(),
            positions: (start..start + rows).collect(),
            mask: if media.is_empty() {
                AttnMask::Causal
            } else {
                AttnMask::Tree(visible)
            },
            media,
            spatial: Vec::new(),
        }
    }

    /// `tokens` with images in them at multimodal rotary positions (Qwen2.5-VL's): causally masked (an image's
    /// rows too), row `r` at the temporal position `positions[r]` and the height and width positions
    /// `spatial[r]`.
    pub fn with_positioned_media(
        tokens: &[u32],
        positions: Vec<usize>,
        spatial: Vec<[usize; 2]>,
        media: Vec<MediaRows>,
    ) -> Self {
        Batch {
            tokens: tokens.to_vec(),
            positions,
            mask: AttnMask::Causal,
            media,
            spatial,
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
    /// Every row's greedy token only ([`ForwardOutput::greedy`]): the argmax taken where the logits are, so a
    /// greedy verify (no penalty, constraint or log-probabilities) copies one value per row, not a vocabulary.
    Greedy,
    /// Every row's token drawn by this race only ([`ForwardOutput::greedy`]), row `r`'s at position
    /// `positions[r] + 1`: drawn where the logits are ([`crate::backend::Backend::draw`]), so a sampled verify
    /// whose race alone decides (temperature and at most min-p; no constraint or log-probabilities) copies one
    /// value per row.
    Drawn(RaceSpec),
}

impl LogitRows {
    /// What these rows ask of a forward's device work: a draw asks for every row's logits and draws from them
    /// afterwards ([`crate::backend::Backend::draw`]), so one recorded forward serves every race's settings.
    pub(crate) fn work(self) -> LogitRows {
        match self {
            LogitRows::Drawn(_) => LogitRows::All,
            rows => rows,
        }
    }

    /// Whether every row is asked for (a verify's rows: a rollback may keep any of them).
    pub(crate) fn every_row(self) -> bool {
        !matches!(self, LogitRows::Last | LogitRows::None)
    }
}

/// What a forward returns.
#[derive(Debug, Clone, Default)]
pub struct ForwardOutput {
    /// `n × vocab`, row-major, for the rows asked for.
    pub logits: Vec<f32>,
    /// Each row's argmax ([`LogitRows::Greedy`]) or drawn token ([`LogitRows::Drawn`]).
    pub greedy: Vec<u32>,
    /// For each requested layer `l`: the residual stream after layer `l`, `rows × hidden`.
    pub hidden: Vec<(usize, Vec<f32>)>,
    /// `rows × hidden`: each row's state after the output norm ([`Model::forward_with_hidden`] only).
    pub final_hidden: Vec<f32>,
    /// `rows × width`: what [`Model::forward_features`] was asked for, row by row.
    pub features: Vec<f32>,
}

/// Which of the target's hidden states a proposer conditions on, per position: the residual stream after each
/// listed layer (what a block drafter fuses), then, where `final_state`, the state after the output norm (what
/// an MTP head reads), concatenated per row in that order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TargetFeatures {
    pub layers: Vec<usize>,
    pub final_state: bool,
}

impl TargetFeatures {
    /// No states.
    pub fn none() -> Self {
        Self::default()
    }

    /// The state after the output norm.
    pub fn final_state() -> Self {
        TargetFeatures {
            layers: Vec::new(),
            final_state: true,
        }
    }

    /// The residual stream after each of `layers`.
    pub fn layers(layers: Vec<usize>) -> Self {
        TargetFeatures {
            layers,
            final_state: false,
        }
    }

    /// Values per row, for a model of `hidden` values per state.
    pub fn width(&self, hidden: usize) -> usize {
        (self.layers.len() + usize::from(self.final_state)) * hidden
    }

    pub fn is_none(&self) -> bool {
        self.layers.is_empty() && !self.final_state
    }

    /// Everything `self` or `other` holds: `self`'s layers, then `other`'s that `self` lacks.
    pub fn union(&self, other: &TargetFeatures) -> TargetFeatures {
        let mut layers = self.layers.clone();
        layers.extend(other.layers.iter().filter(|l| !self.layers.contains(l)));
        TargetFeatures {
            layers,
            final_state: self.final_state || other.final_state,
        }
    }

    /// The rows of `part` (a subset of `self`) taken out of `rows` of `self`'s features, `hidden` values per
    /// state.
    pub fn extract(&self, part: &TargetFeatures, rows: &[f32], hidden: usize) -> Vec<f32> {
        let width = self.width(hidden);
        let at: Vec<usize> = part
            .layers
            .iter()
            .map(|l| self.layers.iter().position(|m| m == l).expect("a subset"))
            .chain(part.final_state.then(|| {
                assert!(self.final_state, "a subset");
                self.layers.len()
            }))
            .collect();
        let mut out = Vec::with_capacity(rows.len() / width.max(1) * at.len() * hidden);
        for row in rows.chunks_exact(width) {
            for &i in &at {
                out.extend_from_slice(&row[i * hidden..(i + 1) * hidden]);
            }
        }
        out
    }

    /// A stable name (`final`, `layers:1,8,15`, `layers:1,8,15+final`; empty for none): how a checkpoint file
    /// records what it holds.
    pub fn tag(&self) -> String {
        let ids: Vec<String> = self.layers.iter().map(|x| x.to_string()).collect();
        match (ids.is_empty(), self.final_state) {
            (true, false) => String::new(),
            (true, true) => "final".into(),
            (false, fin) => format!(
                "layers:{}{}",
                ids.join(","),
                if fin { "+final" } else { "" }
            ),
        }
    }

    /// The features a [`TargetFeatures::tag`] names.
    pub fn from_tag(tag: &str) -> Option<Self> {
        match tag {
            "" => Some(Self::none()),
            "final" => Some(Self::final_state()),
            _ => {
                let ids = tag.strip_prefix("layers:")?;
                let (ids, final_state) = match ids.strip_suffix("+final") {
                    Some(ids) => (ids, true),
                    None => (ids, false),
                };
                let layers: Option<Vec<usize>> = ids.split(',').map(|x| x.parse().ok()).collect();
                layers
                    .filter(|l| !l.is_empty())
                    .map(|layers| TargetFeatures {
                        layers,
                        final_state,
                    })
            }
        }
    }
}
