//! MLX affine quantization (`mlx.core.quantize`): each row of `cols` values is split into groups of `group`;
//! every group stores unsigned `bits`-bit integers packed little-end-first into `u32` words, plus a scale and a
//! bias (float16, bfloat16 or float32), and decodes as `w = scale * q + bias`.

use half::{bf16, f16};

use super::IntBlock;
use crate::error::{Error, Result};

/// The dtype of MLX scales and biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlxScaleType {
    F16,
    BF16,
    F32,
}

impl MlxScaleType {
    pub fn size(self) -> usize {
        match self {
            MlxScaleType::F32 => 4,
            _ => 2,
        }
    }

    /// Value `i` of a little-endian array of this dtype, widened to f32 (exactly).
    #[inline(always)]
    pub(crate) fn read(self, b: &[u8], i: usize) -> f32 {
        match self {
            MlxScaleType::F16 => f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
            MlxScaleType::BF16 => bf16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
            MlxScaleType::F32 => {
                f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
            }
        }
    }
}

/// The parameters of one MLX affine-quantized matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlxAffine {
    pub bits: u32,
    pub group: usize,
    pub scale_type: MlxScaleType,
}

impl MlxAffine {
    /// Validate the parameters verity decodes: 4 or 8 bits, groups of 32, 64 or 128.
    pub fn new(bits: u32, group: usize, scale_type: MlxScaleType) -> Result<Self> {
        if !matches!(bits, 4 | 8) {
            return Err(Error::Unsupported(format!(
                "MLX affine quantization with {bits} bits (4 and 8 are supported)"
            )));
        }
        if !matches!(group, 32 | 64 | 128) {
            return Err(Error::Unsupported(format!(
                "MLX affine group size {group} (32, 64 and 128 are supported)"
            )));
        }
        Ok(MlxAffine {
            bits,
            group,
            scale_type,
        })
    }

    /// Check that the byte sizes of the three parts match a `[rows, cols]` matrix.
    pub(crate) fn check(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        q: usize,
        s: usize,
        b: usize,
    ) -> Result<()> {
        if !cols.is_multiple_of(self.group) {
            return Err(Error::tensor(
                name,
                format!(
                    "{cols} columns are not a multiple of the group size {}",
                    self.group
                ),
            ));
        }
        let want_q = rows * cols * self.bits as usize / 8;
        let want_s = rows * (cols / self.group) * self.scale_type.size();
        if q != want_q || s != want_s || b != want_s {
            return Err(Error::tensor(
                name,
                format!(
                    "MLX q{}-g{} [{rows}, {cols}] needs {want_q} weight bytes and {want_s} bytes of scales and of biases; found {q}, {s}, {b}",
                    self.bits, self.group
                ),
            ));
        }
        Ok(())
    }

    /// The 32-value block `b` of row `row` in integer form (`q` unsigned, offset 0, the group's scale and
    /// bias): what the 8-bit integer kernels read; `decode_block` is its f32 rendering.
    pub(crate) fn int_block(
        &self,
        parts: (&[u8], &[u8], &[u8]),
        cols: usize,
        row: usize,
        b: usize,
    ) -> IntBlock {
        let (data, scales, biases) = parts;
        let gi = row * (cols / self.group) + b * 32 / self.group;
        let bits = self.bits as usize;
        let start = (row * cols + b * 32) * bits / 8;
        let bytes = &data[start..start + 32 * bits / 8];
        let mut q = [0u8; 32];
        if bits == 8 {
            q.copy_from_slice(bytes);
        } else {
            for (j, &byte) in bytes.iter().enumerate() {
                q[2 * j] = byte & 0x0f;
                q[2 * j + 1] = byte >> 4;
            }
        }
        IntBlock {
            q,
            offset: 0,
            d: [self.scale_type.read(scales, gi); 2],
            m: self.scale_type.read(biases, gi),
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(crate) fn decode_block(
        &self,
        data: &[u8],
        scales: &[u8],
        biases: &[u8],
        cols: usize,
        row: usize,
        block: usize,
        out: &mut [f32],
    ) {
        let groups = cols / self.group;
        let gi = row * groups + block;
        let scale = self.scale_type.read(scales, gi);
        let bias = self.scale_type.read(biases, gi);
        let bits = self.bits as usize;
        let start = (row * cols + block * self.group) * bits / 8;
        let bytes = &data[start..start + self.group * bits / 8];
        if bits == 8 {
            for (o, &q) in out.iter_mut().zip(bytes) {
                *o = scale * q as f32 + bias;
            }
        } else {
            // Little-end-first nibbles within little-endian u32 words = low nibble first within each byte.
            for (j, &byte) in bytes.iter().enumerate() {
                out[2 * j] = scale * (byte & 0x0f) as f32 + bias;
                out[2 * j + 1] = scale * (byte >> 4) as f32 + bias;
            }
        }
    }
}
