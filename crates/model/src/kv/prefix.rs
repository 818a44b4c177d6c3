//! Prefix sharing: the registry of full blocks that sessions with the same token prefix share
//! (see the module above for the scheme). [`KvPool::register`] records a cache's full blocks
//! under (previous block, 16 tokens) keys; [`KvPool::attach`] extends a cache with the
//! registered blocks continuing it along its next tokens.

use std::sync::Arc;

use half::f16;

use super::{Block, KvCache, KvPool, PoolState, BLOCK_POSITIONS};

/// Registry ids are below this; prefix roots ([`KvPool::prefix_root`]) at or above it.
const ROOT_BASE: u64 = 1 << 63;

/// A full block's key: the registry id of the block before it (or the root), and its tokens.
pub(super) type PrefixKey = (u64, [u32; BLOCK_POSITIONS]);

pub(super) struct Registered {
    pub(super) key: PrefixKey,
    pub(super) id: u32,
    pub(super) data: Arc<[f16]>,
    /// The block's place in the idle order while no cache holds it.
    pub(super) idle: Option<u64>,
}

/// How many registered blocks a prompt parting inside a block compares its tokens with, at
/// most, to take the leading positions of one.
const MAX_PARTIAL_CANDIDATES: usize = 64;

impl PoolState {
    /// The registered block continuing `parent` whose tokens begin with the most of `tokens`
    /// (at most a block's), and how many: `None` when none begins with the first. Among
    /// partial matches only the newest [`MAX_PARTIAL_CANDIDATES`] blocks starting with that
    /// token are compared (a bound on the work whatever the prompts seen before), the oldest
    /// of the longest matches taken.
    fn continuation(&self, parent: u64, tokens: &[u32]) -> Option<(usize, u64)> {
        let tokens = &tokens[..tokens.len().min(BLOCK_POSITIONS)];
        if let Ok(block) = <[u32; BLOCK_POSITIONS]>::try_from(tokens) {
            if let Some(&uid) = self.keys.get(&(parent, block)) {
                return Some((BLOCK_POSITIONS, uid));
            }
        }
        let children = self.children.get(&(parent, *tokens.first()?))?;
        children
            .iter()
            .rev()
            .take(MAX_PARTIAL_CANDIDATES)
            .map(|&uid| {
                let key = &self.registered[&uid].key.1;
                let same = key.iter().zip(tokens).take_while(|(a, b)| a == b).count();
                (same, uid)
            })
            .filter(|&(same, _)| same > 0)
            .max_by_key(|&(same, uid)| (same, std::cmp::Reverse(uid)))
    }

    /// Takes up again the registered block `cache` ends inside (its positions held are the
    /// block's leading ones): the registered block continuing the same parent along those
    /// positions and the most of `tokens` replaces it, and the cache grows by the tokens it
    /// matches. The parent is the one the block's own key names (the cache's previous block,
    /// or the root it was attached under), so the cache stays in its partition. Returns the
    /// positions added and, when the block is now whole, its id to continue from.
    fn take_up_last(&mut self, cache: &mut KvCache, tokens: &[u32]) -> (usize, Option<u64>) {
        let n = cache.blocks.len();
        let inside = cache.len % BLOCK_POSITIONS;
        let last = &cache.blocks[n - 1];
        if last.uid == 0 {
            return (0, None);
        }
        let (parent, held) = self.registered[&last.uid].key;
        // The positions held in the block, then as many of the new as fit in it.
        let mut seq = [0u32; BLOCK_POSITIONS];
        seq[..inside].copy_from_slice(&held[..inside]);
        let k = tokens.len().min(BLOCK_POSITIONS - inside);
        seq[inside..inside + k].copy_from_slice(&tokens[..k]);
        let Some((same, uid)) = self.continuation(parent, &seq[..inside + k]) else {
            return (0, None);
        };
        if same <= inside {
            return (0, None);
        }
        if uid != last.uid {
            let taken = self.hold(uid);
            let given = std::mem::replace(&mut cache.blocks[n - 1], taken);
            self.release(given);
        }
        cache.len += same - inside;
        (same - inside, (same == BLOCK_POSITIONS).then_some(uid))
    }

    /// Takes a registered block for a cache (no longer idle).
    fn hold(&mut self, uid: u64) -> Block {
        let r = self.registered.get_mut(&uid).expect("registered");
        if let Some(t) = r.idle.take() {
            self.idle.remove(&t);
        }
        Block {
            id: r.id,
            uid,
            data: r.data.clone(),
            local: None,
        }
    }
}

