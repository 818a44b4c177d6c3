//! Attention's inner products over f16 K and V rows read in place from the KV blocks. The
//! scalar functions define the arithmetic (fused multiply-adds, as llama.cpp's f16 dot product
//! and weighted sum use on x86); the F16C versions decode eight values per instruction and are
//! bitwise equal to them (the same fused multiply-adds and reduction tree).

use half::f16;

/// `q . k` with eight interleaved partial sums (lane `l` takes elements `l`, `l + 8`, ...,
/// each with one fused multiply-add), summed as `((s0 + s4) + (s1 + s5)) + ((s2 + s6) +
/// (s3 + s7))`, then the tail.
pub fn dot_f16(q: &[f32], k: &[f16]) -> f32 {
    assert_eq!(q.len(), k.len());
    let chunks = q.len() / 8;
    let mut acc = [0f32; 8];
    for ch in 0..chunks {
        for (l, acc) in acc.iter_mut().enumerate() {
            *acc = q[8 * ch + l].mul_add(k[8 * ch + l].to_f32(), *acc);
        }
    }
    let mut tail = 0f32;
    for i in 8 * chunks..q.len() {
        tail = q[i].mul_add(k[i].to_f32(), tail);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `o += p * v`, element by element, one fused multiply-add each.
pub fn axpy_f16(p: f32, v: &[f16], o: &mut [f32]) {
    assert_eq!(v.len(), o.len());
    for (o, v) in o.iter_mut().zip(v) {
        *o = p.mul_add(v.to_f32(), *o);
    }
}

#[cfg(target_arch = "x86_64")]
pub mod f16c {
    use std::arch::x86_64::*;

    use half::f16;

    /// # Safety
    /// The CPU must have AVX, FMA and F16C.
    #[target_feature(enable = "avx,fma,f16c")]
    pub unsafe fn dot_f16(q: &[f32], k: &[f16]) -> f32 {
        assert_eq!(q.len(), k.len());
        let chunks = q.len() / 8;
        let mut acc = _mm256_setzero_ps();
        for ch in 0..chunks {
            // SAFETY: 8 * ch + 8 <= len for both slices.
            let (qv, kv) = unsafe {
                (
                    _mm256_loadu_ps(q.as_ptr().add(8 * ch)),
                    _mm256_cvtph_ps(_mm_loadu_si128(k.as_ptr().add(8 * ch) as *const __m128i)),
                )
            };
            acc = _mm256_fmadd_ps(qv, kv, acc);
        }
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
        // [s0 + s1, s2 + s3, ..] then (s0 + s1) + (s2 + s3).
        let h = _mm_hadd_ps(s, s);
        let mut sum = _mm_cvtss_f32(_mm_hadd_ps(h, h));
        let mut tail = 0f32;
        for i in 8 * chunks..q.len() {
            tail = q[i].mul_add(k[i].to_f32(), tail);
        }
        sum += tail;
        sum
    }

    /// # Safety
    /// The CPU must have AVX, FMA and F16C.
    #[target_feature(enable = "avx,fma,f16c")]
    pub unsafe fn axpy_f16(p: f32, v: &[f16], o: &mut [f32]) {
        assert_eq!(v.len(), o.len());
        let chunks = v.len() / 8;
        let pv = _mm256_set1_ps(p);
        for ch in 0..chunks {
            // SAFETY: 8 * ch + 8 <= len for both slices.
            unsafe {
                let vv = _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(8 * ch) as *const __m128i));
                let at = o.as_mut_ptr().add(8 * ch);
                _mm256_storeu_ps(at, _mm256_fmadd_ps(pv, vv, _mm256_loadu_ps(at)));
            }
        }
        for i in 8 * chunks..v.len() {
            o[i] = p.mul_add(v[i].to_f32(), o[i]);
        }
    }
}

/// Head widths the fused attention kernel takes (SmolLM2 and Qwen2.5-0.5B: 64; Qwen2.5-1.5B:
/// 128; Gemma 3: 256).
#[cfg(target_arch = "x86_64")]
pub const FUSED_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Most query heads per KV head the fused attention kernel takes in one call.
#[cfg(target_arch = "x86_64")]
pub const FUSED_MAX_GROUP: usize = 8;

