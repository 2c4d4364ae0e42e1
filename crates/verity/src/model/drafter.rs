//! A block drafter (DFlash-style), run on the target's backend beside the target.
//!
//! **Context.** For each committed position `p`, the target's residual streams after the drafter's target
//! layers are concatenated and fused: `c_p = hidden_norm(fc([h_a; h_b; …]))`. Every drafter layer keeps the K/V
//! of `c_p` (its own K/V projections of `c_p`, without its input norm; K normed per head where the layer has Q/K
//! norms and rotated at `p`) in the drafter's cache — computed once, when `p` is committed
//! ([`BlockDrafter::extend_context`]).
//!
//! **Draft.** The block `[t_n, m, m, …]` (the pending token at position `n`, then the mask token at `n + 1..`)
//! is embedded with the target's embedding and runs through the drafter's layers, each of whose queries sees
//! the whole context and the whole block (no causal order inside the block); after the final norm, the
//! target's output matrix turns mask row `i` into the drafter's distribution for the token at `n + i`. One
//! forward proposes the whole block; the block's K/V are written past the cache's committed slots and never
//! kept. RoPE is the Hugging Face rotate-half pairing of the drafter's own weights, whatever the target's.
//!
//! Float drafter weights are re-encoded as Q8_0 at load, as the MTP head's are: every draft reads every weight,
//! and the drafter's numerics never reach the output (the verifier judges every draft).

use std::sync::Arc;

use super::batched::{fit_own, write_batch_step, SeqRows};
use super::decoder::{Layer, Scratch};
use super::{drafting_cache, drafting_matrix, run_recorded, DraftVocab, Model};
use crate::backend::{AttnMask, AttnShape, Backend, Rope, RopeStyle, StepInputs};
use crate::bundle::drafter::{tensor_name, DRAFT_VOCAB};
use crate::bundle::hparams::{BlockStyle, HParams};
use crate::bundle::{st_vector, Bundle, DrafterSpec, DrafterStatus, TensorKey};
use crate::cache::KvCache;
use crate::error::{Error, Result};

/// Context rows fused and cached per forward (a long prompt's context is added in pieces of this many).
const CONTEXT_CHUNK: usize = 64;

/// Work buffers of the drafter beyond a block's scratch.
struct DrafterScratch<B: Backend> {
    block: Scratch<B>,
    /// `rows × width`: the target states of the context rows being added.
    states: B::Buffer,
    /// `rows × hidden`: their fusion, before and after `hidden_norm`.
    fused: B::Buffer,
    fused_normed: B::Buffer,
}

pub struct BlockDrafter<B: Backend> {
    spec: DrafterSpec,
    /// The drafter layers' hyper-parameters (its hidden size and vocabulary are the target's).
    hp: HParams,
    backend: Arc<B>,
    embed: Arc<B::Matrix>,
    fc: B::Matrix,
    hidden_norm: B::Buffer,
    layers: Vec<Layer<B>>,
    norm: B::Buffer,
    lm_head: B::Matrix,
    /// Row `i` of `lm_head` is token `draft_vocab.token(i)`.
    draft_vocab: DraftVocab,
    scratch: Option<DrafterScratch<B>>,
    /// Each request's attention buffers in a batched draft ([`BlockDrafter::draft_batched`]).
    seq_scratch: Vec<Scratch<B>>,
}

/// One request's part of [`BlockDrafter::draft_batched`]: the context it adds first (what
/// [`BlockDrafter::extend_context`] takes), then what [`BlockDrafter::draft`] takes.
pub struct BlockDraft<'a, B: Backend> {
    pub cache: &'a mut KvCache<B>,
    /// The target states (`rows × state_width`) of the positions just before `pos` that the cache does not hold
    /// yet (empty: none).
    pub context: &'a [f32],
    pub pending: u32,
    pub pos: usize,
    pub k: usize,
}

