//! The recurrent state of linear-attention layers (Gated DeltaNet), beside the K/V of the attention layers.
//!
//! An attention layer's cache is rolled back by forgetting slots; a recurrent layer has one state that every
//! token has folded into, which cannot be unfolded. So the state is kept as it was before the latest forward
//! (`base`) and after each of that forward's rows: a rollback to any row of it (a rejected speculative
//! suffix), or the path of a draft tree (each row stepped from its parent's state), picks the state after the
//! last row kept. A rollback before the latest forward cannot be served: the cache is emptied and the caller
//! prefills again (as for a local layer's overwritten window). Forwards that no verifier judges row by row
//! (prefill chunks) keep the state after their last row only, which bounds the memory at real sizes. A row is
//! stepped out of place, from its parent's state into a buffer of its own ([`Recurrent::step`]), so keeping
//! every row's state costs no copy.
//!
//! The states live in host memory: the layers that read them compute on the host (`model::delta_net`).

/// The states of a model's recurrent layers (an empty state for every other layer).
#[derive(Debug, Clone)]
pub struct Recurrent {
    /// Per layer, the length of its state (0: not recurrent).
    lens: Vec<usize>,
    /// The fill before the latest forward, and every layer's state there.
    base: usize,
    base_states: Vec<Vec<f32>>,
    /// After each row of the latest forward, every layer's state, where kept (always the last row's).
    rows: Vec<Option<Vec<Vec<f32>>>>,
    /// Whether the latest forward keeps every row's state.
    keep_all: bool,
    /// The state after the row a layer stepped last where that row's states are not kept, and which (layer,
    /// row) that is.
    work: Vec<f32>,
    work_holds: Option<(usize, usize)>,
    /// Dropped rows' state buffers, reused (a state is megabytes at real sizes: fresh ones would cost page
    /// faults on every verify), and single layers' buffers.
    spare: Vec<Vec<Vec<f32>>>,
    spare_layers: Vec<Vec<f32>>,
}

impl Recurrent {
    /// The zero state of layers with state lengths `lens` (0: a layer without one).
    pub fn new(lens: Vec<usize>) -> Self {
        let base_states = lens.iter().map(|&n| vec![0.0; n]).collect();
        Recurrent {
            lens,
            base: 0,
            base_states,
            rows: Vec::new(),
            keep_all: false,
            work: Vec::new(),
            work_holds: None,
            spare: Vec::new(),
            spare_layers: Vec::new(),
        }
    }

    /// Per layer, the length of its state (0: not recurrent).
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// The fill whose state [`Recurrent::current`] holds.
    fn fill(&self) -> usize {
        self.base + self.rows.len()
    }

    /// Every layer's state at the committed fill.
    pub fn current(&self) -> &[Vec<f32>] {
        match self.rows.last() {
            Some(last) => last.as_ref().expect("the last row's state is kept"),
            None => &self.base_states,
        }
    }

    /// Give rows' buffers back for reuse.
    fn recycle(&mut self, rows: impl IntoIterator<Item = Option<Vec<Vec<f32>>>>) {
        self.spare.extend(rows.into_iter().flatten());
    }

    /// Start a forward of `rows` rows at fill `len` (the cache's committed fill): its rows' states follow, every
    /// row's where `keep_all` (a verify, which may keep any prefix or tree path of its rows), else the last's.
    pub(crate) fn begin(&mut self, len: usize, rows: usize, keep_all: bool) {
        debug_assert_eq!(len, self.fill(), "the states follow the cache's fill");
        if let Some(last) = self.rows.pop() {
            let old = std::mem::replace(
                &mut self.base_states,
                last.expect("the last row's state is kept"),
            );
            self.spare.push(old);
        }
        let dropped = std::mem::take(&mut self.rows);
        self.recycle(dropped);
        self.base = len;
        self.rows = vec![None; rows];
        self.keep_all = keep_all;
        self.work_holds = None;
    }

    /// Whether the states after row `row` of the current forward are kept.
    pub(crate) fn keeps(&self, row: usize) -> bool {
        self.keep_all || row + 1 == self.rows.len()
    }

    /// Layer `l`'s state before row `row` — its parent row's (`None`: the state before the forward) — and a
    /// buffer of the layer's state length for the state after it (its contents unspecified: the step writes it
    /// whole), to hand back with [`Recurrent::stepped`]. Stepping from one buffer into another keeps every kept
    /// row's state without a copy.
    pub(crate) fn step(
        &mut self,
        l: usize,
        row: usize,
        parent: Option<usize>,
    ) -> (&[f32], Vec<f32>) {
        debug_assert!(parent.is_none_or(|p| p < row));
        let mut to = self.spare_layers.pop().unwrap_or_default();
        to.resize(self.lens[l], 0.0);
        let from = match parent {
            None => &self.base_states[l],
            Some(p) if self.work_holds == Some((l, p)) => &self.work,
            Some(p) => &self.rows[p].as_ref().expect("a parent's state is kept")[l],
        };
        (from, to)
    }

