//! The per-layer key/value cache.
//!
//! Invariants: slots `0..len` hold the K/V of the committed tokens, in position order, and `len` is the fill
//! (never a logical position without rows behind it). A forward appends its rows at `len..len + W`; a speculative
//! cycle keeps a prefix of them with [`KvCache::truncate`]. Capacity grows by whole-buffer copies, never
//! silently drops rows.

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
    /// Changes whenever the buffers are reallocated (see [`buffer_set_id`]).
    buffers_id: u64,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache of `shape`, holding at most `max_capacity` slots.
    pub fn new(backend: &B, shape: CacheShape, max_capacity: usize) -> Self {
        let capacity = 256.min(max_capacity);
        let kv_dim = shape.n_kv_heads * shape.head_dim;
        KvCache {
            k: (0..shape.n_layers)
                .map(|_| backend.buffer(capacity * kv_dim))
                .collect(),
            v: (0..shape.n_layers)
                .map(|_| backend.buffer(capacity * kv_dim))
                .collect(),
            attn_work: Self::attention_work(backend, shape, capacity),
            shape,
            kv_dim,
            len: 0,
            capacity,
            max_capacity,
            buffers_id: buffer_set_id(),
        }
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

    /// Slots the buffers hold now (they grow up to [`KvCache::max_capacity`]).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn attention_work(backend: &B, shape: CacheShape, capacity: usize) -> B::Buffer {
        backend.buffer(backend.attention_work_len(shape.n_heads, shape.head_dim, capacity))
    }

    /// Identifies the current buffer allocation (it changes when the cache grows).
    pub(crate) fn buffers_id(&self) -> u64 {
        self.buffers_id
    }

    /// Make room for `extra` more slots after `len`.
    pub(crate) fn reserve(&mut self, backend: &B, extra: usize) -> Result<()> {
        let need = self.len + extra;
        if need > self.max_capacity {
            return Err(Error::Invalid(format!(
                "context full: {need} tokens exceed the context length {}",
                self.max_capacity
            )));
        }
        if need <= self.capacity {
            return Ok(());
        }
        let new_cap = need.next_power_of_two().min(self.max_capacity);
        for bufs in [&mut self.k, &mut self.v] {
            for buf in bufs.iter_mut() {
                let mut grown = backend.buffer(new_cap * self.kv_dim);
                backend.copy(buf, 0, &mut grown, 0, self.len * self.kv_dim);
                *buf = grown;
            }
        }
        self.attn_work = Self::attention_work(backend, self.shape, new_cap);
        self.capacity = new_cap;
        self.buffers_id = buffer_set_id();
        Ok(())
    }

    /// Mark `rows` appended slots as committed (called by the forward after writing them).
    pub(crate) fn advance(&mut self, rows: usize) {
        debug_assert!(self.len + rows <= self.capacity);
        self.len += rows;
    }

    /// A copy of the committed state, to restore later (the prefix cache stores these).
    pub fn checkpoint(&self, backend: &B) -> KvCheckpoint {
        let n = self.len * self.kv_dim;
        KvCheckpoint {
            len: self.len,
            kv_dim: self.kv_dim,
            layers: self
                .k
                .iter()
                .zip(&self.v)
                .map(|(k, v)| (backend.download(k, n), backend.download(v, n)))
                .collect(),
            hidden: None,
        }
    }

    /// Replace the committed state with a checkpoint taken from a cache of the same shape.
    pub fn restore(&mut self, backend: &B, ckpt: &KvCheckpoint) -> Result<()> {
        if ckpt.kv_dim != self.kv_dim || ckpt.layers.len() != self.k.len() {
            return Err(Error::Invalid("checkpoint of another model shape".into()));
        }
        self.len = 0;
        self.reserve(backend, ckpt.len)?;
        for ((k, v), (ck, cv)) in self.k.iter_mut().zip(self.v.iter_mut()).zip(&ckpt.layers) {
            let (ku, vu) = (backend.upload(ck), backend.upload(cv));
            backend.copy(&ku, 0, k, 0, ck.len());
            backend.copy(&vu, 0, v, 0, cv.len());
        }
        self.len = ckpt.len;
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
                for bufs in [&mut self.k, &mut self.v] {
                    for buf in bufs.iter_mut() {
                        backend.copy_down(buf, (src + moved) * d, (dst + moved) * d, n * d);
                    }
                }
                moved += n;
            }
            i += run;
        }
        self.len = self.len.min(base + rows.len());
    }

    /// Roll back to the first `len` slots (a rejected speculative suffix, or a new conversation sharing a prefix).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// The committed K/V of every layer at some fill, held in host memory.
#[derive(Debug, Clone)]
pub struct KvCheckpoint {
    len: usize,
    kv_dim: usize,
    layers: Vec<(Vec<f32>, Vec<f32>)>,
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
    pub(crate) fn from_parts(len: usize, kv_dim: usize, layers: Vec<(Vec<f32>, Vec<f32>)>) -> Self {
        KvCheckpoint {
            len,
            kv_dim,
            layers,
            hidden: None,
        }
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

    /// Each layer's K and V, `len × kv_dim` values each.
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
        kv + self.hidden.as_ref().map_or(0, |h| h.rows.len() * 4)
    }

    /// Tests: `layers` layers of `len` slots whose values start at `seed` (seeds tell checkpoints apart).
    #[cfg(test)]
    pub(crate) fn synthetic(len: usize, kv_dim: usize, layers: usize, seed: f32) -> Self {
        let layer = |l: usize| -> Vec<f32> {
            (0..len * kv_dim)
                .map(|i| seed + (l * 100 + i) as f32 * 0.25)
                .collect()
        };
        let layers = (0..layers)
            .map(|l| (layer(2 * l), layer(2 * l + 1)))
            .collect();
        KvCheckpoint::from_parts(len, kv_dim, layers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

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
