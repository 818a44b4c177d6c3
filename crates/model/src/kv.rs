//! Paged KV cache: fixed-size blocks of positions from a pool with a byte budget, and a
//! registry of full blocks that sessions with the same token prefix share.
//!
//! A [`KvPool`] hands out blocks of [`BLOCK_POSITIONS`] positions; each block holds K and V
//! of those positions for every layer of one range, in f16 (as llama.cpp stores them by
//! default) or `q8_0` ([`KvType`]: as llama.cpp's `--cache-type-k/-v q8_0`, 8.5 bits a value).
//! A [`KvCache`] is one session's list of blocks. Sessions own their caches; the forward pass
//! borrows them, so no session's state lives in the weights.
//!
//! Prefix sharing: the K and V of a position are a function of the tokens up to it alone (the
//! forward pass is batch- and chunk-invariant, bitwise), so a full block is identified by its
//! 16 tokens and the block before it. [`KvPool::register`] records a cache's full blocks under
//! that key; [`KvPool::attach`] extends a cache (empty, or ending on or inside a registered
//! block) with the registered blocks of the longest prefix of its next tokens (`prefix.rs`). A
//! registered block is read-only: it is shared by reference, and a cache that must write into
//! one (after truncating into it) first copies it ([`KvCache::reserve`]). A
//! registered block no cache holds stays as an idle copy that counts as free room: the pool
//! drops idle blocks, least recently released first, when it needs their room. So a block is
//! held by one cache, shared by several, or idle, and the pool's count of held blocks never
//! exceeds the budget.
//!
//! Sliding-window layers (Gemma 3's local layers attend to the last `window` positions only):
//! a block keeps the K and V of the range's global layers in one part and of its windowed
//! layers in another, and a cache drops the windowed part of its blocks that fall behind the
//! window (plus [`BLOCK_POSITIONS`] of slack, so rolling back an early step never needs it).
//! The budget is in bytes, so a long session on such a range costs its global layers' KV for
//! every position and its windowed layers' only for the window. A truncation back past the
//! kept window forgets the whole session (its positions can no longer be continued), which its
//! owner sees as a cache miss. Such pools do not share prefixes: a prefix's windowed part
//! would have to stay for every session that might continue it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::kernels::attn_q8 as q8;
use crate::weights::LayerRange;

mod prefix;

use prefix::{PrefixKey, Registered};

/// Positions per block.
pub const BLOCK_POSITIONS: usize = 16;

/// Bytes one position of K and V costs for `layers` layers whose rows take `row_units`
/// 16-bit units ([`KvType::row_units`]).
pub(crate) fn position_bytes(layers: usize, row_units: usize) -> usize {
    2 * layers * row_units * std::mem::size_of::<f16>()
}

/// How a cache stores each K and V row (every KV head's values of one position and layer).
/// Storage is in 16-bit units either way, so blocks, sharing and copies do not depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvType {
    /// One f16 per value.
    #[default]
    F16,
    /// llama.cpp's `q8_0`: each 32 values as an f16 scale `d` and 32 signed bytes `q`, the
    /// value `d * q` (17 units for 32 values: 53% of f16's bytes). A head's values must be a
    /// whole number of blocks, so heads stay apart ([`KvType::supports`]).
    Q8_0,
}

/// Each `n` values of `x` (`n` a power of two) multiplied by the orthonormal Walsh-Hadamard
/// matrix of order `n` (Sylvester's: entry `(i, j)` is `(-1)^popcount(i & j) / sqrt(n)`), in
/// `log2 n` rounds of sums and differences, then the scale: the same plain f32 operations on
/// every CPU. The matrix is symmetric and its own inverse.
pub(crate) fn hadamard(x: &mut [f32], n: usize) {
    assert!(n.is_power_of_two() && x.len().is_multiple_of(n));
    let scale = 1.0 / (n as f32).sqrt();
    for c in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for pair in c.chunks_exact_mut(2 * h) {
                let (a, b) = pair.split_at_mut(h);
                for (a, b) in a.iter_mut().zip(b) {
                    (*a, *b) = (*a + *b, *a - *b);
                }
            }
            h *= 2;
        }
        c.iter_mut().for_each(|v| *v *= scale);
    }
}

