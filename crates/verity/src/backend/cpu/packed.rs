//! The weight layout and kernels of the 8-bit-activation product, repacked once at load, for the GGML block
//! formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K (what a `_K_M` file holds), and for
//! MLX affine 4- and 8-bit with f16 or bf16 scales, and the IQ4 grid formats IQ4_NL and IQ4_XS. Q3_K runs as
//! Q6_K: its 3-bit values `v` (offset 4) are stored as the 6-bit values `v + 28` (offset 32), the same
//! integers, with its signed sub-block scales in Q6_K's place (the repacked matrix is then Q6_K's size).
//!
//! Why repack: in the stored GGML layout each output column's block is contiguous, so a dot product ends in a
//! horizontal reduction per (row, column), and that per-row work made a W-row verify cost nearly W one-row
//! steps. Here [`GROUP`] = 16 output columns are interleaved four bytes at a time, so one 512-bit register holds
//! the same four inputs of 16 columns: one `vpdpbusd` (AVX2: `vpmaddubsw` + `vpmaddwd` per 8 columns) against
//! four broadcast activation bytes advances all 16 columns, each lane is one column, and no horizontal
//! reduction remains (aarch64: one `sdot` per 4 columns). A group's weight block is decoded once and applied to
//! every activation row. llama.cpp repacks Q4_0 similarly for some CPUs; no crate offers such kernels for these
//! formats, hence by hand.
//!
//! Every format is read through its integer view ([`IntBlock`]): 32-value sub-blocks of unsigned values with an
//! integer offset, one or two exact f32 scales and an additive term. The K-quants' super-block scales stay
//! compact here (f16 `d`/`dmin` per super-block, 6- or 8-bit sub-block scales), and the kernels form a
//! sub-block's exact scale `d·sc` as they go, so the repacked matrix is as small as the stored one (+3 %).
//!
//! Layout of a group of 16 columns (a matrix whose column count is not a multiple of 16 is padded with zero
//! columns whose scales are 0): the quants of all its 32-value blocks, block after block, then the scales, the
//! whole padded to 64 bytes. A block's quants: 4 chunks of 64 bytes, chunk `j` holding for columns 0..16 in
//! order four bytes whose low nibbles are the column's values `4j..4j+4` and high nibbles its values
//! `16+4j..16+4j+4`; then the high bits of the 5- and 6-bit formats in planes of 64 bytes with the same byte
//! order, byte `i` of a plane holding bit 4 of byte `i` of all 8 nibble chunks (5-bit: one plane, chunk `c` at
//! bit `c`) or bits 4-5 of byte `i` of four chunks (6-bit: plane `p` for chunks `4p..4p+4`, chunk `c` at bits
//! `2(c−4p)..`). Q8_0: 8 chunks of 64 signed bytes, chunk `c` holding each column's values `4c..4c+4`. Scales:
//! Q4_0/Q5_0/Q8_0 the f16 `d` of every block (16 per block); Q4_1/Q5_1 those, then the f16 `m`; Q4_K/Q5_K per
//! super-block the f16 `d` and `dmin` (16 each), then per block the 6-bit scales and mins (16 bytes each); Q6_K
//! per super-block the f16 `d`, then per block the signed 8-bit scales of its two 16-value halves; MLX the
//! stored 16-bit scales of every scale group, then its biases (the additive term). MLX 8-bit is stored as
//! Q8_0 is, each value less 128 (its integer offset is −128). IQ4_NL/IQ4_XS keep their 4-bit grid indices in the
//! nibble chunks, looked up (`vpshufb`) into the grid's signed values, which then run as Q8_0's bytes do;
//! IQ4_NL's scales are Q4_0's, IQ4_XS's per super-block the f16 `d`, then per block the signed 6-bit scales.
//!
//! Arithmetic, the contract every instruction set meets bitwise (so results depend neither on how many rows
//! share a call, nor on the thread count, nor on the SIMD width): per output column and activation row,
//! `acc = 0`; per block `i = Σ q·x − offset·Σx` (an exact integer), `acc = fma(d·x.d, i, acc)`, then for the
//! formats with an additive term `acc = fma(m, x.s, acc)` (`x.s = x.d·Σx`). Q6_K sums each 16-value half
//! separately (`x.sum_lo` gives the first half's `Σx`) and takes its two `fma`s, first half first. The blocks
//! fall into [`Runs`]: `S = min(INT8_RUNS, nb)` runs of consecutive blocks, run `s` being blocks
//! `s·nb/S .. (s+1)·nb/S`; `acc` restarts at 0 for each run and the result is `((0 + acc₀) + acc₁) + …` in run
//! order. The runs let a GPU spread one column's blocks over 16 warps, each summing its run, and still give
//! these bits (a single chain would tie every column to one thread's serial latency).

use super::q8::Q8Block;
use super::simd::Int8Isa;
use crate::backend::INT8_RUNS;
use crate::quant::ggml::{iq4_xs_scale, q3_k_scales, IQ4_GRID};
use crate::quant::{GgmlType, MlxScaleType, QMatrix, WeightFormat};
use half::f16;

/// Output columns interleaved in one group.
pub const GROUP: usize = 16;
/// Activation rows one kernel call applies a decoded block to.
pub const ROWS: usize = 8;

/// The formats, as const parameters of the kernels.
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;
const Q5_0: u8 = 3;
const Q5_1: u8 = 4;
const Q4K: u8 = 5;
const Q5K: u8 = 6;
const Q6K: u8 = 7;
/// MLX affine 4- and 8-bit (`scale·q + bias` per group of 32, 64 or 128 values, f16 or bf16 scales).
const MLX4: u8 = 8;
const MLX8: u8 = 9;
/// IQ4_NL and IQ4_XS: 4-bit indices into a signed grid (IQ4_XS with 6-bit sub-block scales).
const IQ4NL: u8 = 10;
const IQ4XS: u8 = 11;

/// Blocks of 32 values per K-quant super-block.
const SUPER: usize = 8;

/// Which blocks end a run of the epilogue, for blocks visited in order.
#[derive(Clone, Copy, Debug)]
pub struct Runs {
    nb: usize,
    count: usize,
    run: usize,
    end: usize,
}

impl Runs {
    pub fn new(nb: usize) -> Self {
        let count = INT8_RUNS.min(nb).max(1);
        Runs {
            nb,
            count,
            run: 0,
            end: nb / count,
        }
    }

    /// Whether block `b`, the block after the last one asked about, is the last of its run.
    #[inline(always)]
    pub fn ends(&mut self, b: usize) -> bool {
        if b + 1 != self.end {
            return false;
        }
        self.run += 1;
        self.end = (self.run + 1) * self.nb / self.count;
        true
    }
}

fn fmt_of(ty: GgmlType) -> Option<u8> {
    Some(match ty {
        GgmlType::Q4_0 => Q4_0,
        GgmlType::Q4_1 => Q4_1,
        GgmlType::Q8_0 => Q8_0,
        GgmlType::Q5_0 => Q5_0,
        GgmlType::Q5_1 => Q5_1,
        GgmlType::Q4K => Q4K,
        GgmlType::Q5K => Q5K,
        GgmlType::Q6K | GgmlType::Q3K => Q6K,
        GgmlType::IQ4NL => IQ4NL,
        GgmlType::IQ4XS => IQ4XS,
        _ => return None,
    })
}

