//! The compute backend: the small set of operations a decoder forward is made of, implemented once per device.
//!
//! The model code is written against [`Backend`] only; a CPU backend lives in [`cpu`], and CUDA/Metal backends
//! implement the same trait. Every operation works on `rows` activation rows at once, and each output row must
//! depend only on its own input row (plus the KV cache for attention) through a fixed sequence of operations:
//! that is what makes a W-row verify forward row-exact against the 1-row decode step.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use rayon::prelude::*;

use crate::error::Result;
use crate::quant::QMatrix;
use crate::sample::RaceSpec;

/// The most runs an 8-bit-activation projection sums each output's blocks in (the contract: `cpu/packed.rs`'s
/// module doc; the CUDA kernels are compiled with it), so that a GPU can spread one output's blocks over warps.
pub const INT8_RUNS: usize = 16;

/// How RoPE pairs the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)`: GGUF llama files (the converter permutes Q/K for it).
    Interleaved,
    /// Pairs `(i, i + d/2)`: Hugging Face `rotate_half`, GGUF qwen2/qwen3 (ggml NEOX mode).
    HalfSplit,
}

/// The activation of a gated MLP: `out = act(gate · x) ⊙ (up · x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Glu {
    /// SwiGLU: `silu(g) = g / (1 + e^-g)` (Llama, Qwen).
    #[default]
    Silu,
    /// GeGLU with the tanh approximation of GELU, `0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³)))` (Gemma).
    GeluTanh,
}

/// Which keys each new row may attend to. Committed cache slots (before the batch) are always visible.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttnMask {
    /// New row `i` sees new rows `0..=i`.
    Causal,
    /// New row `i` sees new row `j` iff `visible[i * rows + j]` (a draft tree: each node sees its ancestors and
    /// itself). Row-major `rows × rows`.
    Tree(Vec<bool>),
}

impl AttnMask {
    #[inline]
    pub fn sees(&self, rows: usize, i: usize, j: usize) -> bool {
        match self {
            AttnMask::Causal => j <= i,
            AttnMask::Tree(v) => v[i * rows + j],
        }
    }
}

/// A process-unique id for a set of device buffers (one scratch, one cache allocation). Replay keys include
/// it, so a recording is never replayed over buffers other than those it was made with.
pub fn buffer_set_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Geometry of one attention call; the per-call inputs (first new slot, mask) are in the step.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub rows: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// A local attention layer's window: a row at position `p` sees only keys at positions `p - window + 1..=p`
    /// (cache slot `j` holds position `j`). `None`: every key the mask allows.
    pub window: Option<usize>,
}

/// One row's draw ([`Backend::draw`]): the row, the race's settings and the absolute position of the token it
/// draws.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowDraw {
    pub row: usize,
    pub race: RaceSpec,
    pub position: usize,
}

/// The most rows a sequence may bring to [`Backend::attention_seqs`] (a decode step's or a verify's; a prompt's
/// chunk runs alone).
pub const SHARED_ATTENTION_ROWS: usize = 16;

/// One sequence of [`Backend::attention_seqs`]: its rows' place in the batch, its shape (`shape.rows` rows),
/// its cache layer, its attention scratch and its step.
pub struct SeqAttention<'a, B: Backend + ?Sized> {
    pub first_row: usize,
    pub shape: AttnShape,
    pub k_cache: &'a mut B::Buffer,
    pub v_cache: &'a mut B::Buffer,
    pub work: &'a mut B::Buffer,
    pub step: &'a B::Step,
}

/// A layer's per-head RMS norms of Q and K (Qwen3, Gemma 3), `head_dim` weights each, applied before the
/// rotation.
#[derive(Debug)]
pub struct HeadNorms<'a, T> {
    pub q: &'a T,
    pub k: &'a T,
    pub eps: f32,
}

impl<T> Clone for HeadNorms<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for HeadNorms<'_, T> {}