impl KvType {
    /// The names llama.cpp's `--cache-type-k` uses, and the cache recipe's `kv_dtype`.
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }

    pub fn from_name(name: &str) -> Result<KvType, String> {
        match name {
            "f16" => Ok(KvType::F16),
            "q8_0" => Ok(KvType::Q8_0),
            other => Err(format!("unknown KV type {other:?} (f16 or q8_0)")),
        }
    }

    /// Whether rows of heads `head_dim` wide can be stored so.
    pub fn supports(self, head_dim: usize) -> bool {
        match self {
            KvType::F16 => true,
            KvType::Q8_0 => head_dim > 0 && head_dim.is_multiple_of(q8::BLOCK),
        }
    }

    /// The widths of the rotations a model whose heads are `head_dim` wide applies around a
    /// cache of this type (see [`hadamard`]): to Q and K, and to V and the attention's output.
    /// A quantized cache rotates each head's Q and K, in pieces of the largest power of two
    /// (at least 64) that divides the head, and V in pieces of 64, when the head is a multiple
    /// of 64 wide, as llama.cpp does for its quantized caches: a few huge values (Qwen2.5's
    /// keys reach 150 where most are under 10) would otherwise set every scale of their
    /// block, and the rest would lose most of their bits. The rotations are orthonormal, so
    /// in exact arithmetic `q . k` and the output are unchanged.
    pub fn rotations(self, head_dim: usize) -> Option<(usize, usize)> {
        match self {
            KvType::F16 => None,
            KvType::Q8_0 if !head_dim.is_multiple_of(64) => None,
            KvType::Q8_0 => Some((1 << head_dim.trailing_zeros(), 64)),
        }
    }

    /// 16-bit units a row of `values` values takes (`values` a multiple of [`q8::BLOCK`] for
    /// `q8_0`).
    pub fn row_units(self, values: usize) -> usize {
        match self {
            KvType::F16 => values,
            KvType::Q8_0 => q8::row_units(values),
        }
    }

    /// Writes `src` into `dst` (a row of [`KvType::row_units`] units): f16 rounded to nearest
    /// even; `q8_0` with `d = amax / 127` (stored as f16) and each `q = x * 127 / amax`
    /// rounded to nearest even, as llama.cpp's x86 quantizer computes them (0 where
    /// `127 / amax` is not finite; the bytes in memory order, as the kernels read them).
    pub fn store(self, src: &[f32], dst: &mut [f16]) {
        match self {
            KvType::F16 => dst.convert_from_f32_slice(src),
            KvType::Q8_0 => {
                for (x, b) in src
                    .chunks_exact(q8::BLOCK)
                    .zip(dst.chunks_exact_mut(q8::UNITS))
                {
                    let (d, id) = q8::scale(x);
                    b[0] = d;
                    for (pair, x) in b[1..].iter_mut().zip(x.chunks_exact(2)) {
                        let bytes = [q8::byte(x[0], id) as u8, q8::byte(x[1], id) as u8];
                        *pair = f16::from_bits(u16::from_ne_bytes(bytes));
                    }
                }
            }
        }
    }

    /// The values [`KvType::store`] keeps of `src`, as f32: how the attention takes Q, as
    /// llama.cpp multiplies K by Q converted to the cache's type (f16, or `q8_0` for its
    /// `q8_0` dot product).
    pub fn round(self, src: &[f32], dst: &mut [f32]) {
        match self {
            KvType::F16 => {
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = f16::from_f32(x).to_f32();
                }
            }
            KvType::Q8_0 => {
                for (x, y) in src
                    .chunks_exact(q8::BLOCK)
                    .zip(dst.chunks_exact_mut(q8::BLOCK))
                {
                    let (d, id) = q8::scale(x);
                    for (y, &x) in y.iter_mut().zip(x) {
                        *y = d.to_f32() * f32::from(q8::byte(x, id));
                    }
                }
            }
        }
    }
}

