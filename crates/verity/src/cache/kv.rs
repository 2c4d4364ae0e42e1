//! The per-layer key/value cache.
//!
//! Invariants: slots `0..len` hold the K/V of the committed tokens, in position order, and `len` is the fill
//! (never a logical position without rows behind it). A forward appends its rows at `len..len + W`; a speculative
//! cycle keeps a prefix of them with [`KvCache::truncate`]. Capacity grows by whole-buffer copies, never
//! silently drops rows.
//!
//! A local attention layer (one that sees only the latest `window` positions) keeps a ring instead: slot `j`
//! lives at `j mod ring`, with `ring ≥ window + W + 136` for the widest forward `W` asked for so far, so a
//! forward's rows never overwrite a position its queries (or a rollback to any of its rows, or 64 positions
//! further back) still need, and what the attention reads before a window (to align its blocks) stays finite. Its memory is bounded by the window, not the
//! context. What the ring has overwritten is tracked (`oldest`): a truncation to a point whose window is gone
//! empties the cache instead (the caller prefills again), a checkpoint holds only each ring's last `window`
//! positions, and a restore writes them back where they belong.
//!
//! A recurrent (linear-attention) layer has no K/V: its state is in [`Recurrent`], rolled back and
//! checkpointed with the slots.

use super::Recurrent;
use crate::backend::{buffer_set_id, Backend};
use crate::error::{Error, Result};
use crate::model::TargetFeatures;

/// The attention geometry a cache serves.
#[derive(Debug, Clone, Copy)]
pub struct CacheShape {
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// Slots a ring keeps beyond a window and the forward's rows: the CPU attention's blocks of eight keys start up
/// to seven positions before a window, the GPU's chunks of 64 keys need a ring of at least two chunks more
/// than a window and the rows span (its chunk records are kept per chunk of the ring), and a draft model's
/// rollback spans the one-row steps that drafted.
const RING_MARGIN: usize = 136;

pub struct KvCache<B: Backend> {
    pub(crate) k: Vec<B::Buffer>,
    pub(crate) v: Vec<B::Buffer>,
    /// The backend's attention scratch for this cache's capacity ([`Backend::attention_work_len`]), shared by
    /// the layers (they run one after another).
    pub(crate) attn_work: B::Buffer,
    shape: CacheShape,
    kv_dim: usize,
    len: usize,
    capacity: usize,
    max_capacity: usize,
    /// Per layer, the window of a local attention layer (`None`: the layer sees the whole context).
    windows: Vec<Option<usize>>,
    /// Slots of the local layers' buffers: `capacity` until the context outgrows their ring.
    ring: usize,
    /// The oldest position every local layer still holds (0 while no ring has wrapped).
    oldest: usize,
    /// Changes whenever the buffers are reallocated (see [`buffer_set_id`]).
    buffers_id: u64,
    /// The recurrent layers' states, where the model has such layers (their K/V buffers are empty).
    recurrent: Option<Recurrent>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache of `shape` whose layers all see the whole context, holding at most `max_capacity` slots.
    pub fn new(backend: &B, shape: CacheShape, max_capacity: usize) -> Self {
        Self::with_windows(backend, shape, max_capacity, vec![None; shape.n_layers])
    }

    /// An empty cache of `shape` whose layer `l` sees the latest `windows[l]` positions (`None`: all of them).
    pub fn with_windows(
        backend: &B,
        shape: CacheShape,
        max_capacity: usize,
        windows: Vec<Option<usize>>,
    ) -> Self {
        assert_eq!(windows.len(), shape.n_layers, "a window entry per layer");
        let capacity = 256.min(max_capacity);
        let ring = windows
            .iter()
            .flatten()
            .max()
            .map_or(capacity, |&w| capacity.min(ring_slots(w, 0)));
        let kv_dim = shape.n_kv_heads * shape.head_dim;
        let buffers = || -> Vec<B::Buffer> {
            windows
                .iter()
                .map(|w| backend.buffer(if w.is_some() { ring } else { capacity } * kv_dim))
                .collect()
        };
        debug_assert!(shape.n_layers > 0);
        KvCache {
            k: buffers(),
            v: buffers(),
            attn_work: Self::attention_work(backend, shape, capacity),
            shape,
            kv_dim,
            len: 0,
            capacity,
            max_capacity,
            windows,
            ring,
            oldest: 0,
            buffers_id: buffer_set_id(),
            recurrent: None,
        }
    }

