//! Quantized matrix × activation-rows product on the CPU.
//!
//! With 8-bit activations the GGML block formats (legacy and K-quants) run the integer kernels of
//! [`super::qmatmul`], as do MLX affine and the IQ4 grid formats; float weights (F16/BF16/F32) and MLX with f32
//! scales run here with f32 activations. Row-exact by construction: weight row `n` is decoded once per call, and
//! output `(r, n)` is the dot product of that decoded row with activation row `r`, computed by the instruction
//! set's single dot routine (fixed lanes, fixed final reduction). The number of rows only changes how many rows
//! share one decoded weight row, never the operations on a row. Work is split across threads by output columns,
//! so the thread count does not change any result either.

use super::packed::Packed;
use super::pool::{share, Pool, SharedOut};
use super::qmatmul;
use super::simd::{self, Isa};
use crate::backend::Glu;
use crate::quant::{QMatrix, RowDecoder};

/// The precision of activations in the product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    /// f32 activations against decoded weights: the accurate reference path.
    F32,
    /// 8-bit activations with integer block dots for the GGML block formats (Q4_0 … Q6_K, IQ4_NL, IQ4_XS) and
    /// MLX affine (llama.cpp's numerics); float weights use the f32 path.
    Q8,
}

/// A weight matrix on the CPU: as stored (memory-mapped; the f32 path and embedding lookups read it) and, for
/// the formats with integer kernels when activations are 8-bit, the interleaved copy those kernels read.
pub struct CpuMatrix {
    pub stored: QMatrix,
    packed: Option<Packed>,
}

impl CpuMatrix {
    pub fn new(stored: QMatrix, acts: Activations) -> Self {
        let packed = match acts {
            Activations::Q8 => Packed::new(&stored),
            Activations::F32 => None,
        };
        CpuMatrix { stored, packed }
    }
}

/// Several products of one input (`outs[i].1 = outs[i].0 · x`): one pool dispatch when the 8-bit path runs
/// them all, else one [`matmul`] each. Each output gets what `matmul` alone would give it.
pub fn matmuls<O: AsMut<[f32]>>(pool: &Pool, x: &[f32], rows: usize, outs: &mut [(&CpuMatrix, O)]) {
    if outs.iter().all(|(w, _)| w.packed.is_some()) {
        for chunk in outs.chunks_mut(qmatmul::MAX_MATS) {
            let n = chunk.len();
            let mut it = chunk
                .iter_mut()
                .map(|(w, o)| (w.packed.as_ref().expect("checked above"), o.as_mut()));
            let mut next = || it.next().expect("n matrices");
            match n {
                1 => qmatmul::matmuls(pool, x, rows, &mut [next()]),
                2 => qmatmul::matmuls(pool, x, rows, &mut [next(), next()]),
                _ => qmatmul::matmuls(pool, x, rows, &mut [next(), next(), next()]),
            }
        }
        return;
    }
    for (w, out) in outs.iter_mut() {
        matmul(pool, w, x, rows, out.as_mut());
    }
}

/// `out = act(gate · x) ⊙ (up · x)` in one pool pass when both run the 8-bit path (see [`qmatmul::glu`]);
/// `false` (nothing written) otherwise.
pub fn glu_packed(
    pool: &Pool,
    x: &[f32],
    rows: usize,
    gate: &CpuMatrix,
    up: &CpuMatrix,
    act: Glu,
    out: &mut [f32],
) -> bool {
    match (&gate.packed, &up.packed) {
        (Some(g), Some(u)) => {
            qmatmul::glu(pool, x, rows, g, u, act, out);
            true
        }
        _ => false,
    }
}