/// A model's rotary position embedding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub theta: f32,
    pub style: RopeStyle,
    pub scaling: RopeScaling,
    /// The values of each head it rotates, from the first (`None`: all of them); the rest pass unrotated.
    pub dims: Option<usize>,
    /// Multimodal rotary positions (Qwen2.5-VL's M-RoPE): the first `mrope[0]` pairs turn with a row's temporal
    /// position, the next `mrope[1]` with its height position, the last `mrope[2]` with its width position. A
    /// text row's three positions are equal, so it turns as with one position.
    pub mrope: Option<[usize; 3]>,
}

/// How a model stretches its rotations beyond the context it was trained on: each pair's frequency
/// `theta^(-2i/d)` divided by a factor (YaRN also scales the rotation, so attention scores grow by its square).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum RopeScaling {
    #[default]
    None,
    /// Every frequency divided by `factor` (positions scaled down).
    Linear { factor: f32 },
    /// Llama 3: frequencies whose wavelength exceeds `original_context / low_freq_factor` divided by `factor`,
    /// those shorter than `original_context / high_freq_factor` kept, a smooth blend between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_context: f32,
    },
    /// YaRN (Peng et al. 2023, as transformers, vLLM and llama.cpp compute it): pairs that turn more than
    /// `beta_fast` times over `original_context` positions kept, pairs that turn fewer than `beta_slow` times
    /// divided by `factor`, a linear ramp over the pair index between (its ends rounded outwards with
    /// `truncate`); every (cos, sin) multiplied by `attention_factor`.
    Yarn {
        factor: f32,
        original_context: f32,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: f32,
        truncate: bool,
    },
}

/// YaRN's default attention factor for a scaling `factor` (`mscale` 1): 0.1·ln(factor) + 1, or 1 where the
/// factor does not stretch.
pub fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

impl RopeScaling {
    /// YaRN with the settings transformers, vLLM and llama.cpp default to: betas 32 and 1, the ramp's ends
    /// rounded outwards, the attention factor [`yarn_mscale`]`(factor, 1)`.
    pub fn yarn(factor: f32, original_context: f32) -> RopeScaling {
        RopeScaling::Yarn {
            factor,
            original_context,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: yarn_mscale(factor as f64, 1.0) as f32,
            truncate: true,
        }
    }

