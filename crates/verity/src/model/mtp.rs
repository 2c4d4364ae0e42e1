//! A native multi-token-prediction head, run on the target's backend beside the target.
//!
//! One head step at position `p` takes the previous hidden state `h` and the token `t_p`:
//! `x = fc([norm_e(E[t_p]); norm_h(h)])` (or `fc_e(·) + fc_h(·)` for a split fusion), then the head's compute
//! block(s) at position `p` with the head's own KV cache, then `out = norm_f(x)` and `logits = lm_head(out)`,
//! its guess for `t_{p+1}`. `E` and `lm_head` are the target's (tied) matrices; `lm_head` is restricted to the
//! head's draft vocabulary when the head ships one (the verifier still judges every draft against the full
//! target distribution, so a smaller drafting vocabulary costs acceptance, never correctness).
//!
//! Float head weights are re-encoded as Q8_0 at load: a draft step reads every head weight, and the drafter's
//! numerics never reach the output.
//!
//! `h` is the target's final hidden state (after its output norm) at `p - 1` for committed positions, and the
//! head's own `out` of the previous step when drafting recursively — which stays on the backend between draft
//! steps ([`HeadInput::Last`]). A greedy draft goes further ([`MtpHead::draft_greedy`]): each step's token is
//! picked on the backend from the step before's argmax, so a whole draft costs the host one wait.

use std::borrow::Cow;
use std::sync::Arc;

use super::batched::{fit_own, write_batch_step, SeqRows};
use super::decoder::{Layer, Scratch};
use super::{drafting_cache, drafting_matrix, drafting_qmatrix, run_recorded, DraftVocab, Model};
use crate::backend::RopeStyle;
use crate::backend::{AttnMask, AttnShape, Backend, Rope, StepInputs};
use crate::bundle::hparams::HParams;
use crate::bundle::mtp::Fusion;
use crate::bundle::{st_vector, Bundle, MtpStatus, TensorKey};
use crate::cache::KvCache;
use crate::error::{Error, Result};

/// The deepest chained greedy draft ([`MtpHead::draft_greedy`]).
pub const MAX_CHAIN: usize = 16;

enum HeadFusion<B: Backend> {
    Joint(B::Matrix),
    Split {
        embedding: B::Matrix,
        hidden: B::Matrix,
    },
}

/// Write one forward's causal inputs into `step`: `tokens` at positions `start..`, after `base` cached slots.
fn write_step<B: Backend>(be: &B, step: &mut B::Step, tokens: &[u32], start: usize, base: usize) {
    let positions: Vec<usize> = (start..start + tokens.len()).collect();
    be.set_step(
        step,
        StepInputs {
            tokens,
            positions: &positions,
            spatial: &[],
            base,
            mask: &AttnMask::Causal,
        },
    );
}

/// Work buffers of the head beyond a block's scratch.
struct HeadScratch<B: Backend> {
    block: Scratch<B>,
    /// `rows × hidden` normed embeddings, then (split fusion) the embedding half's projection.
    e: B::Buffer,
    /// `rows × hidden` incoming hidden states, normed in place into `hn`.
    h: B::Buffer,
    hn: B::Buffer,
    /// `rows × 2·hidden`: `[e; hn]` for a joint fusion.
    fused: B::Buffer,
    /// One-row steps of a chained greedy draft, one per recursive step ([`MtpHead::draft_greedy`]).
    chain: Vec<B::Step>,
    /// The tokens of a chained greedy draft, as f32s.
    log: B::Buffer,
}

/// Where a head forward's incoming hidden states come from.
#[derive(Debug, Clone, Copy)]
pub enum HeadInput<'a> {
    /// `rows × hidden` values from the host: the target's states, for committed positions.
    Host(&'a [f32]),
    /// The last row of the previous forward's outputs, where that forward left it (one row: a recursive draft
    /// step). On a GPU the state never crosses to the host between draft steps — fewer transfers, though not a
    /// measurable speed-up: the head's own forwards are the cost of drafting, not the transfers.
    Last,
}

