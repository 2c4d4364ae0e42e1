//! GGUF writer: the header (metadata, then the tensor directory), then each tensor's data padded to the
//! alignment — the layout llama.cpp writes, so that a file verity writes can be the same bytes.

use std::io::Write;

use crate::error::{Error, Result};
use crate::quant::GgmlType;

const VERSION: u32 = 3;
const DEFAULT_ALIGNMENT: usize = 32;
const TYPE_U32: u32 = 4;
const TYPE_I32: u32 = 5;
const TYPE_F32: u32 = 6;
const TYPE_BOOL: u32 = 7;
const TYPE_STRING: u32 = 8;
const TYPE_ARRAY: u32 = 9;

/// A tensor's entry in the directory.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub name: String,
    /// GGML order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<usize>,
    pub ty: GgmlType,
}

impl TensorEntry {
    /// Bytes of the tensor's data (without padding); `None` if its rows are not whole blocks.
    pub fn data_len(&self) -> Option<usize> {
        let rows: usize = self.dims[1..].iter().product();
        self.ty.row_bytes(self.dims[0]).map(|r| r * rows)
    }
}

/// A GGUF file under construction: metadata entries in order, and the tensor directory.
#[derive(Debug, Default)]
pub struct GgufWriter {
    /// Key and stored bytes (type tag and value).
    entries: Vec<(String, Vec<u8>)>,
    tensors: Vec<TensorEntry>,
    alignment: Option<usize>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Set `key` to an already encoded value (its type tag and value bytes). As in llama.cpp, setting a key
    /// that exists removes it first, so the key moves to the end.
    pub fn set_raw(&mut self, key: &str, value: Vec<u8>) {
        self.remove(key);
        self.entries.push((key.to_string(), value));
    }

    pub fn set_u32(&mut self, key: &str, v: u32) {
        let mut b = TYPE_U32.to_le_bytes().to_vec();
        b.extend_from_slice(&v.to_le_bytes());
        self.set_raw(key, b);
    }

    pub fn set_f32(&mut self, key: &str, v: f32) {
        let mut b = TYPE_F32.to_le_bytes().to_vec();
        b.extend_from_slice(&v.to_le_bytes());
        self.set_raw(key, b);
    }

    pub fn set_str(&mut self, key: &str, v: &str) {
        let mut b = TYPE_STRING.to_le_bytes().to_vec();
        put_string(&mut b, v);
        self.set_raw(key, b);
    }

    pub fn set_bool(&mut self, key: &str, v: bool) {
        let mut b = TYPE_BOOL.to_le_bytes().to_vec();
        b.push(u8::from(v));
        self.set_raw(key, b);
    }

    pub fn set_str_array(&mut self, key: &str, v: &[String]) {
        let mut b = array_header(TYPE_STRING, v.len());
        for s in v {
            put_string(&mut b, s);
        }
        self.set_raw(key, b);
    }

    pub fn set_i32_array(&mut self, key: &str, v: &[i32]) {
        let mut b = array_header(TYPE_I32, v.len());
        for x in v {
            b.extend_from_slice(&x.to_le_bytes());
        }
        self.set_raw(key, b);
    }

    pub fn remove(&mut self, key: &str) {
        self.entries.retain(|(k, _)| k != key);
    }

    /// The data alignment (default 32, as `general.alignment` says when set).
    pub fn set_alignment(&mut self, alignment: usize) -> Result<()> {
        if !alignment.is_power_of_two() {
            return Err(Error::Invalid(format!(
                "GGUF alignment {alignment} is not a power of two"
            )));
        }
        self.alignment = Some(alignment);
        Ok(())
    }

    pub fn add_tensor(&mut self, t: TensorEntry) -> Result<()> {
        if self.tensors.iter().any(|o| o.name == t.name) {
            return Err(Error::Invalid(format!("duplicate tensor name {}", t.name)));
        }
        if t.dims.is_empty() || t.data_len().is_none() {
            return Err(Error::tensor(
                &t.name,
                format!("dims {:?} do not hold whole {} blocks", t.dims, t.ty.name()),
            ));
        }
        self.tensors.push(t);
        Ok(())
    }