#[cfg(target_arch = "x86_64")]
pub mod fused {
    //! One attention task — `G` query heads of width `8 * CH` sharing one KV head — in one
    //! function, with exactly the arithmetic of [`super::dot_f16`], the softmax of the generic
    //! path and [`super::axpy_f16`]: each K and V row is decoded once for all `G` heads, and
    //! nothing is called per position and head. With width 64 and few heads the `G` output
    //! rows stay in registers across every position (32 vector registers with AVX-512VL);
    //! wider heads keep them in the task's stack frame, in L1.

    use std::arch::x86_64::*;

    use half::f16;

    use super::tiled::reduce8;

    /// Converts a row of `8 * CH` f16 values to `CH` registers of f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    unsafe fn load_row<const CH: usize>(r: &[f16]) -> [__m256; CH] {
        assert!(r.len() >= 8 * CH);
        let mut out = [_mm256_setzero_ps(); CH];
        for (ch, o) in out.iter_mut().enumerate() {
            // SAFETY: `8 * CH` values asserted above.
            *o = _mm256_cvtph_ps(unsafe {
                _mm_loadu_si128(r.as_ptr().add(8 * ch) as *const __m128i)
            });
        }
        out
    }

    /// Hints the cache lines of a row of `8 * CH` f16 values.
    #[inline]
    fn prefetch_row<const CH: usize>(r: &[f16]) {
        let p = r.as_ptr() as *const i8;
        for line in 0..(16 * CH).div_ceil(64) {
            // SAFETY: prefetching is a hint; every address is within or at the end of the row.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64 * line)) };
        }
    }

    /// `q` holds the `G` query rows, already rounded to f16 (as the generic path rounds them,
    /// [`crate::KvType::round`]); `k(t)` and `v(t)` are this KV head's f16 rows at position
    /// `t`; `scores` is scratch of `G * n_pos`; `out` receives the `G` attention outputs.
    /// (`q8_0` rows go through [`super::tiled`], which decodes each once into a tile: decoding
    /// them per position here made this kernel 2.4 times slower than that one.)
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA, F16C and AVX-512 F/VL.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    pub unsafe fn heads<'a, const G: usize, const CH: usize>(
        q: &[f32],
        n_pos: usize,
        scale: f32,
        k: impl Fn(usize) -> &'a [f16],
        v: impl Fn(usize) -> &'a [f16],
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let hd = 8 * CH;
        assert!(q.len() >= G * hd && out.len() >= G * hd && scores.len() >= G * n_pos);
        let mut qv = [[_mm256_setzero_ps(); CH]; G];
        for (h, qh) in qv.iter_mut().enumerate() {
            for (ch, x) in qh.iter_mut().enumerate() {
                // SAFETY: lengths asserted above.
                *x = unsafe { _mm256_loadu_ps(q.as_ptr().add(h * hd + 8 * ch)) };
            }
        }
        // K and V rows of one session are scattered over its blocks (and a step's sessions do
        // not fit in cache together): ask for the rows a few positions ahead.
        const AHEAD: usize = 4;
        // Eight positions at a time: their K rows decoded once into `kf` (zeros past the last
        // position), each head's eight partial-sum vectors then reduced together (`reduce8`,
        // the reduction of `dot_f16`), and the scores of the real positions stored.
        let mut kf = [[_mm256_setzero_ps(); CH]; 8];
        for t0 in (0..n_pos).step_by(8) {
            let n = (n_pos - t0).min(8);
            if n < 8 {
                kf = [[_mm256_setzero_ps(); CH]; 8];
            }
            for (p, kp) in kf.iter_mut().enumerate().take(n) {
                if t0 + p + 2 * AHEAD < n_pos {
                    prefetch_row::<CH>(k(t0 + p + 2 * AHEAD));
                }
                *kp = unsafe { load_row::<CH>(k(t0 + p)) };
            }
            for h in 0..G {
                let mut acc = [_mm256_setzero_ps(); 8];
                for (a, kp) in acc.iter_mut().zip(&kf) {
                    for ch in 0..CH {
                        *a = _mm256_fmadd_ps(qv[h][ch], kp[ch], *a);
                    }
                }
                // Then `dot_f16`'s (empty) tail, and the scale.
                let sums = _mm256_add_ps(reduce8(acc), _mm256_setzero_ps());
                // SAFETY: `h * n_pos + t0 + n <= G * n_pos`, asserted above; the mask keeps to
                // the `n` real positions.
                unsafe {
                    _mm256_mask_storeu_ps(
                        scores.as_mut_ptr().add(h * n_pos + t0),
                        ((1u32 << n) - 1) as __mmask8,
                        _mm256_mul_ps(sums, _mm256_set1_ps(scale)),
                    )
                };
            }
        }
        // SAFETY: this function's features include the softmax's.
        let invs =
            unsafe { crate::kernels::exp::avx512::softmax_numerators_rows::<G>(scores, n_pos) };
        for (h, inv) in invs.into_iter().enumerate() {
            let s = &mut scores[h * n_pos..(h + 1) * n_pos];
            // p = f16(score * inv), as the generic path rounds it before the weighted sum.
            let mut chunks = s.chunks_exact_mut(8);
            for c in &mut chunks {
                // SAFETY: 8 floats.
                unsafe {
                    let x = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), _mm256_set1_ps(inv));
                    let r = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
                    _mm256_storeu_ps(c.as_mut_ptr(), r);
                }
            }
            for x in chunks.into_remainder() {
                *x = f16::from_f32(*x * inv).to_f32();
            }
        }
        let mut o = [[_mm256_setzero_ps(); CH]; G];
        for t in 0..n_pos {
            if t + AHEAD < n_pos {
                prefetch_row::<CH>(v(t + AHEAD));
            }
            let vr = unsafe { load_row::<CH>(v(t)) };
            for h in 0..G {
                let p = _mm256_set1_ps(scores[h * n_pos + t]);
                for ch in 0..CH {
                    o[h][ch] = _mm256_fmadd_ps(p, vr[ch], o[h][ch]);
                }
            }
        }
        for h in 0..G {
            for ch in 0..CH {
                // SAFETY: length asserted above.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(h * hd + 8 * ch), o[h][ch]) };
            }
        }
    }
}

