//! Weight matrices and the batched matrix product.
//!
//! The product quantizes each activation row once per call, then hands out runs of weight rows
//! (whole panels when packed) to the pool; each is read once for every activation row of the
//! batch. Each output element is computed by the same instruction sequence on the same two
//! rows, whatever the batch size, grouping or thread: that is what makes results bitwise batch
//! invariant.

use std::marker::PhantomData;
use std::sync::Arc;

use gguf::GgmlType;

use crate::kernels::packed::{self, Layout, PackKind, PANEL};
use crate::kernels::{act, Kernels, ROWS};
use crate::pool::{SharedMut, ThreadPool};

/// Weight rows per pool task when the step has many activation rows (compute-bound: small
/// tasks balance the threads). One panel.
const TILE: usize = PANEL;
/// Tasks per thread when the step has few activation rows (memory-bound: each task streams a
/// long contiguous run of weight rows, which the hardware prefetcher follows best).
const STREAM_TASKS_PER_THREAD: usize = 8;
const STREAM_MAX_TOKENS: usize = 16;
/// Activation rows a task takes against all its weight rows before moving on.
const ACT_CHUNK: usize = 32;
/// Bytes of panels that one pass of the kernel over several activation rows takes before the
/// next rows come (about what an L1 data cache holds beside them).
const PASS_BYTES: usize = 24 << 10;

/// An immutable weight matrix of `n_rows` rows of `n_cols` values, encoded as `ty` (in ggml's
/// block layout, or repacked into panels of [`PANEL`] rows for the panel kernel when `packed`
/// is set). The bytes are shared, so a tied output head costs no second copy of the embedding.
#[derive(Clone)]
pub struct QMatrix {
    pub ty: GgmlType,
    pub n_rows: usize,
    pub n_cols: usize,
    pub packed: Option<Layout>,
    pub data: Arc<[u8]>,
}

impl QMatrix {
    /// A matrix from ggml rows; repacked into panels when `pack` is set and the type has a
    /// packed form.
    pub fn new(ty: GgmlType, n_rows: usize, n_cols: usize, data: Vec<u8>, pack: bool) -> Self {
        if PackKind::of(ty).is_some() && pack {
            return QMatrix::packed_from(ty, n_rows, n_cols, &data, |_| {});
        }
        QMatrix {
            ty,
            n_rows,
            n_cols,
            packed: None,
            data: data.into(),
        }
    }

    /// A matrix in ggml's layout, copied from `src` in one allocation.
    pub fn copied_from(ty: GgmlType, n_rows: usize, n_cols: usize, src: &[u8]) -> Self {
        QMatrix {
            ty,
            n_rows,
            n_cols,
            packed: None,
            data: Arc::from(src),
        }
    }

    /// A packed matrix from the ggml rows `src` (a type with a packed form), written in place
    /// into its one allocation, calling `consumed(n)` each time the first `n` bytes of `src`
    /// have been read for the last time, so a loader can drop them as it goes: packing costs
    /// one copy of the matrix, not two.
    pub fn packed_from(
        ty: GgmlType,
        n_rows: usize,
        n_cols: usize,
        src: &[u8],
        mut consumed: impl FnMut(usize),
    ) -> Self {
        let l = Layout::new(PackKind::of(ty).expect("a type with a packed form"), n_cols);
        let row_bytes = ty.row_bytes(n_cols);
        // Collected from an iterator of known length: allocated once, in place (a Vec turned
        // into an Arc would be copied, briefly holding the matrix twice).
        let mut data: Arc<[u8]> =
            std::iter::repeat_n(0u8, n_rows.div_ceil(PANEL) * l.panel_bytes()).collect();
        let out = Arc::get_mut(&mut data).expect("just made");
        // Panels in groups of about 4 MB of source, each then handed back.
        let group = (4 << 20) / (PANEL * row_bytes).max(1) + 1;
        for (g, outs) in out.chunks_mut(group * l.panel_bytes()).enumerate() {
            for (p, o) in outs.chunks_exact_mut(l.panel_bytes()).enumerate() {
                let r0 = (g * group + p) * PANEL;
                let rows: Vec<&[u8]> = (r0..(r0 + PANEL).min(n_rows))
                    .map(|r| &src[r * row_bytes..(r + 1) * row_bytes])
                    .collect();
                packed::pack_panel(&l, &rows, o);
            }
            consumed((((g + 1) * group * PANEL).min(n_rows)) * row_bytes);
        }
        QMatrix {
            ty,
            n_rows,
            n_cols,
            packed: Some(l),
            data,
        }
    }

