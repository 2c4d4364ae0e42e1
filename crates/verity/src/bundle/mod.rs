//! Model bundles: a GGUF file, or a folder of `config.json` + safetensors shards + tokenizer files.
//!
//! Opening a bundle reads headers only (weights stay memory-mapped); tensors are fetched by [`TensorKey`], so the
//! model code never sees a format's naming scheme.

pub mod drafter;
pub mod gguf;
pub mod gguf_writer;
pub mod hparams;
pub mod mtp;
mod names;
pub mod safetensors;

use std::path::{Path, PathBuf};

pub use drafter::{DrafterSpec, DrafterStatus};
pub use mtp::{MtpHeadSpec, MtpStatus};
pub use names::TensorKey;

use crate::error::{Error, Result};
use crate::quant::{GgmlType, MlxAffine, MlxScaleType, QMatrix};
use gguf::GgufFile;
use hparams::{HParams, HfConfig};
use safetensors::{SafetensorsSet, StDtype};

/// The on-disk form of a bundle.
#[derive(Debug)]
pub enum Source {
    Gguf(GgufFile),
    Safetensors {
        dir: PathBuf,
        config: Box<HfConfig>,
        tensors: SafetensorsSet,
        /// Where the decoder's tensors sit in the files (an image-text checkpoint nests them).
        layout: HfLayout,
    },
}

/// Where a safetensors bundle keeps the decoder's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfLayout {
    /// `model.layers.N…`, `model.embed_tokens`, `lm_head` (a causal LM).
    Plain,
    /// The text model of an image-text checkpoint, as Hugging Face publishes Gemma 3 4B and larger:
    /// `language_model.model.layers.N…`, `language_model.lm_head`.
    LanguageModel,
    /// The same as transformers 5 holds it: `model.language_model.layers.N…`, `lm_head`.
    ModelLanguageModel,
}

impl HfLayout {
    /// `name` (as a causal LM names it) where this layout keeps it.
    fn place(self, name: String) -> String {
        match self {
            HfLayout::Plain => name,
            HfLayout::LanguageModel => format!("language_model.{name}"),
            HfLayout::ModelLanguageModel => match name.strip_prefix("model.") {
                Some(rest) => format!("model.language_model.{rest}"),
                None => name,
            },
        }
    }
}

/// An opened model bundle.
#[derive(Debug)]
pub struct Bundle {
    pub path: PathBuf,
    pub source: Source,
    pub hparams: HParams,
    /// What the bundle offers for native MTP.
    pub mtp: MtpStatus,
    /// A complete head's tensors (from the main shards or the side file).
    mtp_tensors: Option<SafetensorsSet>,
    /// What the bundle folder offers as a block drafter ([`drafter::FOLDER`]).
    pub drafter: DrafterStatus,
    drafter_tensors: Option<SafetensorsSet>,
    /// The token an image row stands for in an image-text checkpoint (its `image_token_index`): what a model
    /// that embeds token ids reads at an image's rows, whose own inputs are the vision side's features.
    pub image_token: Option<u32>,
}

