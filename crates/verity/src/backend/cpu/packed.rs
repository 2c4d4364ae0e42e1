//! The weight layout and kernels of the 8-bit-activation product for Q4_0, Q4_1 and Q8_0, repacked once at load.
//!
//! Why repack: in the stored GGML layout each output column's 32-value block is contiguous, so a dot product
//! ends in a horizontal reduction per (row, column), and that per-row work made a W-row verify cost nearly W
//! one-row steps. Here [`GROUP`] = 16 output columns are interleaved four bytes at a time, so one 512-bit
//! register holds the same four inputs of 16 columns: one `vpdpbusd` (AVX2: `vpmaddubsw` + `vpmaddwd` per 8
//! columns) against four broadcast activation bytes advances all 16 columns, each lane is one column, and no
//! horizontal reduction remains. A group's weight block is decoded once and applied to every activation row.
//! llama.cpp repacks Q4_0 similarly for some CPUs; no crate offers such kernels for these formats, hence by hand.
//!
//! Layout of a group of 16 columns (a matrix whose column count is not a multiple of 16 is padded with zero
//! columns whose scales are 0): the quants of all its blocks, block after block, then the f16 scales `d` (16
//! per block), then, for Q4_1, the f16 offsets `m` (16 per block), the whole padded to 64 bytes. A block's
//! quants: Q4_x: 4 chunks of 64 bytes, chunk `j` holding for columns 0..16 in order the column's stored bytes
//! `4j..4j+4` (low nibbles: values `4j..4j+4`, high nibbles: values `16+4j..16+4j+4`); Q8_0: 8 chunks of 64
//! bytes, chunk `c` holding each column's values `4c..4c+4`.
//!
//! Arithmetic, the contract every instruction set meets bitwise (so results depend neither on how many rows
//! share a call, nor on the thread count, nor on the SIMD width): per output column and activation row,
//! `acc = 0; per block: i = Σ w·x` (an exact integer; Q4_0 weights are `q - 8`), `acc = fma(d·x.d, i, acc)`,
//! and for Q4_1 `acc = fma(m, x.s, acc)` (`x.s = x.d·Σx`).

use super::q8::Q8Block;
use super::simd::Int8Isa;
use crate::quant::{GgmlType, QMatrix, WeightFormat};
use half::f16;

/// Output columns interleaved in one group.
pub const GROUP: usize = 16;
/// Activation rows one kernel call applies a decoded block to.
pub const ROWS: usize = 8;

/// The formats, as const parameters of the kernels.
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A matrix in the interleaved layout.
pub struct Packed {
    fmt: u8,
    /// Output columns (the stored matrix's rows) and inputs.
    pub n: usize,
    pub k: usize,
    blocks: usize,
    group_lines: usize,
    data: Vec<Line>,
}

impl Packed {
    /// The interleaved copy of `m`, or `None` for a format these kernels do not run.
    pub fn new(m: &QMatrix) -> Option<Packed> {
        let (fmt, ty) = match m.format {
            WeightFormat::Ggml(ty @ GgmlType::Q4_0) => (Q4_0, ty),
            WeightFormat::Ggml(ty @ GgmlType::Q4_1) => (Q4_1, ty),
            WeightFormat::Ggml(ty @ GgmlType::Q8_0) => (Q8_0, ty),
            _ => return None,
        };
        let (n, k) = (m.rows, m.cols);
        let blocks = k / 32;
        let bb = ty.block_bytes();
        let qs_bytes = quant_bytes(fmt);
        let scale_sets = if fmt == Q4_1 { 2 } else { 1 };
        let group_bytes = blocks * (qs_bytes + scale_sets * 2 * GROUP);
        let group_lines = group_bytes.div_ceil(64);
        let groups = n.div_ceil(GROUP);
        let mut data = vec![Line([0; 64]); groups * group_lines];
        let src = m.data();
        for g in 0..groups {
            // SAFETY: `Line` is 64 plain bytes; the slice covers exactly this group's lines.
            let dst: &mut [u8] = unsafe {
                std::slice::from_raw_parts_mut(
                    data[g * group_lines..].as_mut_ptr() as *mut u8,
                    group_lines * 64,
                )
            };
            let (qs, scales) = dst.split_at_mut(blocks * qs_bytes);
            for t in 0..GROUP.min(n - g * GROUP) {
                let col = g * GROUP + t;
                for b in 0..blocks {
                    let blk = &src[(col * blocks + b) * bb..][..bb];
                    let q = &mut qs[b * qs_bytes..][..qs_bytes];
                    let stored = &blk[if fmt == Q4_1 { 4 } else { 2 }..];
                    for c in 0..qs_bytes / 64 {
                        q[c * 64 + t * 4..][..4].copy_from_slice(&stored[c * 4..][..4]);
                    }
                    scales[(b * GROUP + t) * 2..][..2].copy_from_slice(&blk[..2]);
                    if fmt == Q4_1 {
                        let at = (blocks * GROUP + b * GROUP + t) * 2;
                        scales[at..at + 2].copy_from_slice(&blk[2..4]);
                    }
                }
            }
        }
        Some(Packed {
            fmt,
            n,
            k,
            blocks,
            group_lines,
            data,
        })
    }

