//! Qwen2.5-VL's vision side: a vision transformer that takes an image near its own size as a grid of patches
//! (each a linear map of its 14 × 14 pixels over two repeated frames), with 2-D rotary positions (a head's
//! first half of pairs turn with the patch's row, the second with its column), RMS norms and SwiGLU MLPs with
//! biases, attention within windows of merged patches in most layers and over the whole image in a few; then a
//! merger that joins each square of 2 × 2 patches into one row of the text model (RMS norm, two linear layers
//! with GELU between). From a Hugging Face `Qwen2_5_VLForConditionalGeneration` folder (`visual.…` or
//! `model.visual.…`).
//!
//! The projections and attention's products run on the backend's f32 matrix kernels; norms, activations,
//! rotations and softmax on the host, in transformers' order of operations. Checked against transformers on a
//! tiny bundle (`tests/vision.rs`).

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use rayon::prelude::*;
use serde_json::Value;

use super::layers::{attend, gelu_erf, rms_norm, Linear, Tensors};
use crate::backend::Backend;
use crate::error::{Error, Result};

/// The tower's and the merger's sizes (`config.json`'s `vision_config`).
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen25VisionConfig {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub patch_size: usize,
    /// Patches per side merged into one text row.
    pub merge: usize,
    pub temporal: usize,
    /// A window's side in pixels (`window_size`).
    pub window: usize,
    /// The layers that attend over the whole image.
    pub full_layers: Vec<usize>,
    /// The text model's hidden size (the merger's output).
    pub text_hidden: usize,
    pub rope_theta: f32,
}

impl Qwen25VisionConfig {
    pub fn from_config(c: &Value) -> Result<Self> {
        let bad = |m: String| Error::Invalid(format!("config.json vision_config: {m}"));
        let v = c
            .get("vision_config")
            .ok_or_else(|| bad("missing".into()))?;
        let num = |k: &str, default: Option<u64>| -> Result<usize> {
            v.get(k)
                .and_then(Value::as_u64)
                .or(default)
                .filter(|&x| (1..=1 << 20).contains(&x))
                .map(|x| x as usize)
                .ok_or_else(|| bad(format!("{k} must be a positive count")))
        };
        let act = v
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if act != "silu" {
            return Err(Error::Unsupported(format!(
                "Qwen2.5-VL vision MLP activation {act:?} (silu is taken)"
            )));
        }
        if num("in_channels", Some(3))? != 3 {
            return Err(bad("in_channels must be 3".into()));
        }
        let full_layers = v
            .get("fullatt_block_indexes")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_u64)
                    .map(|x| x as usize)
                    .collect()
            })
            .unwrap_or_default();
        let rope_theta = v
            .get("rope_parameters")
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0) as f32;
        let cfg = Qwen25VisionConfig {
            hidden: num("hidden_size", None)?,
            intermediate: num("intermediate_size", None)?,
            layers: num("depth", None)?,
            heads: num("num_heads", None)?,
            patch_size: num("patch_size", Some(14))?,
            merge: num("spatial_merge_size", Some(2))?,
            temporal: num("temporal_patch_size", Some(2))?,
            window: num("window_size", Some(112))?,
            full_layers,
            text_hidden: num("out_hidden_size", None)?,
            rope_theta,
        };
        let d = cfg.hidden / cfg.heads;
        if !cfg.hidden.is_multiple_of(cfg.heads)
            || !d.is_multiple_of(4)
            || cfg.window < cfg.merge * cfg.patch_size
            || cfg.full_layers.iter().any(|&l| l >= cfg.layers)
        {
            return Err(bad(format!(
                "{} heads of hidden {}, windows of {} pixels over {}-pixel patches merged {} x {}, full \
                 attention in layers {:?} of {}",
                cfg.heads,
                cfg.hidden,
                cfg.window,
                cfg.patch_size,
                cfg.merge,
                cfg.merge,
                cfg.full_layers,
                cfg.layers
            )));
        }
        Ok(cfg)
    }

    fn patch_values(&self) -> usize {
        3 * self.temporal * self.patch_size * self.patch_size
    }
}

struct Block<B: Backend> {
    norm1: Vec<f32>,
    qkv: [Linear<B>; 3],
    proj: Linear<B>,
    norm2: Vec<f32>,
    gate: Linear<B>,
    up: Linear<B>,
    down: Linear<B>,
}

/// Qwen2.5-VL's vision transformer and merger, their matrices in f32 on the backend.
pub struct Qwen25Vision<B: Backend> {
    pub cfg: Qwen25VisionConfig,
    backend: Arc<B>,
    patch: Linear<B>,
    blocks: Vec<Block<B>>,
    merger_norm: Vec<f32>,
    merger: [Linear<B>; 2],
}

