//! Recorded forwards (CUDA graphs) by replay key, at most a fixed number, the least recently replayed dropped
//! first.
//!
//! Every engine on a backend records into one store: a multi-route run holds each engine's decode step, each
//! verify width (with and without hidden states), the head or draft model's steps and every short prefill.
//! Dropping the oldest *recorded* graph would drop the hot decode step as soon as enough rare shapes arrive
//! after it, and re-record it (a capture and an instantiation, ~ms) in the middle of a measured run; dropping
//! the least recently *replayed* keeps whatever is in use. Generic over the graph so its policy is tested
//! without a GPU.

use std::collections::HashMap;

/// What a store has done since it was made, for the debug log and the tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordedStats {
    pub replays: u64,
    pub recordings: u64,
    pub evictions: u64,
}

pub struct Recorded<G> {
    capacity: usize,
    /// Each key's graph and the tick of its last use (a recording or a replay).
    by_key: HashMap<u64, (G, u64)>,
    tick: u64,
    stats: RecordedStats,
}

impl<G> Recorded<G> {
    /// A store of at most `capacity` graphs (at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            by_key: HashMap::new(),
            tick: 0,
            stats: RecordedStats::default(),
        }
    }

    /// The graph recorded for `key`, marked as the most recently used.
    pub fn replay(&mut self, key: u64) -> Option<&G> {
        self.tick += 1;
        let tick = self.tick;
        let (graph, used) = self.by_key.get_mut(&key)?;
        *used = tick;
        self.stats.replays += 1;
        Some(graph)
    }

    /// Keep `graph` for `key`, dropping the least recently used graph if the store is full. Returns the
    /// stored graph.
    pub fn insert(&mut self, key: u64, graph: G) -> &G {
        if !self.by_key.contains_key(&key) && self.by_key.len() >= self.capacity {
            // A linear scan: the store holds ~100 graphs and a recording costs milliseconds.
            if let Some(&victim) = self
                .by_key
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k)
            {
                self.by_key.remove(&victim);
                self.stats.evictions += 1;
            }
        }
        self.tick += 1;
        self.stats.recordings += 1;
        let slot = self.by_key.entry(key).or_insert((graph, 0));
        slot.1 = self.tick;
        &slot.0
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn stats(&self) -> RecordedStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replayed_graph_survives_recordings_that_overflow_the_store() {
        let mut store = Recorded::new(3);
        store.insert(1, "decode");
        for rare in 10..20 {
            assert_eq!(store.replay(1), Some(&"decode"));
            store.insert(rare, "rare");
        }
        assert_eq!(store.replay(1), Some(&"decode"));
        assert_eq!(store.len(), 3);
        assert_eq!(store.stats().evictions, 8);
    }

    #[test]
    fn the_least_recently_used_graph_is_the_one_dropped() {
        let mut store = Recorded::new(2);
        store.insert(1, 'a');
        store.insert(2, 'b');
        store.replay(1);
        store.insert(3, 'c');
        assert!(store.replay(2).is_none());
        assert!(store.replay(1).is_some() && store.replay(3).is_some());
    }

    #[test]
    fn recording_a_kept_key_again_keeps_the_first_and_evicts_nothing() {
        let mut store = Recorded::new(2);
        store.insert(1, 1);
        store.insert(2, 2);
        assert_eq!(*store.insert(2, 20), 2, "the first recording stays");
        assert_eq!(store.len(), 2);
        assert_eq!(store.stats().evictions, 0);
        assert_eq!(store.stats().recordings, 3);
    }

    #[test]
    fn stats_count_replays_and_misses_apart() {
        let mut store = Recorded::new(4);
        assert!(store.replay(7).is_none());
        store.insert(7, ());
        store.replay(7);
        store.replay(7);
        let s = store.stats();
        assert_eq!((s.replays, s.recordings, s.evictions), (2, 1, 0));
    }
}
