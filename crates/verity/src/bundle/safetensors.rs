//! Safetensors shards of a Hugging Face / MLX bundle: the tensor directory read from each shard's header (by the
//! `safetensors` crate), with every byte range checked again here against the mapped file before use.
//!
//! Only what is physically there counts: a tensor is listed only if its shard exists, its header parses and its
//! byte range lies inside the file. Everything else is recorded in `rejected` with the reason, so that a missing
//! tensor is explained (and an optional part such as an MTP head in a damaged shard simply is not there) instead
//! of one bad shard making the whole bundle unreadable.

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
    I32,
    Other,
}

impl StDtype {
    fn from(d: Dtype) -> Self {
        match d {
            Dtype::F32 => StDtype::F32,
            Dtype::F16 => StDtype::F16,
            Dtype::BF16 => StDtype::BF16,
            Dtype::U32 => StDtype::U32,
            Dtype::I32 => StDtype::I32,
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
#[derive(Debug, Default)]
pub struct SafetensorsSet {
    pub shards: Vec<PathBuf>,
    files: Vec<MappedFile>,
    /// Tensors the bundle provides: physically present and, where an index exists, placed there by it.
    pub tensors: BTreeMap<String, StTensor>,
    /// Tensors physically present in an inspected shard but omitted from the index. They are not part of the
    /// model's weights, but an optional part (an MTP head) found here is still discovered.
    pub unindexed: BTreeMap<String, StTensor>,
    /// Names that were announced but are not usable, with the reason (missing shard, damaged header, bytes
    /// outside the file).
    pub rejected: BTreeMap<String, String>,
    /// Every shard's `__metadata__`, merged.
    pub metadata: BTreeMap<String, String>,
}

#[derive(serde::Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

/// One shard's header: the tensors whose bytes lie inside the image, the entries rejected (name, reason), and
/// the header's `__metadata__`.
#[derive(Debug, Default)]
pub struct ShardHeader {
    pub tensors: Vec<(String, StTensor)>,
    pub rejected: Vec<(String, String)>,
    pub metadata: BTreeMap<String, String>,
}

/// The tensor directory of one safetensors image, every byte range checked against the image. An unreadable
/// header is an error; an entry whose range overflows or leaves the image is rejected alone. Public for fuzzing:
/// it must never panic or allocate without bound.
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<ShardHeader> {
    let (header_len, meta) = SafeTensors::read_metadata(bytes)
        .map_err(|e| Error::malformed(path, format!("invalid safetensors header: {e}")))?;
    let data_start = 8usize
        .checked_add(header_len)
        .ok_or_else(|| Error::malformed(path, "header length overflows"))?;
    let mut out = ShardHeader::default();
    if let Some(m) = meta.metadata() {
        out.metadata = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    }
    for (tname, info) in meta.tensors() {
        let (s, e) = info.data_offsets;
        let range = data_start
            .checked_add(s)
            .zip(data_start.checked_add(e))
            .filter(|(a, b)| a <= b && *b <= bytes.len());
        let Some(range) = range else {
            out.rejected.push((
                tname,
                format!(
                    "{}: data [{s}, {e}) lies outside the file ({} bytes)",
                    path.display(),
                    bytes.len()
                ),
            ));
            continue;
        };
        out.tensors.push((
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
    /// `*.safetensors` file. A tensor the index names counts only if its shard really holds it. A shard that is
    /// missing or whose header cannot be read is skipped (its tensors land in `rejected`); the bundle fails only
    /// if no shard can be read at all.
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

        let mut set = SafetensorsSet::default();
        let mut first_error = None;
        for name in &shard_names {
            let path = dir.join(name);
            let header = MappedFile::open(&path).and_then(|f| {
                let h = parse_header(&path, f.bytes())?;
                Ok((f, h))
            });
            let (file, header) = match header {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!("skipping shard: {e}");
                    if let Some(index) = &index {
                        for (t, s) in &index.weight_map {
                            if s == name {
                                set.rejected.insert(t.clone(), e.to_string());
                            }
                        }
                    }
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            let si = set.files.len();
            for (tname, mut t) in header.tensors {
                t.shard = si;
                let placed = match &index {
                    Some(index) => index.weight_map.get(&tname).map(String::as_str) == Some(name),
                    None => true,
                };
                if placed {
                    set.tensors.insert(tname, t);
                } else {
                    set.unindexed.insert(tname, t);
                }
            }
            set.rejected.extend(header.rejected);
            set.metadata.extend(header.metadata);
            set.shards.push(path);
            set.files.push(file);
        }
        if set.files.is_empty() {
            return Err(first_error.expect("at least one shard was tried"));
        }
        if let Some(index) = &index {
            for (tname, shard) in &index.weight_map {
                if !set.tensors.contains_key(tname) && !set.rejected.contains_key(tname) {
                    tracing::warn!("index names {tname} in {shard}, but that shard lacks it; ignoring the entry");
                    set.rejected.insert(
                        tname.clone(),
                        format!("the index places it in {shard}, which does not hold it"),
                    );
                }
            }
        }
        Ok(set)
    }

    /// One standalone safetensors file (an optional side file such as an MTP head), read like a shard.
    pub fn open_file(path: &Path) -> Result<Self> {
        let file = MappedFile::open(path)?;
        let header = parse_header(path, file.bytes())?;
        Ok(SafetensorsSet {
            shards: vec![path.to_path_buf()],
            files: vec![file],
            tensors: header.tensors.into_iter().collect(),
            unindexed: BTreeMap::new(),
            rejected: header.rejected.into_iter().collect(),
            metadata: header.metadata,
        })
    }

    /// The physically present tensors (indexed or not) that `keep` selects, as a set of their own over the same
    /// mapped files.
    pub fn physical_subset(&self, keep: impl Fn(&str) -> bool) -> SafetensorsSet {
        let pick = |m: &BTreeMap<String, StTensor>| -> Vec<(String, StTensor)> {
            m.iter()
                .filter(|(n, _)| keep(n))
                .map(|(n, t)| (n.clone(), t.clone()))
                .collect()
        };
        let mut tensors: BTreeMap<String, StTensor> = pick(&self.unindexed).into_iter().collect();
        tensors.extend(pick(&self.tensors));
        SafetensorsSet {
            shards: self.shards.clone(),
            files: self.files.clone(),
            tensors,
            unindexed: BTreeMap::new(),
            rejected: BTreeMap::new(),
            metadata: self.metadata.clone(),
        }
    }

    /// Why a tensor is not available: the recorded rejection, or "missing".
    pub fn why_missing(&self, name: &str) -> String {
        match self.rejected.get(name) {
            Some(r) => format!("missing or damaged: {r}"),
            None => "missing from the safetensors shards".into(),
        }
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