    /// An empty cache of `shape` as [`KvCache::with_windows`] makes it, whose layers with a nonzero
    /// `recurrent[l]` keep a recurrent state of that many values instead of K/V.
    pub fn with_recurrent(
        backend: &B,
        shape: CacheShape,
        max_capacity: usize,
        windows: Vec<Option<usize>>,
        recurrent: Vec<usize>,
    ) -> Self {
        assert_eq!(recurrent.len(), shape.n_layers, "a state length per layer");
        let mut cache = Self::with_windows(backend, shape, max_capacity, windows);
        if recurrent.iter().any(|&n| n > 0) {
            for (l, _) in recurrent.iter().enumerate().filter(|(_, &n)| n > 0) {
                cache.k[l] = backend.buffer(1);
                cache.v[l] = backend.buffer(1);
            }
            cache.recurrent = Some(Recurrent::new(recurrent));
        }
        cache
    }

    /// Whether layer `l` keeps K/V (a recurrent layer does not).
    fn has_kv(&self, l: usize) -> bool {
        self.recurrent.as_ref().is_none_or(|r| r.lens()[l] == 0)
    }

    /// The layers that keep K/V.
    fn kv_layers(&self) -> Vec<usize> {
        (0..self.k.len()).filter(|&l| self.has_kv(l)).collect()
    }

    /// The recurrent layers' states, where the model has such layers.
    pub fn recurrent(&self) -> Option<&Recurrent> {
        self.recurrent.as_ref()
    }

    pub(crate) fn recurrent_mut(&mut self) -> Option<&mut Recurrent> {
        self.recurrent.as_mut()
    }

    /// Committed slots.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn max_capacity(&self) -> usize {
        self.max_capacity
    }

    /// Slots the buffers of the whole-context layers hold now (they grow up to [`KvCache::max_capacity`]).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes of K/V the buffers hold (what the cache costs in device memory), and of the recurrent states.
    pub fn bytes(&self) -> usize {
        self.bytes_at(self.capacity, self.ring)
    }

    /// What [`KvCache::bytes`] would say once the buffers have grown to hold `len` positions for forwards of up
    /// to `rows` rows, without growing them (a server's admission by memory).
    pub fn bytes_holding(&self, len: usize, rows: usize) -> usize {
        let (capacity, ring) = self.grown(len.min(self.max_capacity), rows);
        self.bytes_at(capacity, ring)
    }

    /// Bytes of the K/V buffers at `capacity` whole-context slots and `ring` local slots, and of the recurrent
    /// states.
    fn bytes_at(&self, capacity: usize, ring: usize) -> usize {
        let slots: usize = (0..self.windows.len())
            .map(|l| self.slots_at(l, capacity, ring))
            .sum();
        let states: usize = self.recurrent.as_ref().map_or(0, |r| r.lens().iter().sum());
        (2 * slots * self.kv_dim + states) * 4
    }

    /// The whole-context capacity and ring slots the buffers grow to for `need` slots and forwards of `rows`
    /// rows.
    fn grown(&self, need: usize, rows: usize) -> (usize, usize) {
        let capacity = if need <= self.capacity {
            self.capacity
        } else {
            need.next_power_of_two().min(self.max_capacity)
        };
        // A ring never shrinks (that would drop what it holds); until the context outgrows it, the local
        // layers are as long as the others.
        let ring = match self.window() {
            Some(w) => capacity.min(self.ring.max(ring_slots(w, rows))),
            None => capacity,
        };
        (capacity, ring)
    }

