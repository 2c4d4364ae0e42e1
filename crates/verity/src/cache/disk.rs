//! The disk tier of the prefix cache: checkpoints persisted under a folder per model and numerics, surviving
//! restarts.
//!
//! What must hold: a checkpoint is restored only for exactly the token sequence it was taken after, by the same
//! weights computing with the same numerics. So the folder is named by the model's fingerprint (its headers and a
//! sample of its weights, [`crate::bundle::Bundle::fingerprint`]) combined with the backend's numerics
//! ([`crate::backend::Backend::numerics`]), and both are repeated in every header; a file's name is the hash of
//! the tokens its header holds; and one checksum covers the whole file, header and payload, so a flipped bit
//! anywhere, or a payload moved from another file with its checksum, is rejected. Anything that fails a check
//! is deleted and skipped, and the request simply prefills.
//!
//! Crash safety: a checkpoint is written to a temporary file, fsynced, and renamed into place, so a file with the
//! final name is complete. A temporary file is removed on every error path of a store; at open, those of
//! processes that no longer exist are removed whatever their age. Temporary files count in the quota while they
//! exist. Files are private to their owner (0600, folders 0700): they hold conversations' token ids. Every I/O
//! failure while storing (disk full, read-only folder) is a warning; generation is unaffected.
//!
//! The checksum guards against damage and misfiling, not against someone who can write the folder: such a
//! person can write any file. It is XXH3-128, which runs at memory speed (FNV-1a, the checksum of `VRTYKV01`,
//! took ~40 % of a store and of a restore).
//!
//! File layout (`VRTYKV06`): the magic, a little-endian u32 header length, a JSON header (model fingerprint,
//! numerics, token ids, shapes, each layer's first position held — a local attention layer keeps its last
//! window only, a recurrent layer none —, each layer's recurrent state length, which target states it holds),
//! each layer's K and V of its positions as little-endian f32, each recurrent layer's state (f32), then, where
//! the checkpoint kept them, the target's states of every position that the route's proposer conditions on
//! (f32, `hidden` wide: an MTP head's final states, or a block drafter's layers, as `features` names them),
//! then the XXH3-128 of all the bytes before it, little-endian. Written by hand because no crate stores this.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64, xxh3_64_with_seed};

use super::temp_file::{temp_in_progress, TempFile, TEMP_PREFIX};
use super::KvCheckpoint;
use crate::model::TargetFeatures;

const MAGIC: &[u8; 8] = b"VRTYKV06";
const EXT: &str = "vkv";
/// The magic and the header length.
const PREFIX: usize = 12;
/// The trailing checksum.
const CHECKSUM: usize = 16;
/// Headers larger than this are not ours (a million token ids is ~8 MB of JSON).
const MAX_HEADER: u32 = 16 << 20;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    /// The model's fingerprint, hex.
    model: String,
    /// The backend's numerics ([`crate::backend::Backend::numerics`]).
    numerics: String,
    /// Element type of the data (only "f32" so far).
    dtype: String,
    tokens: Vec<u32>,
    kv_dim: usize,
    n_layers: usize,
    /// Per layer, the first position its K/V hold (the rest from there to the last token).
    firsts: Vec<usize>,
    /// Per layer, the values of its recurrent state (0: an attention layer).
    states: Vec<usize>,
    /// Width of the hidden states after the K/V, 0 when there are none.
    hidden: usize,
    /// Which target states they are ([`TargetFeatures::tag`]; empty when there are none).
    features: String,
    data_bytes: u64,
}

/// Why a file is not a checkpoint this tier may restore.
#[derive(Debug, thiserror::Error)]
enum Rejected {
    #[error("cannot read it: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a {} checkpoint", String::from_utf8_lossy(MAGIC))]
    Magic,
    #[error("malformed header: {0}")]
    Header(String),
    #[error("the checksum does not match the file")]
    Checksum,
    #[error("written for another model or other numerics")]
    Foreign,
    #[error("shapes or lengths do not match: {0}")]
    Shape(String),
    #[error("its name is not the hash of its tokens")]
    Name,
    #[error("it holds other tokens than listed at open")]
    Changed,
}

struct Entry {
    path: PathBuf,
    tokens: Vec<u32>,
    bytes: u64,
    used: SystemTime,
}