impl<B: Backend> BlockDrafter<B> {
    /// Load the bundle's complete drafter for `target`. Fails (and the planner takes the next route) when the
    /// bundle's drafter is not complete.
    pub fn load(bundle: &Bundle, target: &Model<B>) -> Result<Self> {
        let DrafterStatus::Complete(spec) = &bundle.drafter else {
            return Err(Error::Invalid(format!(
                "no usable block drafter: {}",
                bundle.drafter.describe()
            )));
        };
        let tensors = bundle
            .drafter_tensors()
            .expect("a complete drafter has its tensors");
        let spec = spec.as_ref().clone();
        let hp = HParams {
            n_layers: spec.layers,
            n_heads: spec.heads,
            n_kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            ffn_hidden: spec.ffn,
            rms_eps: spec.rms_eps,
            rope_theta: spec.rope_theta,
            rope_style: RopeStyle::HalfSplit,
            qkv_bias: false,
            qk_norm: spec.qk_norm,
            // The DFlash layout's blocks are Qwen3's, whatever the target's are.
            block: BlockStyle::default(),
            ..target.hp.clone()
        };
        hp.validate()?;
        let backend = target.backend().clone();
        let be = backend.as_ref();
        be.prepare_attention(hp.head_dim, rope(&hp))?;
        let load =
            |name: &str, rows: usize, cols: usize| drafting_matrix(be, tensors, name, rows, cols);
        let h = hp.hidden;
        let vector =
            |name: &str| -> Result<B::Buffer> { Ok(be.upload(&st_vector(tensors, name, h)?)) };
        let mut layers = Vec::with_capacity(spec.layers);
        for l in 0..spec.layers {
            let mut mat =
                |key: TensorKey, rows: usize, cols: usize| load(&tensor_name(key), rows, cols);
            let mut vec = |key: TensorKey, len: usize| {
                Ok(be.upload(&st_vector(tensors, &tensor_name(key), len)?))
            };
            layers.push(Layer::load(&hp, l, false, None, &mut mat, &mut vec)?);
        }
        let draft_vocab =
            DraftVocab::load(tensors, spec.draft_vocab.then_some(DRAFT_VOCAB), hp.vocab)?;
        let lm_head = draft_vocab.output_head(be, bundle)?;
        Ok(BlockDrafter {
            draft_vocab,
            fc: load("fc.weight", h, spec.target_layers.len() * h)?,
            hidden_norm: vector("hidden_norm.weight")?,
            norm: vector("norm.weight")?,
            embed: target.embedding(),
            layers,
            lm_head,
            hp,
            spec,
            backend,
            scratch: None,
            seq_scratch: Vec::new(),
        })
    }

    pub fn spec(&self) -> &DrafterSpec {
        &self.spec
    }

    /// Size of the vocabulary the drafter drafts from.
    pub fn draft_vocab_len(&self) -> usize {
        self.draft_vocab.len()
    }

    /// The token id of logit `i`.
    pub fn token(&self, i: usize) -> u32 {
        self.draft_vocab.token(i)
    }

    /// Values of target state per context row (the target layers' states, concatenated).
    pub fn state_width(&self) -> usize {
        self.spec.target_layers.len() * self.hp.hidden
    }

    /// A fresh cache for the drafter's context (one layer per drafter layer).
    pub fn new_cache(&self, max_tokens: usize) -> KvCache<B> {
        drafting_cache(
            self.backend.as_ref(),
            &self.hp,
            self.layers.len(),
            max_tokens,
        )
    }

    fn scratch(&mut self, rows: usize) -> DrafterScratch<B> {
        match self.scratch.take() {
            Some(s) if s.block.rows >= rows => s,
            _ => {
                let be = self.backend.as_ref();
                let block = Scratch::new(be, &self.hp, rows, self.draft_vocab_len());
                let n = block.rows;
                DrafterScratch {
                    states: be.buffer(n * self.state_width()),
                    fused: be.buffer(n * self.hp.hidden),
                    fused_normed: be.buffer(n * self.hp.hidden),
                    block,
                }
            }
        }
    }

    fn shape(&self, rows: usize) -> AttnShape {
        AttnShape {
            rows,
            n_heads: self.hp.n_heads,
            n_kv_heads: self.hp.n_kv_heads,
            head_dim: self.hp.head_dim,
            scale: 1.0 / (self.hp.head_dim as f32).sqrt(),
            window: None,
        }
    }

