//! Attention's inner products over `q8_0` K and V rows ([`crate::KvType::Q8_0`]), read in
//! place: a value is its block's f16 scale times its signed byte, exact in f32 (11 significant
//! bits times 7), so these are [`super::attn::dot_f16`] and [`super::attn::axpy_f16`] on the
//! row's values, in the same order, and the tiled attention kernel decodes such rows through
//! [`avx2::decode`] with the same arithmetic. The AVX2 versions are bitwise equal to the
//! scalar ones on every CPU that has them.

use half::f16;

/// The `q8_0` row format (defined here, beside the kernels that read it; the KV cache stores
/// it through [`crate::KvType`]): values per block, and the 16-bit units one block takes (the
/// scale, then 32 bytes).
pub const BLOCK: usize = 32;
pub const UNITS: usize = 17;

/// 16-bit units a row of `values` values takes (`values` a multiple of [`BLOCK`]).
pub fn row_units(values: usize) -> usize {
    values / BLOCK * UNITS
}

/// A block's scale `amax / 127` (as stored) and the factor its values are multiplied by before
/// rounding, `127 / amax` (0 where that is not finite: zeros, or values so small that it
/// overflows).
pub(crate) fn scale(x: &[f32]) -> (f16, f32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let id = 127.0 / amax;
    (
        f16::from_f32(amax / 127.0),
        if id.is_finite() { id } else { 0.0 },
    )
}

/// A value's byte, rounded to nearest even: never -128 (the kernels negate bytes), and NaN is
/// 0, so no input panics here.
pub(crate) fn byte(x: f32, id: f32) -> i8 {
    (x * id).round_ties_even().clamp(-127.0, 127.0) as i8
}

/// A row's bytes in memory order: block `b`'s scale is unit `b * UNITS`, its bytes follow.
fn bytes(row: &[f16]) -> &[u8] {
    // SAFETY: `f16` is two bytes of plain data, and `u8` needs no alignment.
    unsafe { std::slice::from_raw_parts(row.as_ptr().cast::<u8>(), std::mem::size_of_val(row)) }
}

fn check(values: usize, row: &[f16]) {
    assert!(values.is_multiple_of(BLOCK), "{values} values");
    assert_eq!(row.len(), values / BLOCK * UNITS);
}

/// Value `i` of a row.
#[inline]
fn value(row: &[f16], bytes: &[u8], i: usize) -> f32 {
    let b = i / BLOCK;
    let q = bytes[2 * (b * UNITS + 1) + i % BLOCK] as i8;
    row[b * UNITS].to_f32() * f32::from(q)
}

