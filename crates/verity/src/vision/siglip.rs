//! Gemma 3's vision side: the SigLIP tower (patch embedding, bidirectional pre-norm transformer layers with
//! LayerNorm and tanh-GELU, post-LayerNorm) and the projector into the text model (each side's patches averaged
//! in square pools to `mm_tokens_per_image` tokens, Gemma's RMS norm with `1 + w`, one matrix), from a Hugging
//! Face `Gemma3ForConditionalGeneration` folder.
//!
//! The projections — the tower's patch embedding, Q/K/V/output and MLP matrices, and attention's two products
//! per head (scores `Q·Kᵀ`, then the weights times `V`) — run on the backend's f32 matrix kernels, where nearly
//! all of an image's work is (a 896-pixel image is 4,096 patches through 27 layers); norms, GELU, softmax and
//! the pooling run on the host, in transformers' order of operations. Checked against transformers on a tiny
//! bundle (`tests/vision.rs`); an image's tower runs once per image and its features are what the prefix cache
//! keys and keeps.

use std::path::Path;
use std::sync::Arc;

use half::{bf16, f16};
use rayon::prelude::*;
use serde_json::Value;

use crate::backend::Backend;
use crate::bundle::safetensors::{SafetensorsSet, StDtype};
use crate::error::{Error, Result};
use crate::quant::{GgmlType, QMatrix};
use crate::storage::Bytes;

/// The tower's and the projector's sizes (`config.json`'s `vision_config` and `mm_tokens_per_image`).
#[derive(Debug, Clone, PartialEq)]
pub struct SiglipConfig {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub image_size: usize,
    pub patch_size: usize,
    pub eps: f32,
    /// Image tokens the text model receives per image (a square).
    pub tokens: usize,
    /// The text model's hidden size (the projector's output).
    pub text_hidden: usize,
}

impl SiglipConfig {
    pub fn from_config(c: &Value) -> Result<Self> {
        let bad = |m: String| Error::Invalid(format!("config.json: {m}"));
        let v = c
            .get("vision_config")
            .ok_or_else(|| bad("no vision_config".into()))?;
        let num = |o: &Value, k: &str| -> Result<usize> {
            o.get(k)
                .and_then(Value::as_u64)
                .filter(|&x| (1..=1 << 20).contains(&x))
                .map(|x| x as usize)
                .ok_or_else(|| bad(format!("{k} must be a positive count")))
        };
        let text = c.get("text_config").unwrap_or(c);
        let cfg = SiglipConfig {
            hidden: num(v, "hidden_size")?,
            intermediate: num(v, "intermediate_size")?,
            layers: num(v, "num_hidden_layers")?,
            heads: num(v, "num_attention_heads")?,
            image_size: num(v, "image_size")?,
            patch_size: num(v, "patch_size")?,
            eps: v
                .get("layer_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6) as f32,
            tokens: num(c, "mm_tokens_per_image")?,
            text_hidden: num(text, "hidden_size")?,
        };
        let side = cfg.patches_per_side();
        let per_side = (cfg.tokens as f64).sqrt() as usize;
        if !cfg.image_size.is_multiple_of(cfg.patch_size)
            || per_side * per_side != cfg.tokens
            || !side.is_multiple_of(per_side)
            || !cfg.hidden.is_multiple_of(cfg.heads)
        {
            return Err(bad(format!(
                "{}-pixel images in {}-pixel patches do not pool into {} tokens of {} heads' hidden {}",
                cfg.image_size, cfg.patch_size, cfg.tokens, cfg.heads, cfg.hidden
            )));
        }
        Ok(cfg)
    }

    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size
    }

    fn patches(&self) -> usize {
        self.patches_per_side().pow(2)
    }
}

/// `rows × outputs` values of `w · x` for `rows` rows of `x` (`rows × inputs`), on the backend: `w` is
/// `outputs × inputs`, row-major.
fn project<B: Backend>(be: &B, w: &B::Matrix, x: &[f32], rows: usize, outputs: usize) -> Vec<f32> {
    let input = be.upload(x);
    let mut out = be.buffer(rows * outputs);
    be.matmul(w, &input, rows, &mut out);
    be.download(&out, rows * outputs)
}