/// `out[r * w.rows + n] = Σ_k x[r * w.cols + k] · w[n, k]` for `r < rows`.
pub fn matmul(pool: &Pool, w: &CpuMatrix, x: &[f32], rows: usize, out: &mut [f32]) {
    if let Some(p) = &w.packed {
        return qmatmul::matmul(pool, p, x, rows, out);
    }
    let w = &w.stored;
    let (n_out, k) = (w.rows, w.cols);
    assert!(x.len() >= rows * k && out.len() >= rows * n_out);
    let dec = w.decoder();
    let bl = w.block_len();
    let out_ptr = SharedOut::new(out);
    let isa = simd::isa();
    pool.run(&|t| {
        let cols = share(n_out, pool.threads(), t, 4);
        let out = &out_ptr;
        let (n0, n1) = (cols.start, cols.end);
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: Avx2 is only reported after runtime detection.
            Isa::Avx2 => unsafe { tile_avx2(&dec, n0, n1, n_out, k, bl, x, rows, out.at(0)) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: NEON is architectural on aarch64.
            Isa::Neon => unsafe { tile_neon(&dec, n0, n1, n_out, k, bl, x, rows, out.at(0)) },
            _ => tile_scalar(&dec, n0, n1, n_out, k, bl, x, rows, out.at(0)),
        }
    });
}

/// The loop shared by every instruction set: decode weight row `n` once into a buffer (it stays in L1/L2), then
/// take its dot product with every activation row using the instruction set's one dot routine.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile(
    decode: impl Fn(&RowDecoder, usize, usize, &mut [f32]),
    dot: impl Fn(&[f32], &[f32]) -> f32,
    dec: &RowDecoder,
    n0: usize,
    n1: usize,
    n_out: usize,
    k: usize,
    bl: usize,
    x: &[f32],
    rows: usize,
    out: *mut f32,
) {
    WROW.with(|w| {
        let mut w = w.borrow_mut();
        if w.len() < k {
            w.resize(k, 0.0);
        }
        let wrow = &mut w[..k];
        for n in n0..n1 {
            for (b, chunk) in wrow.chunks_mut(bl).enumerate() {
                decode(dec, n, b, chunk);
            }
            for r in 0..rows {
                // SAFETY: r < rows and n < n_out; columns n0..n1 belong to this task alone.
                *out.add(r * n_out + n) = dot(wrow, &x[r * k..(r + 1) * k]);
            }
        }
    })
}

thread_local! {
    /// One decoded weight row per worker thread, grown to the widest matrix once.
    static WROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[allow(clippy::too_many_arguments)]
fn tile_scalar(
    dec: &RowDecoder,
    n0: usize,
    n1: usize,
    n_out: usize,
    k: usize,
    bl: usize,
    x: &[f32],
    rows: usize,
    out: *mut f32,
) {
    // SAFETY: the portable path needs no special instructions; `out` is valid as `tile` requires.
    unsafe {
        tile(
            |d, r, b, o| d.decode(r, b, o),
            simd::dot_scalar,
            dec,
            n0,
            n1,
            n_out,
            k,
            bl,
            x,
            rows,
            out,
        )
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2(
    dec: &RowDecoder,
    n0: usize,
    n1: usize,
    n_out: usize,
    k: usize,
    bl: usize,
    x: &[f32],
    rows: usize,
    out: *mut f32,
) {
    tile(
        |d, r, b, o| super::decode_x86::decode(d, r, b, o),
        |a, b| simd::dot_avx2(a, b),
        dec,
        n0,
        n1,
        n_out,
        k,
        bl,
        x,
        rows,
        out,
    )
}

#[cfg(target_arch = "aarch64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon")]
unsafe fn tile_neon(
    dec: &RowDecoder,
    n0: usize,
    n1: usize,
    n_out: usize,
    k: usize,
    bl: usize,
    x: &[f32],
    rows: usize,
    out: *mut f32,
) {
    tile(
        |d, r, b, o| d.decode(r, b, o),
        |a, b| simd::dot_neon(a, b),
        dec,
        n0,
        n1,
        n_out,
        k,
        bl,
        x,
        rows,
        out,
    )
}
