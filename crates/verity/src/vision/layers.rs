//! What the vision towers share: their weights read from safetensors into f32, linear layers and attention
//! products on the backend's f32 matrix kernels (where nearly all of an image's work is), norms on the host.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::backend::Backend;
use crate::bundle::safetensors::{SafetensorsSet, StDtype};
use crate::error::{Error, Result};
use crate::quant::{GgmlType, QMatrix};
use crate::storage::Bytes;

/// A bundle's vision tensors, found under the names a checkpoint may give them.
pub(super) struct Tensors {
    set: SafetensorsSet,
    /// The names a tensor may be stored under, most likely first.
    names: fn(&str) -> Vec<String>,
}

impl Tensors {
    pub(super) fn open(dir: &std::path::Path, names: fn(&str) -> Vec<String>) -> Result<Self> {
        Ok(Tensors {
            set: SafetensorsSet::open(dir)?,
            names,
        })
    }

    /// The tensor `name` in f32, checked to hold `shape`'s values (stored in f32, bf16 or f16).
    pub(super) fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (full, t) = (self.names)(name)
            .into_iter()
            .find_map(|n| self.set.get(&n).map(|t| (n.clone(), t)))
            .ok_or_else(|| Error::tensor(name, "missing"))?;
        let want: usize = shape.iter().product();
        if t.shape.iter().product::<usize>() != want {
            return Err(Error::tensor(
                &full,
                format!("shape {:?}, expected {:?}", t.shape, shape),
            ));
        }
        let bytes = self.set.bytes(t);
        let b = bytes.as_slice();
        Ok(match t.dtype {
            StDtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            StDtype::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            StDtype::F16 => b
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => {
                return Err(Error::tensor(
                    &full,
                    format!("dtype {} (f32, bf16 or f16 taken)", t.dtype_name),
                ))
            }
        })
    }

    /// The linear layer `name` (`name.weight`, `outputs × inputs`, and `name.bias` where `bias`) on `be`.
    pub(super) fn linear<B: Backend>(
        &self,
        be: &B,
        name: &str,
        outputs: usize,
        inputs: usize,
        bias: bool,
    ) -> Result<Linear<B>> {
        let w = self.f32(&format!("{name}.weight"), &[outputs, inputs])?;
        Ok(Linear {
            w: matrix(be, name, outputs, inputs, &w)?,
            b: if bias {
                self.f32(&format!("{name}.bias"), &[outputs])?
            } else {
                Vec::new()
            },
            outputs,
        })
    }
}

/// `x`'s `rows` rows padded with zeros to the row length the backend's f32 matrices take
/// ([`Backend::f32_row_multiple`]; as [`matrix`] pads a matrix's rows).
fn padded<'a, B: Backend>(be: &B, x: &'a [f32], rows: usize) -> std::borrow::Cow<'a, [f32]> {
    padded_to(x, rows, be.f32_row_multiple())
}

/// `x`'s `rows` rows padded with zeros to a multiple of `multiple` values.
fn padded_to(x: &[f32], rows: usize, multiple: usize) -> std::borrow::Cow<'_, [f32]> {
    let len = x.len() / rows.max(1);
    let to = len.next_multiple_of(multiple);
    if to == len {
        return std::borrow::Cow::Borrowed(x);
    }
    let mut out = vec![0f32; rows * to];
    for (o, r) in out.chunks_mut(to).zip(x.chunks(len)) {
        o[..len].copy_from_slice(r);
    }
    std::borrow::Cow::Owned(out)
}

/// `rows × outputs` values of `w · x` for `rows` rows of `x` (`rows × inputs`), on the backend: `w` is
/// `outputs × inputs`, row-major, as [`matrix`] made it.
pub(super) fn project<B: Backend>(
    be: &B,
    w: &B::Matrix,
    x: &[f32],
    rows: usize,
    outputs: usize,
) -> Vec<f32> {
    let input = be.upload(&padded(be, x, rows));
    let mut out = be.buffer(rows * outputs);
    be.encoder_matmul(w, &input, rows, &mut out);
    be.download(&out, rows * outputs)
}

/// An f32 matrix of `rows × cols` values on the backend, its rows padded with zeros to the length the backend
/// takes ([`Backend::f32_row_multiple`]; the zeros add nothing to a product).
pub(super) fn matrix<B: Backend>(
    be: &B,
    name: &str,
    rows: usize,
    cols: usize,
    values: &[f32],
) -> Result<B::Matrix> {
    debug_assert_eq!(values.len(), rows * cols);
    let values = padded(be, values, rows);
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    be.load_matrix(QMatrix::ggml(
        name,
        GgmlType::F32,
        rows,
        values.len() / rows,
        Bytes::owned(bytes),
    )?)
}

