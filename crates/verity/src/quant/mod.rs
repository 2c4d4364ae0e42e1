//! Weight formats: how a matrix's bytes encode its values, and decoding them block by block.
//!
//! Every format is decoded in *blocks* along the input dimension (32 values for the GGML legacy formats and the
//! float formats, 256 for the K-quants, the group size for MLX affine). The matmul kernels decode one block of a
//! weight row once and apply it to every activation row, so a W-row product reads each weight once, and each row's
//! result is computed by the same sequence of operations whatever W is (the row-exact contract).

pub(crate) mod encode;
pub(crate) mod ggml;
mod mlx;

pub use ggml::{GgmlType, IntBlock};
pub use mlx::{MlxAffine, MlxScaleType};

use crate::error::{Error, Result};
use crate::storage::Bytes;

/// The element format of a stored weight matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// A GGML block format (also used for plain F32/F16/BF16 tensors from any source).
    Ggml(GgmlType),
    /// MLX affine quantization: packed unsigned integers with a scale and bias per group.
    Mlx(MlxAffine),
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightFormat::Ggml(t) => write!(f, "{}", t.name()),
            WeightFormat::Mlx(m) => write!(f, "mlx-affine-q{}-g{}", m.bits, m.group),
        }
    }
}

/// An MLX affine matrix's parameters and parts, as stored.
pub(crate) struct MlxParts<'a> {
    pub q: MlxAffine,
    pub words: &'a [u8],
    pub scales: &'a [u8],
    pub biases: &'a [u8],
}

/// A 2-D weight matrix `[rows (outputs), cols (inputs)]`, stored row-major in its format.
#[derive(Debug, Clone)]
pub struct QMatrix {
    pub name: String,
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    data: Bytes,
    /// MLX affine only: per-group scales and biases, each `[rows, cols / group]`.
    scales: Option<Bytes>,
    biases: Option<Bytes>,
}

impl QMatrix {
    /// A matrix in a GGML format (or a plain float format) whose bytes are `rows` consecutive encoded rows.
    pub fn ggml(name: &str, ty: GgmlType, rows: usize, cols: usize, data: Bytes) -> Result<Self> {
        let row_bytes = ty.row_bytes(cols).ok_or_else(|| {
            Error::tensor(
                name,
                format!(
                    "{} needs the row length {cols} to be a multiple of {}",
                    ty.name(),
                    ty.block_len()
                ),
            )
        })?;
        let want = row_bytes
            .checked_mul(rows)
            .ok_or_else(|| Error::tensor(name, "size overflows"))?;
        if data.len() != want {
            return Err(Error::tensor(
                name,
                format!(
                    "{} [{rows}, {cols}] needs {want} bytes, found {}",
                    ty.name(),
                    data.len()
                ),
            ));
        }
        Ok(QMatrix {
            name: name.to_string(),
            format: WeightFormat::Ggml(ty),
            rows,
            cols,
            data,
            scales: None,
            biases: None,
        })
    }

    /// An MLX affine-quantized matrix from its packed words, scales and biases.
    pub fn mlx(
        name: &str,
        q: MlxAffine,
        rows: usize,
        cols: usize,
        data: Bytes,
        scales: Bytes,
        biases: Bytes,
    ) -> Result<Self> {
        q.check(name, rows, cols, data.len(), scales.len(), biases.len())?;
        Ok(QMatrix {
            name: name.to_string(),
            format: WeightFormat::Mlx(q),
            rows,
            cols,
            data,
            scales: Some(scales),
            biases: Some(biases),
        })
    }

    /// Elements per decoded block.
    pub fn block_len(&self) -> usize {
        match self.format {
            WeightFormat::Ggml(t) => t.block_len(),
            WeightFormat::Mlx(m) => m.group,
        }
    }

    /// Bytes of weight data (all parts), i.e. what one full pass over the matrix reads.
    pub fn nbytes(&self) -> usize {
        self.data.len()
            + self.scales.as_ref().map_or(0, |s| s.len())
            + self.biases.as_ref().map_or(0, |b| b.len())
    }

    /// The encoded bytes (for GGML formats: `rows` consecutive encoded rows).
    pub fn data(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// MLX affine only: the parameters and the three parts (for a backend that re-lays them).
    pub(crate) fn mlx_parts(&self) -> Option<MlxParts<'_>> {
        match (self.format, &self.scales, &self.biases) {
            (WeightFormat::Mlx(q), Some(s), Some(b)) => Some(MlxParts {
                q,
                words: self.data.as_slice(),
                scales: s.as_slice(),
                biases: b.as_slice(),
            }),
            _ => None,
        }
    }