impl KvPool {
    /// The root of prefix keys for `scope`: caches whose K and V are the same function of their
    /// tokens share a scope (a shard past a lossy seam encoding scopes them by route stream).
    pub fn prefix_root(scope: u64) -> u64 {
        ROOT_BASE | scope
    }

    /// Extends `cache` with the registered blocks that continue it along `tokens` (the tokens
    /// of its next positions), at most `max_positions` positions, and returns the positions
    /// added: whole blocks while their 16 tokens match, then the leading positions of the
    /// registered block that continues the last one with the most of the remaining tokens (a
    /// conversation whose last message changed shares all but the block where it differs).
    /// Such a partly used block stays shared until a position is written into it, which copies
    /// it first ([`KvCache::reserve`]).
    ///
    /// The cache must be empty (its blocks then start at `root`), end on the boundary of a
    /// registered block, or end inside a registered block it holds (a prompt's earlier part
    /// that parted there, or a rewind into it); otherwise nothing is added. In the last case
    /// the block is taken up again: the registered block continuing the same parent along
    /// the positions held and the most of `tokens` replaces it (the positions held are the same
    /// function of the same tokens in either), so a prompt that comes in parts smaller than a
    /// block still finds every cached block of its prefix.
    pub fn attach(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        root: u64,
        max_positions: usize,
    ) -> usize {
        let mut tokens = &tokens[..tokens.len().min(max_positions)];
        if tokens.is_empty() || self.is_windowed() {
            return 0;
        }
        let start = cache.len;
        let n = cache.blocks.len();
        let inside = cache.len % BLOCK_POSITIONS;
        if n != KvPool::blocks_for(cache.len) {
            return 0;
        }
        let mut s = self.lock();
        let mut parent = match cache.blocks.last() {
            None => root,
            Some(b) if inside == 0 => b.uid,
            Some(_) => {
                let (added, whole) = s.take_up_last(cache, tokens);
                match whole {
                    Some(uid) => {
                        tokens = &tokens[added..];
                        uid
                    }
                    None => return added,
                }
            }
        };
        if parent == 0 {
            return 0;
        }
        let before = cache.blocks.len();
        for chunk in tokens.chunks_exact(BLOCK_POSITIONS) {
            let key = (parent, chunk.try_into().expect("a full block of tokens"));
            let Some(&uid) = s.keys.get(&key) else { break };
            cache.blocks.push(s.hold(uid));
            parent = uid;
        }
        let whole = cache.blocks.len() - before;
        let rest = &tokens[whole * BLOCK_POSITIONS..];
        let rest = &rest[..rest.len().min(BLOCK_POSITIONS - 1)];
        let mut added = whole * BLOCK_POSITIONS;
        if let Some((same, uid)) = s.continuation(parent, rest) {
            cache.blocks.push(s.hold(uid));
            added += same;
        }
        s.attached_total += (cache.blocks.len() - before) as u64;
        cache.len += added;
        cache.len - start
    }

