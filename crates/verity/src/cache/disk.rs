//! The disk tier of the prefix cache: checkpoints persisted under a folder per model, surviving restarts.
//!
//! Crash safety: a checkpoint is written to a temporary file, fsynced, and renamed into place, so a file with the
//! final name is complete; leftover temporary files are deleted at open. Trust nothing read back: the header
//! must carry this model's fingerprint, the shapes must match the model, the data length must match the header,
//! and the checksum must match the data — anything else is deleted and skipped, and the request simply prefills.
//! Every I/O failure while storing (disk full, read-only folder) is a warning; generation is unaffected.
//!
//! File layout: `VRTYKV01`, a little-endian u32 header length, a JSON header (fingerprint, token ids, fill, shapes,
//! checksum), then each layer's K and V as little-endian f32. Written by hand because no crate stores this.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::KvCheckpoint;

const MAGIC: &[u8; 8] = b"VRTYKV01";
const EXT: &str = "vkv";
/// Headers larger than this are not ours (a million token ids is ~8 MB of JSON).
const MAX_HEADER: u32 = 16 << 20;
/// A temporary file older than this is a store whose process died (a store takes milliseconds); younger ones may
/// belong to another process sharing the folder and are left alone.
const STALE_STORE: std::time::Duration = std::time::Duration::from_secs(600);

