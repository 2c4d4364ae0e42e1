//! Attention launches: how many query heads a block serves and how many blocks split a row's slots (pure rules,
//! tested here), and the launch itself (`kernels.cu`'s `attention_*`).

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::launch::Arg;
use super::{
    grid, lock, CudaBackend, CudaStep, ATT_CHUNK, ATT_HEADS, ATT_RESIDENT_PER_SM, ATT_ROWS,
    ATT_SPLIT, ATT_SPLIT_MAX, ATT_WARPS, ATT_WARP_ROWS, ATT_WARP_WIDTH, MAX_ROWS,
};
use crate::backend::{
    AttnShape, Backend, HeadNorms, Rope, RopeStyle, SeqAttention, SHARED_ATTENTION_ROWS,
};

/// The most sequences one shared launch serves (`kernels.cu`'s `MAX_SEQS`); more take several launches.
pub(super) const MAX_SEQS: usize = 32;
/// 64-bit words of one `kernels.cu` `SeqLaunch`.
const SEQ_WORDS: usize = 8;
const _: () = assert!(SHARED_ATTENTION_ROWS <= MAX_ROWS);

/// A device address argument's value.
fn address(a: Arg) -> u64 {
    match a {
        Arg::Ptr(p) => p,
        _ => unreachable!("an address"),
    }
}

/// Two `int`s of a kernel struct in one little-endian word, `lo` first.
fn ints(lo: usize, hi: usize) -> u64 {
    u64::from(lo as u32) | u64::from(hi as u32) << 32
}

/// Query heads per attention block for a launch of `rows` rows over a cache of `chunks` 64-slot chunks: one
/// while a block per (row, head, chunk) leaves no SM more than two (`sms`), else the largest divisor of the GQA
/// group (query heads per KV head) up to ATT_HEADS; `forced` (up to ATT_HEADS) replaces the rule. A block of
/// several heads loads each K and V value once for all of them (fewer blocks, a chunk read once per KV head),
/// but its own chain is longer, which costs where the blocks per head fit the GPU anyway: with SmolLM2's groups
/// of 3, a block per group is faster from 4 rows over a short context and from 2 over a long one, a block per
/// head at 1-2 rows over a short one, and a one-chunk context does not care. The rule counts the capacity's
/// chunks (a recorded launch serves every context the cache holds), up to twice the context's: hence two per
/// SM, which picks the faster count, or one within noise of it, at every width and context measured, and
/// makes MTP's verify faster than one per SM does (measured: BENCHMARKS.md, "Verify cost by width"). Every
/// query's arithmetic is the same at any count (the same bits: `rowexact` under each), so the count may follow
/// the rows.
pub(super) fn att_heads(
    n_heads: usize,
    n_kv_heads: usize,
    rows: usize,
    chunks: usize,
    sms: usize,
    forced: Option<usize>,
) -> usize {
    let group = n_heads / n_kv_heads.max(1);
    let most = match forced {
        Some(f) => f.clamp(1, ATT_HEADS),
        None if rows * n_heads * chunks <= 2 * sms => 1,
        None => ATT_HEADS,
    };
    (1..=most.min(group))
        .rev()
        .find(|h| group.is_multiple_of(*h))
        .unwrap_or(1)
}

/// The warp-per-chunk kernel's variant for `heads` query heads per block and heads of `head_dim` values: its
/// index in `Kernels::attention_warps` (heads, then 1, 2, 4 or 8 dims per lane: the fewest that cover the head).
pub(super) fn att_warp_kernel(heads: usize, head_dim: usize) -> usize {
    let per_lane = head_dim.div_ceil(32).next_power_of_two().clamp(1, 8);
    (heads - 1) * 4 + per_lane.trailing_zeros() as usize
}

/// Blocks per (row, head block) of the warp-per-chunk kernel over a cache of `capacity` slots: a warp per chunk
/// of the capacity up to ATT_SPLIT blocks (beyond, each warp takes every ATT_WARPS * split-th chunk).
pub(super) fn att_warp_split(capacity: usize) -> usize {
    capacity
        .div_ceil(ATT_CHUNK)
        .div_ceil(ATT_WARPS)
        .clamp(1, ATT_SPLIT)
}

