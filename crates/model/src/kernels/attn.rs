//! Attention's inner products over f16 K and V rows read in place from the KV blocks. The
//! scalar functions define the arithmetic; the F16C versions decode eight values per
//! instruction and are bitwise equal to them (the same products, sums and reduction tree).

use half::f16;

/// `q . k` with eight interleaved partial sums (lane `l` takes elements `l`, `l + 8`, ...),
/// summed as `((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7))`, then the tail.
pub fn dot_f16(q: &[f32], k: &[f16]) -> f32 {
    assert_eq!(q.len(), k.len());
    let chunks = q.len() / 8;
    let mut acc = [0f32; 8];
    for ch in 0..chunks {
        for (l, acc) in acc.iter_mut().enumerate() {
            *acc += q[8 * ch + l] * k[8 * ch + l].to_f32();
        }
    }
    let mut tail = 0f32;
    for i in 8 * chunks..q.len() {
        tail += q[i] * k[i].to_f32();
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `o += p * v`, element by element (a product, then a sum).
pub fn axpy_f16(p: f32, v: &[f16], o: &mut [f32]) {
    assert_eq!(v.len(), o.len());
    for (o, v) in o.iter_mut().zip(v) {
        *o += p * v.to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
pub mod f16c {
    use std::arch::x86_64::*;

    use half::f16;

    /// # Safety
    /// The CPU must have AVX and F16C.
    #[target_feature(enable = "avx,f16c")]
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
            acc = _mm256_add_ps(acc, _mm256_mul_ps(qv, kv));
        }
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
        // [s0 + s1, s2 + s3, ..] then (s0 + s1) + (s2 + s3).
        let h = _mm_hadd_ps(s, s);
        let mut sum = _mm_cvtss_f32(_mm_hadd_ps(h, h));
        let mut tail = 0f32;
        for i in 8 * chunks..q.len() {
            tail += q[i] * k[i].to_f32();
        }
        sum += tail;
        sum
    }

    /// # Safety
    /// The CPU must have AVX and F16C.
    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn axpy_f16(p: f32, v: &[f16], o: &mut [f32]) {
        assert_eq!(v.len(), o.len());
        let chunks = v.len() / 8;
        let pv = _mm256_set1_ps(p);
        for ch in 0..chunks {
            // SAFETY: 8 * ch + 8 <= len for both slices.
            unsafe {
                let vv = _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(8 * ch) as *const __m128i));
                let at = o.as_mut_ptr().add(8 * ch);
                _mm256_storeu_ps(
                    at,
                    _mm256_add_ps(_mm256_loadu_ps(at), _mm256_mul_ps(pv, vv)),
                );
            }
        }
        for i in 8 * chunks..v.len() {
            o[i] += p * v[i].to_f32();
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn f16c_versions_equal_the_scalar_ones_bitwise() {
        if !(is_x86_feature_detected!("avx") && is_x86_feature_detected!("f16c")) {
            return;
        }
        let mut seed = 0x9e37_79b9_u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed as f32 / u32::MAX as f32 - 0.5) * 8.0
        };
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