    /// Registers the full blocks of `cache` not yet registered; `tokens` are the cache's
    /// positions' tokens. A block whose key is already registered (the same prefix computed by
    /// another session) is swapped for the registered one, and its own storage dropped.
    pub fn register(&self, cache: &mut KvCache, tokens: &[u32], root: u64) {
        if self.is_windowed() {
            return;
        }
        let full = (cache.len / BLOCK_POSITIONS).min(tokens.len() / BLOCK_POSITIONS);
        let mut s = self.lock();
        for b in 0..full {
            if cache.blocks[b].uid != 0 {
                continue;
            }
            let parent = if b == 0 {
                root
            } else {
                cache.blocks[b - 1].uid
            };
            if parent == 0 {
                break;
            }
            let chunk = &tokens[b * BLOCK_POSITIONS..(b + 1) * BLOCK_POSITIONS];
            let key = (parent, chunk.try_into().expect("a full block of tokens"));
            if let Some(&uid) = s.keys.get(&key) {
                // The same tokens after the same block give the same K and V wherever they
                // were computed; a block that differs came from inputs that broke this (a
                // shard past the first sent other activations for the same tokens): it and
                // the blocks after it stay private.
                let same = s.registered[&uid]
                    .data
                    .iter()
                    .zip(cache.blocks[b].data.iter())
                    .all(|(a, c)| a.to_bits() == c.to_bits());
                if !same {
                    break;
                }
                let shared = s.hold(uid);
                let own = std::mem::replace(&mut cache.blocks[b], shared);
                s.release(own);
            } else {
                let uid = s.next_uid;
                s.next_uid += 1;
                let block = &mut cache.blocks[b];
                block.uid = uid;
                s.keys.insert(key, uid);
                s.children
                    .entry((parent, key.1[0]))
                    .or_default()
                    .insert(uid);
                s.registered.insert(
                    uid,
                    Registered {
                        key,
                        id: block.id,
                        data: block.data.clone(),
                        idle: None,
                    },
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::range;
    use super::super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    /// What position `pos` of a session whose tokens are `tokens` holds: a function of the
    /// tokens up to it, as the forward pass guarantees.
    fn fingerprint(tokens: &[u32], pos: usize, root: u64) -> f16 {
        let h = tokens[..=pos]
            .iter()
            .fold(pos as u32 ^ root as u32, |h, &t| {
                h.wrapping_mul(31).wrapping_add(t)
            });
        f16::from_f32((h % 1000) as f32)
    }

    /// Tokens of positions `from..to`: `salt` 0 gives every session the same tokens there.
    fn tokens_of(from: usize, to: usize, salt: u32) -> Vec<u32> {
        (from..to)
            .map(|p| if salt == 0 { (p % 5) as u32 } else { salt })
            .collect()
    }

    #[derive(Debug, Clone)]
    enum ShareOp {
        /// Open a cache in partition 0 or 1 and attach the registered prefix of the shared
        /// tokens (up to n).
        Open(usize, bool),
        /// Continue a cache with registered blocks of the shared tokens (up to n positions),
        /// passing its own root or (true) the other partition's.
        Extend(usize, usize, bool),
        Grow(usize, usize, u32),
        Truncate(usize, usize),
        Register(usize),
        Close(usize),
    }

    fn share_op() -> impl Strategy<Value = ShareOp> {
        prop_oneof![
            (0..70usize, any::<bool>()).prop_map(|(n, p)| ShareOp::Open(n, p)),
            (0..8usize, 0..50usize, any::<bool>()).prop_map(|(s, n, o)| ShareOp::Extend(s, n, o)),
            (0..8usize, 1..40usize, 0..3u32).prop_map(|(s, n, salt)| ShareOp::Grow(s, n, salt)),
            (0..8usize, 0..60usize).prop_map(|(s, n)| ShareOp::Truncate(s, n)),
            (0..8usize).prop_map(ShareOp::Register),
            (0..8usize).prop_map(ShareOp::Close),
        ]
    }

    /// What `shared_prefix_blocks` checks after every operation: each cache reads what its
    /// own tokens wrote in its own partition, its registered blocks chain back to its root, a
    /// private block belongs to one cache, and the pool counts each held block once and never
    /// more than its capacity.
    fn holds(pool: &KvPool, caches: &[(KvCache, Vec<u32>, u64)]) -> Result<(), TestCaseError> {
        let mut private = HashSet::new();
        let mut held = HashSet::new();
        let state = pool.lock();
        for (c, tokens, root) in caches {
            prop_assert_eq!(c.len(), tokens.len());
            for (i, b) in c.blocks.iter().enumerate() {
                if b.uid == 0 {
                    prop_assert!(private.insert(b.id), "private block {} held twice", b.id);
                } else {
                    // Its key names the block before it, or the cache's own root.
                    let parent = if i == 0 { *root } else { c.blocks[i - 1].uid };
                    prop_assert_eq!(
                        state.registered[&b.uid].key.0,
                        parent,
                        "block {} of another chain",
                        i
                    );
                }
                held.insert(b.id);
            }
            for pos in 0..c.len() {
                let want = fingerprint(tokens, pos, *root);
                for layer in 0..2 {
                    for which in 0..2 {
                        prop_assert!(
                            c.row(layer, which, pos)
                                .iter()
                                .all(|v| v.to_bits() == want.to_bits()),
                            "position {} reads another session's data",
                            pos
                        );
                    }
                }
            }
        }
        drop(state);
        prop_assert_eq!(pool.blocks_in_use(), held.len());
        prop_assert!(pool.blocks_in_use() + pool.idle_blocks() <= pool.capacity_blocks());
        Ok(())
    }

    proptest! {
        /// With prefix sharing: every cache reads exactly what its own tokens wrote (a shared
        /// block is never written, a truncation into one copies it before the next write), a
        /// private block belongs to one cache, the pool counts each held block once and never
        /// more than its capacity, and releasing everything leaves only idle blocks, which
        /// are free room. Two partitions (API keys): every registered block a cache holds
        /// chains back to its own partition's root, whatever root a caller passes, so one
        /// partition never reads the other's blocks.
        #[test]
        fn shared_prefix_blocks(ops in proptest::collection::vec(share_op(), 1..80), blocks in 2..16usize) {
            let kv_dim = 4;
            let block_bytes = BLOCK_POSITIONS * position_bytes(range().len(), kv_dim);
            let pool = KvPool::new(range(), kv_dim, blocks * block_bytes);
            let roots = [KvPool::prefix_root(1), KvPool::prefix_root(2)];
            let mut caches: Vec<(KvCache, Vec<u32>, u64)> = Vec::new();
            for op in ops {
                match op {
                    ShareOp::Open(n, partition) => {
                        let root = roots[usize::from(partition)];
                        let mut c = pool.new_cache(1 << 20);
                        let want = tokens_of(0, n, 0);
                        let got = pool.attach(&mut c, &want, root, n.saturating_sub(1));
                        prop_assert!(got < n.max(1));
                        prop_assert_eq!(c.n_shared_blocks(), got.div_ceil(BLOCK_POSITIONS));
                        caches.push((c, want[..got].to_vec(), root));
                    }
                    ShareOp::Extend(i, n, other) if !caches.is_empty() => {
                        let k = i % caches.len();
                        let (c, tokens, own) = &mut caches[k];
                        // An empty cache is in the partition it is attached under; one that
                        // holds blocks is in its own, whatever root is passed.
                        let root = if other && !c.blocks.is_empty() {
                            roots[0] ^ roots[1] ^ *own
                        } else {
                            *own
                        };
                        let from = c.len();
                        let next = tokens_of(from, from + n, 0);
                        // Inside a block, only a registered one is taken up again.
                        let inside_shared = c.blocks.last().is_some_and(|b| b.uid != 0);
                        let got = pool.attach(c, &next, root, n);
                        prop_assert!(got <= n);
                        prop_assert!(got == 0 || from.is_multiple_of(BLOCK_POSITIONS) || inside_shared);
                        tokens.extend_from_slice(&next[..got]);
                    }
                    ShareOp::Grow(i, n, salt) if !caches.is_empty() => {
                        let k = i % caches.len();
                        let (c, tokens, root) = &mut caches[k];
                        let (from, to) = (c.len(), c.len() + n);
                        let before = pool.blocks_in_use();
                        match c.reserve(to) {
                            Ok(()) => {
                                tokens.extend(tokens_of(from, to, salt));
                                for pos in from..to {
                                    let v = fingerprint(tokens, pos, *root);
                                    for layer in 0..2 {
                                        for which in 0..2 {
                                            c.row_mut(layer, which, pos).fill(v);
                                        }
                                    }
                                }
                                c.set_len(to);
                            }
                            Err(e) => {
                                prop_assert!(e.need > e.free);
                                prop_assert_eq!(pool.blocks_in_use(), before);
                            }
                        }
                    }
                    ShareOp::Truncate(i, n) if !caches.is_empty() => {
                        let k = i % caches.len();
                        let (c, tokens, _) = &mut caches[k];
                        c.truncate(n);
                        tokens.truncate(c.len());
                    }
                    ShareOp::Register(i) if !caches.is_empty() => {
                        let k = i % caches.len();
                        let (c, tokens, root) = &mut caches[k];
                        pool.register(c, tokens, *root);
                    }
                    ShareOp::Close(i) if !caches.is_empty() => {
                        let k = i % caches.len();
                        let (free, freed) = (pool.free_blocks(), caches[k].0.releasable_bytes());
                        caches.swap_remove(k);
                        prop_assert_eq!(pool.free_blocks(), free + freed / block_bytes);
                    }
                    _ => {}
                }
                holds(&pool, &caches)?;
            }
            caches.clear();
            prop_assert_eq!(pool.blocks_in_use(), 0);
            prop_assert_eq!(pool.free_blocks(), blocks);
        }
    }

    #[test]
    fn a_registered_prefix_is_attached_and_survives_its_session() {
        let pool = KvPool::new(range(), 4, usize::MAX);
        let root = KvPool::prefix_root(0);
        let tokens = tokens_of(0, 40, 0);
        let mut a = pool.new_cache(100);
        a.reserve(40).unwrap();
        a.set_len(40);
        pool.register(&mut a, &tokens, root);
        assert_eq!(a.n_shared_blocks(), 2);
        drop(a);
        assert_eq!((pool.blocks_in_use(), pool.idle_blocks()), (0, 2));
        let mut b = pool.new_cache(100);
        // At most the positions the caller allows (it keeps at least one to compute).
        assert_eq!(pool.attach(&mut b, &tokens, root, 16), 16);
        assert_eq!((pool.blocks_in_use(), pool.idle_blocks()), (1, 1));
        let mut c = pool.new_cache(100);
        // Positions 32..40 were never a full block, so never registered.
        assert_eq!(pool.attach(&mut c, &tokens, root, 39), 32);
        assert_eq!(pool.blocks_in_use(), 2);
        // Dropping c would free only the block b does not share.
        assert_eq!(c.releasable_bytes(), pool.block_bytes());
        // Another root (another seam encoding) shares nothing.
        let mut d = pool.new_cache(100);
        assert_eq!(pool.attach(&mut d, &tokens, KvPool::prefix_root(7), 39), 0);
        // A different first block shares nothing either.
        let mut e = pool.new_cache(100);
        assert_eq!(pool.attach(&mut e, &tokens_of(0, 40, 1), root, 39), 0);
        // A cache on a registered block boundary continues along the chain.
        assert_eq!(pool.attach(&mut b, &tokens[16..], root, 24), 16);
        assert_eq!((b.len(), pool.blocks_in_use()), (32, 2));
        assert_eq!(pool.attached_blocks_total(), 4);
    }

    /// A prompt that comes in parts smaller than a block (a step's token budget cut it) finds
    /// every cached block of its prefix: the part ending inside a block takes the leading
    /// positions of one, and the next takes that block up again, swapped for the sibling that
    /// continues along its tokens when the first pick was another prompt's.
    #[test]
    fn a_prompt_in_parts_finds_every_cached_block() {
        let pool = KvPool::new(range(), 4, usize::MAX);
        let root = KvPool::prefix_root(0);
        // Two prompts of 40 tokens, alike in their first 10; `a` registered first.
        let a = tokens_of(0, 40, 0);
        let mut b = a.clone();
        b[10..].fill(7);
        for tokens in [&a, &b] {
            let mut c = pool.new_cache(100);
            c.reserve(40).unwrap();
            c.set_len(40);
            pool.register(&mut c, tokens, root);
        }
        let mut whole = pool.new_cache(100);
        assert_eq!(pool.attach(&mut whole, &b, root, 39), 32);
        let mut c = pool.new_cache(100);
        // 10 positions: the oldest of the blocks beginning with them, a's.
        assert_eq!(pool.attach(&mut c, &b[..10], root, 10), 10);
        assert_ne!(c.block_ids()[0], whole.block_ids()[0]);
        // 3 more: b's block, where a's differs.
        assert_eq!(pool.attach(&mut c, &b[10..13], root, 3), 3);
        assert_eq!(c.block_ids()[0], whole.block_ids()[0]);
        // The rest of the block and the next whole one; positions 32..40 were never a full block.
        assert_eq!(pool.attach(&mut c, &b[13..], root, 27), 19);
        assert_eq!((c.len(), c.n_shared_blocks()), (32, 2));
        assert_eq!(c.block_ids(), whole.block_ids());
        // A part differing inside the block takes the positions up to the difference.
        let mut d = pool.new_cache(100);
        assert_eq!(pool.attach(&mut d, &b[..5], root, 5), 5);
        let mut next = b[5..16].to_vec();
        next[3] = 99;
        assert_eq!(pool.attach(&mut d, &next, root, 11), 3);
        assert_eq!(d.len(), 8);
        // The block is taken up again in the partition it was attached in, whatever root is
        // passed: another partition's blocks are never a sibling.
        let mut f = pool.new_cache(100);
        assert_eq!(pool.attach(&mut f, &b[..10], root, 10), 10);
        assert_eq!(
            pool.attach(&mut f, &b[10..], KvPool::prefix_root(7), 30),
            22
        );
        assert_eq!(f.block_ids(), whole.block_ids());
        // A cache ending inside a block of its own (computed, private) takes nothing.
        let mut e = pool.new_cache(100);
        e.reserve(5).unwrap();
        e.set_len(5);
        assert_eq!(pool.attach(&mut e, &a[5..], root, 35), 0);
    }
}