    /// Row `r` in ggml's layout (a matrix that is not packed).
    pub fn row(&self, r: usize) -> &[u8] {
        assert!(self.packed.is_none(), "a packed matrix is read by panels");
        let rb = self.ty.row_bytes(self.n_cols);
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Panel `p` (rows `16p .. 16p + 16`) of a packed matrix.
    pub fn panel(&self, p: usize) -> &[u8] {
        let pb = self.packed.as_ref().expect("a packed matrix").panel_bytes();
        &self.data[p * pb..(p + 1) * pb]
    }

    /// Decodes row `r` into `out` (used for embedding lookups).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match &self.packed {
            Some(l) => packed::dequantize_panel_row(l, self.panel(r / PANEL), r % PANEL, out),
            None => gguf::quant::dequantize(self.ty, self.row(r), out)
                .expect("row length fixed at load"),
        }
    }
}

/// Activation rows quantized for one weight encoding.
pub struct QuantizedActs {
    key: ActKey,
    pub row_bytes: usize,
    pub data: Vec<u8>,
}

/// Which activation encoding a matrix consumes: a ggml block type, or a packed layout's.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ActKey {
    Ggml(GgmlType),
    Packed(PackKind),
}

impl ActKey {
    fn of(w: &QMatrix) -> ActKey {
        match &w.packed {
            Some(l) => ActKey::Packed(l.kind),
            None => ActKey::Ggml(act::act_type(w.ty)),
        }
    }
}

impl QuantizedActs {
    /// Sizes this buffer for `n_rows` rows encoded for `w` (it only grows: every byte of a row
    /// is written before it is read, so nothing is zeroed).
    fn size_for(&mut self, w: &QMatrix, n_rows: usize) {
        let key = ActKey::of(w);
        self.row_bytes = match (&w.packed, key) {
            (Some(l), _) => l.a_row_bytes(),
            (None, ActKey::Ggml(ty)) => ty.row_bytes(w.n_cols),
            (None, ActKey::Packed(_)) => unreachable!("packed key only for packed matrices"),
        };
        self.key = key;
        let len = n_rows * self.row_bytes;
        if self.data.len() < len {
            self.data.resize(len, 0);
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

/// Most products one [`matmul`] call computes together.
pub const MAX_PRODUCTS: usize = 4;

/// Quantized activation buffers reused across calls, so a warm forward pass does not allocate:
/// one per distinct activation encoding of the products at hand (Q, K and V usually share one).
#[derive(Default)]
pub struct ActScratch {
    acts: Vec<QuantizedActs>,
    /// Encodings prepared for the next product, and the rows each holds.
    n_acts: usize,
    n_rows: usize,
}

impl ActScratch {
    /// Makes room for `n_rows` activation rows in every encoding `weights` consume. The rows are
    /// then written with [`RowQuantizer::quantize`] (each row once, from any thread), and
    /// [`matmul_prepared`] multiplies them: a per-row job that produces an activation row can
    /// quantize it at once instead of the product quantizing all rows in a pool job of its own.
    pub fn prepare(&mut self, weights: &[&QMatrix], n_rows: usize) -> RowQuantizer<'_> {
        assert!(
            weights.len() <= MAX_PRODUCTS,
            "at most {MAX_PRODUCTS} products per call"
        );
        let n_cols = weights.first().map_or(0, |w| w.n_cols);
        let mut q = RowQuantizer {
            n_cols,
            encodings: [None; MAX_PRODUCTS],
            _scratch: PhantomData,
        };
        self.n_acts = 0;
        self.n_rows = n_rows;
        for w in weights {
            assert_eq!(
                w.n_cols, n_cols,
                "products in one call share their input width"
            );
            let key = ActKey::of(w);
            if self.acts[..self.n_acts].iter().any(|a| a.key == key) {
                continue;
            }
            if self.acts.len() == self.n_acts {
                self.acts.push(QuantizedActs {
                    key,
                    row_bytes: 0,
                    data: Vec::new(),
                });
            }
            let a = &mut self.acts[self.n_acts];
            a.size_for(w, n_rows);
            q.encodings[self.n_acts] = Some((
                key,
                a.row_bytes,
                SharedMut::new(&mut a.data[..n_rows * a.row_bytes]),
            ));
            self.n_acts += 1;
        }
        q
    }
}

/// Writes activation rows into the buffers [`ActScratch::prepare`] sized (borrowing the
/// scratch, so they cannot move while it lives).
pub struct RowQuantizer<'a> {
    n_cols: usize,
    encodings: [Option<(ActKey, usize, SharedMut<u8>)>; MAX_PRODUCTS],
    _scratch: PhantomData<&'a mut ActScratch>,
}

impl RowQuantizer<'_> {
    /// Quantizes activation row `t` (`x`, one row) into every prepared encoding.
    ///
    /// # Safety
    /// `t` is below the prepared row count, and no other thread writes row `t` meanwhile.
    pub unsafe fn quantize(&self, kernels: &Kernels, t: usize, x: &[f32]) {
        assert_eq!(x.len(), self.n_cols, "one activation row");
        for (key, row_bytes, data) in self.encodings.iter().flatten() {
            // SAFETY: row `t` is this caller's alone (the contract above).
            let out = unsafe { data.slice(t * row_bytes, *row_bytes) };
            match *key {
                ActKey::Packed(kind) => {
                    kernels.quantize_packed_act(&Layout::new(kind, self.n_cols), x, out)
                }
                ActKey::Ggml(ty) => act::quantize_row(ty, x, out),
            }
        }
    }
}

