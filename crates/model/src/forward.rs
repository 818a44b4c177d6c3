//! The batched forward pass over a layer range.

use gguf::GgufFile;
use std::sync::Mutex;

use crate::config::{LayerSpec, ModelConfig, RopeStyle};
use crate::kernels::{Isa, Kernels};
use crate::kv::{hadamard, KvCache, KvPool, KvType};
use crate::matmul::{matmul, matmul_prepared, ActScratch, Product, RowQuantizer};
use crate::pool::{SharedMut, ThreadPool};
use crate::weights::{LayerRange, Weights};
use crate::Error;

mod attention;

use attention::AttnScratch;

/// How to run a model: threads and (optionally) a forced instruction set.
#[derive(Debug, Clone, Copy)]
pub struct ModelOptions {
    pub n_threads: usize,
    /// `None` picks the best the CPU has.
    pub isa: Option<Isa>,
    /// How sessions' caches store K and V.
    pub kv_type: KvType,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            n_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            isa: None,
            kv_type: KvType::F16,
        }
    }
}

/// One row of a batch: a token (or, past the first range, an incoming hidden state) of one
/// session at one position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    /// Index of the session's cache in the `caches` slice passed to [`Model::forward`].
    pub seq: usize,
    pub pos: usize,
    /// Used only by a range that starts at layer 0.
    pub token: u32,
    /// Whether the last range should return logits for this row.
    pub want_logits: bool,
}

impl Row {
    /// The rows of one session (the batch's first cache) holding `tokens` at positions
    /// `start..`: logits for every row when `all_logits`, else for the last one.
    pub fn of_session(start: usize, tokens: &[u32], all_logits: bool) -> Vec<Row> {
        tokens
            .iter()
            .enumerate()
            .map(|(i, &token)| Row {
                seq: 0,
                pos: start + i,
                token,
                want_logits: all_logits || i + 1 == tokens.len(),
            })
            .collect()
    }
}

/// A batch: rows from any sessions, and for ranges past layer 0 their hidden states
/// (`rows.len() * n_embd` values, in row order).
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    pub rows: &'a [Row],
    pub hidden: Option<&'a [f32]>,
}

/// What a range produces.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// A range that does not end at the last layer: hidden states for every row.
    Hidden(Vec<f32>),
    /// The last range: logits (`n_vocab` each) for the rows that asked, in row order.
    Logits(Vec<f32>),
}

/// Fewest rows a step runs data-parallel ([`Model::split`]): below, each lane would stream
/// every weight for a row or two, where sharing the weights across threads costs less.
const MIN_PARALLEL_ROWS: usize = 8;

