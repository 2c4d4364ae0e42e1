//! Byte storage for weights: a window into a memory-mapped bundle file (the normal case: weights are never
//! copied into RAM a second time) or an owned buffer (weights verity had to convert).

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Error, Result};

/// A memory-mapped file, shared by every tensor that lives in it.
#[derive(Debug, Clone)]
pub struct MappedFile {
    map: Arc<Mmap>,
}

impl MappedFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the bundle is opened read-only; verity never writes into a user's bundle. Another process
        // truncating the file while it is mapped is outside what any mmap-based loader can defend against.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Ok(MappedFile { map: Arc::new(map) })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// A window of the file; the range must already be validated against `len()`.
    pub fn slice(&self, range: Range<usize>) -> Bytes {
        assert!(range.start <= range.end && range.end <= self.map.len());
        Bytes::Mapped {
            map: self.map.clone(),
            range,
        }
    }
}

/// Bytes of one tensor.
#[derive(Debug, Clone)]
pub enum Bytes {
    Mapped { map: Arc<Mmap>, range: Range<usize> },
    Owned(Arc<Vec<u8>>),
}

impl Bytes {
    pub fn owned(v: Vec<u8>) -> Self {
        Bytes::Owned(Arc::new(v))
    }

    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, range } => &map[range.clone()],
            Bytes::Owned(v) => v,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Bytes::Mapped { range, .. } => range.len(),
            Bytes::Owned(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// verity's cache folder (fetched models, the prefix cache's disk tier, compiled kernels): `$VERITY_CACHE_DIR`,
/// else `$XDG_CACHE_HOME/verity`, else `~/.cache/verity`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("VERITY_CACHE_DIR").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d).join("verity"));
    }
    match std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        Some(h) => Ok(PathBuf::from(h).join(".cache").join("verity")),
        None => Err(Error::Invalid(
            "no cache folder: set VERITY_CACHE_DIR or HOME".into(),
        )),
    }
}
