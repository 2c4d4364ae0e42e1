//! `verity quantize`: a GGUF of float weights in, a quantized GGUF out — the file llama.cpp's quantizer writes.
//!
//! The plan ([`plan`]) gives every tensor its type by the preset's mix ([`mix`]); the blocks come from the
//! reference encoders in [`crate::quant::encode`]; the file is laid out as llama.cpp lays it out (metadata copied
//! in order with `general.quantization_version` and `general.file_type` set last, tensors ordered by layer then
//! name, 32-byte alignment). Rows are independent, so they are encoded in parallel and the bytes do not depend
//! on the thread count. The output is written beside its final name and renamed into place when complete: an
//! interrupted run leaves no half-written model under that name.

pub mod hf;
mod mix;

pub use mix::{Choice, ModelFacts, Preset};

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use rayon::prelude::*;

use crate::bundle::gguf::{GgufFile, MetaValue};
use crate::bundle::gguf_writer::{GgufWriter, TensorEntry};
use crate::error::{Error, Result};
use crate::quant::encode::{can_encode, encode_row};
use crate::quant::GgmlType;
use mix::Mix;

/// llama.cpp's `GGML_QNT_VERSION`: the block layouts' version, recorded in every quantized file.
const QUANTIZATION_VERSION: u32 = 2;
/// Values converted to f32 at a time by one worker.
const CHUNK_VALUES: usize = 32 * 512;

/// One tensor's part of the plan.
#[derive(Debug, Clone)]
pub struct TensorPlan {
    pub name: String,
    /// GGML order: `dims[0]` is the row length.
    pub dims: Vec<usize>,
    pub from: GgmlType,
    pub to: GgmlType,
    /// Why the type is not the one the mix asked for (a row that is not whole blocks).
    pub fallback: Option<String>,
}

impl TensorPlan {
    fn rows(&self) -> usize {
        self.dims[1..].iter().product()
    }

    /// Bytes of the tensor in the output.
    pub fn out_bytes(&self) -> usize {
        self.to.row_bytes(self.dims[0]).expect("planned types fit") * self.rows()
    }

    fn in_bytes(&self) -> usize {
        self.from
            .row_bytes(self.dims[0])
            .expect("read from a valid GGUF")
            * self.rows()
    }
}

/// Every tensor of a model, in output order, with its type.
#[derive(Debug, Clone)]
pub struct Plan {
    pub preset: Preset,
    pub tensors: Vec<TensorPlan>,
}

impl Plan {
    pub fn in_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.in_bytes() as u64).sum()
    }
    pub fn out_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.out_bytes() as u64).sum()
    }
}

/// Where a quantization run stands, reported after each tensor.
pub struct Progress<'a> {
    pub tensor: &'a TensorPlan,
    /// Input bytes handled so far, of `total_bytes`.
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// The model facts the mix needs, from the GGUF metadata.
fn facts(input: &GgufFile) -> Result<ModelFacts> {
    let malformed = |msg: String| Error::malformed(&input.path, msg);
    let arch = input
        .get("general.architecture")
        .and_then(MetaValue::as_str)
        .ok_or_else(|| malformed("no general.architecture".into()))?
        .to_string();
    let count = |key: &str| {
        input
            .get(&format!("{arch}.{key}"))
            .map(|v| {
                v.as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| malformed(format!("{arch}.{key} is not a count: {v:?}")))
            })
            .transpose()
    };
    let layers =
        count("block_count")?.ok_or_else(|| malformed(format!("no {arch}.block_count")))?;
    let heads = count("attention.head_count")?.unwrap_or(0);
    let tied_embeddings = input.tensor("output.weight").is_none();
    let value_projections = input
        .tensors
        .iter()
        .filter(|t| {
            ["attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight"]
                .iter()
                .any(|k| t.name.contains(k))
        })
        .count();
    Ok(ModelFacts {
        layers,
        experts: count("expert_count")?.unwrap_or(0),
        heads,
        kv_heads: count("attention.head_count_kv")?.unwrap_or(heads),
        tied_embeddings,
        value_projections,
        arch,
    })
}