/// FNV-1a, 64 bit: a stable checksum and fingerprint (std's hasher is not stable across releases).
pub fn fnv1a(bytes: &[u8], seed: u64) -> u64 {
    let mut h = seed ^ 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[derive(Serialize, Deserialize)]
struct Header {
    fingerprint: String,
    /// Element type of the data (only "f32" so far).
    dtype: String,
    tokens: Vec<u32>,
    len: usize,
    kv_dim: usize,
    n_layers: usize,
    data_bytes: u64,
    checksum: String,
}

struct Entry {
    path: PathBuf,
    tokens: Vec<u32>,
    bytes: u64,
    used: SystemTime,
}

pub struct DiskTier {
    dir: PathBuf,
    fingerprint: String,
    quota: u64,
    n_layers: usize,
    kv_dim: usize,
    entries: Vec<Entry>,
}

impl DiskTier {
    /// Open (creating) the folder for one model; unreadable or foreign files are removed. Returns `None` (with
    /// a warning) when the folder cannot be used at all.
    pub fn open(
        root: &Path,
        fingerprint: u64,
        n_layers: usize,
        kv_dim: usize,
        quota: u64,
    ) -> Option<Self> {
        let fingerprint = format!("{fingerprint:016x}");
        let dir = root.join(&fingerprint);
        if let Err(e) = std::fs::create_dir_all(&dir) {
            tracing::warn!(
                "prefix cache folder {}: {e}; the disk tier is off",
                dir.display()
            );
            return None;
        }
        let mut tier = DiskTier {
            dir,
            fingerprint,
            quota,
            n_layers,
            kv_dim,
            entries: Vec::new(),
        };
        let Ok(listing) = std::fs::read_dir(&tier.dir) else {
            return None;
        };
        for e in listing.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(".tmp-") {
                // A store that never finished, unless it is another live process's store in progress.
                let age = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok());
                if age.is_some_and(|a| a > STALE_STORE) {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            if path.extension().is_none_or(|x| x != EXT) {
                continue;
            }
            match tier.read_header(&path) {
                Some((h, _)) => tier.entries.push(Entry {
                    path,
                    tokens: h.tokens,
                    bytes: e.metadata().map_or(0, |m| m.len()),
                    used: e
                        .metadata()
                        .and_then(|m| m.modified())
                        .unwrap_or(SystemTime::UNIX_EPOCH),
                }),
                None => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        Some(tier)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `(token count, bytes, path)` of every stored checkpoint.
    pub fn list(&self) -> Vec<(usize, u64, PathBuf)> {
        self.entries
            .iter()
            .map(|e| (e.tokens.len(), e.bytes, e.path.clone()))
            .collect()
    }

    pub fn clear(&mut self) {
        for e in self.entries.drain(..) {
            let _ = std::fs::remove_file(&e.path);
        }
    }

    /// Read and check a file's header; `None` if it is not a valid checkpoint of this model.
    fn read_header(&self, path: &Path) -> Option<(Header, u64)> {
        let mut f = std::fs::File::open(path).ok()?;
        let mut magic = [0u8; 8];
        f.read_exact(&mut magic).ok()?;
        if &magic != MAGIC {
            return None;
        }
        let mut len = [0u8; 4];
        f.read_exact(&mut len).ok()?;
        let len = u32::from_le_bytes(len);
        if len > MAX_HEADER {
            return None;
        }
        let mut buf = vec![0u8; len as usize];
        f.read_exact(&mut buf).ok()?;
        let h: Header = serde_json::from_slice(&buf).ok()?;
        let want = (h.len as u64)
            .checked_mul(h.kv_dim as u64)?
            .checked_mul(8)?
            .checked_mul(h.n_layers as u64)?;
        let file_len = f.metadata().ok()?.len();
        let ok = h.fingerprint == self.fingerprint
            && h.dtype == "f32"
            && h.n_layers == self.n_layers
            && h.kv_dim == self.kv_dim
            && h.tokens.len() == h.len
            && h.data_bytes == want
            && file_len == 12 + len as u64 + want;
        ok.then_some((h, 12 + len as u64))
    }

    /// Persist a checkpoint for `tokens`; failures are warnings.
    pub fn store(&mut self, tokens: &[u32], ckpt: &KvCheckpoint) {
        if let Err(e) = self.try_store(tokens, ckpt) {
            tracing::warn!(
                "prefix cache: cannot store a checkpoint in {}: {e}",
                self.dir.display()
            );
        }
    }

    fn try_store(&mut self, tokens: &[u32], ckpt: &KvCheckpoint) -> std::io::Result<()> {
        let mut data = Vec::with_capacity(ckpt.bytes());
        for (k, v) in ckpt.layers() {
            for x in k.iter().chain(v.iter()) {
                data.extend_from_slice(&x.to_le_bytes());
            }
        }
        let header = Header {
            fingerprint: self.fingerprint.clone(),
            dtype: "f32".into(),
            tokens: tokens.to_vec(),
            len: ckpt.len(),
            kv_dim: self.kv_dim,
            n_layers: self.n_layers,
            data_bytes: data.len() as u64,
            checksum: format!("{:016x}", fnv1a(&data, 0)),
        };
        let header = serde_json::to_vec(&header).map_err(std::io::Error::other)?;
        let name = format!("{:016x}.{EXT}", fnv1a(bytemuck_u32(tokens), 1));
        let path = self.dir.join(&name);
        let tmp = self.dir.join(format!(".tmp-{}-{name}", std::process::id()));
        {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(MAGIC)?;
            f.write_all(&(header.len() as u32).to_le_bytes())?;
            f.write_all(&header)?;
            f.write_all(&data)?;
            f.sync_all()?;
        }
        if let Err(e) = std::fs::rename(&tmp, &path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        if let Ok(d) = std::fs::File::open(&self.dir) {
            let _ = d.sync_all(); // make the rename durable
        }
        self.entries.retain(|e| e.path != path);
        let bytes = 12 + header.len() as u64 + data.len() as u64;
        self.entries.push(Entry {
            path,
            tokens: tokens.to_vec(),
            bytes,
            used: SystemTime::now(),
        });
        self.enforce_quota();
        Ok(())
    }

    fn enforce_quota(&mut self) {
        while self.entries.iter().map(|e| e.bytes).sum::<u64>() > self.quota {
            let Some(i) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
            else {
                break;
            };
            let e = self.entries.remove(i);
            let _ = std::fs::remove_file(&e.path);
        }
    }

    /// Length of the longest stored prefix of `tokens`, without reading any file.
    pub fn best_len(&self, tokens: &[u32]) -> usize {
        self.entries
            .iter()
            .filter(|e| tokens.starts_with(&e.tokens))
            .map(|e| e.tokens.len())
            .max()
            .unwrap_or(0)
    }

    /// The longest stored prefix of `tokens` that reads back valid: its length and checkpoint. Invalid files
    /// met on the way are deleted.
    pub fn longest(&mut self, tokens: &[u32]) -> Option<(usize, KvCheckpoint)> {
        loop {
            let i = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| tokens.starts_with(&e.tokens) && !e.tokens.is_empty())
                .max_by_key(|(_, e)| e.tokens.len())
                .map(|(i, _)| i)?;
            match self.load(&self.entries[i].path) {
                Some(ckpt) if ckpt.len() == self.entries[i].tokens.len() => {
                    self.entries[i].used = SystemTime::now();
                    let n = self.entries[i].tokens.len();
                    return Some((n, ckpt));
                }
                _ => {
                    tracing::warn!(
                        "prefix cache: {} is corrupt; removed",
                        self.entries[i].path.display()
                    );
                    let e = self.entries.remove(i);
                    let _ = std::fs::remove_file(&e.path);
                }
            }
        }
    }

    fn load(&self, path: &Path) -> Option<KvCheckpoint> {
        let (h, start) = self.read_header(path)?;
        let bytes = std::fs::read(path).ok()?;
        let data = bytes.get(start as usize..)?;
        if data.len() as u64 != h.data_bytes || format!("{:016x}", fnv1a(data, 0)) != h.checksum {
            return None;
        }
        let per = h.len * h.kv_dim;
        let floats: Vec<f32> = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let layers = floats
            .chunks_exact(2 * per)
            .map(|l| (l[..per].to_vec(), l[per..].to_vec()))
            .collect();
        Some(KvCheckpoint::from_parts(h.len, h.kv_dim, layers))
    }
}

fn bytemuck_u32(t: &[u32]) -> &[u8] {
    // SAFETY: u32 has no padding and any byte pattern is a valid u8; the slice covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(t.as_ptr() as *const u8, std::mem::size_of_val(t)) }
}
