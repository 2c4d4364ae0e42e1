//! Shared-memory geometry of the projection launches, as pure functions of the shape (`kernels.cu` lays its
//! shared memory out the same way; a launch asks for what these return).

/// The float projection kernel (`matmuls`): rows staged per block, floats per staged 32-value block.
pub const ROWS_PER_GROUP: usize = 8;
pub const XPAD: usize = 36;
/// The integer projection kernels (`qmatmuls_*`): ints per (block, row) of exchanged sums, the most blocks per
/// exchange chunk, and the shared memory the exchange may take.
pub const QM_STRIDE: usize = 20;
pub const QM_CHUNK_MAX: usize = 64;
pub const QM_EXCHANGE_BYTES: usize = 48 * 1024;

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
}

/// The geometry of a `qmatmuls_*` launch of `rows` rows of `k` values within `budget` bytes of shared memory,
/// or `None` where it does not fit. x is not staged (`quantize_x` has quantized it once for the launch): the wide
/// schedule keeps nothing in shared memory; the narrow one keeps its tile's scales and the exchange of integer
/// sums, in chunks of as many blocks as the exchange's budget holds.
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
    let rows_pad = if rows <= 8 { 8 } else { 16 };
    let per_block = rows_pad * QM_STRIDE * 4 * mats.per_tile * mats.sums;
    let chunk = (k / 32)
        .min(QM_CHUNK_MAX)
        .min((QM_EXCHANGE_BYTES / per_block).max(1));
    let bytes = mats.per_tile * mats.scale_bytes + chunk * per_block;
    (bytes <= budget).then_some(QGeometry { bytes, chunk })
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200: usize = 227 * 1024 - 1024;

    fn legacy(k: usize, per_tile: usize) -> QMats {
        QMats {
            per_tile,
            sums: 1,
            scale_bytes: k / 32 * 64,
        }
    }

    #[test]
    fn the_exchange_takes_whole_blocks_within_its_budget() {
        // SmolLM2's down projection at 16 rows: chunks of 64 blocks capped by the exchange.
        let g = q_geometry(16, 1536, false, legacy(1536, 1), H200).unwrap();
        assert_eq!(g.chunk, 38); // 48 KiB of exchange at 1,280 bytes a block
        assert_eq!(g.bytes, 48 * 64 + g.chunk * 16 * 20 * 4);
        // One row of gate and up: 8 padded rows, two matrices, 1,280 bytes a block again; one matrix, 640 bytes
        // a block, up to the 64-block cap.
        assert_eq!(
            q_geometry(1, 4096, false, legacy(4096, 2), H200)
                .unwrap()
                .chunk,
            38
        );
        assert_eq!(
            q_geometry(1, 4096, false, legacy(4096, 1), H200)
                .unwrap()
                .chunk,
            64
        );
    }

    #[test]
    fn long_rows_run_and_only_their_scales_grow() {
        // An 8B model's down projection (14,336 values) and a 70B one's (28,672), at 1, 8 and 16 rows.
        for k in [14_336, 28_672] {
            for rows in [1, 8, 16] {
                for mats in [legacy(k, 1), legacy(k, 2)] {
                    let g = q_geometry(rows, k, false, mats, H200).unwrap();
                    assert!(g.bytes <= H200, "{k} {rows}: {g:?}");
                    assert!(g.chunk >= 1);
                }
            }
        }
        assert_eq!(
            q_geometry(16, 28_672, true, legacy(28_672, 2), H200),
            Some(QGeometry { bytes: 0, chunk: 0 })
        );
    }

    #[test]
    fn a_budget_without_room_for_the_scales_and_one_chunk_is_refused() {
        assert!(q_geometry(16, 4096, false, legacy(4096, 1), 20_000).is_none());
    }
}