/// llama.cpp's tensor order: tensors outside the layers first, then layer by layer, by name within each.
fn order_key(name: &str) -> (i64, &str) {
    let layer = name
        .strip_prefix("blk.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse::<i64>().ok())
        .unwrap_or(-1);
    (layer, name)
}

/// Choose every tensor's type for `preset`.
pub fn plan(input: &GgufFile, preset: Preset) -> Result<Plan> {
    let mut order: Vec<_> = input.tensors.iter().collect();
    order.sort_by(|a, b| order_key(&a.name).cmp(&order_key(&b.name)));
    let mut mix = Mix::new(preset, facts(input)?);
    let mut tensors = Vec::with_capacity(order.len());
    for t in order {
        let Choice { ty, fallback } = mix.choose(&t.name, &t.dims, t.ty)?;
        if ty != t.ty && !t.ty.is_float() {
            return Err(Error::Unsupported(format!(
                "tensor {} is already {}: verity quantizes from F32, F16 or BF16 weights",
                t.name,
                t.ty.name()
            )));
        }
        if !can_encode(ty) {
            return Err(Error::Unsupported(format!(
                "tensor {}: verity does not write {}",
                t.name,
                ty.name()
            )));
        }
        tensors.push(TensorPlan {
            name: t.name.clone(),
            dims: t.dims.clone(),
            from: t.ty,
            to: ty,
            fallback,
        });
    }
    Ok(Plan { preset, tensors })
}

/// The output's header: the input's metadata in order, the preset's file type, and the planned directory.
fn writer(input: &GgufFile, plan: &Plan) -> Result<GgufWriter> {
    let mut w = GgufWriter::new();
    for e in &input.entries {
        w.set_raw(&e.key, input.entry_bytes(e).to_vec());
    }
    for split_key in ["split.no", "split.count", "split.tensors.count"] {
        w.remove(split_key);
    }
    w.set_u32("general.quantization_version", QUANTIZATION_VERSION);
    w.set_u32("general.file_type", plan.preset.file_type());
    if let Some(a) = input.get("general.alignment").and_then(MetaValue::as_u64) {
        w.set_alignment(a as usize)?;
    }
    for t in &plan.tensors {
        w.add_tensor(TensorEntry {
            name: t.name.clone(),
            dims: t.dims.clone(),
            ty: t.to,
        })?;
    }
    Ok(w)
}

/// Rows of `from` values (F32, F16 or BF16 bytes) as f32.
fn to_f32(from: GgmlType, bytes: &[u8], out: &mut Vec<f32>) {
    out.clear();
    match from {
        GgmlType::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        GgmlType::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        GgmlType::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        other => unreachable!("the plan refuses to requantize {}", other.name()),
    }
}

/// Encode one tensor: its rows in parallel, in chunks of whole rows.
fn encode_tensor(t: &TensorPlan, src: &[u8], pool: &rayon::ThreadPool) -> Vec<u8> {
    let cols = t.dims[0];
    let (in_row, out_row) = (
        t.from.row_bytes(cols).expect("valid input"),
        t.to.row_bytes(cols).expect("planned"),
    );
    let rows_per_chunk = CHUNK_VALUES.div_ceil(cols).max(1);
    let mut out = vec![0u8; t.out_bytes()];
    pool.install(|| {
        out.par_chunks_mut(rows_per_chunk * out_row)
            .zip(src.par_chunks(rows_per_chunk * in_row))
            .for_each_init(Vec::new, |values, (dst, rows)| {
                to_f32(t.from, rows, values);
                for (x, o) in values.chunks_exact(cols).zip(dst.chunks_exact_mut(out_row)) {
                    encode_row(t.to, x, o);
                }
            });
    });
    out
}

/// Quantize the GGUF at `input` to `output` by `preset`, on `threads` threads (0: one per core).
pub fn quantize(
    input: &Path,
    output: &Path,
    preset: Preset,
    threads: usize,
    progress: &mut dyn FnMut(Progress),
) -> Result<Plan> {
    if same_file(input, output) {
        return Err(Error::Invalid(format!(
            "{} is the input: write the quantized model to another file",
            output.display()
        )));
    }
    let model = GgufFile::open(input)?;
    let plan = plan(&model, preset)?;
    let w = writer(&model, &plan)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| Error::Invalid(format!("cannot start {threads} threads: {e}")))?;

    write_then_rename(output, |partial| {
        let io = |e| Error::io(partial, e);
        let mut out = BufWriter::new(File::create(partial).map_err(io)?);
        out.write_all(&w.header()).map_err(io)?;
        let total_bytes = plan.in_bytes();
        let mut done_bytes = 0u64;
        for t in &plan.tensors {
            let src = model.tensor_bytes(model.tensor(&t.name).expect("planned from this file"));
            let src = src.as_slice();
            if t.to == t.from {
                w.write_data(&mut out, src).map_err(io)?;
            } else {
                w.write_data(&mut out, &encode_tensor(t, src, &pool))
                    .map_err(io)?;
            }
            done_bytes += t.in_bytes() as u64;
            progress(Progress {
                tensor: t,
                done_bytes,
                total_bytes,
            });
        }
        out.into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_all()
            .map_err(io)
    })?;
    Ok(plan)
}

/// `write` to a file beside `output`, renamed into place once complete: an interrupted or failed run leaves no
/// half-written model under that name (and no partial file).
pub(crate) fn write_then_rename(
    output: &Path,
    write: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    let partial = partial_path(output);
    let result = write(&partial)
        .and_then(|()| std::fs::rename(&partial, output).map_err(|e| Error::io(output, e)));
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result
}

fn partial_path(output: &Path) -> PathBuf {
    let mut name = output.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".partial-{}", std::process::id()));
    output.with_file_name(name)
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}
