//! Several sequences in one forward: what continuous batching runs.
//!
//! Every projection and mixture runs once over the rows of all the sequences, so each weight is read once for
//! the batch; each sequence's RoPE, cache write and attention run over its own cache with its own positions and
//! mask (the decoding sequences' in launches they share where the device has them: [`Backend::attention_seqs`]). The projections are row-exact (a row's result does not depend on which rows share the launch) and
//! the attention of a sequence sees only its own rows, so every sequence gets bitwise the logits and cache it
//! would get from [`Model::forward`] alone — the promise a batching server makes to each request.
//!
//! Models with Gated DeltaNet layers, and batches holding an image, run their sequences one after another (a
//! recurrence runs per sequence on the host either way; an image's features are uploaded for its own forward).

use super::decoder::{layer_rope, layer_shape, Layer, Scratch, MAX_STATE_LAYERS};
use super::{Batch, ForwardOutput, LogitRows, Model, TargetFeatures};
use crate::backend::{
    AttnMask, AttnShape, Backend, HeadNorms, Rope, RowDraw, SeqAttention, StepInputs,
    SHARED_ATTENTION_ROWS,
};
use crate::bundle::hparams::HParams;
use crate::cache::KvCache;
use crate::error::Result;

/// One sequence's rows in a batched layer ([`Layer::run_batched`]).
pub(super) struct SeqRows<'a, B: Backend> {
    pub(super) rows: usize,
    pub(super) cache: &'a mut KvCache<B>,
    /// Its own buffers: its step (positions, cache base, mask) and its attention's inputs and output.
    pub(super) own: &'a mut Scratch<B>,
}

impl<B: Backend> Layer<B> {
    /// The block over the rows of several sequences held together in `s` (`total` rows, sequence after
    /// sequence): the projections and the MLP once over all rows (each weight read once for the batch), each
    /// sequence's RoPE, cache write (its cache layer `cache_layer`) and attention (of `shape(rows)`) in its own
    /// buffers over its own cache. Row-exact projections make every row bitwise what its sequence's own
    /// [`Layer::run`] gives.
    #[allow(clippy::too_many_arguments)] // `run`'s inputs, per sequence
    pub(super) fn run_batched(
        &self,
        be: &B,
        hp: &HParams,
        rope: Rope,
        cache_layer: usize,
        shape: impl Fn(usize) -> AttnShape,
        s: &mut Scratch<B>,
        total: usize,
        seqs: &mut [SeqRows<B>],
        next: Option<&B::Buffer>,
    ) {
        let (qd, kvd) = (hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim);
        self.qkv_projections(be, hp, s, total);
        let norms = self.head_norms(hp);
        let shared = shared_attention(be, s, rope, cache_layer, &shape, seqs, norms);
        let mut at = 0;
        for (q, done) in seqs.iter_mut().zip(shared) {
            let (rows, o) = (q.rows, &mut *q.own);
            if done {
                at += rows;
                continue;
            }
            be.copy(&s.q, at * qd, &mut o.q, 0, rows * qd);
            be.copy(&s.k, at * kvd, &mut o.k, 0, rows * kvd);
            be.copy(&s.v, at * kvd, &mut o.v, 0, rows * kvd);
            let shape = shape(rows);
            let cache = &mut *q.cache;
            let (kc, vc) = (&mut cache.k[cache_layer], &mut cache.v[cache_layer]);
            be.rope_and_cache(
                &mut o.q, &mut o.k, &o.v, kc, vc, shape, rope, norms, &o.step,
            );
            be.attention(
                &o.q,
                kc,
                vc,
                &mut cache.attn_work,
                shape,
                &o.step,
                &mut o.attn,
            );
            be.copy(&o.attn, 0, &mut s.attn, at * qd, rows * qd);
            at += rows;
        }
        self.finish(be, hp, s, total, next);
    }

