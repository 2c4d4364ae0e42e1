//! GGUF reader: the header (metadata and tensor directory) parsed from a memory-mapped file.
//!
//! Trust nothing: every length and count is checked against the bytes that remain before anything is allocated,
//! every tensor's byte range is checked to lie inside the file with overflow-checked arithmetic, and every
//! failure names the file and the problem.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::quant::GgmlType;
use crate::storage::{Bytes, MappedFile};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Nested arrays deeper than this are not GGUF that any writer produces.
const MAX_ARRAY_DEPTH: usize = 4;
const MAX_DIMS: u32 = 4;

/// A GGUF metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => self.as_u64().map(|v| v != 0),
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor directory, validated against the file.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub name: String,
    /// GGML order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    /// Absolute byte range in the file.
    pub range: std::ops::Range<usize>,
}

/// One metadata entry as stored: its key and the byte range of its type tag and value, so that a writer can
/// copy metadata verbatim (order, types and bytes; `MetaValue` keeps neither the order nor an empty array's
/// element type).
#[derive(Debug, Clone)]
pub struct RawEntry {
    pub key: String,
    pub value: std::ops::Range<usize>,
}

/// A parsed GGUF file.
#[derive(Debug)]
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    /// The metadata entries in file order.
    pub entries: Vec<RawEntry>,
    pub tensors: Vec<GgufTensor>,
    file: MappedFile,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = MappedFile::open(path)?;
        Self::parse(path, file)
    }

    /// Parse a GGUF image already in memory (the fuzz target and the malformed-file tests use this).
    pub fn parse(path: &Path, file: MappedFile) -> Result<Self> {
        let Header {
            version,
            metadata,
            entries,
            tensors,
        } = parse_header(path, file.bytes())?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            entries,
            tensors,
            file,
        })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    pub fn tensor_bytes(&self, t: &GgufTensor) -> Bytes {
        self.file.slice(t.range.clone())
    }

    /// Bytes `part` of tensor `t`'s data (a slice of a stacked tensor: one expert's matrix).
    pub fn tensor_part(&self, t: &GgufTensor, part: std::ops::Range<usize>) -> Bytes {
        assert!(part.end <= t.range.len(), "a part inside the tensor");
        self.file
            .slice(t.range.start + part.start..t.range.start + part.end)
    }

    pub fn file_len(&self) -> usize {
        self.file.len()
    }

    /// The stored bytes of a metadata entry's type tag and value.
    pub fn entry_bytes(&self, e: &RawEntry) -> &[u8] {
        &self.file.bytes()[e.value.clone()]
    }
}

/// A GGUF header: what `parse_header` reads before the tensor data.
#[derive(Debug)]
pub struct Header {
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub entries: Vec<RawEntry>,
    pub tensors: Vec<GgufTensor>,
}