/// A linear layer on the backend; `b` empty where it has no bias.
pub(super) struct Linear<B: Backend> {
    pub(super) w: B::Matrix,
    pub(super) b: Vec<f32>,
    pub(super) outputs: usize,
}

impl<B: Backend> Linear<B> {
    /// `rows` rows of `x` through the layer, the bias added.
    pub(super) fn apply(&self, be: &B, x: &[f32], rows: usize) -> Vec<f32> {
        self.with_bias(project(be, &self.w, x, rows, self.outputs))
    }

    /// `out` (rows of this layer's products) with the bias added.
    pub(super) fn with_bias(&self, mut out: Vec<f32>) -> Vec<f32> {
        if self.b.is_empty() {
            return out;
        }
        for o in out.chunks_mut(self.outputs) {
            for (v, b) in o.iter_mut().zip(&self.b) {
                *v += b;
            }
        }
        out
    }
}

/// `x`'s rows projected by `q`, `k` and `v` from one upload of `x`, biases added.
pub(super) fn qkv<B: Backend>(
    be: &B,
    [q, k, v]: [&Linear<B>; 3],
    x: &[f32],
    rows: usize,
) -> [Vec<f32>; 3] {
    let input = be.upload(&padded(be, x, rows));
    [q, k, v].map(|l| {
        let mut out = be.buffer(rows * l.outputs);
        be.encoder_matmul(&l.w, &input, rows, &mut out);
        l.with_bias(be.download(&out, rows * l.outputs))
    })
}

/// Scores a query block may hold (its rows × the span's keys): a large image's full-attention layers would
/// otherwise hold a square of tens of thousands of patches per head (a 12-megapixel picture is 61,000 of them).
const SCORE_VALUES: usize = 1 << 24;

/// Bidirectional attention of `rows` rows (`q`, `k`, `v`: `rows × hidden`, `heads` heads side by side) within
/// each of `spans` (ranges of rows that see each other and nothing else; together every row once), head by
/// head: the scores `Q_h · K_hᵀ` and the weighted values `P · V_h` on the backend (each span's keys, and its
/// values transposed, as a matrix), the softmax on the host; the queries in blocks whose scores fit
/// [`SCORE_VALUES`] (blocks that follow from the image's size alone, so an image always gives the same bits).
/// Returns `rows × hidden`.
pub(super) fn attend<B: Backend>(
    be: &B,
    qkv: [&[f32]; 3],
    hidden: usize,
    heads: usize,
    spans: &[std::ops::Range<usize>],
) -> Result<Vec<f32>> {
    attend_within(be, qkv, hidden, heads, spans, SCORE_VALUES)
}

/// [`attend`] with query blocks of at most `score_values` scores.
fn attend_within<B: Backend>(
    be: &B,
    [q, k, v]: [&[f32]; 3],
    hidden: usize,
    heads: usize,
    spans: &[std::ops::Range<usize>],
    score_values: usize,
) -> Result<Vec<f32>> {
    let d = hidden / heads;
    let rows = q.len() / hidden;
    let scale = (d as f32).powf(-0.5);
    let mut out = vec![0f32; rows * hidden];
    for span in spans {
        let n = span.len();
        let head_of = |m: &[f32], head: usize| -> Vec<f32> {
            m[span.start * hidden..span.end * hidden]
                .chunks(hidden)
                .flat_map(|r| &r[head * d..][..d])
                .copied()
                .collect()
        };
        let block = (score_values / n).clamp(1, n);
        for head in 0..heads {
            let (qh, kh) = (head_of(q, head), head_of(k, head));
            let keys = matrix(be, "vision keys", n, d, &kh)?;
            // The values transposed: row e holds every row's value e.
            let mut vt = vec![0f32; d * n];
            for (j, r) in v[span.start * hidden..span.end * hidden]
                .chunks(hidden)
                .enumerate()
            {
                for (e, &x) in r[head * d..][..d].iter().enumerate() {
                    vt[e * n + j] = x;
                }
            }
            let values = matrix(be, "vision values", d, n, &vt)?;
            for (b, queries) in qh.chunks(block * d).enumerate() {
                let m = queries.len() / d;
                let mut p = project(be, &keys, queries, m, n);
                p.par_chunks_mut(n).for_each(|w| {
                    let max = w.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x * scale));
                    let mut sum = 0.0;
                    for x in w.iter_mut() {
                        *x = (*x * scale - max).exp();
                        sum += *x;
                    }
                    for x in w.iter_mut() {
                        *x /= sum;
                    }
                });
                let oh = project(be, &values, &p, m, d);
                let first = span.start + b * block;
                for (o, r) in out[first * hidden..(first + m) * hidden]
                    .chunks_mut(hidden)
                    .zip(oh.chunks(d))
                {
                    o[head * d..][..d].copy_from_slice(r);
                }
            }
        }
    }
    Ok(out)
}