    /// [`Layer::context_kv`] over the rows of several sequences held together in `x` (`total` rows, sequence
    /// after sequence): the projections once over all rows, each sequence's RoPE and cache write (its cache
    /// layer `cache_layer`, `shape(rows)`) in its own buffers. Bitwise each sequence's own `context_kv`.
    #[allow(clippy::too_many_arguments)] // `context_kv`'s inputs, per sequence
    pub(super) fn context_kv_batched(
        &self,
        be: &B,
        hp: &HParams,
        x: &B::Buffer,
        rope: Rope,
        cache_layer: usize,
        shape: impl Fn(usize) -> AttnShape,
        s: &mut Scratch<B>,
        total: usize,
        seqs: &mut [SeqRows<B>],
    ) {
        let kvd = hp.n_kv_heads * hp.head_dim;
        self.context_kv_projections(be, hp, x, s, total);
        let norms = self.head_norms(hp);
        let mut at = 0;
        for q in seqs.iter_mut() {
            let (rows, o) = (q.rows, &mut *q.own);
            be.copy(&s.k, at * kvd, &mut o.k, 0, rows * kvd);
            be.copy(&s.v, at * kvd, &mut o.v, 0, rows * kvd);
            let cache = &mut *q.cache;
            let (kc, vc) = (&mut cache.k[cache_layer], &mut cache.v[cache_layer]);
            be.rope_and_cache(
                &mut o.q,
                &mut o.k,
                &o.v,
                kc,
                vc,
                shape(rows),
                rope,
                norms,
                &o.step,
            );
            at += rows;
        }
    }
}

/// The RoPE, cache writes and attention of the sequences of at most [`SHARED_ATTENTION_ROWS`] rows, in launches
/// they share where the backend has them ([`Backend::attention_seqs`], reading and writing the batch's rows in
/// place); which sequences that did (the others run alone).
fn shared_attention<B: Backend>(
    be: &B,
    s: &mut Scratch<B>,
    rope: Rope,
    cache_layer: usize,
    shape: &impl Fn(usize) -> AttnShape,
    seqs: &mut [SeqRows<B>],
    norms: Option<HeadNorms<'_, B::Buffer>>,
) -> Vec<bool> {
    let small: Vec<bool> = seqs
        .iter()
        .map(|q| q.rows <= SHARED_ATTENTION_ROWS)
        .collect();
    if small.iter().filter(|&&b| b).count() < 2 {
        return vec![false; seqs.len()];
    }
    let mut group = Vec::new();
    let mut at = 0;
    for (q, &small) in seqs.iter_mut().zip(&small) {
        if small {
            let cache = &mut *q.cache;
            group.push(SeqAttention {
                first_row: at,
                shape: shape(q.rows),
                k_cache: &mut cache.k[cache_layer],
                v_cache: &mut cache.v[cache_layer],
                work: &mut cache.attn_work,
                step: &q.own.step,
            });
        }
        at += q.rows;
    }
    if be.attention_seqs(
        &mut s.q,
        &mut s.k,
        &s.v,
        &mut s.attn,
        rope,
        norms,
        &mut group,
    ) {
        small
    } else {
        vec![false; seqs.len()]
    }
}

/// Size `own` (each sequence's buffers in a batched forward: its step, its attention's inputs and output, kept
/// between forwards) for sequences of `rows` rows each, in order, growing the buffers that are too small.
pub(super) fn fit_own<B: Backend>(
    be: &B,
    hp: &HParams,
    own: &mut Vec<Scratch<B>>,
    rows: impl ExactSizeIterator<Item = usize>,
) {
    own.resize_with(own.len().max(rows.len()), || Scratch::new(be, hp, 1, 1));
    for (o, r) in own.iter_mut().zip(rows) {
        if o.rows < r {
            *o = Scratch::new(be, hp, r, 1);
        }
    }
}

/// The batch's step: every sequence's tokens (at their positions), which the embedding reads; each sequence's
/// attention reads its own step.
pub(super) fn write_batch_step<B: Backend>(
    be: &B,
    step: &mut B::Step,
    tokens: &[u32],
    positions: &[usize],
) {
    be.set_step(
        step,
        StepInputs {
            tokens,
            positions,
            spatial: &[],
            base: 0,
            mask: &AttnMask::Causal,
        },
    );
}

/// One sequence's part of a batched forward.
pub struct SeqForward<'a, B: Backend> {
    pub cache: &'a mut KvCache<B>,
    pub batch: &'a Batch,
    pub logits: LogitRows,
    /// The target states its proposer conditions on, returned in [`ForwardOutput::features`] as
    /// [`Model::forward_features`] returns them.
    pub features: TargetFeatures,
}

