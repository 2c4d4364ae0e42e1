//! Caches of model state: the per-layer KV cache of the target model (with the recurrent state of its
//! linear-attention layers), and the prefix cache of checkpoints (RAM radix tree, disk tier).

mod disk;
mod kv;
mod prefix;
mod recurrent;
mod temp_file;
mod tiers;

pub use disk::{CheckpointShape, DiskTier};
pub use kv::{CacheShape, KvCache, KvCheckpoint};
pub use prefix::PrefixCache;
pub use recurrent::Recurrent;
pub use tiers::PrefixTiers;