/// The tensors' names: `visual.…` (published checkpoints) or `model.visual.…`.
fn names(name: &str) -> Vec<String> {
    vec![name.to_string(), format!("model.{name}")]
}

/// The RMS norms' epsilon (fixed in the model).
const EPS: f32 = 1e-6;

impl<B: Backend> Qwen25Vision<B> {
    /// The tower and merger of the image-text bundle in `dir` (`config.json` and its safetensors), on
    /// `backend`.
    pub fn load(dir: &Path, backend: Arc<B>) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let config: Value =
            serde_json::from_str(&text).map_err(|e| Error::malformed(&path, e.to_string()))?;
        let cfg = Qwen25VisionConfig::from_config(&config)?;
        let t = Tensors::open(dir, names)?;
        let be = backend.as_ref();
        let (h, m) = (cfg.hidden, cfg.intermediate);
        let blocks = (0..cfg.layers)
            .map(|l| {
                let n = format!("visual.blocks.{l}");
                // One `qkv` matrix (Q, K, V stacked by rows): its thirds as three layers.
                let w = t.f32(&format!("{n}.attn.qkv.weight"), &[3 * h, h])?;
                let b = t.f32(&format!("{n}.attn.qkv.bias"), &[3 * h])?;
                let third = |i: usize| -> Result<Linear<B>> {
                    Ok(Linear {
                        w: super::layers::matrix(be, &n, h, h, &w[i * h * h..][..h * h])?,
                        b: b[i * h..][..h].to_vec(),
                        outputs: h,
                    })
                };
                Ok(Block {
                    norm1: t.f32(&format!("{n}.norm1.weight"), &[h])?,
                    qkv: [third(0)?, third(1)?, third(2)?],
                    proj: t.linear(be, &format!("{n}.attn.proj"), h, h, true)?,
                    norm2: t.f32(&format!("{n}.norm2.weight"), &[h])?,
                    gate: t.linear(be, &format!("{n}.mlp.gate_proj"), m, h, true)?,
                    up: t.linear(be, &format!("{n}.mlp.up_proj"), m, h, true)?,
                    down: t.linear(be, &format!("{n}.mlp.down_proj"), h, m, true)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let joined = h * cfg.merge * cfg.merge;
        Ok(Qwen25Vision {
            patch: t.linear(be, "visual.patch_embed.proj", h, cfg.patch_values(), false)?,
            blocks,
            merger_norm: t.f32("visual.merger.ln_q.weight", &[h])?,
            merger: [
                t.linear(be, "visual.merger.mlp.0", joined, joined, true)?,
                t.linear(be, "visual.merger.mlp.2", cfg.text_hidden, joined, true)?,
            ],
            backend,
            cfg,
        })
    }

    /// The image's features for the text model from its patches' pixel values (`patches ×` values per patch,
    /// merged square by merged square, as [`super::GridProcessor`] gives them) on a grid of `[rows, columns]`
    /// patches: one row of the text model's width per merged square, row-major over the squares.
    pub fn image_features(&self, pixels: &[f32], grid: [usize; 2]) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (m, h) = (c.merge, c.hidden);
        let [rows, cols] = grid;
        let n = rows * cols;
        if rows == 0 || cols == 0 || !rows.is_multiple_of(m) || !cols.is_multiple_of(m) {
            return Err(Error::Invalid(format!(
                "a grid of {rows} x {cols} patches for a tower that merges {m} x {m}"
            )));
        }
        if pixels.len() != n * c.patch_values() {
            return Err(Error::Invalid(format!(
                "{} pixel values for {n} patches of {}",
                pixels.len(),
                c.patch_values()
            )));
        }
        let unit = m * m;
        let (order, windows) = self.windows(rows / m, cols / m);
        let be = self.backend.as_ref();
        // Patches in window order: whole merged squares moved, so a square's patches stay consecutive.
        let x = self.patch.apply(be, pixels, n);
        let mut x = permute(&x, &order, unit * h);
        let rotations = permute(
            &self.rotations(rows / m, cols / m),
            &order,
            unit * h / c.heads / 2,
        );
        let full = 0..n;
        for (l, b) in self.blocks.iter().enumerate() {
            let spans: &[Range<usize>] = if c.full_layers.contains(&l) {
                std::slice::from_ref(&full)
            } else {
                &windows
            };
            let xn = rms_norm(&x, &b.norm1, EPS);
            let [mut q, mut k, v] =
                super::layers::qkv(be, [&b.qkv[0], &b.qkv[1], &b.qkv[2]], &xn, n);
            rotate(&mut q, &rotations, h / c.heads);
            rotate(&mut k, &rotations, h / c.heads);
            let a = attend(be, [&q, &k, &v], h, c.heads, spans)?;
            let a = b.proj.apply(be, &a, n);
            for (v, d) in x.iter_mut().zip(&a) {
                *v += d;
            }
            let xn = rms_norm(&x, &b.norm2, EPS);
            let gate = b.gate.apply(be, &xn, n);
            let mut up = b.up.apply(be, &xn, n);
            up.par_iter_mut().zip(&gate).for_each(|(u, g)| {
                *u *= g / (1.0 + (-g).exp());
            });
            let d = b.down.apply(be, &up, n);
            for (v, d) in x.iter_mut().zip(&d) {
                *v += d;
            }
        }
        // The merger: each square's patches side by side as one row.
        let xn = rms_norm(&x, &self.merger_norm, EPS);
        let mut mid = self.merger[0].apply(be, &xn, n / unit);
        mid.par_iter_mut().for_each(|v| *v = gelu_erf(*v));
        let merged = self.merger[1].apply(be, &mid, n / unit);
        // Back from window order to row-major squares.
        let mut out = vec![0f32; merged.len()];
        for (j, &sq) in order.iter().enumerate() {
            out[sq * c.text_hidden..][..c.text_hidden]
                .copy_from_slice(&merged[j * c.text_hidden..][..c.text_hidden]);
        }
        Ok(out)
    }

    /// The windows over a grid of `rows × cols` merged squares: the squares in window order (windows row-major,
    /// squares row-major within each; windows at the right and bottom edges cut short) and each window's range
    /// of patch rows in that order.
    fn windows(&self, rows: usize, cols: usize) -> (Vec<usize>, Vec<Range<usize>>) {
        let c = &self.cfg;
        let side = c.window / c.merge / c.patch_size;
        let unit = c.merge * c.merge;
        let (mut order, mut spans) = (Vec::with_capacity(rows * cols), Vec::new());
        for wy in 0..rows.div_ceil(side) {
            for wx in 0..cols.div_ceil(side) {
                let first = order.len();
                for y in wy * side..((wy + 1) * side).min(rows) {
                    for x in wx * side..((wx + 1) * side).min(cols) {
                        order.push(y * cols + x);
                    }
                }
                spans.push(first * unit..order.len() * unit);
            }
        }
        (order, spans)
    }

    /// Each patch's rotation (`(cos, sin)` of each pair of a head, pairs `(i, i + d/2)`), patches in the
    /// processor's order: a head's first half of pairs turn with the patch's row, the second half with its
    /// column, at the frequencies `theta^(-4j/d)` (f32, as transformers computes them).
    fn rotations(&self, rows: usize, cols: usize) -> Vec<(f32, f32)> {
        let c = &self.cfg;
        let (m, d) = (c.merge, c.hidden / c.heads);
        let quarter = d / 4;
        let inv: Vec<f32> = (0..quarter)
            .map(|j| 1.0 / c.rope_theta.powf((2 * j) as f32 / (d / 2) as f32))
            .collect();
        let mut out = Vec::with_capacity(rows * cols * m * m * d / 2);
        for sq in 0..rows * cols {
            let (by, bx) = (sq / cols, sq % cols);
            for w in 0..m * m {
                let (y, x) = ((by * m + w / m) as f32, (bx * m + w % m) as f32);
                for pos in [y, x] {
                    out.extend(inv.iter().map(|&f| {
                        let a = pos * f;
                        (a.cos(), a.sin())
                    }));
                }
            }
        }
        out
    }
}

/// `x`'s blocks of `block` values in the order `order` names them.
fn permute<T: Copy>(x: &[T], order: &[usize], block: usize) -> Vec<T> {
    order
        .iter()
        .flat_map(|&i| &x[i * block..(i + 1) * block])
        .copied()
        .collect()
}

/// Rotate every head (`d` values) of each row of `x` by the row's `d / 2` rotations, pairs `(i, i + d/2)`.
fn rotate(x: &mut [f32], rotations: &[(f32, f32)], d: usize) {
    let half = d / 2;
    for (row, rot) in x
        .chunks_mut(x.len() / (rotations.len() / half))
        .zip(rotations.chunks(half))
    {
        for head in row.chunks_mut(d) {
            for (i, &(c, s)) in rot.iter().enumerate() {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * c - b * s;
                head[i + half] = b * c + a * s;
            }
        }
    }
}