/// Parse the header of a GGUF image. Public for fuzzing: it must never panic or allocate without bound.
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<Header> {
    let mut r = Cursor {
        path,
        bytes,
        pos: 0,
    };
    let magic = r.take(4, "magic")?;
    if magic != MAGIC {
        return Err(r.err(format!(
            "not a GGUF file (magic {:02x?}, expected \"GGUF\")",
            magic
        )));
    }
    let version = r.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(r.err(format!(
            "GGUF version {version} is not supported (2 and 3 are)"
        )));
    }
    let tensor_count = r.u64("tensor count")?;
    let kv_count = r.u64("metadata count")?;
    // Each metadata entry takes at least 8 (key length) + 4 (type) + 1 bytes, each tensor entry 8 + 4 + 8 + 4 + 8.
    r.check_count(kv_count, 13, "metadata count")?;
    r.check_count(tensor_count, 32, "tensor count")?;

    let mut metadata = BTreeMap::new();
    let mut entries = Vec::with_capacity(kv_count as usize);
    for _ in 0..kv_count {
        let key = r.string("metadata key")?;
        let start = r.pos;
        let ty = r.u32("metadata type")?;
        let value = r.value(ty, 0, &key)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(r.err(format!("duplicate metadata key {key:?}")));
        }
        entries.push(RawEntry {
            key,
            value: start..r.pos,
        });
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => return Err(r.err(format!("general.alignment {v:?} is not a power of two"))),
        },
    };

    struct Raw {
        name: String,
        dims: Vec<usize>,
        ty: GgmlType,
        offset: u64,
    }
    let mut raws = Vec::with_capacity(tensor_count as usize);
    for _ in 0..tensor_count {
        let name = r.string("tensor name")?;
        let n_dims = r.u32("tensor dimension count")?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(r.err(format!(
                "tensor {name}: {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = r.u64("tensor dimension")?;
            if d == 0 || d > i64::MAX as u64 {
                return Err(r.err(format!("tensor {name}: dimension {d} out of range")));
            }
            dims.push(d as usize);
        }
        let ty_id = r.u32("tensor type")?;
        let ty = GgmlType::from_gguf_id(ty_id).ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: tensor {name} has GGML type {ty_id} ({}), which verity does not decode",
                path.display(),
                GgmlType::gguf_id_name(ty_id)
            ))
        })?;
        let offset = r.u64("tensor offset")?;
        raws.push(Raw {
            name,
            dims,
            ty,
            offset,
        });
    }
    let data_start =
        align_up(r.pos as u64, alignment).ok_or_else(|| r.err("data offset overflows"))?;
    let file_len = bytes.len() as u64;

    let mut tensors = Vec::with_capacity(raws.len());
    let mut seen = std::collections::HashSet::new();
    for raw in raws {
        if !seen.insert(raw.name.clone()) {
            return Err(r.err(format!("duplicate tensor {:?}", raw.name)));
        }
        let cols = raw.dims[0];
        let rows = raw.dims[1..]
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| r.err(format!("tensor {}: element count overflows", raw.name)))?;
        let row_bytes = raw.ty.row_bytes(cols).ok_or_else(|| {
            r.err(format!(
                "tensor {}: row length {cols} is not a multiple of the {} block ({})",
                raw.name,
                raw.ty.name(),
                raw.ty.block_len()
            ))
        })?;
        let size = (row_bytes as u64)
            .checked_mul(rows as u64)
            .ok_or_else(|| r.err(format!("tensor {}: byte size overflows", raw.name)))?;
        if raw.offset % alignment != 0 {
            return Err(r.err(format!(
                "tensor {}: offset {} is not aligned to {alignment}",
                raw.name, raw.offset
            )));
        }
        let start = data_start
            .checked_add(raw.offset)
            .ok_or_else(|| r.err(format!("tensor {}: offset overflows", raw.name)))?;
        let end = start
            .checked_add(size)
            .ok_or_else(|| r.err(format!("tensor {}: end overflows", raw.name)))?;
        if end > file_len {
            return Err(r.err(format!(
                "tensor {}: data [{start}, {end}) lies outside the file ({file_len} bytes); the file is truncated or corrupt",
                raw.name
            )));
        }
        tensors.push(GgufTensor {
            name: raw.name,
            dims: raw.dims,
            ty: raw.ty,
            range: start as usize..end as usize,
        });
    }
    Ok(Header {
        version,
        metadata,
        entries,
        tensors,
    })
}

fn align_up(v: u64, a: u64) -> Option<u64> {
    v.checked_add(a - 1).map(|x| x / a * a)
}

struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, msg: impl Into<String>) -> Error {
        Error::malformed(self.path, format!("{} (at byte {})", msg.into(), self.pos))
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(format!(
                "truncated: {what} needs {n} bytes, {} remain",
                self.remaining()
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn check_count(&self, count: u64, min_each: u64, what: &str) -> Result<()> {
        if count.saturating_mul(min_each) > self.remaining() as u64 {
            return Err(self.err(format!(
                "{what} {count} cannot fit in the {} bytes that remain",
                self.remaining()
            )));
        }
        Ok(())
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return Err(self.err(format!(
                "{what}: string length {len} exceeds the {} bytes that remain",
                self.remaining()
            )));
        }
        let b = self.take(len as usize, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err(format!("{what}: string is not UTF-8")))
    }

    fn value(&mut self, ty: u32, depth: usize, key: &str) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.u8(key)?),
            1 => MetaValue::I8(self.u8(key)? as i8),
            2 => MetaValue::U16(self.u16(key)?),
            3 => MetaValue::I16(self.u16(key)? as i16),
            4 => MetaValue::U32(self.u32(key)?),
            5 => MetaValue::I32(self.u32(key)? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32(key)?)),
            7 => match self.u8(key)? {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(self.err(format!("{key}: boolean byte {b}"))),
            },
            8 => MetaValue::Str(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format!(
                        "{key}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
                    )));
                }
                let elem_ty = self.u32(key)?;
                let count = self.u64(key)?;
                let min_size = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8..=12 => 8,
                    t => return Err(self.err(format!("{key}: unknown array element type {t}"))),
                };
                self.check_count(count, min_size, &format!("{key}: array length"))?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem_ty, depth + 1, key)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(key)?),
            11 => MetaValue::I64(self.u64(key)? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64(key)?)),
            t => return Err(self.err(format!("{key}: unknown metadata type {t}"))),
        })
    }
}