/// How a group's blocks share their scales: `nb` blocks of 32 values; MLX scale groups of `2^shift` blocks
/// whose 16-bit scales are bf16 (else f16).
#[derive(Clone, Copy, Debug)]
struct Lay {
    nb: usize,
    shift: u32,
    bf16: bool,
}

/// Whether the format's quants are whole (signed) bytes.
const fn bytes(f: u8) -> bool {
    matches!(f, Q8_0 | MLX8)
}

/// Whether the format's nibbles index the IQ4 grid.
const fn grid(f: u8) -> bool {
    matches!(f, IQ4NL | IQ4XS)
}

/// Whether the kernels see the weights as signed bytes (the byte formats, and the IQ4 grid's values).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const fn signed(f: u8) -> bool {
    bytes(f) || grid(f)
}

/// High-bit planes per block.
const fn planes(f: u8) -> usize {
    match f {
        Q5_0 | Q5_1 | Q5K => 1,
        Q6K => 2,
        _ => 0,
    }
}

/// Bytes of one block's quants for a group.
const fn quant_bytes(f: u8) -> usize {
    if bytes(f) {
        32 * GROUP
    } else {
        (16 + 4 * planes(f)) * GROUP
    }
}

/// What the stored values are offset by, as the kernels see them: the byte formats are stored signed (Q8_0 as
/// it is, MLX8 as `q − 128`), and the VNNI kernel feeds them as unsigned bytes (`+128`) with its own correction.
const fn offset(f: u8) -> i32 {
    match f {
        Q4_0 => 8,
        Q5_0 => 16,
        Q6K => 32,
        MLX8 => -128,
        _ => 0,
    }
}

/// Whether the format has an additive term (`m`, or the K-quants' `−dmin·min`).
const fn has_min(f: u8) -> bool {
    matches!(f, Q4_1 | Q5_1 | Q4K | Q5K | MLX4 | MLX8)
}

/// Bytes of scales per K-quant super-block: `d` and `dmin` (f16), then 8 × (16 scales, 16 mins); Q6_K: `d`,
/// then 8 × 2 × 16 signed scales.
const K_SUPER_BYTES: usize = 4 * GROUP + SUPER * 2 * GROUP;
const Q6K_SUPER_BYTES: usize = 2 * GROUP + SUPER * 2 * GROUP;
/// IQ4_XS: `d`, then 8 × 16 signed scales (`scale − 32`).
const IQ4XS_SUPER_BYTES: usize = 2 * GROUP + SUPER * GROUP;

/// Bytes of a group's scales.
fn scale_bytes(f: u8, lay: Lay) -> usize {
    let nb = lay.nb;
    match f {
        Q4K | Q5K => nb / SUPER * K_SUPER_BYTES,
        Q6K => nb / SUPER * Q6K_SUPER_BYTES,
        IQ4XS => nb / SUPER * IQ4XS_SUPER_BYTES,
        MLX4 | MLX8 => (nb >> lay.shift) * 4 * GROUP,
        _ if has_min(f) => nb * 4 * GROUP,
        _ => nb * 2 * GROUP,
    }
}

/// Where block `b`'s scale data lies in a group: the 16 16-bit `d` (per block, per super-block for the
/// K-quants, per scale group for MLX), the 16 of the additive term (`m`, `dmin` or the MLX bias), and for the
/// K-quants the 16 sub-block scales (Q6_K: of the first half; the second half's follow) and the 16 mins.
#[derive(Clone, Copy)]
struct ScaleAt {
    d: usize,
    m: usize,
    sc: usize,
    mins: usize,
}

#[inline(always)]
fn scale_at(f: u8, lay: Lay, b: usize) -> ScaleAt {
    let nb = lay.nb;
    let base = nb * quant_bytes(f);
    let (s, j) = (b / SUPER, b % SUPER);
    match f {
        Q4K | Q5K => {
            let sup = base + s * K_SUPER_BYTES;
            let sc = sup + 4 * GROUP + j * 2 * GROUP;
            ScaleAt {
                d: sup,
                m: sup + 2 * GROUP,
                sc,
                mins: sc + GROUP,
            }
        }
        Q6K => {
            let sup = base + s * Q6K_SUPER_BYTES;
            ScaleAt {
                d: sup,
                m: 0,
                sc: sup + 2 * GROUP + j * 2 * GROUP,
                mins: 0,
            }
        }
        IQ4XS => {
            let sup = base + s * IQ4XS_SUPER_BYTES;
            ScaleAt {
                d: sup,
                m: 0,
                sc: sup + 2 * GROUP + j * GROUP,
                mins: 0,
            }
        }
        _ => {
            let (g, groups) = (b >> lay.shift, nb >> lay.shift);
            ScaleAt {
                d: base + g * 2 * GROUP,
                m: base + (groups + g) * 2 * GROUP,
                sc: 0,
                mins: 0,
            }
        }
    }
}