/// An f32 matrix of `rows × cols` values on the backend.
fn matrix<B: Backend>(
    be: &B,
    name: &str,
    rows: usize,
    cols: usize,
    values: &[f32],
) -> Result<B::Matrix> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    be.load_matrix(QMatrix::ggml(
        name,
        GgmlType::F32,
        rows,
        cols,
        Bytes::owned(bytes),
    )?)
}

struct Linear<B: Backend> {
    w: B::Matrix,
    b: Vec<f32>,
    outputs: usize,
}

impl<B: Backend> Linear<B> {
    /// `rows` rows of `x` through the layer, the bias added.
    fn apply(&self, be: &B, x: &[f32], rows: usize) -> Vec<f32> {
        self.with_bias(project(be, &self.w, x, rows, self.outputs))
    }

    /// `out` (rows of this layer's products) with the bias added.
    fn with_bias(&self, mut out: Vec<f32>) -> Vec<f32> {
        for o in out.chunks_mut(self.outputs) {
            for (v, b) in o.iter_mut().zip(&self.b) {
                *v += b;
            }
        }
        out
    }
}

struct Norm {
    w: Vec<f32>,
    b: Vec<f32>,
}

struct Layer<B: Backend> {
    ln1: Norm,
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    o: Linear<B>,
    ln2: Norm,
    fc1: Linear<B>,
    fc2: Linear<B>,
}

/// Gemma 3's SigLIP tower and projector, its matrices in f32 on the backend.
pub struct Gemma3Vision<B: Backend> {
    pub cfg: SiglipConfig,
    backend: Arc<B>,
    patch: Linear<B>,
    positions: Vec<f32>,
    layers: Vec<Layer<B>>,
    post: Norm,
    pool_norm: Vec<f32>,
    /// `[vision hidden][text hidden]`.
    projection: Vec<f32>,
}

/// The tensors' names: `vision_tower.vision_model.…` (published checkpoints) or `vision_tower.…`, and
/// `multi_modal_projector.…`, optionally under `model.`.
fn find<'a>(
    set: &'a SafetensorsSet,
    name: &str,
) -> Option<(String, &'a crate::bundle::safetensors::StTensor)> {
    let candidates = [
        name.to_string(),
        format!("model.{name}"),
        name.replacen("vision_tower.", "vision_tower.vision_model.", 1),
        format!(
            "model.{}",
            name.replacen("vision_tower.", "vision_tower.vision_model.", 1)
        ),
    ];
    candidates
        .into_iter()
        .find_map(|n| set.get(&n).map(|t| (n.clone(), t)))
}