/// The pool could not supply the bytes asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("KV pool exhausted: need {need} bytes, {free} free of {capacity}")]
pub struct KvExhausted {
    pub need: usize,
    pub free: usize,
    pub capacity: usize,
}

/// Where each layer of a range keeps its K and V in a block: in the part every position keeps
/// (global layers) or in the part only the window keeps (sliding-window layers).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Layout {
    /// Per local layer: (windowed, index among the layers of its part).
    slots: Vec<(bool, usize)>,
    n_global: usize,
    n_local: usize,
    /// Positions before a cache's end whose windowed part is kept (window - 1 plus slack); 0
    /// when no layer is windowed.
    keep: usize,
}

impl Layout {
    fn new(windows: &[Option<usize>]) -> Layout {
        let (mut n_global, mut n_local) = (0, 0);
        let slots = windows
            .iter()
            .map(|w| match w {
                Some(_) => (true, post_inc(&mut n_local)),
                None => (false, post_inc(&mut n_global)),
            })
            .collect();
        let window = windows.iter().flatten().copied().max();
        Layout {
            slots,
            n_global,
            n_local,
            keep: window.map_or(0, |w| w.saturating_sub(1) + BLOCK_POSITIONS),
        }
    }
}

fn post_inc(n: &mut usize) -> usize {
    *n += 1;
    *n - 1
}

struct Block {
    id: u32,
    /// The registry id when the block is registered (shared, read-only); 0 when private.
    uid: u64,
    /// K and V of the global layers.
    data: Arc<[f16]>,
    /// K and V of the windowed layers, while the block is inside its cache's kept window.
    local: Option<Box<[f16]>>,
}

struct PoolState {
    /// The budget in bytes (whole blocks).
    capacity: usize,
    /// Bytes of a block's global part and of its windowed part.
    global_bytes: usize,
    local_bytes: usize,
    /// Blocks that exist: held by caches or kept idle by the registry.
    alive: usize,
    /// Windowed parts that exist.
    alive_local: usize,
    /// Storage of dropped blocks, reused before allocating (no allocation once warm).
    spare: Vec<Arc<[f16]>>,
    spare_local: Vec<Box<[f16]>>,
    /// Ids of dropped blocks, reused before minting new ones.
    spare_ids: Vec<u32>,
    next_id: u32,
    keys: HashMap<PrefixKey, u64>,
    /// The registered blocks that continue each registered block (or root), by its id and
    /// their first token: where a prompt parting inside a block looks for the one to take
    /// the leading positions of.
    children: HashMap<(u64, u32), BTreeSet<u64>>,
    registered: HashMap<u64, Registered>,
    /// Registered blocks no cache holds, least recently released first.
    idle: BTreeMap<u64, u64>,
    next_uid: u64,
    tick: u64,
    /// Blocks cache starts took from the registry instead of computing them.
    attached_total: u64,
}

impl PoolState {
    /// Blocks held by caches (idle registered blocks are free room).
    fn held(&self) -> usize {
        self.alive - self.idle.len()
    }

    /// Bytes held by caches. Registered blocks have no windowed part (windowed pools share
    /// nothing), so idle blocks cost only their global part.
    fn held_bytes(&self) -> usize {
        self.held() * self.global_bytes + self.alive_local * self.local_bytes
    }

    fn free_bytes(&self) -> usize {
        self.capacity - self.held_bytes()
    }

    fn drop_local(&mut self, part: Box<[f16]>) {
        self.spare_local.push(part);
        self.alive_local -= 1;
    }

    /// Drops the least recently released idle block.
    fn drop_idle(&mut self) {
        let Some((_, uid)) = self.idle.pop_first() else {
            return;
        };
        let r = self
            .registered
            .remove(&uid)
            .expect("idle blocks are registered");
        self.keys.remove(&r.key);
        let family = (r.key.0, r.key.1[0]);
        if let Some(siblings) = self.children.get_mut(&family) {
            siblings.remove(&uid);
            if siblings.is_empty() {
                self.children.remove(&family);
            }
        }
        assert_eq!(Arc::strong_count(&r.data), 1);
        self.spare.push(r.data);
        self.spare_ids.push(r.id);
        self.alive -= 1;
    }