/// What one head forward returns.
#[derive(Debug, Clone, Default)]
pub struct HeadOutput {
    /// `rows × hidden`: each row's `out` (the next recursive step's `h`); empty from [`MtpHead::draft`].
    pub hidden: Vec<f32>,
    /// The last row's logits over the draft vocabulary (see [`MtpHead::token`]); empty when the forward was
    /// asked for the argmax alone.
    pub logits: Vec<f32>,
    /// The last row's argmax over the draft vocabulary, when asked for instead of the logits (a greedy draft:
    /// one value from the device, not a vocabulary).
    pub greedy: Option<u32>,
}

pub struct MtpHead<B: Backend> {
    hp: HParams,
    backend: Arc<B>,
    rope: RopeStyle,
    embed: Arc<B::Matrix>,
    /// The token an image row stands for ([`Bundle::image_token`]).
    image_token: Option<u32>,
    embedding_norm: B::Buffer,
    hidden_norm: B::Buffer,
    fusion: HeadFusion<B>,
    blocks: Vec<Layer<B>>,
    final_norm: B::Buffer,
    lm_head: B::Matrix,
    /// Row `i` of `lm_head` is token `draft_vocab.token(i)`.
    draft_vocab: DraftVocab,
    /// `draft_vocab` on the backend, as f32s ([`Backend::draft_token`]).
    token_table: Option<B::Buffer>,
    scratch: Option<HeadScratch<B>>,
    /// Each request's attention buffers in a batched draft ([`MtpHead::draft_greedy_batched`]).
    seq_scratch: Vec<Scratch<B>>,
    /// Rows of the last forward, whose outputs the scratch holds (0: none yet).
    last_rows: usize,
    /// Whether a forward does host work mid-way (an attention gate, a mixture's routing), which a recording
    /// cannot hold.
    host_work: bool,
}

/// The head's rotation: the target's, in the head's own pair layout.
fn rotation(hp: &HParams, style: RopeStyle) -> Rope {
    Rope {
        theta: hp.rope_theta,
        style,
        scaling: hp.rope_scaling,
        dims: hp.block.rotary_dims,
        mrope: None,
    }
}