/// Positions the tiled kernel ([`tiled`]) decodes at once for heads of width `hd`: about 16 KiB
/// of f32, a multiple of eight.
pub fn tile_positions(hd: usize) -> usize {
    (4096 / hd.max(1) / 8 * 8).max(8)
}

/// The f32 scratch the tiled kernel needs besides the scores: a tile, and eight rows of zeros
/// after it (a row's group of eight positions may start anywhere in a tile).
pub fn tile_floats(hd: usize) -> usize {
    (tile_positions(hd) + 8) * hd
}

/// Most query rows (of one session, at consecutive positions) the tiled kernel takes in one
/// call.
pub const MAX_BLOCK_ROWS: usize = 8;

#[cfg(target_arch = "x86_64")]
pub mod tiled {
    //! One attention task — `g` query heads sharing one KV head — for AVX2's 16 vector
    //! registers, with exactly the arithmetic of the generic path ([`super::dot_f16`], the
    //! softmax, the rounded weights, [`super::axpy_f16`]). K and V are decoded to f32 a tile of
    //! positions at a time into L1 scratch, once for every head; each head's dot products run
    //! eight positions at once (eight independent fused multiply-add chains, reduced together as
    //! `dot_f16` reduces one), and its weighted sum keeps up to 64 output values in registers
    //! across a whole tile. Nothing is called per position and head.

    use std::arch::x86_64::*;

    use half::f16;

    use crate::kernels::exp;

    /// Most query heads per KV head this kernel takes.
    pub const MAX_GROUP: usize = exp::avx2::MAX_ROWS;

    use super::{tile_positions, MAX_BLOCK_ROWS};