    pub fn groups(&self) -> usize {
        self.n.div_ceil(GROUP)
    }

    /// Columns `16g..16g+16` for the activation rows `xs` (at most [`ROWS`]), each row's blocks quantized by
    /// `q8::quantize_row`: `out[r][t]` is column `16g+t` of row `r` (0 for padding columns).
    pub fn group(&self, isa: Int8Isa, g: usize, xs: &[&[Q8Block]], out: &mut [[f32; GROUP]; ROWS]) {
        assert!(g < self.groups() && xs.len() <= ROWS);
        assert!(xs.iter().all(|x| x.len() >= self.blocks));
        let lines = &self.data[g * self.group_lines..(g + 1) * self.group_lines];
        // SAFETY: the group's bytes, as laid out by `new`.
        let grp: &[u8] =
            unsafe { std::slice::from_raw_parts(lines.as_ptr() as *const u8, lines.len() * 64) };
        match (self.fmt, isa) {
            #[cfg(target_arch = "x86_64")]
            (Q4_0, Int8Isa::Avx512Vnni) => {
                by_rows!(x86::vnni::<Q4_0, _>(grp, self.blocks, xs, out))
            }
            #[cfg(target_arch = "x86_64")]
            (Q4_1, Int8Isa::Avx512Vnni) => {
                by_rows!(x86::vnni::<Q4_1, _>(grp, self.blocks, xs, out))
            }
            #[cfg(target_arch = "x86_64")]
            (Q8_0, Int8Isa::Avx512Vnni) => {
                by_rows!(x86::vnni::<Q8_0, _>(grp, self.blocks, xs, out))
            }
            #[cfg(target_arch = "x86_64")]
            (Q4_0, Int8Isa::Avx2) => by_rows!(x86::avx2::<Q4_0, _>(grp, self.blocks, xs, out)),
            #[cfg(target_arch = "x86_64")]
            (Q4_1, Int8Isa::Avx2) => by_rows!(x86::avx2::<Q4_1, _>(grp, self.blocks, xs, out)),
            #[cfg(target_arch = "x86_64")]
            (Q8_0, Int8Isa::Avx2) => by_rows!(x86::avx2::<Q8_0, _>(grp, self.blocks, xs, out)),
            (fmt, _) => portable(fmt, grp, self.blocks, xs, out),
        }
    }
}

/// Calls a kernel monomorphised for the number of rows (the accumulators live in registers).
macro_rules! by_rows {
    ($path:ident :: $kernel:ident :: <$fmt:ident, _>($grp:expr, $nb:expr, $xs:expr, $out:expr)) => {{
        let xs = $xs;
        // SAFETY: the instruction set was detected at run time (`simd::int8_isa`); the group holds `$nb` blocks
        // in the layout of `Packed::new` and every row has at least `$nb` blocks (asserted by the caller).
        unsafe {
            match xs.len() {
                1 => $path::$kernel::<$fmt, 1>($grp, $nb, [xs[0]], $out),
                2 => $path::$kernel::<$fmt, 2>($grp, $nb, [xs[0], xs[1]], $out),
                3 => $path::$kernel::<$fmt, 3>($grp, $nb, [xs[0], xs[1], xs[2]], $out),
                4 => $path::$kernel::<$fmt, 4>($grp, $nb, [xs[0], xs[1], xs[2], xs[3]], $out),
                5 => $path::$kernel::<$fmt, 5>($grp, $nb, [xs[0], xs[1], xs[2], xs[3], xs[4]], $out),
                6 => $path::$kernel::<$fmt, 6>(
                    $grp,
                    $nb,
                    [xs[0], xs[1], xs[2], xs[3], xs[4], xs[5]],
                    $out,
                ),
                7 => $path::$kernel::<$fmt, 7>(
                    $grp,
                    $nb,
                    [xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6]],
                    $out,
                ),
                8 => $path::$kernel::<$fmt, 8>(
                    $grp,
                    $nb,
                    [xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7]],
                    $out,
                ),
                _ => {}
            }
        }
    }};
}
use by_rows;