    /// What pair `i`'s frequency `theta^(-2i/rotated)` is divided by (`rotated`: the values of a head it
    /// rotates).
    pub fn divisor(&self, theta: f32, i: usize, rotated: usize) -> f64 {
        let inv_freq = (theta as f64).powf(-2.0 * i as f64 / rotated as f64);
        match *self {
            RopeScaling::None => 1.0,
            RopeScaling::Linear { factor } => factor as f64,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => {
                let (factor, low, high, ctx) = (
                    factor as f64,
                    low_freq_factor as f64,
                    high_freq_factor as f64,
                    original_context as f64,
                );
                let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
                if wavelen < ctx / high {
                    1.0
                } else if wavelen > ctx / low {
                    factor
                } else {
                    let smooth = (ctx / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                }
            }
            RopeScaling::Yarn {
                factor,
                original_context,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                // The pair index at which a pair turns `turns` times over the original context.
                let (dim, base) = (rotated as f64, theta as f64);
                let at = |turns: f32| {
                    dim * (original_context as f64 / (turns as f64 * 2.0 * std::f64::consts::PI))
                        .ln()
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (at(beta_fast), at(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                // 1 where the pair keeps its frequency, 0 where it is divided by `factor`.
                let kept = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                1.0 / ((1.0 - kept) / factor as f64 + kept)
            }
        }
    }

    /// What every (cos, sin) of the rotation is multiplied by (YaRN's attention factor; else 1).
    pub fn magnitude(&self) -> f32 {
        match *self {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor,
            _ => 1.0,
        }
    }
}

impl Rope {
    /// The values of a `head_dim`-wide head it rotates.
    pub fn rotated(&self, head_dim: usize) -> usize {
        self.dims.unwrap_or(head_dim)
    }

    /// The rotation `(cos, sin)` of pair `i` of the `rotated` values of a head at `pos`, for `i < rotated / 2`.
    /// Every backend uses it: the angle is computed in f64 and rounded once, so it is as accurate as f32 allows
    /// and the same for a position in any batch.
    pub fn angle(&self, pos: usize, i: usize, rotated: usize) -> (f32, f32) {
        self.angle_at([pos; 3], i, rotated)
    }

    /// [`Rope::angle`] of pair `i` for a row at the temporal, height and width positions `pos` (all three are
    /// one position unless the rotation is multimodal).
    pub fn angle_at(&self, pos: [usize; 3], i: usize, rotated: usize) -> (f32, f32) {
        let pos = pos[self.section(i)];
        let inv_freq = (self.theta as f64).powf(-2.0 * i as f64 / rotated as f64);
        let a = pos as f64 * inv_freq / self.scaling.divisor(self.theta, i, rotated);
        let m = self.scaling.magnitude() as f64;
        ((m * a.cos()) as f32, (m * a.sin()) as f32)
    }

    /// Which of a row's temporal, height and width positions (0, 1, 2) pair `i` turns with: the temporal one
    /// unless the rotation is multimodal.
    pub fn section(&self, i: usize) -> usize {
        match self.mrope {
            Some([t, h, _]) => usize::from(i >= t) + usize::from(i >= t + h),
            None => 0,
        }
    }

    /// A key that tells rotations apart (their tables of angles differ).
    pub fn key(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.theta.to_bits().hash(&mut h);
        (self.style == RopeStyle::Interleaved).hash(&mut h);
        self.dims.hash(&mut h);
        self.mrope.hash(&mut h);
        match self.scaling {
            RopeScaling::None => 0u8.hash(&mut h),
            RopeScaling::Linear { factor } => (1u8, factor.to_bits()).hash(&mut h),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => (
                2u8,
                factor.to_bits(),
                low_freq_factor.to_bits(),
                high_freq_factor.to_bits(),
                original_context.to_bits(),
            )
                .hash(&mut h),
            RopeScaling::Yarn {
                factor,
                original_context,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => (
                3u8,
                [
                    factor,
                    original_context,
                    beta_fast,
                    beta_slow,
                    attention_factor,
                ]
                .map(f32::to_bits),
                truncate,
            )
                .hash(&mut h),
        }
        h.finish()
    }
}

/// One forward's per-call inputs.
#[derive(Debug, Clone, Copy)]
pub struct StepInputs<'a> {
    pub tokens: &'a [u32],
    /// Absolute position of each row (RoPE).
    pub positions: &'a [usize],
    /// Multimodal rotary positions ([`Rope::mrope`]): each row's height and width positions beside its
    /// (temporal) position, for a forward holding an image's rows; empty where every row's three positions are
    /// its position.
    pub spatial: &'a [[usize; 2]],
    /// Cache slots committed before this forward; its rows' K/V go to slots `base..base + rows`.
    pub base: usize,
    pub mask: &'a AttnMask,
}

/// Rows per prefill forward unless a backend runs another count best ([`Backend::prefill_rows`]).
pub const PREFILL_ROWS: usize = 64;

/// A device that runs decoder forwards.
///
/// A forward writes its per-call inputs once with [`Backend::set_step`]; every operation reads them from the
/// step, never from host arguments, so the same operations on the same buffers can be recorded once and replayed
/// with new inputs ([`Backend::replay_or_record`]: CUDA graphs on the GPU).
pub trait Backend: Send + Sync + 'static {
    /// An activation buffer (f32).
    type Buffer: Send;
    /// A weight matrix resident on the device, in its stored format.
    type Matrix: Send + Sync;
    /// One forward's inputs, resident on the device ([`StepInputs`]).
    type Step: Send;

    fn name(&self) -> String;
    /// Every choice of this backend that changes a bit of a forward's results (the instruction set where the
    /// paths differ in bits, the activation precision, the kernels' compiler and options), and none that only
    /// changes speed. Results computed under one string may be reused under the same string only: the prefix
    /// cache's disk tier keeps a folder per model and numerics.
    fn numerics(&self) -> String;

    fn load_matrix(&self, m: QMatrix) -> Result<Self::Matrix>;
    /// A matrix only ever read a row at a time (an embedding table that is not also the output layer): a
    /// backend may keep it as stored instead of in its projection layout.
    fn load_table(&self, m: QMatrix) -> Result<Self::Matrix> {
        self.load_matrix(m)
    }
    /// Bytes the matrix occupies on the device.
    fn matrix_bytes(&self, m: &Self::Matrix) -> usize;
    fn buffer(&self, len: usize) -> Self::Buffer;
    fn upload(&self, data: &[f32]) -> Self::Buffer;
    /// Copy `data` into the start of an existing buffer (no allocation: for per-step inputs).
    fn write(&self, buf: &mut Self::Buffer, data: &[f32]);
    fn download(&self, buf: &Self::Buffer, len: usize) -> Vec<f32>;

    /// A step holding the inputs of forwards of up to `max_rows` rows.
    fn step(&self, max_rows: usize) -> Self::Step;
    /// Write one forward's inputs into `step` (`inputs.tokens.len()` ≤ the step's `max_rows`).
    fn set_step(&self, step: &mut Self::Step, inputs: StepInputs);
    /// Run `work` (one forward's device operations, reading their inputs from a step), or replay what an
    /// earlier call with the same `key` recorded. The caller guarantees that one key always means the same
    /// operations on the same buffers. Backends without recording just run `work`.
    fn replay_or_record(&self, key: u64, work: &mut dyn FnMut()) {
        let _ = key;
        work()
    }

    /// `out[r] = table[step.tokens[r]]` for each of `rows` rows.
    fn embed(&self, table: &Self::Matrix, step: &Self::Step, rows: usize, out: &mut Self::Buffer);
    /// `out[r, n] = Σ_k x[r, k] · w[n, k]` for `rows` rows.
    fn matmul(&self, w: &Self::Matrix, x: &Self::Buffer, rows: usize, out: &mut Self::Buffer);
    /// `out[r, n] = Σ_k x[r, k] · w[n, k]` for an encoder's `rows` rows at once (the vision towers'): the same
    /// call always gives the same bits, but a row's may depend on how many rows share the call, so a device may
    /// run a blocked GEMM. The decoder's forwards use [`Backend::matmul`], whose rows are exact; by default this
    /// is that.
    fn encoder_matmul(
        &self,
        w: &Self::Matrix,
        x: &Self::Buffer,
        rows: usize,
        out: &mut Self::Buffer,
    ) {
        self.matmul(w, x, rows, out)
    }
    /// `out[r, n] += Σ_k x[r, k] · w[n, k]`: a projection added to the residual stream (the sum is formed
    /// first, exactly as `matmul` forms it, then added).
    fn matmul_add(&self, w: &Self::Matrix, x: &Self::Buffer, rows: usize, out: &mut Self::Buffer);
    /// Several projections of one input, in one pass where the device can: `outs[i].1 = outs[i].0 · x̂`, where
    /// x̂ is `x`, or with `norm = Some((weight, eps))` its RMS norm `x / sqrt(mean(x²) + eps) * weight` (fused
    /// into the projections where the device can).
    fn matmuls(
        &self,
        x: &Self::Buffer,
        norm: Option<(&Self::Buffer, f32)>,
        rows: usize,
        outs: &mut [(&Self::Matrix, &mut Self::Buffer)],
    );
    /// The first half of a gated MLP: `out = act(gate · x̂) ⊙ (up · x̂)`, with x̂ as in [`Backend::matmuls`].
    #[allow(clippy::too_many_arguments)]
    fn glu_matmul(
        &self,
        x: &Self::Buffer,
        norm: Option<(&Self::Buffer, f32)>,
        rows: usize,
        gate: &Self::Matrix,
        up: &Self::Matrix,
        act: Glu,
        out: &mut Self::Buffer,
    );
    /// `x[..len] *= s`.
    fn scale(&self, x: &mut Self::Buffer, len: usize, s: f32);
    /// `out += rms_norm(x) · w` for `rows` rows of `dim` values: a normed block output added to the residual
    /// stream (the norm formed exactly as [`Backend::rms_norm`] forms it, then added). `next`: the input norm
    /// (weights, eps) through which the next launch projects these rows of `out` ([`Backend::matmuls`] or
    /// [`Backend::glu_matmul`] with that norm), where known: a device that prepares a projection's input in a
    /// launch of its own prepares it here, and the projection skips that launch. The same bits either way.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_add(
        &self,
        x: &Self::Buffer,
        w: &Self::Buffer,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buffer,
        next: Option<(&Self::Buffer, f32)>,
    );
    /// `x[r, :] += bias` for `rows` rows.
    fn add_bias(&self, x: &mut Self::Buffer, bias: &Self::Buffer, rows: usize, dim: usize);
    /// RMS norm of each `dim`-long row: `out = x / sqrt(mean(x²) + eps) * w`.
    fn rms_norm(
        &self,
        x: &Self::Buffer,
        w: &Self::Buffer,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buffer,
    );
    /// Rotate each head of `q` (in place) and of `k` by its row's position, and write the rotated `k` and `v`
    /// into the cache slots `step.base..` (`k` is scratch afterwards). With `norms`, each Q and K head is first
    /// RMS-normed, exactly as [`Backend::rms_norm`] norms a `head_dim`-long row (`q` keeps the normed values
    /// past the rotated ones). A cache buffer of `s` slots is a ring: slot `j` is stored at `j mod s` (a local
    /// layer's cache holds its window, not the whole context).
    #[allow(clippy::too_many_arguments)]
    fn rope_and_cache(
        &self,
        q: &mut Self::Buffer,
        k: &mut Self::Buffer,
        v: &Self::Buffer,
        k_cache: &mut Self::Buffer,
        v_cache: &mut Self::Buffer,
        shape: AttnShape,
        rope: Rope,
        norms: Option<HeadNorms<'_, Self::Buffer>>,
        step: &Self::Step,
    );
    /// [`Backend::matmuls`] of the Q, K and V projections of x̂, then [`Backend::rope_and_cache`]: one launch
    /// where the device can fuse them. Afterwards `q` is rotated, the cache slots `step.base..` hold the rotated
    /// K and the V, and `k` and `v` are scratch.
    #[allow(clippy::too_many_arguments)]
    fn qkv_rope_and_cache(
        &self,
        x: &Self::Buffer,
        norm: Option<(&Self::Buffer, f32)>,
        [wq, wk, wv]: [&Self::Matrix; 3],
        [q, k, v]: [&mut Self::Buffer; 3],
        [k_cache, v_cache]: [&mut Self::Buffer; 2],
        shape: AttnShape,
        rope: Rope,
        step: &Self::Step,
    ) {
        self.matmuls(
            x,
            norm,
            shape.rows,
            &mut [(wq, &mut *q), (wk, &mut *k), (wv, &mut *v)],
        );
        self.rope_and_cache(q, k, v, k_cache, v_cache, shape, rope, None, step);
    }
    /// Called when a model loads, before its first step is made: an error if this backend's attention cannot
    /// run heads of `head_dim` values (so an unsupported model is refused up front instead of failing inside a
    /// kernel); a backend may prepare what [`Backend::rope_and_cache`] needs for this rotation.
    fn prepare_attention(&self, head_dim: usize, rope: Rope) -> Result<()> {
        let _ = (head_dim, rope);
        Ok(())
    }
    /// What the length of an f32 matrix's rows (and so of its input rows) must be a multiple of on this
    /// backend; a caller with other lengths pads both with zeros (the vision towers do).
    fn f32_row_multiple(&self) -> usize {
        1
    }
    /// Rows per prefill forward: a prompt is computed in chunks of this many (no result depends on it: a
    /// forward's rows are row-exact), large enough to amortize each weight read, small enough to bound scratch.
    fn prefill_rows(&self) -> usize {
        PREFILL_ROWS
    }
    /// Values of scratch [`Backend::attention`] needs over a cache of `capacity` slots; the cache owns it, so it
    /// is reallocated with the cache's buffers.
    fn attention_work_len(&self, n_heads: usize, head_dim: usize, capacity: usize) -> usize {
        let _ = (n_heads, head_dim, capacity);
        0
    }
    /// Scaled-dot-product attention of the batch's queries over the cache (committed slots plus the batch, as
    /// the step's mask and the shape's window allow; slot `j` at `j mod` the buffer's slots), with the cache's
    /// scratch `work`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Buffer,
        k_cache: &Self::Buffer,
        v_cache: &Self::Buffer,
        work: &mut Self::Buffer,
        shape: AttnShape,
        step: &Self::Step,
        out: &mut Self::Buffer,
    );
    /// [`Backend::rope_and_cache`] then [`Backend::attention`] for several sequences at once: sequence `i`'s
    /// rows lie from row `seqs[i].first_row` on in `q`, `k` and `v` (rows of `n_heads * head_dim` and
    /// `n_kv_heads * head_dim` values) and its attention output goes to the same rows of `out`; each runs over
    /// its own cache with its own step, every value bitwise what its own two calls give. Returns `false`,
    /// having done nothing, where this backend runs sequences one at a time (the caller then does): a device
    /// shares launches among them, which a host does not need.
    #[allow(clippy::too_many_arguments)]
    fn attention_seqs(
        &self,
        _q: &mut Self::Buffer,
        _k: &mut Self::Buffer,
        _v: &Self::Buffer,
        _out: &mut Self::Buffer,
        _rope: Rope,
        _norms: Option<HeadNorms<'_, Self::Buffer>>,
        _seqs: &mut [SeqAttention<'_, Self>],
    ) -> bool {
        false
    }
    /// Each of `rows` rows' greedy token: `out[r]` = the index of the largest of `x[r * n..(r + 1) * n]`, chosen
    /// as [`crate::sample::argmax`] chooses it, as an exact f32 (indices stay below 2^24). A greedy verify then
    /// copies `rows` values to the host instead of `rows × vocab` logits.
    fn argmax(&self, x: &Self::Buffer, rows: usize, n: usize, out: &mut Self::Buffer);
    /// Each draw's token: drawn by its race from its row's logits `x[row * n..(row + 1) * n]`, bitwise what
    /// [`RaceSpec::draw`] draws from them. A device that draws where the logits are lets a sampled verify copy a
    /// value per row to the host instead of a vocabulary; by default the logits come to the host and are drawn
    /// there, the rows' races side by side on the host's cores (a race reads its whole row: 0.26 ms for
    /// SmolLM2's 49,152 logits, so 16 sequences' draws one after another would cost a GPU step several times).
    fn draw(&self, x: &Self::Buffer, n: usize, draws: &[RowDraw]) -> Vec<u32> {
        let rows = draws.iter().map(|d| d.row + 1).max().unwrap_or(0);
        let logits = self.download(x, rows * n);
        let race = |d: &RowDraw| d.race.draw(&logits[d.row * n..(d.row + 1) * n], d.position);
        if draws.len() == 1 {
            return vec![race(&draws[0])];
        }
        draws.par_iter().map(race).collect()
    }
    /// A greedy draft picked where the argmax lies: the token `table[src[0]]` (`src[0]` an argmax index as an
    /// exact f32; `table` a draft vocabulary's token ids as exact f32s, or `None` where the index is the token)
    /// goes to `log[at]` and, with `step`, becomes the step's first token — the next draft step's input, chosen
    /// without a round trip to the host.
    fn draft_token(
        &self,
        src: &Self::Buffer,
        table: Option<&Self::Buffer>,
        log: &mut Self::Buffer,
        at: usize,
        step: Option<&mut Self::Step>,
    );
    /// Copy `len` values from `src[src_off..]` to `dst[dst_off..]`.
    fn copy(
        &self,
        src: &Self::Buffer,
        src_off: usize,
        dst: &mut Self::Buffer,
        dst_off: usize,
        len: usize,
    );
    /// Copy `len` values within `buf` from `src_off..` to a disjoint `dst_off..`: a draft tree's accepted path
    /// moved down over the rejected slots (in a ring of slots, possibly to a higher offset).
    fn copy_within(&self, buf: &mut Self::Buffer, src_off: usize, dst_off: usize, len: usize);

    /// The first device error since the last call, if any. Operations cannot fail one by one (a forward is a
    /// few hundred of them, recorded and replayed as a whole); a backend whose device can fail keeps the error,
    /// skips the work after it, and the model returns it as the forward's error.
    fn take_fault(&self) -> Option<String> {
        None
    }
}