impl CudaBackend {
    /// Attention blocks per (row, head) for a launch of `row_heads` (row, head) pairs over a cache of
    /// `capacity` slots: a block per 64-slot chunk of the capacity, so that no block takes two chunks in turn
    /// (the kernel puts only as many blocks to work as the step's context has chunks; the others return at
    /// once), capped where 4 blocks per SM would not hold the grid (at ATT_SPLIT, or more where a wave allows)
    /// and at ATT_SPLIT_MAX. Against the row-count-only rule (the branch with `att_split_by_context` off), each
    /// with its own early-load limit (4 blocks per SM here, 2 there), this one is faster at 4-8 rows over a
    /// 256-slot context and at 2-4 over a 1024-slot one, within noise elsewhere; its one loss is 16 rows over a
    /// one-chunk context (measured: BENCHMARKS.md, "Verify cost by width"). No bits depend on it: every chunk's
    /// record is the same whichever block computes it, and the combine reads them in chunk order.
    fn att_split(&self, row_heads: usize, capacity: usize) -> usize {
        if let Some(forced) = self.att_split {
            return forced;
        }
        if !self.att_split_by_context {
            return if ATT_SPLIT * row_heads < self.sms {
                (2 * self.sms / row_heads).clamp(ATT_SPLIT, ATT_SPLIT_MAX)
            } else {
                ATT_SPLIT
            };
        }
        let wave = ATT_RESIDENT_PER_SM * self.sms / row_heads.max(1);
        capacity
            .div_ceil(ATT_CHUNK)
            .clamp(1, wave.clamp(ATT_SPLIT, ATT_SPLIT_MAX))
    }