    /// Add the context of positions `start..` (`states`: their target states, `rows × state_width`) to
    /// `cache`, which must end at `start`.
    pub fn extend_context(
        &mut self,
        cache: &mut KvCache<B>,
        start: usize,
        states: &[f32],
    ) -> Result<()> {
        let w = self.state_width();
        if states.is_empty() || !states.len().is_multiple_of(w) {
            return Err(Error::Invalid(format!(
                "block drafter: {} context values are not rows of {w}",
                states.len()
            )));
        }
        let rows = states.len() / w;
        if cache.len() + rows > cache.max_capacity() {
            return Err(Error::Invalid(format!(
                "block drafter: {rows} context rows do not fit a cache of {}",
                cache.max_capacity()
            )));
        }
        for (i, chunk) in states.chunks(CONTEXT_CHUNK * w).enumerate() {
            self.extend_chunk(cache, start + i * CONTEXT_CHUNK, chunk)?;
        }
        Ok(())
    }

    fn extend_chunk(&mut self, cache: &mut KvCache<B>, start: usize, states: &[f32]) -> Result<()> {
        let (w, h, eps) = (self.state_width(), self.hp.hidden, self.hp.rms_eps);
        let rows = states.len() / w;
        cache.reserve(self.backend.as_ref(), rows)?;
        let mut s = self.scratch(rows);
        let be = self.backend.as_ref();
        let positions: Vec<usize> = (start..start + rows).collect();
        be.set_step(
            &mut s.block.step,
            StepInputs {
                tokens: &vec![0; rows],
                positions: &positions,
                spatial: &[],
                base: cache.len(),
                mask: &AttnMask::Causal,
            },
        );
        be.write(&mut s.states, states);
        let (shape, rope) = (self.shape(rows), rope(&self.hp));
        let key = (s.block.id, cache.buffers_id(), rows, "context");
        run_recorded(be, rows, key, &mut || {
            be.matmul(&self.fc, &s.states, rows, &mut s.fused);
            be.rms_norm(
                &s.fused,
                &self.hidden_norm,
                rows,
                h,
                eps,
                &mut s.fused_normed,
            );
            for (i, layer) in self.layers.iter().enumerate() {
                let (kc, vc) = (&mut cache.k[i], &mut cache.v[i]);
                layer.context_kv(
                    be,
                    &self.hp,
                    rope,
                    &s.fused_normed,
                    &mut s.block,
                    [kc, vc],
                    shape,
                );
            }
        });
        cache.advance(rows);
        self.scratch = Some(s);
        Ok(())
    }

    /// Refuse a draft of `k` positions after token `pending`.
    fn check_draft(&self, pending: u32, k: usize) -> Result<()> {
        if !(1..self.spec.block).contains(&k) || pending as usize >= self.hp.vocab {
            return Err(Error::Invalid(format!(
                "block drafter: {k} drafts after token {pending} (1 to {} in a block)",
                self.spec.block - 1
            )));
        }
        Ok(())
    }

    /// The block's step inputs: `pending` at `pos`, then mask tokens, after `base` cached slots; inside the block
    /// every row sees every row.
    fn write_block(&self, step: &mut B::Step, pending: u32, pos: usize, rows: usize, base: usize) {
        let mut tokens = vec![self.spec.mask_token; rows];
        tokens[0] = pending;
        let positions: Vec<usize> = (pos..pos + rows).collect();
        self.backend.set_step(
            step,
            StepInputs {
                tokens: &tokens,
                positions: &positions,
                spatial: &[],
                base,
                mask: &AttnMask::Tree(vec![true; rows * rows]),
            },
        );
    }

