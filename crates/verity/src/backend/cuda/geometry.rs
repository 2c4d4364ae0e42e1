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

/// Bytes of `kernels.cu`'s `stage_q8` layout for a window of `blocks` 32-value blocks: the 8-bit rows (padded to
/// 8 or 16, each 16 bytes longer than the window against bank conflicts), their per-block scales and sums, 16
/// norm scales.
fn stage_bytes(rows_pad: usize, blocks: usize) -> usize {
    rows_pad * (blocks * 32 + 16) + 2 * rows_pad * blocks * 4 + 16 * 4
}

/// What an integer projection launch stages and exchanges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QGeometry {
    /// Dynamic shared memory to ask for.
    pub bytes: usize,
    /// Blocks per exchange chunk (narrow schedule; 0 in the wide one).
    pub chunk: usize,
    /// Blocks of x staged at a time: the whole row, or (narrow schedule, long rows) a multiple of `chunk`.
    pub window: usize,
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
/// or `None` where it does not fit: the wide schedule stages whole rows; the narrow one stages the whole row
/// where it fits beside the tile's scales and the exchange, else the most whole exchange chunks that do, so any
/// row length runs.
pub fn q_geometry(
    rows: usize,
    k: usize,
    wide: bool,
    mats: QMats,
    budget: usize,
) -> Option<QGeometry> {
    let rows_pad = if rows <= 8 { 8 } else { 16 };
    let nb = k / 32;
    if wide {
        let bytes = stage_bytes(rows_pad, nb);
        return (bytes <= budget).then_some(QGeometry {
            bytes,
            chunk: 0,
            window: nb,
        });
    }
    let per_block = rows_pad * QM_STRIDE * 4 * mats.per_tile * mats.sums;
    let chunk = nb
        .min(QM_CHUNK_MAX)
        .min((QM_EXCHANGE_BYTES / per_block).max(1));
    let fixed = mats.per_tile * mats.scale_bytes + chunk * per_block;
    let window = if fixed + stage_bytes(rows_pad, nb) <= budget {
        nb
    } else {
        let room = budget.checked_sub(fixed + stage_bytes(rows_pad, 0))?;
        let blocks = room / (stage_bytes(rows_pad, 1) - stage_bytes(rows_pad, 0));
        let window = blocks / chunk * chunk;
        if window == 0 {
            return None;
        }
        window
    };
    Some(QGeometry {
        bytes: fixed + stage_bytes(rows_pad, window),
        chunk,
        window,
    })
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
    fn rows_that_fit_are_staged_whole_as_before() {
        // SmolLM2's down projection at 16 rows: the whole row, chunks of 64 blocks capped by the exchange.
        let g = q_geometry(16, 1536, false, legacy(1536, 1), H200).unwrap();
        assert_eq!(g.window, 48);
        assert_eq!(g.chunk, 38); // 48 KiB of exchange at 1,280 bytes a block
        assert_eq!(
            g.bytes,
            16 * (1536 + 16) + 2 * 16 * 48 * 4 + 64 + 48 * 64 + g.chunk * 16 * 20 * 4
        );
    }

    #[test]
    fn long_rows_are_staged_in_windows_of_whole_chunks_within_the_budget() {
        // An 8B model's down projection (14,336 values) at 16 rows, and a 70B one's (28,672).
        for k in [14_336, 28_672] {
            for rows in [1, 8, 16] {
                for mats in [legacy(k, 1), legacy(k, 2)] {
                    let g = q_geometry(rows, k, false, mats, H200).unwrap();
                    assert!(g.bytes <= H200, "{k} {rows}: {g:?}");
                    assert!(
                        g.window == k / 32 || g.window.is_multiple_of(g.chunk),
                        "{g:?}"
                    );
                    assert!(g.window >= g.chunk);
                }
            }
        }
        let g = q_geometry(16, 14_336, false, legacy(14_336, 1), H200).unwrap();
        assert!(g.window < 14_336 / 32);
        // The wide schedule stages whole rows or does not run.
        assert!(q_geometry(16, 14_336, true, legacy(14_336, 1), H200).is_none());
        assert!(q_geometry(16, 4096, true, legacy(4096, 1), H200).is_some());
    }

    #[test]
    fn a_budget_without_room_for_one_chunk_is_refused() {
        assert!(q_geometry(16, 4096, false, legacy(4096, 1), 20_000).is_none());
    }
}
