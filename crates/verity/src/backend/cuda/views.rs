//! Each row's view of a tree-masked step, as the attention kernels read it.
//!
//! The kernels sum a row's keys in an order fixed by each key's index (chunks of 64, a halving tree within a
//! chunk): the same bits whatever else shares the launch, provided every key has the index it would have in a
//! one-row step at the row's position. Under a causal mask that index is the cache slot. A draft tree breaks it:
//! a node's ancestors sit at the slots their rows were given, with its siblings' and cousins' slots in between,
//! so the same keys would fall into other lanes and chunks, the sums would associate differently, and a tree
//! verify would drift from AR in the last bits — enough to flip a near-tie argmax. So a tree step carries, per
//! row, the step rows it sees in row order (a node's ancestors, then itself): the kernels read the row's `k`-th
//! visible key of the step at index `base + k`, exactly where AR's one-row step holds it after the path is
//! committed. (Masks that are not trees, such as an image's bidirectional rows, are read the same way: each row's
//! keys in order, at consecutive indices.)
//!
//! Layout at the step's views offset: `u16 counts[rows]` (how many step rows row `i` sees), then
//! `u16 seen[rows][rows]` (row `i`'s seen rows in increasing order, from `seen[i][0]`).

/// The bytes the views of a step of up to `cap` rows take.
pub fn views_bytes(cap: usize) -> usize {
    2 * (cap + cap * cap)
}

/// Write the views of a `rows`-row step under the row-major visibility matrix `visible` into `out`; returns the
/// bytes written.
pub fn write_views(visible: &[bool], rows: usize, out: &mut [u8]) -> usize {
    assert_eq!(visible.len(), rows * rows, "a {rows}-row mask");
    assert!(
        rows <= usize::from(u16::MAX),
        "{rows} rows exceed a view's index"
    );
    let mut put =
        |at: usize, v: usize| out[2 * at..2 * at + 2].copy_from_slice(&(v as u16).to_le_bytes());
    for i in 0..rows {
        let mut count = 0;
        for j in 0..rows {
            if visible[i * rows + j] {
                put(rows + i * rows + count, j);
                count += 1;
            }
        }
        put(i, count);
    }
    views_bytes(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(out: &[u8], rows: usize) -> Vec<Vec<u16>> {
        let at = |k: usize| u16::from_le_bytes([out[2 * k], out[2 * k + 1]]);
        (0..rows)
            .map(|i| {
                (0..at(i) as usize)
                    .map(|k| at(rows + i * rows + k))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn a_tree_rows_view_is_its_path_from_the_root() {
        // pending(0) → a(1), b(2); a → c(3); b → d(4); d → e(5).
        let parents = [None, Some(0), Some(0), Some(1), Some(2), Some(4)];
        let rows = parents.len();
        let mut visible = vec![false; rows * rows];
        for i in 0..rows {
            let mut at = Some(i);
            while let Some(j) = at {
                visible[i * rows + j] = true;
                at = parents[j];
            }
        }
        let mut out = vec![0xaa; views_bytes(8)];
        assert_eq!(write_views(&visible, rows, &mut out), views_bytes(rows));
        let views = read(&out, rows);
        assert_eq!(views[0], [0]);
        assert_eq!(views[3], [0, 1, 3]);
        // Row 5 sits at depth 3: its keys go to indices base..base + 3, the slots AR gives that path.
        assert_eq!(views[5], [0, 2, 4, 5]);
    }

    #[test]
    fn a_causal_mask_reads_as_the_slots_themselves() {
        let rows = 5;
        let visible: Vec<bool> = (0..rows * rows).map(|x| x % rows <= x / rows).collect();
        let mut out = vec![0; views_bytes(rows)];
        write_views(&visible, rows, &mut out);
        for (i, v) in read(&out, rows).iter().enumerate() {
            assert_eq!(*v, (0..=i as u16).collect::<Vec<_>>());
        }
    }
}
