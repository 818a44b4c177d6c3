//! Attention's inner products over `q8_0` K and V rows ([`crate::KvType::Q8_0`]), read in
//! place. `q . k` takes Q quantized as K is and sums exact integer products per block, as
//! llama.cpp's `q8_0` dot product does; `o += p * v` takes each value as its block's f16 scale
//! times its signed byte, exact in f32 (11 significant bits times 7), in the order
//! [`super::attn::axpy_f16`] takes f16 values. The AVX2 versions are bitwise equal to the
//! scalar ones on every CPU that has them.

use half::f16;

use crate::kv::{Q8_0_BLOCK, Q8_0_UNITS};

/// A row's little-endian bytes: block `b`'s scale is unit `b * Q8_0_UNITS`, its bytes follow.
fn bytes(row: &[f16]) -> &[u8] {
    // SAFETY: `f16` is two bytes of plain data, and `u8` needs no alignment.
    unsafe { std::slice::from_raw_parts(row.as_ptr().cast::<u8>(), std::mem::size_of_val(row)) }
}

fn check(values: usize, row: &[f16]) {
    assert!(values.is_multiple_of(Q8_0_BLOCK), "{values} values");
    assert_eq!(row.len(), values / Q8_0_BLOCK * Q8_0_UNITS);
}

/// Value `i` of a row.
#[inline]
fn value(row: &[f16], bytes: &[u8], i: usize) -> f32 {
    let b = i / Q8_0_BLOCK;
    let q = bytes[2 * (b * Q8_0_UNITS + 1) + i % Q8_0_BLOCK] as i8;
    row[b * Q8_0_UNITS].to_f32() * f32::from(q)
}

/// `q . k` of two `q8_0` rows (Q quantized as K is, as llama.cpp's `q8_0` dot product takes
/// it): per block the exact integer sum of the byte products, times the product of the two
/// scales, added block after block.
pub fn dot_q8_0(q: &[f16], k: &[f16]) -> f32 {
    assert_eq!(q.len(), k.len());
    assert!(q.len().is_multiple_of(Q8_0_UNITS));
    let (qb, kb) = (bytes(q), bytes(k));
    let mut sum = 0f32;
    for b in 0..q.len() / Q8_0_UNITS {
        let at = 2 * (b * Q8_0_UNITS + 1);
        let sumi: i32 = (at..at + Q8_0_BLOCK)
            .map(|i| i32::from(qb[i] as i8) * i32::from(kb[i] as i8))
            .sum();
        let d = q[b * Q8_0_UNITS].to_f32() * k[b * Q8_0_UNITS].to_f32();
        sum += sumi as f32 * d;
    }
    sum
}

