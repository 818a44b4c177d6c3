//! Weight matrices and the batched matrix product.
//!
//! The product quantizes each activation row once per call, then hands out tiles of weight rows
//! to the pool; a tile is read once for every activation row of the batch. Each output element
//! is one call of the same dot kernel on the same two rows, whatever the batch size, tile or
//! thread: that is what makes results bitwise batch invariant.

use std::sync::Arc;

use gguf::GgmlType;

use crate::kernels::{act, Kernels, ROWS};
use crate::pool::{SharedMut, ThreadPool};

/// Weight rows per pool task.
const TILE: usize = 16;

/// An immutable weight matrix of `n_rows` rows of `n_cols` values, encoded as `ty`. The bytes
/// are shared, so a tied output head costs no second copy of the embedding.
#[derive(Clone)]
pub struct QMatrix {
    pub ty: GgmlType,
    pub n_rows: usize,
    pub n_cols: usize,
    pub data: Arc<[u8]>,
}

impl QMatrix {
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.n_cols)
    }

    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Decodes row `r` into `out` (used for embedding lookups).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        gguf::quant::dequantize(self.ty, self.row(r), out).expect("row length fixed at load");
    }
}

/// Activation rows quantized for one weight type.
pub struct QuantizedActs {
    pub ty: GgmlType,
    pub row_bytes: usize,
    pub data: Vec<u8>,
}

impl QuantizedActs {
    pub fn new(weight_ty: GgmlType, x: &[f32], n_cols: usize) -> Self {
        let ty = act::act_type(weight_ty);
        let row_bytes = ty.row_bytes(n_cols);
        let n_rows = x.len() / n_cols;
        let mut data = vec![0u8; n_rows * row_bytes];
        for (xr, out) in x.chunks_exact(n_cols).zip(data.chunks_exact_mut(row_bytes)) {
            act::quantize_row(ty, xr, out);
        }
        QuantizedActs {
            ty,
            row_bytes,
            data,
        }
    }

    fn row(&self, t: usize) -> &[u8] {
        &self.data[t * self.row_bytes..(t + 1) * self.row_bytes]
    }
}

/// One product of a batched call: `out[t * w.n_rows + r] = w.row(r) . x[t]`.
pub struct Product<'a> {
    pub w: &'a QMatrix,
    pub out: &'a mut [f32],
}

/// Computes several products that share the activation rows `x` (`n_tokens * n_cols`) in one
/// pool job, e.g. Q, K and V, or gate and up.
pub fn matmul(kernels: &Kernels, pool: &ThreadPool, x: &[f32], products: &mut [Product<'_>]) {
    let Some(first) = products.first() else {
        return;
    };
    let n_cols = first.w.n_cols;
    let n_tokens = x.len() / n_cols;
    // Quantize once per distinct activation type (Q, K and V usually share one).
    let mut acts: Vec<QuantizedActs> = Vec::new();
    let mut act_idx = Vec::with_capacity(products.len());
    for p in products.iter() {
        assert_eq!(
            p.w.n_cols, n_cols,
            "products in one call share their input width"
        );
        assert_eq!(p.out.len(), n_tokens * p.w.n_rows, "output size");
        let at = act::act_type(p.w.ty);
        let idx = match acts.iter().position(|a| a.ty == at) {
            Some(i) => i,
            None => {
                acts.push(QuantizedActs::new(p.w.ty, x, n_cols));
                acts.len() - 1
            }
        };
        act_idx.push(idx);
    }
    // Task t covers tile t of the concatenated weight rows of all products.
    let mut tiles = Vec::with_capacity(products.len());
    let mut n_tasks = 0;
    for p in products.iter() {
        tiles.push(n_tasks);
        n_tasks += p.w.n_rows.div_ceil(TILE);
    }
    let outs: Vec<(&QMatrix, SharedMut<f32>)> = products
        .iter_mut()
        .map(|p| (p.w, SharedMut::new(p.out)))
        .collect();
    pool.run(n_tasks, &|task| {
        let pi = tiles.partition_point(|&start| start <= task) - 1;
        let (w, out) = &outs[pi];
        let acts = &acts[act_idx[pi]];
        let r0 = (task - tiles[pi]) * TILE;
        let r1 = (r0 + TILE).min(w.n_rows);
        let mut scratch = Vec::new();
        for r in r0..r1 {
            let wr = w.row(r);
            // Four activation rows per call while they last; the multi-row kernel is bitwise
            // equal to single calls, so the grouping never changes a result.
            let mut t = 0;
            while t + ROWS <= n_tokens {
                let a = [
                    acts.row(t),
                    acts.row(t + 1),
                    acts.row(t + 2),
                    acts.row(t + 3),
                ];
                let v = kernels.dot4(w.ty, n_cols, wr, a, &mut scratch);
                for (k, v) in v.into_iter().enumerate() {
                    // SAFETY: rows [r0, r1) of this product belong to this task alone.
                    unsafe { out.write((t + k) * w.n_rows + r, v) };
                }
                t += ROWS;
            }
            for t in t..n_tokens {
                let v = kernels.dot(w.ty, n_cols, wr, acts.row(t), &mut scratch);
                // SAFETY: as above.
                unsafe { out.write(t * w.n_rows + r, v) };
            }
        }
    });
}
