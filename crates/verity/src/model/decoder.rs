//! The decoder: pre-norm attention and gated-MLP blocks over a residual stream, with what sets each family apart
//! taken from [`HParams`]: Llama and SmolLM (SwiGLU), Qwen2 (QKV biases), Qwen3 (per-head Q/K norms), Gemma 3
//! (GeGLU, post-norms on both block outputs, Q/K norms, embeddings scaled by √hidden, its own query scale, and
//! local sliding-window layers with their own RoPE base between the global ones), Qwen3-MoE (mixtures of
//! experts), Qwen3-Next (Gated DeltaNet layers between gated full-attention ones, partial RoPE, a mixture with
//! a shared expert).

use std::sync::Arc;

use super::delta_net::DeltaNet;
use super::moe::{mixture, SharedExpert};
use super::{run_recorded, Batch, ForwardOutput, LogitRows, TargetFeatures};
use crate::backend::{
    buffer_set_id, AttnMask, AttnShape, Backend, HeadNorms, Rope, RopeScaling, RowDraw, StepInputs,
};
use crate::bundle::hparams::{Arch, HParams};
use crate::bundle::{Bundle, TensorKey};
use crate::cache::{CacheShape, KvCache};
use crate::error::{Error, Result};

pub(super) struct Layer<B: Backend> {
    attn_norm: B::Buffer,
    mixer: Mixer<B>,
    ffn_norm: B::Buffer,
    /// Gemma: the norms of the attention and MLP outputs.
    post_norms: Option<[B::Buffer; 2]>,
    mlp: Mlp<B>,
}

/// What mixes a layer's positions: attention over the cache, or a Gated DeltaNet's recurrent state.
enum Mixer<B: Backend> {
    Attention(Attention<B>),
    Linear(DeltaNet<B>),
}

pub(super) struct Attention<B: Backend> {
    q: B::Matrix,
    k: B::Matrix,
    v: B::Matrix,
    o: B::Matrix,
    /// Qwen3-Next: the per-head output gate's projection (its sigmoid scales the attention output).
    gate: Option<B::Matrix>,
    qkv_bias: Option<[B::Buffer; 3]>,
    qk_norm: Option<[B::Buffer; 2]>,
}

/// A layer's MLP: one gated MLP, or a mixture of experts.
enum Mlp<B: Backend> {
    Dense {
        gate: B::Matrix,
        up: B::Matrix,
        down: B::Matrix,
    },
    /// A router (a row per expert), each expert's gate, up and down projections, and a shared expert where
    /// the model has one.
    Experts {
        router: B::Matrix,
        experts: Vec<[B::Matrix; 3]>,
        shared: Option<SharedExpert<B>>,
    },
}

/// Activation buffers for up to `rows` rows, reused across forwards.
pub(super) struct Scratch<B: Backend> {
    pub(super) rows: usize,
    /// Identifies this allocation in replay keys.
    pub(super) id: u64,
    pub(super) step: B::Step,
    pub(super) x: B::Buffer,
    pub(super) xn: B::Buffer,
    pub(super) q: B::Buffer,
    /// Qwen3-Next: the attention output gates' projections.
    pub(super) gate: B::Buffer,
    pub(super) k: B::Buffer,
    pub(super) v: B::Buffer,
    pub(super) tmp: B::Buffer,
    pub(super) attn: B::Buffer,
    pub(super) act: B::Buffer,
    /// A mixture's router logits (rows × experts) and the rows gathered for one expert.
    pub(super) router: B::Buffer,
    pub(super) gathered: B::Buffer,
    pub(super) logits: B::Buffer,
    /// Each row's argmax, as exact f32 ([`LogitRows::Greedy`]).
    pub(super) greedy: B::Buffer,
    /// The residual streams after the layers a forward reports (up to [`MAX_STATE_LAYERS`] of them), layer
    /// after layer, `rows × hidden` each: copied on the device so that such forwards record and replay too.
    pub(super) states: B::Buffer,
}

/// The most layers whose residual streams one forward reports ([`Model::forward`]'s `hidden_layers`).
pub const MAX_STATE_LAYERS: usize = 8;

/// A loaded decoder on backend `B`.
pub struct Model<B: Backend> {
    pub hp: HParams,
    pub(super) backend: Arc<B>,
    pub(super) embed: Arc<B::Matrix>,
    /// `None` when the output projection is tied to the embedding.
    pub(super) output: Option<B::Matrix>,
    pub(super) output_norm: B::Buffer,
    pub(super) layers: Vec<Layer<B>>,
    pub(super) scratch: Option<Scratch<B>>,
    /// Per sequence of a batched forward, the buffers of its own attention ([`Model::forward_batched`]).
    pub(super) seq_scratch: Vec<Scratch<B>>,
    weight_bytes: usize,
}

