//! Caches of model state: the per-layer KV cache of the target model, and the prefix cache of checkpoints.

mod kv;
mod prefix;

pub use kv::{KvCache, KvCheckpoint};
pub use prefix::PrefixCache;
