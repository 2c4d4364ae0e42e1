//! RoPE angle tables for the CUDA backend.
//!
//! Every step uploads, with its tokens and positions, the `(cos, sin)` pairs of its rows for each rotation the
//! loaded models prepared (`Backend::prepare_attention`). The kernels read the angles instead of computing
//! them, so a rotation on the GPU is bitwise the CPU backend's (both are [`rope_angle`]'s values) and no
//! double-precision transcendental sits on the Q/K/V projection's critical path. The host computes each
//! position's pairs once.

use crate::backend::{rope_angle, Rope};

/// A rotation by `(theta's bits, head_dim)`.
pub type RopeKey = (u32, usize);

pub fn key(rope: Rope, head_dim: usize) -> RopeKey {
    (rope.theta.to_bits(), head_dim)
}

/// The `(cos, sin)` pairs of one rotation by position, grown on demand.
pub struct RopeTable {
    pub key: RopeKey,
    /// `[position][pair] = (cos, sin)`: `head_dim` values per position.
    pairs: Vec<f32>,
}

impl RopeTable {
    pub fn new(key: RopeKey) -> Self {
        RopeTable {
            key,
            pairs: Vec::new(),
        }
    }

    /// The `head_dim` values of position `pos`: `(cos, sin)` of pair 0, then pair 1, ...
    pub fn at(&mut self, pos: usize) -> &[f32] {
        let (theta, hd) = (f32::from_bits(self.key.0), self.key.1);
        while self.pairs.len() < (pos + 1) * hd {
            let p = self.pairs.len() / hd;
            for i in 0..hd / 2 {
                let (c, s) = rope_angle(p, i, hd, theta);
                self.pairs.extend([c, s]);
            }
        }
        &self.pairs[pos * hd..(pos + 1) * hd]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::RopeStyle;

    #[test]
    fn positions_read_back_rope_angle_in_any_order() {
        let rope = Rope {
            theta: 100_000.0,
            style: RopeStyle::Interleaved,
        };
        let mut table = RopeTable::new(key(rope, 64));
        for pos in [700, 3, 0, 701, 64, 699] {
            let row = table.at(pos).to_vec();
            assert_eq!(row.len(), 64);
            for i in 0..32 {
                let (c, s) = rope_angle(pos, i, 64, rope.theta);
                assert_eq!(
                    (row[2 * i].to_bits(), row[2 * i + 1].to_bits()),
                    (c.to_bits(), s.to_bits())
                );
            }
        }
    }
}
