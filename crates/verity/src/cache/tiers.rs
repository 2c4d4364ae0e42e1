//! The prefix cache's two tiers behind one lookup: checkpoints in RAM ([`PrefixCache`]) and on disk
//! ([`DiskTier`]). A store goes to both; a restore takes the longest valid prefix from either, and a checkpoint
//! read from disk is kept in RAM for the next turn.

use super::{DiskTier, KvCheckpoint, PrefixCache};
use crate::error::Result;

pub struct PrefixTiers {
    ram: PrefixCache<KvCheckpoint>,
    disk: Option<DiskTier>,
}

impl Default for PrefixTiers {
    /// Both tiers off.
    fn default() -> Self {
        PrefixTiers {
            ram: PrefixCache::new(0),
            disk: None,
        }
    }
}

impl PrefixTiers {
    /// Keep checkpoints up to `bytes` in RAM (0 turns the RAM tier off and drops what it holds).
    pub fn set_ram_budget(&mut self, bytes: usize) {
        self.ram = PrefixCache::new(bytes);
    }

    pub fn set_disk(&mut self, disk: Option<DiskTier>) {
        self.disk = disk;
    }

    pub fn disk(&self) -> Option<&DiskTier> {
        self.disk.as_ref()
    }

    /// Whether either tier keeps checkpoints.
    pub fn enabled(&self) -> bool {
        self.ram.budget() > 0 || self.disk.is_some()
    }

    /// Drop every checkpoint, in RAM and on disk.
    pub fn clear(&mut self) {
        self.ram.clear();
        if let Some(d) = self.disk.as_mut() {
            d.clear();
        }
    }

    /// Keep `ckpt` as the state after `tokens`, in both tiers.
    pub fn store(&mut self, tokens: &[u32], ckpt: KvCheckpoint) {
        if let Some(d) = self.disk.as_mut() {
            d.store(tokens, &ckpt);
        }
        let bytes = ckpt.bytes();
        self.ram.insert(tokens, ckpt, bytes);
    }

    /// Hand the longest checkpoint of a prefix of `tokens` longer than `beyond` tokens to `restore`, from
    /// whichever tier holds the longer one; returns its length, or `None` when neither holds one that long.
    pub fn restore_longest(
        &mut self,
        tokens: &[u32],
        beyond: usize,
        restore: impl FnOnce(&KvCheckpoint) -> Result<()>,
    ) -> Result<Option<usize>> {
        let in_ram = self.ram.longest(tokens).map_or(0, |(m, _)| m);
        let on_disk = self.disk.as_ref().map_or(0, |d| d.best_len(tokens));
        if on_disk > in_ram.max(beyond) {
            // The index says the disk holds more; the file may still read back invalid (then it is removed).
            if let Some((m, ckpt)) = self.disk.as_mut().and_then(|d| d.longest(tokens)) {
                if m > in_ram.max(beyond) {
                    restore(&ckpt)?;
                    let bytes = ckpt.bytes();
                    self.ram.insert(&tokens[..m], ckpt, bytes);
                    return Ok(Some(m));
                }
            }
        }
        match self.ram.longest(tokens) {
            Some((m, ckpt)) if m > beyond => {
                restore(ckpt)?;
                Ok(Some(m))
            }
            _ => Ok(None),
        }
    }
}
