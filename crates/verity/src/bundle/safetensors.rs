//! Safetensors shards of a Hugging Face / MLX bundle: the tensor directory read from each shard's header (by the
//! `safetensors` crate, which validates offsets against the buffer), with every byte range checked again here
//! against the mapped file before use.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors};

use crate::error::{Error, Result};
use crate::storage::{Bytes, MappedFile};

/// The element type of a safetensors tensor, as far as verity reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StDtype {
    F32,
    F16,
    BF16,
    U32,
    Other,
}

impl StDtype {
    fn from(d: Dtype) -> Self {
        match d {
            Dtype::F32 => StDtype::F32,
            Dtype::F16 => StDtype::F16,
            Dtype::BF16 => StDtype::BF16,
            Dtype::U32 => StDtype::U32,
            _ => StDtype::Other,
        }
    }
}

/// One tensor in a shard.
#[derive(Debug, Clone)]
pub struct StTensor {
    pub dtype: StDtype,
    pub dtype_name: String,
    pub shape: Vec<usize>,
    pub shard: usize,
    pub range: std::ops::Range<usize>,
}

/// All tensors of a bundle, across its shards.
#[derive(Debug)]
pub struct SafetensorsSet {
    pub shards: Vec<PathBuf>,
    files: Vec<MappedFile>,
    pub tensors: BTreeMap<String, StTensor>,
}

#[derive(serde::Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

/// The tensor directory of one safetensors image, every byte range checked against the image. Public for
/// fuzzing: it must never panic or allocate without bound.
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<Vec<(String, StTensor)>> {
    let (header_len, meta) = SafeTensors::read_metadata(bytes)
        .map_err(|e| Error::malformed(path, format!("invalid safetensors header: {e}")))?;
    let data_start = 8usize
        .checked_add(header_len)
        .ok_or_else(|| Error::malformed(path, "header length overflows"))?;
    let mut out = Vec::new();
    for (tname, info) in meta.tensors() {
        let (s, e) = info.data_offsets;
        let range = data_start
            .checked_add(s)
            .zip(data_start.checked_add(e))
            .filter(|(a, b)| a <= b && *b <= bytes.len())
            .ok_or_else(|| {
                Error::malformed(
                    path,
                    format!("tensor {tname}: data [{s}, {e}) lies outside the file"),
                )
            })?;
        out.push((
            tname,
            StTensor {
                dtype: StDtype::from(info.dtype),
                dtype_name: format!("{:?}", info.dtype),
                shape: info.shape.clone(),
                shard: 0,
                range: range.0..range.1,
            },
        ));
    }
    Ok(out)
}

impl SafetensorsSet {
    /// Open the shards of a bundle folder: those named by `model.safetensors.index.json` if present, else every
    /// `*.safetensors` file. A tensor the index names counts only if its shard really holds it.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let (shard_names, index) = if index_path.exists() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let index: Index = serde_json::from_str(&text)
                .map_err(|e| Error::malformed(&index_path, format!("invalid index JSON: {e}")))?;
            let mut names: Vec<String> = index.weight_map.values().cloned().collect();
            names.sort();
            names.dedup();
            for n in &names {
                if n.contains('/') || n.contains('\\') || n == ".." {
                    return Err(Error::malformed(
                        &index_path,
                        format!("shard name {n:?} leaves the bundle folder"),
                    ));
                }
            }
            (names, Some(index))
        } else {
            let mut names = Vec::new();
            let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
            for entry in rd {
                let entry = entry.map_err(|e| Error::io(dir, e))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.ends_with(".safetensors") {
                    names.push(name);
                }
            }
            names.sort();
            (names, None)
        };
        if shard_names.is_empty() {
            return Err(Error::malformed(dir, "no .safetensors files in the bundle"));
        }

        let mut set = SafetensorsSet {
            shards: Vec::new(),
            files: Vec::new(),
            tensors: BTreeMap::new(),
        };
        for (si, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            let file = MappedFile::open(&path)?;
            for (tname, mut t) in parse_header(&path, file.bytes())? {
                if let Some(index) = &index {
                    if index.weight_map.get(&tname).map(String::as_str) != Some(name.as_str()) {
                        continue; // the index does not place it here; only index entries count
                    }
                }
                t.shard = si;
                set.tensors.insert(tname, t);
            }
            set.shards.push(path);
            set.files.push(file);
        }
        if let Some(index) = &index {
            for (tname, shard) in &index.weight_map {
                if !set.tensors.contains_key(tname) {
                    tracing::warn!("index names {tname} in {shard}, but that shard lacks it; ignoring the entry");
                }
            }
        }
        Ok(set)
    }

    pub fn get(&self, name: &str) -> Option<&StTensor> {
        self.tensors.get(name)
    }

    pub fn bytes(&self, t: &StTensor) -> Bytes {
        self.files[t.shard].slice(t.range.clone())
    }

    pub fn shard_path(&self, t: &StTensor) -> &Path {
        &self.shards[t.shard]
    }
}
