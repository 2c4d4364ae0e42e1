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

use rayon::prelude::*;
use serde_json::Value;

use super::layers::{attend, gelu_tanh, qkv, Linear, Tensors};
use crate::backend::Backend;
use crate::error::{Error, Result};

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
fn names(name: &str) -> Vec<String> {
    let nested = name.replacen("vision_tower.", "vision_tower.vision_model.", 1);
    vec![
        name.to_string(),
        format!("model.{name}"),
        format!("model.{nested}"),
        nested,
    ]
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
        let set = Tensors::open(dir, names)?;
        let tensor = |name: &str, shape: &[usize]| set.f32(name, shape);
        let (h, m) = (cfg.hidden, cfg.intermediate);
        let be = backend.as_ref();
        let linear =
            |name: &str, outputs: usize, inputs: usize| set.linear(be, name, outputs, inputs, true);
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
            mid.par_iter_mut().for_each(|v| *v = gelu_tanh(*v));
            let d = layer.fc2.apply(be, &mid, n);
            for (v, d) in x.iter_mut().zip(&d) {
                *v += d;
            }
        }
        debug_assert_eq!(x.len(), n * h);
        Ok(layer_norm(&x, &self.post, c.eps))
    }

    /// Every patch's attention over every patch (no mask), Q, K and V from one upload of the input.
    fn attention(&self, layer: &Layer<B>, x: &[f32], n: usize) -> Result<Vec<f32>> {
        let be = self.backend.as_ref();
        let [q, k, v] = qkv(be, [&layer.q, &layer.k, &layer.v], x, n);
        let all = 0..n;
        let out = attend(
            be,
            [&q, &k, &v],
            self.cfg.hidden,
            self.cfg.heads,
            std::slice::from_ref(&all),
        )?;
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
    super::layers::layer_norm(x, &n.w, &n.b, eps)
}