/// Bytes of one block's quants for a group.
fn quant_bytes(fmt: u8) -> usize {
    if fmt == Q8_0 {
        32 * GROUP
    } else {
        16 * GROUP
    }
}

/// The scale (`set` 0) or Q4_1 offset (`set` 1) of column `t` in block `b`.
fn scale(grp: &[u8], fmt: u8, nb: usize, set: usize, b: usize, t: usize) -> f32 {
    let at = nb * quant_bytes(fmt) + ((set * nb + b) * GROUP + t) * 2;
    f16::from_le_bytes([grp[at], grp[at + 1]]).to_f32()
}

/// The contract's arithmetic, written out value by value.
fn portable(fmt: u8, grp: &[u8], nb: usize, xs: &[&[Q8Block]], out: &mut [[f32; GROUP]; ROWS]) {
    let qb = quant_bytes(fmt);
    for t in 0..GROUP {
        for (r, x) in xs.iter().enumerate() {
            let mut acc = 0f32;
            for (b, xb) in x[..nb].iter().enumerate() {
                let q = &grp[b * qb..][..qb];
                let mut i = 0i32;
                for (e, &xq) in xb.qs.iter().enumerate() {
                    let w = if fmt == Q8_0 {
                        q[(e / 4) * 64 + t * 4 + e % 4] as i8 as i32
                    } else {
                        let byte = q[((e % 16) / 4) * 64 + t * 4 + e % 4];
                        let v = if e < 16 { byte & 0x0f } else { byte >> 4 } as i32;
                        if fmt == Q4_0 {
                            v - 8
                        } else {
                            v
                        }
                    };
                    i += w * xq as i32;
                }
                acc = (scale(grp, fmt, nb, 0, b, t) * xb.d).mul_add(i as f32, acc);
                if fmt == Q4_1 {
                    acc = scale(grp, fmt, nb, 1, b, t).mul_add(xb.s, acc);
                }
            }
            out[r][t] = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{quant_bytes, Q8Block, GROUP, Q4_0, Q4_1, Q8_0, ROWS};

    /// The integer sums' starting value: the exact correction of the weights' offset (Q4_0 stores `q` for
    /// `q - 8`; the VNNI path feeds Q8_0 weights as `w + 128`).
    #[inline(always)]
    fn int_start(fmt: u8, x: &Q8Block, q8_bias: i32) -> i32 {
        match fmt {
            Q4_0 => -8 * x.sum,
            Q8_0 => -q8_bias * x.sum,
            _ => 0,
        }
    }

    /// While block `b` of a group is computed, the `b`-th share of the next group's lines is fetched into L1:
    /// the hardware prefetchers alone left the kernel waiting on weight loads. (Past the last group this reads
    /// nothing: prefetches do not fault.)
    #[inline(always)]
    unsafe fn prefetch_next_group(grp: &[u8], nb: usize, b: usize) {
        let lines = grp.len() / 64;
        let next = grp.as_ptr().wrapping_add(grp.len());
        for l in b * lines / nb..(b + 1) * lines / nb {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(64 * l) as *const i8);
        }
    }

    /// Four activation bytes `4c..4c+4` of a block, as one 32-bit lane.
    #[inline(always)]
    unsafe fn x4(x: &Q8Block, c: usize) -> i32 {
        (x.qs.as_ptr().add(4 * c) as *const i32).read_unaligned()
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn vnni<const F: u8, const R: usize>(
        grp: &[u8],
        nb: usize,
        xs: [&[Q8Block]; R],
        out: &mut [[f32; GROUP]; ROWS],
    ) {
        let qb = quant_bytes(F);
        let p = grp.as_ptr();
        let scales = p.add(nb * qb) as *const __m256i;
        let offsets = p.add(nb * qb + nb * 2 * GROUP) as *const __m256i;
        let low = _mm512_set1_epi8(0x0f);
        let flip = _mm512_set1_epi8(-128);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            prefetch_next_group(grp, nb, b);
            let q = p.add(b * qb) as *const __m512i;
            let mut w = [_mm512_setzero_si512(); 8];
            if F == Q8_0 {
                for (c, wc) in w.iter_mut().enumerate() {
                    *wc = _mm512_xor_si512(_mm512_load_si512(q.add(c)), flip);
                }
            } else {
                for j in 0..4 {
                    let raw = _mm512_load_si512(q.add(j));
                    w[j] = _mm512_and_si512(raw, low);
                    w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(scales.add(b)));
            let m = if F == Q4_1 {
                _mm512_cvtph_ps(_mm256_loadu_si256(offsets.add(b)))
            } else {
                _mm512_setzero_ps()
            };
            for r in 0..R {
                let x = xs[r].get_unchecked(b);
                // With four or more rows their chains overlap; fewer rows split each chain in two (integer
                // sums: the grouping cannot change a bit).
                let mut i0 = _mm512_set1_epi32(int_start(F, x, 128));
                let i = if R >= 4 {
                    for (c, &wc) in w.iter().enumerate() {
                        i0 = _mm512_dpbusd_epi32(i0, wc, _mm512_set1_epi32(x4(x, c)));
                    }
                    i0
                } else {
                    let mut i1 = _mm512_setzero_si512();
                    for c in (0..8).step_by(2) {
                        i0 = _mm512_dpbusd_epi32(i0, w[c], _mm512_set1_epi32(x4(x, c)));
                        i1 = _mm512_dpbusd_epi32(i1, w[c + 1], _mm512_set1_epi32(x4(x, c + 1)));
                    }
                    _mm512_add_epi32(i0, i1)
                };
                let i = _mm512_cvtepi32_ps(i);
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.d)), i, acc[r]);
                if F == Q4_1 {
                    acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s), acc[r]);
                }
            }
        }
        for r in 0..R {
            _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]);
        }
    }

    /// The same contract on AVX2: each group's 16 columns in two halves of 8.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn avx2<const F: u8, const R: usize>(
        grp: &[u8],
        nb: usize,
        xs: [&[Q8Block]; R],
        out: &mut [[f32; GROUP]; ROWS],
    ) {
        let qb = quant_bytes(F);
        let p = grp.as_ptr();
        let low = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        for h in 0..2 {
            let scales = p.add(nb * qb + 16 * h) as *const __m128i;
            let offsets = p.add(nb * qb + nb * 2 * GROUP + 16 * h) as *const __m128i;
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                if h == 0 {
                    prefetch_next_group(grp, nb, b);
                }
                let q = p.add(b * qb + 32 * h);
                let chunk = |c: usize| _mm256_loadu_si256(q.add(64 * c) as *const __m256i);
                let mut w = [_mm256_setzero_si256(); 8];
                if F == Q8_0 {
                    for (c, wc) in w.iter_mut().enumerate() {
                        *wc = chunk(c);
                    }
                } else {
                    for j in 0..4 {
                        let raw = chunk(j);
                        w[j] = _mm256_and_si256(raw, low);
                        w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(scales.add(2 * b)));
                let m = if F == Q4_1 {
                    _mm256_cvtph_ps(_mm_loadu_si128(offsets.add(2 * b)))
                } else {
                    _mm256_setzero_ps()
                };
                for r in 0..R {
                    let x = xs[r].get_unchecked(b);
                    let mut i = _mm256_set1_epi32(int_start(F, x, 0));
                    for (c, &wc) in w.iter().enumerate() {
                        let xv = _mm256_set1_epi32(x4(x, c));
                        // Q8_0: |w| · (x with w's sign), the usual way to feed signed weights to vpmaddubsw.
                        let pairs = if F == Q8_0 {
                            _mm256_maddubs_epi16(_mm256_sign_epi8(wc, wc), _mm256_sign_epi8(xv, wc))
                        } else {
                            _mm256_maddubs_epi16(wc, xv)
                        };
                        i = _mm256_add_epi32(i, _mm256_madd_epi16(pairs, ones));
                    }
                    let i = _mm256_cvtepi32_ps(i);
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d)), i, acc[r]);
                    if F == Q4_1 {
                        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s), acc[r]);
                    }
                }
            }
            for r in 0..R {
                _mm256_storeu_ps(out[r].as_mut_ptr().add(8 * h), acc[r]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::q8::{quantize_row, ZERO_BLOCK};
    use super::*;
    use crate::storage::Bytes;

    fn lcg(seed: &mut u64) -> u32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 33) as u32
    }

    /// A random matrix of `n` columns and `nb` blocks with small, sign-mixed scales.
    fn matrix(ty: GgmlType, n: usize, nb: usize, seed: &mut u64) -> QMatrix {
        let bb = ty.block_bytes();
        let mut w: Vec<u8> = (0..n * nb * bb).map(|_| lcg(seed) as u8).collect();
        for blk in w.chunks_exact_mut(bb) {
            let d = f16::from_f32((lcg(seed) % 1000) as f32 * 1e-4 - 0.05);
            blk[..2].copy_from_slice(&d.to_le_bytes());
            if ty == GgmlType::Q4_1 {
                let m = f16::from_f32((lcg(seed) % 1000) as f32 * 1e-3 - 0.5);
                blk[2..4].copy_from_slice(&m.to_le_bytes());
            }
        }
        QMatrix::ggml("w", ty, n, nb * 32, Bytes::owned(w)).unwrap()
    }

    fn activations(rows: usize, nb: usize, seed: &mut u64) -> Vec<Vec<Q8Block>> {
        (0..rows)
            .map(|_| {
                let x: Vec<f32> = (0..nb * 32)
                    .map(|_| (lcg(seed) % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                let mut q = vec![ZERO_BLOCK; nb];
                quantize_row(&x, &mut q);
                q
            })
            .collect()
    }

    fn isas() -> Vec<Int8Isa> {
        let mut v = vec![Int8Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                v.push(Int8Isa::Avx2);
            }
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
            {
                v.push(Int8Isa::Avx512Vnni);
            }
        }
        v
    }

    /// The stored layout's value of column `col`, element `e`, for an independent reading of the formats.
    fn stored_dot(m: &QMatrix, col: usize, x: &[Q8Block]) -> f32 {
        let WeightFormat::Ggml(ty) = m.format else {
            unreachable!()
        };
        let bb = ty.block_bytes();
        let nb = m.cols / 32;
        let h = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
        let mut acc = 0f32;
        for (b, xb) in x[..nb].iter().enumerate() {
            let blk = &m.data()[(col * nb + b) * bb..][..bb];
            let mut i = 0i32;
            for (e, &xq) in xb.qs.iter().enumerate() {
                let w = match ty {
                    GgmlType::Q8_0 => blk[2 + e] as i8 as i32,
                    _ => {
                        let at = if ty == GgmlType::Q4_1 { 4 } else { 2 } + e % 16;
                        let v = if e < 16 { blk[at] & 15 } else { blk[at] >> 4 } as i32;
                        v - if ty == GgmlType::Q4_0 { 8 } else { 0 }
                    }
                };
                i += w * xq as i32;
            }
            acc = (h(blk, 0) * xb.d).mul_add(i as f32, acc);
            if ty == GgmlType::Q4_1 {
                acc = h(blk, 2).mul_add(xb.s, acc);
            }
        }
        acc
    }

    /// Every instruction set gives bitwise the contract's arithmetic read from the stored layout, for every
    /// format, row count 1..=8 and a column count that leaves a partial group.
    #[test]
    fn every_kernel_is_bitwise_the_contract_on_ragged_shapes() {
        let mut seed = 0x5eed_u64;
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (n, nb) = (37, 5);
            let m = matrix(ty, n, nb, &mut seed);
            let p = Packed::new(&m).unwrap();
            assert_eq!(p.groups(), 3);
            let xs = activations(ROWS, nb, &mut seed);
            for isa in isas() {
                for rows in 1..=ROWS {
                    let refs: Vec<&[Q8Block]> = xs[..rows].iter().map(|x| x.as_slice()).collect();
                    for g in 0..p.groups() {
                        let mut out = [[f32::NAN; GROUP]; ROWS];
                        p.group(isa, g, &refs, &mut out);
                        for (r, x) in refs.iter().enumerate() {
                            for (t, got) in out[r].iter().enumerate() {
                                let col = g * GROUP + t;
                                let want = if col < n { stored_dot(&m, col, x) } else { 0.0 };
                                assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{ty:?} {isa:?} rows {rows} row {r} col {col}: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn other_formats_are_not_packed() {
        let m = QMatrix::ggml("f", GgmlType::F32, 2, 32, Bytes::owned(vec![0; 256])).unwrap();
        assert!(Packed::new(&m).is_none());
    }
}