/// LayerNorm of each `w.len()`-long row: `(x - mean) / sqrt(var + eps) · w + b`.
pub(super) fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let h = w.len();
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .for_each(|(o, r)| {
            let mean = r.iter().sum::<f32>() / h as f32;
            let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h as f32;
            let inv = 1.0 / (var + eps).sqrt();
            for (i, oi) in o.iter_mut().enumerate() {
                *oi = (r[i] - mean) * inv * w[i] + b[i];
            }
        });
    out
}

/// RMS norm of each `w.len()`-long row: `x / sqrt(mean(x²) + eps) · w`.
pub(super) fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let h = w.len();
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .for_each(|(o, r)| {
            let ms = r.iter().map(|v| v * v).sum::<f32>() / h as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for ((oi, &v), &wi) in o.iter_mut().zip(r).zip(w) {
                *oi = v * inv * wi;
            }
        });
    out
}

/// GELU with the tanh approximation (`gelu_pytorch_tanh`).
pub(super) fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

/// GELU as `x · Φ(x)` (PyTorch's `nn.GELU()`), with erf from Abramowitz and Stegun 7.1.26 in f64 (absolute
/// error below 1.5e-7, under f32's resolution of Φ).
pub(super) fn gelu_erf(x: f32) -> f32 {
    let z = f64::from(x) / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * z.abs());
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erf = (1.0 - poly * (-z * z).exp()).copysign(z);
    (0.5 * f64::from(x) * (1.0 + erf)) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_padded_with_zeros_give_the_same_products() {
        let be = crate::backend::cpu::CpuBackend::new(2).unwrap();
        let (rows, cols, outputs) = (3, 147, 5);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| (i % 13) as f32 * 0.1 - 0.6)
            .collect();
        let w: Vec<f32> = (0..outputs * cols)
            .map(|i| (i % 7) as f32 * 0.2 - 0.5)
            .collect();
        let plain = project(
            &be,
            &matrix(&be, "w", outputs, cols, &w).unwrap(),
            &x,
            rows,
            outputs,
        );
        let (wp, xp) = (padded_to(&w, outputs, 32), padded_to(&x, rows, 32));
        assert_eq!((wp.len(), xp.len()), (outputs * 160, rows * 160));
        assert!(xp.chunks(160).all(|r| r[cols..].iter().all(|&v| v == 0.0)));
        let wide = project(
            &be,
            &matrix(&be, "w", outputs, 160, &wp).unwrap(),
            &xp,
            rows,
            outputs,
        );
        for (a, b) in plain.iter().zip(&wide) {
            assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{a} vs {b}");
        }
    }

    #[test]
    fn attention_in_query_blocks_is_the_whole_attention_to_rounding() {
        let be = crate::backend::cpu::CpuBackend::new(2).unwrap();
        let (rows, hidden, heads) = (40, 16, 2);
        let values = |seed: u32| -> Vec<f32> {
            (0..rows * hidden)
                .map(|i| {
                    ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5
                })
                .collect()
        };
        let (q, k, v) = (values(1), values(2), values(3));
        let all = 0..rows;
        let spans = std::slice::from_ref(&all);
        let whole = attend(&be, [&q, &k, &v], hidden, heads, spans).unwrap();
        let blocked = attend_within(&be, [&q, &k, &v], hidden, heads, spans, 7 * rows).unwrap();
        // The encoder's products may round a row differently in another block (a blocked GEMM).
        for (a, b) in whole.iter().zip(&blocked) {
            assert!((a - b).abs() <= 1e-6, "{a} vs {b}");
        }
        let again = attend_within(&be, [&q, &k, &v], hidden, heads, spans, 7 * rows).unwrap();
        assert!(blocked
            .iter()
            .zip(&again)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn gelu_erf_is_x_times_the_normal_cdf() {
        // Φ at a few points (to 10 digits).
        for (x, phi) in [
            (0.0f64, 0.5),
            (1.0, 0.841_344_746_1),
            (-1.0, 0.158_655_253_9),
            (2.5, 0.993_790_334_7),
            (-3.0, 0.001_349_898_0),
        ] {
            let got = gelu_erf(x as f32) as f64;
            assert!((got - x * phi).abs() < 1e-6, "gelu({x}) = {got}");
        }
    }
}
