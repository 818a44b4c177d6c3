//! What a route's shards hold in their prefix caches, as far as the tracker can tell: the
//! chain keys of the full 16-position blocks of the prompts the route prefilled, the most
//! recently used kept, at most [`PrefixIndex::capacity`] of them. A request goes first to
//! the route holding the longest prefix of its prompt ([`super::offer::submit`]), so an
//! agent's next turn finds the blocks its last turn left.
//!
//! It is a hint, never a promise: a shard may have evicted blocks the index still lists (the
//! request then computes them, as it would anywhere), and the tracker does not see blocks
//! another tracker put there.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use engine::KV_BLOCK_POSITIONS;

/// Blocks one route's index lists at most (a million prompt positions): about 48 bytes each.
pub const DEFAULT_CAPACITY: usize = 1 << 16;

/// The chain keys of the full blocks of `tokens` in partition `partition` (a tenant's: a
/// conversation is matched against its own key's blocks only): key `i` names blocks `0..=i`.
pub fn chain(partition: u64, tokens: &[u32]) -> Vec<u64> {
    let mut parent = partition;
    tokens
        .chunks_exact(KV_BLOCK_POSITIONS)
        .map(|block| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (parent, block).hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

/// One route's prefix index.
pub struct PrefixIndex {
    capacity: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Chain key -> when it was last recorded.
    used: HashMap<u64, u64>,
    /// When -> chain key, oldest first.
    by_age: BTreeMap<u64, u64>,
    tick: u64,
}

impl PrefixIndex {
    pub fn new(capacity: usize) -> PrefixIndex {
        PrefixIndex {
            capacity: capacity.max(1),
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a chain the route was given (its blocks become the most recently used; the
    /// oldest go past the capacity).
    pub fn record(&self, keys: &[u64]) {
        let mut s = self.lock();
        for &k in keys {
            s.tick += 1;
            let tick = s.tick;
            if let Some(old) = s.used.insert(k, tick) {
                s.by_age.remove(&old);
            }
            s.by_age.insert(tick, k);
        }
        while s.used.len() > self.capacity {
            let Some((_, k)) = s.by_age.pop_first() else {
                break;
            };
            s.used.remove(&k);
        }
    }

    /// How many leading blocks of the chain the route holds.
    pub fn matched(&self, keys: &[u64]) -> usize {
        let s = self.lock();
        keys.iter().take_while(|k| s.used.contains_key(k)).count()
    }

    /// Blocks listed.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().used.len()
    }
}

/// How the tracker picks among a model's routes for a new session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteChoice {
    /// Whether the route holding the longest cached prefix of the prompt goes first and slow
    /// routes last (`--route-by cache`, the default), or the least loaded always does, whatever
    /// it caches and however fast it is (`--route-by load`: sessions spread evenly).
    pub by_cache: bool,
    /// The most sessions the route holding the prefix may have over the least loaded route
    /// and still go first (`--cache-route-slack`): past it, load decides.
    pub slack: usize,
}

impl Default for RouteChoice {
    fn default() -> Self {
        RouteChoice {
            by_cache: true,
            slack: 8,
        }
    }
}

impl RouteChoice {
    /// The order in which to offer a session to routes, given each route's load (sessions
    /// held and on their way), the leading blocks of the prompt each holds and its measured
    /// time per token (`pace`, `None` before it has one; see [`super::pace`]).
    ///
    /// Routes slower than [`super::pace::SLOW_FACTOR`] times the fastest go last, slowest
    /// last; the others the least loaded first (ties in the given order). Then the route
    /// holding the most blocks of the prompt goes first, slow or not, while its load is within
    /// the slack of the route otherwise first: a cached prefix is prompt computation not done
    /// again (seconds for a few thousand tokens on a CPU), which weighs more than the
    /// milliseconds per token a pace tells apart, and a conversation that changed routes with
    /// its pace would go cold; unless it is over [`super::pace::CACHE_SLOW_FACTOR`] (10) times
    /// slower than the fastest. Between routes holding as many blocks, a fast one before a
    /// slow one, then the less loaded.
    ///
    /// `--route-by load` (`by_cache` false): the least loaded first, ties in the given order.
    pub fn order(&self, load: &[usize], matched: &[usize], pace: &[Option<f64>]) -> Vec<usize> {
        if !self.by_cache {
            let mut order: Vec<usize> = (0..load.len()).collect();
            order.sort_by_key(|&i| load[i]);
            return order;
        }
        let slow = super::pace::slow(pace);
        let too_slow = super::pace::slow_by(pace, super::pace::CACHE_SLOW_FACTOR);
        let (mut order, mut slow_ones): (Vec<usize>, Vec<usize>) =
            (0..load.len()).partition(|&i| !slow[i]);
        slow_ones.sort_by(|&a, &b| pace[a].partial_cmp(&pace[b]).expect("finite paces"));
        order.sort_by_key(|&i| load[i]);
        order.extend(slow_ones);
        if !order.is_empty() {
            let least = load[order[0]];
            let best = order
                .iter()
                .copied()
                .filter(|&i| matched[i] > 0 && load[i] <= least + self.slack && !too_slow[i])
                .max_by_key(|&i| (matched[i], !slow[i], std::cmp::Reverse(load[i])));
            if let Some(best) = best {
                order.retain(|&i| i != best);
                order.insert(0, best);
            }
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_names_each_prefix_of_whole_blocks_in_its_partition() {
        let a: Vec<u32> = (0..50).collect();
        let keys = chain(1, &a);
        assert_eq!(keys.len(), 3, "three full blocks of 16 in 50 tokens");
        let mut b = a.clone();
        b[20] = 999;
        let other = chain(1, &b);
        assert_eq!(other[0], keys[0], "the same first block");
        assert_ne!(other[1], keys[1], "a block differs, and every key after it");
        assert_ne!(other[2], keys[2]);
        assert_ne!(chain(2, &a)[0], keys[0], "another partition, other keys");
    }

    #[test]
    fn the_index_matches_leading_blocks_and_forgets_the_oldest() {
        let idx = PrefixIndex::new(4);
        let a = chain(1, &(0..64).collect::<Vec<u32>>());
        idx.record(&a[..3]);
        assert_eq!(idx.matched(&a), 3);
        assert_eq!(idx.matched(&chain(7, &(0..64).collect::<Vec<u32>>())), 0);
        // Two blocks of another prompt push the oldest of the first out.
        let b = chain(1, &(100..132).collect::<Vec<u32>>());
        idx.record(&b);
        assert_eq!(idx.len(), 4);
        assert_eq!(idx.matched(&a), 0, "its first block went first");
        assert_eq!(idx.matched(&b), 2);
    }

    #[test]
    fn the_route_holding_the_prefix_goes_first_within_the_slack() {
        let choice = RouteChoice {
            by_cache: true,
            slack: 2,
        };
        // Route 1 holds 10 blocks, route 2 holds 3; route 0 is least loaded.
        assert_eq!(
            choice.order(&[0, 2, 0], &[0, 10, 3], &[None; 3]),
            vec![1, 0, 2]
        );
        // Route 1 is 3 sessions over the least loaded: past the slack of 2, route 2 holds
        // the most within it.
        assert_eq!(
            choice.order(&[0, 3, 1], &[0, 10, 3], &[None; 3]),
            vec![2, 0, 1]
        );
        // Nothing cached: by load alone.
        assert_eq!(
            choice.order(&[2, 1, 3], &[0, 0, 0], &[None; 3]),
            vec![1, 0, 2]
        );
        let load_only = RouteChoice {
            by_cache: false,
            ..choice
        };
        assert_eq!(
            load_only.order(&[0, 2, 0], &[0, 10, 3], &[None; 3]),
            vec![0, 2, 1]
        );
        // By load alone, a route's pace changes nothing either.
        assert_eq!(
            load_only.order(&[1, 0, 2], &[0, 0, 0], &[Some(0.010), Some(0.500), None]),
            vec![1, 0, 2]
        );
    }

    /// A route more than three times as slow as the fastest goes last whatever its load,
    /// unless it holds the prompt's longest cached prefix; within the factor, and before a
    /// route has a pace, load and cache decide as before.
    #[test]
    fn slow_routes_go_last_unless_they_hold_the_prefix() {
        let choice = RouteChoice::default();
        let fast = Some(0.010);
        // Route 0 is idle but 5x slower; route 2 is 3.5x slower: both after the fast one.
        assert_eq!(
            choice.order(&[0, 3, 1], &[0, 0, 0], &[Some(0.050), fast, Some(0.035)]),
            vec![1, 2, 0]
        );
        // Route 2 holds the prompt's prefix: it goes first, slow as it is.
        assert_eq!(
            choice.order(&[0, 3, 1], &[0, 0, 5], &[Some(0.050), fast, Some(0.035)]),
            vec![2, 1, 0]
        );
        // Over ten times slower, the route holding the prefix goes last all the same.
        assert_eq!(
            choice.order(&[0, 3, 1], &[0, 0, 5], &[Some(0.050), fast, Some(0.101)]),
            vec![1, 0, 2]
        );
        // Holding the prefix, but past the slack: last, slow as it is.
        assert_eq!(
            choice.order(&[0, 0, 9], &[0, 0, 5], &[fast, fast, Some(0.035)]),
            vec![0, 1, 2]
        );
        // Both hold as many blocks: the fast one first, though more loaded.
        assert_eq!(
            choice.order(&[0, 3], &[4, 4], &[Some(0.050), fast]),
            vec![1, 0]
        );
        // Within the factor (2.9x): the least loaded, as without paces.
        assert_eq!(
            choice.order(&[0, 3], &[0, 0], &[Some(0.029), fast]),
            vec![0, 1]
        );
        // A route with no pace yet counts as fast: it gets measured.
        assert_eq!(choice.order(&[0, 3], &[0, 0], &[None, fast]), vec![0, 1]);
        assert_eq!(
            choice.order(&[3, 0], &[0, 0], &[fast, Some(0.5)]),
            vec![0, 1]
        );
    }
}
