//! Attention over the paged KV cache: each row over its own session's positions, the kernels
//! given every session's K and V rows of a layer a block at a time.

use std::mem::take;

use half::f16;

use super::{Model, Row};
use crate::kernels::exp;
use crate::kv::{KvCache, KvType, BLOCK_POSITIONS};
use crate::pool::{SharedMut, ThreadPool};

impl Model {
    /// Causal attention of every row over its own session's cache: every position before it,
    /// or only the last `window` (itself included) on a sliding-window layer.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        pool: &ThreadPool,
        li: usize,
        window: Option<usize>,
        rows: &[Row],
        caches: &[&mut KvCache],
        q: &[f32],
        out: &mut [f32],
        scratch: &mut AttnScratch,
    ) {
        let c = &self.config;
        let (hd, qd) = (c.head_dim, c.q_dim());
        let group = c.n_head / c.n_head_kv;
        let scale = c.attn_scale;
        let ty = self.kv_type;
        let q8 = ty == KvType::Q8_0;
        let out_ptr = SharedMut::new(out);
        // A task takes every query head sharing one KV head, so each K and V row is decoded once
        // for all of them; with few rows, one task per query head keeps every thread busy. The
        // arithmetic of each head is the same either way.
        let per_task = if rows.len() * c.n_head_kv >= 4 * pool.n_threads() {
            group
        } else {
            1
        };
        let tasks_per_block = c.n_head / per_task;
        // Where the kernels take them, a task takes a block of a session's consecutive rows (a
        // prefill chunk's), which share all but their last positions: K and V are then decoded
        // once for the block. Each row's arithmetic is the same as alone.
        let max_rows = if per_task == group {
            self.kernels.attention_block_rows()
        } else {
            1
        };
        let blocks = &mut scratch.blocks;
        blocks.clear();
        for (i, row) in rows.iter().enumerate() {
            match blocks.last_mut() {
                Some(b)
                    if b.len() < max_rows
                        && rows[b.end - 1].seq == row.seq
                        && rows[b.end - 1].pos + 1 == row.pos =>
                {
                    b.end = i + 1
                }
                _ => blocks.push(i..i + 1),
            }
        }
        let block_rows = blocks.iter().map(|b| b.len()).max().unwrap_or(1);
        // Every thread's scratch fits the longest row, grown here (by the caller, only ever
        // grown, and at once to the longest context in the batch, so a growing context does not
        // reallocate step after step).
        let longest = rows.iter().map(|r| r.pos + 1).max().unwrap_or(0);
        let n_ctx = caches.iter().map(|c| c.n_ctx()).max().unwrap_or(0);
        let tile = crate::kernels::attn::tile_floats(hd);
        let size = |n_pos: usize| per_task * block_rows * (2 * hd + n_pos) + per_task + tile;
        scratch.threads.resize_with(pool.n_threads(), Vec::new);
        for s in scratch.threads.iter_mut() {
            if s.len() < size(longest) {
                s.resize(size(n_ctx.max(longest)), 0.0);
            }
        }
        let (mut kb, mut vb) = (
            recycle(take(&mut scratch.kb)),
            recycle(take(&mut scratch.vb)),
        );
        kv_blocks(
            li,
            window,
            rows,
            caches,
            &mut scratch.spans,
            &mut kb,
            &mut vb,
        );
        let (kbs, vbs): (&[&[f16]], &[&[f16]]) = (&kb, &vb);
        let spans: &[(usize, usize)] = &scratch.spans;
        let blocks = &scratch.blocks;
        let threads = SharedMut::new(&mut scratch.threads);
        pool.run_on(blocks.len() * tasks_per_block, &|task, thread| {
            let (b, first) = (task / tasks_per_block, (task % tasks_per_block) * per_task);
            let block = &rows[blocks[b].clone()];
            let cache: &KvCache = caches[block[0].seq];
            let kvh = first / group;
            // The positions each row attends to: `from..=row.pos`.
            let mut ranges = [(0, 0); crate::kernels::attn::MAX_BLOCK_ROWS];
            for (range, row) in ranges.iter_mut().zip(block) {
                let from = window.map_or(0, |w| (row.pos + 1).saturating_sub(w));
                *range = (from, row.pos + 1 - from);
            }
            let ranges = &ranges[..block.len()];
            let n_pos: usize = ranges.iter().map(|&(_, n)| n).sum();
            let width = per_task * hd;
            // SAFETY: a thread runs one task at a time; only it uses its entry.
            let scratch = unsafe { &mut threads.slice(thread, 1)[0] };
            let need = block.len() * 2 * width + per_task * n_pos + per_task + tile;
            let (qs, rest) = scratch[..need].split_at_mut(block.len() * width);
            let (outs, rest) = rest.split_at_mut(block.len() * width);
            let (scores, rest) = rest.split_at_mut(per_task * n_pos);
            let (inv, tile) = rest.split_at_mut(per_task);
            // llama.cpp multiplies K by Q converted to the cache's type (f16, or `q8_0` for its
            // `q8_0` dot product); do the same for parity.
            for (qs, b) in qs.chunks_exact_mut(width).zip(blocks[b].clone()) {
                ty.round(&q[b * qd + first * hd..][..width], qs);
            }
            let (base, b0) = spans[block[0].seq];
            // A KV head's row: `head` 16-bit units of the position's row of `row` units.
            let (row, head) = (cache.row_units(), ty.row_units(hd));
            let at = |t: usize| (t % BLOCK_POSITIONS) * row + kvh * head;
            let k = |t: usize| &kbs[base + t / BLOCK_POSITIONS - b0][at(t)..][..head];
            let v = |t: usize| &vbs[base + t / BLOCK_POSITIONS - b0][at(t)..][..head];
            if block.len() > 1
                && self
                    .kernels
                    .attention_block(hd, qs, ranges, scale, q8, k, v, scores, tile, outs)
            {
                for (o, i) in outs.chunks_exact(width).zip(blocks[b].clone()) {
                    // SAFETY: each task writes its own heads' head_dim slices of `out`.
                    unsafe { out_ptr.slice(i * qd + first * hd, width) }.copy_from_slice(o);
                }
                return;
            }
            for ((qs, &(from, n_pos)), i) in
                qs.chunks_exact(width).zip(ranges).zip(blocks[b].clone())
            {
                // SAFETY: each task writes its own heads' head_dim slices of `out`.
                let o = unsafe { out_ptr.slice(i * qd + first * hd, width) };
                self.attend_one(
                    hd,
                    qs,
                    from,
                    n_pos,
                    k,
                    v,
                    &mut scores[..per_task * n_pos],
                    inv,
                    tile,
                    o,
                );
            }
        });
        (scratch.kb, scratch.vb) = (recycle(kb), recycle(vb));
    }

    /// One row's attention over positions `from..from + n_pos` (`q`: its heads that share one
    /// KV head, rounded to the cache's type): the fused kernel where one exists, else the
    /// generic path (dot products, softmax, rounded weights, weighted sums) over the rows'
    /// values (f16, or `q8_0`'s scale times byte).
    #[allow(clippy::too_many_arguments)]
    fn attend_one<'a>(
        &self,
        hd: usize,
        q: &[f32],
        from: usize,
        n_pos: usize,
        k: impl Fn(usize) -> &'a [f16],
        v: impl Fn(usize) -> &'a [f16],
        scores: &mut [f32],
        inv: &mut [f32],
        tile: &mut [f32],
        o: &mut [f32],
    ) {
        let scale = self.config.attn_scale;
        let q8 = self.kv_type == KvType::Q8_0;
        if self.kernels.fused_attention(
            hd,
            q,
            n_pos,
            scale,
            q8,
            |t| k(from + t),
            |t| v(from + t),
            scores,
            tile,
            o,
        ) {
            return;
        }
        // K and V are read from the session's blocks in place, one head row at a time.
        for t in 0..n_pos {
            let k = k(from + t);
            for (h, qh) in q.chunks_exact(hd).enumerate() {
                let dot = if q8 {
                    self.kernels.dot_q8_0(qh, k)
                } else {
                    self.kernels.dot_f16(qh, k)
                };
                scores[h * n_pos + t] = dot * scale;
            }
        }
        for (h, s) in scores.chunks_exact_mut(n_pos).enumerate() {
            inv[h] = exp::softmax_numerators(s);
        }
        o.fill(0.0);
        for t in 0..n_pos {
            let v = v(from + t);
            for (h, oh) in o.chunks_exact_mut(hd).enumerate() {
                let p = f16::from_f32(scores[h * n_pos + t] * inv[h]).to_f32();
                if q8 {
                    self.kernels.axpy_q8_0(p, v, oh);
                } else {
                    self.kernels.axpy_f16(p, v, oh);
                }
            }
        }
    }
}