    /// A block a cache lets go of: private storage is dropped, a registered block stays (idle
    /// once no cache holds it).
    fn release(&mut self, mut b: Block) {
        if let Some(part) = b.local.take() {
            self.drop_local(part);
        }
        if b.uid == 0 {
            assert_eq!(Arc::strong_count(&b.data), 1);
            self.spare.push(b.data);
            self.spare_ids.push(b.id);
            self.alive -= 1;
            return;
        }
        drop(b.data);
        let r = self
            .registered
            .get_mut(&b.uid)
            .expect("held blocks stay registered");
        if Arc::strong_count(&r.data) == 1 {
            self.tick += 1;
            r.idle = Some(self.tick);
            self.idle.insert(self.tick, b.uid);
        }
    }
}

/// A budgeted source of KV blocks for one layer range. Cloning shares the pool.
#[derive(Clone)]
pub struct KvPool {
    state: Arc<Mutex<PoolState>>,
    range: LayerRange,
    ty: KvType,
    /// 16-bit units of one K or V row: `ty.row_units(kv_dim)` for the range's `kv_dim`.
    row_units: usize,
    layout: Arc<Layout>,
}

impl KvPool {
    /// A pool holding at most `budget_bytes` of blocks (whole blocks only); `usize::MAX` for
    /// a pool without a practical budget.
    pub fn new(range: LayerRange, kv_dim: usize, budget_bytes: usize) -> KvPool {
        KvPool::with_windows(
            range,
            kv_dim,
            KvType::F16,
            &vec![None; range.len()],
            budget_bytes,
        )
    }

