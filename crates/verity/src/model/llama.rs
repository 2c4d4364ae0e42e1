//! The Llama-family decoder (Llama, SmolLM, Mistral without sliding windows, Qwen2 with QKV biases, Qwen3 with
//! per-head Q/K norms): pre-norm attention and SwiGLU MLP blocks over a residual stream.

use std::sync::Arc;

use super::hparams::{Arch, HParams};
use super::{Batch, ForwardOutput, LogitRows};
use crate::backend::{AttnMask, AttnShape, Backend};
use crate::bundle::{Bundle, TensorKey};
use crate::cache::KvCache;
use crate::error::{Error, Result};

struct Layer<B: Backend> {
    attn_norm: B::Buffer,
    q: B::Matrix,
    k: B::Matrix,
    v: B::Matrix,
    o: B::Matrix,
    qkv_bias: Option<[B::Buffer; 3]>,
    qk_norm: Option<[B::Buffer; 2]>,
    ffn_norm: B::Buffer,
    gate: B::Matrix,
    up: B::Matrix,
    down: B::Matrix,
}

/// Activation buffers for up to `rows` rows, reused across forwards.
struct Scratch<B: Backend> {
    rows: usize,
    x: B::Buffer,
    xn: B::Buffer,
    q: B::Buffer,
    k: B::Buffer,
    v: B::Buffer,
    tmp: B::Buffer,
    attn: B::Buffer,
    proj: B::Buffer,
    gate: B::Buffer,
    up: B::Buffer,
    act: B::Buffer,
    logits: B::Buffer,
}

/// A loaded decoder on backend `B`.
pub struct Model<B: Backend> {
    pub hp: HParams,
    backend: Arc<B>,
    embed: B::Matrix,
    /// `None` when the output projection is tied to the embedding.
    output: Option<B::Matrix>,
    output_norm: B::Buffer,
    layers: Vec<Layer<B>>,
    scratch: Option<Scratch<B>>,
    weight_bytes: usize,
}

impl<B: Backend> Model<B> {
    pub fn load(bundle: &Bundle, backend: Arc<B>) -> Result<Self> {
        let hp = bundle.hparams.clone();
        let be = backend.as_ref();
        let (h, qd, kvd, f) = (
            hp.hidden,
            hp.n_heads * hp.head_dim,
            hp.n_kv_heads * hp.head_dim,
            hp.ffn_hidden,
        );
        let mut weight_bytes = 0usize;
        let mut mat = |key: TensorKey, rows: usize, cols: usize| -> Result<B::Matrix> {
            let m = be.load_matrix(bundle.matrix(key, rows, cols)?)?;
            weight_bytes += be.matrix_bytes(&m);
            Ok(m)
        };
        let embed = mat(TensorKey::TokenEmbedding, hp.vocab, h)?;
        let output = if hp.tied_embeddings && !bundle.has(TensorKey::Output) {
            None
        } else {
            Some(mat(TensorKey::Output, hp.vocab, h)?)
        };
        let mut layers = Vec::with_capacity(hp.n_layers);
        for l in 0..hp.n_layers {
            layers.push(Layer {
                attn_norm: be.upload(&bundle.vector(TensorKey::AttnNorm(l), h)?),
                q: mat(TensorKey::Q(l), qd, h)?,
                k: mat(TensorKey::K(l), kvd, h)?,
                v: mat(TensorKey::V(l), kvd, h)?,
                o: mat(TensorKey::O(l), h, qd)?,
                qkv_bias: if hp.qkv_bias {
                    Some([
                        be.upload(&bundle.vector(TensorKey::QBias(l), qd)?),
                        be.upload(&bundle.vector(TensorKey::KBias(l), kvd)?),
                        be.upload(&bundle.vector(TensorKey::VBias(l), kvd)?),
                    ])
                } else {
                    None
                },
                qk_norm: if hp.qk_norm {
                    Some([
                        be.upload(&bundle.vector(TensorKey::QNorm(l), hp.head_dim)?),
                        be.upload(&bundle.vector(TensorKey::KNorm(l), hp.head_dim)?),
                    ])
                } else {
                    None
                },
                ffn_norm: be.upload(&bundle.vector(TensorKey::FfnNorm(l), h)?),
                gate: mat(TensorKey::Gate(l), f, h)?,
                up: mat(TensorKey::Up(l), f, h)?,
                down: mat(TensorKey::Down(l), h, f)?,
            });
        }
        let output_norm = be.upload(&bundle.vector(TensorKey::OutputNorm, h)?);
        if hp.arch == Arch::Qwen3 && !hp.qk_norm {
            return Err(Error::Invalid("qwen3 without q/k norms".into()));
        }
        Ok(Model {
            hp,
            backend,
            embed,
            output,
            output_norm,
            layers,
            scratch: None,
            weight_bytes,
        })
    }

    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// Bytes of all weight matrices (what a forward streams, but for the embedding rows it skips).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// A fresh KV cache for this model holding up to `max_tokens` slots (capped by the context length).
    pub fn new_cache(&self, max_tokens: usize) -> KvCache<B> {
        let cap = max_tokens.min(self.hp.context_len).max(1);
        KvCache::new(
            self.backend.as_ref(),
            self.hp.n_layers,
            self.hp.n_kv_heads * self.hp.head_dim,
            cap,
        )
    }