    /// Slots of layer `l`'s buffers (none for a recurrent layer).
    fn slots(&self, l: usize) -> usize {
        self.slots_at(l, self.capacity, self.ring)
    }

    /// Slots of layer `l`'s buffers at `capacity` whole-context slots and `ring` local slots.
    fn slots_at(&self, l: usize, capacity: usize, ring: usize) -> usize {
        if !self.has_kv(l) {
            0
        } else if self.windows[l].is_some() {
            ring
        } else {
            capacity
        }
    }

    /// The widest window of the local layers, if there are any.
    fn window(&self) -> Option<usize> {
        self.windows.iter().flatten().max().copied()
    }

    fn attention_work(backend: &B, shape: CacheShape, capacity: usize) -> B::Buffer {
        backend.buffer(backend.attention_work_len(shape.n_heads, shape.head_dim, capacity))
    }

    /// Identifies the current buffer allocation (it changes when the cache grows).
    pub(crate) fn buffers_id(&self) -> u64 {
        self.buffers_id
    }

    /// Make room for a forward of `extra` rows after `len`.
    pub(crate) fn reserve(&mut self, backend: &B, extra: usize) -> Result<()> {
        let need = self.len + extra;
        if need > self.max_capacity {
            return Err(Error::Invalid(format!(
                "context full: {need} tokens exceed the context length {}",
                self.max_capacity
            )));
        }
        self.grow(backend, need, extra);
        // The rows' slots are about to be written: in a ring, what they replace is gone.
        if self.ring < need {
            self.oldest = self.oldest.max(need - self.ring);
        }
        Ok(())
    }

    /// Buffers for `need` slots, with rings wide enough for forwards of `rows` rows.
    fn grow(&mut self, backend: &B, need: usize, rows: usize) {
        let (capacity, ring) = self.grown(need, rows);
        if capacity == self.capacity && ring == self.ring {
            return;
        }
        // Every position each buffer holds, moved to where the new buffer keeps it.
        let held = |slots: usize, len: usize| len.saturating_sub(slots)..len;
        for l in self.kv_layers() {
            let (old, new) = (self.slots(l), self.slots_at(l, capacity, ring));
            if old == new {
                continue;
            }
            let positions = held(old, self.len);
            let d = self.kv_dim;
            for bufs in [&mut self.k, &mut self.v] {
                let mut grown = backend.buffer(new * d);
                for (p, n) in ring_pieces(positions.clone(), old) {
                    for (q, m) in ring_pieces(p..p + n, new) {
                        backend.copy(&bufs[l], (q % old) * d, &mut grown, (q % new) * d, m * d);
                    }
                }
                bufs[l] = grown;
            }
        }
        if capacity != self.capacity {
            self.attn_work = Self::attention_work(backend, self.shape, capacity);
        }
        self.capacity = capacity;
        self.ring = ring;
        self.buffers_id = buffer_set_id();
    }

    /// Mark `rows` appended slots as committed (called by the forward after writing them).
    pub(crate) fn advance(&mut self, rows: usize) {
        debug_assert!(self.len + rows <= self.capacity);
        self.len += rows;
    }

    /// The positions a checkpoint keeps of layer `l`: a local layer's last window, a recurrent layer's none
    /// (its state stands for them), every other layer's all.
    fn kept(&self, l: usize) -> std::ops::Range<usize> {
        match self.windows[l] {
            _ if !self.has_kv(l) => self.len..self.len,
            Some(w) => self.len.saturating_sub(w)..self.len,
            None => 0..self.len,
        }
    }

