//! Quantized matrix × activation-rows product on the CPU.
//!
//! With 8-bit activations the GGML block formats (legacy and K-quants) run the integer kernels of
//! [`super::qmatmul`], as do MLX affine and the IQ4 grid formats; float weights (F16/BF16/F32) and MLX with f32
//! scales run here with f32 activations. Row-exact by construction: weight row `n` is decoded once per call, and
//! output `(r, n)` is the dot product of that decoded row with activation row `r`, with the instruction set's
//! dot arithmetic (fixed lanes, fixed final reduction; where two rows of each side are taken at once, each pair
//! still has its own accumulators and order). The number of rows only changes how many rows share one decoded
//! weight row, never the operations on a row. Work is split across threads by output columns, so the thread
//! count does not change any result either.

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

/// [`crate::backend::Backend::encoder_matmul`]: float weights (an encoder's) through the `gemm` crate's blocked
/// f32 GEMM, several times the dot routine's speed over thousands of rows; its bits depend on the blocking, so
/// never on the decoder's path. The weights are decoded to f32 for the call (a few per cent of its time). Other
/// formats take [`matmul`].
pub fn encoder_matmul(pool: &Pool, w: &CpuMatrix, x: &[f32], rows: usize, out: &mut [f32]) {
    if w.packed.is_some() {
        return matmul(pool, w, x, rows, out);
    }
    let w = &w.stored;
    let (n_out, k) = (w.rows, w.cols);
    assert!(x.len() >= rows * k && out.len() >= rows * n_out);
    let mut weights = vec![0f32; n_out * k];
    let dec = w.decoder();
    let bl = w.block_len();
    let dst = SharedOut::new(&mut weights);
    pool.run(&|t| {
        for n in share(n_out, pool.threads(), t, 1) {
            // SAFETY: row n of the decoded weights belongs to this task.
            let row = unsafe { std::slice::from_raw_parts_mut(dst.at(n * k), k) };
            for (b, block) in row.chunks_mut(bl).enumerate() {
                dec.decode(n, b, block);
            }
        }
    });
    // SAFETY: `out` holds rows × n_out values (row stride n_out), `x` rows × k (stride k), `weights` n_out × k
    // (stride k, read transposed); none overlaps another.
    unsafe {
        gemm::gemm(
            rows,
            n_out,
            k,
            out.as_mut_ptr(),
            1,
            n_out as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            weights.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(pool.threads()),
        );
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
        let task = Task {
            dec: &dec,
            n0: cols.start,
            n1: cols.end,
            n_out,
            k,
            bl,
            x,
            rows,
            out: out_ptr.at(0),
        };
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: Avx2 and AVX-512VL are only used after runtime detection.
            Isa::Avx2 if has_avx512vl() => unsafe { tile_avx512(&task) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: Avx2 is only reported after runtime detection.
            Isa::Avx2 => unsafe { tile_avx2(&task) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: NEON is architectural on aarch64.
            Isa::Neon => unsafe { tile_neon(&task) },
            // SAFETY: the portable path needs no special instructions; `out` is valid as `tile` requires.
            _ => unsafe { tile_scalar(&task) },
        }
    });
}

/// One thread's share of an f32 product: weight rows `n0..n1` of `dec` (rows of `k` values, decoded `bl` at a
/// time) against activation rows `x` (`rows` of them), into `out` (`n_out` values per activation row).
struct Task<'a> {
    dec: &'a RowDecoder<'a>,
    n0: usize,
    n1: usize,
    n_out: usize,
    k: usize,
    bl: usize,
    x: &'a [f32],
    rows: usize,
    out: *mut f32,
}