    fn scratch(&mut self, rows: usize) -> Scratch<B> {
        match self.scratch.take() {
            Some(s) if s.rows >= rows => s,
            _ => {
                let hp = &self.hp;
                let be = self.backend.as_ref();
                let rows = rows.next_power_of_two();
                let qd = hp.n_heads * hp.head_dim;
                let kvd = hp.n_kv_heads * hp.head_dim;
                Scratch {
                    rows,
                    x: be.buffer(rows * hp.hidden),
                    xn: be.buffer(rows * hp.hidden),
                    q: be.buffer(rows * qd),
                    k: be.buffer(rows * kvd),
                    v: be.buffer(rows * kvd),
                    tmp: be.buffer(rows * qd.max(hp.hidden)),
                    attn: be.buffer(rows * qd),
                    proj: be.buffer(rows * hp.hidden),
                    gate: be.buffer(rows * hp.ffn_hidden),
                    up: be.buffer(rows * hp.ffn_hidden),
                    act: be.buffer(rows * hp.ffn_hidden),
                    logits: be.buffer(rows * hp.vocab),
                }
            }
        }
    }

    /// Run `batch` through the model: append its K/V to `cache` (slots `cache.len()..+rows`), return logits for
    /// `logit_rows` and the residual stream after each layer in `hidden_layers`.
    pub fn forward(
        &mut self,
        cache: &mut KvCache<B>,
        batch: &Batch,
        logit_rows: LogitRows,
        hidden_layers: &[usize],
    ) -> Result<ForwardOutput> {
        let rows = batch.rows();
        self.check_batch(batch, hidden_layers)?;
        cache.reserve(self.backend.as_ref(), rows)?;
        let mut s = self.scratch(rows);
        let out = self.run(cache, batch, logit_rows, hidden_layers, &mut s);
        self.scratch = Some(s);
        Ok(out)
    }

    fn check_batch(&self, batch: &Batch, hidden_layers: &[usize]) -> Result<()> {
        let rows = batch.rows();
        if rows == 0 {
            return Err(Error::Invalid("a forward needs at least one token".into()));
        }
        if batch.positions.len() != rows {
            return Err(Error::Invalid(format!(
                "{rows} tokens but {} positions",
                batch.positions.len()
            )));
        }
        if let Some(&t) = batch.tokens.iter().find(|&&t| t as usize >= self.hp.vocab) {
            return Err(Error::Invalid(format!(
                "token id {t} outside the vocabulary ({})",
                self.hp.vocab
            )));
        }
        if let AttnMask::Tree(v) = &batch.mask {
            if v.len() != rows * rows || (0..rows).any(|i| !v[i * rows + i]) {
                return Err(Error::Invalid(
                    "tree mask must be rows×rows with every row seeing itself".into(),
                ));
            }
        }
        if let Some(&l) = hidden_layers.iter().find(|&&l| l >= self.hp.n_layers) {
            return Err(Error::Invalid(format!(
                "hidden layer {l} of a {}-layer model",
                self.hp.n_layers
            )));
        }
        Ok(())
    }