impl Bundle {
    /// Open a bundle: a `.gguf` file, a folder holding one `.gguf` file, or a safetensors folder.
    pub fn open(path: &Path) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        let mut image_token = None;
        let source = if meta.is_file() {
            Source::Gguf(GgufFile::open(path)?)
        } else if path.join("config.json").is_file() {
            let cfg_path = path.join("config.json");
            let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
            let value: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::malformed(&cfg_path, format!("invalid config.json: {e}")))?;
            image_token = ["image_token_index", "image_token_id"]
                .iter()
                .find_map(|k| value.get(*k))
                .and_then(serde_json::Value::as_u64)
                .and_then(|v| u32::try_from(v).ok());
            let (value, nested) = hparams::text_model_config(value);
            let config: HfConfig = serde_json::from_value(value)
                .map_err(|e| Error::malformed(&cfg_path, format!("invalid config.json: {e}")))?;
            let tensors = SafetensorsSet::open(path)?;
            // An image-text checkpoint keeps its text model under `language_model` (Gemma 3), or beside the
            // vision tower as a text-only one would (Qwen2.5-VL's `model.layers…`).
            let layout = if !nested || tensors.get("model.embed_tokens.weight").is_some() {
                HfLayout::Plain
            } else if tensors
                .get("model.language_model.embed_tokens.weight")
                .is_some()
            {
                HfLayout::ModelLanguageModel
            } else {
                HfLayout::LanguageModel
            };
            Source::Safetensors {
                dir: path.to_path_buf(),
                config: Box::new(config),
                tensors,
                layout,
            }
        } else {
            let ggufs: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| Error::io(path, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
                .collect();
            match ggufs.as_slice() {
                [one] => Source::Gguf(GgufFile::open(one)?),
                [] => {
                    return Err(Error::malformed(
                        path,
                        "not a bundle: no config.json and no .gguf file in this folder",
                    ))
                }
                _ => {
                    return Err(Error::malformed(
                        path,
                        "several .gguf files in this folder: name one",
                    ))
                }
            }
        };
        let hparams = match &source {
            Source::Gguf(g) => HParams::from_gguf(g)?,
            // A value out of range is the file's fault: name it.
            Source::Safetensors { dir, config, .. } => {
                HParams::from_hf(config).map_err(|e| match e {
                    Error::Invalid(m) => Error::malformed(dir.join("config.json"), m),
                    e => e,
                })?
            }
        };
        let (mtp, mtp_tensors) = find_mtp(path, meta.is_dir(), &source, &hparams);
        let (drafter, drafter_tensors) = if meta.is_dir() {
            drafter::inspect(path, &hparams)
        } else {
            (DrafterStatus::Absent, None)
        };
        Ok(Bundle {
            path: path.to_path_buf(),
            source,
            hparams,
            mtp,
            mtp_tensors,
            drafter,
            drafter_tensors,
            image_token,
        })
    }

    /// The tensors of the complete block drafter (`None` unless [`Bundle::drafter`] is complete).
    pub fn drafter_tensors(&self) -> Option<&SafetensorsSet> {
        self.drafter_tensors.as_ref()
    }

    /// The tensors of the complete MTP head (`None` unless [`Bundle::mtp`] is complete).
    pub fn mtp_tensors(&self) -> Option<&SafetensorsSet> {
        self.mtp_tensors.as_ref()
    }

    /// A stable fingerprint of the model's weights: the headers (metadata, config, tensor directory), a sample
    /// of every tensor's data (its first, middle and last bytes), and each file's size and modification time.
    /// Two bundles with the same fingerprint compute the same results, so cache checkpoints of one serve the
    /// other. The sample costs a few pages per tensor instead of a read of the weights; it catches a tensor
    /// changed at its start, middle or end, and the modification time a change elsewhere (made in place, or by
    /// a copy that does not keep the time).
    pub fn fingerprint(&self) -> u64 {
        let mut desc = Vec::new();
        let files: Vec<&Path> = match &self.source {
            Source::Gguf(g) => {
                let tensors: Vec<_> = g
                    .tensors
                    .iter()
                    .map(|t| (&t.name, &t.dims, t.ty.name(), &t.range))
                    .collect();
                desc.extend(
                    format!("gguf {:?} {:?} {}", g.metadata, tensors, g.file_len()).bytes(),
                );
                for t in &g.tensors {
                    sample_tensor(g.tensor_bytes(t).as_slice(), &mut desc);
                }
                vec![g.path.as_path()]
            }
            Source::Safetensors {
                config, tensors, ..
            } => {
                let ts: Vec<_> = tensors
                    .tensors
                    .iter()
                    .map(|(n, t)| (n, &t.dtype_name, &t.shape, &t.range))
                    .collect();
                desc.extend(format!("safetensors {config:?} {ts:?}").bytes());
                for t in tensors.tensors.values() {
                    sample_tensor(tensors.bytes(t).as_slice(), &mut desc);
                }
                tensors.shards.iter().map(PathBuf::as_path).collect()
            }
        };
        for f in files {
            let meta = std::fs::metadata(f).ok();
            let modified = meta
                .as_ref()
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            let len = meta.map_or(0, |m| m.len());
            // Not the path: a bundle moved or copied whole (keeping its times) keeps its checkpoints.
            desc.extend(format!(" {len} {modified}").bytes());
        }
        xxhash_rust::xxh3::xxh3_64(&desc)
    }

    /// The name of a tensor in this bundle's format.
    pub fn tensor_name(&self, key: TensorKey) -> String {
        match &self.source {
            Source::Gguf(_) => key.gguf_in(self.hparams.arch),
            Source::Safetensors { layout, .. } => layout.place(key.hf(self.hparams.arch)),
        }
    }

    pub fn has(&self, key: TensorKey) -> bool {
        match &self.source {
            Source::Gguf(g) => g.tensor(&key.gguf_in(self.hparams.arch)).is_some(),
            Source::Safetensors { tensors, .. } => tensors.get(&self.tensor_name(key)).is_some(),
        }
    }

    /// A weight matrix `[rows, cols]` (rows = outputs).
    pub fn matrix(&self, key: TensorKey, rows: usize, cols: usize) -> Result<QMatrix> {
        if self.hparams.block.attention_gate && matches!(key, TensorKey::Q(_) | TensorKey::QGate(_))
        {
            // The Q projection holds each head's queries then its gates: take one half of every head's rows.
            let both = self.stored_matrix(key, 2 * rows, cols)?;
            return both.select_rows(&key.gated_q_rows(self.hparams.head_dim, rows));
        }
        self.stored_matrix(key, rows, cols)
    }

    /// The matrix `key` as the bundle stores it, `[rows, cols]`.
    fn stored_matrix(&self, key: TensorKey, rows: usize, cols: usize) -> Result<QMatrix> {
        match &self.source {
            Source::Gguf(g) => {
                let name = key.gguf_in(self.hparams.arch);
                let t = g
                    .tensor(&name)
                    .ok_or_else(|| Error::tensor(&name, "missing from the GGUF file"))?;
                if let Some(e) = key.expert() {
                    // One expert's [rows, cols] matrix out of the stacked [experts, rows, cols] tensor.
                    if t.dims.len() != 3 || t.dims[0] != cols || t.dims[1] != rows || t.dims[2] <= e
                    {
                        return Err(Error::tensor(
                            &name,
                            format!(
                                "shape {:?} (GGML order), expected [{cols}, {rows}, > {e}]",
                                t.dims
                            ),
                        ));
                    }
                    let bytes = t.ty.row_bytes(cols).map_or(0, |b| b * rows);
                    let part = g.tensor_part(t, e * bytes..(e + 1) * bytes);
                    return QMatrix::ggml(&format!("{name}[{e}]"), t.ty, rows, cols, part);
                }
                // A one-row matrix may be stored as a vector (qwen3next's shared-expert gate).
                let one_row = rows == 1 && t.dims == [cols];
                if !one_row && (t.dims.len() != 2 || t.dims[0] != cols || t.dims[1] != rows) {
                    return Err(Error::tensor(
                        &name,
                        format!("shape {:?} (GGML order), expected [{cols}, {rows}]", t.dims),
                    ));
                }
                QMatrix::ggml(&name, t.ty, rows, cols, g.tensor_bytes(t))
            }
            Source::Safetensors {
                config,
                tensors,
                layout,
                ..
            } => st_matrix(
                tensors,
                Some(config),
                &layout.place(key.hf_module(self.hparams.arch)),
                &self.tensor_name(key),
                rows,
                cols,
            ),
        }
    }

    /// A 1-D tensor (norm weight, bias) of `len` values, converted to f32.
    pub fn vector(&self, key: TensorKey, len: usize) -> Result<Vec<f32>> {
        let mut v = self.values(key, &[len])?;
        // Checkpoints of models whose norms scale by 1 + w store w - 1; GGUF converters store w.
        if !self.is_gguf() && key.stored_minus_one(self.hparams.arch) {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(v)
    }

    /// A small tensor of any rank (a norm's weights, a convolution's taps), checked to be `shape` (a GGUF
    /// stores it with its dimensions reversed and those of 1 squeezed out), as f32 values in row-major order.
    pub fn values(&self, key: TensorKey, shape: &[usize]) -> Result<Vec<f32>> {
        match &self.source {
            Source::Safetensors { tensors, .. } => {
                st_values(tensors, &self.tensor_name(key), shape)
            }
            Source::Gguf(g) => {
                let name = key.gguf_in(self.hparams.arch);
                let t = g
                    .tensor(&name)
                    .ok_or_else(|| Error::tensor(&name, "missing from the GGUF file"))?;
                let want: Vec<usize> = shape.iter().rev().copied().filter(|&d| d != 1).collect();
                let have: Vec<usize> = t.dims.iter().copied().filter(|&d| d != 1).collect();
                if have != want {
                    return Err(Error::tensor(
                        &name,
                        format!(
                            "{} {:?} (GGML order), expected {want:?}",
                            t.ty.name(),
                            t.dims
                        ),
                    ));
                }
                let len = shape.iter().product();
                let m = QMatrix::ggml(&name, t.ty, 1, len, g.tensor_bytes(t))?;
                let mut out = vec![0.0; len];
                m.dequantize_row(0, &mut out);
                Ok(out)
            }
        }
    }

    /// Whether the bundle is a GGUF file.
    pub fn is_gguf(&self) -> bool {
        matches!(self.source, Source::Gguf(_))
    }

    pub fn format_name(&self) -> &'static str {
        match &self.source {
            Source::Gguf(_) => "gguf",
            Source::Safetensors { config, .. } if config.quantization.is_some() => {
                "mlx-safetensors"
            }
            Source::Safetensors { .. } => "safetensors",
        }
    }
}