impl<B: Backend> Model<B> {
    /// Run each sequence's rows as [`Model::forward_features`] would, in one forward: each output, and each
    /// cache afterwards, is bitwise what that sequence's own forward gives.
    pub fn forward_batched(&mut self, seqs: &mut [SeqForward<B>]) -> Result<Vec<ForwardOutput>> {
        // The states any sequence asks for are kept for every row (each takes its own out of them).
        let union = seqs
            .iter()
            .fold(TargetFeatures::none(), |all, q| all.union(&q.features));
        if seqs.len() == 1
            || self.layers.iter().any(|l| l.is_linear())
            || seqs.iter().any(|q| !q.batch.media.is_empty())
            || union.layers.len() > MAX_STATE_LAYERS
        {
            return seqs
                .iter_mut()
                .map(|q| self.forward_features(q.cache, q.batch, q.logits, &q.features))
                .collect();
        }
        for q in seqs.iter_mut() {
            self.check_batch(q.batch, &q.features.layers)?;
            q.cache.reserve(self.backend.as_ref(), q.batch.rows())?;
        }
        let be = self.backend.clone();
        let be = be.as_ref();
        let total: usize = seqs.iter().map(|q| q.batch.rows()).sum();
        let mut s = self.scratch(total);
        let tokens: Vec<u32> = seqs
            .iter()
            .flat_map(|q| q.batch.tokens.iter().copied())
            .collect();
        let positions: Vec<usize> = seqs
            .iter()
            .flat_map(|q| q.batch.positions.iter().copied())
            .collect();
        write_batch_step(be, &mut s.step, &tokens, &positions);
        let mut own = std::mem::take(&mut self.seq_scratch);
        fit_own(be, &self.hp, &mut own, seqs.iter().map(|q| q.batch.rows()));
        for (q, o) in seqs.iter_mut().zip(own.iter_mut()) {
            let rows = q.batch.rows();
            q.cache.begin_forward(rows, q.logits.every_row());
            be.set_step(
                &mut o.step,
                StepInputs {
                    tokens: &q.batch.tokens,
                    positions: &q.batch.positions,
                    spatial: &q.batch.spatial,
                    base: q.cache.len(),
                    mask: &q.batch.mask,
                },
            );
        }
        self.encode_batched(seqs, &mut own, &mut s, total, &union);
        let mut out = self.logits_batched(seqs, &mut s);
        if !union.is_none() {
            self.features_batched(seqs, &s, total, &union, &mut out);
        }
        self.scratch = Some(s);
        self.seq_scratch = own;
        for q in seqs.iter_mut() {
            q.cache.advance(q.batch.rows());
        }
        // A device fault fails every sequence of the forward (each rolled back).
        if let Some(fault) = self.backend.take_fault() {
            for q in seqs.iter_mut() {
                let len = q.cache.len() - q.batch.rows();
                q.cache.truncate(len);
            }
            return Err(crate::error::Error::Device(fault));
        }
        Ok(out)
    }

    /// The layers over all `total` rows of `s`: projections and MLPs once, each sequence's attention in its own
    /// buffers `own[i]` over its own cache; the residual streams after `states`' layers copied to `s.states` (in
    /// that order) and, where it asks for the final state, every row's output norm into `s.xn`.
    fn encode_batched(
        &self,
        seqs: &mut [SeqForward<B>],
        own: &mut [Scratch<B>],
        s: &mut Scratch<B>,
        total: usize,
        states: &TargetFeatures,
    ) {
        let be = self.backend.as_ref();
        let hp = &self.hp;
        let h = hp.hidden;
        be.embed(&self.embed, &s.step, total, &mut s.x);
        if let Some(scale) = hp.block.embedding_scale {
            be.scale(&mut s.x, total * h, scale);
        }
        let mut parts: Vec<SeqRows<B>> = seqs
            .iter_mut()
            .zip(own.iter_mut())
            .map(|(q, own)| SeqRows {
                rows: q.batch.rows(),
                cache: &mut *q.cache,
                own,
            })
            .collect();
        for (l, layer) in self.layers.iter().enumerate() {
            let shape = |rows| layer_shape(hp, l, rows);
            let next = self.next_norm(l, false);
            layer.run_batched(
                be,
                hp,
                layer_rope(hp, l),
                l,
                shape,
                s,
                total,
                &mut parts,
                next,
            );
            if let Some(j) = states.layers.iter().position(|&m| m == l) {
                be.copy(&s.x, 0, &mut s.states, j * total * h, total * h);
            }
        }
        if states.final_state {
            be.rms_norm(&s.x, &self.output_norm, total, h, hp.rms_eps, &mut s.xn);
        }
    }

