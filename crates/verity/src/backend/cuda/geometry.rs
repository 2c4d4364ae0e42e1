//! Shared-memory geometry of the projection launches, as pure functions of the shape (`kernels.cu` lays its
//! shared memory out the same way; a launch asks for what these return).

/// The float projection kernel (`matmuls`): rows staged per block, floats per staged 32-value block.
pub const ROWS_PER_GROUP: usize = 8;
pub const XPAD: usize = 36;
/// The integer projection kernels (`qmatmuls_*`): ints per (block, row) of exchanged sums; the most blocks per
/// chunk, and the fewest a chunk takes before a CTA gives up sharing its SM; the shared-memory stages a
/// narrow-schedule CTA streams its quants through (`kernels.cu`'s `QM_STAGES`, set from here).
pub const QM_STRIDE: usize = 20;
pub const QM_CHUNK_MAX: usize = 64;
pub const QM_CHUNK_MIN: usize = 8;
pub const QM_STAGES: usize = 4;

/// Shared memory a `matmuls` launch of `rows` rows of `k` values stages x in: the kernel computes a
/// power-of-two number of rows per group (reading, never storing, those past the group's), so room for that
/// many, then a fused norm's scratch (a float per row and 32-value block).
pub fn staged_bytes(rows: usize, k: usize) -> usize {
    let group = rows.min(ROWS_PER_GROUP);
    (group.next_power_of_two() * XPAD + group) * (k / 32) * 4
}

/// What an integer projection launch keeps in shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QGeometry {
    /// Dynamic shared memory to ask for.
    pub bytes: usize,
    /// Blocks per exchange chunk (narrow schedule; 0 in the wide one).
    pub chunk: usize,
}

/// The matrices a launch's tiles come from, as the geometry sees them.
#[derive(Clone, Copy, Debug)]
pub struct QMats {
    /// Matrices per tile (2 for gate/up).
    pub per_tile: usize,
    /// The most integer sums per block of any of them (Q6_K: 2).
    pub sums: usize,
    /// The most scale bytes of one of their tiles.
    pub scale_bytes: usize,
    /// The most quant bytes of one of their (tile, block)s.
    pub quant_bytes: usize,
}

/// The geometry of a `qmatmuls_*` launch of `rows` rows of `k` values within `budget` bytes of shared memory,
/// or `None` where it does not fit. x is not staged (`quantize_x` has quantized it once for the launch): the wide
/// schedule keeps nothing in shared memory; the narrow one keeps its tiles' scales, `QM_STAGES` chunks of
/// quants and the exchange of one chunk's integer sums for its rows. A chunk takes as many blocks as leave room
/// for a second CTA on the SM (two CTAs keep twice the copies in flight), at least `QM_CHUNK_MIN`; failing
/// that, as many as the whole budget holds. A chunk is the whole row, or a multiple of 8 blocks where it can be.
pub fn q_geometry(
    rows: usize,
    k: usize,
    wide: bool,
    mats: QMats,
    budget: usize,
) -> Option<QGeometry> {
    if wide {
        return Some(QGeometry { bytes: 0, chunk: 0 });
    }
    let nb = k / 32;
    let fixed = mats.per_tile * mats.scale_bytes;
    let per_block =
        mats.per_tile * (QM_STAGES * mats.quant_bytes + mats.sums * rows * QM_STRIDE * 4);
    let blocks = |room: usize| {
        let c = (room.checked_sub(fixed)? / per_block).min(QM_CHUNK_MAX);
        Some(if c >= nb {
            nb
        } else if c >= 8 {
            c / 8 * 8
        } else {
            c
        })
    };
    let chunk = match blocks(budget / 2) {
        Some(c) if c >= QM_CHUNK_MIN.min(nb) => c,
        _ => blocks(budget).filter(|&c| c >= 1)?,
    };
    Some(QGeometry {
        bytes: fixed + chunk * per_block,
        chunk,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200: usize = 227 * 1024 - 1024;

    fn q4_k(k: usize, per_tile: usize) -> QMats {
        QMats {
            per_tile,
            sums: 1,
            scale_bytes: k / 32 * 40,
            quant_bytes: 256,
        }
    }

    #[test]
    fn chunks_leave_room_for_a_second_cta_on_the_sm() {
        // An 8B model's gate/up (4,096 values, two matrices) at one row: 10 KiB of scales, 2,208 bytes a
        // block (four stages of 256 bytes and 80 bytes of sums, per matrix): 47 blocks fit half the budget,
        // 40 as a multiple of 8.
        let g = q_geometry(1, 4096, false, q4_k(4096, 2), H200).unwrap();
        assert_eq!(g.chunk, 40);
        assert_eq!(g.bytes, 2 * 128 * 40 + 40 * 2208);
        assert!(2 * g.bytes <= H200);
        // Its down projection (14,336 values): the 64-block cap.
        assert_eq!(
            q_geometry(1, 14_336, false, q4_k(14_336, 1), H200)
                .unwrap()
                .chunk,
            64
        );
        // Short rows: a chunk is the whole row.
        assert_eq!(
            q_geometry(16, 576, false, q4_k(576, 1), H200)
                .unwrap()
                .chunk,
            18
        );
        assert_eq!(
            q_geometry(1, 192, false, q4_k(192, 1), H200).unwrap().chunk,
            6
        );
    }

    #[test]
    fn long_rows_and_many_rows_run_in_smaller_chunks() {
        for k in [14_336, 28_672] {
            for rows in [1, 8, 16] {
                for mats in [q4_k(k, 1), q4_k(k, 2)] {
                    let g = q_geometry(rows, k, false, mats, H200).unwrap();
                    assert!(g.bytes <= H200, "{k} {rows}: {g:?}");
                    assert!(g.chunk >= QM_CHUNK_MIN, "{k} {rows}: {g:?}");
                }
            }
        }
        assert_eq!(
            q_geometry(16, 28_672, true, q4_k(28_672, 2), H200),
            Some(QGeometry { bytes: 0, chunk: 0 })
        );
    }

    #[test]
    fn a_budget_without_room_for_the_scales_and_one_block_is_refused() {
        assert!(q_geometry(16, 4096, false, q4_k(4096, 1), 5_000).is_none());
        // Room for fewer than QM_CHUNK_MIN blocks in half the budget: the whole budget is used.
        let g = q_geometry(1, 4096, false, q4_k(4096, 1), 2 * (5_120 + 4 * 1104)).unwrap();
        assert_eq!(g.chunk, 8);
    }
}