    /// A decoder bound to this matrix's bytes.
    pub fn decoder(&self) -> RowDecoder<'_> {
        match self.format {
            WeightFormat::Ggml(t) => RowDecoder::Ggml {
                ty: t,
                data: self.data.as_slice(),
                row_bytes: t.row_bytes(self.cols).expect("checked at construction"),
            },
            WeightFormat::Mlx(m) => RowDecoder::Mlx {
                q: m,
                data: self.data.as_slice(),
                scales: self.scales.as_ref().expect("mlx has scales").as_slice(),
                biases: self.biases.as_ref().expect("mlx has biases").as_slice(),
                cols: self.cols,
            },
        }
    }

    /// A new matrix of the chosen rows, in order (a drafter's output projection restricted to its draft
    /// vocabulary, the queries or the gates of a gated Q projection); the rows are copied.
    pub fn select_rows(&self, rows: &[u32]) -> Result<QMatrix> {
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= self.rows) {
            return Err(Error::tensor(
                &self.name,
                format!("row {r} selected from {} rows", self.rows),
            ));
        }
        let pick = |src: &[u8], row_bytes: usize| -> Bytes {
            let mut out = Vec::with_capacity(rows.len() * row_bytes);
            for &r in rows {
                let r = r as usize;
                out.extend_from_slice(&src[r * row_bytes..(r + 1) * row_bytes]);
            }
            Bytes::owned(out)
        };
        match self.format {
            WeightFormat::Ggml(ty) => {
                let rb = ty.row_bytes(self.cols).expect("checked at construction");
                QMatrix::ggml(&self.name, ty, rows.len(), self.cols, pick(self.data(), rb))
            }
            WeightFormat::Mlx(q) => {
                let parts = self.mlx_parts().expect("mlx has its parts");
                let words = self.cols * q.bits as usize / 8;
                let scales = self.cols / q.group * q.scale_type.size();
                QMatrix::mlx(
                    &self.name,
                    q,
                    rows.len(),
                    self.cols,
                    pick(parts.words, words),
                    pick(parts.scales, scales),
                    pick(parts.biases, scales),
                )
            }
        }
    }

    /// This matrix re-encoded as Q8_0 (32 values per block, an f16 scale of max|x|/127): for a drafter's float
    /// weights, whose numerics never reach the output (every draft is verified) but whose bytes are read on
    /// every draft step. Needs a row length that is a multiple of 32.
    pub fn to_q8_0(&self) -> Result<QMatrix> {
        if !self.cols.is_multiple_of(32) {
            return Err(Error::tensor(
                &self.name,
                format!(
                    "Q8_0 needs rows of a multiple of 32 values, not {}",
                    self.cols
                ),
            ));
        }
        let mut data = Vec::with_capacity(self.rows * self.cols / 32 * 34);
        let mut row = vec![0f32; self.cols];
        for r in 0..self.rows {
            self.dequantize_row(r, &mut row);
            for block in row.chunks_exact(32) {
                let amax = block.iter().fold(0f32, |m, &x| m.max(x.abs()));
                let d = amax / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                data.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
                data.extend(
                    block
                        .iter()
                        .map(|&x| (x * inv).round().clamp(-127.0, 127.0) as i8 as u8),
                );
            }
        }
        QMatrix::ggml(
            &self.name,
            GgmlType::Q8_0,
            self.rows,
            self.cols,
            Bytes::owned(data),
        )
    }

    /// Decode one whole row to f32 (embedding lookups, tests).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        let dec = self.decoder();
        let bl = self.block_len();
        for (b, chunk) in out.chunks_mut(bl).enumerate() {
            dec.decode(row, b, chunk);
        }
    }
}

/// Decodes blocks of one matrix; borrowed so that the hot loop holds plain slices.
#[derive(Clone, Copy)]
pub enum RowDecoder<'a> {
    Ggml {
        ty: GgmlType,
        data: &'a [u8],
        row_bytes: usize,
    },
    Mlx {
        q: MlxAffine,
        data: &'a [u8],
        scales: &'a [u8],
        biases: &'a [u8],
        cols: usize,
    },
}

impl RowDecoder<'_> {
    /// Decode block `block` of row `row` into `out` (`out.len()` is the block length, or less for the ragged
    /// last block of a float row).
    #[inline(always)]
    pub fn decode(&self, row: usize, block: usize, out: &mut [f32]) {
        match *self {
            RowDecoder::Ggml {
                ty,
                data,
                row_bytes,
            } => {
                let row_data = &data[row * row_bytes..(row + 1) * row_bytes];
                ty.decode_block(row_data, block, out)
            }
            RowDecoder::Mlx {
                q,
                data,
                scales,
                biases,
                cols,
            } => q.decode_block(data, scales, biases, cols, row, block, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row of `m`, decoded.
    fn decoded(m: &QMatrix) -> Vec<Vec<f32>> {
        let mut row = vec![0f32; m.cols];
        (0..m.rows)
            .map(|r| {
                m.dequantize_row(r, &mut row);
                row.clone()
            })
            .collect()
    }

    #[test]
    fn selected_rows_decode_to_the_rows_they_were_taken_from() {
        let (rows, cols) = (6, 128);
        let bytes = |n: usize, salt: u8| -> Bytes {
            Bytes::owned((0..n).map(|i| (i as u8).wrapping_mul(37) ^ salt).collect())
        };
        let q4 = MlxAffine::new(4, 64, MlxScaleType::F16).unwrap();
        let mlx = QMatrix::mlx(
            "m",
            q4,
            rows,
            cols,
            bytes(rows * cols / 2, 1),
            bytes(rows * 2 * 2, 2),
            bytes(rows * 2 * 2, 3),
        )
        .unwrap();
        let q8 = QMatrix::ggml("g", GgmlType::F32, rows, cols, {
            let v: Vec<u8> = (0..rows * cols)
                .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
                .collect();
            Bytes::owned(v)
        })
        .unwrap()
        .to_q8_0()
        .unwrap();
        for m in [mlx, q8] {
            let pick = [4u32, 0, 5, 4];
            let picked = m.select_rows(&pick).unwrap();
            let (all, some) = (decoded(&m), decoded(&picked));
            for (i, &r) in pick.iter().enumerate() {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&some[i]),
                    bits(&all[r as usize]),
                    "{}: row {r}",
                    m.format
                );
            }
            assert!(m.select_rows(&[6]).is_err());
        }
    }
}