/// The loop shared by every instruction set: decode the task's weight rows a chunk at a time into a buffer
/// (a chunk's rows stay in L2), then take each activation row's dot product with every row of the chunk using
/// the instruction set's one dot routine, so an activation row is read from memory once per chunk rather than
/// once per weight row: with thousands of rows (a vision tower's patches) that was the product's whole cost.
#[inline(always)]
unsafe fn tile(
    decode: impl Fn(&RowDecoder, usize, usize, &mut [f32]),
    dot: impl Fn(&[f32], &[f32]) -> f32,
    dots: impl Fn([&[f32]; 2], [&[f32]; 2]) -> [[f32; 2]; 2],
    task: &Task,
) {
    let &Task {
        dec,
        n0,
        n1,
        n_out,
        k,
        bl,
        x,
        rows,
        out,
    } = task;
    let chunk = chunk_rows(k, rows).min(n1.saturating_sub(n0)).max(1);
    WROW.with(|w| {
        let mut w = w.borrow_mut();
        if w.len() < chunk * k {
            w.resize(chunk * k, 0.0);
        }
        for c0 in (n0..n1).step_by(chunk) {
            let c1 = (c0 + chunk).min(n1);
            let decoded = &mut w[..(c1 - c0) * k];
            for (n, wrow) in (c0..c1).zip(decoded.chunks_mut(k)) {
                for (b, part) in wrow.chunks_mut(bl).enumerate() {
                    decode(dec, n, b, part);
                }
            }
            let wrow = |n: usize| &decoded[(n - c0) * k..(n - c0 + 1) * k];
            let xrow = |r: usize| &x[r * k..(r + 1) * k];
            // SAFETY (every write): r < rows and n < n_out; columns n0..n1 belong to this task alone.
            let mut r = 0;
            while r + 2 <= rows {
                let mut n = c0;
                while n + 2 <= c1 {
                    let d = dots([wrow(n), wrow(n + 1)], [xrow(r), xrow(r + 1)]);
                    for (c, dc) in d.iter().enumerate() {
                        *out.add(r * n_out + n + c) = dc[0];
                        *out.add((r + 1) * n_out + n + c) = dc[1];
                    }
                    n += 2;
                }
                if n < c1 {
                    *out.add(r * n_out + n) = dot(wrow(n), xrow(r));
                    *out.add((r + 1) * n_out + n) = dot(wrow(n), xrow(r + 1));
                }
                r += 2;
            }
            if r < rows {
                for n in c0..c1 {
                    *out.add(r * n_out + n) = dot(wrow(n), xrow(r));
                }
            }
        }
    })
}

/// Weight rows decoded per chunk for rows of `k` values and `rows` activation rows: one where there are few
/// activation rows (each is read once anyway), else as many as fill 256 KiB.
fn chunk_rows(k: usize, rows: usize) -> usize {
    if rows <= 4 {
        1
    } else {
        (256 * 1024 / (4 * k.max(1))).max(1)
    }
}

