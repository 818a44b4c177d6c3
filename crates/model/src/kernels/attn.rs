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

    /// Converts `8 * CH` f16 values to `CH` registers of f32.
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
        for line in 0..CH.div_ceil(4) {
            // SAFETY: prefetching is a hint; every address is within or at the end of the row.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64 * line)) };
        }
    }

    /// The sums of eight vectors of eight partial sums (one vector per position), each as
    /// [`super::dot_f16`] reduces it: `((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7))`.
    /// Lane `p` of the result is vector `p`'s sum.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    fn reduce8(a: [__m256; 8]) -> __m256 {
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

    /// `q` holds the `G` query rows (rounded to f16 values here); `k(t)` and `v(t)` are this
    /// KV head's rows at position `t`; `scores` is scratch of `G * n_pos`; `out` receives the
    /// `G` attention outputs.
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
        // Q rounded to f16 values, as llama.cpp multiplies it by an f16 K (round to nearest
        // even, as `f16::from_f32`). SAFETY: lengths asserted above.
        let mut qv = [[_mm256_setzero_ps(); CH]; G];
        for (h, qh) in qv.iter_mut().enumerate() {
            for (ch, x) in qh.iter_mut().enumerate() {
                // SAFETY: lengths asserted above.
                let v = unsafe { _mm256_loadu_ps(q.as_ptr().add(h * hd + 8 * ch)) };
                *x = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The generic path's attention of `g` heads: Q rounded to f16, dot, softmax, rounded
    /// weights, axpy.
    fn generic(q: &[f32], ks: &[Vec<f16>], vs: &[Vec<f16>], scale: f32, g: usize) -> Vec<f32> {
        let n_pos = ks.len();
        let hd = q.len() / g;
        let q: Vec<f32> = q.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
        let mut scores = vec![0f32; g * n_pos];
        for t in 0..n_pos {
            for h in 0..g {
                scores[h * n_pos + t] = dot_f16(&q[h * hd..(h + 1) * hd], &ks[t]) * scale;
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
                axpy_f16(p, &vs[t], &mut out[h * hd..(h + 1) * hd]);
            }
        }
        out
    }

    #[test]
    fn fused_attention_equals_the_generic_path_bitwise() {
        if !crate::kernels::Isa::Avx512Vnni
            .testable("fused_attention_equals_the_generic_path_bitwise")
        {
            return;
        }
        let mut uniform = crate::kernels::tests::uniform(0x1234_5679);
        let mut next = || uniform(6.0);
        for hd in FUSED_HEAD_DIMS {
            for g in 1..=FUSED_MAX_GROUP {
                for n_pos in [1, 7, 8, 17, 100] {
                    let q: Vec<f32> = (0..g * hd).map(|_| next()).collect();
                    let row = |next: &mut dyn FnMut() -> f32| -> Vec<f16> {
                        (0..hd).map(|_| f16::from_f32(next())).collect()
                    };
                    let ks: Vec<Vec<f16>> = (0..n_pos).map(|_| row(&mut next)).collect();
                    let vs: Vec<Vec<f16>> = (0..n_pos).map(|_| row(&mut next)).collect();
                    let want = generic(&q, &ks, &vs, 0.125, g);
                    let mut scores = vec![0f32; g * n_pos];
                    let mut got = vec![0f32; g * hd];
                    let k = crate::kernels::Kernels::detect();
                    assert!(k.fused_attention(
                        hd,
                        &q,
                        n_pos,
                        0.125,
                        |t| &ks[t][..],
                        |t| &vs[t][..],
                        &mut scores,
                        &mut got
                    ));
                    assert_eq!(
                        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "hd = {hd}, g = {g}, n_pos = {n_pos}"
                    );
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
