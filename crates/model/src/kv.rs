//! Per-session KV cache for the layers of one range. Sessions own their caches; the forward
//! pass borrows them, so no session's state lives in the weights.

use half::f16;

use crate::weights::LayerRange;

/// Bytes one position of K and V (f16) costs for every layer of `range`.
pub(crate) fn position_bytes(range: LayerRange, kv_dim: usize) -> usize {
    2 * range.len() * kv_dim * std::mem::size_of::<f16>()
}

/// Keys and values (f16, as llama.cpp stores them by default) for positions `0..len` of one
/// session, for every layer of a range.
#[derive(Clone)]
pub struct KvCache {
    range: LayerRange,
    kv_dim: usize,
    n_ctx: usize,
    len: usize,
    /// Per layer: `[pos][kv_dim]` keys, then values.
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
}

impl KvCache {
    /// An empty cache for `range`, holding at most `n_ctx` positions; memory grows on demand.
    pub fn new(range: LayerRange, kv_dim: usize, n_ctx: usize) -> Self {
        KvCache {
            range,
            kv_dim,
            n_ctx,
            len: 0,
            k: vec![Vec::new(); range.len()],
            v: vec![Vec::new(); range.len()],
        }
    }

    pub fn range(&self) -> LayerRange {
        self.range
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

    /// Forgets every position from `len` on.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            for l in 0..self.k.len() {
                self.k[l].truncate(len * self.kv_dim);
                self.v[l].truncate(len * self.kv_dim);
            }
        }
    }

    /// Bytes of K and V held for the current positions.
    pub fn n_bytes(&self) -> usize {
        self.len * position_bytes(self.range, self.kv_dim)
    }

    pub(crate) fn grow_to(&mut self, len: usize) {
        for l in 0..self.k.len() {
            self.k[l].resize(len * self.kv_dim, f16::ZERO);
            self.v[l].resize(len * self.kv_dim, f16::ZERO);
        }
        self.len = len;
    }

    pub(crate) fn layer(&self, l: usize) -> (&[f16], &[f16]) {
        (&self.k[l], &self.v[l])
    }

    pub(crate) fn layer_mut(&mut self, l: usize) -> (&mut [f16], &mut [f16]) {
        (&mut self.k[l], &mut self.v[l])
    }
}
