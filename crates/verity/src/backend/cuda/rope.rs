//! RoPE angle tables for the CUDA backend.
//!
//! Every step uploads, with its tokens and positions, the `(cos, sin)` pairs of its rows for each rotation the
//! loaded models prepared (`Backend::prepare_attention`). The kernels read the angles instead of computing
//! them, so a rotation on the GPU is bitwise the CPU backend's (both are [`Rope::angle`]'s values) and no
//! double-precision transcendental sits on the Q/K/V projection's critical path. The host computes each
//! position's pairs once.

use crate::backend::Rope;

/// A rotation by `(Rope::key, head_dim)`.
pub type RopeKey = (u64, usize);

pub fn key(rope: Rope, head_dim: usize) -> RopeKey {
    (rope.key(), head_dim)
}

/// The `(cos, sin)` pairs of one rotation by position, grown on demand.
pub struct RopeTable {
    pub key: RopeKey,
    rope: Rope,
    /// `[position][pair] = (cos, sin)`: `head_dim` values per position.
    pairs: Vec<f32>,
}

impl RopeTable {
    pub fn new(rope: Rope, head_dim: usize) -> Self {
        RopeTable {
            key: key(rope, head_dim),
            rope,
            pairs: Vec::new(),
        }
    }

    /// The `head_dim` values of position `pos`: `(cos, sin)` of pair 0, then pair 1, ... — of the rotated pairs
    /// where RoPE rotates part of each head, then `(1, 0)` (the table's stride stays `head_dim`).
    pub fn at(&mut self, pos: usize) -> &[f32] {
        let hd = self.key.1;
        let rotated = self.rope.rotated(hd);
        while self.pairs.len() < (pos + 1) * hd {
            let p = self.pairs.len() / hd;
            for i in 0..hd / 2 {
                let (c, s) = if i < rotated / 2 {
                    self.rope.angle(p, i, rotated)
                } else {
                    (1.0, 0.0)
                };
                self.pairs.extend([c, s]);
            }
        }
        &self.pairs[pos * hd..(pos + 1) * hd]
    }

    /// The `head_dim` values of a row at the temporal, height and width positions `pos` of a multimodal
    /// rotation ([`Rope::mrope`]): each pair's `(cos, sin)` as [`RopeTable::at`] gives it at the position its
    /// section turns with (so the values are [`Rope::angle_at`]'s, as on the CPU).
    pub fn at_multimodal(&mut self, pos: [usize; 3]) -> Vec<f32> {
        let hd = self.key.1;
        self.at(pos.into_iter().max().unwrap_or(0));
        (0..hd / 2)
            .flat_map(|i| {
                let at = pos[self.rope.section(i)] * hd + 2 * i;
                [self.pairs[at], self.pairs[at + 1]]
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::RopeStyle;

    #[test]
    fn multimodal_rows_take_each_section_at_its_own_position() {
        let rope = Rope {
            theta: 10_000.0,
            style: RopeStyle::HalfSplit,
            scaling: crate::backend::RopeScaling::None,
            dims: None,
            mrope: Some([2, 5, 5]),
        };
        let mut table = RopeTable::new(rope, 24);
        for pos in [[5, 5, 9], [7, 3, 0], [4, 4, 4]] {
            let row = table.at_multimodal(pos);
            for i in 0..12 {
                let (c, s) = rope.angle_at(pos, i, 24);
                assert_eq!(
                    (row[2 * i].to_bits(), row[2 * i + 1].to_bits()),
                    (c.to_bits(), s.to_bits())
                );
            }
        }
        // A text row's three positions are one: the plain row.
        assert_eq!(table.at_multimodal([6; 3]), table.at(6).to_vec());
    }

    #[test]
    fn positions_read_back_the_rotation_angles_in_any_order() {
        let rope = Rope {
            theta: 100_000.0,
            style: RopeStyle::Interleaved,
            scaling: crate::backend::RopeScaling::Linear { factor: 8.0 },
            dims: None,
            mrope: None,
        };
        let mut table = RopeTable::new(rope, 64);
        for pos in [700, 3, 0, 701, 64, 699] {
            let row = table.at(pos).to_vec();
            assert_eq!(row.len(), 64);
            for i in 0..32 {
                let (c, s) = rope.angle(pos, i, 64);
                assert_eq!(
                    (row[2 * i].to_bits(), row[2 * i + 1].to_bits()),
                    (c.to_bits(), s.to_bits())
                );
            }
        }
        // Qwen3-Next's partial rotation: a quarter of each head, at the frequencies of that quarter.
        let partial = Rope {
            dims: Some(16),
            ..rope
        };
        let mut table = RopeTable::new(partial, 64);
        let row = table.at(9).to_vec();
        for i in 0..32 {
            let (c, s) = if i < 8 {
                partial.angle(9, i, 16)
            } else {
                (1.0, 0.0)
            };
            assert_eq!((row[2 * i], row[2 * i + 1]), (c, s));
        }
    }
}
