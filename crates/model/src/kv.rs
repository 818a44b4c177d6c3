//! Paged KV cache: fixed-size blocks of positions from a pool with a byte budget.
//!
//! A [`KvPool`] hands out blocks of [`BLOCK_POSITIONS`] positions; each block holds K and V
//! (f16, as llama.cpp stores them by default) of those positions for every layer of one range.
//! A [`KvCache`] is one session's list of blocks. Blocks are owned by exactly one cache at a
//! time and go back to the pool when the cache truncates past them or is dropped, so releasing a
//! session returns its memory to the budget by construction. Sessions own their caches; the
//! forward pass borrows them, so no session's state lives in the weights.

use std::sync::{Arc, Mutex, MutexGuard};

use half::f16;

use crate::weights::LayerRange;

/// Positions per block.
pub const BLOCK_POSITIONS: usize = 16;

/// Bytes one position of K and V (f16) costs for every layer of `range`.
pub(crate) fn position_bytes(range: LayerRange, kv_dim: usize) -> usize {
    2 * range.len() * kv_dim * std::mem::size_of::<f16>()
}

/// The pool could not supply the blocks asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("KV pool exhausted: need {need} blocks, {free} free of {capacity}")]
pub struct KvExhausted {
    pub need: usize,
    pub free: usize,
    pub capacity: usize,
}

struct Block {
    id: u32,
    data: Box<[f16]>,
}

struct PoolState {
    capacity: usize,
    in_use: usize,
    /// Storage of returned blocks, reused before allocating (no allocation once warm).
    spare: Vec<Box<[f16]>>,
    /// Ids of returned blocks, reused before minting new ones.
    spare_ids: Vec<u32>,
    next_id: u32,
}

/// A budgeted source of KV blocks for one layer range. Cloning shares the pool.
#[derive(Clone)]
pub struct KvPool {
    state: Arc<Mutex<PoolState>>,
    range: LayerRange,
    kv_dim: usize,
}