/// Computes several products that share the activation rows `x` (`n_tokens * n_cols`) in one
/// pool job, e.g. Q, K and V, or gate and up. Activations are quantized into `scratch` first
/// (spread over the pool when there are four rows or more).
pub fn matmul(
    kernels: &Kernels,
    pool: &ThreadPool,
    x: &[f32],
    products: &mut [Product<'_>],
    scratch: &mut ActScratch,
) {
    let Some(first) = products.first() else {
        return;
    };
    let n_cols = first.w.n_cols;
    let n_tokens = x.len() / n_cols;
    let mut weights = [first.w; MAX_PRODUCTS];
    for (w, p) in weights.iter_mut().zip(products.iter()) {
        *w = p.w;
    }
    let q = scratch.prepare(&weights[..products.len()], n_tokens);
    // SAFETY: every row is quantized once, by one task.
    let quantize = |t: usize| unsafe { q.quantize(kernels, t, &x[t * n_cols..(t + 1) * n_cols]) };
    if n_tokens < 4 {
        (0..n_tokens).for_each(quantize);
    } else {
        pool.run_rows(n_tokens, &quantize);
    }
    matmul_prepared(kernels, pool, products, scratch);
}

/// [`matmul`] of the activation rows already written into `scratch` (see
/// [`ActScratch::prepare`]; the products' weights must be the prepared ones).
pub fn matmul_prepared(
    kernels: &Kernels,
    pool: &ThreadPool,
    products: &mut [Product<'_>],
    scratch: &ActScratch,
) {
    let Some(first) = products.first() else {
        return;
    };
    assert!(
        products.len() <= MAX_PRODUCTS,
        "at most {MAX_PRODUCTS} products per call"
    );
    let n_cols = first.w.n_cols;
    let n_tokens = scratch.n_rows;
    let prepared = &scratch.acts[..scratch.n_acts];
    let mut act_idx = [0usize; MAX_PRODUCTS];
    for (pi, p) in products.iter().enumerate() {
        assert_eq!(
            p.w.n_cols, n_cols,
            "products in one call share their input width"
        );
        assert_eq!(p.out.len(), n_tokens * p.w.n_rows, "output size");
        let key = ActKey::of(p.w);
        act_idx[pi] = prepared
            .iter()
            .position(|a| a.key == key)
            .expect("activations prepared for every product");
    }
    let acts = &scratch.acts;
    // Task t covers run t of the concatenated weight rows of all products. Which rows a task
    // takes never changes a result: every element is computed the same way.
    let rows_per_task = if n_tokens <= STREAM_MAX_TOKENS {
        let total: usize = products.iter().map(|p| p.w.n_rows).sum();
        (total / (pool.n_threads() * STREAM_TASKS_PER_THREAD))
            .next_multiple_of(PANEL)
            .max(TILE)
    } else {
        TILE
    };
    let mut tiles = [usize::MAX; MAX_PRODUCTS];
    let mut n_tasks = 0;
    for (pi, p) in products.iter().enumerate() {
        tiles[pi] = n_tasks;
        n_tasks += p.w.n_rows.div_ceil(rows_per_task);
    }
    let n_products = products.len();
    let mut outs: [Option<(&QMatrix, SharedMut<f32>)>; MAX_PRODUCTS] = [None; MAX_PRODUCTS];
    for (o, p) in outs.iter_mut().zip(products.iter_mut()) {
        *o = Some((p.w, SharedMut::new(p.out)));
    }
    pool.run(n_tasks, &|task| {
        let pi = tiles[..n_products].partition_point(|&start| start <= task) - 1;
        let (w, out) = outs[pi].as_ref().expect("one per product");
        let acts = &acts[act_idx[pi]];
        let r0 = (task - tiles[pi]) * rows_per_task;
        let r1 = (r0 + rows_per_task).min(w.n_rows);
        match &w.packed {
            Some(layout) => panel_rows(kernels, layout, w, acts, n_tokens, r0..r1, out),
            None => ggml_rows(kernels, w, acts, n_tokens, r0..r1, out),
        }
    });
}

/// Weight rows `rows` (whole panels, but for the matrix's last) of a packed matrix against
/// every activation row; the kernel's elements do not depend on how the rows are grouped.
fn panel_rows(
    kernels: &Kernels,
    layout: &Layout,
    w: &QMatrix,
    acts: &QuantizedActs,
    n_tokens: usize,
    rows: std::ops::Range<usize>,
    out: &SharedMut<f32>,
) {
    assert_eq!(rows.start % PANEL, 0, "tasks start at a panel");
    let pb = layout.panel_bytes();
    let first = rows.start / PANEL;
    let n_panels = rows.len().div_ceil(PANEL);
    // The kernel takes a few activation rows per call, so several calls pass over the same
    // panels: as many panels a pass as stay in the L1 cache between them (a long run of a
    // batched decode step's panels would be read from memory again by each call). One row
    // streams the whole run in one call.
    let per_pass = if n_tokens > 1 {
        (PASS_BYTES / pb).max(1)
    } else {
        n_panels
    };
    // Activation rows in chunks that stay in cache while every panel of the task passes over
    // them (a prompt's rows would not).
    for t0 in (0..n_tokens).step_by(ACT_CHUNK) {
        let t1 = (t0 + ACT_CHUNK).min(n_tokens);
        let a: [&[u8]; ACT_CHUNK] = std::array::from_fn(|j| acts.row((t0 + j).min(t1 - 1)));
        for p0 in (0..n_panels).step_by(per_pass) {
            let p1 = (p0 + per_pass).min(n_panels);
            let r0 = rows.start + p0 * PANEL;
            let r1 = (rows.start + p1 * PANEL).min(rows.end);
            let panels = &w.data[(first + p0) * pb..(first + p1) * pb];
            // SAFETY: rows `rows` of every output row belong to this task alone, and the
            // output holds `n_tokens * w.n_rows` values (asserted by the caller).
            unsafe {
                let o = out.at(t0 * w.n_rows + r0);
                kernels.packed_panels(layout, panels, r1 - r0, &a[..t1 - t0], o, w.n_rows);
            }
        }
    }
}

/// Weight rows `rows` of a ggml-layout matrix against every activation row.
fn ggml_rows(
    kernels: &Kernels,
    w: &QMatrix,
    acts: &QuantizedActs,
    n_tokens: usize,
    rows: std::ops::Range<usize>,
    out: &SharedMut<f32>,
) {
    let n_cols = w.n_cols;
    let mut scratch = Vec::new();
    for r in rows {
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
}