/// Append the first, middle and last bytes of a tensor's data (all of it when it is short) to `out`.
fn sample_tensor(data: &[u8], out: &mut Vec<u8>) {
    const SAMPLE: usize = 64;
    if data.len() <= 3 * SAMPLE {
        out.extend_from_slice(data);
        return;
    }
    let mid = data.len() / 2 - SAMPLE / 2;
    out.extend_from_slice(&data[..SAMPLE]);
    out.extend_from_slice(&data[mid..mid + SAMPLE]);
    out.extend_from_slice(&data[data.len() - SAMPLE..]);
}

/// Look for an MTP head: in the main shards first, then in a side file of a bundle folder. A side file that
/// cannot be read makes the head incomplete, never the bundle unreadable.
fn find_mtp(
    path: &Path,
    is_dir: bool,
    source: &Source,
    hp: &HParams,
) -> (MtpStatus, Option<SafetensorsSet>) {
    let mut status = MtpStatus::Absent;
    let mut set = None;
    if let Source::Safetensors {
        config, tensors, ..
    } = source
    {
        let nextn = config
            .num_nextn_predict_layers
            .or(config.mtp_num_hidden_layers);
        let names = tensors.tensors.keys().chain(tensors.unindexed.keys());
        status = mtp::inspect(names.map(String::as_str), hp.n_layers, nextn);
        if let MtpStatus::Complete(spec) = &status {
            set = Some(tensors.physical_subset(|n| spec.owns(n)));
        }
    }
    let side = path.join(mtp::SIDE_FILE);
    let side_is_shard =
        matches!(source, Source::Safetensors { tensors, .. } if tensors.shards.contains(&side));
    if status == MtpStatus::Absent && is_dir && side.is_file() && !side_is_shard {
        match SafetensorsSet::open_file(&side) {
            Ok(side_set) => {
                let nextn = side_set
                    .metadata
                    .get("num_nextn_predict_layers")
                    .and_then(|v| v.parse().ok());
                status = mtp::inspect(
                    side_set.tensors.keys().map(String::as_str),
                    hp.n_layers,
                    nextn,
                );
                if let MtpStatus::Complete(spec) = &mut status {
                    spec.side_file = Some(side.clone());
                    set = Some(side_set);
                } else if status == MtpStatus::Absent {
                    status =
                        MtpStatus::Incomplete(format!("{} holds no MTP tensors", side.display()));
                }
            }
            Err(e) => status = MtpStatus::Incomplete(e.to_string()),
        }
    }
    (status, set)
}