thread_local! {
    /// A chunk of decoded weight rows per worker thread, grown to the largest chunk once.
    static WROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `tile` for one instruction set: its features enabled (none for the portable path), its decoding, its dot
/// routine, and `$dots` for two weight rows against two activation rows.
macro_rules! isa_tile {
    ($(#[$attr:meta])* $name:ident, $decode:expr, $dot:expr, $dots:expr) => {
        $(#[$attr])*
        unsafe fn $name(task: &Task) {
            tile($decode, $dot, $dots, task)
        }
    };
}

isa_tile!(
    tile_scalar,
    |d, r, b, o| d.decode(r, b, o),
    simd::dot_scalar,
    |a: [&[f32]; 2], b: [&[f32]; 2]| a.map(|a| b.map(|b| simd::dot_scalar(a, b)))
);

isa_tile!(
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    tile_avx2,
    |d, r, b, o| super::decode_x86::decode(d, r, b, o),
    |a, b| simd::dot_avx2(a, b),
    |a: [&[f32]; 2], b: [&[f32]; 2]| a.map(|a| b.map(|b| simd::dot_avx2(a, b)))
);

isa_tile!(
    /// With AVX-512VL's 32 vector registers: two weight rows against two activation rows at a time
    /// (`simd::dots_avx2`, each product bitwise `dot_avx2`'s), so each load serves two products.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    tile_avx512,
    |d, r, b, o| super::decode_x86::decode(d, r, b, o),
    |a, b| simd::dot_avx2(a, b),
    |a, b| simd::dots_avx2::<2, 2>(a, b)
);

isa_tile!(
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    tile_neon,
    |d, r, b, o| d.decode(r, b, o),
    |a, b| simd::dot_neon(a, b),
    |a: [&[f32]; 2], b: [&[f32]; 2]| a.map(|a| b.map(|b| simd::dot_neon(a, b)))
);

/// Whether this CPU has AVX-512F and VL (for `tile_avx512`).
#[cfg(target_arch = "x86_64")]
fn has_avx512vl() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl"))
}

#[cfg(test)]
mod tests {

    /// The encoder's GEMM: within f32 rounding of the row-exact product, and the same bits whatever the
    /// thread count (an image's features must not change with `--threads`, or a restored turn with a cold one).
    #[test]
    fn encoder_products_are_the_products_and_ignore_the_thread_count() {
        use crate::backend::Backend;
        use crate::quant::GgmlType;
        use crate::storage::Bytes;
        let (n, k, rows) = (37, 96, 53);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919) % 997) as f32 / 997.0 - 0.5)
            .collect();
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 104_729) % 991) as f32 / 991.0 - 0.5)
            .collect();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let run = |threads: usize, encoder: bool| {
            let be = super::super::CpuBackend::new(threads).unwrap();
            let m = be
                .load_matrix(
                    QMatrix::ggml("w", GgmlType::F32, n, k, Bytes::owned(bytes.clone())).unwrap(),
                )
                .unwrap();
            let mut out = be.buffer(rows * n);
            if encoder {
                be.encoder_matmul(&m, &x, rows, &mut out);
            } else {
                be.matmul(&m, &x, rows, &mut out);
            }
            out
        };
        let (exact, one, two) = (run(2, false), run(1, true), run(2, true));
        assert!(one
            .iter()
            .zip(&two)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        for (a, b) in exact.iter().zip(&two) {
            assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{a} vs {b}");
        }
    }

    use super::*;
    use crate::quant::GgmlType;
    use crate::storage::Bytes;

    /// The f32 path's rows are bitwise their one-row products and the dot routine's own result, however many
    /// rows a call takes and however the weight rows fall into chunks (F16 and F32 weights; rows of 1,152
    /// values, a vision tower's width, give chunks of 56 rows; 2 threads split the columns).
    #[test]
    fn f32_products_of_many_rows_are_bitwise_their_one_row_products() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let (n, k, rows) = (131, 1152, 9);
        let x: Vec<f32> = (0..rows * k).map(|_| next()).collect();
        let values: Vec<f32> = (0..n * k).map(|_| next()).collect();
        let pool = Pool::new(2).unwrap();
        for ty in [GgmlType::F16, GgmlType::F32] {
            let bytes: Vec<u8> = match ty {
                GgmlType::F16 => values
                    .iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                    .collect(),
                _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            };
            let w = CpuMatrix::new(
                QMatrix::ggml("w", ty, n, k, Bytes::owned(bytes)).unwrap(),
                Activations::F32,
            );
            let mut all = vec![0f32; rows * n];
            matmul(&pool, &w, &x, rows, &mut all);
            let mut wrow = vec![0f32; k];
            let dec = w.stored.decoder();
            for r in 0..rows {
                let mut one = vec![0f32; n];
                matmul(&pool, &w, &x[r * k..(r + 1) * k], 1, &mut one);
                assert_eq!(
                    all[r * n..(r + 1) * n]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{ty:?} row {r}"
                );
                for c in [0, 55, 56, 130] {
                    for (b, part) in wrow.chunks_mut(w.stored.block_len()).enumerate() {
                        dec.decode(c, b, part);
                    }
                    let want = match simd::isa() {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: Avx2 is only reported after runtime detection.
                        Isa::Avx2 => unsafe { simd::dot_avx2(&wrow, &x[r * k..(r + 1) * k]) },
                        #[cfg(target_arch = "aarch64")]
                        // SAFETY: NEON is architectural on aarch64.
                        Isa::Neon => unsafe { simd::dot_neon(&wrow, &x[r * k..(r + 1) * k]) },
                        _ => simd::dot_scalar(&wrow, &x[r * k..(r + 1) * k]),
                    };
                    assert_eq!(
                        all[r * n + c].to_bits(),
                        want.to_bits(),
                        "{ty:?} ({r}, {c})"
                    );
                }
            }
        }
    }
}