/// `v[..len]`, grown if shorter. Buffers sized by the step only grow, and a step uses a prefix
/// (every buffer is written in full before it is read): a decode step after a prefill step must
/// not shrink them, or the next prefill zeroes megabytes again.
fn grow(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

/// The weights of one layer range, ready to run.
pub struct Model {
    config: ModelConfig,
    range: LayerRange,
    /// The distinct RoPE settings of the range's layers (base, scale), and which each layer of
    /// the range uses: one table of angles per setting per step.
    ropes: Vec<(f32, f32)>,
    layer_rope: Vec<usize>,
    weights: Weights,
    kernels: Kernels,
    kv_type: KvType,
    pool: ThreadPool,
    /// Per-step buffers, reused (forward passes run one at a time).
    workspace: Mutex<Workspace>,
    /// With several threads, one lane per thread for data-parallel steps ([`Model::split`]).
    lanes: Vec<Lane>,
}

/// One group of sessions' own way through the layers: a single-thread pool and buffers.
struct Lane {
    pool: ThreadPool,
    ws: Mutex<Workspace>,
}

/// A forward pass's activations: the residual stream, one layer's intermediates, quantized
/// matrix inputs, RoPE angles. Sized for the largest step so far.
#[derive(Default)]
struct Workspace {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    /// A normed attention or FFN output, for the families that norm them before the residual.
    p: Vec<f32>,
    /// Rows that want logits, before the output norm.
    sel: Vec<f32>,
    ends: Vec<usize>,
    acts: ActScratch,
    /// One table of angles per distinct RoPE setting of the range's layers.
    rope: Vec<RopeTable>,
    /// Attention scratch (rounded queries, scores, outputs) per pool thread, sized by the caller
    /// before each attention job so that no worker allocates, and the step's blocks of rows.
    attn_scratch: AttnScratch,
    /// A data-parallel step's groups: runs of rows holding whole sessions.
    groups: Vec<std::ops::Range<usize>>,
    /// A lane's rows, sessions renumbered from its first.
    rows: Vec<Row>,
    /// An embedding row as read from the model file.
    embd_row: Vec<u8>,
}

impl Model {
    /// Loads `range` (the whole model when `None`) from `file`.
    pub fn load(
        file: &GgufFile,
        range: Option<LayerRange>,
        opts: ModelOptions,
    ) -> Result<Model, Error> {
        let config = ModelConfig::from_header(file.header())?;
        let range = match range {
            Some(r) => LayerRange::new(r.start, r.end, config.n_layers)?,
            None => LayerRange::new(0, config.n_layers, config.n_layers)?,
        };
        let mut ropes: Vec<(f32, f32)> = Vec::new();
        let layer_rope = config.layers[range.start..range.end]
            .iter()
            .map(|l: &LayerSpec| {
                let key = (l.rope_base, l.rope_freq_scale);
                ropes.iter().position(|r| *r == key).unwrap_or_else(|| {
                    ropes.push(key);
                    ropes.len() - 1
                })
            })
            .collect();
        let isa = opts.isa.unwrap_or_else(Isa::detect);
        let kernels = Kernels::new(isa).ok_or(Error::BadConfig {
            field: "isa",
            value: isa.name().to_string(),
            why: "this CPU does not support it",
        })?;
        if !opts.kv_type.supports(config.head_dim) {
            return Err(Error::BadConfig {
                field: "kv_type",
                value: opts.kv_type.name().to_string(),
                why: "the model's head width is not a multiple of the type's 32-value blocks",
            });
        }
        let weights = Weights::load(file, &config, range, kernels.packs_weights())?;
        Ok(Model {
            config,
            range,
            ropes,
            layer_rope,
            weights,
            kernels,
            kv_type: opts.kv_type,
            pool: ThreadPool::new(opts.n_threads),
            workspace: Mutex::new(Workspace::default()),
            lanes: (0..if opts.n_threads > 1 {
                opts.n_threads
            } else {
                0
            })
                .map(|_| Lane {
                    pool: ThreadPool::new(1),
                    ws: Mutex::new(Workspace::default()),
                })
                .collect(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn range(&self) -> LayerRange {
        self.range
    }

    pub fn isa(&self) -> Isa {
        self.kernels.isa()
    }

    /// How many times a kernel thread found itself woken onto the CPU of the thread that
    /// handed it work and moved to another (see [`crate::pool`]).
    pub fn kernel_thread_moves(&self) -> u64 {
        self.pool.n_moves()
    }

    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// Bytes of weights this range holds.
    pub fn weight_bytes(&self) -> usize {
        self.weights.n_bytes()
    }

    /// Bytes of the embedding this range reads from the model file a row at a time instead of
    /// holding it (not in [`Model::weight_bytes`]): where it starts at layer 0 and its output
    /// head is not tied to the embedding.
    pub fn in_file_weight_bytes(&self) -> usize {
        self.weights.in_file_bytes()
    }

    pub fn is_first(&self) -> bool {
        self.range.start == 0
    }

    /// How this model's caches store K and V.
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    pub fn is_last(&self) -> bool {
        self.range.end == self.config.n_layers
    }

    /// Bytes of per-step activations (scratch) a step of `n_rows` rows, `n_outputs` of which
    /// produce logits, needs on this range: the f32 buffers of one layer (hidden, norm,
    /// post-norm, output, q, attention, k, v, gate, up), the quantized copies of the matrix
    /// inputs, and the logits. Reused across layers, so independent of the range's length.
    pub fn scratch_bytes(&self, n_rows: usize, n_outputs: usize) -> usize {
        let c = &self.config;
        let (d, q, kv, ff) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff);
        let per_row = 4 * (4 * d + 2 * q + 2 * kv + 2 * ff) + 2 * (2 * d + q + ff);
        let logits = if self.is_last() { 4 * c.n_vocab } else { 0 };
        n_rows * per_row + n_outputs * logits
    }

    /// A new, empty cache for one session on this range, from a pool of its own without a
    /// budget (for tools that hold one session; servers share one [`KvPool`]).
    pub fn new_cache(&self, n_ctx: usize) -> KvCache {
        self.new_pool(usize::MAX).new_cache(n_ctx)
    }

    /// A pool of KV blocks for this range holding at most `budget_bytes`; sliding-window
    /// layers keep their K and V only for the window.
    pub fn new_pool(&self, budget_bytes: usize) -> KvPool {
        let windows: Vec<Option<usize>> = self.config.layers[self.range.start..self.range.end]
            .iter()
            .map(|l| l.window)
            .collect();
        KvPool::with_windows(
            self.range,
            self.config.kv_dim(),
            self.kv_type,
            &windows,
            budget_bytes,
        )
    }

    /// Runs `batch` through this range, appending each row's K and V to its session's cache.
    /// Every session's rows must continue its cache: positions `len, len + 1, ...` in order.
    pub fn forward(&self, batch: Batch<'_>, caches: &mut [&mut KvCache]) -> Result<Output, Error> {
        let mut out = Vec::new();
        self.forward_into(batch, caches, &mut out)?;
        // A fresh buffer grows to exactly this step's size.
        Ok(if self.is_last() {
            Output::Logits(out)
        } else {
            Output::Hidden(out)
        })
    }

    /// [`Model::forward`] writing into `out`: the hidden states (exactly), or on the last range
    /// the logits of the rows that want them in `out[..n_out * n_vocab]` (`out` only grows, so it
    /// may be longer). With `out` and the model's own buffers warm, a step allocates nothing
    /// (buffers only grow when a step is larger than any before it).
    pub fn forward_into(
        &self,
        batch: Batch<'_>,
        caches: &mut [&mut KvCache],
        out: &mut Vec<f32>,
    ) -> Result<(), Error> {
        let result = self.forward_pass(batch, caches, out);
        // A range that is only part of the model hands its output to the next shard, which may
        // share this host's cores: the pool sleeps now instead of spinning through that pass.
        // The whole model in one process keeps its workers spinning into the next step.
        if !(self.is_first() && self.is_last()) {
            self.pool.rest();
        }
        result
    }

    fn forward_pass(
        &self,
        batch: Batch<'_>,
        caches: &mut [&mut KvCache],
        out: &mut Vec<f32>,
    ) -> Result<(), Error> {
        let c = &self.config;
        let rows = batch.rows;
        let n = rows.len();
        let d = c.n_embd;
        let mut guard = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        let ws = &mut *guard;
        self.validate(batch, caches, &mut ws.ends)?;
        match batch.hidden {
            Some(h) => {
                ws.x.clear();
                ws.x.extend_from_slice(h);
            }
            None => {
                let embd = self
                    .weights
                    .embd
                    .as_ref()
                    .expect("validated: first range has the embedding");
                embd.check()?;
                ws.x.resize(n * d, 0.0);
                for (row, out) in rows.iter().zip(ws.x.chunks_exact_mut(d)) {
                    embd.dequantize_row(row.token as usize, out, &mut ws.embd_row)?;
                    if let Some(scale) = c.embd_scale {
                        out.iter_mut().for_each(|v| *v *= scale);
                    }
                }
            }
        }
        // Room for every new position first, all or nothing.
        ws.ends.clear();
        ws.ends.extend(caches.iter().map(|c| c.len()));
        for row in rows {
            ws.ends[row.seq] = ws.ends[row.seq].max(row.pos + 1);
        }
        for s in 0..caches.len() {
            if let Err(e) = caches[s].reserve(ws.ends[s]) {
                for c in caches.iter_mut() {
                    let len = c.len();
                    c.truncate(len);
                }
                return Err(Error::KvExhausted(e));
            }
        }
        let mut groups = std::mem::take(&mut ws.groups);
        if self.split(rows, &mut groups) {
            // Data parallel: each group of whole sessions runs every layer on its own thread,
            // with its own buffers (no synchronization inside a layer); a row's arithmetic is the
            // same as on the shared path.
            let xs = SharedMut::new(&mut ws.x[..n * d]);
            let cs = SharedMut::new(caches);
            let groups = &groups;
            self.pool.run(groups.len(), &|g| {
                let r = groups[g].clone();
                let first_seq = rows[r.start].seq;
                let n_seq = rows[r.end - 1].seq + 1 - first_seq;
                let lane = &self.lanes[g];
                let mut lws = lane.ws.lock().unwrap_or_else(|e| e.into_inner());
                let lws = &mut *lws;
                // SAFETY: groups hold disjoint runs of rows and of sessions.
                let (x, caches) = unsafe {
                    (
                        xs.slice(r.start * d, r.len() * d),
                        cs.slice(first_seq, n_seq),
                    )
                };
                lws.x.clear();
                lws.x.extend_from_slice(x);
                let mut own = std::mem::take(&mut lws.rows);
                own.clear();
                own.extend(rows[r].iter().map(|row| Row {
                    seq: row.seq - first_seq,
                    ..*row
                }));
                self.run_layers(&lane.pool, lws, &own, caches);
                x.copy_from_slice(&lws.x[..x.len()]);
                lws.rows = own;
            });
        } else {
            self.run_layers(&self.pool, ws, rows, caches);
        }
        ws.groups = groups;
        for (c, &end) in caches.iter_mut().zip(&ws.ends) {
            c.set_len(end);
        }
        if !self.is_last() {
            out.clear();
            out.extend_from_slice(&ws.x);
            return Ok(());
        }
        let n_out = rows.iter().filter(|r| r.want_logits).count();
        ws.sel.clear();
        for (i, row) in rows.iter().enumerate() {
            if row.want_logits {
                ws.sel.extend_from_slice(&ws.x[i * d..(i + 1) * d]);
            }
        }
        let normed = grow(&mut ws.h, n_out * d);
        let norm = self
            .weights
            .output_norm
            .as_ref()
            .expect("last range has the output norm");
        rms_norm(&ws.sel, norm, c.rms_eps, normed);
        let head = self
            .weights
            .output
            .as_ref()
            .expect("last range has the output head");
        let logits = grow(out, n_out * c.n_vocab);
        matmul(
            &self.kernels,
            &self.pool,
            normed,
            &mut [Product {
                w: head,
                out: logits,
            }],
            &mut ws.acts,
        );
        Ok(())
    }

    /// Whether to run `rows` data-parallel, and how: one group of whole sessions per lane, in
    /// order, with about the same number of rows each. Only for batches of several sessions in
    /// session order that split evenly enough (a long prompt's rows stay on the shared path,
    /// where every thread works on them).
    fn split(&self, rows: &[Row], groups: &mut Vec<std::ops::Range<usize>>) -> bool {
        groups.clear();
        let (n, t) = (rows.len(), self.lanes.len());
        if t < 2 || n < MIN_PARALLEL_ROWS || rows.windows(2).any(|w| w[1].seq < w[0].seq) {
            return false;
        }
        let mut start = 0;
        for g in 0..t {
            if start == n {
                break;
            }
            let mut end = (start + (n - start).div_ceil(t - g)).min(n);
            while end < n && rows[end].seq == rows[end - 1].seq {
                end += 1;
            }
            groups.push(start..end);
            start = end;
        }
        let longest = groups.iter().map(|g| g.len()).max().unwrap_or(0);
        groups.len() == t && longest * t <= n + n / 4 + t
    }

    /// Every layer of the range over the rows' hidden states in `ws.x`, on `pool`; each row's K
    /// and V go to its session's cache (room reserved by the caller).
    fn run_layers(
        &self,
        pool: &ThreadPool,
        ws: &mut Workspace,
        rows: &[Row],
        caches: &mut [&mut KvCache],
    ) {
        let c = &self.config;
        let (n, d, qd, kv) = (rows.len(), c.n_embd, c.q_dim(), c.kv_dim());
        ws.rope.resize_with(self.ropes.len(), RopeTable::default);
        for (table, &(base, scale)) in ws.rope.iter_mut().zip(&self.ropes) {
            table.fill(c.rope_dim, base, scale, rows);
        }
        let Workspace {
            x,
            h,
            q,
            k,
            v,
            attn,
            o,
            p,
            g,
            u,
            acts,
            rope,
            attn_scratch,
            ..
        } = ws;
        let (h, q, k, v) = (
            grow(h, n * d),
            grow(q, n * qd),
            grow(k, n * kv),
            grow(v, n * kv),
        );
        let (attn, o, p) = (grow(attn, n * qd), grow(o, n * d), grow(p, n * d));
        let (g, u) = (grow(g, n * c.n_ff), grow(u, n * c.n_ff));
        // Which buffer holds the FFN output that joins the residual stream next: the down
        // projection's, or its norm.
        let mut ffn_out_normed = false;
        for (li, lw) in self.weights.layers.iter().enumerate() {
            let layer = c.layers[self.range.start + li];
            // The previous layer's FFN output joins the residual stream here.
            let residual = (li > 0).then_some(if ffn_out_normed { &p[..] } else { &o[..] });
            let rows_q = acts.prepare(&[&lw.wq, &lw.wk, &lw.wv], n);
            self.add_norm(pool, x, residual, &lw.attn_norm, h, &rows_q);
            matmul_prepared(
                &self.kernels,
                pool,
                &mut [
                    Product { w: &lw.wq, out: q },
                    Product { w: &lw.wk, out: k },
                    Product { w: &lw.wv, out: v },
                ],
                acts,
            );
            {
                let table = &rope[self.layer_rope[li]];
                let (qs, ks, vs) = (SharedMut::new(q), SharedMut::new(k), SharedMut::new(v));
                pool.run_rows(n, &|i| {
                    // SAFETY: each row's slices belong to this task alone.
                    let (qi, ki, vi) = unsafe {
                        (
                            qs.slice(i * qd, qd),
                            ks.slice(i * kv, kv),
                            vs.slice(i * kv, kv),
                        )
                    };
                    self.shape_qkv(lw, table, i, qi, ki, vi);
                });
            }
            for (i, row) in rows.iter().enumerate() {
                let cache = &mut caches[row.seq];
                for (which, src) in [(0, &*k), (1, &*v)] {
                    self.kv_type.store(
                        &src[i * kv..(i + 1) * kv],
                        cache.row_mut(li, which, row.pos),
                    );
                }
            }
            self.attention(pool, li, layer.window, rows, caches, q, attn, attn_scratch);
            self.rotate_back(pool, attn);
            matmul(
                &self.kernels,
                pool,
                attn,
                &mut [Product { w: &lw.wo, out: o }],
                acts,
            );
            let attn_out: &[f32] = match &lw.post_attn_norm {
                Some(w) => {
                    self.norm_rows(pool, o, w, p);
                    p
                }
                None => o,
            };
            let rows_q = acts.prepare(&[&lw.w_gate, &lw.w_up], n);
            self.add_norm(pool, x, Some(attn_out), &lw.ffn_norm, h, &rows_q);
            matmul_prepared(
                &self.kernels,
                pool,
                &mut [
                    Product {
                        w: &lw.w_gate,
                        out: g,
                    },
                    Product {
                        w: &lw.w_up,
                        out: u,
                    },
                ],
                acts,
            );
            {
                // The activation and the down projection's activation row, in one pass per row.
                let rows_q = acts.prepare(&[&lw.w_down], n);
                let (gs, u, f) = (SharedMut::new(g), &*u, c.n_ff);
                pool.run_rows(n, &|i| {
                    // SAFETY: each row's slice (and quantized row) belongs to this task alone.
                    unsafe {
                        let gi = gs.slice(i * f, f);
                        self.kernels
                            .act_mul(c.block.ffn_act, gi, &u[i * f..(i + 1) * f]);
                        rows_q.quantize(&self.kernels, i, gi);
                    }
                });
            }
            matmul_prepared(
                &self.kernels,
                pool,
                &mut [Product {
                    w: &lw.w_down,
                    out: o,
                }],
                acts,
            );
            ffn_out_normed = match &lw.post_ffn_norm {
                Some(w) => {
                    self.norm_rows(pool, o, w, p);
                    true
                }
                None => false,
            };
        }
        if !self.weights.layers.is_empty() {
            let last: &[f32] = if ffn_out_normed { p } else { o };
            x.iter_mut().zip(last).for_each(|(a, b)| *a += b);
        }
    }

    /// One row's Q, K and V as attention takes them: biases added, each head RMS-normed, and
    /// RoPE applied to Q and K, as the family's block says; then rotated where the cache's type
    /// asks it ([`KvType::rotations`]).
    fn shape_qkv(
        &self,
        lw: &crate::weights::LayerWeights,
        table: &RopeTable,
        i: usize,
        q: &mut [f32],
        k: &mut [f32],
        v: &mut [f32],
    ) {
        let c = &self.config;
        for (x, b) in [(&mut *q, &lw.bq), (&mut *k, &lw.bk), (&mut *v, &lw.bv)] {
            if let Some(b) = b {
                x.iter_mut().zip(b).for_each(|(a, b)| *a += b);
            }
        }
        for (x, w) in [(&mut *q, &lw.q_norm), (&mut *k, &lw.k_norm)] {
            if let Some(w) = w {
                for head in x.chunks_exact_mut(c.head_dim) {
                    norm_in_place(head, w, c.rms_eps);
                }
            }
        }
        table.apply_row(i, q, c.head_dim, c.block.rope);
        table.apply_row(i, k, c.head_dim, c.block.rope);
        if let Some((qk, vr)) = self.kv_type.rotations(c.head_dim) {
            hadamard(q, qk);
            hadamard(k, qk);
            hadamard(v, vr);
        }
    }

    /// Rotates each row of the attention's output back where the cache's type rotated V
    /// ([`KvType::rotations`]): the output is a sum of rotated V rows, and the matrix is its
    /// own inverse.
    fn rotate_back(&self, pool: &ThreadPool, attn: &mut [f32]) {
        let Some((_, v)) = self.kv_type.rotations(self.config.head_dim) else {
            return;
        };
        let qd = self.config.q_dim();
        let outs = SharedMut::new(attn);
        pool.run_rows(attn.len() / qd, &|i| {
            // SAFETY: each row's slice belongs to this task alone.
            hadamard(unsafe { outs.slice(i * qd, qd) }, v);
        });
    }

    /// `out = rms_norm(x) * weight`, row by row, in parallel.
    fn norm_rows(&self, pool: &ThreadPool, x: &[f32], weight: &[f32], out: &mut [f32]) {
        let d = weight.len();
        let n = x.len() / d;
        let os = SharedMut::new(out);
        pool.run(n.div_ceil(4), &|task| {
            let run = 4 * task..(4 * task + 4).min(n);
            // SAFETY: each run's rows belong to this task alone.
            let o = unsafe { os.slice(run.start * d, run.len() * d) };
            rms_norm(
                &x[run.start * d..run.end * d],
                weight,
                self.config.rms_eps,
                o,
            );
        });
    }

    /// `x += residual` (when given), then `h = rms_norm(x) * weight`, quantized for the next
    /// product by `rows_q`: in parallel, each row in one pass.
    fn add_norm(
        &self,
        pool: &ThreadPool,
        x: &mut [f32],
        residual: Option<&[f32]>,
        weight: &[f32],
        h: &mut [f32],
        rows_q: &RowQuantizer<'_>,
    ) {
        let (d, eps) = (self.config.n_embd, self.config.rms_eps);
        let n = h.len() / d;
        assert_eq!(x.len(), n * d);
        let (xs, hs) = (SharedMut::new(x), SharedMut::new(h));
        // Tasks of four rows: `rms_norm` advances four rows' sums together.
        pool.run(n.div_ceil(4), &|task| {
            let run = 4 * task..(4 * task + 4).min(n);
            // SAFETY: each run's rows belong to this task alone.
            let (xr, hr) = unsafe {
                (
                    xs.slice(run.start * d, run.len() * d),
                    hs.slice(run.start * d, run.len() * d),
                )
            };
            if let Some(r) = residual {
                xr.iter_mut()
                    .zip(&r[run.start * d..run.end * d])
                    .for_each(|(a, b)| *a += b);
            }
            rms_norm(xr, weight, eps, hr);
            for (i, hi) in run.zip(hr.chunks_exact(d)) {
                // SAFETY: row `i` is this task's alone.
                unsafe { rows_q.quantize(&self.kernels, i, hi) };
            }
        });
    }

    /// Checks the batch against the caches (`next` is scratch for the expected positions).
    fn validate(
        &self,
        batch: Batch<'_>,
        caches: &[&mut KvCache],
        next: &mut Vec<usize>,
    ) -> Result<(), Error> {
        let c = &self.config;
        for cache in caches.iter() {
            if cache.range() != self.range {
                return Err(Error::CacheMismatch {
                    cache_start: cache.range().start,
                    cache_end: cache.range().end,
                    start: self.range.start,
                    end: self.range.end,
                });
            }
            if cache.kv_type() != self.kv_type {
                return Err(Error::BadInput {
                    what: format!(
                        "a cache of {} K and V for a model that stores them as {}",
                        cache.kv_type().name(),
                        self.kv_type.name()
                    ),
                });
            }
        }
        match (batch.hidden, self.is_first()) {
            (None, false) => {
                return Err(Error::BadInput {
                    what: format!("range {} needs hidden states, got none", self.range),
                })
            }
            (Some(_), true) => {
                return Err(Error::BadInput {
                    what: format!(
                        "range {} starts at layer 0 and takes tokens, not hidden states",
                        self.range
                    ),
                })
            }
            (Some(h), false) if h.len() != batch.rows.len() * c.n_embd => {
                return Err(Error::BadInput {
                    what: format!(
                        "{} hidden values for {} rows of width {}",
                        h.len(),
                        batch.rows.len(),
                        c.n_embd
                    ),
                })
            }
            _ => {}
        }
        next.clear();
        next.extend(caches.iter().map(|c| c.len()));
        for (row_idx, row) in batch.rows.iter().enumerate() {
            let Some(expected) = next.get_mut(row.seq) else {
                return Err(Error::NoSuchCache {
                    row_idx,
                    seq: row.seq,
                    n_caches: caches.len(),
                });
            };
            if row.pos != *expected {
                return Err(Error::PositionGap {
                    row_idx,
                    seq: row.seq,
                    pos: row.pos,
                    expected: *expected,
                });
            }
            let n_ctx = caches[row.seq].n_ctx();
            if row.pos >= n_ctx {
                return Err(Error::ContextFull {
                    seq: row.seq,
                    pos: row.pos,
                    n_ctx,
                });
            }
            *expected += 1;
            if self.is_first() && row.token as usize >= c.n_vocab {
                return Err(Error::TokenOutOfRange {
                    token: row.token,
                    n_vocab: c.n_vocab,
                });
            }
        }
        Ok(())
    }
}

/// RMS norm of each row, times `weight` (as llama.cpp: the squares summed in f64, in order).
/// Four rows at a time, so four of those sequential sums advance together.
fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    let mut rows = x.chunks_exact(4 * d).zip(out.chunks_exact_mut(4 * d));
    for (xs, outs) in &mut rows {
        let xr: [&[f32]; 4] = std::array::from_fn(|r| &xs[r * d..(r + 1) * d]);
        let mut sums = [0f64; 4];
        for i in 0..d {
            for (sum, row) in sums.iter_mut().zip(&xr) {
                *sum += (row[i] * row[i]) as f64;
            }
        }
        for ((xr, or), sum) in xr.iter().zip(outs.chunks_exact_mut(d)).zip(sums) {
            scale_row(xr, weight, eps, sum, or);
        }
    }
    let done = x.len() / (4 * d) * 4 * d;
    for (xr, or) in x[done..]
        .chunks_exact(d)
        .zip(out[done..].chunks_exact_mut(d))
    {
        let sum: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
        scale_row(xr, weight, eps, sum, or);
    }
}

/// `out = x / sqrt(mean + eps) * weight`, from the row's sum of squares.
fn scale_row(x: &[f32], weight: &[f32], eps: f32, sum: f64, out: &mut [f32]) {
    let mean = (sum / weight.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = (v * scale) * w;
    }
}

/// RMS norm of one row in place, times `weight` (the same arithmetic as [`rms_norm`]).
fn norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / weight.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for (v, &w) in x.iter_mut().zip(weight) {
        *v = (*v * scale) * w;
    }
}

/// cos/sin of every rotated pair for each row's position (angles built by repeated
/// multiplication as in ggml), for one RoPE base and scale.
#[derive(Default)]
struct RopeTable {
    rope_dim: usize,
    cos_sin: Vec<(f32, f32)>,
}

impl RopeTable {
    /// The angles of every row's position, into the table's reused storage.
    fn fill(&mut self, rope_dim: usize, base: f32, freq_scale: f32, rows: &[Row]) {
        let pairs = rope_dim / 2;
        let theta_scale = base.powf(-2.0 / rope_dim as f32);
        self.rope_dim = rope_dim;
        self.cos_sin.clear();
        for row in rows {
            let mut theta = row.pos as f32;
            for _ in 0..pairs {
                let t = freq_scale * theta;
                self.cos_sin.push((t.cos(), t.sin()));
                theta *= theta_scale;
            }
        }
    }

    /// Rotates every head of row `i` (`x` holds that row's heads): adjacent pairs, or a head's
    /// two halves (NeoX).
    fn apply_row(&self, i: usize, x: &mut [f32], head_dim: usize, style: RopeStyle) {
        let pairs = self.rope_dim / 2;
        let cs = &self.cos_sin[i * pairs..(i + 1) * pairs];
        for head in x.chunks_exact_mut(head_dim) {
            for (p, &(cos, sin)) in cs.iter().enumerate() {
                let (a, b) = match style {
                    RopeStyle::Normal => (2 * p, 2 * p + 1),
                    RopeStyle::Neox => (p, p + pairs),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos - x1 * sin;
                head[b] = x0 * sin + x1 * cos;
            }
        }
    }
}
