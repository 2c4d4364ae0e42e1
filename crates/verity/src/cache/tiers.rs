//! The prefix cache's two tiers behind one lookup: checkpoints in RAM ([`PrefixCache`]) and on disk
//! ([`DiskTier`]). A store goes to both; a restore takes the longest valid prefix from either, and a checkpoint
//! read from disk is kept in RAM for the next turn.
//!
//! The disk tier stores off the request path: writing a checkpoint of a few MB and fsyncing it and its folder
//! took 12–34 ms per turn (BENCHMARKS.md, section 4), time the answer waited for. A store now hands the
//! checkpoint (shared with the RAM tier, not copied) to a writer thread and returns; the file appears when the
//! write is done, crash-safe as before (temporary file, fsync, rename). Until then the RAM tier holds the same
//! checkpoint, so a restore in the meantime loses nothing. Lookups and [`PrefixTiers::disk`] take the tier's
//! lock; `disk`, `clear` and dropping the tiers first wait for every queued store.

use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::{DiskTier, KvCheckpoint, PrefixCache};
use crate::error::Result;

pub struct PrefixTiers {
    ram: PrefixCache<Arc<KvCheckpoint>>,
    disk: Option<DiskWriter>,
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

    /// Use `disk` as the disk tier (replacing the current one once its queued stores have landed).
    pub fn set_disk(&mut self, disk: Option<DiskTier>) {
        self.disk = disk.and_then(DiskWriter::start);
    }