/// `o += p * v` over a `q8_0` row, one fused multiply-add per value.
pub fn axpy_q8_0(p: f32, v: &[f16], o: &mut [f32]) {
    check(o.len(), v);
    let vb = bytes(v);
    for (i, o) in o.iter_mut().enumerate() {
        *o = p.mul_add(value(v, vb, i), *o);
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::{bytes, check};
    use crate::kv::{Q8_0_BLOCK, Q8_0_UNITS};

    /// Values `8 * c..8 * c + 8` of block `b`, each its scale times its byte.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn eight(row: &[f16], bytes: &[u8], b: usize, c: usize) -> __m256 {
        let at = 2 * (b * Q8_0_UNITS + 1) + 8 * c;
        assert!(at + 8 <= bytes.len());
        // SAFETY: the eight bytes lie inside the row (checked above).
        let q = unsafe { _mm_loadl_epi64(bytes.as_ptr().add(at) as *const __m128i) };
        _mm256_mul_ps(
            _mm256_set1_ps(row[b * Q8_0_UNITS].to_f32()),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
        )
    }

    /// [`super::dot_q8_0`], bitwise (the integer sums are exact either way).
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot_q8_0(q: &[f16], k: &[f16]) -> f32 {
        assert_eq!(q.len(), k.len());
        assert!(q.len().is_multiple_of(Q8_0_UNITS));
        let (qb, kb) = (bytes(q), bytes(k));
        let ones = _mm256_set1_epi16(1);
        let mut sum = 0f32;
        for b in 0..q.len() / Q8_0_UNITS {
            let at = 2 * (b * Q8_0_UNITS + 1);
            // SAFETY: the block's 32 bytes lie inside both rows (lengths checked above).
            let (x, y) = unsafe {
                (
                    _mm256_loadu_si256(qb.as_ptr().add(at) as *const __m256i),
                    _mm256_loadu_si256(kb.as_ptr().add(at) as *const __m256i),
                )
            };
            // |x| times y with x's sign: byte pairs summed into 16 bits (at most 2 * 127 * 128,
            // no overflow: the quantizer writes no -128), then pairs of those into 32 bits.
            let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
            let s = _mm256_madd_epi16(pairs, ones);
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
            let sumi = _mm_cvtsi128_si32(s);
            let d = q[b * Q8_0_UNITS].to_f32() * k[b * Q8_0_UNITS].to_f32();
            sum += sumi as f32 * d;
        }
        sum
    }

    /// [`super::axpy_q8_0`], bitwise.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_q8_0(p: f32, v: &[f16], o: &mut [f32]) {
        check(o.len(), v);
        let vb = bytes(v);
        let pv = _mm256_set1_ps(p);
        for b in 0..o.len() / Q8_0_BLOCK {
            for c in 0..Q8_0_BLOCK / 8 {
                // SAFETY: `Q8_0_BLOCK * b + 8 * c + 8 <= o.len()`.
                unsafe {
                    let at = o.as_mut_ptr().add(Q8_0_BLOCK * b + 8 * c);
                    let x = eight(v, vb, b, c);
                    _mm256_storeu_ps(at, _mm256_fmadd_ps(pv, x, _mm256_loadu_ps(at)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvType;

    /// A row stored as `q8_0` reads back as its scale times its bytes, within half a step of
    /// what was stored (plus the scale's rounding to f16); the dot product of two such rows is
    /// that of their values; the AVX2 products equal the scalar ones bitwise.
    #[test]
    fn q8_0_rows_round_trip_and_avx2_equals_scalar_bitwise() {
        let mut uniform = crate::kernels::tests::uniform(0x51ed_2701);
        let mut next = || uniform(8.0);
        for n in [32, 64, 128, 256] {
            let x: Vec<f32> = (0..n).map(|_| next()).collect();
            let mut row = vec![f16::ZERO; KvType::Q8_0.row_units(n)];
            KvType::Q8_0.store(&x, &mut row);
            let rb = bytes(&row);
            for (b, x) in x.chunks_exact(Q8_0_BLOCK).enumerate() {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (j, &x) in x.iter().enumerate() {
                    let got = value(&row, rb, b * Q8_0_BLOCK + j);
                    let bound = amax / 127.0 * 0.5 + amax / 2048.0;
                    assert!((got - x).abs() <= bound, "n {n}: {got} for {x}");
                }
            }
            let qf: Vec<f32> = (0..n).map(|_| next()).collect();
            let mut q = vec![f16::ZERO; row.len()];
            KvType::Q8_0.store(&qf, &mut q);
            let qb = bytes(&q);
            let want: f32 = (0..n).map(|i| value(&q, qb, i) * value(&row, rb, i)).sum();
            let dot = dot_q8_0(&q, &row);
            assert!(
                (dot - want).abs() <= 1e-3 * want.abs().max(1.0),
                "n {n}: {dot} vs {want}"
            );
            let p = next();
            let mut a: Vec<f32> = (0..n).map(|_| next()).collect();
            let before = a.clone();
            let mut b = a.clone();
            axpy_q8_0(p, &row, &mut a);
            for i in 0..n {
                assert_eq!(a[i], p.mul_add(value(&row, rb, i), before[i]));
            }
            if !crate::kernels::Isa::Avx2
                .testable("q8_0_rows_round_trip_and_avx2_equals_scalar_bitwise")
            {
                continue;
            }
            // SAFETY: AVX2 and FMA checked above.
            let fast = unsafe { avx2::dot_q8_0(&q, &row) };
            assert_eq!(fast.to_bits(), dot.to_bits(), "dot, n = {n}");
            // SAFETY: as above.
            unsafe { avx2::axpy_q8_0(p, &row, &mut b) };
            assert_eq!(
                a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "axpy, n = {n}"
            );
        }
    }

    /// Nothing a forward pass can produce makes storing panic: zeros, infinities and NaN.
    #[test]
    fn storing_odd_values_does_not_panic() {
        for v in [
            0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            1e-30,
        ] {
            let x = vec![v; 32];
            let mut row = vec![f16::ZERO; Q8_0_UNITS];
            KvType::Q8_0.store(&x, &mut row);
            let _ = dot_q8_0(&row, &row);
        }
        let (mut zero, mut ones) = (vec![f16::ZERO; Q8_0_UNITS], vec![f16::ZERO; Q8_0_UNITS]);
        KvType::Q8_0.store(&[0.0; 32], &mut zero);
        KvType::Q8_0.store(&[1.0; 32], &mut ones);
        assert_eq!(dot_q8_0(&ones, &zero), 0.0);
        let d = f16::from_f32(1.0 / 127.0).to_f32();
        assert_eq!(dot_q8_0(&ones, &ones), (32 * 127 * 127) as f32 * (d * d));
    }
}