    /// A copy of the committed state, to restore later (the prefix cache stores these).
    pub fn checkpoint(&self, backend: &B) -> KvCheckpoint {
        let d = self.kv_dim;
        let mut layers = Vec::with_capacity(self.k.len());
        let mut firsts = Vec::with_capacity(self.k.len());
        for l in 0..self.k.len() {
            let (kept, slots) = (self.kept(l), self.slots(l));
            let read = |buf: &B::Buffer| -> Vec<f32> {
                let mut out = Vec::with_capacity(kept.len() * d);
                for (p, n) in ring_pieces(kept.clone(), slots) {
                    let at = (p % slots) * d;
                    let all = backend.download(buf, at + n * d);
                    out.extend_from_slice(&all[at..]);
                }
                out
            };
            firsts.push(kept.start);
            layers.push((read(&self.k[l]), read(&self.v[l])));
        }
        KvCheckpoint {
            len: self.len,
            kv_dim: d,
            firsts,
            layers,
            recurrent: self.recurrent.as_ref().map(|r| r.current().to_vec()),
            hidden: None,
        }
    }

    /// Replace the committed state with a checkpoint taken from a cache of the same shape.
    pub fn restore(&mut self, backend: &B, ckpt: &KvCheckpoint) -> Result<()> {
        let states_fit = match (&self.recurrent, &ckpt.recurrent) {
            (None, None) => true,
            (Some(r), Some(states)) => {
                states.len() == r.lens().len()
                    && states.iter().zip(r.lens()).all(|(s, &n)| s.len() == n)
            }
            _ => false,
        };
        if ckpt.kv_dim != self.kv_dim || ckpt.layers.len() != self.k.len() || !states_fit {
            return Err(Error::Invalid("checkpoint of another model shape".into()));
        }
        // A local layer needs its last window, a recurrent layer no position (its state), any other layer
        // everything.
        let enough = (0..self.k.len()).all(|l| {
            let need = match self.windows[l] {
                _ if !self.has_kv(l) => ckpt.len,
                Some(w) => ckpt.len.saturating_sub(w),
                None => 0,
            };
            ckpt.firsts[l] <= need
        });
        if ckpt.len > self.max_capacity || !enough {
            return Err(Error::Invalid(
                "checkpoint does not hold what this cache's layers need".into(),
            ));
        }
        self.len = 0;
        self.oldest = 0;
        self.grow(backend, ckpt.len, 0);
        let d = self.kv_dim;
        for l in self.kv_layers() {
            let slots = self.slots(l);
            let first = ckpt.firsts[l].max(ckpt.len.saturating_sub(slots));
            let (ck, cv) = &ckpt.layers[l];
            let skip = (first - ckpt.firsts[l]) * d;
            for (buf, data) in [(&mut self.k[l], ck), (&mut self.v[l], cv)] {
                let up = backend.upload(&data[skip..]);
                let mut at = 0;
                for (p, n) in ring_pieces(first..ckpt.len, slots) {
                    backend.copy(&up, at, buf, (p % slots) * d, n * d);
                    at += n * d;
                }
            }
        }
        self.len = ckpt.len;
        if self.ring < self.len {
            self.oldest = self.len - self.ring;
        }
        if let (Some(r), Some(states)) = (&mut self.recurrent, &ckpt.recurrent) {
            r.restore(ckpt.len, states.clone());
        }
        Ok(())
    }