/// The values of nibble chunk `c` (0..8) at lane byte `e` (0..4): chunks 0..4 hold values `4c+e` (low
/// nibbles), chunks 4..8 values `16+4(c−4)+e` (high nibbles); Q8_0's chunk `c` holds values `4c+e`.
#[inline(always)]
const fn value_of(c: usize, e: usize) -> usize {
    if c < 4 {
        4 * c + e
    } else {
        16 + 4 * (c - 4) + e
    }
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A matrix in the interleaved layout.
pub struct Packed {
    fmt: u8,
    /// Output columns (the stored matrix's rows) and inputs.
    pub n: usize,
    pub k: usize,
    lay: Lay,
    group_lines: usize,
    data: Vec<Line>,
}

impl Packed {
    /// The interleaved copy of `m`, or `None` for a format these kernels do not run.
    pub fn new(m: &QMatrix) -> Option<Packed> {
        let (n, k) = (m.rows, m.cols);
        let blocks = k / 32;
        let (fmt, lay) = match m.format {
            WeightFormat::Ggml(ty) => (
                fmt_of(ty)?,
                Lay {
                    nb: blocks,
                    shift: 0,
                    bf16: false,
                },
            ),
            WeightFormat::Mlx(q) if q.scale_type != MlxScaleType::F32 => (
                if q.bits == 4 { MLX4 } else { MLX8 },
                Lay {
                    nb: blocks,
                    shift: (q.group / 32).trailing_zeros(),
                    bf16: q.scale_type == MlxScaleType::BF16,
                },
            ),
            WeightFormat::Mlx(_) => return None,
        };
        let qb = quant_bytes(fmt);
        let group_lines = (blocks * qb + scale_bytes(fmt, lay)).div_ceil(64);
        let groups = n.div_ceil(GROUP);
        let mut data = vec![Line([0; 64]); groups * group_lines];
        let pack_group = |g: usize, lines: &mut [Line]| {
            // SAFETY: `Line` is 64 plain bytes; the slice covers exactly this group's lines.
            let grp: &mut [u8] = unsafe {
                std::slice::from_raw_parts_mut(lines.as_mut_ptr() as *mut u8, lines.len() * 64)
            };
            for t in 0..GROUP.min(n - g * GROUP) {
                pack_column(m, fmt, lay, g * GROUP + t, grp, t);
            }
        };
        // Repacking reads every value: the machine's cores share the groups (an 8B model holds billions).
        let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
        let per = groups.div_ceil(threads).max(1);
        std::thread::scope(|s| {
            for (i, chunk) in data.chunks_mut((per * group_lines).max(1)).enumerate() {
                let pack_group = &pack_group;
                s.spawn(move || {
                    for (j, lines) in chunk.chunks_mut(group_lines.max(1)).enumerate() {
                        pack_group(i * per + j, lines);
                    }
                });
            }
        });
        Some(Packed {
            fmt,
            n,
            k,
            lay,
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
        assert!(xs.iter().all(|x| x.len() >= self.lay.nb));
        let lines = &self.data[g * self.group_lines..(g + 1) * self.group_lines];
        // SAFETY: the group's bytes, as laid out by `new`.
        let grp: &[u8] =
            unsafe { std::slice::from_raw_parts(lines.as_ptr() as *const u8, lines.len() * 64) };
        match isa {
            #[cfg(target_arch = "x86_64")]
            Int8Isa::Avx512Vnni => by_format!(self.fmt, x86::vnni(grp, self.lay, xs, out)),
            #[cfg(target_arch = "x86_64")]
            Int8Isa::Avx2 => by_format!(self.fmt, x86::avx2(grp, self.lay, xs, out)),
            #[cfg(target_arch = "aarch64")]
            Int8Isa::NeonDot => by_format!(self.fmt, neon::dot(grp, self.lay, xs, out)),
            _ => portable(self.fmt, grp, self.lay, xs, out),
        }
    }
}

/// Writes matrix column `col` (the stored matrix's row) into slot `t` of its group `grp`.
fn pack_column(m: &QMatrix, fmt: u8, lay: Lay, col: usize, grp: &mut [u8], t: usize) {
    let qb = quant_bytes(fmt);
    match m.format {
        WeightFormat::Ggml(ty) => {
            let (bb, subs) = (ty.block_bytes(), ty.block_len() / 32);
            for b in 0..lay.nb {
                let blk = &m.data()[(col * lay.nb / subs + b / subs) * bb..][..bb];
                let mut q = ty.int_block(blk, b % subs).q;
                if ty == GgmlType::Q3K {
                    // Q6_K's offset (32) where Q3_K's is 4.
                    for v in q.iter_mut() {
                        *v += 28;
                    }
                }
                if grid(fmt) {
                    // The kernels look the grid up: store each value's index.
                    for v in q.iter_mut() {
                        let value = *v as i32 - 128;
                        let at = IQ4_GRID.iter().position(|&g| g as i32 == value);
                        *v = at.expect("a value of the grid") as u8;
                    }
                }
                pack_quants(fmt, &q, &mut grp[b * qb..][..qb], t);
                if ty == GgmlType::Q3K {
                    pack_q3_k_scales(blk, grp, lay, b, t);
                } else {
                    pack_scales(fmt, blk, grp, lay, b, t);
                }
            }
        }
        WeightFormat::Mlx(_) => {
            let parts = m.mlx_parts().expect("an MLX matrix has scales and biases");
            let q = parts.q;
            let size = q.scale_type.size();
            for b in 0..lay.nb {
                let ib = q.int_block((parts.words, parts.scales, parts.biases), m.cols, col, b);
                pack_quants(fmt, &ib.q, &mut grp[b * qb..][..qb], t);
                // The stored 16-bit scale and bias, as they are.
                let gi = col * (m.cols / q.group) + b * 32 / q.group;
                let at = scale_at(fmt, lay, b);
                grp[at.d + 2 * t..][..2].copy_from_slice(&parts.scales[gi * size..][..2]);
                grp[at.m + 2 * t..][..2].copy_from_slice(&parts.biases[gi * size..][..2]);
            }
        }
    }
}

/// Writes column `t`'s values `q` of one block into the block's quants `dst`.
fn pack_quants(fmt: u8, q: &[u8; 32], dst: &mut [u8], t: usize) {
    if bytes(fmt) {
        for c in 0..8 {
            for e in 0..4 {
                // Stored signed: Q8_0's integer view is the signed byte plus 128, MLX8's is `q` (offset −128).
                dst[c * 64 + t * 4 + e] = q[4 * c + e] ^ 0x80;
            }
        }
        return;
    }
    for j in 0..4 {
        for e in 0..4 {
            dst[j * 64 + t * 4 + e] = (q[4 * j + e] & 0x0f) | (q[16 + 4 * j + e] & 0x0f) << 4;
        }
    }
    for c in 0..8 {
        for e in 0..4 {
            let high = q[value_of(c, e)] >> 4;
            match planes(fmt) {
                1 => dst[256 + t * 4 + e] |= (high & 1) << c,
                2 => dst[256 + (c / 4) * 64 + t * 4 + e] |= (high & 3) << (2 * (c % 4)),
                _ => {}
            }
        }
    }
}

/// Writes column `t`'s scales of block `b` (from its stored GGML block `blk`) into the group `grp`.
fn pack_scales(fmt: u8, blk: &[u8], grp: &mut [u8], lay: Lay, b: usize, t: usize) {
    let at = scale_at(fmt, lay, b);
    let j = b % SUPER;
    match fmt {
        Q4K | Q5K => {
            if j == 0 {
                grp[at.d + 2 * t..][..2].copy_from_slice(&blk[0..2]);
                grp[at.m + 2 * t..][..2].copy_from_slice(&blk[2..4]);
            }
            let (sc, mn) = crate::quant::ggml::scale_min_k4(j, &blk[4..16]);
            grp[at.sc + t] = sc;
            grp[at.mins + t] = mn;
        }
        IQ4XS => {
            if j == 0 {
                grp[at.d + 2 * t..][..2].copy_from_slice(&blk[0..2]);
            }
            grp[at.sc + t] = iq4_xs_scale(blk, j) as i8 as u8;
        }
        Q6K => {
            if j == 0 {
                grp[at.d + 2 * t..][..2].copy_from_slice(&blk[208..210]);
            }
            let (n, k) = (j / 4, j % 4);
            grp[at.sc + t] = blk[192 + n * 8 + 2 * k];
            grp[at.sc + GROUP + t] = blk[192 + n * 8 + 2 * k + 1];
        }
        _ => {
            grp[at.d + 2 * t..][..2].copy_from_slice(&blk[0..2]);
            if has_min(fmt) {
                grp[at.m + 2 * t..][..2].copy_from_slice(&blk[2..4]);
            }
        }
    }
}

/// Q3_K's scales in Q6_K's places: the f16 `d`, and the signed scales of block `b`'s two 16-value halves.
fn pack_q3_k_scales(blk: &[u8], grp: &mut [u8], lay: Lay, b: usize, t: usize) {
    let at = scale_at(Q6K, lay, b);
    let j = b % SUPER;
    if j == 0 {
        grp[at.d + 2 * t..][..2].copy_from_slice(&blk[108..110]);
    }
    let scales = q3_k_scales(&blk[96..108]);
    grp[at.sc + t] = scales[2 * j] as i8 as u8;
    grp[at.sc + GROUP + t] = scales[2 * j + 1] as i8 as u8;
}

/// Calls a kernel monomorphised for the format and the number of rows (the accumulators live in registers).
macro_rules! by_format {
    ($fmt:expr, $path:ident :: $kernel:ident ($grp:expr, $nb:expr, $xs:expr, $out:expr)) => {
        match $fmt {
            Q4_0 => by_rows!($path::$kernel::<Q4_0, _>($grp, $nb, $xs, $out)),
            Q4_1 => by_rows!($path::$kernel::<Q4_1, _>($grp, $nb, $xs, $out)),
            Q8_0 => by_rows!($path::$kernel::<Q8_0, _>($grp, $nb, $xs, $out)),
            Q5_0 => by_rows!($path::$kernel::<Q5_0, _>($grp, $nb, $xs, $out)),
            Q5_1 => by_rows!($path::$kernel::<Q5_1, _>($grp, $nb, $xs, $out)),
            Q4K => by_rows!($path::$kernel::<Q4K, _>($grp, $nb, $xs, $out)),
            Q5K => by_rows!($path::$kernel::<Q5K, _>($grp, $nb, $xs, $out)),
            Q6K => by_rows!($path::$kernel::<Q6K, _>($grp, $nb, $xs, $out)),
            MLX4 => by_rows!($path::$kernel::<MLX4, _>($grp, $nb, $xs, $out)),
            IQ4NL => by_rows!($path::$kernel::<IQ4NL, _>($grp, $nb, $xs, $out)),
            IQ4XS => by_rows!($path::$kernel::<IQ4XS, _>($grp, $nb, $xs, $out)),
            _ => by_rows!($path::$kernel::<MLX8, _>($grp, $nb, $xs, $out)),
        }
    };
}
use by_format;

/// Calls a kernel monomorphised for the number of rows.
macro_rules! by_rows {
    ($path:ident :: $kernel:ident :: <$fmt:ident, _>($grp:expr, $nb:expr, $xs:expr, $out:expr)) => {{
        let xs = $xs;
        // SAFETY: the instruction set was detected at run time (`simd::int8_isa`); the group holds `$nb.nb`
        // blocks in the layout of `Packed::new` and every row has at least as many (asserted by the caller).
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

fn f16_at(grp: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([grp[at], grp[at + 1]]).to_f32()
}

/// A 16-bit scale: bf16 where `bf16` (MLX bundles of bf16 models), else f16.
fn half_at(grp: &[u8], at: usize, bf16: bool) -> f32 {
    if bf16 {
        half::bf16::from_le_bytes([grp[at], grp[at + 1]]).to_f32()
    } else {
        f16_at(grp, at)
    }
}

/// The contract's arithmetic, written out value by value from the packed layout.
fn portable(fmt: u8, grp: &[u8], lay: Lay, xs: &[&[Q8Block]], out: &mut [[f32; GROUP]; ROWS]) {
    let (qb, nb) = (quant_bytes(fmt), lay.nb);
    for t in 0..GROUP {
        for (r, x) in xs.iter().enumerate() {
            let (mut acc, mut total) = (0f32, 0f32);
            let mut runs = Runs::new(nb);
            for (b, xb) in x[..nb].iter().enumerate() {
                let q = &grp[b * qb..][..qb];
                let at = scale_at(fmt, lay, b);
                let mut value = [0i32; 32];
                for c in 0..8 {
                    for e in 0..4 {
                        let v = value_of(c, e);
                        value[v] = if bytes(fmt) {
                            q[c * 64 + t * 4 + e] as i8 as i32
                        } else {
                            let byte = q[(c % 4) * 64 + t * 4 + e];
                            let low = if c < 4 { byte & 0x0f } else { byte >> 4 };
                            if grid(fmt) {
                                value[v] = IQ4_GRID[low as usize] as i32;
                                continue;
                            }
                            let high = match planes(fmt) {
                                1 => (q[256 + t * 4 + e] >> c) & 1,
                                2 => (q[256 + (c / 4) * 64 + t * 4 + e] >> (2 * (c % 4))) & 3,
                                _ => 0,
                            };
                            (low | high << 4) as i32
                        };
                    }
                }
                let dot = |range: std::ops::Range<usize>, sum: i32| {
                    let i: i32 = range.map(|e| value[e] * xb.qs[e] as i32).sum();
                    i - offset(fmt) * sum
                };
                match fmt {
                    Q6K => {
                        let d = f16_at(grp, at.d + 2 * t);
                        for (h, sum) in [(0, xb.sum_lo), (1, xb.sum - xb.sum_lo)] {
                            let sc = grp[at.sc + h * GROUP + t] as i8 as f32;
                            let i = dot(16 * h..16 * h + 16, sum);
                            acc = (d * sc * xb.d).mul_add(i as f32, acc);
                        }
                    }
                    IQ4XS => {
                        let d = f16_at(grp, at.d + 2 * t) * grp[at.sc + t] as i8 as f32;
                        acc = (d * xb.d).mul_add(dot(0..32, xb.sum) as f32, acc);
                    }
                    Q4K | Q5K => {
                        let d = f16_at(grp, at.d + 2 * t) * grp[at.sc + t] as f32;
                        let m = -(f16_at(grp, at.m + 2 * t) * grp[at.mins + t] as f32);
                        acc = (d * xb.d).mul_add(dot(0..32, xb.sum) as f32, acc);
                        acc = m.mul_add(xb.s, acc);
                    }
                    _ => {
                        let d = half_at(grp, at.d + 2 * t, lay.bf16);
                        acc = (d * xb.d).mul_add(dot(0..32, xb.sum) as f32, acc);
                        if has_min(fmt) {
                            acc = half_at(grp, at.m + 2 * t, lay.bf16).mul_add(xb.s, acc);
                        }
                    }
                }
                if runs.ends(b) {
                    total += acc;
                    acc = 0.0;
                }
            }
            out[r][t] = total;
        }
    }
}

/// `$body` once per row `r` in `0..rows`, `r` a literal in each copy: the rows' accumulators then stay in
/// registers (LLVM does not fully unroll a loop over a body this long, and an array indexed by a loop
/// variable lives on the stack, which made every row's chain wait on store forwarding).
macro_rules! each_row {
    ($rows:expr, |$r:ident| $body:block) => {
        each_row!(@ $rows, $r, $body, 0 1 2 3 4 5 6 7)
    };
    (@ $rows:expr, $r:ident, $body:block, $($i:literal)*) => {
        $(if $i < $rows {
            let $r: usize = $i;
            $body
        })*
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{
        bytes, grid, has_min, offset, planes, quant_bytes, scale_at, signed, Lay, Q8Block, Runs,
        GROUP, IQ4XS, IQ4_GRID, MLX4, MLX8, Q4K, Q5K, Q6K,
    };
    use super::{ROWS, SUPER};

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

    /// The integer sums' starting values for the block's two 16-value halves (only Q6_K sums them apart; the
    /// other formats start the whole sum at `.0`). The VNNI kernel feeds the byte formats as `w + 128`.
    #[inline(always)]
    fn int_starts(f: u8, x: &Q8Block, vnni: bool) -> (i32, i32) {
        match f {
            Q6K => (-32 * x.sum_lo, -32 * (x.sum - x.sum_lo)),
            _ if signed(f) && vnni => (-(offset(f) + 128) * x.sum, 0),
            _ => (-offset(f) * x.sum, 0),
        }
    }

    /// Chunks whose `vpmaddubsw` pair sums (at most 2·max|w|·127 each) add up exactly in 16 bits: 8 for 4-bit
    /// weights (8·3,810), 4 for 5-bit (4·7,874), 2 for 6-bit (2·16,002), 1 for Q8_0's signed bytes.
    const fn i16_span(f: u8) -> usize {
        match f {
            _ if signed(f) => 1,
            Q6K => 2,
            _ if planes(f) == 1 => 4,
            _ => 8,
        }
    }

    /// `h` shifted left by `n` bits per 16-bit lane (right for negative `n`).
    #[inline(always)]
    unsafe fn shift512(h: __m512i, n: i32) -> __m512i {
        if n >= 0 {
            _mm512_sll_epi16(h, _mm_cvtsi32_si128(n))
        } else {
            _mm512_srl_epi16(h, _mm_cvtsi32_si128(-n))
        }
    }

    #[inline(always)]
    unsafe fn shift256(h: __m256i, n: i32) -> __m256i {
        if n >= 0 {
            _mm256_sll_epi16(h, _mm_cvtsi32_si128(n))
        } else {
            _mm256_srl_epi16(h, _mm_cvtsi32_si128(-n))
        }
    }

    /// `−v`, exactly (sign flip, so that `−(+0)` is `−0` as in the scalar contract).
    #[inline(always)]
    unsafe fn neg512(v: __m512) -> __m512 {
        _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(v),
            _mm512_set1_epi32(i32::MIN),
        ))
    }

    #[inline(always)]
    unsafe fn neg256(v: __m256) -> __m256 {
        _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN)))
    }

    /// A block's exact integer sums for one row, VNNI: the whole block's (`.0`), or Q6_K's two halves.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline]
    unsafe fn row_dots_vnni<const F: u8, const R: usize>(
        w: &[__m512i; 8],
        x: &Q8Block,
    ) -> (__m512i, __m512i) {
        let (s0, s1) = int_starts(F, x, true);
        let (mut i0, mut i1) = (_mm512_set1_epi32(s0), _mm512_set1_epi32(s1));
        let dp = |i, c: usize| _mm512_dpbusd_epi32(i, w[c], _mm512_set1_epi32(x4(x, c)));
        if F == Q6K {
            for c in 0..4 {
                i0 = dp(i0, c);
                i1 = dp(i1, c + 4);
            }
            return (i0, i1);
        }
        if R >= 4 {
            // Four or more rows' chains overlap one another.
            for c in 0..8 {
                i0 = dp(i0, c);
            }
            (i0, i1)
        } else {
            // Fewer rows split each chain in two (integer sums: the grouping cannot change a bit).
            for c in (0..8).step_by(2) {
                i0 = dp(i0, c);
                i1 = dp(i1, c + 1);
            }
            (_mm512_add_epi32(i0, i1), _mm512_setzero_si512())
        }
    }

    /// The same on AVX2. Pair sums of [`i16_span`] chunks add up in 16 bits before one widening `vpmaddwd`
    /// (exact: the span keeps them below 2^15), which halves the instructions per row.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn row_dots_avx2<const F: u8>(w: &[__m256i; 8], x: &Q8Block) -> (__m256i, __m256i) {
        let ones = _mm256_set1_epi16(1);
        let pairs = |c: usize| {
            let (wc, xv) = (w[c], _mm256_set1_epi32(x4(x, c)));
            // Signed bytes: |w| · (x with w's sign), the usual way to feed them to vpmaddubsw.
            if signed(F) {
                _mm256_maddubs_epi16(_mm256_sign_epi8(wc, wc), _mm256_sign_epi8(xv, wc))
            } else {
                _mm256_maddubs_epi16(wc, xv)
            }
        };
        let sum = |c0: usize, n: usize| {
            let mut s16 = pairs(c0);
            for c in c0 + 1..c0 + n {
                s16 = _mm256_add_epi16(s16, pairs(c));
            }
            _mm256_madd_epi16(s16, ones)
        };
        let (s0, s1) = int_starts(F, x, false);
        let (i0, i1) = (_mm256_set1_epi32(s0), _mm256_set1_epi32(s1));
        let add = |a, b| _mm256_add_epi32(a, b);
        match i16_span(F) {
            8 => (add(i0, sum(0, 8)), i1),
            4 => (add(i0, add(sum(0, 4), sum(4, 4))), i1),
            // Q6_K, whose halves are summed apart.
            2 => (
                add(i0, add(sum(0, 2), sum(2, 2))),
                add(i1, add(sum(4, 2), sum(6, 2))),
            ),
            _ => {
                let mut i = i0;
                for c in 0..8 {
                    i = add(i, sum(c, 1));
                }
                (i, i1)
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn vnni<const F: u8, const R: usize>(
        grp: &[u8],
        lay: Lay,
        xs: [&[Q8Block]; R],
        out: &mut [[f32; GROUP]; ROWS],
    ) {
        let qb = quant_bytes(F);
        let p = grp.as_ptr();
        let low = _mm512_set1_epi8(0x0f);
        let flip = _mm512_set1_epi8(-128);
        let (bit4, bits45) = (_mm512_set1_epi8(0x10), _mm512_set1_epi8(0x30));
        // The IQ4 grid in every 128-bit lane, for vpshufb.
        let grid512 = _mm512_broadcast_i32x4(_mm_loadu_si128(IQ4_GRID.as_ptr() as *const __m128i));
        let nb = lay.nb;
        let f16x16 = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(p.add(at) as *const __m256i));
        // MLX's 16-bit scales: bf16 is the top half of an f32.
        let half16 = |at: usize| {
            let raw = _mm256_loadu_si256(p.add(at) as *const __m256i);
            if lay.bf16 {
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
            } else {
                _mm512_cvtph_ps(raw)
            }
        };
        let u8x16 = |at: usize| {
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                p.add(at) as *const __m128i
            )))
        };
        let i8x16 = |at: usize| {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                p.add(at) as *const __m128i
            )))
        };
        let mut acc = [_mm512_setzero_ps(); R];
        let mut total = [_mm512_setzero_ps(); R];
        let mut runs = Runs::new(nb);
        let mut d_super = _mm512_setzero_ps();
        let mut m_super = _mm512_setzero_ps();
        for b in 0..nb {
            prefetch_next_group(grp, nb, b);
            let q = p.add(b * qb) as *const __m512i;
            let mut w = [_mm512_setzero_si512(); 8];
            if bytes(F) {
                for (c, wc) in w.iter_mut().enumerate() {
                    *wc = _mm512_xor_si512(_mm512_load_si512(q.add(c)), flip);
                }
            } else {
                for j in 0..4 {
                    let raw = _mm512_load_si512(q.add(j));
                    w[j] = _mm512_and_si512(raw, low);
                    w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                }
                if grid(F) {
                    // Grid values, fed as unsigned bytes (+128) like Q8_0's.
                    for wc in w.iter_mut() {
                        *wc = _mm512_xor_si512(_mm512_shuffle_epi8(grid512, *wc), flip);
                    }
                }
                if planes(F) == 1 {
                    let h = _mm512_load_si512(q.add(4));
                    for (c, wc) in w.iter_mut().enumerate() {
                        let hb = _mm512_and_si512(shift512(h, 4 - c as i32), bit4);
                        *wc = _mm512_or_si512(*wc, hb);
                    }
                } else if planes(F) == 2 {
                    for (c, wc) in w.iter_mut().enumerate() {
                        let h = _mm512_load_si512(q.add(4 + c / 4));
                        let hb = _mm512_and_si512(shift512(h, 4 - 2 * (c % 4) as i32), bits45);
                        *wc = _mm512_or_si512(*wc, hb);
                    }
                }
            }
            let at = scale_at(F, lay, b);
            if (F == Q4K || F == Q5K || F == Q6K || F == IQ4XS) && b % SUPER == 0 {
                d_super = f16x16(at.d);
                if F == Q4K || F == Q5K {
                    m_super = f16x16(at.m);
                }
            }
            // The block's scales (the second is Q6_K's second half, or the additive term).
            let (d, m) = match F {
                Q4K | Q5K => (
                    _mm512_mul_ps(d_super, u8x16(at.sc)),
                    neg512(_mm512_mul_ps(m_super, u8x16(at.mins))),
                ),
                Q6K => (
                    _mm512_mul_ps(d_super, i8x16(at.sc)),
                    _mm512_mul_ps(d_super, i8x16(at.sc + GROUP)),
                ),
                IQ4XS => (_mm512_mul_ps(d_super, i8x16(at.sc)), _mm512_setzero_ps()),
                MLX4 | MLX8 => (half16(at.d), half16(at.m)),
                _ if has_min(F) => (f16x16(at.d), f16x16(at.m)),
                _ => (f16x16(at.d), _mm512_setzero_ps()),
            };
            each_row!(R, |r| {
                let x = xs[r].get_unchecked(b);
                let (i0, i1) = row_dots_vnni::<F, R>(&w, x);
                let xd = _mm512_set1_ps(x.d);
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, xd), _mm512_cvtepi32_ps(i0), acc[r]);
                if F == Q6K {
                    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(m, xd), _mm512_cvtepi32_ps(i1), acc[r]);
                } else if has_min(F) {
                    acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s), acc[r]);
                }
            });
            if runs.ends(b) {
                each_row!(R, |r| {
                    total[r] = _mm512_add_ps(total[r], acc[r]);
                    acc[r] = _mm512_setzero_ps();
                });
            }
        }
        for r in 0..R {
            _mm512_storeu_ps(out[r].as_mut_ptr(), total[r]);
        }
    }

    /// The same contract on AVX2: each group's 16 columns in two halves of 8.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn avx2<const F: u8, const R: usize>(
        grp: &[u8],
        lay: Lay,
        xs: [&[Q8Block]; R],
        out: &mut [[f32; GROUP]; ROWS],
    ) {
        let (qb, nb) = (quant_bytes(F), lay.nb);
        let p = grp.as_ptr();
        let low = _mm256_set1_epi8(0x0f);
        let (bit4, bits45) = (_mm256_set1_epi8(0x10), _mm256_set1_epi8(0x30));
        let grid256 =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_GRID.as_ptr() as *const __m128i));
        for h in 0..2 {
            let f16x8 =
                |at: usize| _mm256_cvtph_ps(_mm_loadu_si128(p.add(at + 16 * h) as *const __m128i));
            let half8 = |at: usize| {
                let raw = _mm_loadu_si128(p.add(at + 16 * h) as *const __m128i);
                if lay.bf16 {
                    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
                } else {
                    _mm256_cvtph_ps(raw)
                }
            };
            let u8x8 = |at: usize| {
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                    p.add(at + 8 * h) as *const __m128i
                )))
            };
            let i8x8 = |at: usize| {
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    p.add(at + 8 * h) as *const __m128i
                )))
            };
            let mut acc = [_mm256_setzero_ps(); R];
            let mut total = [_mm256_setzero_ps(); R];
            let mut runs = Runs::new(nb);
            let mut d_super = _mm256_setzero_ps();
            let mut m_super = _mm256_setzero_ps();
            for b in 0..nb {
                if h == 0 {
                    prefetch_next_group(grp, nb, b);
                }
                let q = p.add(b * qb + 32 * h);
                let chunk = |c: usize| _mm256_loadu_si256(q.add(64 * c) as *const __m256i);
                let mut w = [_mm256_setzero_si256(); 8];
                if bytes(F) {
                    for (c, wc) in w.iter_mut().enumerate() {
                        *wc = chunk(c);
                    }
                } else {
                    for j in 0..4 {
                        let raw = chunk(j);
                        w[j] = _mm256_and_si256(raw, low);
                        w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    }
                    if grid(F) {
                        for wc in w.iter_mut() {
                            *wc = _mm256_shuffle_epi8(grid256, *wc);
                        }
                    }
                    if planes(F) == 1 {
                        let hp = chunk(4);
                        for (c, wc) in w.iter_mut().enumerate() {
                            let hb = _mm256_and_si256(shift256(hp, 4 - c as i32), bit4);
                            *wc = _mm256_or_si256(*wc, hb);
                        }
                    } else if planes(F) == 2 {
                        for (c, wc) in w.iter_mut().enumerate() {
                            let hp = chunk(4 + c / 4);
                            let hb = _mm256_and_si256(shift256(hp, 4 - 2 * (c % 4) as i32), bits45);
                            *wc = _mm256_or_si256(*wc, hb);
                        }
                    }
                }
                let at = scale_at(F, lay, b);
                if (F == Q4K || F == Q5K || F == Q6K || F == IQ4XS) && b % SUPER == 0 {
                    d_super = f16x8(at.d);
                    if F == Q4K || F == Q5K {
                        m_super = f16x8(at.m);
                    }
                }
                let (d, m) = match F {
                    Q4K | Q5K => (
                        _mm256_mul_ps(d_super, u8x8(at.sc)),
                        neg256(_mm256_mul_ps(m_super, u8x8(at.mins))),
                    ),
                    Q6K => (
                        _mm256_mul_ps(d_super, i8x8(at.sc)),
                        _mm256_mul_ps(d_super, i8x8(at.sc + GROUP)),
                    ),
                    IQ4XS => (_mm256_mul_ps(d_super, i8x8(at.sc)), _mm256_setzero_ps()),
                    MLX4 | MLX8 => (half8(at.d), half8(at.m)),
                    _ if has_min(F) => (f16x8(at.d), f16x8(at.m)),
                    _ => (f16x8(at.d), _mm256_setzero_ps()),
                };
                each_row!(R, |r| {
                    let x = xs[r].get_unchecked(b);
                    let (i0, i1) = row_dots_avx2::<F>(&w, x);
                    let xd = _mm256_set1_ps(x.d);
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, xd), _mm256_cvtepi32_ps(i0), acc[r]);
                    if F == Q6K {
                        acc[r] =
                            _mm256_fmadd_ps(_mm256_mul_ps(m, xd), _mm256_cvtepi32_ps(i1), acc[r]);
                    } else if has_min(F) {
                        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s), acc[r]);
                    }
                });
                if runs.ends(b) {
                    each_row!(R, |r| {
                        total[r] = _mm256_add_ps(total[r], acc[r]);
                        acc[r] = _mm256_setzero_ps();
                    });
                }
            }
            for r in 0..R {
                _mm256_storeu_ps(out[r].as_mut_ptr().add(8 * h), total[r]);
            }
        }
    }
}

