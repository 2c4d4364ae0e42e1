//! The prefix cache: checkpoints of model state keyed by the token prefix they were taken after, in a radix
//! tree over token ids (as SGLang's radix cache), with least-recently-used eviction under a byte budget.
//!
//! Invariants: a stored value belongs to exactly the token sequence on the path from the root to its node; a
//! lookup returns the longest stored prefix of the query (never a sequence that merely shares a prefix with it);
//! the bytes of stored values never exceed the budget after an insert returns (values larger than the whole
//! budget are not stored).

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;

struct Node<V> {
    /// Edge label from the parent (empty for the root).
    edge: Vec<u32>,
    children: BTreeMap<u32, Node<V>>,
    value: Option<Stored<V>>,
}

struct Stored<V> {
    value: V,
    bytes: usize,
    last_used: u64,
}

impl<V> Node<V> {
    fn new(edge: Vec<u32>) -> Self {
        Node {
            edge,
            children: BTreeMap::new(),
            value: None,
        }
    }
}

pub struct PrefixCache<V> {
    root: Node<V>,
    bytes: usize,
    budget: usize,
    clock: u64,
    entries: usize,
}

impl<V> PrefixCache<V> {
    pub fn new(budget: usize) -> Self {
        PrefixCache {
            root: Node::new(Vec::new()),
            bytes: 0,
            budget,
            clock: 0,
            entries: 0,
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    pub fn clear(&mut self) {
        self.root = Node::new(Vec::new());
        self.bytes = 0;
        self.entries = 0;
    }

    /// Store `value` (of `bytes` bytes) for exactly `tokens`, replacing what was stored there; then evict the
    /// least recently used values until the budget holds.
    pub fn insert(&mut self, tokens: &[u32], value: V, bytes: usize) {
        if bytes > self.budget || tokens.is_empty() {
            return;
        }
        self.clock += 1;
        let clock = self.clock;
        let mut node = &mut self.root;
        let mut rest = tokens;
        while !rest.is_empty() {
            match node.children.entry(rest[0]) {
                Entry::Vacant(slot) => {
                    node = slot.insert(Node::new(rest.to_vec()));
                    break;
                }
                Entry::Occupied(slot) => {
                    let child = slot.into_mut();
                    let common = child
                        .edge
                        .iter()
                        .zip(rest)
                        .take_while(|(a, b)| a == b)
                        .count();
                    if common < child.edge.len() {
                        // Split the edge: a new inner node holds the common part.
                        let mut old = std::mem::replace(child, Node::new(rest[..common].to_vec()));
                        old.edge.drain(..common);
                        child.children.insert(old.edge[0], old);
                    }
                    rest = &rest[common..];
                    node = child;
                }
            }
        }
        if let Some(old) = node.value.replace(Stored {
            value,
            bytes,
            last_used: clock,
        }) {
            self.bytes -= old.bytes;
            self.entries -= 1;
        }
        self.bytes += bytes;
        self.entries += 1;
        while self.bytes > self.budget {
            self.evict_oldest();
        }
    }

    /// The longest stored prefix of `tokens`: its length and value (marked as just used).
    pub fn longest(&mut self, tokens: &[u32]) -> Option<(usize, &V)> {
        self.clock += 1;
        let clock = self.clock;
        // Walk once to find the depth of the deepest stored node on the path.
        let mut best = None;
        let mut node = &self.root;
        let mut depth = 0;
        loop {
            if node.value.is_some() && depth > 0 {
                best = Some(depth);
            }
            let Some(child) = tokens.get(depth).and_then(|t| node.children.get(t)) else {
                break;
            };
            let l = child.edge.len();
            if tokens.len() < depth + l || tokens[depth..depth + l] != child.edge[..] {
                break;
            }
            depth += l;
            node = child;
        }
        let best = best?;
        let mut node = &mut self.root;
        let mut depth = 0;
        while depth < best {
            node = node.children.get_mut(&tokens[depth]).expect("on the path");
            depth += node.edge.len();
        }
        let stored = node.value.as_mut().expect("stored at this depth");
        stored.last_used = clock;
        Some((best, &stored.value))
    }

    fn evict_oldest(&mut self) {
        fn oldest<V>(n: &Node<V>, path: &mut Vec<u32>, best: &mut Option<(u64, Vec<u32>)>) {
            if let Some(s) = &n.value {
                if best.as_ref().is_none_or(|(t, _)| s.last_used < *t) {
                    *best = Some((s.last_used, path.clone()));
                }
            }
            for c in n.children.values() {
                path.extend_from_slice(&c.edge);
                oldest(c, path, best);
                path.truncate(path.len() - c.edge.len());
            }
        }
        let mut best = None;
        oldest(&self.root, &mut Vec::new(), &mut best);
        let Some((_, path)) = best else { return };
        if let Some(bytes) = Self::remove(&mut self.root, &path) {
            self.bytes -= bytes;
            self.entries -= 1;
        }
    }

    /// Remove the value stored for `path` below `node`, pruning nodes left without value or children.
    fn remove(node: &mut Node<V>, path: &[u32]) -> Option<usize> {
        if path.is_empty() {
            return node.value.take().map(|s| s.bytes);
        }
        let child = node.children.get_mut(&path[0])?;
        let l = child.edge.len();
        let bytes = Self::remove(child, &path[l..])?;
        if child.value.is_none() && child.children.is_empty() {
            node.children.remove(&path[0]);
        }
        Some(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn longest_returns_the_deepest_stored_prefix_only() {
        let mut c = PrefixCache::new(1000);
        c.insert(&[1, 2, 3], "a", 1);
        c.insert(&[1, 2, 3, 4, 5], "b", 1);
        c.insert(&[1, 9], "c", 1);
        assert_eq!(
            c.longest(&[1, 2, 3, 4, 5, 6]).map(|(n, v)| (n, *v)),
            Some((5, "b"))
        );
        assert_eq!(
            c.longest(&[1, 2, 3, 4]).map(|(n, v)| (n, *v)),
            Some((3, "a"))
        );
        assert_eq!(
            c.longest(&[1, 2]).map(|(n, v)| (n, *v)),
            None,
            "a shared prefix is not a stored one"
        );
        assert_eq!(c.longest(&[1, 9, 9]).map(|(n, v)| (n, *v)), Some((2, "c")));
        assert_eq!(c.len(), 3);
    }

    #[test]
    fn eviction_drops_the_least_recently_used() {
        let mut c = PrefixCache::new(3);
        c.insert(&[1], 1, 1);
        c.insert(&[2], 2, 1);
        c.insert(&[3], 3, 1);
        c.longest(&[1]); // 1 is now more recent than 2
        c.insert(&[4], 4, 1);
        assert!(c.longest(&[2]).is_none());
        assert!(
            c.longest(&[1]).is_some() && c.longest(&[3]).is_some() && c.longest(&[4]).is_some()
        );
        assert_eq!(c.bytes(), 3);
        c.insert(&[5], 5, 10); // larger than the budget: not stored
        assert!(c.longest(&[5]).is_none());
    }

    proptest! {
        /// Against a plain list of (sequence, value): same longest-prefix answers, budget respected.
        #[test]
        fn behaves_like_a_naive_map(ops in proptest::collection::vec(
            (proptest::collection::vec(0u32..4, 1..7), 1usize..5, any::<bool>()), 1..60)) {
            let budget = 12;
            let mut c = PrefixCache::new(budget);
            let mut naive: Vec<(Vec<u32>, usize, usize)> = Vec::new(); // (seq, value, bytes)
            for (i, (seq, bytes, is_insert)) in ops.into_iter().enumerate() {
                if is_insert {
                    c.insert(&seq, i, bytes);
                    naive.retain(|e| e.0 != seq);
                    naive.push((seq.clone(), i, bytes));
                    prop_assert!(c.bytes() <= budget);
                    // Whatever survived must be a naive entry with the same value.
                    naive.retain(|e| c.longest(&e.0).is_some_and(|(n, v)| n == e.0.len() && *v == e.1));
                    prop_assert_eq!(c.len(), naive.len());
                } else {
                    let want = naive.iter().filter(|e| seq.starts_with(&e.0)).max_by_key(|e| e.0.len()).map(|e| (e.0.len(), e.1));
                    prop_assert_eq!(c.longest(&seq).map(|(n, v)| (n, *v)), want);
                }
            }
        }
    }
}