    /// Of the slots `base..`, keep those at offsets `rows` (ascending, `rows[i] ≥ i`: a draft tree's accepted
    /// path) moved to `base..base + rows.len()`, and drop the rest. Runs of consecutive offsets move together;
    /// a leading run already in place (the first-child line) does not move at all.
    pub fn keep_rows(&mut self, backend: &B, base: usize, rows: &[usize]) {
        debug_assert!(rows.windows(2).all(|w| w[0] < w[1]));
        debug_assert!(base + rows.last().map_or(0, |&r| r + 1) <= self.len);
        let d = self.kv_dim;
        let mut i = 0;
        while i < rows.len() {
            let mut run = 1;
            while i + run < rows.len() && rows[i + run] == rows[i] + run {
                run += 1;
            }
            let (src, dst) = (base + rows[i], base + i);
            // Disjoint pieces: each moves at most the gap `src - dst`, in order, so none reads what one wrote.
            let mut moved = 0;
            while src > dst && moved < run {
                let n = (run - moved).min(src - dst);
                for l in self.kv_layers() {
                    let slots = self.slots(l);
                    // In a ring a piece may wrap: split it where either end does.
                    for (p, m) in ring_pieces(src + moved..src + moved + n, slots) {
                        let to = p - src + dst;
                        for (q, k) in ring_pieces(to..to + m, slots) {
                            let from = q - dst + src;
                            for buf in [&mut self.k[l], &mut self.v[l]] {
                                backend.copy_within(
                                    buf,
                                    (from % slots) * d,
                                    (q % slots) * d,
                                    k * d,
                                );
                            }
                        }
                    }
                }
                moved += n;
            }
            i += run;
        }
        self.len = self.len.min(base + rows.len());
        if let Some(r) = &mut self.recurrent {
            r.keep_rows(base, rows);
        }
    }

    /// Roll back to the first `len` slots (a rejected speculative suffix, or a new conversation sharing a
    /// prefix), and return the fill kept: `len`, or 0 where a ring no longer holds the window before `len`, or
    /// the recurrent state at `len` is not kept (the caller prefills again from the start).
    pub fn truncate(&mut self, len: usize) -> usize {
        let len = self.len.min(len);
        let window_kept = self
            .window()
            .is_none_or(|w| len.saturating_sub(w) >= self.oldest);
        let state_kept = self.recurrent.as_mut().is_none_or(|r| r.truncate(len));
        if window_kept && state_kept {
            self.len = len;
        } else {
            self.len = 0;
            self.oldest = 0;
            if let Some(r) = &mut self.recurrent {
                r.reset();
            }
        }
        self.len
    }

    /// Start a forward of `rows` rows after the committed slots: the recurrent states after its rows follow,
    /// every row's where `verify` (a rollback may keep any prefix or tree path of them), else the last's.
    pub(crate) fn begin_forward(&mut self, rows: usize, verify: bool) {
        let len = self.len;
        if let Some(r) = &mut self.recurrent {
            r.begin(len, rows, verify);
        }
    }
}

/// The ring a local layer of `window` positions needs for forwards of `rows` rows.
fn ring_slots(window: usize, rows: usize) -> usize {
    (window + rows + RING_MARGIN).next_multiple_of(64)
}

/// `positions` cut where a ring of `slots` slots wraps: `(first position, count)` pieces, each contiguous in the
/// ring.
fn ring_pieces(positions: std::ops::Range<usize>, slots: usize) -> Vec<(usize, usize)> {
    let mut pieces = Vec::new();
    let mut p = positions.start;
    while p < positions.end {
        let n = (slots - p % slots).min(positions.end - p);
        pieces.push((p, n));
        p += n;
    }
    pieces
}

/// The committed K/V of every layer at some fill, held in host memory.
#[derive(Debug, Clone)]
pub struct KvCheckpoint {
    len: usize,
    kv_dim: usize,
    /// Per layer, the first position it holds (a local layer keeps only its last window).
    firsts: Vec<usize>,
    /// Each layer's K and V of positions `firsts[l]..len`.
    layers: Vec<(Vec<f32>, Vec<f32>)>,
    /// Each layer's recurrent state at `len` (empty for attention layers), where the model has such layers.
    recurrent: Option<Vec<Vec<f32>>>,
    /// The target's hidden states of every slot that the route's proposer conditions on (an MTP head's final
    /// states, a block drafter's layers; `len × width` values), where they were kept: a restore then hands the
    /// proposer the whole prefix, as a cold prefill would.
    hidden: Option<HiddenRows>,
}