    /// The disk tier, once every store handed to it so far has landed.
    pub fn disk(&self) -> Option<MutexGuard<'_, DiskTier>> {
        self.disk.as_ref().map(|d| {
            d.flush();
            d.lock()
        })
    }

    /// The RAM tier's checkpoints and their bytes.
    pub fn ram_usage(&self) -> (usize, usize) {
        (self.ram.len(), self.ram.bytes())
    }

    /// Whether either tier keeps checkpoints.
    pub fn enabled(&self) -> bool {
        self.ram.budget() > 0 || self.disk.is_some()
    }

    /// Drop every checkpoint, in RAM and on disk (after the queued stores, which it removes too).
    /// Drop the RAM tier's checkpoints (the disk tier keeps its files).
    pub fn clear_ram(&mut self) {
        self.ram.clear();
    }

    pub fn clear(&mut self) {
        self.ram.clear();
        if let Some(mut d) = self.disk() {
            d.clear();
        }
    }

    /// Keep `ckpt` as the state after `tokens`, in both tiers; the disk write happens in the background.
    pub fn store(&mut self, tokens: &[u32], ckpt: KvCheckpoint) {
        let bytes = ckpt.bytes();
        let ckpt = Arc::new(ckpt);
        if let Some(d) = &self.disk {
            d.store(tokens.to_vec(), Arc::clone(&ckpt));
        }
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
        if let Some(disk) = &self.disk {
            let mut tier = disk.lock();
            // The index says the disk holds more; the file may still read back invalid (then it is removed).
            if tier.best_len(tokens) > in_ram.max(beyond) {
                if let Some((m, ckpt)) = tier.longest(tokens) {
                    drop(tier);
                    if m > in_ram.max(beyond) {
                        restore(&ckpt)?;
                        let bytes = ckpt.bytes();
                        self.ram.insert(&tokens[..m], Arc::new(ckpt), bytes);
                        return Ok(Some(m));
                    }
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

/// What the writer thread is asked to do, in order.
enum Job {
    Store(Vec<u32>, Arc<KvCheckpoint>),
    /// Answer once every job before this one is done.
    Flush(mpsc::SyncSender<()>),
}

/// A [`DiskTier`] and the thread that writes its stores.
struct DiskWriter {
    tier: Arc<Mutex<DiskTier>>,
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl DiskWriter {
    /// `None` (with a warning; the disk tier is then off) when no thread can be started.
    fn start(tier: DiskTier) -> Option<DiskWriter> {
        let tier = Arc::new(Mutex::new(tier));
        let (jobs, queue) = mpsc::channel::<Job>();
        let shared = Arc::clone(&tier);
        let spawned = std::thread::Builder::new()
            .name("verity-prefix-store".into())
            .spawn(move || {
                for job in queue {
                    match job {
                        Job::Store(tokens, ckpt) => {
                            lock(&shared).store(&tokens, &ckpt);
                        }
                        Job::Flush(done) => {
                            let _ = done.send(());
                        }
                    }
                }
            });
        match spawned {
            Ok(thread) => Some(DiskWriter {
                tier,
                jobs: Some(jobs),
                thread: Some(thread),
            }),
            Err(e) => {
                tracing::warn!("prefix cache: cannot start the disk writer ({e}); disk tier off");
                None
            }
        }
    }

    fn store(&self, tokens: Vec<u32>, ckpt: Arc<KvCheckpoint>) {
        if let Some(jobs) = &self.jobs {
            // The writer only stops when this is dropped; a send error means it died, and then the store is
            // lost like any failed store (RAM still holds the checkpoint).
            let _ = jobs.send(Job::Store(tokens, ckpt));
        }
    }

    /// Wait until every store queued so far has landed.
    fn flush(&self) {
        let (done, wait) = mpsc::sync_channel(1);
        if let Some(jobs) = &self.jobs {
            if jobs.send(Job::Flush(done)).is_ok() {
                let _ = wait.recv();
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, DiskTier> {
        lock(&self.tier)
    }
}

/// The tier's lock; a panic of the other holder left the tier as consistent as a crash would (every file is
/// whole or absent), so the guard is taken anyway.
fn lock(tier: &Mutex<DiskTier>) -> MutexGuard<'_, DiskTier> {
    tier.lock().unwrap_or_else(|e| e.into_inner())
}

impl Drop for DiskWriter {
    /// Queued stores finish before the tiers go (a server shutting down keeps its last turns).
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::CheckpointShape;
    use std::path::{Path, PathBuf};

    const LAYERS: usize = 2;
    const KV_DIM: usize = 4;

    fn scratch(test: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("verity-tiers-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        root
    }

    fn checkpoint(len: usize, seed: f32) -> KvCheckpoint {
        KvCheckpoint::synthetic(len, KV_DIM, LAYERS, seed)
    }

    fn open(root: &Path) -> DiskTier {
        let shape = CheckpointShape {
            n_layers: LAYERS,
            kv_dim: KV_DIM,
            hidden: 8,
            states: vec![0; LAYERS],
        };
        DiskTier::open(root, 7, "test numerics", shape, 1 << 20).expect("usable folder")
    }

    /// Each checkpoint's first K value, as restored (the seeds tell them apart).
    fn restored(tiers: &mut PrefixTiers, tokens: &[u32]) -> Option<(usize, f32)> {
        let mut first = None;
        let m = tiers
            .restore_longest(tokens, 0, |c| {
                first = Some(c.layers()[0].0[0]);
                Ok(())
            })
            .unwrap()?;
        Some((m, first.unwrap()))
    }

    /// Stores queued for the writer are on disk once the tier is asked for, survive the tiers being dropped
    /// right after a store, and restore what was stored, from RAM or from the files.
    #[test]
    fn background_stores_land_in_order_and_restore_from_either_tier() {
        let root = scratch("background");
        let mut tiers = PrefixTiers::default();
        tiers.set_ram_budget(1 << 20);
        tiers.set_disk(Some(open(&root)));
        for n in 1..=20u32 {
            let tokens: Vec<u32> = (0..n).collect();
            tiers.store(&tokens, checkpoint(n as usize, n as f32));
        }
        // From RAM at once, whatever the writer has done so far.
        let all: Vec<u32> = (0..25).collect();
        assert_eq!(restored(&mut tiers, &all), Some((20, 20.0)));
        assert_eq!(
            tiers.disk().unwrap().list().len(),
            20,
            "every queued store landed"
        );
        tiers.store(&(100..130).collect::<Vec<u32>>(), checkpoint(30, 100.0));
        drop(tiers);

        // A new process: only the files.
        let mut tiers = PrefixTiers::default();
        tiers.set_disk(Some(open(&root)));
        let long: Vec<u32> = (100..140).collect();
        assert_eq!(
            restored(&mut tiers, &long),
            Some((30, 100.0)),
            "the store queued before the drop"
        );
        assert_eq!(restored(&mut tiers, &all[..7]), Some((7, 7.0)));
        tiers.clear();
        assert!(tiers.disk().unwrap().list().is_empty());
        let _ = std::fs::remove_dir_all(&root);
    }
}