impl<B: Backend> Gemma3Vision<B> {
    /// The tower and projector of the image-text bundle in `dir` (`config.json` and its safetensors), on
    /// `backend`.
    pub fn load(dir: &Path, backend: Arc<B>) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let config: Value =
            serde_json::from_str(&text).map_err(|e| Error::malformed(&path, e.to_string()))?;
        let cfg = SiglipConfig::from_config(&config)?;
        let set = SafetensorsSet::open(dir)?;
        let tensor = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let (full, t) = find(&set, name).ok_or_else(|| Error::tensor(name, "missing"))?;
            let want: usize = shape.iter().product();
            if t.shape.iter().product::<usize>() != want {
                return Err(Error::tensor(
                    &full,
                    format!("shape {:?}, expected {:?}", t.shape, shape),
                ));
            }
            let bytes = set.bytes(t);
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
        };
        let (h, m) = (cfg.hidden, cfg.intermediate);
        let be = backend.as_ref();
        let linear = |name: &str, outputs: usize, inputs: usize| -> Result<Linear<B>> {
            let w = tensor(&format!("{name}.weight"), &[outputs, inputs])?;
            Ok(Linear {
                w: matrix(be, name, outputs, inputs, &w)?,
                b: tensor(&format!("{name}.bias"), &[outputs])?,
                outputs,
            })
        };
        let norm = |name: &str| -> Result<Norm> {
            Ok(Norm {
                w: tensor(&format!("{name}.weight"), &[h])?,
                b: tensor(&format!("{name}.bias"), &[h])?,
            })
        };
        let p = cfg.patch_size;
        let patch = linear("vision_tower.embeddings.patch_embedding", h, 3 * p * p)?;
        let positions = tensor(
            "vision_tower.embeddings.position_embedding.weight",
            &[cfg.patches(), h],
        )?;
        let layers = (0..cfg.layers)
            .map(|l| {
                let n = format!("vision_tower.encoder.layers.{l}");
                Ok(Layer {
                    ln1: norm(&format!("{n}.layer_norm1"))?,
                    q: linear(&format!("{n}.self_attn.q_proj"), h, h)?,
                    k: linear(&format!("{n}.self_attn.k_proj"), h, h)?,
                    v: linear(&format!("{n}.self_attn.v_proj"), h, h)?,
                    o: linear(&format!("{n}.self_attn.out_proj"), h, h)?,
                    ln2: norm(&format!("{n}.layer_norm2"))?,
                    fc1: linear(&format!("{n}.mlp.fc1"), m, h)?,
                    fc2: linear(&format!("{n}.mlp.fc2"), h, m)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Gemma3Vision {
            backend: backend.clone(),
            patch,
            positions,
            layers,
            post: norm("vision_tower.post_layernorm")?,
            pool_norm: tensor("multi_modal_projector.mm_soft_emb_norm.weight", &[h])?,
            projection: tensor(
                "multi_modal_projector.mm_input_projection_weight",
                &[h, cfg.text_hidden],
            )?,
            cfg,
        })
    }

    /// The tower's last hidden state for one image's pixel values (`3 × image_size × image_size`, channels
    /// first): `patches × hidden`, patches row by row.
    pub fn tower(&self, pixels: &[f32]) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (s, p, h) = (c.image_size, c.patch_size, c.hidden);
        if pixels.len() != 3 * s * s {
            return Err(Error::Invalid(format!(
                "{} pixel values for a {s}×{s} tower",
                pixels.len()
            )));
        }
        let side = c.patches_per_side();
        let n = c.patches();
        // Each patch's values in the convolution's order: channel, then row, then column.
        let mut cols = vec![0f32; n * 3 * p * p];
        for (i, col) in cols.chunks_mut(3 * p * p).enumerate() {
            let (py, px) = (i / side, i % side);
            for ch in 0..3 {
                for y in 0..p {
                    let src = &pixels[ch * s * s + (py * p + y) * s + px * p..][..p];
                    col[(ch * p + y) * p..][..p].copy_from_slice(src);
                }
            }
        }
        let be = self.backend.as_ref();
        let mut x = self.patch.apply(be, &cols, n);
        for (v, pos) in x.iter_mut().zip(&self.positions) {
            *v += pos;
        }
        for layer in &self.layers {
            let xn = layer_norm(&x, &layer.ln1, c.eps);
            let a = self.attention(layer, &xn, n)?;
            for (v, d) in x.iter_mut().zip(&a) {
                *v += d;
            }
            let xn = layer_norm(&x, &layer.ln2, c.eps);
            let mut mid = layer.fc1.apply(be, &xn, n);
            for v in mid.iter_mut() {
                *v = gelu_tanh(*v);
            }
            let d = layer.fc2.apply(be, &mid, n);
            for (v, d) in x.iter_mut().zip(&d) {
                *v += d;
            }
        }
        debug_assert_eq!(x.len(), n * h);
        Ok(layer_norm(&x, &self.post, c.eps))
    }

    /// Every patch's attention over every patch (no mask), head by head: the scores `Q_h · K_hᵀ` and the
    /// weighted values `P · V_h` on the backend (each head's keys, and its values transposed, as a matrix), the
    /// softmax on the host.
    fn attention(&self, layer: &Layer<B>, x: &[f32], n: usize) -> Result<Vec<f32>> {
        let be = self.backend.as_ref();
        let h = self.cfg.hidden;
        let d = h / self.cfg.heads;
        // Q, K and V from one upload of the input, in one pass where the backend can.
        let input = be.upload(x);
        let (mut bq, mut bk, mut bv) = (be.buffer(n * h), be.buffer(n * h), be.buffer(n * h));
        be.matmuls(
            &input,
            None,
            n,
            &mut [
                (&layer.q.w, &mut bq),
                (&layer.k.w, &mut bk),
                (&layer.v.w, &mut bv),
            ],
        );
        let [q, k, v] = [(&layer.q, bq), (&layer.k, bk), (&layer.v, bv)]
            .map(|(l, b)| l.with_bias(be.download(&b, n * h)));
        let scale = (d as f32).powf(-0.5);
        let head_of = |m: &[f32], head: usize| -> Vec<f32> {
            m.chunks(h)
                .flat_map(|r| &r[head * d..][..d])
                .copied()
                .collect()
        };
        let mut out = vec![0f32; n * h];
        for head in 0..self.cfg.heads {
            let (qh, kh) = (head_of(&q, head), head_of(&k, head));
            let keys = matrix(be, "vision keys", n, d, &kh)?;
            let mut p = project(be, &keys, &qh, n, n);
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
            // The values transposed: row e holds every patch's value e.
            let mut vt = vec![0f32; d * n];
            for (j, r) in v.chunks(h).enumerate() {
                for (e, &x) in r[head * d..][..d].iter().enumerate() {
                    vt[e * n + j] = x;
                }
            }
            let values = matrix(be, "vision values", d, n, &vt)?;
            let oh = project(be, &values, &p, n, d);
            for (o, r) in out.chunks_mut(h).zip(oh.chunks(d)) {
                o[head * d..][..d].copy_from_slice(r);
            }
        }
        Ok(layer.o.apply(be, &out, n))
    }

    /// The image's features for the text model: the tower's patches averaged in square pools, Gemma's RMS norm
    /// (`x · rsqrt(mean x² + eps) · (1 + w)`), projected: `tokens × text_hidden`.
    pub fn image_features(&self, pixels: &[f32]) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let tower = self.tower(pixels)?;
        let (side, h) = (c.patches_per_side(), c.hidden);
        let per_side = (c.tokens as f64).sqrt() as usize;
        let k = side / per_side;
        let mut out = Vec::with_capacity(c.tokens * c.text_hidden);
        for t in 0..c.tokens {
            let (ty, tx) = (t / per_side, t % per_side);
            let mut pooled = vec![0f32; h];
            for y in 0..k {
                for x in 0..k {
                    let patch = (ty * k + y) * side + tx * k + x;
                    for (a, b) in pooled.iter_mut().zip(&tower[patch * h..][..h]) {
                        *a += b;
                    }
                }
            }
            let area = (k * k) as f32;
            for a in pooled.iter_mut() {
                *a /= area;
            }
            let ms = pooled.iter().map(|a| a * a).sum::<f32>() / h as f32;
            let r = 1.0 / (ms + c.eps).sqrt();
            let normed: Vec<f32> = pooled
                .iter()
                .zip(&self.pool_norm)
                .map(|(a, w)| a * r * (1.0 + w))
                .collect();
            for j in 0..c.text_hidden {
                let mut acc = 0f32;
                for (i, v) in normed.iter().enumerate() {
                    acc += v * self.projection[i * c.text_hidden + j];
                }
                out.push(acc);
            }
        }
        Ok(out)
    }
}

fn layer_norm(x: &[f32], n: &Norm, eps: f32) -> Vec<f32> {
    let h = n.w.len();
    let mut out = vec![0f32; x.len()];
    for (o, r) in out.chunks_mut(h).zip(x.chunks(h)) {
        let mean = r.iter().sum::<f32>() / h as f32;
        let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for (i, oi) in o.iter_mut().enumerate() {
            *oi = (r[i] - mean) * inv * n.w[i] + n.b[i];
        }
    }
    out
}

/// GELU with the tanh approximation (`gelu_pytorch_tanh`).
fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}
