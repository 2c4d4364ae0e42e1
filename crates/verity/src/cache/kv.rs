//! The per-layer key/value cache.
//!
//! Invariants: slots `0..len` hold the K/V of the committed tokens, in position order, and `len` is the fill
//! (never a logical position without rows behind it). A forward appends its rows at `len..len + W`; a speculative
//! cycle keeps a prefix of them with [`KvCache::truncate`]. Capacity grows by whole-buffer copies, never
//! silently drops rows.

use crate::backend::{buffer_set_id, Backend};
use crate::error::{Error, Result};

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
}

impl KvCheckpoint {
    pub(crate) fn from_parts(len: usize, kv_dim: usize, layers: Vec<(Vec<f32>, Vec<f32>)>) -> Self {
        KvCheckpoint {
            len,
            kv_dim,
            layers,
        }
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

    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(k, v)| (k.len() + v.len()) * 4)
            .sum()
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