    /// The attention of `shape.rows` rows (launches of up to `MAX_ROWS` rows, or `ATT_ROWS` with a warp per
    /// chunk), as `Backend::attention`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_attention(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<f32>,
        v_cache: &CudaSlice<f32>,
        work: &mut CudaSlice<f32>,
        shape: AttnShape,
        step: &CudaStep,
        out: &mut CudaSlice<f32>,
    ) {
        // Chunk records for every chunk of the cache's capacity (fixed while its buffers live, so a recorded
        // launch stays valid). A local layer's cache may be a ring of that many slots; its window keeps every
        // chunk a row reads within the step's positions.
        let capacity = k_cache.len() / (shape.n_kv_heads * shape.head_dim);
        let chunks = capacity.div_ceil(ATT_CHUNK);
        assert!(work.len() >= self.attention_work_len(shape.n_heads, shape.head_dim, capacity));
        let (nh, nkv, hd, cap, nc) = (
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
            step.cap as i32,
            chunks as i32,
        );
        // A launch of every row (at most a verify's) also stages the output, in whole 32-value blocks, for the
        // output projection that follows: its `quantize_x` launch is skipped.
        let width = shape.n_heads * shape.head_dim;
        let stage = shape.head_dim.is_multiple_of(32) && self.can_stage(shape.rows, width);
        let key = stage.then(|| self.staged_key(out, 0, shape.rows, width, None));
        let staged = lock(&self.staged);
        let target = staged.last().filter(|_| stage);
        let mut r0 = 0;
        while r0 < shape.rows {
            let left = shape.rows - r0;
            // Many rows (prefill chunks, wide verifies): a warp per chunk, every block sharing each K and V value
            // over its heads, up to ATT_ROWS rows a launch; else a block per chunk, the heads per block and split
            // by the rules above.
            let warps = match self.att_warp_rows {
                Some(forced) => forced > 0 && left.min(MAX_ROWS) >= forced,
                None => {
                    left.min(MAX_ROWS) >= ATT_WARP_ROWS
                        && shape.n_heads * shape.head_dim >= ATT_WARP_WIDTH
                }
            };
            let take = left.min(if warps { ATT_ROWS } else { MAX_ROWS });
            // With a warp per chunk a block always serves as many heads as the group allows (no SMs: no grid
            // counts as small).
            let sms = if warps { 0 } else { self.sms };
            let heads = att_heads(
                shape.n_heads,
                shape.n_kv_heads,
                take,
                chunks,
                sms,
                self.att_heads,
            );
            let per_chunk = take * shape.n_heads / heads;
            let split = match (warps, self.att_split) {
                (true, Some(forced)) => forced,
                (true, None) => att_warp_split(capacity),
                (false, _) => self.att_split(per_chunk, capacity),
            };
            let cfg = LaunchConfig {
                grid_dim: (split as u32, per_chunk as u32, 1),
                block_dim: (if warps { 32 * ATT_WARPS } else { 256 } as u32, 1, 1),
                shared_mem_bytes: if warps {
                    0
                } else {
                    (heads * 4 * shape.head_dim * 4) as u32
                },
            };
            let row0 = r0 as i32;
            let args = [
                self.at(q, 0),
                self.at(k_cache, 0),
                self.at(v_cache, 0),
                Arg::I32(row0),
                Arg::I32(nh),
                Arg::I32(nkv),
                Arg::I32(hd),
                Arg::F32(shape.scale),
                Arg::I32(shape.window.map_or(0, |w| w.min(i32::MAX as usize) as i32)),
                Arg::I32(capacity as i32),
                self.at(&step.dev, 0),
                Arg::I32(cap),
                self.at(work, 0),
                Arg::I32(nc),
                self.at(out, 0),
                target.map_or(Arg::Ptr(0), |s| self.at(&s.xq, 0)),
                target.map_or(Arg::Ptr(0), |s| self.at(&s.xd, 0)),
                target.map_or(Arg::Ptr(0), |s| self.at(&s.xs, 0)),
            ];
            // The early-load variant takes more registers, so fewer of its blocks fit an SM: it runs where the
            // grid is small enough (decode steps, verifies of short contexts). Both give the same bits.
            let blocks = split * per_chunk;
            let f = if warps {
                &self.k.attention_warps[att_warp_kernel(heads, shape.head_dim)]
            } else if self.att_ahead && blocks <= self.att_ahead_per_sm * self.sms {
                &self.k.attention_ahead[heads - 1]
            } else {
                &self.k.attention[heads - 1]
            };
            // SAFETY: q/out hold rows × n_heads × head_dim values, the caches (base + rows) × kv_dim within
            // their capacity; `work` holds the counters and chunk records of up to ATT_ROWS rows (checked above);
            // the mask is in the step; a staging target holds rows ≤ MAX_ROWS < STAGED_ROWS rows of `width`
            // values; both kernels take these arguments.
            unsafe { self.go("attention", f, cfg, &args) };
            r0 += take;
        }
        drop(staged);
        *lock(&self.staged_for) = key;
    }
}

impl CudaBackend {
    /// `Backend::attention_seqs`: up to MAX_SEQS sequences of up to SHARED_ATTENTION_ROWS rows each per pair of
    /// launches (`rope_and_cache_seqs`, then `attention_seqs[_ahead]_*`), each sequence's step, cache layer and
    /// scratch passed by value; `false` where switched off or a sequence has more rows.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_attention_seqs(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        rope: Rope,
        norms: Option<HeadNorms<'_, CudaSlice<f32>>>,
        seqs: &mut [SeqAttention<'_, Self>],
    ) -> bool {
        if !self.seq_launches || seqs.iter().any(|s| s.shape.rows > SHARED_ATTENTION_ROWS) {
            return false;
        }
        // Staging the output for the output projection needs every row of `out` it reads: the launch's rows
        // from row 0 on, in one launch.
        let contiguous = seqs
            .iter()
            .scan(0, |at, s| {
                let ok = s.first_row == *at;
                *at += s.shape.rows;
                Some(ok)
            })
            .all(|ok| ok);
        let whole = contiguous && seqs.len() <= MAX_SEQS;
        for part in seqs.chunks_mut(MAX_SEQS) {
            self.seqs_launches(q, k, v, out, rope, norms, part, whole);
        }
        true
    }

