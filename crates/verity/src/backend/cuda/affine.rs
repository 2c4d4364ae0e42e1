//! MLX affine matrices on the GPU, re-laid at upload into 32-value blocks `[scale f32][bias f32][quants]` (16
//! bytes of 4-bit values, value 2j in the low nibble of byte j as MLX packs them, or 32 bytes of 8-bit values),
//! which `kernels.cu`'s `decode` reads as types `T_AFF4` / `T_AFF8`.
//!
//! Why re-lay: MLX keeps a group's scale and bias in two tensors apart from the packed words, so decoding one
//! block would take three scattered loads; here it is one contiguous block like the GGML formats. Scales and
//! biases are widened to f32 exactly, and the kernel decodes `scale * q + bias` with a rounded multiply and a
//! rounded add (no FMA), so its values are the CPU decoder's bitwise.

use crate::quant::QMatrix;

/// Bytes of one 32-value block of `bits`-bit values.
pub fn block_bytes(bits: u32) -> usize {
    8 + 32 * bits as usize / 8
}

/// The blocks of an MLX affine matrix (`rows` rows of `cols / 32` blocks), or `None` for another format.
pub fn to_blocks(m: &QMatrix) -> Option<Vec<u8>> {
    let parts = m.mlx_parts()?;
    let (q, data, scales, biases) = (parts.q, parts.words, parts.scales, parts.biases);
    let (bits, nb) = (q.bits as usize, m.cols / 32);
    let bb = block_bytes(q.bits);
    let groups = m.cols / q.group;
    let mut out = Vec::with_capacity(m.rows * nb * bb);
    for r in 0..m.rows {
        for b in 0..nb {
            let g = r * groups + b * 32 / q.group;
            out.extend_from_slice(&q.scale_type.read(scales, g).to_le_bytes());
            out.extend_from_slice(&q.scale_type.read(biases, g).to_le_bytes());
            let start = (r * m.cols + b * 32) * bits / 8;
            out.extend_from_slice(&data[start..start + 32 * bits / 8]);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{MlxAffine, MlxScaleType};
    use crate::storage::Bytes;

    /// Block b of row r decoded as the kernel decodes it.
    fn decode(bits: u32, blocks: &[u8], nb: usize, r: usize, b: usize) -> Vec<f32> {
        let bb = block_bytes(bits);
        let p = &blocks[(r * nb + b) * bb..(r * nb + b + 1) * bb];
        let f = |at: usize| f32::from_le_bytes(p[at..at + 4].try_into().unwrap());
        let (scale, bias) = (f(0), f(4));
        let q = &p[8..];
        if bits == 8 {
            q.iter().map(|&v| scale * f32::from(v) + bias).collect()
        } else {
            q.iter()
                .flat_map(|&v| [v & 15, v >> 4])
                .map(|v| scale * f32::from(v) + bias)
                .collect()
        }
    }

    #[test]
    fn blocks_decode_bitwise_as_the_cpu_decoder() {
        let mut seed = 0x2545_f491u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for (bits, group, st) in [
            (4, 32, MlxScaleType::F16),
            (4, 64, MlxScaleType::BF16),
            (8, 128, MlxScaleType::F32),
            (8, 32, MlxScaleType::F16),
        ] {
            let (rows, cols) = (5, group * 3);
            let q = MlxAffine::new(bits, group, st).unwrap();
            let words: Vec<u8> = (0..rows * cols * bits as usize / 32)
                .flat_map(|_| next().to_le_bytes())
                .collect();
            let n_groups = rows * cols / group;
            // Finite scales and biases of every dtype: small integers scaled, as bytes of that dtype.
            let scalar = |v: f32| -> Vec<u8> {
                match st {
                    MlxScaleType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                    MlxScaleType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                    MlxScaleType::F32 => v.to_le_bytes().to_vec(),
                }
            };
            let scales: Vec<u8> = (0..n_groups)
                .flat_map(|i| scalar(0.013 * (1 + i % 7) as f32))
                .collect();
            let biases: Vec<u8> = (0..n_groups)
                .flat_map(|i| scalar(-0.05 * (i % 5) as f32))
                .collect();
            let m = QMatrix::mlx(
                "t",
                q,
                rows,
                cols,
                Bytes::owned(words),
                Bytes::owned(scales),
                Bytes::owned(biases),
            )
            .unwrap();
            let blocks = to_blocks(&m).unwrap();
            let nb = cols / 32;
            assert_eq!(blocks.len(), rows * nb * block_bytes(bits));
            let mut want = vec![0f32; cols];
            for r in 0..rows {
                m.dequantize_row(r, &mut want);
                for b in 0..nb {
                    let got = decode(bits, &blocks, nb, r, b);
                    let w = &want[b * 32..(b + 1) * 32];
                    assert!(
                        got.iter().zip(w).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "q{bits}-g{group}: row {r} block {b}"
                    );
                }
            }
        }
    }
}