    /// Decodes `n` rows of `hd` values (`row(p)`: f16, or `q8_0` where `q8`) into `tile` (row
    /// `p` at `p * hd`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn decode<'a>(
        hd: usize,
        n: usize,
        q8: bool,
        row: impl Fn(usize) -> &'a [f16],
        tile: &mut [f32],
    ) {
        for p in 0..n {
            let r = row(p);
            let dst = &mut tile[p * hd..(p + 1) * hd];
            if q8 {
                assert_eq!(r.len(), crate::kernels::attn_q8::row_units(hd));
                // SAFETY: the row holds `hd` values (asserted), a multiple of 32 (the rows'
                // format), and `dst` takes them.
                unsafe { crate::kernels::attn_q8::avx2::decode(r, hd / 8, dst) };
                continue;
            }
            let r = &r[..hd];
            for ch in 0..hd / 8 {
                // SAFETY: `8 * ch + 8 <= hd` for both rows.
                unsafe {
                    let x = _mm_loadu_si128(r.as_ptr().add(8 * ch).cast());
                    _mm256_storeu_ps(dst.as_mut_ptr().add(8 * ch), _mm256_cvtph_ps(x));
                }
            }
        }
    }

    /// The sums of eight vectors of eight partial sums (one vector per position), each as
    /// [`super::dot_f16`] reduces it: `((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7))`.
    /// Lane `p` of the result is vector `p`'s sum.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn reduce8(a: [__m256; 8]) -> __m256 {
        // b[p] = [a[p] lanes 0-3 + 4-7 | a[p + 4] lanes 0-3 + 4-7], for p < 4.
        let b: [__m256; 4] = std::array::from_fn(|p| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(a[p], a[p + 4]),
                _mm256_permute2f128_ps::<0x31>(a[p], a[p + 4]),
            )
        });
        // Pairwise sums within each 128-bit half (positions 0, 1 | 4, 5 and 2, 3 | 6, 7),
        // then the final sums, in position order.
        let c = _mm256_hadd_ps(b[0], b[1]);
        let d = _mm256_hadd_ps(b[2], b[3]);
        _mm256_hadd_ps(c, d)
    }

    /// `o[..8 * M] += Σ_p w[p] * tile[p * hd + col..][..8 * M]`, one fused multiply-add per
    /// value and position, in position order, the `M` registers of `o` held across the tile.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn weighted_sum<const M: usize>(w: &[f32], tile: &[f32], hd: usize, col: usize, o: &mut [f32]) {
        assert!(o.len() >= 8 * M && col + 8 * M <= hd && tile.len() >= w.len() * hd);
        // SAFETY: the bounds asserted above.
        unsafe {
            let mut acc: [__m256; M] =
                std::array::from_fn(|ch| _mm256_loadu_ps(o.as_ptr().add(8 * ch)));
            for (p, &wp) in w.iter().enumerate() {
                let wv = _mm256_set1_ps(wp);
                let row = tile.as_ptr().add(p * hd + col);
                for (ch, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(row.add(8 * ch)), *a);
                }
            }
            for (ch, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.as_mut_ptr().add(8 * ch), *a);
            }
        }
    }

    /// Attention of `ranges.len()` query rows, each with the `g` query heads sharing one KV
    /// head, over one session's K and V: row `r` attends to the absolute positions
    /// `ranges[r].0..ranges[r].0 + ranges[r].1`. Every row's arithmetic is exactly the generic
    /// path's for that row alone ([`super::dot_f16`], the softmax, the rounded weights,
    /// [`super::axpy_f16`] in position order), whatever rows share the call: tiles are decoded
    /// once for all of them (a prefill step's consecutive rows share all but their last
    /// positions), and a row takes from each tile the positions of its own range.
    ///
    /// `q` holds row `r`'s `g` heads at `r * g * hd` (already rounded to the cache's type, as the
    /// generic path rounds them); `k(t)` and `v(t)` are this KV head's rows at absolute
    /// position `t`; `scores` is scratch of `g * Σ n_pos`, `tile` of [`super::tile_floats`];
    /// `out` receives row `r`'s `g` outputs at `r * g * hd`. Returns false, doing nothing, for a
    /// shape it does not take (a width not a multiple of eight, more than [`MAX_GROUP`] heads).
    ///
    /// `avx512`: the CPU has AVX-512 F/VL, and the softmax takes its AVX-512 kernel (bitwise
    /// the same, 6-8% faster over this kernel's work at 4096 positions).
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C, and AVX-512 F/VL where `avx512`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn block<'a>(
        avx512: bool,
        hd: usize,
        q: &[f32],
        ranges: &[(usize, usize)],
        scale: f32,
        q8: bool,
        k: impl Fn(usize) -> &'a [f16],
        v: impl Fn(usize) -> &'a [f16],
        scores: &mut [f32],
        tile: &mut [f32],
        out: &mut [f32],
    ) -> bool {
        // The models' widths compiled with the width a constant (row offsets in the
        // instructions); the same arithmetic for every width.
        match hd {
            64 => block_of::<64>(avx512, hd, q, ranges, scale, q8, k, v, scores, tile, out),
            128 => block_of::<128>(avx512, hd, q, ranges, scale, q8, k, v, scores, tile, out),
            256 => block_of::<256>(avx512, hd, q, ranges, scale, q8, k, v, scores, tile, out),
            _ => block_of::<0>(avx512, hd, q, ranges, scale, q8, k, v, scores, tile, out),
        }
    }

    /// [`block`] for head width `HD` (0: any width, `hd`).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn block_of<'a, const HD: usize>(
        avx512: bool,
        hd: usize,
        q: &[f32],
        ranges: &[(usize, usize)],
        scale: f32,
        q8: bool,
        k: impl Fn(usize) -> &'a [f16],
        v: impl Fn(usize) -> &'a [f16],
        scores: &mut [f32],
        tile: &mut [f32],
        out: &mut [f32],
    ) -> bool {
        let hd = if HD == 0 { hd } else { HD };
        let n_rows = ranges.len();
        if hd == 0 || !hd.is_multiple_of(8) || n_rows == 0 || !q.len().is_multiple_of(hd * n_rows) {
            return false;
        }
        let g = q.len() / hd / n_rows;
        // (`q8_0` rows hold whole blocks of 32 values.)
        let q8_width = !q8 || hd.is_multiple_of(crate::kernels::attn_q8::BLOCK);
        if g == 0 || g > MAX_GROUP || !q8_width {
            return false;
        }
        let tp = tile_positions(hd);
        let total: usize = ranges.iter().map(|&(_, n)| n).sum();
        assert!(
            out.len() >= n_rows * g * hd
                && scores.len() >= g * total
                && tile.len() >= super::tile_floats(hd)
        );
        // Where each row's scores start, and the positions the rows cover together.
        assert!(
            n_rows <= MAX_BLOCK_ROWS,
            "at most {MAX_BLOCK_ROWS} rows a call"
        );
        let mut starts = [0usize; MAX_BLOCK_ROWS];
        for r in 1..n_rows {
            starts[r] = starts[r - 1] + g * ranges[r - 1].1;
        }
        let lo = ranges.iter().map(|&(f, _)| f).min().unwrap_or(0);
        let hi = ranges.iter().map(|&(f, n)| f + n).max().unwrap_or(0);
        // The positions `a..b` of row `r` within the tile `t0..t0 + n`.
        let part = |r: usize, t0: usize, n: usize| {
            let (f, len) = ranges[r];
            (f.max(t0), (f + len).min(t0 + n))
        };
        // Scores: a tile of K rows decoded (zeros after its last position, so that a group of
        // eight that starts anywhere in the tile reads only decoded or zero rows), then per row
        // and head eight of the row's positions at a time, only the real ones stored.
        for t0 in (lo..hi).step_by(tp) {
            let n = (hi - t0).min(tp);
            decode(hd, n, q8, |p| k(t0 + p), tile);
            tile[n * hd..(tp + 8) * hd].fill(0.0);
            for r in 0..n_rows {
                let (a, b) = part(r, t0, n);
                if a >= b {
                    continue;
                }
                let (f, len) = ranges[r];
                for h in 0..g {
                    let qh = &q[(r * g + h) * hd..][..hd];
                    let s = &mut scores[starts[r] + h * len..][..len];
                    for p0 in (a..b).step_by(8) {
                        let at = (p0 - t0) * hd;
                        let lanes = dot8(qh, &tile[at..at + 8 * hd], scale);
                        let m = (b - p0).min(8);
                        s[p0 - f..][..m].copy_from_slice(&lanes[..m]);
                    }
                }
            }
        }
        let mut inv = [0f32; MAX_GROUP];
        for (r, &(_, len)) in ranges.iter().enumerate() {
            let s = &mut scores[starts[r]..][..g * len];
            softmax_rows(avx512, s, g, len, &mut inv);
            for (h, &inv) in inv[..g].iter().enumerate() {
                round_weights(&mut s[h * len..(h + 1) * len], inv);
            }
        }
        // The weighted sums: a tile of V rows decoded, then per row, head and group of up to
        // 64 output values, the row's positions of the tile, in position order.
        out[..n_rows * g * hd].fill(0.0);
        for t0 in (lo..hi).step_by(tp) {
            let n = (hi - t0).min(tp);
            decode(hd, n, q8, |p| v(t0 + p), tile);
            for r in 0..n_rows {
                let (a, b) = part(r, t0, n);
                if a >= b {
                    continue;
                }
                let (f, len) = ranges[r];
                let rows = &tile[(a - t0) * hd..(b - t0) * hd];
                for h in 0..g {
                    let w = &scores[starts[r] + h * len + (a - f)..][..b - a];
                    let o = &mut out[(r * g + h) * hd..][..hd];
                    for col in (0..hd).step_by(64) {
                        let o = &mut o[col..];
                        match (hd - col).min(64) / 8 {
                            8 => weighted_sum::<8>(w, rows, hd, col, o),
                            7 => weighted_sum::<7>(w, rows, hd, col, o),
                            6 => weighted_sum::<6>(w, rows, hd, col, o),
                            5 => weighted_sum::<5>(w, rows, hd, col, o),
                            4 => weighted_sum::<4>(w, rows, hd, col, o),
                            3 => weighted_sum::<3>(w, rows, hd, col, o),
                            2 => weighted_sum::<2>(w, rows, hd, col, o),
                            _ => weighted_sum::<1>(w, rows, hd, col, o),
                        }
                    }
                }
            }
        }
        true
    }

    /// [`exp::avx2::softmax_numerators_rows`] of `g` rows (at most [`MAX_GROUP`]), or where
    /// `avx512` its AVX-512 twin, bitwise the same.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn softmax_rows(avx512: bool, s: &mut [f32], g: usize, n: usize, inv: &mut [f32]) {
        assert!((1..=MAX_GROUP).contains(&g) && inv.len() >= g);
        if !avx512 {
            // SAFETY: this function's features include the softmax's; `g <= MAX_GROUP`.
            unsafe { exp::avx2::softmax_numerators_rows(s, g, n, inv) };
            return;
        }
        macro_rules! rows {
            ($g:literal) => {{
                // SAFETY: the caller of `block` promises AVX-512 F/VL where `avx512`.
                let v = unsafe { exp::avx512::softmax_numerators_rows::<$g>(s, n) };
                inv[..$g].copy_from_slice(&v);
            }};
        }
        match g {
            1 => rows!(1),
            2 => rows!(2),
            3 => rows!(3),
            4 => rows!(4),
            5 => rows!(5),
            6 => rows!(6),
            7 => rows!(7),
            _ => rows!(8),
        }
    }

    /// The scaled dot products of `q` with the eight rows of `rows` (`8 * hd` values), each as
    /// [`super::dot_f16`] computes one: eight independent fused multiply-add chains, reduced
    /// together by [`reduce8`], then `dot_f16`'s (empty) tail and the scale.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot8(q: &[f32], rows: &[f32], scale: f32) -> [f32; 8] {
        let hd = q.len();
        assert!(rows.len() >= 8 * hd && hd.is_multiple_of(8));
        let mut acc = [_mm256_setzero_ps(); 8];
        for ch in 0..hd / 8 {
            // SAFETY: `8 * ch + 8 <= hd`; rows `0..8` are within `rows`, asserted above.
            unsafe {
                let qv = _mm256_loadu_ps(q.as_ptr().add(8 * ch));
                let base = rows.as_ptr().add(8 * ch);
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(base.add(j * hd)), *a);
                }
            }
        }
        let sums = _mm256_add_ps(reduce8(acc), _mm256_setzero_ps());
        let mut lanes = [0f32; 8];
        // SAFETY: eight floats.
        unsafe {
            _mm256_storeu_ps(
                lanes.as_mut_ptr(),
                _mm256_mul_ps(sums, _mm256_set1_ps(scale)),
            )
        };
        lanes
    }

    /// `w = f16(w * inv)`: the softmax's weights rounded as the generic path rounds them
    /// before the weighted sum.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn round_weights(s: &mut [f32], inv: f32) {
        let mut chunks = s.chunks_exact_mut(8);
        for c in &mut chunks {
            // SAFETY: 8 floats.
            unsafe {
                let x = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), _mm256_set1_ps(inv));
                let r = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
                _mm256_storeu_ps(c.as_mut_ptr(), r);
            }
        }
        for x in chunks.into_remainder() {
            *x = f16::from_f32(*x * inv).to_f32();
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    use crate::kernels::attn_q8::{axpy_q8_0, dot_q8_0};
    use crate::KvType;

    /// The generic path's attention of `g` heads over rows stored as `ty`: Q rounded to `ty`,
    /// dot, softmax, rounded weights, axpy.
    fn generic(
        ty: KvType,
        q: &[f32],
        ks: &[Vec<f16>],
        vs: &[Vec<f16>],
        scale: f32,
        g: usize,
    ) -> Vec<f32> {
        let n_pos = ks.len();
        let hd = q.len() / g;
        let mut rounded = vec![0f32; q.len()];
        ty.round(q, &mut rounded);
        let q = rounded;
        type Dot = fn(&[f32], &[f16]) -> f32;
        type Axpy = fn(f32, &[f16], &mut [f32]);
        let (dot, axpy): (Dot, Axpy) = match ty {
            KvType::F16 => (dot_f16, axpy_f16),
            KvType::Q8_0 => (dot_q8_0, axpy_q8_0),
        };
        let mut scores = vec![0f32; g * n_pos];
        for t in 0..n_pos {
            for h in 0..g {
                scores[h * n_pos + t] = dot(&q[h * hd..(h + 1) * hd], &ks[t]) * scale;
            }
        }
        let mut out = vec![0f32; g * hd];
        let inv: Vec<f32> = scores
            .chunks_exact_mut(n_pos)
            .map(crate::kernels::exp::softmax_numerators)
            .collect();
        for t in 0..n_pos {
            for h in 0..g {
                let p = f16::from_f32(scores[h * n_pos + t] * inv[h]).to_f32();
                axpy(p, &vs[t], &mut out[h * hd..(h + 1) * hd]);
            }
        }
        out
    }

    /// A row of `hd` values drawn from `next`, stored as `ty`.
    fn stored(ty: KvType, hd: usize, next: &mut dyn FnMut() -> f32) -> Vec<f16> {
        let x: Vec<f32> = (0..hd).map(|_| next()).collect();
        let mut row = vec![f16::ZERO; ty.row_units(hd)];
        ty.store(&x, &mut row);
        row
    }

    /// The AVX-512 kernel (its head widths and groups) and the AVX2 one (any width that is a
    /// multiple of eight, tiles of positions crossed) against the generic path.
    #[test]
    fn fused_attention_equals_the_generic_path_bitwise() {
        use crate::kernels::{Isa, Kernels};
        for isa in [Isa::Avx2, Isa::Avx512Vnni] {
            if !isa.testable("fused_attention_equals_the_generic_path_bitwise") {
                continue;
            }
            let kernels = Kernels::new(isa).unwrap();
            let widths: &[usize] = match isa {
                // AVX-512: its fused kernel's widths, and others through the tiled kernel.
                Isa::Avx2 => &[8, 32, 64, 80, 96, 128, 256],
                _ => &[32, 64, 80, 96, 128, 256],
            };
            let mut uniform = crate::kernels::tests::uniform(0x1234_5679);
            let mut next = || uniform(6.0);
            for (ty, &hd) in [KvType::F16, KvType::Q8_0]
                .into_iter()
                .flat_map(|ty| widths.iter().map(move |hd| (ty, hd)))
                .filter(|&(ty, &hd)| ty.supports(hd))
            {
                for g in 1..=FUSED_MAX_GROUP {
                    for n_pos in [1, 7, 8, 17, 100, 131] {
                        let q: Vec<f32> = (0..g * hd)
                            .map(|_| f16::from_f32(next()).to_f32())
                            .collect();
                        let ks: Vec<Vec<f16>> =
                            (0..n_pos).map(|_| stored(ty, hd, &mut next)).collect();
                        let vs: Vec<Vec<f16>> =
                            (0..n_pos).map(|_| stored(ty, hd, &mut next)).collect();
                        let want = generic(ty, &q, &ks, &vs, 0.125, g);
                        let mut q = q;
                        ty.round(&q.clone(), &mut q);
                        let mut scores = vec![0f32; g * n_pos];
                        let mut tile = vec![0f32; tile_floats(hd)];
                        let mut got = vec![0f32; g * hd];
                        assert!(kernels.fused_attention(
                            hd,
                            &q,
                            n_pos,
                            0.125,
                            ty == KvType::Q8_0,
                            |t| &ks[t][..],
                            |t| &vs[t][..],
                            &mut scores,
                            &mut tile,
                            &mut got
                        ));
                        assert_eq!(
                            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            "{} {}: hd = {hd}, g = {g}, n_pos = {n_pos}",
                            isa.name(),
                            ty.name()
                        );
                    }
                }
            }
        }
    }

    /// The block kernel, as each isa dispatches it: every row of a block (consecutive
    /// positions of one session, the whole context or a sliding window, tiles crossed, groups
    /// of eight starting anywhere in a tile) equals the generic path for that row alone,
    /// bitwise.
    #[test]
    fn an_attention_block_gives_each_row_the_generic_paths_result_bitwise() {
        use crate::kernels::{Isa, Kernels};
        for isa in [Isa::Avx2, Isa::Avx512Vnni] {
            if isa.testable("an_attention_block_gives_each_row_the_generic_paths_result_bitwise") {
                block_rows_equal_the_generic_path(&Kernels::new(isa).unwrap());
            }
        }
    }

    fn block_rows_equal_the_generic_path(kernels: &crate::kernels::Kernels) {
        let mut uniform = crate::kernels::tests::uniform(0x2545_f491);
        let mut next = || uniform(6.0);
        for (ty, hd) in [
            (KvType::F16, 8),
            (KvType::F16, 64),
            (KvType::F16, 128),
            (KvType::Q8_0, 32),
            (KvType::Q8_0, 64),
            (KvType::Q8_0, 96),
            (KvType::Q8_0, 128),
        ] {
            for g in [1, 3, 6] {
                for (n_ctx, window) in [
                    (1, None),
                    (9, None),
                    (70, None),
                    (131, None),
                    (131, Some(21)),
                    (200, Some(61)),
                ] {
                    for n_rows in 1..=MAX_BLOCK_ROWS {
                        let n_ctx = n_ctx.max(n_rows);
                        let ks: Vec<Vec<f16>> =
                            (0..n_ctx).map(|_| stored(ty, hd, &mut next)).collect();
                        let vs: Vec<Vec<f16>> =
                            (0..n_ctx).map(|_| stored(ty, hd, &mut next)).collect();
                        // The last `n_rows` positions of the context, each over its own range.
                        let ranges: Vec<(usize, usize)> = (n_ctx - n_rows..n_ctx)
                            .map(|pos| {
                                let from = window.map_or(0, |w: usize| (pos + 1).saturating_sub(w));
                                (from, pos + 1 - from)
                            })
                            .collect();
                        let raw: Vec<f32> = (0..n_rows * g * hd).map(|_| next()).collect();
                        let mut q = vec![0f32; raw.len()];
                        ty.round(&raw, &mut q);
                        let total: usize = ranges.iter().map(|r| r.1).sum();
                        let mut scores = vec![0f32; g * total];
                        let mut tile = vec![0f32; tile_floats(hd)];
                        let mut got = vec![0f32; n_rows * g * hd];
                        assert!(kernels.attention_block(
                            hd,
                            &q,
                            &ranges,
                            0.125,
                            ty == KvType::Q8_0,
                            |t| &ks[t][..],
                            |t| &vs[t][..],
                            &mut scores,
                            &mut tile,
                            &mut got
                        ));
                        for (r, &(from, n)) in ranges.iter().enumerate() {
                            let width = g * hd;
                            let want = generic(
                                ty,
                                &raw[r * width..(r + 1) * width],
                                &ks[from..from + n],
                                &vs[from..from + n],
                                0.125,
                                g,
                            );
                            assert_eq!(
                                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                                got[r * width..(r + 1) * width].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                                "{}: hd = {hd}, g = {g}, n_ctx = {n_ctx}, window = {window:?}, row {r} of {n_rows}",
                                ty.name()
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn f16c_versions_equal_the_scalar_ones_bitwise() {
        if !crate::kernels::Isa::Avx2.testable("f16c_versions_equal_the_scalar_ones_bitwise") {
            return;
        }
        let mut uniform = crate::kernels::tests::uniform(0x9e37_79b9);
        let mut next = || uniform(8.0);
        for n in [1, 7, 8, 15, 64, 67, 128] {
            let q: Vec<f32> = (0..n).map(|_| next()).collect();
            let k: Vec<f16> = (0..n).map(|_| f16::from_f32(next())).collect();
            // SAFETY: features checked above.
            let fast = unsafe { f16c::dot_f16(&q, &k) };
            assert_eq!(fast.to_bits(), dot_f16(&q, &k).to_bits(), "dot, n = {n}");
            let p = next();
            let mut a: Vec<f32> = (0..n).map(|_| next()).collect();
            let mut b = a.clone();
            axpy_f16(p, &k, &mut a);
            // SAFETY: as above.
            unsafe { f16c::axpy_f16(p, &k, &mut b) };
            assert_eq!(
                a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "axpy, n = {n}"
            );
        }
    }
}
