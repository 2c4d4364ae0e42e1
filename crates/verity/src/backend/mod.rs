//! The compute backend: the small set of operations a decoder forward is made of, implemented once per device.
//!
//! The model code is written against [`Backend`] only; a CPU backend lives in [`cpu`], and CUDA/Metal backends
//! implement the same trait. Every operation works on `rows` activation rows at once, and each output row must
//! depend only on its own input row (plus the KV cache for attention) through a fixed sequence of operations:
//! that is what makes a W-row verify forward row-exact against the 1-row decode step.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::error::Result;
use crate::model::hparams::RopeStyle;
use crate::quant::QMatrix;

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

/// The RoPE rotation `(cos, sin)` of pair `i` of a `head_dim`-wide head at `pos`, for `i < head_dim / 2`. Every
/// backend uses it: the angle is computed in f64 and rounded once, so it is as accurate as f32 allows and the
/// same for a position in any batch.
pub fn rope_angle(pos: usize, i: usize, head_dim: usize, theta: f32) -> (f32, f32) {
    let inv_freq = (theta as f64).powf(-2.0 * i as f64 / head_dim as f64);
    let a = pos as f64 * inv_freq;
    (a.cos() as f32, a.sin() as f32)
}

/// Shapes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub rows: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Cache slots committed before this batch; the batch's K/V sit in slots `base..base + rows`.
    pub base: usize,
    pub scale: f32,
}

/// A device that runs decoder forwards.
pub trait Backend: Send + Sync + 'static {
    /// An activation buffer (f32).
    type Buffer: Send;
    /// A weight matrix resident on the device, in its stored format.
    type Matrix: Send + Sync;

    fn name(&self) -> String;

    /// The most cache slots one attention call can cover on this device; caches are capped to it, so a longer
    /// context is refused up front (a clear "context full") rather than failing inside a kernel.
    fn max_attention_slots(&self) -> usize {
        usize::MAX
    }

    fn load_matrix(&self, m: QMatrix) -> Result<Self::Matrix>;
    /// Bytes the matrix occupies on the device.
    fn matrix_bytes(&self, m: &Self::Matrix) -> usize;
    fn buffer(&self, len: usize) -> Self::Buffer;
    fn upload(&self, data: &[f32]) -> Self::Buffer;
    /// Copy `data` into the start of an existing buffer (no allocation: for per-step inputs).
    fn write(&self, buf: &mut Self::Buffer, data: &[f32]);
    fn download(&self, buf: &Self::Buffer, len: usize) -> Vec<f32>;

    /// `out[r] = table[tokens[r]]` for each row.
    fn embed(&self, table: &Self::Matrix, tokens: &[u32], out: &mut Self::Buffer);
    /// `out[r, n] = Σ_k x[r, k] · w[n, k]` for `rows` rows.
    fn matmul(&self, w: &Self::Matrix, x: &Self::Buffer, rows: usize, out: &mut Self::Buffer);
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
    /// Rotate each head of each row by its row's position.
    fn rope(
        &self,
        x: &mut Self::Buffer,
        positions: &[usize],
        n_heads: usize,
        head_dim: usize,
        theta: f32,
        style: RopeStyle,
    );
    /// Write `rows` rows of K (or V) into cache slots starting at `slot`.
    fn kv_write(
        &self,
        cache: &mut Self::Buffer,
        src: &Self::Buffer,
        slot: usize,
        rows: usize,
        kv_dim: usize,
    );
    /// Scaled-dot-product attention of the batch's queries over the cache (committed slots plus the batch).
    fn attention(
        &self,
        q: &Self::Buffer,
        k_cache: &Self::Buffer,
        v_cache: &Self::Buffer,
        shape: AttnShape,
        mask: &AttnMask,
        out: &mut Self::Buffer,
    );
    /// `out = silu(gate) * up`, elementwise over `len` values.
    fn swiglu(&self, gate: &Self::Buffer, up: &Self::Buffer, len: usize, out: &mut Self::Buffer);
    /// `x += y` over `len` values.
    fn add_assign(&self, x: &mut Self::Buffer, y: &Self::Buffer, len: usize);
    /// Copy `len` values from `src[src_off..]` to `dst[dst_off..]`.
    fn copy(
        &self,
        src: &Self::Buffer,
        src_off: usize,
        dst: &mut Self::Buffer,
        dst_off: usize,
        len: usize,
    );
}