impl<B: Backend> MtpHead<B> {
    /// Load the bundle's complete head for `target`. Fails (and the planner takes the next route) when the
    /// bundle's head is not complete or its tensors do not fit the target.
    pub fn load(bundle: &Bundle, target: &Model<B>) -> Result<Self> {
        let MtpStatus::Complete(spec) = &bundle.mtp else {
            return Err(Error::Invalid(format!(
                "no usable MTP head: {}",
                bundle.mtp.describe()
            )));
        };
        let tensors = bundle
            .mtp_tensors()
            .expect("a complete head has its tensors");
        let hp = target.hp.clone();
        let backend = target.backend().clone();
        let be = backend.as_ref();
        let h = hp.hidden;
        let load =
            |name: &str, rows: usize, cols: usize| drafting_matrix(be, tensors, name, rows, cols);
        let fusion = match &spec.fusion {
            Fusion::Joint(n) => HeadFusion::Joint(load(n, h, 2 * h)?),
            Fusion::Split { embedding, hidden } => HeadFusion::Split {
                embedding: load(embedding, h, h)?,
                hidden: load(hidden, h, h)?,
            },
        };
        // The head's blocks are built as the target's attention layers are (a Qwen3-Next head's: gated
        // attention with partial RoPE, a mixture where the block has a router), and its norms stored as the
        // target's are.
        let norm_offset = |mut v: Vec<f32>| {
            if TensorKey::OutputNorm.stored_minus_one(hp.arch) {
                v.iter_mut().for_each(|x| *x += 1.0);
            }
            v
        };
        let mut blocks = Vec::with_capacity(spec.blocks.len());
        let mut host_work = hp.block.attention_gate;
        for prefix in &spec.blocks {
            let name = |key: TensorKey| {
                format!("{prefix}{}", key.hf_layer_name().expect("a layer tensor"))
            };
            let mut mat = |key: TensorKey, rows: usize, cols: usize| match key {
                TensorKey::Q(_) | TensorKey::QGate(_) if hp.block.attention_gate => {
                    let both = drafting_qmatrix(tensors, &name(key), 2 * rows, cols)?;
                    be.load_matrix(both.select_rows(&key.gated_q_rows(hp.head_dim, rows))?)
                }
                _ => load(&name(key), rows, cols),
            };
            let mut vec = |key: TensorKey, len: usize| {
                let v = st_vector(tensors, &name(key), len)?;
                Ok(be.upload(&if key.is_norm() { norm_offset(v) } else { v }))
            };
            let sparse =
                hp.block.moe.is_some() && tensors.get(&name(TensorKey::Router(0))).is_some();
            host_work |= sparse;
            blocks.push(Layer::load(&hp, 0, sparse, None, &mut mat, &mut vec)?);
        }
        let vector = |name: &str| -> Result<B::Buffer> {
            Ok(be.upload(&norm_offset(st_vector(tensors, name, h)?)))
        };
        let draft_vocab = DraftVocab::load(tensors, spec.draft_vocab.as_deref(), hp.vocab)?;
        let lm_head = draft_vocab.output_head(be, bundle)?;
        // Token ids are below 2^24, so exact as f32s.
        let token_table = draft_vocab
            .ids()
            .map(|ids| be.upload(&ids.iter().map(|&t| t as f32).collect::<Vec<_>>()));
        let rope = match tensors.metadata.get("rope_style").map(String::as_str) {
            Some("interleaved") => RopeStyle::Interleaved,
            Some("half_split") | None => RopeStyle::HalfSplit,
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "MTP head rope_style {other:?} (expected half_split or interleaved)"
                )))
            }
        };
        // The head's rotation may differ from the target's (a head trained in Hugging Face's layout rotates
        // half-split pairs of a GGUF target's interleaved ones): the backend prepares it as the target's.
        be.prepare_attention(hp.head_dim, rotation(&hp, rope))?;
        Ok(MtpHead {
            embedding_norm: vector(&spec.embedding_norm)?,
            hidden_norm: vector(&spec.hidden_norm)?,
            final_norm: vector(&spec.final_norm)?,
            hp,
            rope,
            embed: target.embedding(),
            image_token: bundle.image_token,
            fusion,
            blocks,
            lm_head,
            draft_vocab,
            token_table,
            scratch: None,
            seq_scratch: Vec::new(),
            last_rows: 0,
            host_work,
            backend,
        })
    }

    pub fn hidden_size(&self) -> usize {
        self.hp.hidden
    }

    /// Size of the vocabulary the head drafts from.
    pub fn draft_vocab_len(&self) -> usize {
        self.draft_vocab.len()
    }

    /// The token id of logit `i`.
    pub fn token(&self, i: usize) -> u32 {
        self.draft_vocab.token(i)
    }

    /// A fresh KV cache for the head (one layer per block).
    pub fn new_cache(&self, max_tokens: usize) -> KvCache<B> {
        drafting_cache(
            self.backend.as_ref(),
            &self.hp,
            self.blocks.len(),
            max_tokens,
        )
    }

    fn scratch(&mut self, rows: usize) -> HeadScratch<B> {
        match self.scratch.take() {
            Some(s) if s.block.rows >= rows => s,
            _ => {
                let be = self.backend.as_ref();
                let block = Scratch::new(be, &self.hp, rows, self.draft_vocab_len());
                let n = block.rows * self.hp.hidden;
                HeadScratch {
                    block,
                    e: be.buffer(n),
                    h: be.buffer(n),
                    hn: be.buffer(n),
                    fused: be.buffer(2 * n),
                    chain: Vec::new(),
                    log: be.buffer(MAX_CHAIN),
                }
            }
        }
    }

    /// Run head steps for `tokens` at positions `start..`, row `i` conditioned on `hidden` row `i` (`rows ×
    /// hidden`); their K/V are appended to `cache`. Returns every row's `out` and the last row's logits, or with
    /// `greedy` their argmax alone.
    pub fn forward(
        &mut self,
        cache: &mut KvCache<B>,
        tokens: &[u32],
        start: usize,
        hidden: &[f32],
        greedy: bool,
    ) -> Result<HeadOutput> {
        self.step(cache, tokens, start, HeadInput::Host(hidden), greedy, true)
    }

    /// [`MtpHead::forward`] for drafting: the rows' `out` stay where the forward left them (the next draft step
    /// reads the last one through [`HeadInput::Last`]) and only the last row's logits or argmax are returned.
    pub fn draft(
        &mut self,
        cache: &mut KvCache<B>,
        tokens: &[u32],
        start: usize,
        input: HeadInput,
        greedy: bool,
    ) -> Result<HeadOutput> {
        self.step(cache, tokens, start, input, greedy, false)
    }

    /// Greedy drafting of `depth` tokens with one download: a catch-up forward over `tokens` (positions
    /// `start..`, row `i` conditioned on `hidden` row `i`), then `depth - 1` recursive steps, each from the
    /// state and the argmax the step before left on the backend ([`Backend::draft_token`] picks its input
    /// token there). Every step's other inputs (position, cache fill) are known ahead, so each is written into a
    /// step of its own before any runs, and the host waits once, for the tokens. The same tokens, bitwise, as
    /// [`MtpHead::draft`] step by step; the cache ends `tokens.len() + depth - 1` slots further.
    pub fn draft_greedy(
        &mut self,
        cache: &mut KvCache<B>,
        tokens: &[u32],
        start: usize,
        hidden: &[f32],
        depth: usize,
    ) -> Result<Vec<u32>> {
        let (rows, hd) = (tokens.len(), self.hp.hidden);
        if rows == 0 || hidden.len() != rows * hd || !(1..=MAX_CHAIN).contains(&depth) {
            return Err(Error::Invalid(format!(
                "MTP head: a chained draft of depth {depth} (at most {MAX_CHAIN}) after {rows} tokens with {} \
                 hidden values",
                hidden.len()
            )));
        }
        let tokens = &*self.embedded_ids(tokens)?;
        cache.reserve(self.backend.as_ref(), rows + depth - 1)?;
        let mut s = self.scratch(rows);
        let be = self.backend.as_ref();
        while s.chain.len() < depth - 1 {
            s.chain.push(be.step(1));
        }
        let base = cache.len();
        write_step(be, &mut s.block.step, tokens, start, base);
        for (i, step) in s.chain[..depth - 1].iter_mut().enumerate() {
            // Step i + 1's token is written by the step before it (0 until then).
            write_step(be, step, &[0], start + rows + i, base + rows + i);
        }
        self.enqueue(cache, rows, HeadInput::Host(hidden), 0, true, 0, &mut s);
        let mut prev = rows;
        for i in 0..depth {
            // Draft i goes to the log and, but for the last, into the next step's token slot.
            let next = s.chain[..depth - 1].get_mut(i);
            be.draft_token(
                &s.block.greedy,
                self.token_table.as_ref(),
                &mut s.log,
                i,
                next,
            );
            if i + 1 == depth {
                break;
            }
            // The recorded forward reads the scratch's step: chain step i takes its place.
            std::mem::swap(&mut s.block.step, &mut s.chain[i]);
            self.enqueue(cache, 1, HeadInput::Last, prev, true, i + 1, &mut s);
            std::mem::swap(&mut s.block.step, &mut s.chain[i]);
            prev = 1;
        }
        let drafted = be.download(&s.log, depth);
        self.scratch = Some(s);
        self.last_rows = prev;
        Ok(drafted.iter().map(|&t| t as u32).collect())
    }

    /// The ids the head embeds for `tokens`: an image's rows ([`crate::engine::is_media`]) as the model's image
    /// token (the head reads the image through the target's states over its rows, as it reads text through
    /// them), every other id as it is; ids the embedding does not hold are refused.
    fn embedded_ids<'a>(&self, tokens: &'a [u32]) -> Result<Cow<'a, [u32]>> {
        let mut ids = Cow::Borrowed(tokens);
        if tokens.iter().any(|&t| crate::engine::is_media(t)) {
            let image = self.image_token.ok_or_else(|| {
                Error::Invalid("an image row, and the model names no image token".into())
            })?;
            ids = Cow::Owned(
                tokens
                    .iter()
                    .map(|&t| if crate::engine::is_media(t) { image } else { t })
                    .collect(),
            );
        }
        match ids.iter().find(|&&t| t as usize >= self.hp.vocab) {
            Some(t) => Err(Error::Invalid(format!(
                "token id {t} outside the vocabulary"
            ))),
            None => Ok(ids),
        }
    }

    /// Whether the head drafts on requests with images (the model names the token their rows stand for).
    pub fn reads_images(&self) -> bool {
        self.image_token.is_some()
    }

    fn step(
        &mut self,
        cache: &mut KvCache<B>,
        tokens: &[u32],
        start: usize,
        input: HeadInput,
        greedy: bool,
        hidden_out: bool,
    ) -> Result<HeadOutput> {
        let rows = tokens.len();
        let hd = self.hp.hidden;
        match input {
            HeadInput::Host(hidden) if rows == 0 || hidden.len() != rows * hd => {
                return Err(Error::Invalid(format!(
                    "MTP head: {rows} tokens with {} hidden values",
                    hidden.len()
                )))
            }
            HeadInput::Last if rows != 1 || self.last_rows == 0 => {
                return Err(Error::Invalid(format!(
                    "MTP head: a step from the last output takes one token after a forward ({rows} tokens, {} \
                     rows before)",
                    self.last_rows
                )))
            }
            _ => {}
        }
        let tokens = &*self.embedded_ids(tokens)?;
        cache.reserve(self.backend.as_ref(), rows)?;
        let mut s = self.scratch(rows);
        let out = self.run(cache, tokens, start, input, greedy, hidden_out, &mut s);
        self.scratch = Some(s);
        self.last_rows = rows;
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)] // one forward's inputs and what it returns
    fn run(
        &self,
        cache: &mut KvCache<B>,
        tokens: &[u32],
        start: usize,
        input: HeadInput,
        greedy: bool,
        hidden_out: bool,
        s: &mut HeadScratch<B>,
    ) -> HeadOutput {
        let be = self.backend.as_ref();
        let (rows, h) = (tokens.len(), self.hp.hidden);
        write_step(be, &mut s.block.step, tokens, start, cache.len());
        self.enqueue(cache, rows, input, self.last_rows, greedy, 0, s);
        let (logits, greedy) = if greedy {
            (Vec::new(), Some(be.download(&s.block.greedy, 1)[0] as u32))
        } else {
            (be.download(&s.block.logits, self.draft_vocab_len()), None)
        };
        HeadOutput {
            hidden: if hidden_out {
                be.download(&s.block.xn, rows * h)
            } else {
                Vec::new()
            },
            logits,
            greedy,
        }
    }

    /// Queue one head forward of `rows` rows whose step `s.block.step` holds: its incoming hidden states (from
    /// the host, or the last of the `prev_rows` outputs the forward before left), then the forward, recorded per
    /// width, buffers and `slot` (which step the scratch holds: 0 its own, `i` a chained draft's step `i`);
    /// the cache advances by `rows`.
    #[allow(clippy::too_many_arguments)] // one queued forward's inputs
    fn enqueue(
        &self,
        cache: &mut KvCache<B>,
        rows: usize,
        input: HeadInput,
        prev_rows: usize,
        greedy: bool,
        slot: usize,
        s: &mut HeadScratch<B>,
    ) {
        let (be, h) = (self.backend.as_ref(), self.hp.hidden);
        match input {
            HeadInput::Host(hidden) => be.write(&mut s.h, hidden),
            // Ordered before the forward that overwrites the outputs (one stream).
            HeadInput::Last => be.copy(&s.block.xn, (prev_rows - 1) * h, &mut s.h, 0, h),
        }
        // A draft step is a few dozen small launches: recorded once per width and buffers, like the target's.
        let key = (s.block.id, cache.buffers_id(), rows, greedy, slot);
        let mut work = || self.encode(cache, rows, greedy, s);
        if self.host_work {
            work();
        } else {
            run_recorded(be, rows, key, &mut work);
        }
        cache.advance(rows);
    }

    /// The device work of one head forward whose inputs are in the step and `s.h`: every row's final hidden
    /// state into `s.block.xn`, the last row's draft logits into `s.block.logits` (and with `greedy` their argmax
    /// into `s.block.greedy`).
    fn encode(&self, cache: &mut KvCache<B>, rows: usize, greedy: bool, s: &mut HeadScratch<B>) {
        let be = self.backend.as_ref();
        let hp = &self.hp;
        self.fuse(rows, s);
        let rope = rotation(hp, self.rope);
        for (i, block) in self.blocks.iter().enumerate() {
            let (kc, vc) = (&mut cache.k[i], &mut cache.v[i]);
            block.run(
                be,
                hp,
                rope,
                &mut s.block,
                [kc, vc, &mut cache.attn_work],
                self.shape(rows),
                None,
            );
        }
        be.rms_norm(
            &s.block.x,
            &self.final_norm,
            rows,
            hp.hidden,
            hp.rms_eps,
            &mut s.block.xn,
        );
        be.copy(
            &s.block.xn,
            (rows - 1) * hp.hidden,
            &mut s.block.tmp,
            0,
            hp.hidden,
        );
        be.matmul(&self.lm_head, &s.block.tmp, 1, &mut s.block.logits);
        if greedy {
            be.argmax(
                &s.block.logits,
                1,
                self.draft_vocab_len(),
                &mut s.block.greedy,
            );
        }
    }

    /// The head's input for `rows` rows whose step and incoming states (`s.h`) are written: the fused embedding
    /// and hidden state, into `s.block.x`.
    fn fuse(&self, rows: usize, s: &mut HeadScratch<B>) {
        let be = self.backend.as_ref();
        let (h, eps) = (self.hp.hidden, self.hp.rms_eps);
        be.embed(&self.embed, &s.block.step, rows, &mut s.block.tmp);
        be.rms_norm(&s.block.tmp, &self.embedding_norm, rows, h, eps, &mut s.e);
        be.rms_norm(&s.h, &self.hidden_norm, rows, h, eps, &mut s.hn);
        match &self.fusion {
            HeadFusion::Joint(fc) => {
                for r in 0..rows {
                    be.copy(&s.e, r * h, &mut s.fused, 2 * r * h, h);
                    be.copy(&s.hn, r * h, &mut s.fused, (2 * r + 1) * h, h);
                }
                be.matmul(fc, &s.fused, rows, &mut s.block.x);
            }
            HeadFusion::Split { embedding, hidden } => {
                be.matmul(embedding, &s.e, rows, &mut s.block.x);
                be.matmul_add(hidden, &s.hn, rows, &mut s.block.x);
            }
        }
    }

    /// The shape of a head block's attention over `rows` rows (full attention: a head has no window).
    fn shape(&self, rows: usize) -> AttnShape {
        let hp = &self.hp;
        AttnShape {
            rows,
            n_heads: hp.n_heads,
            n_kv_heads: hp.n_kv_heads,
            head_dim: hp.head_dim,
            scale: 1.0 / (hp.head_dim as f32).sqrt(),
            window: None,
        }
    }

    /// Greedy drafts for several requests, each as [`MtpHead::draft_greedy`] gives it alone (bitwise the same
    /// tokens and cache): the catch-ups of all of them in one forward, then each recursive step of the requests
    /// still drafting in one forward. A forward runs the fusion, the blocks' projections and the output layer
    /// once over every request's rows (each weight read once for all of them, where per-request drafting reads
    /// them once per request and step), each request's attention over its own cache. The host picks each
    /// step's tokens (one wait per step, not per draft).
    pub fn draft_greedy_batched(&mut self, jobs: &mut [HeadDraft<B>]) -> Result<Vec<Vec<u32>>> {
        let hd = self.hp.hidden;
        // Each job's catch-up ids as the head embeds them.
        let mut catch_up = Vec::with_capacity(jobs.len());
        for j in jobs.iter() {
            let rows = j.tokens.len();
            if rows == 0 || j.hidden.len() != rows * hd || !(1..=MAX_CHAIN).contains(&j.depth) {
                return Err(Error::Invalid(format!(
                    "MTP head: a batched draft of depth {} (at most {MAX_CHAIN}) after {rows} tokens with {} \
                     hidden values",
                    j.depth,
                    j.hidden.len()
                )));
            }
            catch_up.push(self.embedded_ids(j.tokens)?.into_owned());
        }
        let be = self.backend.clone();
        let be = be.as_ref();
        for j in jobs.iter_mut() {
            j.cache.reserve(be, j.tokens.len() + j.depth - 1)?;
        }
        let n = jobs.len();
        let total: usize = jobs.iter().map(|j| j.tokens.len()).sum();
        let mut s = self.scratch(total.max(n));
        // Step 0's rows are each request's most.
        let mut own = std::mem::take(&mut self.seq_scratch);
        fit_own(be, &self.hp, &mut own, jobs.iter().map(|j| j.tokens.len()));
        let mut drafted: Vec<Vec<u32>> = vec![Vec::new(); n];
        let depth = jobs.iter().map(|j| j.depth).max().unwrap_or(0);
        for i in 0..depth {
            // Step 0: every catch-up, its rows' states from the host; step i: one row for each request still
            // drafting, its state the last output row its request had in the step before.
            let mut tokens = Vec::new();
            let mut positions = Vec::new();
            let mut states = Vec::new();
            let mut row = 0;
            for (j, (job, o)) in jobs.iter_mut().zip(own.iter_mut()).enumerate() {
                if job.depth <= i {
                    continue;
                }
                let (t, first) = if i == 0 {
                    (std::mem::take(&mut catch_up[j]), job.start)
                } else {
                    (
                        vec![drafted[j][i - 1]],
                        job.start + job.tokens.len() + i - 1,
                    )
                };
                write_step(be, &mut o.step, &t, first, job.cache.len());
                if i == 0 {
                    states.extend_from_slice(job.hidden);
                } else {
                    let last = job.last_row;
                    be.copy(&s.block.xn, last * hd, &mut s.h, row * hd, hd);
                }
                job.last_row = row + t.len() - 1;
                row += t.len();
                positions.extend(first..first + t.len());
                tokens.extend(t);
            }
            if i == 0 {
                be.write(&mut s.h, &states);
            }
            write_batch_step(be, &mut s.block.step, &tokens, &positions);
            let rows = tokens.len();
            let mut parts: Vec<SeqRows<B>> = jobs
                .iter_mut()
                .zip(own.iter_mut())
                .filter(|(job, _)| job.depth > i)
                .map(|(job, own)| SeqRows {
                    rows: if i == 0 { job.tokens.len() } else { 1 },
                    cache: &mut *job.cache,
                    own,
                })
                .collect();
            self.encode_batched(&mut parts, rows, &mut s);
            for part in parts.iter_mut() {
                part.cache.advance(part.rows);
            }
            // Each request's last row through the output layer, together.
            let drafting: Vec<usize> = (0..n).filter(|&j| jobs[j].depth > i).collect();
            for (r, &j) in drafting.iter().enumerate() {
                be.copy(
                    &s.block.xn,
                    jobs[j].last_row * hd,
                    &mut s.block.tmp,
                    r * hd,
                    hd,
                );
            }
            let m = drafting.len();
            be.matmul(&self.lm_head, &s.block.tmp, m, &mut s.block.logits);
            be.argmax(
                &s.block.logits,
                m,
                self.draft_vocab_len(),
                &mut s.block.greedy,
            );
            for (&j, t) in drafting.iter().zip(be.download(&s.block.greedy, m)) {
                drafted[j].push(self.token(t as usize));
            }
        }
        self.scratch = Some(s);
        self.seq_scratch = own;
        // The scratch's outputs are no single forward's last rows: a step from the last output needs a forward
        // of its own first.
        self.last_rows = 0;
        Ok(drafted)
    }

    /// The blocks over the rows of several requests held together in `s` (their fused inputs written): each
    /// request's attention over its own cache, every row's final state into `s.block.xn`.
    fn encode_batched(&self, seqs: &mut [SeqRows<B>], total: usize, s: &mut HeadScratch<B>) {
        let be = self.backend.as_ref();
        let hp = &self.hp;
        self.fuse(total, s);
        let rope = rotation(hp, self.rope);
        for (i, block) in self.blocks.iter().enumerate() {
            let shape = |rows| self.shape(rows);
            block.run_batched(be, hp, rope, i, shape, &mut s.block, total, seqs, None);
        }
        be.rms_norm(
            &s.block.x,
            &self.final_norm,
            total,
            hp.hidden,
            hp.rms_eps,
            &mut s.block.xn,
        );
    }
}

/// One request's part of [`MtpHead::draft_greedy_batched`]: what [`MtpHead::draft_greedy`] takes.
pub struct HeadDraft<'a, B: Backend> {
    pub cache: &'a mut KvCache<B>,
    /// The catch-up's tokens, at positions `start..`, row `i` conditioned on `hidden` row `i`.
    pub tokens: &'a [u32],
    pub start: usize,
    pub hidden: &'a [f32],
    pub depth: usize,
    /// Where its last output row lies in the forward before (the next step's incoming state).
    last_row: usize,
}

impl<'a, B: Backend> HeadDraft<'a, B> {
    pub fn new(
        cache: &'a mut KvCache<B>,
        tokens: &'a [u32],
        start: usize,
        hidden: &'a [f32],
        depth: usize,
    ) -> Self {
        HeadDraft {
            cache,
            tokens,
            start,
            hidden,
            depth,
            last_row: 0,
        }
    }
}
