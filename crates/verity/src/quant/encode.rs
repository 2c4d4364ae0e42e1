//! Block encoders: f32 rows to GGML blocks, bit for bit as llama.cpp's reference quantizers write them.
//!
//! Written by hand because no crate encodes GGML blocks, and because `verity quantize` promises the blocks
//! llama.cpp's quantizer writes for the same input (a model quantized by either tool is the same file). The
//! reference functions (`quantize_row_*_ref` in ggml-quants.c, used whenever no importance matrix is given) are
//! plain f32 arithmetic, compiled without fused multiply-adds; each function here performs the same operations
//! in the same order and precision (Rust never fuses or reorders float operations), including the reference's
//! integer conversions (truncation toward zero, the magic-number rounding of `nearest_int`). The fixtures in
//! `tests/fixtures/quantize/` hold llama.cpp's output for two test models and every preset.

use half::{bf16, f16};

use super::ggml::f16_at;
use super::GgmlType;

const QK_K: usize = 256;
/// Sub-blocks whose largest magnitude is below this are all-zero to the K-quant encoders.
const GROUP_MAX_EPS: f32 = 1e-15;

/// Encode one row of `x.len()` values as `ty` into `out` (exactly `ty.row_bytes(x.len())` bytes).
///
/// The caller guarantees whole blocks; this is an internal contract, checked by the quantizer's planner.
pub fn encode_row(ty: GgmlType, x: &[f32], out: &mut [u8]) {
    debug_assert_eq!(Some(out.len()), ty.row_bytes(x.len()));
    match ty {
        GgmlType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
            }
        }
        _ => {
            let (n, bytes) = (ty.block_len(), ty.block_bytes());
            for (xb, ob) in x.chunks_exact(n).zip(out.chunks_exact_mut(bytes)) {
                match ty {
                    GgmlType::Q4_0 => q4_0(xb, ob),
                    GgmlType::Q4_1 => q4_1(xb, ob),
                    GgmlType::Q5_0 => q5_0(xb, ob),
                    GgmlType::Q5_1 => q5_1(xb, ob),
                    GgmlType::Q8_0 => q8_0(xb, ob),
                    GgmlType::Q2K => q2_k(xb, ob),
                    GgmlType::Q3K => q3_k(xb, ob),
                    GgmlType::Q4K => q4_k(xb, ob),
                    GgmlType::Q5K => q5_k(xb, ob),
                    GgmlType::Q6K => q6_k(xb, ob),
                    GgmlType::IQ4NL | GgmlType::IQ4XS => {
                        unreachable!("the quantizer does not offer {}", ty.name())
                    }
                    GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => unreachable!(),
                }
            }
        }
    }
}

/// Whether `encode_row` writes `ty`.
pub fn can_encode(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::IQ4NL | GgmlType::IQ4XS)
}