/// `q . k` over a `q8_0` row with eight interleaved partial sums (lane `l` takes values `l`,
/// `l + 8`, ..., one fused multiply-add each), summed as `((s0 + s4) + (s1 + s5)) + ((s2 + s6)
/// + (s3 + s7))`: [`super::attn::dot_f16`]'s arithmetic on the row's values.
pub fn dot_q8_0(q: &[f32], k: &[f16]) -> f32 {
    check(q.len(), k);
    let kb = bytes(k);
    let mut acc = [0f32; 8];
    for ch in 0..q.len() / 8 {
        for (l, acc) in acc.iter_mut().enumerate() {
            let i = 8 * ch + l;
            *acc = q[i].mul_add(value(k, kb, i), *acc);
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
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

    use super::check;
    use super::{BLOCK, UNITS};

    /// Block `b`'s scale in every lane (converted by F16C, not per value).
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C; the row must hold block `b`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale(row: &[f16], b: usize) -> __m256 {
        debug_assert!((b + 1) * UNITS <= row.len());
        // SAFETY: the caller promises the row holds this block.
        let bits = unsafe { *row.as_ptr().add(b * UNITS) }.to_bits();
        _mm256_cvtph_ps(_mm_set1_epi16(bits as i16))
    }

    /// Values `8 * j..8 * j + 8` of block `b` (`j < 4`), each the scale `d` times its byte
    /// (exact).
    ///
    /// # Safety
    /// The CPU must have AVX2; the row must hold block `b`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn times(row: &[f16], b: usize, j: usize, d: __m256) -> __m256 {
        debug_assert!((b + 1) * UNITS <= row.len() && j < 4);
        // SAFETY: the caller promises the row holds this block.
        unsafe {
            let at = (row.as_ptr().add(b * UNITS + 1) as *const u8).add(8 * j);
            let q = _mm_loadl_epi64(at as *const __m128i);
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)))
        }
    }

    /// Values `8 * ch..8 * ch + 8` of a row, each its block's scale times its byte (exact).
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C; the row must hold `8 * ch + 8` values.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn eight(row: &[f16], ch: usize) -> __m256 {
        let b = ch / (BLOCK / 8);
        // SAFETY: the caller promises the row holds these values.
        unsafe { times(row, b, ch % 4, scale(row, b)) }
    }

    /// A row's `8 * n` values into `dst` (32 at a time, one scale conversion for each 32).
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C; the row must hold `8 * n` values, `n` a multiple of 4,
    /// and `dst` take them.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn decode(row: &[f16], n: usize, dst: &mut [f32]) {
        assert!(n.is_multiple_of(4) && dst.len() >= 8 * n && row.len() >= n / 4 * UNITS);
        for b in 0..n / 4 {
            // SAFETY: block `b` is in the row and its 32 values in `dst` (asserted above).
            unsafe {
                let d = scale(row, b);
                for j in 0..4 {
                    let at = dst.as_mut_ptr().add(32 * b + 8 * j);
                    _mm256_storeu_ps(at, times(row, b, j, d));
                }
            }
        }
    }

    /// [`super::dot_q8_0`], bitwise.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0(q: &[f32], k: &[f16]) -> f32 {
        check(q.len(), k);
        let mut acc = _mm256_setzero_ps();
        for ch in 0..q.len() / 8 {
            // SAFETY: `8 * ch + 8 <= q.len()`, and the row holds `q.len()` values (checked).
            let (qv, kv) = unsafe { (_mm256_loadu_ps(q.as_ptr().add(8 * ch)), eight(k, ch)) };
            acc = _mm256_fmadd_ps(qv, kv, acc);
        }
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
        // [s0 + s4, s1 + s5, ..] then ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)).
        let h = _mm_hadd_ps(s, s);
        _mm_cvtss_f32(_mm_hadd_ps(h, h))
    }

    /// [`super::axpy_q8_0`], bitwise.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_q8_0(p: f32, v: &[f16], o: &mut [f32]) {
        check(o.len(), v);
        let pv = _mm256_set1_ps(p);
        for ch in 0..o.len() / 8 {
            // SAFETY: `8 * ch + 8 <= o.len()`, and the row holds `o.len()` values (checked).
            unsafe {
                let at = o.as_mut_ptr().add(8 * ch);
                _mm256_storeu_ps(at, _mm256_fmadd_ps(pv, eight(v, ch), _mm256_loadu_ps(at)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvType;

    /// A row stored as `q8_0` reads back as its scale times its bytes, within half a step of
    /// what was stored (plus the scale's rounding to f16); the products take those values; the
    /// AVX2 products equal the scalar ones bitwise.
    #[test]
    fn q8_0_rows_round_trip_and_avx2_equals_scalar_bitwise() {
        let mut uniform = crate::kernels::tests::uniform(0x51ed_2701);
        let mut next = || uniform(8.0);
        for n in [32, 64, 128, 256] {
            let x: Vec<f32> = (0..n).map(|_| next()).collect();
            let mut row = vec![f16::ZERO; KvType::Q8_0.row_units(n)];
            KvType::Q8_0.store(&x, &mut row);
            let rb = bytes(&row);
            for (b, x) in x.chunks_exact(BLOCK).enumerate() {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (j, &x) in x.iter().enumerate() {
                    let got = value(&row, rb, b * BLOCK + j);
                    let bound = amax / 127.0 * 0.5 + amax / 2048.0;
                    assert!((got - x).abs() <= bound, "n {n}: {got} for {x}");
                }
            }
            let q: Vec<f32> = (0..n).map(|_| next()).collect();
            let want: f32 = (0..n).map(|i| q[i] * value(&row, rb, i)).sum();
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
            let mut decoded = vec![0f32; n];
            // SAFETY: AVX2 and F16C checked above; the row holds `n` values, `n / 8` a
            // multiple of 4.
            unsafe { avx2::decode(&row, n / 8, &mut decoded) };
            for (i, d) in decoded.iter().enumerate() {
                assert_eq!(
                    d.to_bits(),
                    value(&row, rb, i).to_bits(),
                    "decode, n {n}, {i}"
                );
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

    /// Nothing a forward pass can produce makes storing panic or writes a -128 (zeros,
    /// infinities, NaN, values so small that `127 / amax` overflows), and the AVX2 dot product
    /// still equals the scalar one on them.
    #[test]
    fn storing_odd_values_does_not_panic() {
        let odd = [0.0, f32::INFINITY, f32::NAN, f32::MAX, 1e-30, 1e-38];
        for v in odd {
            let x: Vec<f32> = (0..32).map(|i| if i % 3 == 0 { -v } else { v }).collect();
            let mut row = vec![f16::ZERO; UNITS];
            KvType::Q8_0.store(&x, &mut row);
            assert!(!bytes(&row)[2..].contains(&0x80), "{v}: a -128 byte");
            let q = [0.5; 32];
            let dot = dot_q8_0(&q, &row);
            if crate::kernels::Isa::Avx2.testable("storing_odd_values_does_not_panic") {
                // SAFETY: AVX2 checked above.
                let fast = unsafe { avx2::dot_q8_0(&q, &row) };
                assert_eq!(fast.to_bits(), dot.to_bits(), "{v}");
            }
        }
        let (mut zero, mut ones) = (vec![f16::ZERO; UNITS], vec![f16::ZERO; UNITS]);
        KvType::Q8_0.store(&[0.0; 32], &mut zero);
        KvType::Q8_0.store(&[1.0; 32], &mut ones);
        assert_eq!(dot_q8_0(&[1.0; 32], &zero), 0.0);
        let d = f16::from_f32(1.0 / 127.0).to_f32();
        assert_eq!(dot_q8_0(&[1.0; 32], &ones), 32.0 * (127.0 * d));
    }
}