/// Hidden states (of one [`TargetFeatures`] kind) of consecutive positions from 0: `rows.len() / width` of them.
#[derive(Debug, Clone, PartialEq)]
pub struct HiddenRows {
    pub features: TargetFeatures,
    pub width: usize,
    pub rows: Vec<f32>,
}

impl KvCheckpoint {
    /// A checkpoint of `len` positions whose layer `l` holds positions `firsts[l]..len` (`kv_dim` values each
    /// in K and V).
    pub(crate) fn from_parts(
        len: usize,
        kv_dim: usize,
        firsts: Vec<usize>,
        layers: Vec<(Vec<f32>, Vec<f32>)>,
    ) -> Self {
        debug_assert!(firsts.len() == layers.len());
        debug_assert!(layers
            .iter()
            .zip(&firsts)
            .all(|((k, v), &f)| k.len() == (len - f) * kv_dim && v.len() == k.len()));
        KvCheckpoint {
            len,
            kv_dim,
            firsts,
            layers,
            recurrent: None,
            hidden: None,
        }
    }

    /// Attach each layer's recurrent state at `len` (empty for layers without one).
    pub(crate) fn with_recurrent(mut self, states: Vec<Vec<f32>>) -> Self {
        assert_eq!(states.len(), self.layers.len(), "a state per layer");
        self.recurrent = Some(states);
        self
    }

    /// Each layer's recurrent state, where the model has recurrent layers.
    pub fn recurrent(&self) -> Option<&[Vec<f32>]> {
        self.recurrent.as_deref()
    }

    /// Per layer, the first position it holds.
    pub fn firsts(&self) -> &[usize] {
        &self.firsts
    }

    /// Attach the hidden states (`features`) of slots `0..len` (`rows`: `len × width` values).
    pub(crate) fn with_hidden(
        mut self,
        features: TargetFeatures,
        width: usize,
        rows: Vec<f32>,
    ) -> Self {
        assert_eq!(rows.len(), self.len * width, "hidden rows of every slot");
        self.hidden = Some(HiddenRows {
            features,
            width,
            rows,
        });
        self
    }

    /// The hidden states of every slot, where they were kept.
    pub fn hidden(&self) -> Option<&HiddenRows> {
        self.hidden.as_ref()
    }

    /// Each layer's K and V of the positions it holds ([`KvCheckpoint::firsts`]), `kv_dim` values per position.
    pub fn layers(&self) -> &[(Vec<f32>, Vec<f32>)] {
        &self.layers
    }

    /// Committed slots it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of its K/V and hidden states.
    pub fn bytes(&self) -> usize {
        let kv: usize = self
            .layers
            .iter()
            .map(|(k, v)| (k.len() + v.len()) * 4)
            .sum();
        let states: usize = self.recurrent.iter().flatten().map(|s| s.len() * 4).sum();
        kv + states + self.hidden.as_ref().map_or(0, |h| h.rows.len() * 4)
    }

