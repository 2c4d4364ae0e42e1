//! The exponential of the softmax and of SwiGLU: one fixed polynomial, in scalar code and for AVX2 with the same
//! operations lane by lane, so both give the same bits. Why not libm's `expf`: a W-row verify takes W times
//! the exponentials of a step, and a vectorised exponential is several times cheaper.

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two (Cody–Waite), so `x - n·ln2` loses no precision.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Below this, `e^x` is under f32's normal range; inputs are clamped to it (a softmax weight of ~1e-38).
const EXP_MIN: f32 = -87.336_55;
/// Above this, `e^x` would overflow f32; inputs are clamped to it.
const EXP_MAX: f32 = 88.0;
/// The minimax polynomial of `(e^r - 1 - r) / r²` on `|r| ≤ ln2/2` (Cephes `expf`).
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` for `x` in `[-87.3, 88]` (clamped outside), within ~2 ulp: `x = n·ln2 + r`, `e^r` by the polynomial,
/// times `2^n`. The AVX2 path does the same operations lane by lane.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// [`exp`] on eight lanes.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)),
        _mm256_set1_ps(EXP_MAX),
    );
    let n = _mm256_round_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(
        _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
        _mm256_set1_ps(1.0),
    );
    let bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_mul_ps(y, _mm256_castsi256_ps(bits))
}

/// `silu(g) · u = g / (1 + e^-g) · u`, the one definition every SwiGLU path uses.
#[inline(always)]
pub fn silu_times(g: f32, u: f32) -> f32 {
    g / (1.0 + exp(-g)) * u
}

/// `√(8/π)`: GELU's tanh form `0.5·g·(1 + tanh(√(2/π)·z))` is `g / (1 + e^(-2·√(2/π)·z))`.
const GELU_K: f32 = 1.595_769_2;

/// `gelu_tanh(g) · u` with `gelu_tanh(g) = 0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³)))`, computed as the equal
/// `g / (1 + e^(-√(8/π)·g·(1 + 0.044715·g²)))`: one exponential, like [`silu_times`]. The one definition every
/// GeGLU path uses.
#[inline(always)]
pub fn gelu_tanh_times(g: f32, u: f32) -> f32 {
    let z = g * 0.044_715f32.mul_add(g * g, 1.0);
    g / (1.0 + exp(-GELU_K * z)) * u
}

/// [`gelu_tanh_times`] on eight lanes, bitwise the same.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn gelu_tanh_times_avx2(
    g: std::arch::x86_64::__m256,
    u: std::arch::x86_64::__m256,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let z = _mm256_mul_ps(
        g,
        _mm256_fmadd_ps(
            _mm256_set1_ps(0.044_715),
            _mm256_mul_ps(g, g),
            _mm256_set1_ps(1.0),
        ),
    );
    let e = exp_avx2(_mm256_mul_ps(_mm256_set1_ps(-GELU_K), z));
    _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e)), u)
}

/// [`silu_times`] on eight lanes.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn silu_times_avx2(
    g: std::arch::x86_64::__m256,
    u: std::arch::x86_64::__m256,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e)), u)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exponential_is_within_two_ulp_of_libm_on_the_softmax_range() {
        let mut x = 0f32;
        while x > -90.0 {
            let (got, want) = (exp(x), x.exp());
            if want > f32::MIN_POSITIVE {
                let ulp = (got.to_bits() as i64 - want.to_bits() as i64).abs();
                assert!(ulp <= 2, "exp({x}) = {got}, libm {want}");
            }
            x -= 0.000_731;
        }
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn the_exponential_is_within_two_ulp_of_libm_for_positive_inputs() {
        let mut x = 0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            let ulp = (got.to_bits() as i64 - want.to_bits() as i64).abs();
            assert!(ulp <= 2, "exp({x}) = {got}, libm {want}");
            x += 0.000_913;
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_exponential_and_silu_are_bitwise_the_scalar_ones() {
        use std::arch::x86_64::*;
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        let mut x = -100f32;
        while x < 100.0 {
            let xs: [f32; 8] = std::array::from_fn(|l| x + l as f32 * 0.0173);
            let us: [f32; 8] = std::array::from_fn(|l| 1.5 - l as f32 * 0.37);
            let (mut e, mut s, mut g) = ([0f32; 8], [0f32; 8], [0f32; 8]);
            unsafe {
                let xv = _mm256_loadu_ps(xs.as_ptr());
                let uv = _mm256_loadu_ps(us.as_ptr());
                _mm256_storeu_ps(e.as_mut_ptr(), exp_avx2(xv));
                _mm256_storeu_ps(s.as_mut_ptr(), silu_times_avx2(xv, uv));
                _mm256_storeu_ps(g.as_mut_ptr(), gelu_tanh_times_avx2(xv, uv));
            }
            for l in 0..8 {
                assert_eq!(e[l].to_bits(), exp(xs[l]).to_bits(), "exp({})", xs[l]);
                assert_eq!(
                    s[l].to_bits(),
                    silu_times(xs[l], us[l]).to_bits(),
                    "silu({})",
                    xs[l]
                );
                assert_eq!(
                    g[l].to_bits(),
                    gelu_tanh_times(xs[l], us[l]).to_bits(),
                    "gelu({})",
                    xs[l]
                );
            }
            x += 0.137;
        }
    }

    /// The one-exponential form equals GELU's tanh definition (PyTorch's `gelu(approximate="tanh")`), computed
    /// in f64, to within float rounding.
    #[test]
    fn gelu_tanh_matches_its_definition() {
        let mut x = -12f32;
        while x < 12.0 {
            let g = x as f64;
            let want = 0.5
                * g
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh());
            let got = gelu_tanh_times(x, 1.0) as f64;
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
                "gelu({x}) = {got}, want {want}"
            );
            x += 0.0123;
        }
    }
}