    /// [`BlockDrafter::extend_context`] then [`BlockDrafter::draft`] for several requests at once, each
    /// request's context cache and logits bitwise what its own calls give: the new context rows of every request
    /// in one pass (a context longer than a chunk on its own, in chunks), then one forward over every request's
    /// block; the fusion, the projections and the output layer run once over all rows (each weight read once for
    /// all of them), each request's RoPE, cache writes and attention over its own cache.
    pub fn draft_batched(&mut self, jobs: &mut [BlockDraft<B>]) -> Result<Vec<Vec<f32>>> {
        let w = self.state_width();
        for j in jobs.iter() {
            self.check_draft(j.pending, j.k)?;
            if !j.context.len().is_multiple_of(w) || j.context.len() / w > j.pos {
                return Err(Error::Invalid(format!(
                    "block drafter: {} context values before position {} are not rows of {w}",
                    j.context.len(),
                    j.pos
                )));
            }
        }
        for j in jobs.iter_mut() {
            let rows = j.context.len() / w;
            if rows > CONTEXT_CHUNK {
                self.extend_context(j.cache, j.pos - rows, j.context)?;
                j.context = &[];
            }
        }
        if jobs.iter().any(|j| !j.context.is_empty()) {
            self.extend_batched(jobs)?;
        }
        let be = self.backend.clone();
        let be = be.as_ref();
        for j in jobs.iter_mut() {
            j.cache.reserve(be, j.k + 1)?;
        }
        let total: usize = jobs.iter().map(|j| j.k + 1).sum();
        let mut s = self.scratch(total);
        let mut own = std::mem::take(&mut self.seq_scratch);
        fit_own(be, &self.hp, &mut own, jobs.iter().map(|j| j.k + 1));
        let (h, eps, vocab) = (self.hp.hidden, self.hp.rms_eps, self.draft_vocab_len());
        let mut tokens = Vec::with_capacity(total);
        let mut positions = Vec::with_capacity(total);
        for (j, o) in jobs.iter().zip(own.iter_mut()) {
            let rows = j.k + 1;
            self.write_block(&mut o.step, j.pending, j.pos, rows, j.cache.len());
            tokens.push(j.pending);
            tokens.extend(std::iter::repeat_n(self.spec.mask_token, j.k));
            positions.extend(j.pos..j.pos + rows);
        }
        write_batch_step(be, &mut s.block.step, &tokens, &positions);
        let mut parts: Vec<SeqRows<B>> = jobs
            .iter_mut()
            .zip(own.iter_mut())
            .map(|(j, own)| SeqRows {
                rows: j.k + 1,
                cache: &mut *j.cache,
                own,
            })
            .collect();
        be.embed(&self.embed, &s.block.step, total, &mut s.block.x);
        let (hp, rope) = (&self.hp, rope(&self.hp));
        for (i, layer) in self.layers.iter().enumerate() {
            let shape = |rows| self.shape(rows);
            layer.run_batched(
                be,
                hp,
                rope,
                i,
                shape,
                &mut s.block,
                total,
                &mut parts,
                None,
            );
        }
        drop(parts);
        be.rms_norm(&s.block.x, &self.norm, total, h, eps, &mut s.block.xn);
        // Each block's mask rows (row 0 holds its pending token), together through the output layer.
        let (mut at, mut drafted) = (0, 0);
        for j in jobs.iter() {
            be.copy(
                &s.block.xn,
                (at + 1) * h,
                &mut s.block.tmp,
                drafted * h,
                j.k * h,
            );
            at += j.k + 1;
            drafted += j.k;
        }
        be.matmul(&self.lm_head, &s.block.tmp, drafted, &mut s.block.logits);
        let logits = be.download(&s.block.logits, drafted * vocab);
        self.scratch = Some(s);
        self.seq_scratch = own;
        let mut out = Vec::with_capacity(jobs.len());
        let mut rest = &logits[..];
        for j in jobs.iter() {
            let (mine, more) = rest.split_at(j.k * vocab);
            out.push(mine.to_vec());
            rest = more;
        }
        Ok(out)
    }