/// The shape of a model's checkpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointShape {
    pub n_layers: usize,
    pub kv_dim: usize,
    /// The model's hidden size: the target states a checkpoint holds are a whole number of these wide.
    pub hidden: usize,
    /// Per layer, the values of its recurrent state (0: an attention layer).
    pub states: Vec<usize>,
}

pub struct DiskTier {
    dir: PathBuf,
    model: String,
    numerics: String,
    quota: u64,
    shape: CheckpointShape,
    entries: Vec<Entry>,
    /// Tests: fail every store's write after this many bytes (a full disk).
    #[cfg(test)]
    fail_writes_after: Option<usize>,
}

/// The file name of the checkpoint for `tokens`.
fn file_name(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    format!("{:016x}.{EXT}", xxh3_64(&bytes))
}

/// The folder of a model's checkpoints under a given numerics.
fn folder_name(model: u64, numerics: &str) -> String {
    format!("{:016x}", xxh3_64_with_seed(numerics.as_bytes(), model))
}

/// Remove the checkpoints of earlier formats in every model's folder under `root`: their folders were named by
/// an earlier fingerprint, so no tier of this version opens them, and they would hold disk outside any quota.
/// Only files that carry an earlier `VRTYKV` magic, in folders named as tiers name them, are touched, and never
/// a temporary file (another process may be writing it).
fn remove_previous_formats(root: &Path) {
    let Ok(folders) = std::fs::read_dir(root) else {
        return;
    };
    let tier_folder = |name: &str| name.len() == 16 && name.bytes().all(|b| b.is_ascii_hexdigit());
    for folder in folders.flatten() {
        if !tier_folder(&folder.file_name().to_string_lossy()) {
            continue;
        }
        let Ok(files) = std::fs::read_dir(folder.path()) else {
            continue;
        };
        let mut removed = false;
        for f in files.flatten() {
            let path = f.path();
            // Temporary files are a live store's until its process ends ([`DiskTier::open`] decides).
            if path.extension().is_none_or(|x| x != EXT)
                || f.file_name().to_string_lossy().starts_with(TEMP_PREFIX)
            {
                continue;
            }
            let mut magic = [0u8; 8];
            let read = File::open(&path).and_then(|mut h| h.read_exact(&mut magic));
            if read.is_ok() && magic.starts_with(b"VRTYKV") && &magic != MAGIC {
                removed |= std::fs::remove_file(&path).is_ok();
            }
        }
        // A folder that only held old files (never a current tier's folder that is merely empty so far, which
        // another process may have just made).
        if removed {
            let _ = std::fs::remove_dir(folder.path());
        }
    }
}

/// Create `dir` (and missing parents) private to the owner.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir)?;
    // A folder made by an earlier version, or by hand, may be readable by others.
    #[cfg(unix)]
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    Ok(())
}