/// The contract on aarch64 with the dot-product extension (`sdot`: four signed bytes times four signed bytes
/// summed into each 32-bit lane): a group's 16 columns in four passes of 4, each 16-byte quarter of a
/// 64-byte chunk holding 4 columns' four values. The values are decoded to signed bytes as the portable kernel
/// decodes them (nibbles, high-bit planes, grid lookups, Q8_0's stored signed bytes), so `sdot` gives its exact
/// integer sums; the scales and the `fma` chains are the portable kernel's operations, lane by lane.
#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    use super::{
        bytes, f16_at, grid, half_at, has_min, offset, planes, quant_bytes, scale_at, Lay, Q8Block,
        Runs, GROUP, IQ4XS, IQ4_GRID, MLX4, MLX8, Q4K, Q5K, Q6K, ROWS, SUPER,
    };

    /// `acc + Σ a·b` over each lane's four byte pairs (`sdot`; `vdotq_s32` is not yet stable in Rust).
    #[inline(always)]
    unsafe fn sdot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        std::arch::asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    }

    /// Four activation bytes `4c..4c+4` of a block in every lane.
    #[inline(always)]
    unsafe fn x4(x: &Q8Block, c: usize) -> int8x16_t {
        let v = (x.qs.as_ptr().add(4 * c) as *const i32).read_unaligned();
        vreinterpretq_s8_s32(vdupq_n_s32(v))
    }

    /// Four f32 values from `f`, one per column of the quarter.
    #[inline(always)]
    unsafe fn lanes(f: impl Fn(usize) -> f32) -> float32x4_t {
        let v = [f(0), f(1), f(2), f(3)];
        vld1q_f32(v.as_ptr())
    }

    /// The group's columns for the rows `xs`, as [`super::portable`] computes them. The CPU must have the
    /// dot-product extension (`simd::int8_isa` checks).
    #[target_feature(enable = "neon,dotprod")]
    pub unsafe fn dot<const F: u8, const R: usize>(
        grp: &[u8],
        lay: Lay,
        xs: [&[Q8Block]; R],
        out: &mut [[f32; GROUP]; ROWS],
    ) {
        let (qb, nb) = (quant_bytes(F), lay.nb);
        let p = grp.as_ptr();
        let low = vdupq_n_u8(0x0f);
        let (bit4, bits45) = (vdupq_n_u8(0x10), vdupq_n_u8(0x30));
        let grid16 = vld1q_s8(IQ4_GRID.as_ptr());
        for h in 0..4 {
            // Column `4h + l`'s value of a per-column f16/byte array at `at`.
            let col = |l: usize| 4 * h + l;
            let mut acc = [vdupq_n_f32(0.0); R];
            let mut total = [vdupq_n_f32(0.0); R];
            let mut runs = Runs::new(nb);
            let mut d_super = vdupq_n_f32(0.0);
            let mut m_super = vdupq_n_f32(0.0);
            for b in 0..nb {
                let q = p.add(b * qb + 16 * h);
                let chunk = |c: usize| vld1q_u8(q.add(64 * c));
                let mut w = [vdupq_n_s8(0); 8];
                if bytes(F) {
                    for (c, wc) in w.iter_mut().enumerate() {
                        *wc = vreinterpretq_s8_u8(chunk(c));
                    }
                } else {
                    let mut u = [vdupq_n_u8(0); 8];
                    for j in 0..4 {
                        let raw = chunk(j);
                        u[j] = vandq_u8(raw, low);
                        u[j + 4] = vshrq_n_u8::<4>(raw);
                    }
                    if planes(F) == 1 {
                        let hp = chunk(4);
                        for (c, uc) in u.iter_mut().enumerate() {
                            let hb = vandq_u8(vshlq_u8(hp, vdupq_n_s8(4 - c as i8)), bit4);
                            *uc = vorrq_u8(*uc, hb);
                        }
                    } else if planes(F) == 2 {
                        for (c, uc) in u.iter_mut().enumerate() {
                            let hp = chunk(4 + c / 4);
                            let hb =
                                vandq_u8(vshlq_u8(hp, vdupq_n_s8(4 - 2 * (c % 4) as i8)), bits45);
                            *uc = vorrq_u8(*uc, hb);
                        }
                    }
                    for (wc, uc) in w.iter_mut().zip(u) {
                        *wc = if grid(F) {
                            vqtbl1q_s8(grid16, uc)
                        } else {
                            vreinterpretq_s8_u8(uc)
                        };
                    }
                }
                let at = scale_at(F, lay, b);
                if (F == Q4K || F == Q5K || F == Q6K || F == IQ4XS) && b % SUPER == 0 {
                    d_super = lanes(|l| f16_at(grp, at.d + 2 * col(l)));
                    if F == Q4K || F == Q5K {
                        m_super = lanes(|l| f16_at(grp, at.m + 2 * col(l)));
                    }
                }
                let u8s = |at: usize| lanes(|l| grp[at + col(l)] as f32);
                let i8s = |at: usize| lanes(|l| grp[at + col(l)] as i8 as f32);
                let (d, m) = match F {
                    Q4K | Q5K => (
                        vmulq_f32(d_super, u8s(at.sc)),
                        vnegq_f32(vmulq_f32(m_super, u8s(at.mins))),
                    ),
                    Q6K => (
                        vmulq_f32(d_super, i8s(at.sc)),
                        vmulq_f32(d_super, i8s(at.sc + GROUP)),
                    ),
                    IQ4XS => (vmulq_f32(d_super, i8s(at.sc)), vdupq_n_f32(0.0)),
                    MLX4 | MLX8 => (
                        lanes(|l| half_at(grp, at.d + 2 * col(l), lay.bf16)),
                        lanes(|l| half_at(grp, at.m + 2 * col(l), lay.bf16)),
                    ),
                    _ if has_min(F) => (
                        lanes(|l| f16_at(grp, at.d + 2 * col(l))),
                        lanes(|l| f16_at(grp, at.m + 2 * col(l))),
                    ),
                    _ => (lanes(|l| f16_at(grp, at.d + 2 * col(l))), vdupq_n_f32(0.0)),
                };
                each_row!(R, |r| {
                    let x = xs[r].get_unchecked(b);
                    // The integer sums (Q6_K: its two halves apart), started at −offset·Σx as the contract's.
                    let (i0, i1) = if F == Q6K {
                        let (mut i0, mut i1) = (
                            vdupq_n_s32(-32 * x.sum_lo),
                            vdupq_n_s32(-32 * (x.sum - x.sum_lo)),
                        );
                        for c in 0..4 {
                            i0 = sdot(i0, w[c], x4(x, c));
                            i1 = sdot(i1, w[c + 4], x4(x, c + 4));
                        }
                        (i0, i1)
                    } else {
                        let (mut i0, mut i1) = (vdupq_n_s32(-offset(F) * x.sum), vdupq_n_s32(0));
                        for c in (0..8).step_by(2) {
                            i0 = sdot(i0, w[c], x4(x, c));
                            i1 = sdot(i1, w[c + 1], x4(x, c + 1));
                        }
                        (vaddq_s32(i0, i1), vdupq_n_s32(0))
                    };
                    let xd = vdupq_n_f32(x.d);
                    acc[r] = vfmaq_f32(acc[r], vmulq_f32(d, xd), vcvtq_f32_s32(i0));
                    if F == Q6K {
                        acc[r] = vfmaq_f32(acc[r], vmulq_f32(m, xd), vcvtq_f32_s32(i1));
                    } else if has_min(F) {
                        acc[r] = vfmaq_f32(acc[r], m, vdupq_n_f32(x.s));
                    }
                });
                if runs.ends(b) {
                    each_row!(R, |r| {
                        total[r] = vaddq_f32(total[r], acc[r]);
                        acc[r] = vdupq_n_f32(0.0);
                    });
                }
            }
            for r in 0..R {
                vst1q_f32(out[r].as_mut_ptr().add(4 * h), total[r]);
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

    /// A random matrix of `n` columns and `nb` 32-value blocks with small, sign-mixed, finite scales.
    fn matrix(ty: GgmlType, n: usize, nb: usize, seed: &mut u64) -> QMatrix {
        let bb = ty.block_bytes();
        let blocks = n * nb * 32 / ty.block_len();
        let mut w: Vec<u8> = (0..blocks * bb).map(|_| lcg(seed) as u8).collect();
        for blk in w.chunks_exact_mut(bb) {
            let mut put = |at: usize, v: f32| {
                blk[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes())
            };
            let d = (lcg(seed) % 1000) as f32 * 1e-4 - 0.05;
            let m = (lcg(seed) % 1000) as f32 * 1e-3 - 0.5;
            match ty {
                GgmlType::Q6K => put(208, d),
                GgmlType::Q3K => put(108, d),
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => {
                    put(0, d);
                    put(2, m);
                }
                _ => put(0, d),
            }
        }
        QMatrix::ggml("w", ty, n, nb * 32, Bytes::owned(w)).unwrap()
    }

    /// A random MLX affine matrix of `n` columns and `nb` 32-value blocks, with finite 16-bit scales and biases.
    fn mlx_matrix(
        bits: u32,
        group: usize,
        st: MlxScaleType,
        n: usize,
        nb: usize,
        seed: &mut u64,
    ) -> QMatrix {
        let q = crate::quant::MlxAffine::new(bits, group, st).unwrap();
        let k = nb * 32;
        let words: Vec<u8> = (0..n * k * bits as usize / 8)
            .map(|_| lcg(seed) as u8)
            .collect();
        let mut halves = |scale: f32, shift: f32| -> Vec<u8> {
            (0..n * k / group)
                .flat_map(|_| {
                    let v = (lcg(seed) % 1000) as f32 * scale - shift;
                    match st {
                        MlxScaleType::BF16 => half::bf16::from_f32(v).to_le_bytes(),
                        _ => f16::from_f32(v).to_le_bytes(),
                    }
                })
                .collect()
        };
        let (scales, biases) = (halves(1e-4, 0.05), halves(1e-3, 0.5));
        let (w, s, b) = (
            Bytes::owned(words),
            Bytes::owned(scales),
            Bytes::owned(biases),
        );
        QMatrix::mlx("mlx", q, n, k, w, s, b).unwrap()
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
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("dotprod") {
                v.push(Int8Isa::NeonDot);
            }
        }
        v
    }

    /// The contract's arithmetic for column `col`, read from the stored blocks through their integer view.
    fn stored_dot(m: &QMatrix, col: usize, x: &[Q8Block]) -> f32 {
        let nb = m.cols / 32;
        let (ty, additive) = match m.format {
            WeightFormat::Ggml(ty) => (
                Some(ty),
                matches!(
                    ty,
                    GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K
                ),
            ),
            WeightFormat::Mlx(_) => (None, true),
        };
        let (mut acc, mut total) = (0f32, 0f32);
        // The runs, written out: run s is blocks s·nb/S .. (s+1)·nb/S.
        let runs = INT8_RUNS.min(nb);
        let ends: Vec<usize> = (1..=runs).map(|s| s * nb / runs).collect();
        for (b, xb) in x[..nb].iter().enumerate() {
            let ib = match ty {
                Some(ty) => {
                    let (bb, subs) = (ty.block_bytes(), ty.block_len() / 32);
                    let blk = &m.data()[(col * nb / subs + b / subs) * bb..][..bb];
                    ty.int_block(blk, b % subs)
                }
                None => {
                    let p = m.mlx_parts().unwrap();
                    p.q.int_block((p.words, p.scales, p.biases), m.cols, col, b)
                }
            };
            let dot = |r: std::ops::Range<usize>, sum: i32| -> f32 {
                let i: i32 = r.map(|e| ib.q[e] as i32 * xb.qs[e] as i32).sum();
                (i - ib.offset * sum) as f32
            };
            if matches!(ty, Some(GgmlType::Q6K | GgmlType::Q3K)) {
                acc = (ib.d[0] * xb.d).mul_add(dot(0..16, xb.sum_lo), acc);
                acc = (ib.d[1] * xb.d).mul_add(dot(16..32, xb.sum - xb.sum_lo), acc);
            } else {
                acc = (ib.d[0] * xb.d).mul_add(dot(0..32, xb.sum), acc);
                if additive {
                    acc = ib.m.mul_add(xb.s, acc);
                }
            }
            if ends.contains(&(b + 1)) {
                total += acc;
                acc = 0.0;
            }
        }
        total
    }

    /// Every instruction set gives bitwise the contract's arithmetic read from the stored layout, for every
    /// format, row count 1..=8 and a column count that leaves a partial group.
    #[test]
    fn every_kernel_is_bitwise_the_contract_on_ragged_shapes() {
        let mut seed = 0x5eed_u64;
        let mut mats = Vec::new();
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
            GgmlType::Q3K,
            GgmlType::IQ4NL,
            GgmlType::IQ4XS,
        ] {
            // Fewer blocks than runs (a run per block), and several blocks per run.
            for nb in if ty.block_len() == 32 {
                [5, 37]
            } else {
                [16, 40]
            } {
                mats.push(matrix(ty, 37, nb, &mut seed));
            }
        }
        for (bits, group, st) in [
            (4, 32, MlxScaleType::F16),
            (4, 64, MlxScaleType::BF16),
            (8, 128, MlxScaleType::F16),
            (8, 64, MlxScaleType::BF16),
        ] {
            for nb in [8, 36] {
                mats.push(mlx_matrix(bits, group, st, 37, nb, &mut seed));
            }
        }
        for m in &mats {
            let (n, nb) = (m.rows, m.cols / 32);
            let p = Packed::new(m).unwrap();
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
                                let want = if col < n { stored_dot(m, col, x) } else { 0.0 };
                                assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{} {isa:?} rows {rows} row {r} col {col}: {got} vs {want}",
                                    m.format
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
        let m = QMatrix::ggml("h", GgmlType::BF16, 2, 32, Bytes::owned(vec![0; 128])).unwrap();
        assert!(Packed::new(&m).is_none());
        let q = crate::quant::MlxAffine::new(4, 32, MlxScaleType::F32).unwrap();
        let m = QMatrix::mlx(
            "m",
            q,
            2,
            32,
            Bytes::owned(vec![0; 32]),
            Bytes::owned(vec![0; 8]),
            Bytes::owned(vec![0; 8]),
        )
        .unwrap();
        assert!(Packed::new(&m).is_none(), "f32 MLX scales run the f32 path");
    }
}