fn put_f16(out: &mut [u8], v: f32) {
    out[..2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

fn f16_round_trip(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// C's float-to-integer conversion as x86-64 compiles it: truncation toward zero.
fn trunc(v: f32) -> i32 {
    v as i32
}

/// ggml's `nearest_int`: round half to even by adding 1.5 * 2^23 and reading the mantissa.
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0f32).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// The value of largest magnitude (the first of equal magnitudes).
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

fn inverse(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

fn q4_0(x: &[f32], out: &mut [u8]) {
    let (_, max) = signed_absmax(x);
    let d = max / -8.0;
    let id = inverse(d);
    put_f16(out, d);
    for j in 0..16 {
        let lo = trunc(x[j] * id + 8.5) as i8 as i32;
        let hi = trunc(x[j + 16] * id + 8.5) as i8 as i32;
        out[2 + j] = (lo.min(15) as u8) | ((hi.min(15) as u8) << 4);
    }
}

fn q4_1(x: &[f32], out: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse(d);
    put_f16(out, d);
    put_f16(&mut out[2..], min);
    for j in 0..16 {
        let lo = trunc((x[j] - min) * id + 0.5) as i8 as i32;
        let hi = trunc((x[j + 16] - min) * id + 0.5) as i8 as i32;
        out[4 + j] = (lo.min(15) as u8) | ((hi.min(15) as u8) << 4);
    }
}

fn q5_0(x: &[f32], out: &mut [u8]) {
    let (_, max) = signed_absmax(x);
    let d = max / -16.0;
    let id = inverse(d);
    put_f16(out, d);
    let mut qh = 0u32;
    for j in 0..16 {
        let lo = (trunc(x[j] * id + 16.5) as i8 as i32).min(31) as u8;
        let hi = (trunc(x[j + 16] * id + 16.5) as i8 as i32).min(31) as u8;
        out[6 + j] = (lo & 0x0f) | ((hi & 0x0f) << 4);
        qh |= (((lo & 0x10) >> 4) as u32) << j;
        qh |= (((hi & 0x10) >> 4) as u32) << (j + 16);
    }
    out[2..6].copy_from_slice(&qh.to_le_bytes());
}

fn q5_1(x: &[f32], out: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse(d);
    put_f16(out, d);
    put_f16(&mut out[2..], min);
    let mut qh = 0u32;
    for j in 0..16 {
        let lo = trunc((x[j] - min) * id + 0.5) as u8;
        let hi = trunc((x[j + 16] - min) * id + 0.5) as u8;
        out[8 + j] = (lo & 0x0f) | ((hi & 0x0f) << 4);
        qh |= (((lo & 0x10) >> 4) as u32) << j;
        qh |= (((hi & 0x10) >> 4) as u32) << (j + 16);
    }
    out[4..8].copy_from_slice(&qh.to_le_bytes());
}

fn q8_0(x: &[f32], out: &mut [u8]) {
    let mut amax = 0.0f32;
    for &v in x {
        amax = if amax > v.abs() { amax } else { v.abs() };
    }
    let d = amax / 127.0;
    let id = inverse(d);
    put_f16(out, d);
    for (o, &v) in out[2..34].iter_mut().zip(x) {
        *o = trunc((v * id).round()) as i8 as u8;
    }
}

/// Scale steps of `make_qkx2_quants` evaluated side by side (lanes of one vector where the compiler has them).
/// Four, not eight: an improvement that moves `min` discards the steps evaluated after it, and improvements
/// come often enough that wider batches waste what their lanes gain.
const STEPS: usize = 4;

/// ggml's `make_qkx2_quants`: levels `l` in 0..=nmax for `x ≈ scale * l - min`, searching `nstep + 1` scales
/// for the least weighted error (absolute with `mad`, else squared). Returns (scale, min) and leaves the levels
/// in `levels`.
///
/// The reference tries the steps one after another, and a step that improves the fit moves `min`, which the
/// later steps start from. Here [`STEPS`] steps are evaluated at once from the current `min` (each with its own
/// sums, accumulated in the reference's order, so each is bitwise the reference's), then taken in order as the
/// reference takes them; after an improvement that moves `min`, the steps after it are evaluated again from the
/// new `min`. Most sub-blocks improve a few times in 16 or 21 steps, so the work is a few passes instead of one
/// per step.
fn make_qkx2_quants(search: Search, x: &[f32], weights: &[f32], levels: &mut [u8]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present. The same operations, the steps in vector lanes.
        return unsafe { qkx2_avx2(search, x, weights, levels) };
    }
    qkx2(search, x, weights, levels)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn qkx2_avx2(search: Search, x: &[f32], weights: &[f32], levels: &mut [u8]) -> (f32, f32) {
    qkx2(search, x, weights, levels)
}

/// The search a `make_qkx2_quants` call runs: levels `0..=nmax`; `nstep + 1` inverse scales
/// `(nmax + rmin + rdelta·i) / range`; the absolute error (`mad`) or the squared one.
#[derive(Clone, Copy)]
struct Search {
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    mad: bool,
}

#[inline(always)]
fn qkx2(search: Search, x: &[f32], weights: &[f32], levels: &mut [u8]) -> (f32, f32) {
    let Search {
        nmax,
        rmin,
        rdelta,
        nstep,
        mad,
    } = search;
    let error = |diff: f32| if mad { diff.abs() } else { diff * diff };
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        levels[..n].fill(0);
        return (0.0, -min);
    }
    let iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        levels[i] = l as u8;
        best_error += weights[i] * error(scale * l as f32 + min - x[i]);
    }
    let level = |iscale: f32, xm: f32| nearest_int(iscale * xm).clamp(0, nmax) as f32;
    // The last improvement's step: its inverse scale and the `min` its levels were taken from.
    let mut chosen: Option<(f32, f32)> = None;
    let mut is = 0;
    while is <= nstep {
        let isc: [f32; STEPS] = std::array::from_fn(|j| {
            (rmin + rdelta * (is + j as i32) as f32 + nmax as f32) / (max - min)
        });
        let (mut sum_l, mut sum_l2, mut sum_xl) =
            ([0.0f32; STEPS], [0.0f32; STEPS], [0.0f32; STEPS]);
        for i in 0..n {
            let (xm, w, xi) = (x[i] - min, weights[i], x[i]);
            for j in 0..STEPS {
                let lf = level(isc[j], xm);
                sum_l[j] += w * lf;
                sum_l2[j] += w * lf * lf;
                sum_xl[j] += w * lf * xi;
            }
        }
        let mut this_scale = [0.0f32; STEPS];
        let mut this_min = [0.0f32; STEPS];
        let mut fits = [false; STEPS];
        for j in 0..STEPS {
            let det = sum_w * sum_l2[j] - sum_l[j] * sum_l[j];
            fits[j] = det > 0.0;
            this_scale[j] = (sum_w * sum_xl[j] - sum_x * sum_l[j]) / det;
            this_min[j] = (sum_l2[j] * sum_x - sum_l[j] * sum_xl[j]) / det;
            if this_min[j] > 0.0 {
                this_min[j] = 0.0;
                this_scale[j] = sum_xl[j] / sum_l2[j];
            }
        }
        let mut cur_error = [0.0f32; STEPS];
        for i in 0..n {
            let (xm, w, xi) = (x[i] - min, weights[i], x[i]);
            for j in 0..STEPS {
                cur_error[j] += w * error(this_scale[j] * level(isc[j], xm) + this_min[j] - xi);
            }
        }
        let steps = STEPS.min((nstep - is + 1) as usize);
        let mut taken = steps;
        for j in 0..steps {
            if fits[j] && cur_error[j] < best_error {
                best_error = cur_error[j];
                scale = this_scale[j];
                chosen = Some((isc[j], min));
                let moved = this_min[j] != min;
                min = this_min[j];
                if moved {
                    taken = j + 1;
                    break;
                }
            }
        }
        is += taken as i32;
    }
    if let Some((isc, from)) = chosen {
        for i in 0..n {
            levels[i] = level(isc, x[i] - from) as u8;
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` with weights x² (`rmse_type` 1, no importance matrix): signed levels for
/// `x ≈ scale * (L - nmax)`, searching 19 scales around `nmax / max`. Stores `L` (0..2·nmax) in `levels`.
fn make_qx_quants(nmax: i32, x: &[f32], levels: &mut [i8]) -> f32 {
    let (amax, max) = {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            let ax = v.abs();
            if ax > amax {
                amax = ax;
                max = v;
            }
        }
        (amax, max)
    };
    if amax < GROUP_MAX_EPS {
        levels[..x.len()].fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = level(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let mut iscale = -(nmax as f32) / max;
    for (o, &v) in levels.iter_mut().zip(x) {
        *o = (level(iscale, v) + nmax) as i8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1f32 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (o, &v) in levels.iter_mut().zip(x) {
                *o = (level(iscale, v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_q3_quants` with its error-reducing passes: signed levels in -nmax..nmax for `x ≈ scale * l`,
/// starting from `nmax / max` and moving single levels while the x²-weighted fit improves (at most 5 passes).
/// Stores `l + nmax` in `levels`.
fn make_q3_quants(nmax: i32, x: &[f32], levels: &mut [i8]) -> f32 {
    let (amax, max) = {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        (amax, max)
    };
    if amax < GROUP_MAX_EPS {
        levels[..x.len()].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    let mut l = [0i32; 16];
    for (i, &v) in x.iter().enumerate() {
        l[i] = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        let w = v * v;
        sumlx += w * v * l[i] as f32;
        suml2 += w * l[i] as f32 * l[i] as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (i, &v) in x.iter().enumerate() {
            let w = v * v;
            let mut slx = sumlx - w * v * l[i] as f32;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * l[i] as f32 * l[i] as f32;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l[i] {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for (o, &li) in levels.iter_mut().zip(&l[..x.len()]) {
        *o = (li + nmax) as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Pack 256 two-bit levels as Q2_K and Q3_K store them: byte `l` of each 32-byte run holds values `l`, `l+32`,
/// `l+64` and `l+96` of its 128, lowest bits first.
fn pack_2bit(levels: &[u8], qs: &mut [u8]) {
    for (lv, q) in levels.chunks_exact(128).zip(qs.chunks_exact_mut(32)) {
        for l in 0..32 {
            q[l] = lv[l] | (lv[l + 32] << 2) | (lv[l + 64] << 4) | (lv[l + 96] << 6);
        }
    }
}

/// Q2_K's search: 2-bit levels, the absolute error.
const Q2_K_SEARCH: Search = Search {
    nmax: 3,
    rmin: -0.5,
    rdelta: 0.1,
    nstep: 15,
    mad: true,
};

fn q2_k(x: &[f32], out: &mut [u8]) {
    let mut levels = [0u8; QK_K];
    let (mut scales, mut mins) = ([0.0f32; 16], [0.0f32; 16]);
    let mut weights = [0.0f32; 16];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = v.abs();
        }
        let lv = &mut levels[16 * j..16 * j + 16];
        (scales[j], mins[j]) = make_qkx2_quants(Q2_K_SEARCH, xs, &weights, lv);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    // Layout: scales[16] (scale in the low nibble, min in the high), qs[64], d, dmin.
    let (packed, rest) = out.split_at_mut(16);
    if max_scale > 0.0 {
        let iscale = 15.0 / max_scale;
        for (p, &sc) in packed.iter_mut().zip(&scales) {
            *p = nearest_int(iscale * sc) as u8;
        }
        put_f16(&mut rest[64..], max_scale / 15.0);
    } else {
        packed.fill(0);
        put_f16(&mut rest[64..], 0.0);
    }
    if max_min > 0.0 {
        let iscale = 15.0 / max_min;
        for (p, &m) in packed.iter_mut().zip(&mins) {
            *p |= (nearest_int(iscale * m) << 4) as u8;
        }
        put_f16(&mut rest[66..], max_min / 15.0);
    } else {
        put_f16(&mut rest[66..], 0.0);
    }
    let (d_all, dmin_all) = (f16_at(rest, 64), f16_at(rest, 66));
    for (j, &sc) in packed.iter().enumerate() {
        let d = d_all * (sc & 0x0f) as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * (sc >> 4) as f32;
        for i in 16 * j..16 * j + 16 {
            levels[i] = nearest_int((x[i] + dm) / d).clamp(0, 3) as u8;
        }
    }
    pack_2bit(&levels, &mut rest[..64]);
}

fn q3_k(x: &[f32], out: &mut [u8]) {
    let mut levels = [0i8; QK_K];
    let mut scales = [0.0f32; 16];
    let (mut max_scale, mut amax) = (0.0f32, 0.0f32);
    for j in 0..16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut levels[16 * j..16 * j + 16]);
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    // Layout: hmask[32], qs[64], scales[12], d.
    let (hmask, rest) = out.split_at_mut(32);
    let (qs, rest) = rest.split_at_mut(64);
    let packed = &mut rest[..12];
    packed.fill(0);
    if max_scale != 0.0 {
        let iscale = -32.0f32 / max_scale;
        for (j, &sc) in scales.iter().enumerate() {
            let l = ((nearest_int(iscale * sc) as i8 as i32).clamp(-32, 31) + 32) as u8;
            if j < 8 {
                packed[j] = l & 0x0f;
            } else {
                packed[j - 8] |= (l & 0x0f) << 4;
            }
            packed[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
        }
        put_f16(&mut rest[12..], 1.0 / iscale);
    } else {
        put_f16(&mut rest[12..], 0.0);
    }
    let d_all = f16_at(rest, 12);
    let unpacked = crate::quant::ggml::q3_k_scales(&rest[..12]);
    for (j, &sc) in unpacked.iter().enumerate() {
        let d = d_all * sc as f32;
        if d == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            levels[i] = (nearest_int(x[i] / d).clamp(-4, 3) + 4) as i8;
        }
    }
    hmask.fill(0);
    let mut low = [0u8; QK_K];
    for (j, (&l, lo)) in levels.iter().zip(low.iter_mut()).enumerate() {
        let mut l = l as u8;
        if l > 3 {
            hmask[j % 32] |= 1 << (j / 32);
            l -= 4;
        }
        *lo = l;
    }
    pack_2bit(&low, qs);
}

/// The 6-bit scale and min of sub-block `j` from the 12 packed bytes of a Q4_K/Q5_K block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The shared half of Q4_K and Q5_K: eight 32-value sub-blocks, each with a 6-bit scale and min under the
/// block's f16 `d` and `dmin`. Writes `d`, `dmin` and the 12 scale bytes into `head` and the levels into `levels`.
fn k_quant_scales(
    x: &[f32],
    nmax: i32,
    rmin: f32,
    nstep: i32,
    head: &mut [u8],
    levels: &mut [u8; QK_K],
) {
    let mut scales = [0.0f32; QK_K / 32];
    let mut mins = [0.0f32; QK_K / 32];
    let mut weights = [0.0f32; 32];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..QK_K / 32 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let search = Search {
            nmax,
            rmin,
            rdelta: 0.1,
            nstep,
            mad: false,
        };
        let (scale, min) = make_qkx2_quants(search, xs, &weights, &mut levels[32 * j..32 * j + 32]);
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let packed = &mut head[4..16];
    packed.fill(0);
    for j in 0..QK_K / 32 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    put_f16(head, max_scale / 63.0);
    put_f16(&mut head[2..], max_min / 63.0);
    let d_all = f16_round_trip(max_scale / 63.0);
    let dmin_all = f16_round_trip(max_min / 63.0);
    for j in 0..QK_K / 32 {
        let (sc, m) = scale_min_k4(j, &head[4..16]);
        let d = d_all * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * m as f32;
        for i in 32 * j..32 * j + 32 {
            levels[i] = nearest_int((x[i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
}

fn q4_k(x: &[f32], out: &mut [u8]) {
    let mut levels = [0u8; QK_K];
    k_quant_scales(x, 15, -1.0, 20, out, &mut levels);
    let qs = &mut out[16..144];
    for (chunk, q) in levels.chunks_exact(64).zip(qs.chunks_exact_mut(32)) {
        for l in 0..32 {
            q[l] = chunk[l] | (chunk[l + 32] << 4);
        }
    }
}

fn q5_k(x: &[f32], out: &mut [u8]) {
    let mut levels = [0u8; QK_K];
    k_quant_scales(x, 31, -0.5, 15, out, &mut levels);
    let (qh, qs) = out[16..176].split_at_mut(32);
    qh.fill(0);
    let (mut m1, mut m2) = (1u8, 2u8);
    for (chunk, q) in levels.chunks_exact(64).zip(qs.chunks_exact_mut(32)) {
        for j in 0..32 {
            let mut l1 = chunk[j];
            if l1 > 15 {
                l1 -= 16;
                qh[j] |= m1;
            }
            let mut l2 = chunk[j + 32];
            if l2 > 15 {
                l2 -= 16;
                qh[j] |= m2;
            }
            q[j] = l1 | (l2 << 4);
        }
        m1 <<= 2;
        m2 <<= 2;
    }
}

fn q6_k(x: &[f32], out: &mut [u8]) {
    let mut levels = [0i8; QK_K];
    let mut scales = [0.0f32; QK_K / 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for ib in 0..QK_K / 16 {
        let scale = make_qx_quants(
            32,
            &x[16 * ib..16 * ib + 16],
            &mut levels[16 * ib..16 * ib + 16],
        );
        scales[ib] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    // Layout: ql[128], qh[64], scales[16] (i8), d (f16).
    if max_abs_scale < GROUP_MAX_EPS {
        out[..210].fill(0);
        put_f16(&mut out[208..], 0.0);
        return;
    }
    let iscale = -128.0f32 / max_scale;
    put_f16(&mut out[208..], 1.0 / iscale);
    let d_all = f16_round_trip(1.0 / iscale);
    for ib in 0..QK_K / 16 {
        out[192 + ib] = nearest_int(iscale * scales[ib]).min(127) as i8 as u8;
    }
    for j in 0..QK_K / 16 {
        let d = d_all * (out[192 + j] as i8) as f32;
        if d == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            levels[i] = (nearest_int(x[i] / d).clamp(-32, 31) + 32) as i8;
        }
    }
    let (ql, rest) = out.split_at_mut(128);
    let qh = &mut rest[..64];
    for (half, lv) in levels.chunks_exact(128).enumerate() {
        let (ql, qh) = (
            &mut ql[64 * half..64 * half + 64],
            &mut qh[32 * half..32 * half + 32],
        );
        for l in 0..32 {
            let q = |k: usize| lv[l + 32 * k] as u8;
            ql[l] = (q(0) & 0x0f) | ((q(2) & 0x0f) << 4);
            ql[l + 32] = (q(1) & 0x0f) | ((q(3) & 0x0f) << 4);
            qh[l] = (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values with every magnitude a model holds, some zero blocks and some constant ones.
    fn sample(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                match (i / 256) % 4 {
                    0 => 0.0,
                    1 => 0.03,
                    _ => u * (1 + i % 7) as f32,
                }
            })
            .collect()
    }

    fn decode(ty: GgmlType, row: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; n];
        for (b, o) in out.chunks_mut(ty.block_len().max(32)).enumerate() {
            ty.decode_block(row, b, o);
        }
        out
    }

    #[test]
    fn every_format_decodes_back_close_to_its_input() {
        let x = sample(2048, 7);
        let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        for (ty, tol) in [
            (GgmlType::F32, 0.0),
            (GgmlType::F16, 2e-3),
            (GgmlType::BF16, 2e-2),
            (GgmlType::Q8_0, 0.01),
            (GgmlType::Q6K, 0.04),
            (GgmlType::Q5_0, 0.07),
            (GgmlType::Q5_1, 0.07),
            (GgmlType::Q5K, 0.07),
            (GgmlType::Q4_0, 0.15),
            (GgmlType::Q3K, 0.3),
            (GgmlType::Q2K, 0.6),
            (GgmlType::Q4_1, 0.15),
            (GgmlType::Q4K, 0.15),
        ] {
            let mut row = vec![0u8; ty.row_bytes(x.len()).unwrap()];
            encode_row(ty, &x, &mut row);
            let y = decode(ty, &row, x.len());
            for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                assert!(
                    (a - b).abs() <= tol * amax,
                    "{} value {i}: {a} came back as {b}",
                    ty.name()
                );
            }
        }
    }

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(
            [0.5, 1.5, 2.5, -0.5, -1.5, 2.4999, 7.0].map(nearest_int),
            [0, 2, 2, 0, -2, 2, 7]
        );
    }
}