    /// Tests: `layers` layers of `len` slots whose values start at `seed` (seeds tell checkpoints apart).
    #[cfg(test)]
    pub(crate) fn synthetic(len: usize, kv_dim: usize, layers: usize, seed: f32) -> Self {
        let layer = |l: usize| -> Vec<f32> {
            (0..len * kv_dim)
                .map(|i| seed + (l * 100 + i) as f32 * 0.25)
                .collect()
        };
        let firsts = vec![0; layers];
        let layers = (0..layers)
            .map(|l| (layer(2 * l), layer(2 * l + 1)))
            .collect();
        KvCheckpoint::from_parts(len, kv_dim, firsts, layers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    /// Gemma 3 270M's layout (18 layers, 15 local of a 512 window, one KV head of 256) filled to 8,192 tokens in
    /// prefill chunks of 64: the global layers hold every position, the local ones a ring of 768.
    #[test]
    fn local_layers_hold_a_ring_of_their_window_at_any_context() {
        let be = CpuBackend::new(1).unwrap();
        let shape = CacheShape {
            n_layers: 18,
            n_heads: 4,
            n_kv_heads: 1,
            head_dim: 256,
        };
        let windows: Vec<Option<usize>> =
            (0..18).map(|l| ((l + 1) % 6 != 0).then_some(512)).collect();
        let mut rings = KvCache::with_windows(&be, shape, 32_768, windows);
        let mut whole = KvCache::new(&be, shape, 32_768);
        for cache in [&mut rings, &mut whole] {
            while cache.len() < 8192 {
                cache.reserve(&be, 64).unwrap();
                cache.advance(64);
            }
        }
        let per_slot = 2 * 256 * 4;
        assert_eq!(whole.bytes(), 18 * 8192 * per_slot);
        assert_eq!(rings.bytes(), (3 * 8192 + 15 * 768) * per_slot);
        assert_eq!(rings.truncate(8192 - 200), 8192 - 200);
        assert_eq!(
            rings.truncate(8192 - 400),
            0,
            "the ring no longer holds that window"
        );
    }

    #[test]
    fn bytes_holding_foretells_what_growing_the_cache_allocates() {
        let be = CpuBackend::new(1).unwrap();
        let shape = CacheShape {
            n_layers: 6,
            n_heads: 4,
            n_kv_heads: 1,
            head_dim: 64,
        };
        let windows: Vec<Option<usize>> = (0..6).map(|l| (l % 3 != 2).then_some(256)).collect();
        for mut cache in [
            KvCache::with_windows(&be, shape, 4096, windows),
            KvCache::new(&be, shape, 4096),
        ] {
            for len in [10, 64, 200, 1000, 3000, 4096] {
                let told = cache.bytes_holding(len, 64);
                while cache.len() < len {
                    let rows = (len - cache.len()).min(64);
                    cache.reserve(&be, rows).unwrap();
                    cache.advance(rows);
                }
                assert_eq!(cache.bytes(), told, "{len} positions");
            }
            assert_eq!(
                cache.bytes_holding(100_000, 64),
                cache.bytes(),
                "capped by the context"
            );
        }
    }

    #[test]
    fn keep_rows_moves_the_kept_path_down_and_drops_the_rest() {
        let be = CpuBackend::new(1).unwrap();
        let shape = CacheShape {
            n_layers: 2,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
        };
        // Every value says which layer, K or V, and slot it belongs to.
        let value = |l: usize, kv: usize, slot: usize, i: usize| {
            (l * 10_000 + kv * 1000 + slot * 10 + i) as f32
        };
        for kept in [
            vec![0, 1, 2, 3],          // the first-child line: nothing moves
            vec![0, 4, 5, 6, 7, 8, 9], // a run longer than its gap: moved in disjoint pieces
            vec![0, 2, 5, 6, 11],
            vec![0],
        ] {
            let mut cache = KvCache::new(&be, shape, 64);
            let (base, rows) = (3, 12);
            cache.reserve(&be, base + rows).unwrap();
            for l in 0..2 {
                for (kv, bufs) in [&mut cache.k, &mut cache.v].into_iter().enumerate() {
                    for slot in 0..base + rows {
                        for i in 0..4 {
                            bufs[l][slot * 4 + i] = value(l, kv, slot, i);
                        }
                    }
                }
            }
            cache.advance(base + rows);
            cache.keep_rows(&be, base, &kept);
            assert_eq!(cache.len(), base + kept.len());
            let want = |slot: usize| {
                if slot < base {
                    slot
                } else {
                    base + kept[slot - base]
                }
            };
            for l in 0..2 {
                for (kv, bufs) in [&cache.k, &cache.v].into_iter().enumerate() {
                    for slot in 0..cache.len() {
                        for i in 0..4 {
                            assert_eq!(
                                bufs[l][slot * 4 + i],
                                value(l, kv, want(slot), i),
                                "{kept:?} slot {slot}"
                            );
                        }
                    }
                }
            }
        }
    }
}
