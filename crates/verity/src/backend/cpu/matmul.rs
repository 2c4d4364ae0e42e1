//! Quantized matrix × activation-rows product on the CPU.
//!
//! Row-exact by construction: for output `n` of row `r`, the kernel sums, block by block in order, the dot
//! product of the decoded weight block with row `r`'s slice, each block's dot computed by the same SIMD routine.
//! The number of rows only changes how many rows share one decoded block, never the operations on a row. Work is
//! split across threads by output columns, so the thread count does not change any result either.

use rayon::prelude::*;

use super::simd::{self, Isa};
use crate::quant::{QMatrix, RowDecoder};

/// Rows that share one decoded weight block (bounded so the partial sums stay in registers/L1).
const ROW_TILE: usize = 16;
/// Largest block of any format (K-quants: 256; MLX groups: 128).
const MAX_BLOCK: usize = 256;

struct OutPtr(*mut f32);
// SAFETY: each task writes a disjoint set of output columns.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out[r * w.rows + n] = Σ_k x[r * w.cols + k] · w[n, k]` for `r < rows`.
pub fn matmul(pool: &rayon::ThreadPool, w: &QMatrix, x: &[f32], rows: usize, out: &mut [f32]) {
    let (n_out, k) = (w.rows, w.cols);
    assert!(x.len() >= rows * k && out.len() >= rows * n_out);
    let dec = w.decoder();
    let bl = w.block_len();
    assert!(bl <= MAX_BLOCK);
    let threads = pool.current_num_threads().max(1);
    // Enough chunks to balance the threads, few enough that per-chunk overhead stays small.
    let chunk = n_out.div_ceil(threads * 8).clamp(1, 256);
    let out_ptr = OutPtr(out.as_mut_ptr());
    let isa = simd::isa();
    pool.install(|| {
        (0..n_out.div_ceil(chunk)).into_par_iter().for_each(|c| {
            let n0 = c * chunk;
            let n1 = (n0 + chunk).min(n_out);
            let out = &out_ptr;
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: Avx2 is only reported after runtime detection.
                Isa::Avx2 => unsafe { tile_avx2(&dec, n0, n1, n_out, k, bl, x, rows, out.0) },
                #[cfg(target_arch = "aarch64")]
                // SAFETY: NEON is architectural on aarch64.
                Isa::Neon => unsafe { tile_neon(&dec, n0, n1, n_out, k, bl, x, rows, out.0) },
                _ => tile(&dec, n0, n1, n_out, k, bl, x, rows, out.0, simd::dot_scalar),
            }
        })
    });
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
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
    // SAFETY (closure): the caller guarantees AVX2/FMA.
    tile(dec, n0, n1, n_out, k, bl, x, rows, out, |a, b| unsafe { simd::dot_avx2(a, b) })
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
    tile(dec, n0, n1, n_out, k, bl, x, rows, out, |a, b| unsafe { simd::dot_neon(a, b) })
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tile(
    dec: &RowDecoder,
    n0: usize,
    n1: usize,
    n_out: usize,
    k: usize,
    bl: usize,
    x: &[f32],
    rows: usize,
    out: *mut f32,
    dot: impl Fn(&[f32], &[f32]) -> f32,
) {
    let mut wbuf = [0f32; MAX_BLOCK];
    let mut acc = [0f32; ROW_TILE];
    let n_blocks = k.div_ceil(bl);
    for n in n0..n1 {
        let mut r0 = 0;
        while r0 < rows {
            let rt = ROW_TILE.min(rows - r0);
            acc[..rt].fill(0.0);
            for b in 0..n_blocks {
                let start = b * bl;
                let len = bl.min(k - start);
                let wb = &mut wbuf[..len];
                dec.decode(n, b, wb);
                for (r, a) in acc[..rt].iter_mut().enumerate() {
                    let xr = &x[(r0 + r) * k + start..(r0 + r) * k + start + len];
                    *a += dot(wb, xr);
                }
            }
            for (r, &a) in acc[..rt].iter().enumerate() {
                // SAFETY: (r0 + r) < rows and n < n_out; columns n0..n1 belong to this task alone.
                unsafe { *out.add((r0 + r) * n_out + n) = a };
            }
            r0 += rt;
        }
    }
}
