//! Caches of model state: the per-layer KV cache of the target model.

mod kv;

pub use kv::KvCache;