/// A weight matrix `[rows, cols]` from a safetensors set: float, or MLX affine-quantized when `module.scales`
/// exists (the quantization read from `config`).
pub(crate) fn st_matrix(
    tensors: &SafetensorsSet,
    config: Option<&HfConfig>,
    module: &str,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<QMatrix> {
    let t = tensors
        .get(name)
        .ok_or_else(|| Error::tensor(name, tensors.why_missing(name)))?;
    if let Some(scales) = tensors.get(&format!("{module}.scales")) {
        let biases = tensors
            .get(&format!("{module}.biases"))
            .ok_or_else(|| Error::tensor(name, "MLX-quantized but has no .biases"))?;
        let (bits, group) = config.and_then(|c| mlx_params(c, module)).ok_or_else(|| {
            Error::tensor(name, "has .scales but config.json has no quantization")
        })?;
        if t.dtype != StDtype::U32 {
            return Err(Error::tensor(
                name,
                format!("MLX packed weight is {}, expected U32", t.dtype_name),
            ));
        }
        if scales.dtype != biases.dtype {
            return Err(Error::tensor(name, "scales and biases differ in dtype"));
        }
        let q = MlxAffine::new(bits, group, mlx_scale_type(name, scales.dtype)?)?;
        let want = [rows, cols * bits as usize / 32];
        if t.shape != want {
            return Err(Error::tensor(
                name,
                format!("packed shape {:?}, expected {want:?}", t.shape),
            ));
        }
        return QMatrix::mlx(
            name,
            q,
            rows,
            cols,
            tensors.bytes(t),
            tensors.bytes(scales),
            tensors.bytes(biases),
        );
    }
    if t.shape != [rows, cols] {
        return Err(Error::tensor(
            name,
            format!("shape {:?}, expected [{rows}, {cols}]", t.shape),
        ));
    }
    QMatrix::ggml(name, float_type(name, t)?, rows, cols, tensors.bytes(t))
}

/// A 1-D float tensor of `len` values from a safetensors set, converted to f32.
pub(crate) fn st_vector(tensors: &SafetensorsSet, name: &str, len: usize) -> Result<Vec<f32>> {
    st_values(tensors, name, &[len])
}

/// A float tensor of exactly `shape`, as f32 values in row-major order.
pub(crate) fn st_values(tensors: &SafetensorsSet, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let t = tensors
        .get(name)
        .ok_or_else(|| Error::tensor(name, tensors.why_missing(name)))?;
    if t.shape != shape {
        return Err(Error::tensor(
            name,
            format!("shape {:?}, expected {shape:?}", t.shape),
        ));
    }
    let len = shape.iter().product();
    let m = QMatrix::ggml(name, float_type(name, t)?, 1, len, tensors.bytes(t))?;
    let mut out = vec![0.0; len];
    m.dequantize_row(0, &mut out);
    Ok(out)
}

/// A 1-D I32 tensor of token ids, each checked to be below `vocab`.
pub(crate) fn st_token_ids(tensors: &SafetensorsSet, name: &str, vocab: usize) -> Result<Vec<u32>> {
    let t = tensors
        .get(name)
        .ok_or_else(|| Error::tensor(name, tensors.why_missing(name)))?;
    if t.dtype != StDtype::I32 || t.shape.len() != 1 {
        return Err(Error::tensor(
            name,
            format!("{} {:?}, expected a 1-D I32 list", t.dtype_name, t.shape),
        ));
    }
    let bytes = tensors.bytes(t);
    let ids: Vec<i32> = bytes
        .as_slice()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    ids.iter()
        .map(|&i| {
            u32::try_from(i)
                .ok()
                .filter(|&u| (u as usize) < vocab)
                .ok_or_else(|| {
                    Error::tensor(
                        name,
                        format!("token id {i} outside the vocabulary ({vocab})"),
                    )
                })
        })
        .collect()
}

fn float_type(name: &str, t: &safetensors::StTensor) -> Result<GgmlType> {
    match t.dtype {
        StDtype::F32 => Ok(GgmlType::F32),
        StDtype::F16 => Ok(GgmlType::F16),
        StDtype::BF16 => Ok(GgmlType::BF16),
        _ => Err(Error::Unsupported(format!(
            "tensor {name} has dtype {}",
            t.dtype_name
        ))),
    }
}

/// MLX quantization parameters for a module: a per-module override in `quantization` if present, else the
/// global `{group_size, bits}`.
fn mlx_params(config: &HfConfig, module: &str) -> Option<(u32, usize)> {
    let q = config
        .quantization
        .as_ref()
        .or(config.quantization_config.as_ref())?;
    let read = |v: &serde_json::Value| -> Option<(u32, usize)> {
        Some((
            v.get("bits")?.as_u64()? as u32,
            v.get("group_size")?.as_u64()? as usize,
        ))
    };
    q.get(module).and_then(read).or_else(|| read(q))
}

fn mlx_scale_type(name: &str, dtype: StDtype) -> Result<MlxScaleType> {
    match dtype {
        StDtype::F16 => Ok(MlxScaleType::F16),
        StDtype::BF16 => Ok(MlxScaleType::BF16),
        StDtype::F32 => Ok(MlxScaleType::F32),
        _ => Err(Error::tensor(name, "MLX scales must be f16, bf16 or f32")),
    }
}