    /// The new context rows of every job (each at most a chunk) added to its cache in one pass.
    fn extend_batched(&mut self, jobs: &mut [BlockDraft<B>]) -> Result<()> {
        let (w, h, eps) = (self.state_width(), self.hp.hidden, self.hp.rms_eps);
        let be = self.backend.clone();
        let be = be.as_ref();
        let total: usize = jobs.iter().map(|j| j.context.len() / w).sum();
        for j in jobs.iter_mut() {
            let rows = j.context.len() / w;
            if j.cache.len() + rows > j.cache.max_capacity() {
                return Err(Error::Invalid(format!(
                    "block drafter: {rows} context rows do not fit a cache of {}",
                    j.cache.max_capacity()
                )));
            }
            j.cache.reserve(be, rows)?;
        }
        let mut s = self.scratch(total);
        let mut own = std::mem::take(&mut self.seq_scratch);
        fit_own(
            be,
            &self.hp,
            &mut own,
            jobs.iter().map(|j| j.context.len() / w),
        );
        let mut states = Vec::with_capacity(total * w);
        let mut parts: Vec<SeqRows<B>> = Vec::new();
        for (j, o) in jobs.iter_mut().zip(own.iter_mut()) {
            let rows = j.context.len() / w;
            if rows == 0 {
                continue;
            }
            let start = j.pos - rows;
            let positions: Vec<usize> = (start..j.pos).collect();
            be.set_step(
                &mut o.step,
                StepInputs {
                    tokens: &vec![0; rows],
                    positions: &positions,
                    spatial: &[],
                    base: j.cache.len(),
                    mask: &AttnMask::Causal,
                },
            );
            states.extend_from_slice(j.context);
            parts.push(SeqRows {
                rows,
                cache: &mut *j.cache,
                own: o,
            });
        }
        be.write(&mut s.states, &states);
        be.matmul(&self.fc, &s.states, total, &mut s.fused);
        be.rms_norm(
            &s.fused,
            &self.hidden_norm,
            total,
            h,
            eps,
            &mut s.fused_normed,
        );
        let (hp, rope) = (&self.hp, rope(&self.hp));
        for (i, layer) in self.layers.iter().enumerate() {
            let (shape, x) = (|rows| self.shape(rows), &s.fused_normed);
            layer.context_kv_batched(be, hp, x, rope, i, shape, &mut s.block, total, &mut parts);
        }
        for part in parts.iter_mut() {
            part.cache.advance(part.rows);
        }
        drop(parts);
        for j in jobs.iter_mut() {
            j.context = &[];
        }
        self.scratch = Some(s);
        self.seq_scratch = own;
        Ok(())
    }

    /// The drafter's logits for the `k` positions (at most the block's `block - 1`) after `pending` at position
    /// `pos`, the cache holding the context up to `pos`: `k × draft_vocab_len` values, [`BlockDrafter::token`]
    /// naming logit `i` (greedy drafts build a tree from them, so the whole distribution comes back, not an
    /// argmax). The cache's committed length does not change.
    pub fn draft(
        &mut self,
        cache: &mut KvCache<B>,
        pending: u32,
        pos: usize,
        k: usize,
    ) -> Result<Vec<f32>> {
        self.check_draft(pending, k)?;
        let rows = k + 1;
        cache.reserve(self.backend.as_ref(), rows)?;
        let mut s = self.scratch(rows);
        let be = self.backend.as_ref();
        let (h, eps, vocab) = (self.hp.hidden, self.hp.rms_eps, self.draft_vocab_len());
        self.write_block(&mut s.block.step, pending, pos, rows, cache.len());
        let (shape, rope) = (self.shape(rows), rope(&self.hp));
        let key = (s.block.id, cache.buffers_id(), rows, "draft");
        run_recorded(be, rows, key, &mut || {
            be.embed(&self.embed, &s.block.step, rows, &mut s.block.x);
            for (i, layer) in self.layers.iter().enumerate() {
                let (kc, vc) = (&mut cache.k[i], &mut cache.v[i]);
                layer.run(
                    be,
                    &self.hp,
                    rope,
                    &mut s.block,
                    [kc, vc, &mut cache.attn_work],
                    shape,
                    None,
                );
            }
            be.rms_norm(&s.block.x, &self.norm, rows, h, eps, &mut s.block.xn);
            // Row 0 holds the pending token: the drafts are the mask rows'.
            be.copy(&s.block.xn, h, &mut s.block.tmp, 0, k * h);
            be.matmul(&self.lm_head, &s.block.tmp, k, &mut s.block.logits);
        });
        let logits = be.download(&s.block.logits, k * vocab);
        self.scratch = Some(s);
        Ok(logits)
    }
}

fn rope(hp: &HParams) -> Rope {
    Rope {
        theta: hp.rope_theta,
        style: RopeStyle::HalfSplit,
        scaling: hp.rope_scaling,
        dims: hp.block.rotary_dims,
        mrope: None,
    }
}