    /// Each sequence's [`ForwardOutput::features`], row by row as [`Model::forward_features`] lays them out, from
    /// the states of `union` that [`Model::encode_batched`] kept for all `total` rows.
    fn features_batched(
        &self,
        seqs: &[SeqForward<B>],
        s: &Scratch<B>,
        total: usize,
        union: &TargetFeatures,
        out: &mut [ForwardOutput],
    ) {
        let be = self.backend.as_ref();
        let h = self.hp.hidden;
        let layers = be.download(&s.states, union.layers.len() * total * h);
        let last = if union.final_state {
            be.download(&s.xn, total * h)
        } else {
            Vec::new()
        };
        let mut at = 0;
        for (q, o) in seqs.iter().zip(out.iter_mut()) {
            let rows = q.batch.rows();
            if !q.features.is_none() {
                // Each of its layers' plane among the union's.
                let planes: Vec<&[f32]> = q
                    .features
                    .layers
                    .iter()
                    .map(|l| {
                        let j = union
                            .layers
                            .iter()
                            .position(|m| m == l)
                            .expect("in the union");
                        &layers[j * total * h..(j + 1) * total * h]
                    })
                    .collect();
                let mut v = Vec::with_capacity(rows * q.features.width(h));
                for r in at..at + rows {
                    for plane in &planes {
                        v.extend_from_slice(&plane[r * h..(r + 1) * h]);
                    }
                    if q.features.final_state {
                        v.extend_from_slice(&last[r * h..(r + 1) * h]);
                    }
                }
                o.features = v;
            }
            at += rows;
        }
    }

    /// Each sequence's logits as its own forward returns them: the rows asked for, gathered, through one output
    /// projection (the output norm fused, as a single forward runs it).
    fn logits_batched(&self, seqs: &[SeqForward<B>], s: &mut Scratch<B>) -> Vec<ForwardOutput> {
        let be = self.backend.as_ref();
        let (h, vocab) = (self.hp.hidden, self.hp.vocab);
        // The rows of `s.x` each sequence wants, in order, as runs of consecutive rows.
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut at = 0;
        for q in seqs {
            // A sequence's wanted rows end with its last row.
            let (rows, count) = (q.batch.rows(), wanted_rows(q));
            let first = at + rows - count;
            if count > 0 {
                match runs.last_mut() {
                    Some((start, len)) if *start + *len == first => *len += count,
                    _ => runs.push((first, count)),
                }
            }
            at += rows;
        }
        let n: usize = runs.iter().map(|r| r.1).sum();
        if n > 0 {
            let mut to = 0;
            for &(first, count) in &runs {
                be.copy(&s.x, first * h, &mut s.tmp, to * h, count * h);
                to += count;
            }
            let output = self.output.as_ref().unwrap_or(self.embed.as_ref());
            let norm = Some((&self.output_norm, self.hp.rms_eps));
            be.matmuls(&s.tmp, norm, n, &mut [(output, &mut s.logits)]);
        }
        let greedy = seqs.iter().any(|q| q.logits == LogitRows::Greedy);
        if greedy {
            be.argmax(&s.logits, n, vocab, &mut s.greedy);
        }
        // Logits come to the host only where a sequence wants them.
        let wants_logits = seqs
            .iter()
            .any(|q| matches!(q.logits, LogitRows::All | LogitRows::Last));
        let logits = if wants_logits {
            be.download(&s.logits, n * vocab)
        } else {
            Vec::new()
        };
        let argmax = if greedy {
            be.download(&s.greedy, n)
        } else {
            Vec::new()
        };
        // The drawn rows' races, each at its row's next position.
        let mut draws = Vec::new();
        let mut row = 0;
        for q in seqs {
            if let LogitRows::Drawn(race) = q.logits {
                draws.extend(q.batch.positions.iter().enumerate().map(|(i, &p)| RowDraw {
                    row: row + i,
                    race,
                    position: p + 1,
                }));
            }
            row += wanted_rows(q);
        }
        let drawn = if draws.is_empty() {
            Vec::new()
        } else {
            be.draw(&s.logits, vocab, &draws)
        };
        let mut out = Vec::with_capacity(seqs.len());
        let (mut row, mut next_draw) = (0, 0);
        for q in seqs {
            let mine = wanted_rows(q);
            let mut o = ForwardOutput::default();
            match q.logits {
                LogitRows::Greedy => {
                    o.greedy = argmax[row..row + mine].iter().map(|&t| t as u32).collect()
                }
                LogitRows::Drawn(_) => {
                    o.greedy = drawn[next_draw..next_draw + mine].to_vec();
                    next_draw += mine;
                }
                LogitRows::All | LogitRows::Last => {
                    o.logits = logits[row * vocab..(row + mine) * vocab].to_vec()
                }
                LogitRows::None => {}
            }
            out.push(o);
            row += mine;
        }
        out
    }
}

/// The rows of a sequence's logits a batched forward computes: all, the last, or none.
fn wanted_rows<B: Backend>(q: &SeqForward<B>) -> usize {
    match q.logits {
        LogitRows::Last => 1,
        LogitRows::None => 0,
        _ => q.batch.rows(),
    }
}