    fn alignment(&self) -> usize {
        self.alignment.unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// Zero bytes that follow `len` bytes of tensor data.
    pub fn padding(&self, len: usize) -> usize {
        len.next_multiple_of(self.alignment()) - len
    }

    /// The header, padded to the alignment: what comes before the first tensor's data.
    pub fn header(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.entries.len() as u64).to_le_bytes());
        for (key, value) in &self.entries {
            put_string(&mut b, key);
            b.extend_from_slice(value);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_string(&mut b, &t.name);
            // ggml's dimension count: up to the last dimension above 1, at least one.
            let n_dims = t.dims.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1);
            b.extend_from_slice(&(n_dims as u32).to_le_bytes());
            for &d in &t.dims[..n_dims] {
                b.extend_from_slice(&(d as u64).to_le_bytes());
            }
            b.extend_from_slice(&t.ty.gguf_id().to_le_bytes());
            b.extend_from_slice(&(offset as u64).to_le_bytes());
            let len = t.data_len().expect("checked in add_tensor");
            offset += len + self.padding(len);
        }
        b.resize(b.len() + self.padding(b.len()), 0);
        b
    }

    /// Write one tensor's data and its padding.
    pub fn write_data(&self, w: &mut impl Write, data: &[u8]) -> std::io::Result<()> {
        w.write_all(data)?;
        w.write_all(&vec![0u8; self.padding(data.len())])
    }
}

/// An array value's type tag, element type and length.
fn array_header(element: u32, len: usize) -> Vec<u8> {
    let mut b = TYPE_ARRAY.to_le_bytes().to_vec();
    b.extend_from_slice(&element.to_le_bytes());
    b.extend_from_slice(&(len as u64).to_le_bytes());
    b
}

fn put_string(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::gguf::{parse_header, MetaValue};

    #[test]
    fn a_written_file_reads_back_with_its_metadata_order_and_tensors() {
        let mut w = GgufWriter::new();
        w.set_str("general.architecture", "llama");
        w.set_u32("general.file_type", 1);
        w.set_u32("llama.block_count", 2);
        w.set_u32("general.file_type", 15);
        w.set_str_array("tokenizer.ggml.tokens", &["a".into(), "bc".into()]);
        w.set_i32_array("tokenizer.ggml.token_type", &[1, 3]);
        w.set_bool("tokenizer.ggml.add_bos_token", true);
        w.add_tensor(TensorEntry {
            name: "a".into(),
            dims: vec![64, 3],
            ty: GgmlType::Q8_0,
        })
        .unwrap();
        w.add_tensor(TensorEntry {
            name: "b".into(),
            dims: vec![5, 1],
            ty: GgmlType::F32,
        })
        .unwrap();
        assert!(w
            .add_tensor(TensorEntry {
                name: "c".into(),
                dims: vec![40],
                ty: GgmlType::Q4_0,
            })
            .is_err());
        let mut file = w.header();
        assert_eq!(file.len() % 32, 0);
        w.write_data(&mut file, &[7u8; 2 * 34 * 3]).unwrap();
        w.write_data(&mut file, &[1u8; 20]).unwrap();
        let h = parse_header(std::path::Path::new("w.gguf"), &file).unwrap();
        let keys: Vec<_> = h.entries.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "general.architecture",
                "llama.block_count",
                "general.file_type",
                "tokenizer.ggml.tokens",
                "tokenizer.ggml.token_type",
                "tokenizer.ggml.add_bos_token"
            ]
        );
        assert_eq!(h.metadata["general.file_type"], MetaValue::U32(15));
        assert_eq!(
            h.metadata["tokenizer.ggml.tokens"],
            MetaValue::Array(vec![
                MetaValue::Str("a".into()),
                MetaValue::Str("bc".into())
            ])
        );
        assert_eq!(
            h.metadata["tokenizer.ggml.token_type"],
            MetaValue::Array(vec![MetaValue::I32(1), MetaValue::I32(3)])
        );
        assert_eq!(
            h.metadata["tokenizer.ggml.add_bos_token"],
            MetaValue::Bool(true)
        );
        assert_eq!(h.tensors[1].dims, [5]);
        assert_eq!(&file[h.tensors[0].range.clone()], &[7u8; 204][..]);
        assert_eq!(&file[h.tensors[1].range.clone()], &[1u8; 20][..]);
    }
}