/// Attention's scratch: per pool thread, the step's blocks of rows (each task takes one
/// block's rows for its heads), and where each session's K and V rows of the layer lie, a
/// block of positions at a time (`kb`, `vb`: empty between calls, kept for their capacity).
#[derive(Default)]
pub(super) struct AttnScratch {
    threads: Vec<Vec<f32>>,
    blocks: Vec<std::ops::Range<usize>>,
    /// Per session: where its blocks start in `kb` / `vb`, and its first block ([`kv_blocks`]).
    spans: Vec<(usize, usize)>,
    kb: Vec<&'static [f16]>,
    vb: Vec<&'static [f16]>,
}

/// Each session's K and V rows of local layer `li`, a block of positions at a time
/// ([`KvCache::block_rows`]), looked up once per layer and step: the kernels ask for every
/// position's row (and again to prefetch it), and looking each up through the cache's blocks
/// took 8% of a 4096-token prefill's time. `spans[seq]` receives where session `seq`'s blocks
/// start in `kb` / `vb` and its first block: the first any of its rows attends to (a sliding
/// window's cache drops the ones before).
fn kv_blocks<'c>(
    li: usize,
    window: Option<usize>,
    rows: &[Row],
    caches: &'c [&mut KvCache],
    spans: &mut Vec<(usize, usize)>,
    kb: &mut Vec<&'c [f16]>,
    vb: &mut Vec<&'c [f16]>,
) {
    // Per session: the first block and the end block its rows attend to (none: an empty range).
    spans.clear();
    spans.resize(caches.len(), (usize::MAX, 0));
    for row in rows {
        let from = window.map_or(0, |w| (row.pos + 1).saturating_sub(w));
        let s = &mut spans[row.seq];
        s.0 = s.0.min(from / BLOCK_POSITIONS);
        s.1 = s.1.max((row.pos + 1).div_ceil(BLOCK_POSITIONS));
    }
    for (cache, span) in caches.iter().zip(spans.iter_mut()) {
        let (b0, b1) = *span;
        *span = (kb.len(), b0);
        for b in b0..b1 {
            kb.push(cache.block_rows(li, 0, b));
            vb.push(cache.block_rows(li, 1, b));
        }
    }
}

/// `v` emptied, as a vector of slices of another lifetime in the same allocation: the standard
/// library collects a vector's own iterator in place when the element layouts agree (and an
/// empty one maps nothing), so [`AttnScratch`] keeps the capacity of vectors that hold one
/// call's borrows without allocating each call (`tests/no_alloc.rs` checks it).
fn recycle<'a>(mut v: Vec<&[f16]>) -> Vec<&'a [f16]> {
    v.clear();
    v.into_iter()
        .map(|_| -> &'a [f16] { unreachable!("emptied") })
        .collect()
}