impl KvPool {
    /// A pool holding at most `budget_bytes` of blocks (whole blocks only); `usize::MAX` for
    /// a pool without a practical budget.
    pub fn new(range: LayerRange, kv_dim: usize, budget_bytes: usize) -> KvPool {
        let block = BLOCK_POSITIONS * position_bytes(range, kv_dim);
        KvPool {
            state: Arc::new(Mutex::new(PoolState {
                capacity: budget_bytes / block.max(1),
                in_use: 0,
                spare: Vec::new(),
                spare_ids: Vec::new(),
                next_id: 0,
            })),
            range,
            kv_dim,
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A panic while holding the lock leaves counts consistent (no await points, no partial
        // updates), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn range(&self) -> LayerRange {
        self.range
    }

    /// f16 values in one block.
    fn block_len(&self) -> usize {
        BLOCK_POSITIONS * 2 * self.range.len() * self.kv_dim
    }

    pub fn block_bytes(&self) -> usize {
        BLOCK_POSITIONS * position_bytes(self.range, self.kv_dim)
    }

    /// Blocks needed to hold `positions` positions.
    pub fn blocks_for(positions: usize) -> usize {
        positions.div_ceil(BLOCK_POSITIONS)
    }

    pub fn capacity_blocks(&self) -> usize {
        self.lock().capacity
    }

    pub fn blocks_in_use(&self) -> usize {
        self.lock().in_use
    }

    pub fn free_blocks(&self) -> usize {
        let s = self.lock();
        s.capacity - s.in_use
    }

    pub fn bytes_in_use(&self) -> usize {
        self.blocks_in_use() * self.block_bytes()
    }

    /// The budget in bytes (whole blocks).
    pub fn budget_bytes(&self) -> usize {
        self.capacity_blocks().saturating_mul(self.block_bytes())
    }

    /// A new, empty cache for one session, holding at most `n_ctx` positions.
    pub fn new_cache(&self, n_ctx: usize) -> KvCache {
        KvCache {
            pool: self.clone(),
            n_ctx,
            len: 0,
            blocks: Vec::new(),
        }
    }

    fn take(&self, n: usize, into: &mut Vec<Block>) -> Result<(), KvExhausted> {
        let mut s = self.lock();
        let free = s.capacity - s.in_use;
        if n > free {
            return Err(KvExhausted {
                need: n,
                free,
                capacity: s.capacity,
            });
        }
        s.in_use += n;
        for _ in 0..n {
            let id = s.spare_ids.pop().unwrap_or_else(|| {
                s.next_id += 1;
                s.next_id - 1
            });
            let data = s.spare.pop();
            into.push(Block {
                id,
                // A reused block's old contents are never read: positions are written before
                // a cache's length covers them.
                data: data.unwrap_or_else(|| vec![f16::ZERO; self.block_len()].into()),
            });
        }
        Ok(())
    }

    fn give_back(&self, blocks: impl Iterator<Item = Block>) {
        let mut s = self.lock();
        for b in blocks {
            s.in_use -= 1;
            s.spare_ids.push(b.id);
            s.spare.push(b.data);
        }
    }
}

/// Keys and values of positions `0..len` of one session, for every layer of a range, in
/// blocks from a [`KvPool`].
pub struct KvCache {
    pool: KvPool,
    n_ctx: usize,
    len: usize,
    blocks: Vec<Block>,
}

impl Drop for KvCache {
    fn drop(&mut self) {
        self.pool.give_back(self.blocks.drain(..));
    }
}

impl KvCache {
    pub fn range(&self) -> LayerRange {
        self.pool.range
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn n_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Ids of the blocks held, in position order (for ownership checks).
    pub fn block_ids(&self) -> Vec<u32> {
        self.blocks.iter().map(|b| b.id).collect()
    }

    /// Bytes of the blocks held.
    pub fn n_bytes(&self) -> usize {
        self.blocks.len() * self.pool.block_bytes()
    }

    /// Bytes of blocks this cache would need on top of what it holds to reach `len` positions.
    pub fn extra_bytes_for(&self, len: usize) -> usize {
        KvPool::blocks_for(len).saturating_sub(self.blocks.len()) * self.pool.block_bytes()
    }

    /// Takes blocks from the pool so positions `0..len` have room (all or none).
    pub fn reserve(&mut self, len: usize) -> Result<(), KvExhausted> {
        let need = KvPool::blocks_for(len).saturating_sub(self.blocks.len());
        if need > 0 {
            self.pool.clone().take(need, &mut self.blocks)?;
        }
        Ok(())
    }

    /// Forgets every position from `len` on; whole blocks past it go back to the pool.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
        }
        let keep = KvPool::blocks_for(self.len);
        if keep < self.blocks.len() {
            self.pool.give_back(self.blocks.drain(keep..));
        }
    }

    /// Marks positions `0..len` as written; the room must have been reserved.
    pub(crate) fn set_len(&mut self, len: usize) {
        assert!(
            KvPool::blocks_for(len) <= self.blocks.len(),
            "positions reserved before they are written"
        );
        self.len = len;
    }

    fn offset(&self, layer: usize, which: usize, pos: usize) -> (usize, usize) {
        let kv = self.pool.kv_dim;
        let (b, p) = (pos / BLOCK_POSITIONS, pos % BLOCK_POSITIONS);
        (b, ((layer * 2 + which) * BLOCK_POSITIONS + p) * kv)
    }

    /// Key (`which` = 0) or value (1) of local layer `layer` at position `pos`.
    #[inline]
    pub(crate) fn row(&self, layer: usize, which: usize, pos: usize) -> &[f16] {
        let (b, at) = self.offset(layer, which, pos);
        &self.blocks[b].data[at..at + self.pool.kv_dim]
    }

    #[inline]
    pub(crate) fn row_mut(&mut self, layer: usize, which: usize, pos: usize) -> &mut [f16] {
        let (b, at) = self.offset(layer, which, pos);
        let kv = self.pool.kv_dim;
        &mut self.blocks[b].data[at..at + kv]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn range() -> LayerRange {
        LayerRange { start: 0, end: 2 }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Open,
        Grow(usize, usize),
        Truncate(usize, usize),
        Close(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            Just(Op::Open),
            (0..8usize, 1..40usize).prop_map(|(s, n)| Op::Grow(s, n)),
            (0..8usize, 0..60usize).prop_map(|(s, n)| Op::Truncate(s, n)),
            (0..8usize).prop_map(Op::Close),
        ]
    }

    proptest! {
        /// Under any sequence of opens, appends, truncations and releases: no block is owned
        /// twice, the pool's count equals the blocks caches hold, the budget is never exceeded,
        /// a refused append changes nothing, and releasing everything restores full capacity.
        #[test]
        fn block_pool_accounting(ops in proptest::collection::vec(op(), 1..80), blocks in 1..12usize) {
            let kv_dim = 8;
            let block_bytes = BLOCK_POSITIONS * position_bytes(range(), kv_dim);
            let pool = KvPool::new(range(), kv_dim, blocks * block_bytes + block_bytes / 2);
            prop_assert_eq!(pool.capacity_blocks(), blocks);
            let mut caches: Vec<KvCache> = Vec::new();
            for op in ops {
                match op {
                    Op::Open => caches.push(pool.new_cache(1 << 20)),
                    Op::Grow(i, n) if !caches.is_empty() => {
                        let c = i % caches.len();
                        let before = (caches[c].block_ids(), pool.blocks_in_use());
                        let want = caches[c].len() + n;
                        match caches[c].reserve(want) {
                            Ok(()) => caches[c].set_len(want),
                            Err(e) => {
                                prop_assert!(e.need > e.free);
                                prop_assert_eq!((caches[c].block_ids(), pool.blocks_in_use()), before);
                            }
                        }
                    }
                    Op::Truncate(i, n) if !caches.is_empty() => {
                        let c = i % caches.len();
                        caches[c].truncate(n);
                        prop_assert_eq!(caches[c].n_blocks(), KvPool::blocks_for(caches[c].len()));
                    }
                    Op::Close(i) if !caches.is_empty() => {
                        caches.swap_remove(i % caches.len());
                    }
                    _ => {}
                }
                let mut seen = HashSet::new();
                let mut held = 0;
                for c in &caches {
                    for id in c.block_ids() {
                        prop_assert!(seen.insert(id), "block {} owned twice", id);
                        held += 1;
                    }
                }
                prop_assert_eq!(pool.blocks_in_use(), held);
                prop_assert!(pool.blocks_in_use() <= pool.capacity_blocks());
                prop_assert!(pool.bytes_in_use() <= blocks * block_bytes + block_bytes / 2);
            }
            caches.clear();
            prop_assert_eq!(pool.blocks_in_use(), 0);
            prop_assert_eq!(pool.free_blocks(), blocks);
        }
    }

    #[test]
    fn positions_land_in_their_block() {
        let pool = KvPool::new(range(), 4, usize::MAX);
        let mut c = pool.new_cache(100);
        c.reserve(40).unwrap();
        c.set_len(40);
        assert_eq!(c.n_blocks(), 3);
        for pos in 0..40 {
            for layer in 0..2 {
                for which in 0..2 {
                    c.row_mut(layer, which, pos)
                        .fill(f16::from_f32((pos * 4 + layer * 2 + which) as f32));
                }
            }
        }
        for pos in 0..40 {
            for layer in 0..2 {
                for which in 0..2 {
                    let want = f16::from_f32((pos * 4 + layer * 2 + which) as f32);
                    assert!(c.row(layer, which, pos).iter().all(|&v| v == want));
                }
            }
        }
        c.truncate(17);
        assert_eq!(c.n_blocks(), 2);
        assert_eq!(pool.blocks_in_use(), 2);
        drop(c);
        assert_eq!(pool.blocks_in_use(), 0);
    }
}
