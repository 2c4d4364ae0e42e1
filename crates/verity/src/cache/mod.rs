//! Caches of model state: the per-layer KV cache of the target model, and the prefix cache of checkpoints
//! (RAM radix tree, disk tier).

mod disk;
mod kv;
mod prefix;
mod temp_file;
mod tiers;

pub use disk::DiskTier;
pub use kv::{CacheShape, KvCache, KvCheckpoint};
pub use prefix::PrefixCache;
pub use tiers::PrefixTiers;