impl<B: Backend> Model<B> {
    pub fn load(bundle: &Bundle, backend: Arc<B>) -> Result<Self> {
        let hp = bundle.hparams.clone();
        let be = backend.as_ref();
        for l in 0..hp.n_layers {
            be.prepare_attention(hp.head_dim, layer_rope(&hp, l))?;
        }
        let h = hp.hidden;
        // Tied: the embedding table is the output layer too, so it needs the projection layout.
        let tied = hp.tied_embeddings && !bundle.has(TensorKey::Output);
        let table = bundle.matrix(TensorKey::TokenEmbedding, hp.vocab, h)?;
        let embed = if tied {
            be.load_matrix(table)?
        } else {
            be.load_table(table)?
        };
        let mut weight_bytes = be.matrix_bytes(&embed);
        let mut mat = |key: TensorKey, rows: usize, cols: usize| -> Result<B::Matrix> {
            let m = be.load_matrix(bundle.matrix(key, rows, cols)?)?;
            weight_bytes += be.matrix_bytes(&m);
            Ok(m)
        };
        let output = if tied {
            None
        } else {
            Some(mat(TensorKey::Output, hp.vocab, h)?)
        };
        let mut vec = |key: TensorKey, len: usize| -> Result<B::Buffer> {
            Ok(be.upload(&bundle.vector(key, len)?))
        };
        let mut linear_bytes = 0;
        let layers = (0..hp.n_layers)
            .map(|l| {
                let sparse = hp.block.moe.as_ref().is_some_and(|m| m.sparse[l]);
                let linear = match &hp.block.linear {
                    Some(la) if la.layers[l] => {
                        let (d, bytes) = DeltaNet::load(bundle, &hp, l, be)?;
                        linear_bytes += bytes;
                        Some(d)
                    }
                    _ => None,
                };
                Layer::load(&hp, l, sparse, linear, &mut mat, &mut vec)
            })
            .collect::<Result<Vec<_>>>()?;
        weight_bytes += linear_bytes;
        let output_norm = be.upload(&bundle.vector(TensorKey::OutputNorm, h)?);
        if matches!(hp.arch, Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen3Next) && !hp.qk_norm {
            return Err(Error::Invalid(format!(
                "{} without q/k norms",
                hp.arch.name()
            )));
        }
        Ok(Model {
            hp,
            backend,
            embed: Arc::new(embed),
            output,
            output_norm,
            layers,
            scratch: None,
            seq_scratch: Vec::new(),
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

    /// A fresh KV cache for this model holding up to `max_tokens` slots (capped by the context length); local
    /// layers keep rings of their window.
    pub fn new_cache(&self, max_tokens: usize) -> KvCache<B> {
        let cap = max_tokens.min(self.hp.context_len).max(1);
        let windows = (0..self.hp.n_layers)
            .map(|l| self.hp.layer_attention(l).0)
            .collect();
        let recurrent = (0..self.hp.n_layers)
            .map(|l| match &self.hp.block.linear {
                Some(la) if la.layers[l] => la.state_len(),
                _ => 0,
            })
            .collect();
        KvCache::with_recurrent(
            self.backend.as_ref(),
            CacheShape {
                n_layers: self.hp.n_layers,
                n_heads: self.hp.n_heads,
                n_kv_heads: self.hp.n_kv_heads,
                head_dim: self.hp.head_dim,
            },
            cap,
            windows,
            recurrent,
        )
    }

    pub(super) fn scratch(&mut self, rows: usize) -> Scratch<B> {
        match self.scratch.take() {
            Some(s) if s.rows >= rows => s,
            _ => Scratch::new(self.backend.as_ref(), &self.hp, rows, self.hp.vocab),
        }
    }

    /// The token embedding table (shared with an MTP head, which embeds its drafted tokens with it).
    pub(crate) fn embedding(&self) -> Arc<B::Matrix> {
        self.embed.clone()
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
        self.forward_states(cache, batch, logit_rows, hidden_layers, false)
    }

    /// [`Model::forward`], with every row's final hidden state too where `final_hidden`.
    fn forward_states(
        &mut self,
        cache: &mut KvCache<B>,
        batch: &Batch,
        logit_rows: LogitRows,
        hidden_layers: &[usize],
        final_hidden: bool,
    ) -> Result<ForwardOutput> {
        let rows = batch.rows();
        self.check_batch(batch, hidden_layers)?;
        cache.reserve(self.backend.as_ref(), rows)?;
        // Rows whose logits are all asked for are a verify's: a rollback may keep any of them.
        cache.begin_forward(rows, logit_rows.every_row());
        let mut s = self.scratch(rows);
        let out = self.run(
            cache,
            batch,
            logit_rows,
            hidden_layers,
            final_hidden,
            &mut s,
        );
        self.scratch = Some(s);
        self.fault_check(cache, rows)?;
        Ok(out)
    }

    /// A device fault during the forward that appended `rows` to `cache` (or during any device work since the
    /// last forward: a draft) becomes the forward's error, and the rows are rolled back.
    pub(super) fn fault_check(&self, cache: &mut KvCache<B>, rows: usize) -> Result<()> {
        match self.backend.take_fault() {
            Some(fault) => {
                cache.truncate(cache.len() - rows);
                Err(Error::Device(fault))
            }
            None => Ok(()),
        }
    }

    /// [`Model::forward`] that also returns every row's final hidden state (after the output norm, what the
    /// output projection reads) in [`ForwardOutput::final_hidden`]: what an MTP head conditions on.
    pub fn forward_with_hidden(
        &mut self,
        cache: &mut KvCache<B>,
        batch: &Batch,
        logit_rows: LogitRows,
    ) -> Result<ForwardOutput> {
        self.forward_states(cache, batch, logit_rows, &[], true)
    }

    /// [`Model::forward`] that also returns `features` of every row in [`ForwardOutput::features`] (`rows ×
    /// features.width(hidden)`): what the route's proposer conditions on.
    pub fn forward_features(
        &mut self,
        cache: &mut KvCache<B>,
        batch: &Batch,
        logit_rows: LogitRows,
        features: &TargetFeatures,
    ) -> Result<ForwardOutput> {
        if features.is_none() {
            return self.forward(cache, batch, logit_rows, &[]);
        }
        let (h, rows) = (self.hp.hidden, batch.rows());
        let mut out = self.forward_states(
            cache,
            batch,
            logit_rows,
            &features.layers,
            features.final_state,
        )?;
        let per_layer: Vec<&[f32]> = features
            .layers
            .iter()
            .map(|l| {
                let (_, v) = out.hidden.iter().find(|(m, _)| m == l).expect("asked for");
                v.as_slice()
            })
            .chain(features.final_state.then_some(out.final_hidden.as_slice()))
            .collect();
        let mut rows_out = Vec::with_capacity(rows * per_layer.len() * h);
        for r in 0..rows {
            for v in &per_layer {
                rows_out.extend_from_slice(&v[r * h..(r + 1) * h]);
            }
        }
        out.features = rows_out;
        out.hidden.clear();
        out.final_hidden.clear();
        Ok(out)
    }

    pub(super) fn check_batch(&self, batch: &Batch, hidden_layers: &[usize]) -> Result<()> {
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
        if !batch.spatial.is_empty()
            && (batch.spatial.len() != rows || self.hp.block.mrope.is_none())
        {
            return Err(Error::Invalid(format!(
                "{} multimodal positions for {rows} rows of a model {} multimodal rotary positions",
                batch.spatial.len(),
                if self.hp.block.mrope.is_some() {
                    "with"
                } else {
                    "without"
                }
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
        let mut next_free = 0;
        for m in &batch.media {
            if m.rows == 0
                || m.first_row < next_free
                || m.first_row + m.rows > rows
                || m.values.len() != m.rows * self.hp.hidden
            {
                return Err(Error::Invalid(format!(
                    "image rows {}..{} ({} values) do not fit a batch of {rows} rows of {} values, in order",
                    m.first_row,
                    m.first_row + m.rows,
                    m.values.len(),
                    self.hp.hidden
                )));
            }
            next_free = m.first_row + m.rows;
        }
        if let Some(&l) = hidden_layers.iter().find(|&&l| l >= self.hp.n_layers) {
            return Err(Error::Invalid(format!(
                "hidden layer {l} of a {}-layer model",
                self.hp.n_layers
            )));
        }
        if hidden_layers.len() > MAX_STATE_LAYERS {
            return Err(Error::Invalid(format!(
                "{} hidden layers asked for (at most {MAX_STATE_LAYERS})",
                hidden_layers.len()
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
        final_hidden: bool,
        s: &mut Scratch<B>,
    ) -> ForwardOutput {
        let be = self.backend.as_ref();
        let rows = batch.rows();
        let h = self.hp.hidden;
        be.set_step(
            &mut s.step,
            StepInputs {
                tokens: &batch.tokens,
                positions: &batch.positions,
                spatial: &batch.spatial,
                base: cache.len(),
                mask: &batch.mask,
            },
        );
        let mut out = ForwardOutput::default();
        let tree = matches!(batch.mask, AttnMask::Tree(_));
        let key = (
            s.id,
            cache.buffers_id(),
            rows,
            tree,
            logit_rows.work(),
            final_hidden,
            hidden_layers,
        );
        let parents = parents(&batch.mask, rows);
        // An image's rows: its features on the device, copied over those rows' embeddings.
        let media: Vec<(usize, usize, B::Buffer)> = batch
            .media
            .iter()
            .map(|m| (m.first_row, m.values.len(), be.upload(&m.values)))
            .collect();
        let mut work = || {
            self.encode(
                cache,
                rows,
                &media,
                &parents,
                logit_rows.work(),
                final_hidden,
                hidden_layers,
                s,
            )
        };
        if self.hp.block.moe.is_some() || self.hp.block.linear.is_some() || !media.is_empty() {
            // A mixture routes on the host mid-forward, and a Gated DeltaNet steps its state there: a recording
            // cannot hold either; nor an image's features, uploaded for this forward alone.
            work();
        } else {
            run_recorded(be, rows, key, &mut work);
        }
        if !hidden_layers.is_empty() {
            let states = be.download(&s.states, hidden_layers.len() * rows * h);
            out.hidden = hidden_layers
                .iter()
                .zip(states.chunks_exact(rows * h))
                .map(|(&l, v)| (l, v.to_vec()))
                .collect();
        }
        cache.advance(rows);
        if final_hidden {
            out.final_hidden = be.download(&s.xn, rows * h);
        }
        let n = match logit_rows {
            LogitRows::All => rows,
            LogitRows::Last => 1,
            LogitRows::None | LogitRows::Greedy | LogitRows::Drawn(_) => 0,
        };
        match logit_rows {
            LogitRows::Greedy => {
                out.greedy = be
                    .download(&s.greedy, rows)
                    .into_iter()
                    .map(|t| t as u32)
                    .collect();
            }
            LogitRows::Drawn(race) => {
                let draws: Vec<RowDraw> = batch
                    .positions
                    .iter()
                    .enumerate()
                    .map(|(row, &p)| RowDraw {
                        row,
                        race,
                        position: p + 1,
                    })
                    .collect();
                out.greedy = be.draw(&s.logits, self.hp.vocab, &draws);
            }
            _ => {}
        }
        if n > 0 {
            out.logits = be.download(&s.logits, n * self.hp.vocab);
        }
        out
    }

    /// The input norm of what projects the residual stream after layer `l`: the next layer's, or after the last
    /// the output norm where it is fused into the output projection (`output_fused`).
    pub(super) fn next_norm(&self, l: usize, output_fused: bool) -> Option<&B::Buffer> {
        match self.layers.get(l + 1) {
            Some(next) => Some(&next.attn_norm),
            None => output_fused.then_some(&self.output_norm),
        }
    }

    /// The device work of a forward whose inputs are in `s.step`: the layers (the residual streams after those
    /// in `hidden_layers` copied to `s.states`, in that order; a recurrent layer's row `r` stepped from the
    /// state after row `parents[r]`), then the final norm of every row into `s.xn` if `final_hidden`, and the
    /// logits of the rows asked for into `s.logits`.
    #[allow(clippy::too_many_arguments)] // a forward's inputs and what it returns
    fn encode(
        &self,
        cache: &mut KvCache<B>,
        rows: usize,
        media: &[(usize, usize, B::Buffer)],
        parents: &[Option<usize>],
        logit_rows: LogitRows,
        final_hidden: bool,
        hidden_layers: &[usize],
        s: &mut Scratch<B>,
    ) {
        let be = self.backend.as_ref();
        let hp = &self.hp;
        let h = hp.hidden;
        be.embed(&self.embed, &s.step, rows, &mut s.x);
        if let Some(scale) = hp.block.embedding_scale {
            be.scale(&mut s.x, rows * h, scale);
        }
        // Images enter as they are: the scale is the token embeddings'.
        for (first, len, values) in media {
            be.copy(values, 0, &mut s.x, first * h, *len);
        }
        // The output norm is fused into the output projection where these rows' logits come from `s.x` itself.
        let output_fused = !final_hidden
            && match logit_rows {
                LogitRows::None => false,
                LogitRows::All | LogitRows::Greedy | LogitRows::Drawn(_) => true,
                LogitRows::Last => rows == 1,
            };
        for (l, layer) in self.layers.iter().enumerate() {
            let next = self.next_norm(l, output_fused);
            match &layer.mixer {
                Mixer::Attention(_) => {
                    let (kc, vc) = (&mut cache.k[l], &mut cache.v[l]);
                    let shape = layer_shape(hp, l, rows);
                    let rope = layer_rope(hp, l);
                    layer.run(be, hp, rope, s, [kc, vc, &mut cache.attn_work], shape, next);
                }
                Mixer::Linear(d) => {
                    let states = cache
                        .recurrent_mut()
                        .expect("a model with recurrent layers has their states");
                    d.run(be, hp, &layer.attn_norm, s, rows, parents, l, states);
                    let mlp_norm = layer.mlp_input_norm();
                    layer.add_output(
                        be, hp, &d.out, &s.attn, 0, rows, &mut s.tmp, &mut s.x, mlp_norm,
                    );
                    layer.feed_forward(be, hp, s, rows, next);
                }
            }
            if let Some(j) = hidden_layers.iter().position(|&m| m == l) {
                be.copy(&s.x, 0, &mut s.states, j * rows * h, rows * h);
            }
        }
        let eps = hp.rms_eps;
        if final_hidden {
            be.rms_norm(&s.x, &self.output_norm, rows, h, eps, &mut s.xn);
        }
        let output = self.output.as_ref().unwrap_or(self.embed.as_ref());
        match logit_rows {
            LogitRows::None => {}
            LogitRows::All | LogitRows::Greedy | LogitRows::Drawn(_) => {
                if final_hidden {
                    be.matmul(output, &s.xn, rows, &mut s.logits);
                } else {
                    // The output norm fused into the output projection (one launch fewer on a GPU).
                    let norm = Some((&self.output_norm, eps));
                    be.matmuls(&s.x, norm, rows, &mut [(output, &mut s.logits)]);
                }
                if logit_rows == LogitRows::Greedy {
                    be.argmax(&s.logits, rows, hp.vocab, &mut s.greedy);
                }
            }
            // The last row alone: moved to the front of `tmp` (already normed, or normed inside the projection).
            LogitRows::Last if final_hidden => {
                be.copy(&s.xn, (rows - 1) * h, &mut s.tmp, 0, h);
                be.matmul(output, &s.tmp, 1, &mut s.logits);
            }
            LogitRows::Last => {
                let last = if rows == 1 {
                    &s.x
                } else {
                    be.copy(&s.x, (rows - 1) * h, &mut s.tmp, 0, h);
                    &s.tmp
                };
                let norm = Some((&self.output_norm, eps));
                be.matmuls(last, norm, 1, &mut [(output, &mut s.logits)]);
            }
        }
    }
}

/// Layer `l`'s attention over `rows` new rows: its window, if local, and the model's score scale.
pub(super) fn layer_shape(hp: &HParams, l: usize, rows: usize) -> AttnShape {
    AttnShape {
        rows,
        n_heads: hp.n_heads,
        n_kv_heads: hp.n_kv_heads,
        head_dim: hp.head_dim,
        scale: hp.attention_scale(),
        window: hp.layer_attention(l).0,
    }
}

/// Layer `l`'s rotation (local layers have their own base and are not stretched).
pub(super) fn layer_rope(hp: &HParams, l: usize) -> Rope {
    let (window, theta) = hp.layer_attention(l);
    Rope {
        theta,
        style: hp.rope_style,
        scaling: if window.is_some() {
            RopeScaling::None
        } else {
            hp.rope_scaling
        },
        dims: hp.block.rotary_dims,
        mrope: hp.block.mrope,
    }
}

/// Each row's parent among the forward's rows (the row whose state it continues): the row before it under a
/// causal mask; in a draft tree the nearest row it sees (its parent node); `None` for a row that continues
/// the committed state.
fn parents(mask: &AttnMask, rows: usize) -> Vec<Option<usize>> {
    (0..rows)
        .map(|r| (0..r).rev().find(|&j| mask.sees(rows, r, j)))
        .collect()
}

impl<B: Backend> Scratch<B> {
    /// Buffers for up to `rows` rows (rounded up to a power of two) and `vocab` logits per row.
    pub(super) fn new(be: &B, hp: &HParams, rows: usize, vocab: usize) -> Self {
        let rows = rows.next_power_of_two();
        let moe = hp.block.moe.as_ref();
        let qd = hp.n_heads * hp.head_dim;
        let kvd = hp.n_kv_heads * hp.head_dim;
        // A Gated DeltaNet's input projections go to `act` (Q/K/V/Z) and `router` (β/α), its output to `attn`.
        let (linear_in, linear_ba, linear_out) = hp.block.linear.as_ref().map_or((0, 0, 0), |la| {
            let (kd, vd) = (la.key_heads * la.key_dim, la.value_heads * la.value_dim);
            (2 * kd + 2 * vd, 2 * la.value_heads, vd)
        });
        let act = hp
            .ffn_hidden
            .max(moe.map_or(0, |m| m.ffn.max(m.shared_ffn.unwrap_or(0))))
            .max(linear_in);
        Scratch {
            rows,
            id: buffer_set_id(),
            step: be.step(rows),
            x: be.buffer(rows * hp.hidden),
            xn: be.buffer(rows * hp.hidden),
            q: be.buffer(rows * qd),
            gate: be.buffer(if hp.block.attention_gate {
                rows * qd
            } else {
                1
            }),
            k: be.buffer(rows * kvd),
            v: be.buffer(rows * kvd),
            tmp: be.buffer(rows * qd.max(hp.hidden)),
            attn: be.buffer(rows * qd.max(linear_out)),
            act: be.buffer(rows * act),
            router: be.buffer(rows * moe.map_or(1, |m| m.experts).max(linear_ba)),
            gathered: be.buffer(if moe.is_some() { rows * hp.hidden } else { 1 }),
            logits: be.buffer(rows * vocab),
            greedy: be.buffer(rows),
            states: be.buffer(rows * hp.hidden * MAX_STATE_LAYERS),
        }
    }
}

impl<B: Backend> Layer<B> {
    /// Load layer `l` (with a mixture-of-experts MLP when `sparse`; mixed by `linear` where it is a Gated
    /// DeltaNet layer, else by attention) through `mat(key, rows, cols)` and `vec(key, len)`, which resolve
    /// the tensor names.
    pub(super) fn load(
        hp: &HParams,
        l: usize,
        sparse: bool,
        linear: Option<DeltaNet<B>>,
        mat: &mut impl FnMut(TensorKey, usize, usize) -> Result<B::Matrix>,
        vec: &mut impl FnMut(TensorKey, usize) -> Result<B::Buffer>,
    ) -> Result<Self> {
        let (h, qd, kvd, f) = (
            hp.hidden,
            hp.n_heads * hp.head_dim,
            hp.n_kv_heads * hp.head_dim,
            hp.ffn_hidden,
        );
        let mixer = match linear {
            Some(d) => Mixer::Linear(d),
            None => Mixer::Attention(Attention {
                q: mat(TensorKey::Q(l), qd, h)?,
                k: mat(TensorKey::K(l), kvd, h)?,
                v: mat(TensorKey::V(l), kvd, h)?,
                o: mat(TensorKey::O(l), h, qd)?,
                gate: if hp.block.attention_gate {
                    Some(mat(TensorKey::QGate(l), qd, h)?)
                } else {
                    None
                },
                qkv_bias: if hp.qkv_bias {
                    Some([
                        vec(TensorKey::QBias(l), qd)?,
                        vec(TensorKey::KBias(l), kvd)?,
                        vec(TensorKey::VBias(l), kvd)?,
                    ])
                } else {
                    None
                },
                qk_norm: if hp.qk_norm {
                    Some([
                        vec(TensorKey::QNorm(l), hp.head_dim)?,
                        vec(TensorKey::KNorm(l), hp.head_dim)?,
                    ])
                } else {
                    None
                },
            }),
        };
        Ok(Layer {
            attn_norm: vec(TensorKey::AttnNorm(l), h)?,
            mixer,
            ffn_norm: vec(TensorKey::FfnNorm(l), h)?,
            post_norms: if hp.block.post_norms {
                Some([
                    vec(TensorKey::AttnPostNorm(l), h)?,
                    vec(TensorKey::FfnPostNorm(l), h)?,
                ])
            } else {
                None
            },
            mlp: match hp.block.moe.as_ref().filter(|_| sparse) {
                Some(m) => Mlp::Experts {
                    router: mat(TensorKey::Router(l), m.experts, h)?,
                    experts: (0..m.experts)
                        .map(|e| {
                            Ok([
                                mat(TensorKey::ExpertGate(l, e), m.ffn, h)?,
                                mat(TensorKey::ExpertUp(l, e), m.ffn, h)?,
                                mat(TensorKey::ExpertDown(l, e), h, m.ffn)?,
                            ])
                        })
                        .collect::<Result<_>>()?,
                    shared: match m.shared_ffn {
                        Some(sf) => Some(SharedExpert {
                            mlp: [
                                mat(TensorKey::SharedGate(l), sf, h)?,
                                mat(TensorKey::SharedUp(l), sf, h)?,
                                mat(TensorKey::SharedDown(l), h, sf)?,
                            ],
                            weight: mat(TensorKey::SharedWeight(l), 1, h)?,
                        }),
                        None => None,
                    },
                },
                None => Mlp::Dense {
                    gate: mat(TensorKey::Gate(l), f, h)?,
                    up: mat(TensorKey::Up(l), f, h)?,
                    down: mat(TensorKey::Down(l), h, f)?,
                },
            },
        })
    }

    /// The layer's attention, where it has one (an MTP head's and a block drafter's layers always do).
    /// Whether this is a Gated DeltaNet layer.
    pub(super) fn is_linear(&self) -> bool {
        matches!(self.mixer, Mixer::Linear(_))
    }

    pub(super) fn attention(&self) -> &Attention<B> {
        match &self.mixer {
            Mixer::Attention(a) => a,
            Mixer::Linear(_) => {
                panic!("an attention layer was asked for, not a linear-attention one")
            }
        }
    }

    /// The block over `rows = shape.rows` rows of `s.x`, in place, with its inputs in `s.step`: attention (its
    /// K/V written to the cache layer's slots from the step's base; the cache's attention scratch third) and the
    /// MLP, each added to the residual stream. `next`: the input norm of what projects `s.x` next (the next
    /// layer's, or the output norm fused into the output projection), where known ([`Backend::rms_norm_add`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        &self,
        be: &B,
        hp: &HParams,
        rope: Rope,
        s: &mut Scratch<B>,
        [k_cache, v_cache, attn_work]: [&mut B::Buffer; 3],
        shape: AttnShape,
        next: Option<&B::Buffer>,
    ) {
        let rows = shape.rows;
        let a = self.attention();
        if a.qkv_bias.is_none() && a.qk_norm.is_none() && a.gate.is_none() {
            // Nothing between the projections and RoPE: one fused step where the backend has it.
            be.qkv_rope_and_cache(
                &s.x,
                Some((&self.attn_norm, hp.rms_eps)),
                [&a.q, &a.k, &a.v],
                [&mut s.q, &mut s.k, &mut s.v],
                [&mut *k_cache, &mut *v_cache],
                shape,
                rope,
                &s.step,
            );
        } else {
            self.qkv_unfused(be, hp, rope, s, [&mut *k_cache, &mut *v_cache], shape);
        }
        be.attention(
            &s.q,
            k_cache,
            v_cache,
            attn_work,
            shape,
            &s.step,
            &mut s.attn,
        );
        self.finish(be, hp, s, rows, next);
    }

    /// The rest of an attention block over `rows` rows whose attention output is in `s.attn`: the output gate
    /// where the layer has one, the output projection added to `s.x`, then the MLP (`next` as in
    /// [`Layer::run`]).
    pub(super) fn finish(
        &self,
        be: &B,
        hp: &HParams,
        s: &mut Scratch<B>,
        rows: usize,
        next: Option<&B::Buffer>,
    ) {
        let a = self.attention();
        if a.gate.is_some() {
            // attn ⊙ σ(gate), on the host (one of the layers a Gated DeltaNet model keeps out of recordings).
            let n = rows * hp.n_heads * hp.head_dim;
            let gate = be.download(&s.gate, n);
            let mut out = be.download(&s.attn, n);
            for (o, g) in out.iter_mut().zip(gate) {
                *o *= 1.0 / (1.0 + (-g).exp());
            }
            be.write(&mut s.attn, &out);
        }
        let mlp_norm = self.mlp_input_norm();
        self.add_output(
            be, hp, &a.o, &s.attn, 0, rows, &mut s.tmp, &mut s.x, mlp_norm,
        );
        self.feed_forward(be, hp, s, rows, next);
    }

    /// The norm the MLP projects `s.x` through first, where that is a projection of it (a dense MLP's).
    pub(super) fn mlp_input_norm(&self) -> Option<&B::Buffer> {
        matches!(self.mlp, Mlp::Dense { .. }).then_some(&self.ffn_norm)
    }

    /// The MLP over `rows` rows of `s.x`, added to it (`next` as in [`Layer::run`]).
    pub(super) fn feed_forward(
        &self,
        be: &B,
        hp: &HParams,
        s: &mut Scratch<B>,
        rows: usize,
        next: Option<&B::Buffer>,
    ) {
        match &self.mlp {
            Mlp::Dense { gate, up, down } => {
                be.glu_matmul(
                    &s.x,
                    Some((&self.ffn_norm, hp.rms_eps)),
                    rows,
                    gate,
                    up,
                    hp.block.glu,
                    &mut s.act,
                );
                self.add_output(be, hp, down, &s.act, 1, rows, &mut s.tmp, &mut s.x, next);
            }
            Mlp::Experts {
                router,
                experts,
                shared,
            } => {
                mixture(
                    be,
                    hp,
                    &self.ffn_norm,
                    router,
                    experts,
                    shared.as_ref(),
                    s,
                    rows,
                );
            }
        }
    }

    /// `x += w · input`, through the layer's post-norm `which` (0 attention, 1 MLP) where it has them; `tmp`
    /// holds the projection then, and `next` is the input norm of what projects `x` next, where known.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn add_output(
        &self,
        be: &B,
        hp: &HParams,
        w: &B::Matrix,
        input: &B::Buffer,
        which: usize,
        rows: usize,
        tmp: &mut B::Buffer,
        x: &mut B::Buffer,
        next: Option<&B::Buffer>,
    ) {
        match &self.post_norms {
            None => be.matmul_add(w, input, rows, x),
            Some(norms) => {
                be.matmul(w, input, rows, tmp);
                let next = next.map(|n| (n, hp.rms_eps));
                be.rms_norm_add(tmp, &norms[which], rows, hp.hidden, hp.rms_eps, x, next);
            }
        }
    }

    /// The K/V of `shape.rows` rows of `x` that enter this layer's attention without its input norm (a block
    /// drafter's fused target states): projected ([`Layer::context_kv_projections`]), K rotated at the step's
    /// positions, both written to the cache slots from the step's base. `s.q` and `s.tmp` are scratch.
    #[allow(clippy::too_many_arguments)] // `run`'s inputs and the rows
    pub(super) fn context_kv(
        &self,
        be: &B,
        hp: &HParams,
        rope: Rope,
        x: &B::Buffer,
        s: &mut Scratch<B>,
        [k_cache, v_cache]: [&mut B::Buffer; 2],
        shape: AttnShape,
    ) {
        self.context_kv_projections(be, hp, x, s, shape.rows);
        let norms = self.head_norms(hp);
        be.rope_and_cache(
            &mut s.q, &mut s.k, &s.v, k_cache, v_cache, shape, rope, norms, &s.step,
        );
    }

    /// The K/V projections of `rows` rows of `x` into `s.k` and `s.v`, with the biases where the layer has them
    /// (the per-head K norm comes with RoPE).
    pub(super) fn context_kv_projections(
        &self,
        be: &B,
        hp: &HParams,
        x: &B::Buffer,
        s: &mut Scratch<B>,
        rows: usize,
    ) {
        let kvd = hp.n_kv_heads * hp.head_dim;
        let a = self.attention();
        be.matmuls(x, None, rows, &mut [(&a.k, &mut s.k), (&a.v, &mut s.v)]);
        if let Some([_, bk, bv]) = &a.qkv_bias {
            be.add_bias(&mut s.k, bk, rows, kvd);
            be.add_bias(&mut s.v, bv, rows, kvd);
        }
    }

    /// Q/K/V with their biases, then the per-head norms, RoPE and the cache write.
    fn qkv_unfused(
        &self,
        be: &B,
        hp: &HParams,
        rope: Rope,
        s: &mut Scratch<B>,
        [k_cache, v_cache]: [&mut B::Buffer; 2],
        shape: AttnShape,
    ) {
        self.qkv_projections(be, hp, s, shape.rows);
        let norms = self.head_norms(hp);
        be.rope_and_cache(
            &mut s.q, &mut s.k, &s.v, k_cache, v_cache, shape, rope, norms, &s.step,
        );
    }

    /// The per-head Q/K norms [`Backend::rope_and_cache`] applies, where the layer has them.
    pub(super) fn head_norms(&self, hp: &HParams) -> Option<HeadNorms<'_, B::Buffer>> {
        self.attention().qk_norm.as_ref().map(|[q, k]| HeadNorms {
            q,
            k,
            eps: hp.rms_eps,
        })
    }

    /// Q, K and V of `rows` rows of `s.x` (and the output gates), with their biases, into `s.q`, `s.k`, `s.v`
    /// (`s.gate`); the per-head norms come with RoPE ([`Layer::head_norms`]).
    pub(super) fn qkv_projections(&self, be: &B, hp: &HParams, s: &mut Scratch<B>, rows: usize) {
        let hd = hp.head_dim;
        let (qd, kvd) = (hp.n_heads * hd, hp.n_kv_heads * hd);
        let a = self.attention();
        let norm = Some((&self.attn_norm, hp.rms_eps));
        match &a.gate {
            None => be.matmuls(
                &s.x,
                norm,
                rows,
                &mut [(&a.q, &mut s.q), (&a.k, &mut s.k), (&a.v, &mut s.v)],
            ),
            Some(g) => be.matmuls(
                &s.x,
                norm,
                rows,
                &mut [
                    (&a.q, &mut s.q),
                    (&a.k, &mut s.k),
                    (&a.v, &mut s.v),
                    (g, &mut s.gate),
                ],
            ),
        }
        if let Some([bq, bk, bv]) = &a.qkv_bias {
            be.add_bias(&mut s.q, bq, rows, qd);
            be.add_bias(&mut s.k, bk, rows, kvd);
            be.add_bias(&mut s.v, bv, rows, kvd);
        }
    }
}
