//! Shared-memory geometry of the projection launches, as pure functions of the shape (`kernels.cu` lays its
//! shared memory out the same way; a launch asks for what these return).

use super::STREAM_SLOT;
use crate::backend::INT8_RUNS;

/// The float projection kernel (`matmuls`): rows staged per block, floats per staged 32-value block.
pub const ROWS_PER_GROUP: usize = 8;
pub const XPAD: usize = 36;

/// Shared memory a `matmuls` launch of `rows` rows of `k` values stages x in: the kernel computes a
/// power-of-two number of rows per group (reading, never storing, those past the group's), so room for that
/// many, then a fused norm's scratch (a float per row and 32-value block).
pub fn staged_bytes(rows: usize, k: usize) -> usize {
    let group = rows.min(ROWS_PER_GROUP);
    (group.next_power_of_two() * XPAD + group) * (k / 32) * 4
}

/// Tiles of a GEMM-schedule CTA (`kernels.cu`'s `GM_WARPS`, a warp each; gate/up pairs take two), blocks per
/// stage of its pipeline (`GM_KC`) and stages (`GM_STAGES`).
pub const GEMM_WARPS: usize = 8;
const GEMM_KC: usize = 4;
const GEMM_STAGES: usize = 3;
/// A GEMM-schedule CTA's shared memory: per stage, 64 rows of x (GM_KC blocks and 16 bytes of padding each),
/// their (scale, sum) pairs (two floats of padding a row) and each warp's GM_KC blocks in stream slots. The
/// kernel checks its own sum against this one (`GM_SHARED_BYTES`, passed at compilation).
pub const GEMM_SHARED_BYTES: usize = GEMM_STAGES
    * (64 * (GEMM_KC * 32 + 16) + 64 * (GEMM_KC * 2 + 2) * 4 + GEMM_WARPS * GEMM_KC * STREAM_SLOT);

/// What an integer projection launch keeps in shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QGeometry {
    /// Dynamic shared memory to ask for.
    pub bytes: usize,
}

/// The geometry of a `qmatmuls_*` launch of `rows` rows of `k` values, `per_tile` matrices per tile (2 for
/// gate/up), within `budget` bytes of shared memory, or `None` where it does not fit. x is not staged
/// (`quantize_x` has quantized it once for the launch): the wide schedule keeps nothing in shared memory; the
/// narrow one keeps its warps' weight stream (`stream` bytes) and each run's sums (`kernels.cu`'s
/// `split_tile`): a float per run, matrix, (column, row) of its MMA n-tiles (8 rows each) — at most 128 KiB (64
/// rows of gate and up, the tall schedule).
pub fn q_geometry(
    rows: usize,
    k: usize,
    wide: bool,
    per_tile: usize,
    stream: usize,
    budget: usize,
) -> Option<QGeometry> {
    if wide {
        return Some(QGeometry { bytes: 0 });
    }
    let runs = INT8_RUNS.min(k / 32);
    let n_tiles = rows.div_ceil(8);
    let bytes = stream + runs * per_tile * n_tiles * 16 * 8 * 4;
    (bytes <= budget).then_some(QGeometry { bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200: usize = 227 * 1024 - 1024;

    #[test]
    fn the_narrow_schedule_keeps_each_runs_sums() {
        // An 8B model's gate/up at one row: 16 runs x 2 matrices x 128 (column, row) slots.
        assert_eq!(
            q_geometry(1, 4096, false, 2, 0, H200),
            Some(QGeometry {
                bytes: 16 * 2 * 128 * 4
            })
        );
        // 16 rows take two n-tiles; short rows fewer runs (one per block).
        assert_eq!(
            q_geometry(16, 14_336, false, 1, 0, H200).unwrap().bytes,
            16 * 256 * 4
        );
        assert_eq!(
            q_geometry(1, 192, false, 1, 0, H200).unwrap().bytes,
            6 * 128 * 4
        );
        assert_eq!(
            q_geometry(16, 28_672, true, 2, 0, H200),
            Some(QGeometry { bytes: 0 })
        );
        assert!(q_geometry(16, 4096, false, 2, 0, 1024).is_none());
        // The tall schedule's 64 rows: eight n-tiles.
        assert_eq!(
            q_geometry(64, 4096, false, 2, 0, H200).unwrap().bytes,
            16 * 2 * 8 * 128 * 4
        );
        assert_eq!(
            q_geometry(37, 4096, false, 1, 0, H200).unwrap().bytes,
            16 * 5 * 128 * 4
        );
        // A weight stream of 4 slots per warp of a 16-warp CTA comes first.
        assert_eq!(
            q_geometry(1, 4096, false, 2, 16 * 4 * 640, H200)
                .unwrap()
                .bytes,
            16 * 4 * 640 + 16 * 2 * 128 * 4
        );
    }
}