    /// One pair of launches for at most MAX_SEQS sequences; `stage`: their rows are the output's rows 0.. .
    #[allow(clippy::too_many_arguments)]
    fn seqs_launches(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        rope: Rope,
        norms: Option<HeadNorms<'_, CudaSlice<f32>>>,
        seqs: &mut [SeqAttention<'_, Self>],
        stage: bool,
    ) {
        let shape = seqs[0].shape;
        let (nh, nkv, hd) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
        let kv_dim = nkv * hd;
        let items: usize = seqs.iter().map(|s| s.shape.rows).sum();
        let capacity = seqs
            .iter()
            .map(|s| s.k_cache.len() / kv_dim)
            .max()
            .unwrap_or(0);
        // The rules of a one-sequence launch, for the launch's rows and its largest cache.
        let heads = att_heads(
            nh,
            nkv,
            items,
            capacity.div_ceil(ATT_CHUNK),
            self.sms,
            self.att_heads,
        );
        let per_row = nh / heads;
        let split = self.att_split(items * per_row, capacity);
        let mut words = vec![0u64; MAX_SEQS * SEQ_WORDS + 1];
        let (mut item, mut block) = (0, 0);
        for (s, w) in seqs.iter().zip(words.chunks_mut(SEQ_WORDS)) {
            debug_assert!(
                s.shape.n_heads == nh && s.shape.n_kv_heads == nkv && s.shape.head_dim == hd
            );
            let slots = s.k_cache.len() / kv_dim;
            assert!(s.work.len() >= self.attention_work_len(nh, hd, slots));
            w[0] = address(self.at(&s.step.dev, 0));
            w[1] = address(self.at(s.k_cache, 0));
            w[2] = address(self.at(s.v_cache, 0));
            w[3] = address(self.at(s.work, 0));
            w[4] = ints(s.step.cap, s.step.rope_table(rope, hd) as usize);
            w[5] = ints(slots, slots.div_ceil(ATT_CHUNK));
            w[6] = ints(s.first_row, s.shape.rows);
            w[7] = ints(item, block);
            item += s.shape.rows;
            block += s.shape.rows * per_row;
        }
        words[MAX_SEQS * SEQ_WORDS] = seqs.len() as u64;
        let rope_args = [
            self.at(q, 0),
            self.at(k, 0),
            self.at(v, 0),
            Arg::I32(items as i32),
            Arg::I32(nh as i32),
            Arg::I32(nkv as i32),
            Arg::I32(hd as i32),
            Arg::I32(rope.rotated(hd) as i32),
            Arg::I32(i32::from(rope.style == RopeStyle::Interleaved)),
            norms.map_or(Arg::Ptr(0), |n| self.at(n.q, 0)),
            norms.map_or(Arg::Ptr(0), |n| self.at(n.k, 0)),
            Arg::F32(norms.map_or(0.0, |n| n.eps)),
            Arg::Words(&words),
        ];
        // SAFETY: q, k and v hold every sequence's rows at its first row; each sequence's cache has room for its
        // step's slots (reserved by the model; a ring's slots wrap) and its step its rows' rotation table; the
        // norms' weights head_dim each; one warp per (row, head) of Q, K and V; `words` is a `Seqs`.
        unsafe {
            self.go(
                "rope_and_cache_seqs",
                &self.k.rope_and_cache_seqs,
                grid(items * (nh + 2 * nkv) * 32, 128),
                &rope_args,
            )
        };
        let width = nh * hd;
        let stage = stage && hd.is_multiple_of(32) && self.can_stage(items, width);
        let key = stage.then(|| self.staged_key(out, 0, items, width, None));
        let staged = lock(&self.staged);
        let target = staged.last().filter(|_| stage);
        let args = [
            self.at(q, 0),
            Arg::I32(nh as i32),
            Arg::I32(nkv as i32),
            Arg::I32(hd as i32),
            Arg::F32(shape.scale),
            Arg::I32(shape.window.map_or(0, |w| w.min(i32::MAX as usize) as i32)),
            self.at(out, 0),
            target.map_or(Arg::Ptr(0), |s| self.at(&s.xq, 0)),
            target.map_or(Arg::Ptr(0), |s| self.at(&s.xd, 0)),
            target.map_or(Arg::Ptr(0), |s| self.at(&s.xs, 0)),
            Arg::Words(&words),
        ];
        let cfg = LaunchConfig {
            grid_dim: (split as u32, block as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: (heads * 4 * hd * 4) as u32,
        };
        let f = if self.att_ahead && split * block <= self.att_ahead_per_sm * self.sms {
            &self.k.attention_seqs_ahead[heads - 1]
        } else {
            &self.k.attention_seqs[heads - 1]
        };
        // SAFETY: as `launch_attention`'s, per sequence: its rows of q and out from its first row, its caches,
        // scratch (checked above) and step; a staging target holds the launch's rows (items ≤ MAX_ROWS, checked
        // by `can_stage`); `words` is a `Seqs` whose blocks cover the grid's y.
        unsafe { self.go("attention_seqs", f, cfg, &args) };
        drop(staged);
        *lock(&self.staged_for) = key;
    }
}

#[cfg(test)]
mod tests {
    use super::{att_heads, att_warp_kernel, att_warp_split};
    use crate::backend::cuda::ATT_SPLIT;

    #[test]
    fn attention_blocks_serve_a_head_each_while_they_fit_two_per_sm() {
        let sms = 132;
        assert_eq!(att_heads(9, 3, 1, 8, sms, None), 1); // SmolLM2, W=1 over a cache of 512
        assert_eq!(att_heads(9, 3, 2, 8, sms, None), 1);
        assert_eq!(att_heads(9, 3, 4, 8, sms, None), 3);
        assert_eq!(att_heads(9, 3, 8, 5, sms, None), 3);
        assert_eq!(att_heads(9, 3, 16, 1, sms, None), 1);
        assert_eq!(att_heads(9, 3, 1, 32, sms, None), 3);
        assert_eq!(att_heads(9, 3, 2, 16, sms, None), 3);
    }
    #[test]
    fn the_warp_kernels_variant_covers_the_head_with_the_fewest_dims_per_lane() {
        assert_eq!(att_warp_kernel(1, 16), 0);
        assert_eq!(att_warp_kernel(1, 32), 0);
        assert_eq!(att_warp_kernel(3, 64), 2 * 4 + 1); // SmolLM2
        assert_eq!(att_warp_kernel(4, 128), 3 * 4 + 2); // Llama 8B
        assert_eq!(att_warp_kernel(4, 96), 3 * 4 + 2);
        assert_eq!(att_warp_kernel(4, 256), 3 * 4 + 3); // Gemma 3
        assert_eq!(att_warp_split(512), 2);
        assert_eq!(att_warp_split(100), 1);
        assert_eq!(att_warp_split(32_768), ATT_SPLIT);
    }

    #[test]
    fn a_group_block_serves_the_largest_divisor_of_the_group_up_to_four_heads() {
        let many = |n_heads, n_kv_heads| att_heads(n_heads, n_kv_heads, 16, 32, 132, None);
        assert_eq!(many(9, 3), 3);
        assert_eq!(many(4, 1), 4); // Gemma 3 270M
        assert_eq!(many(32, 4), 4);
        assert_eq!(many(28, 4), 1); // groups of 7
        assert_eq!(many(24, 4), 3); // groups of 6
        assert_eq!(many(8, 8), 1); // no GQA
        assert_eq!(att_heads(9, 3, 1, 8, 132, Some(3)), 3);
        assert_eq!(att_heads(16, 2, 16, 32, 132, Some(2)), 2);
    }
}