impl DiskTier {
    /// Open (creating) the folder of one model (fingerprint `model`) computing with `numerics`; files that are
    /// not valid checkpoints of it, and temporary files of stores that can no longer finish, are removed.
    /// Returns `None` (with a warning) when the folder cannot be used at all.
    pub fn open(
        root: &Path,
        model: u64,
        numerics: &str,
        shape: CheckpointShape,
        quota: u64,
    ) -> Option<Self> {
        // verity's version too: a release may change how a kernel rounds.
        let numerics = format!("verity {} {numerics}", env!("CARGO_PKG_VERSION"));
        let dir = root.join(folder_name(model, &numerics));
        remove_previous_formats(root);
        if let Err(e) = create_private_dir(&dir) {
            tracing::warn!(
                "prefix cache folder {}: {e}; the disk tier is off",
                dir.display()
            );
            return None;
        }
        let mut tier = DiskTier {
            dir,
            model: format!("{model:016x}"),
            numerics,
            quota,
            shape,
            entries: Vec::new(),
            #[cfg(test)]
            fail_writes_after: None,
        };
        let listing = match std::fs::read_dir(&tier.dir) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(
                    "prefix cache folder {}: {e}; the disk tier is off",
                    tier.dir.display()
                );
                return None;
            }
        };
        for e in listing.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            let meta = e.metadata().ok();
            if name.starts_with(TEMP_PREFIX) {
                let modified = meta.as_ref().and_then(|m| m.modified().ok());
                if !temp_in_progress(&name, modified) {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            if path.extension().is_none_or(|x| x != EXT) {
                continue;
            }
            match tier.read_header(&path) {
                Ok(h) => tier.entries.push(Entry {
                    path,
                    tokens: h.tokens,
                    bytes: meta.as_ref().map_or(0, |m| m.len()),
                    used: meta
                        .and_then(|m| m.modified().ok())
                        .unwrap_or(SystemTime::UNIX_EPOCH),
                }),
                Err(why) => {
                    tracing::warn!("prefix cache: {} rejected ({why}); removed", path.display());
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        tier.make_room(0);
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

    /// Check a header (with the bytes before it, `bytes` starting at the magic) of the file at `path`, which is
    /// `file_len` bytes long; returns it and where the payload starts.
    fn check_header(
        &self,
        path: &Path,
        bytes: &[u8],
        file_len: u64,
    ) -> Result<(Header, usize), Rejected> {
        if bytes.get(..8) != Some(MAGIC) {
            return Err(Rejected::Magic);
        }
        let len = bytes
            .get(8..PREFIX)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
            .ok_or_else(|| Rejected::Header("no length".into()))?;
        if len > MAX_HEADER {
            return Err(Rejected::Header(format!("{len} bytes long")));
        }
        let start = PREFIX + len as usize;
        let json = bytes
            .get(PREFIX..start)
            .ok_or_else(|| Rejected::Header("shorter than its length".into()))?;
        let h: Header =
            serde_json::from_slice(json).map_err(|e| Rejected::Header(e.to_string()))?;
        if h.model != self.model || h.numerics != self.numerics {
            return Err(Rejected::Foreign);
        }
        let n = h.tokens.len() as u64;
        // Positions held by all layers together (each at most all of them).
        let held = h
            .firsts
            .iter()
            .try_fold(0u64, |sum, &f| sum.checked_add(n.checked_sub(f as u64)?));
        let state_values: u64 = h.states.iter().map(|&s| s as u64).sum();
        let want = held
            .and_then(|p| p.checked_mul(h.kv_dim as u64))
            .and_then(|b| b.checked_mul(8))
            .and_then(|b| b.checked_add(state_values.checked_mul(4)?))
            .and_then(|b| b.checked_add(n.checked_mul(h.hidden as u64)?.checked_mul(4)?));
        let features = TargetFeatures::from_tag(&h.features);
        let shape = &self.shape;
        let shapes_ok = h.dtype == "f32"
            && h.n_layers == shape.n_layers
            && h.firsts.len() == h.n_layers
            && h.states == shape.states
            && h.kv_dim == shape.kv_dim
            && features.is_some_and(|f| f.width(shape.hidden) == h.hidden)
            && h.kv_dim > 0
            && !h.tokens.is_empty()
            && want == Some(h.data_bytes)
            && Some(file_len) == (start as u64 + CHECKSUM as u64).checked_add(h.data_bytes);
        if !shapes_ok {
            return Err(Rejected::Shape(format!(
                "{} tokens, {} layers of {} {}, hidden states {:?} {} wide, {} data bytes in a file of {file_len}",
                h.tokens.len(),
                h.n_layers,
                h.kv_dim,
                h.dtype,
                h.features,
                h.hidden,
                h.data_bytes
            )));
        }
        if path.file_name().and_then(|n| n.to_str()) != Some(file_name(&h.tokens).as_str()) {
            return Err(Rejected::Name);
        }
        Ok((h, start))
    }

    /// Read and check a file's header (not its checksum: that needs the whole file, read when it is restored).
    fn read_header(&self, path: &Path) -> Result<Header, Rejected> {
        let mut f = File::open(path)?;
        let file_len = f.metadata()?.len();
        let mut bytes = vec![0u8; PREFIX];
        f.read_exact(&mut bytes)?;
        let len = u32::from_le_bytes(bytes[8..PREFIX].try_into().expect("4 bytes"));
        if &bytes[..8] == MAGIC && len <= MAX_HEADER {
            bytes.resize(PREFIX + len as usize, 0);
            f.read_exact(&mut bytes[PREFIX..])?;
        }
        self.check_header(path, &bytes, file_len).map(|(h, _)| h)
    }

    /// Read a whole file, check its checksum and header, and that it holds the checkpoint of exactly `tokens`.
    fn load(&self, path: &Path, tokens: &[u32]) -> Result<KvCheckpoint, Rejected> {
        let bytes = std::fs::read(path)?;
        let body_len = bytes
            .len()
            .checked_sub(CHECKSUM)
            .ok_or(Rejected::Checksum)?;
        let (body, sum) = bytes.split_at(body_len);
        if xxh3_128(body).to_le_bytes() != sum {
            return Err(Rejected::Checksum);
        }
        let (h, start) = self.check_header(path, body, bytes.len() as u64)?;
        if h.tokens != tokens {
            return Err(Rejected::Changed);
        }
        let floats = |bytes: &[u8]| -> Vec<f32> {
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let n = h.tokens.len();
        let mut at = start;
        let mut layers = Vec::with_capacity(h.n_layers);
        for &first in &h.firsts {
            let per = (n - first) * h.kv_dim * 4;
            let (k, v) = body[at..at + 2 * per].split_at(per);
            layers.push((floats(k), floats(v)));
            at += 2 * per;
        }
        let mut ckpt = KvCheckpoint::from_parts(n, h.kv_dim, h.firsts.clone(), layers);
        if h.states.iter().any(|&s| s > 0) {
            let mut states = Vec::with_capacity(h.n_layers);
            for &len in &h.states {
                states.push(floats(&body[at..at + len * 4]));
                at += len * 4;
            }
            ckpt = ckpt.with_recurrent(states);
        }
        let hidden = &body[at..];
        let features = TargetFeatures::from_tag(&h.features).expect("checked with the header");
        Ok(if h.hidden > 0 {
            ckpt.with_hidden(features, h.hidden, floats(hidden))
        } else {
            ckpt
        })
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

    /// The whole file of the checkpoint of `tokens`.
    fn encode(&self, tokens: &[u32], ckpt: &KvCheckpoint) -> std::io::Result<Vec<u8>> {
        if ckpt.len() != tokens.len() || tokens.is_empty() {
            return Err(std::io::Error::other(format!(
                "a checkpoint of {} slots for {} tokens",
                ckpt.len(),
                tokens.len()
            )));
        }
        let states: Vec<usize> = match ckpt.recurrent() {
            Some(states) => states.iter().map(Vec::len).collect(),
            None => vec![0; self.shape.n_layers],
        };
        if states != self.shape.states {
            return Err(std::io::Error::other(
                "a checkpoint whose recurrent states are not this model's",
            ));
        }
        let header = Header {
            model: self.model.clone(),
            numerics: self.numerics.clone(),
            dtype: "f32".into(),
            tokens: tokens.to_vec(),
            kv_dim: self.shape.kv_dim,
            n_layers: self.shape.n_layers,
            firsts: ckpt.firsts().to_vec(),
            states,
            hidden: ckpt.hidden().map_or(0, |h| h.width),
            features: ckpt.hidden().map_or(String::new(), |h| h.features.tag()),
            data_bytes: ckpt.bytes() as u64,
        };
        let header = serde_json::to_vec(&header).map_err(std::io::Error::other)?;
        let mut bytes = Vec::with_capacity(PREFIX + header.len() + ckpt.bytes() + CHECKSUM);
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&(header.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&header);
        for (k, v) in ckpt.layers() {
            for x in k.iter().chain(v.iter()) {
                bytes.extend_from_slice(&x.to_le_bytes());
            }
        }
        for x in ckpt.recurrent().into_iter().flatten().flatten() {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        for x in ckpt.hidden().map_or(&[][..], |h| &h.rows) {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        let sum = xxh3_128(&bytes);
        bytes.extend_from_slice(&sum.to_le_bytes());
        Ok(bytes)
    }

    fn try_store(&mut self, tokens: &[u32], ckpt: &KvCheckpoint) -> std::io::Result<()> {
        let bytes = self.encode(tokens, ckpt)?;
        // Room first: the temporary file counts in the quota while it exists.
        if !self.make_room(bytes.len() as u64) {
            return Err(std::io::Error::other(format!(
                "{} bytes do not fit in the quota of {}",
                bytes.len(),
                self.quota
            )));
        }
        let name = file_name(tokens);
        let path = self.dir.join(&name);
        let mut tmp = TempFile::create(&self.dir, &name)?;
        self.write(tmp.file(), &bytes)?;
        tmp.file().sync_all()?;
        tmp.persist(&path)?;
        if let Ok(d) = File::open(&self.dir) {
            let _ = d.sync_all(); // make the rename durable
        }
        self.entries.retain(|e| e.path != path);
        self.entries.push(Entry {
            path,
            tokens: tokens.to_vec(),
            bytes: bytes.len() as u64,
            used: SystemTime::now(),
        });
        Ok(())
    }

    fn write(&self, f: &mut File, bytes: &[u8]) -> std::io::Result<()> {
        #[cfg(test)]
        if let Some(n) = self.fail_writes_after {
            f.write_all(&bytes[..n.min(bytes.len())])?;
            return Err(std::io::Error::other("injected write error"));
        }
        f.write_all(bytes)
    }

    /// Bytes of the temporary files in the folder (stores in progress, here or in other processes).
    fn temp_bytes(&self) -> u64 {
        let Ok(listing) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        listing
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(TEMP_PREFIX))
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.len())
            .sum()
    }

    /// Evict the least recently used checkpoints until `incoming` more bytes fit in the quota beside the
    /// stored and temporary files; false if they cannot fit even with nothing stored.
    fn make_room(&mut self, incoming: u64) -> bool {
        let temp = self.temp_bytes();
        loop {
            let stored: u64 = self.entries.iter().map(|e| e.bytes).sum();
            if stored.saturating_add(temp).saturating_add(incoming) <= self.quota {
                return true;
            }
            let Some(i) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
            else {
                return false;
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
            let entry = &self.entries[i];
            match self.load(&entry.path, &entry.tokens) {
                Ok(ckpt) => {
                    self.entries[i].used = SystemTime::now();
                    return Some((ckpt.len(), ckpt));
                }
                Err(why) => {
                    tracing::warn!(
                        "prefix cache: {} rejected ({why}); removed",
                        entry.path.display()
                    );
                    let e = self.entries.remove(i);
                    let _ = std::fs::remove_file(&e.path);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAYERS: usize = 2;
    const KV_DIM: usize = 4;
    const HIDDEN: usize = 3;
    const MODEL: u64 = 7;
    const NUMERICS: &str = "cpu x86_64 Avx2 Q8 activations";

    /// A fresh folder for one test.
    fn scratch(test: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("verity-disk-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        root
    }

    fn checkpoint(len: usize, seed: f32) -> KvCheckpoint {
        KvCheckpoint::synthetic(len, KV_DIM, LAYERS, seed)
    }

    fn shape(hidden: usize) -> CheckpointShape {
        CheckpointShape {
            n_layers: LAYERS,
            kv_dim: KV_DIM,
            hidden,
            states: vec![0; LAYERS],
        }
    }

    fn open(root: &Path) -> DiskTier {
        DiskTier::open(root, MODEL, NUMERICS, shape(HIDDEN), 1 << 20).expect("usable folder")
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// Nothing in a freshly opened tier over `root` restores, and the folder holds no checkpoint any more.
    fn assert_nothing_restores(root: &Path, queries: &[&[u32]], what: &str) {
        let mut t = open(root);
        let listed: Vec<Vec<u32>> = t.entries.iter().map(|e| e.tokens.clone()).collect();
        for q in listed
            .iter()
            .map(Vec::as_slice)
            .chain(queries.iter().copied())
        {
            assert!(t.longest(q).is_none(), "{what}: restored for {q:?}");
        }
        assert!(
            files(t.dir()).iter().all(|n| !n.ends_with(".vkv")),
            "{what}: the rejected file is removed: {:?}",
            files(t.dir())
        );
    }

    #[test]
    fn recurrent_states_travel_with_their_checkpoint_and_other_state_shapes_are_rejected() {
        let root = scratch("recurrent");
        // Layer 1 is recurrent (5 values); its K/V positions are none.
        let states = |lens: Vec<usize>| CheckpointShape {
            states: lens,
            ..shape(HIDDEN)
        };
        let layers = vec![
            (
                (0..3 * KV_DIM).map(|i| i as f32).collect(),
                vec![0.5; 3 * KV_DIM],
            ),
            (Vec::new(), Vec::new()),
        ];
        let ckpt = KvCheckpoint::from_parts(3, KV_DIM, vec![0, 3], layers)
            .with_recurrent(vec![Vec::new(), vec![1.0, -2.0, 3.5, 0.0, 7.25]]);
        let mut t = DiskTier::open(&root, MODEL, NUMERICS, states(vec![0, 5]), 1 << 20).unwrap();
        t.store(&[1, 2, 3], &ckpt);
        let mut t = DiskTier::open(&root, MODEL, NUMERICS, states(vec![0, 5]), 1 << 20).unwrap();
        let (n, back) = t.longest(&[1, 2, 3]).expect("restored");
        assert_eq!(
            (n, back.layers(), back.recurrent()),
            (3, ckpt.layers(), ckpt.recurrent())
        );
        // A model whose layer keeps another state: not restored, removed.
        let mut other =
            DiskTier::open(&root, MODEL, NUMERICS, states(vec![0, 6]), 1 << 20).unwrap();
        assert!(other.longest(&[1, 2, 3]).is_none());
        assert!(files(other.dir()).is_empty());
        // A checkpoint without the states this tier's model keeps is not stored.
        other.store(&[4, 5], &checkpoint(2, 1.0));
        assert!(files(other.dir()).is_empty());
    }

    #[test]
    fn a_checkpoint_restores_after_a_reopen_for_exactly_its_tokens() {
        let root = scratch("roundtrip");
        let ckpt = checkpoint(3, 1.0);
        open(&root).store(&[1, 2, 3], &ckpt);
        let mut t = open(&root);
        let (n, back) = t.longest(&[1, 2, 3, 4]).expect("restored");
        assert_eq!((n, back.layers()), (3, ckpt.layers()));
        assert!(t.longest(&[1, 2]).is_none(), "a shorter query is no match");
        assert!(t.longest(&[1, 2, 4]).is_none());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn hidden_states_travel_with_their_checkpoint_and_a_foreign_width_is_rejected() {
        let root = scratch("hidden");
        let rows: Vec<f32> = (0..3 * HIDDEN).map(|i| i as f32 * 0.5 - 1.0).collect();
        let ckpt =
            checkpoint(3, 2.0).with_hidden(TargetFeatures::final_state(), HIDDEN, rows.clone());
        open(&root).store(&[4, 5, 6], &ckpt);
        let (_, back) = open(&root).longest(&[4, 5, 6]).expect("restored");
        assert_eq!(back.layers(), ckpt.layers());
        assert_eq!(back.hidden(), ckpt.hidden());
        // A block drafter's layers: twice as wide, and named.
        let layers = TargetFeatures::layers(vec![0, 2]);
        let wide: Vec<f32> = (0..2 * 2 * HIDDEN).map(|i| i as f32 * 0.25).collect();
        let ckpt2 = checkpoint(2, 3.0).with_hidden(layers, 2 * HIDDEN, wide);
        open(&root).store(&[7, 8], &ckpt2);
        let (_, back) = open(&root).longest(&[7, 8]).expect("restored");
        assert_eq!(back.hidden(), ckpt2.hidden());
        // The same files read by a tier of a model with another hidden size: not restored, removed.
        let mut other = DiskTier::open(&root, MODEL, NUMERICS, shape(HIDDEN + 1), 1 << 20).unwrap();
        assert!(other.longest(&[4, 5, 6]).is_none());
        assert!(other.longest(&[7, 8]).is_none());
        assert!(files(other.dir()).is_empty());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn every_single_bit_flip_of_a_checkpoint_is_rejected() {
        let root = scratch("bitflips");
        let tokens = [11, 12, 13];
        let mut t = open(&root);
        t.store(&tokens, &checkpoint(3, 0.5));
        let path = t.entries[0].path.clone();
        drop(t);
        let good = std::fs::read(&path).unwrap();
        let header_len = PREFIX + u32::from_le_bytes(good[8..PREFIX].try_into().unwrap()) as usize;
        assert!(
            header_len > PREFIX + 100,
            "a real header: {header_len} bytes"
        );
        // The whole file, header first: every bit of it.
        for bit in 0..good.len() * 8 {
            let mut bad = good.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            std::fs::write(&path, &bad).unwrap();
            let part = if bit / 8 < header_len {
                "header"
            } else {
                "payload"
            };
            assert_nothing_restores(
                &root,
                &[&tokens, &[11, 12, 13, 14]],
                &format!("{part} bit {bit}"),
            );
        }
        std::fs::write(&path, &good).unwrap();
        assert!(open(&root).longest(&tokens).is_some(), "the intact file");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_payload_moved_with_its_checksum_into_another_file_is_rejected() {
        let root = scratch("swap");
        let (a, b) = ([1, 2, 3], [4, 5, 6]);
        let mut t = open(&root);
        t.store(&a, &checkpoint(3, 1.0));
        t.store(&b, &checkpoint(3, 2.0));
        let (pa, pb) = (t.dir().join(file_name(&a)), t.dir().join(file_name(&b)));
        drop(t);
        let (fa, fb) = (std::fs::read(&pa).unwrap(), std::fs::read(&pb).unwrap());
        let payload =
            |f: &[u8]| PREFIX + u32::from_le_bytes(f[8..PREFIX].try_into().unwrap()) as usize;
        assert_eq!(fa.len(), fb.len());
        // a's header with b's payload and checksum.
        let mut crafted = fa[..payload(&fa)].to_vec();
        crafted.extend_from_slice(&fb[payload(&fb)..]);
        std::fs::write(&pa, &crafted).unwrap();
        let mut t = open(&root);
        assert!(t.longest(&a).is_none(), "a's tokens with b's data");
        assert!(!pa.exists(), "removed");
        let (n, back) = t.longest(&b).expect("b is intact");
        assert_eq!((n, back.layers()), (3, checkpoint(3, 2.0).layers()));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_file_renamed_to_another_token_hash_is_rejected() {
        let root = scratch("rename");
        let mut t = open(&root);
        t.store(&[1, 2, 3], &checkpoint(3, 1.0));
        let dir = t.dir().to_path_buf();
        drop(t);
        std::fs::rename(
            dir.join(file_name(&[1, 2, 3])),
            dir.join(file_name(&[1, 2])),
        )
        .unwrap();
        assert_nothing_restores(&root, &[&[1, 2, 3], &[1, 2]], "renamed");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn other_numerics_or_another_model_never_restore() {
        let root = scratch("numerics");
        let tokens = [1, 2, 3];
        let mut q8 = open(&root);
        q8.store(&tokens, &checkpoint(3, 1.0));
        let stored = q8.dir().join(file_name(&tokens));
        let others = [
            (MODEL, "cpu x86_64 Avx2 F32 activations"),
            (MODEL, "cpu x86_64 Scalar Q8 activations"),
            (MODEL + 1, NUMERICS),
        ];
        for (model, numerics) in others {
            let mut t = DiskTier::open(&root, model, numerics, shape(HIDDEN), 1 << 20).unwrap();
            assert_ne!(t.dir(), q8.dir(), "{model} {numerics}: a folder of its own");
            assert!(t.longest(&tokens).is_none());
            // Even a file copied into its folder is not restored.
            std::fs::copy(&stored, t.dir().join(file_name(&tokens))).unwrap();
            let mut t = DiskTier::open(&root, model, numerics, shape(HIDDEN), 1 << 20).unwrap();
            assert!(
                t.longest(&tokens).is_none(),
                "{model} {numerics}: copied file"
            );
            assert!(files(t.dir()).is_empty(), "{model} {numerics}: removed");
        }
        assert!(open(&root).longest(&tokens).is_some(), "its own numerics");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn files_of_the_previous_format_are_rejected_and_removed() {
        let root = scratch("oldformat");
        let mut t = open(&root);
        t.store(&[1, 2, 3], &checkpoint(3, 1.0));
        let path = t.dir().join(file_name(&[1, 2, 3]));
        drop(t);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[..8].copy_from_slice(b"VRTYKV02");
        std::fs::write(&path, bytes).unwrap();
        assert_nothing_restores(&root, &[&[1, 2, 3]], "VRTYKV02");
        // A live process's store in progress (process 1) is left alone, whatever its bytes say.
        let in_progress = path.with_file_name(".tmp-1-0-z.vkv");
        std::fs::write(&in_progress, b"VRTYKV02 partial").unwrap();
        // In the folder of an earlier fingerprint, which no tier opens any more: removed too, with the folder.
        let old_folder = root.join("00000000deadbeef");
        std::fs::create_dir_all(&old_folder).unwrap();
        std::fs::write(old_folder.join("0123.vkv"), b"VRTYKV01 and the rest").unwrap();
        // Another model's current checkpoints, and files that are not checkpoints, are left alone.
        let mut other = DiskTier::open(&root, MODEL + 1, NUMERICS, shape(HIDDEN), 1 << 20).unwrap();
        other.store(&[1, 2, 3], &checkpoint(3, 1.0));
        let foreign = root.join("not-a-tier");
        std::fs::create_dir_all(&foreign).unwrap();
        std::fs::write(foreign.join("x.vkv"), b"VRTYKV01").unwrap();
        open(&root);
        assert!(!old_folder.exists());
        assert!(other.longest(&[1, 2, 3]).is_some());
        assert!(foreign.join("x.vkv").exists());
        assert!(in_progress.exists());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_failed_store_leaves_no_temporary_file() {
        let root = scratch("failedstore");
        let mut t = open(&root);
        // A write error midway (a full disk): the partial temporary file is removed.
        t.fail_writes_after = Some(100);
        t.store(&[1, 2, 3], &checkpoint(3, 1.0));
        assert!(files(t.dir()).is_empty(), "{:?}", files(t.dir()));
        assert!(t.entries.is_empty());
        t.fail_writes_after = None;
        // The rename fails: a folder holds the final name.
        let blocker = t.dir().join(file_name(&[1, 2, 3]));
        std::fs::create_dir(&blocker).unwrap();
        std::fs::write(blocker.join("x"), b"x").unwrap();
        t.store(&[1, 2, 3], &checkpoint(3, 1.0));
        assert_eq!(files(t.dir()), [file_name(&[1, 2, 3])], "only the blocker");
        assert!(t.entries.is_empty());
        std::fs::remove_dir_all(&blocker).unwrap();
        // Larger than the quota: nothing is written.
        t.quota = 100;
        t.store(&[1, 2, 3], &checkpoint(3, 1.0));
        assert!(files(t.dir()).is_empty());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn temporary_files_are_removed_at_open_unless_their_process_lives_and_count_in_the_quota() {
        let root = scratch("temps");
        let t = open(&root);
        let dir = t.dir().to_path_buf();
        drop(t);
        // Above the kernel's largest process id: that process cannot exist. The file is young.
        let dead = format!("{TEMP_PREFIX}4194304-0-{}", file_name(&[1]));
        // Process 1 always exists: its store may be in progress.
        let live = format!("{TEMP_PREFIX}1-0-{}", file_name(&[2]));
        // This process's id but no store of it: left by an earlier process with the same id.
        let reused = format!(
            "{TEMP_PREFIX}{}-999999-{}",
            std::process::id(),
            file_name(&[3])
        );
        std::fs::write(dir.join(&dead), [0u8; 10]).unwrap();
        std::fs::write(dir.join(&live), [0u8; 1000]).unwrap();
        std::fs::write(dir.join(&reused), [0u8; 10]).unwrap();
        let mut t = open(&root);
        assert_eq!(files(&dir), std::slice::from_ref(&live));
        // The quota holds the live temporary file and one checkpoint, not two.
        let one = t.encode(&[5, 6, 7], &checkpoint(3, 1.0)).unwrap().len() as u64;
        t.quota = 1000 + one + one / 2;
        t.store(&[5, 6, 7], &checkpoint(3, 1.0));
        t.store(&[8, 9, 10], &checkpoint(3, 2.0));
        assert_eq!(t.list().len(), 1);
        assert!(t.longest(&[8, 9, 10]).is_some(), "the newer one stays");
        let on_disk: u64 = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.metadata().unwrap().len())
            .sum();
        assert!(on_disk <= t.quota, "{on_disk} > {}", t.quota);
        // No room beside the temporary file: nothing is stored.
        t.quota = 1000 + one - 1;
        t.store(&[5, 6, 7], &checkpoint(3, 1.0));
        assert!(t.longest(&[5, 6, 7]).is_none());
        assert_eq!(files(&dir), [live]);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn folders_and_files_are_private_to_their_owner() {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let root = scratch("modes");
        let mut t = open(&root.join("nested"));
        t.store(&[1, 2, 3], &checkpoint(3, 1.0));
        assert_eq!(mode(&root), 0o700, "a parent it created");
        assert_eq!(mode(t.dir()), 0o700);
        assert_eq!(mode(&t.dir().join(file_name(&[1, 2, 3]))), 0o600);
        // A folder left readable by an earlier version is closed at open.
        let dir = t.dir().to_path_buf();
        drop(t);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        open(&root.join("nested"));
        assert_eq!(mode(&dir), 0o700);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