    /// A pool for a range whose layer `i` (counted from the range's start) attends to the last
    /// `windows[i]` positions only, or to all of them (`None`), storing rows as `ty` (which must
    /// [support](KvType::supports) the heads: `kv_dim` a multiple of their width).
    pub fn with_windows(
        range: LayerRange,
        kv_dim: usize,
        ty: KvType,
        windows: &[Option<usize>],
        budget_bytes: usize,
    ) -> KvPool {
        assert_eq!(windows.len(), range.len(), "one window per layer");
        assert!(ty.supports(kv_dim), "{} rows of {kv_dim} values", ty.name());
        let layout = Layout::new(windows);
        let row_units = ty.row_units(kv_dim);
        let global_bytes = BLOCK_POSITIONS * position_bytes(layout.n_global, row_units);
        let local_bytes = BLOCK_POSITIONS * position_bytes(layout.n_local, row_units);
        let block = (global_bytes + local_bytes).max(1);
        KvPool {
            state: Arc::new(Mutex::new(PoolState {
                capacity: budget_bytes / block * block,
                global_bytes,
                local_bytes,
                alive: 0,
                alive_local: 0,
                spare: Vec::new(),
                spare_local: Vec::new(),
                spare_ids: Vec::new(),
                next_id: 0,
                keys: HashMap::new(),
                children: HashMap::new(),
                registered: HashMap::new(),
                idle: BTreeMap::new(),
                next_uid: 1,
                tick: 0,
                attached_total: 0,
            })),
            range,
            ty,
            row_units,
            layout: Arc::new(layout),
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

    /// How rows are stored.
    pub fn kv_type(&self) -> KvType {
        self.ty
    }

    /// 16-bit units in one block's global part and in its windowed part.
    fn part_lens(&self) -> (usize, usize) {
        let per_layer = BLOCK_POSITIONS * 2 * self.row_units;
        (
            per_layer * self.layout.n_global,
            per_layer * self.layout.n_local,
        )
    }

    /// Bytes of a whole block (both parts).
    pub fn block_bytes(&self) -> usize {
        BLOCK_POSITIONS * position_bytes(self.range.len(), self.row_units)
    }

    /// Bytes of a block's windowed part (0 when no layer of the range is windowed).
    pub fn window_block_bytes(&self) -> usize {
        BLOCK_POSITIONS * position_bytes(self.layout.n_local, self.row_units)
    }

    /// Whether some layer of the range is windowed.
    pub fn is_windowed(&self) -> bool {
        self.layout.n_local > 0
    }

    /// Positions before a cache's end whose windowed part it keeps: the longest window less
    /// one, plus [`BLOCK_POSITIONS`] of slack (0 when nothing is windowed). A session whose
    /// steps append at most `t` positions so holds the windowed part of at most
    /// `(keep + t).div_ceil(BLOCK_POSITIONS) + 1` blocks.
    pub fn window_keep_positions(&self) -> usize {
        self.layout.keep
    }

    /// Blocks needed to hold `positions` positions.
    pub fn blocks_for(positions: usize) -> usize {
        positions.div_ceil(BLOCK_POSITIONS)
    }

    /// Whole blocks the budget holds.
    pub fn capacity_blocks(&self) -> usize {
        self.lock().capacity / self.block_bytes().max(1)
    }

    /// Blocks held by caches (a block several caches share counts once).
    pub fn blocks_in_use(&self) -> usize {
        self.lock().held()
    }

    /// Registered blocks no cache holds: kept for later prefixes, dropped when room is needed.
    pub fn idle_blocks(&self) -> usize {
        self.lock().idle.len()
    }

    /// Blocks cache starts have taken from the registry instead of computing them.
    pub fn attached_blocks_total(&self) -> u64 {
        self.lock().attached_total
    }

    /// Blocks held whose windowed part is kept (0 when nothing is windowed).
    pub fn window_blocks_in_use(&self) -> usize {
        self.lock().alive_local
    }

    /// Whole blocks the free bytes hold.
    pub fn free_blocks(&self) -> usize {
        self.lock().free_bytes() / self.block_bytes().max(1)
    }

    /// Bytes held by caches (a block several caches share counts once).
    pub fn bytes_in_use(&self) -> usize {
        self.lock().held_bytes()
    }

    /// The budget in bytes (whole blocks).
    pub fn budget_bytes(&self) -> usize {
        self.lock().capacity
    }

    /// A new, empty cache for one session, holding at most `n_ctx` positions.
    pub fn new_cache(&self, n_ctx: usize) -> KvCache {
        KvCache {
            pool: self.clone(),
            n_ctx,
            len: 0,
            blocks: Vec::new(),
            first_local: 0,
        }
    }

    fn take(&self, n: usize, into: &mut Vec<Block>) -> Result<(), KvExhausted> {
        let mut s = self.lock();
        let (need, free) = (n * self.block_bytes(), s.free_bytes());
        if need > free {
            return Err(KvExhausted {
                need,
                free,
                capacity: s.capacity,
            });
        }
        // Idle blocks are free room: drop as many as the new blocks need.
        while s.capacity - s.alive * s.global_bytes - s.alive_local * s.local_bytes < need {
            s.drop_idle();
        }
        s.alive += n;
        let (global_len, local_len) = self.part_lens();
        let windowed = self.is_windowed();
        s.alive_local += if windowed { n } else { 0 };
        for _ in 0..n {
            let id = s.spare_ids.pop().unwrap_or_else(|| {
                s.next_id += 1;
                s.next_id - 1
            });
            let data = s.spare.pop();
            let local = windowed.then(|| {
                s.spare_local
                    .pop()
                    .unwrap_or_else(|| vec![f16::ZERO; local_len].into())
            });
            into.push(Block {
                id,
                uid: 0,
                // A reused block's old contents are never read: positions are written before
                // a cache's length covers them.
                data: data.unwrap_or_else(|| vec![f16::ZERO; global_len].into()),
                local,
            });
        }
        Ok(())
    }

    /// Returns blocks, the last first (so a released chain's tail goes idle before its head,
    /// and is dropped first).
    fn give_back(&self, blocks: impl DoubleEndedIterator<Item = Block>) {
        let mut s = self.lock();
        for b in blocks.rev() {
            s.release(b);
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
    /// Blocks before this one have dropped their windowed part.
    first_local: usize,
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

    /// Blocks held that are registered (shared, read-only), in position order.
    pub fn n_shared_blocks(&self) -> usize {
        self.blocks.iter().filter(|b| b.uid != 0).count()
    }

    /// Blocks whose windowed part this cache keeps.
    pub fn n_window_blocks(&self) -> usize {
        self.blocks.iter().filter(|b| b.local.is_some()).count()
    }

    /// Bytes of one block's part a block always keeps.
    fn global_block_bytes(&self) -> usize {
        self.pool.block_bytes() - self.pool.window_block_bytes()
    }

    /// Bytes of the blocks held.
    pub fn n_bytes(&self) -> usize {
        self.blocks.len() * self.global_block_bytes()
            + self.n_window_blocks() * self.pool.window_block_bytes()
    }

    /// Bytes dropping this cache would make free: its private blocks and the registered ones no
    /// other cache holds (those go idle); a block other caches share stays held.
    pub fn releasable_bytes(&self) -> usize {
        // Only the registry and this cache hold a registered block that no other cache does.
        let alone = |b: &Block| b.uid == 0 || Arc::strong_count(&b.data) <= 2;
        self.blocks.iter().filter(|b| alone(b)).count() * self.global_block_bytes()
            + self.n_window_blocks() * self.pool.window_block_bytes()
    }

    /// Whether growing to `len` writes into a registered block (after a truncation into it),
    /// which must be copied first.
    fn must_copy_last(&self, len: usize) -> bool {
        len > self.len
            && !self.len.is_multiple_of(BLOCK_POSITIONS)
            && self.blocks[self.len / BLOCK_POSITIONS].uid != 0
    }

    /// Bytes of blocks this cache would need on top of what it holds to reach `len` positions.
    pub fn extra_bytes_for(&self, len: usize) -> usize {
        let new = KvPool::blocks_for(len).saturating_sub(self.blocks.len());
        (new + usize::from(self.must_copy_last(len))) * self.pool.block_bytes()
    }

    /// Takes blocks from the pool so positions `0..len` have room (all or none), copying a
    /// registered block the new positions would be written into.
    pub fn reserve(&mut self, len: usize) -> Result<(), KvExhausted> {
        let copy = self.must_copy_last(len);
        let need = KvPool::blocks_for(len).saturating_sub(self.blocks.len()) + usize::from(copy);
        if need == 0 {
            return Ok(());
        }
        let pool = self.pool.clone();
        pool.take(need, &mut self.blocks)?;
        if copy {
            let at = self.len / BLOCK_POSITIONS;
            let mut fresh = self.blocks.pop().expect("taken above");
            Arc::get_mut(&mut fresh.data)
                .expect("a fresh block is private")
                .copy_from_slice(&self.blocks[at].data);
            let shared = std::mem::replace(&mut self.blocks[at], fresh);
            pool.give_back(std::iter::once(shared));
        }
        Ok(())
    }

    /// Forgets every position from `len` on; whole blocks past it go back to the pool. When
    /// the windowed layers' K and V that position `len` would attend to were dropped already,
    /// every position is forgotten (the cache can only start over), so callers compare
    /// [`KvCache::len`] with what they asked for.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            // Position `len` attends back to `len + 1 - window` on a windowed layer.
            let window = (self.pool.layout.keep + 1).saturating_sub(BLOCK_POSITIONS);
            let lost = self.pool.is_windowed()
                && (len + 1).saturating_sub(window) < self.first_local * BLOCK_POSITIONS;
            self.len = if lost { 0 } else { len };
        }
        let keep = KvPool::blocks_for(self.len);
        if keep < self.blocks.len() {
            self.pool.give_back(self.blocks.drain(keep..));
        }
        if self.len == 0 {
            self.first_local = 0;
        }
    }

    /// Marks positions `0..len` as written (the room must have been reserved), then drops the
    /// windowed part of the blocks that are behind the kept window.
    pub(crate) fn set_len(&mut self, len: usize) {
        assert!(
            KvPool::blocks_for(len) <= self.blocks.len(),
            "positions reserved before they are written"
        );
        self.len = len;
        if !self.pool.is_windowed() {
            return;
        }
        let first = len.saturating_sub(self.pool.layout.keep) / BLOCK_POSITIONS;
        if first > self.first_local {
            let mut s = self.pool.lock();
            for b in &mut self.blocks[self.first_local..first] {
                if let Some(part) = b.local.take() {
                    s.drop_local(part);
                }
            }
            self.first_local = first;
        }
    }

    /// The part holding `layer`'s K (`which` = 0) or V (1) at `pos`, and the offset there.
    #[inline]
    fn offset(&self, layer: usize, which: usize, pos: usize) -> (bool, usize, usize) {
        let kv = self.pool.row_units;
        let (windowed, index) = self.pool.layout.slots[layer];
        let (b, p) = (pos / BLOCK_POSITIONS, pos % BLOCK_POSITIONS);
        (
            windowed,
            b,
            ((index * 2 + which) * BLOCK_POSITIONS + p) * kv,
        )
    }

    /// Key (`which` = 0) or value (1) of local layer `layer` at position `pos` (the forward
    /// pass reads them a block at a time, [`KvCache::block_rows`]).
    #[cfg(test)]
    pub(crate) fn row(&self, layer: usize, which: usize, pos: usize) -> &[f16] {
        let kv = self.pool.row_units;
        &self.block_rows(layer, which, pos / BLOCK_POSITIONS)[(pos % BLOCK_POSITIONS) * kv..][..kv]
    }

    /// How rows are stored.
    pub fn kv_type(&self) -> KvType {
        self.pool.ty
    }

    /// 16-bit units of one position's K (or V) row: every KV head's values
    /// ([`KvType::row_units`]).
    pub(crate) fn row_units(&self) -> usize {
        self.pool.row_units
    }

    /// Keys (`which` = 0) or values (1) of local layer `layer` in block `b`: its
    /// [`BLOCK_POSITIONS`] positions' rows in order, each [`KvCache::row_units`] units (every
    /// KV head's values).
    #[inline]
    pub(crate) fn block_rows(&self, layer: usize, which: usize, b: usize) -> &[f16] {
        let (windowed, b, at) = self.offset(layer, which, b * BLOCK_POSITIONS);
        let block = &self.blocks[b];
        let data: &[f16] = if windowed {
            block
                .local
                .as_deref()
                .expect("windowed layers read only inside the kept window")
        } else {
            &block.data
        };
        &data[at..at + BLOCK_POSITIONS * self.pool.row_units]
    }

    #[inline]
    pub(crate) fn row_mut(&mut self, layer: usize, which: usize, pos: usize) -> &mut [f16] {
        let (windowed, b, at) = self.offset(layer, which, pos);
        let kv = self.pool.row_units;
        let block = &mut self.blocks[b];
        let data: &mut [f16] = if windowed {
            block
                .local
                .as_deref_mut()
                .expect("positions are written inside the kept window")
        } else {
            Arc::get_mut(&mut block.data)
                .expect("registered blocks are never written (reserve copies them first)")
        };
        &mut data[at..at + kv]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    /// The rotation is its own inverse and keeps lengths; on a row with one huge value (as
    /// Qwen2.5's keys have) it spreads that value, so `q8_0` keeps the others far better.
    #[test]
    fn the_rotation_undoes_itself_and_spares_the_small_values_from_an_outlier() {
        for n in [64, 128, 256] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 3.0)
                .collect();
            let mut y = x.clone();
            hadamard(&mut y, n);
            let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>().sqrt();
            assert!((norm(&y) - norm(&x)).abs() < 1e-4 * norm(&x), "n {n}");
            hadamard(&mut y, n);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() < 1e-5, "n {n}: {a} {b}");
            }
        }
        let mut x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 3.0)
            .collect();
        x[5] = 150.0;
        let error = |rotate: bool| {
            let mut v = x.clone();
            if rotate {
                hadamard(&mut v, 64);
            }
            let mut row = vec![f16::ZERO; KvType::Q8_0.row_units(64)];
            KvType::Q8_0.store(&v, &mut row);
            let mut back = vec![0f32; 64];
            crate::kernels::attn_q8::axpy_q8_0(1.0, &row, &mut back);
            if rotate {
                hadamard(&mut back, 64);
            }
            // The largest error on the small values.
            (0..64)
                .filter(|&i| i != 5)
                .map(|i| (back[i] - x[i]).abs())
                .fold(0f32, f32::max)
        };
        let (plain, rotated) = (error(false), error(true));
        assert!(rotated * 3.0 < plain, "rotated {rotated}, plain {plain}");
    }

    pub(super) fn range() -> LayerRange {
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
            let block_bytes = BLOCK_POSITIONS * position_bytes(range().len(), kv_dim);
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

    proptest! {
        /// A pool with sliding-window layers (layer 1 of 0..3 global, the others windowed):
        /// under any appends, rewinds and releases, every position a windowed layer may still
        /// read holds what was written there, a session keeps the windowed part of a bounded
        /// number of blocks, the pool counts exactly the bytes caches hold and never more than
        /// its budget, a refused append changes nothing, and a rewind behind the window
        /// forgets the session.
        #[test]
        fn windowed_pool_accounting(ops in proptest::collection::vec(op(), 1..80), blocks in 2..40usize, window in 1..40usize) {
            let (kv_dim, range) = (4, LayerRange { start: 0, end: 3 });
            let windows = [Some(window), None, Some(window)];
            let block_bytes = BLOCK_POSITIONS * position_bytes(3, kv_dim);
            let pool =
                KvPool::with_windows(range, kv_dim, KvType::F16, &windows, blocks * block_bytes);
            let keep = pool.window_keep_positions();
            prop_assert_eq!(keep, window - 1 + BLOCK_POSITIONS);
            prop_assert_eq!(pool.window_block_bytes() * 3, block_bytes * 2);
            let mut caches: Vec<(KvCache, u32)> = Vec::new();
            let mut salt = 0;
            let value = |salt: u32, pos: usize, layer: usize| f16::from_f32(((salt as usize * 7 + pos * 3 + layer) % 2000) as f32);
            for op in ops {
                match op {
                    Op::Open => {
                        salt += 1;
                        caches.push((pool.new_cache(1 << 20), salt));
                    }
                    Op::Grow(i, n) if !caches.is_empty() => {
                        let k = i % caches.len();
                        let (c, salt) = &mut caches[k];
                        let (from, to) = (c.len(), c.len() + n);
                        let before = (c.block_ids(), pool.bytes_in_use());
                        match c.reserve(to) {
                            Ok(()) => {
                                for pos in from..to {
                                    for layer in 0..3 {
                                        for which in 0..2 {
                                            c.row_mut(layer, which, pos).fill(value(*salt, pos, layer));
                                        }
                                    }
                                }
                                c.set_len(to);
                                prop_assert!(c.n_window_blocks() <= (keep + n).div_ceil(BLOCK_POSITIONS) + 1);
                            }
                            Err(e) => {
                                prop_assert!(e.need > e.free);
                                prop_assert_eq!((c.block_ids(), pool.bytes_in_use()), before);
                            }
                        }
                    }
                    Op::Truncate(i, n) if !caches.is_empty() => {
                        let k = i % caches.len();
                        let c = &mut caches[k].0;
                        let len = c.len();
                        c.truncate(n);
                        prop_assert!(c.len() == n.min(len) || c.is_empty());
                        prop_assert_eq!(c.n_blocks(), KvPool::blocks_for(c.len()));
                    }
                    Op::Close(i) if !caches.is_empty() => {
                        caches.swap_remove(i % caches.len());
                    }
                    _ => {}
                }
                let mut bytes = 0;
                for (c, salt) in &caches {
                    bytes += c.n_bytes();
                    let len = c.len();
                    for pos in 0..len {
                        prop_assert!(c.row(1, 0, pos).iter().all(|v| *v == value(*salt, pos, 1)));
                    }
                    // What the next position may attend to on a windowed layer.
                    for pos in (len + 1).saturating_sub(window)..len {
                        for layer in [0, 2] {
                            prop_assert!(c.row(layer, 1, pos).iter().all(|v| *v == value(*salt, pos, layer)));
                        }
                    }
                }
                prop_assert_eq!(pool.bytes_in_use(), bytes);
                prop_assert!(pool.bytes_in_use() <= pool.budget_bytes());
            }
            caches.clear();
            prop_assert_eq!((pool.bytes_in_use(), pool.window_blocks_in_use()), (0, 0));
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