    fn run(
        &self,
        cache: &mut KvCache<B>,
        batch: &Batch,
        logit_rows: LogitRows,
        hidden_layers: &[usize],
        s: &mut Scratch<B>,
    ) -> ForwardOutput {
        let be = self.backend.as_ref();
        let hp = &self.hp;
        let rows = batch.rows();
        let (h, hd) = (hp.hidden, hp.head_dim);
        let (qd, kvd) = (hp.n_heads * hd, hp.n_kv_heads * hd);
        let base = cache.len();
        let shape = AttnShape {
            rows,
            n_heads: hp.n_heads,
            n_kv_heads: hp.n_kv_heads,
            head_dim: hd,
            base,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let mut out = ForwardOutput::default();

        be.embed(&self.embed, &batch.tokens, &mut s.x);
        for (l, layer) in self.layers.iter().enumerate() {
            be.rms_norm(&s.x, &layer.attn_norm, rows, h, hp.rms_eps, &mut s.xn);
            be.matmul(&layer.q, &s.xn, rows, &mut s.q);
            be.matmul(&layer.k, &s.xn, rows, &mut s.k);
            be.matmul(&layer.v, &s.xn, rows, &mut s.v);
            if let Some([bq, bk, bv]) = &layer.qkv_bias {
                be.add_bias(&mut s.q, bq, rows, qd);
                be.add_bias(&mut s.k, bk, rows, kvd);
                be.add_bias(&mut s.v, bv, rows, kvd);
            }
            if let Some([nq, nk]) = &layer.qk_norm {
                be.rms_norm(&s.q, nq, rows * hp.n_heads, hd, hp.rms_eps, &mut s.tmp);
                be.copy(&s.tmp, 0, &mut s.q, 0, rows * qd);
                be.rms_norm(&s.k, nk, rows * hp.n_kv_heads, hd, hp.rms_eps, &mut s.tmp);
                be.copy(&s.tmp, 0, &mut s.k, 0, rows * kvd);
            }
            be.rope(
                &mut s.q,
                &batch.positions,
                hp.n_heads,
                hd,
                hp.rope_theta,
                hp.rope_style,
            );
            be.rope(
                &mut s.k,
                &batch.positions,
                hp.n_kv_heads,
                hd,
                hp.rope_theta,
                hp.rope_style,
            );
            be.kv_write(&mut cache.k[l], &s.k, base, rows, kvd);
            be.kv_write(&mut cache.v[l], &s.v, base, rows, kvd);
            be.attention(
                &s.q,
                &cache.k[l],
                &cache.v[l],
                shape,
                &batch.mask,
                &mut s.attn,
            );
            be.matmul(&layer.o, &s.attn, rows, &mut s.proj);
            be.add_assign(&mut s.x, &s.proj, rows * h);

            be.rms_norm(&s.x, &layer.ffn_norm, rows, h, hp.rms_eps, &mut s.xn);
            be.matmul(&layer.gate, &s.xn, rows, &mut s.gate);
            be.matmul(&layer.up, &s.xn, rows, &mut s.up);
            be.swiglu(&s.gate, &s.up, rows * hp.ffn_hidden, &mut s.act);
            be.matmul(&layer.down, &s.act, rows, &mut s.proj);
            be.add_assign(&mut s.x, &s.proj, rows * h);

            if hidden_layers.contains(&l) {
                out.hidden.push((l, be.download(&s.x, rows * h)));
            }
        }
        cache.advance(rows);

        let (first, n) = match logit_rows {
            LogitRows::All => (0, rows),
            LogitRows::Last => (rows - 1, 1),
            LogitRows::None => return out,
        };
        be.copy(&s.x, first * h, &mut s.tmp, 0, n * h);
        be.rms_norm(&s.tmp, &self.output_norm, n, h, hp.rms_eps, &mut s.xn);
        be.matmul(
            self.output.as_ref().unwrap_or(&self.embed),
            &s.xn,
            n,
            &mut s.logits,
        );
        out.logits = be.download(&s.logits, n * hp.vocab);
        out
    }
}