    /// The state of layer `l` after row `row`, stepped into the buffer [`Recurrent::step`] gave: kept where that
    /// row's states are, else held until the next row of the layer has stepped from it (call it layer by layer
    /// in order, each layer's rows in order).
    pub(crate) fn stepped(&mut self, l: usize, row: usize, state: Vec<f32>) {
        if !self.keeps(row) {
            let old = std::mem::replace(&mut self.work, state);
            self.spare_layers.push(old);
            self.work_holds = Some((l, row));
            return;
        }
        if self.rows[row].is_none() {
            let mut bufs = self.spare.pop().unwrap_or_default();
            bufs.resize_with(self.lens.len(), Vec::new);
            self.rows[row] = Some(bufs);
        }
        let slot = &mut self.rows[row].as_mut().expect("just made")[l];
        let old = std::mem::replace(slot, state);
        self.spare_layers.push(old);
    }

    /// Roll back to fill `len`; `false` where the state there is not kept (the caller empties the cache).
    pub(crate) fn truncate(&mut self, len: usize) -> bool {
        if len == self.fill() {
            return true;
        }
        if len < self.base {
            return false;
        }
        let kept = len - self.base;
        if kept > 0 && self.rows[kept - 1].is_none() {
            return false;
        }
        let dropped = self.rows.split_off(kept);
        self.recycle(dropped);
        self.work_holds = None;
        true
    }

    /// Keep the latest forward's rows at offsets `rows` (a draft tree's accepted path, each row a child of the
    /// one before) as its first rows, and drop the rest: the state after the path is its last row's.
    pub(crate) fn keep_rows(&mut self, base: usize, rows: &[usize]) {
        debug_assert_eq!(base, self.base);
        let mut all = std::mem::take(&mut self.rows);
        self.rows = rows.iter().map(|&r| all[r].take()).collect();
        debug_assert!(self.rows.iter().all(Option::is_some));
        self.recycle(all);
        self.work_holds = None;
    }

    /// Back to the zero state at fill 0.
    pub(crate) fn reset(&mut self) {
        *self = Recurrent::new(std::mem::take(&mut self.lens));
    }

    /// Replace the states with `states` (a checkpoint's) at fill `len`.
    pub(crate) fn restore(&mut self, len: usize, states: Vec<Vec<f32>>) {
        debug_assert!(states.iter().zip(&self.lens).all(|(s, &n)| s.len() == n));
        self.base = len;
        let old = std::mem::replace(&mut self.base_states, states);
        self.spare.push(old);
        let dropped = std::mem::take(&mut self.rows);
        self.recycle(dropped);
        self.work_holds = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Layer 1 recurrent (2 values), layer 0 not: a row's state is `[its parent's first value + 1, the row]`.
    fn stepped(r: &mut Recurrent, len: usize, parents: &[Option<usize>]) {
        r.begin(len, parents.len(), true);
        for (row, &p) in parents.iter().enumerate() {
            let (_, none) = r.step(0, row, p);
            r.stepped(0, row, none);
            step_one(r, row, p);
        }
    }

    /// Layer 1's step of `row` from `parent`: `[the parent's first value + 1, the row]`.
    fn step_one(r: &mut Recurrent, row: usize, parent: Option<usize>) {
        let (from, mut to) = r.step(1, row, parent);
        to[0] = from[0] + 1.0;
        to[1] = row as f32;
        r.stepped(1, row, to);
    }

    #[test]
    fn a_rollback_within_the_latest_forward_restores_the_state_after_the_kept_rows() {
        let mut r = Recurrent::new(vec![0, 2]);
        stepped(&mut r, 0, &[None, Some(0), Some(1)]);
        assert_eq!(r.current()[1], vec![3.0, 2.0]);
        stepped(&mut r, 3, &[None, Some(0), Some(1), Some(2)]);
        assert_eq!(r.current()[1], vec![7.0, 3.0]);
        assert!(r.truncate(5));
        assert_eq!(r.current()[1], vec![5.0, 1.0]);
        assert!(r.truncate(3));
        assert_eq!(r.current()[1], vec![3.0, 2.0]);
        // Before the latest forward: not kept.
        assert!(!r.truncate(2));
    }

    #[test]
    fn a_tree_path_keeps_the_state_of_its_last_row() {
        let mut r = Recurrent::new(vec![0, 2]);
        // Rows 1 and 2 are both children of row 0; row 3 a child of row 2.
        stepped(&mut r, 0, &[None, Some(0), Some(0), Some(2)]);
        r.keep_rows(0, &[0, 2, 3]);
        assert_eq!(r.current()[1], vec![3.0, 3.0]);
        assert!(r.truncate(2));
        assert_eq!(r.current()[1], vec![2.0, 2.0]);
    }

    #[test]
    fn forwards_without_a_verifier_keep_their_last_row_only() {
        let mut r = Recurrent::new(vec![0, 2]);
        r.begin(0, 40, false);
        for row in 0..40 {
            step_one(&mut r, row, row.checked_sub(1));
        }
        assert_eq!(r.current()[1], vec![40.0, 39.0]);
        assert!(!r.truncate(39));
        assert!(r.truncate(40));
        r.reset();
        assert_eq!(r.current()[1], vec![0.0, 0.0]);
    }
}
