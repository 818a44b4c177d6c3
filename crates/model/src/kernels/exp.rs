//! `exp` for f32, the one every kernel uses (SiLU, softmax): a table of 2^(i/32) and a cubic in
//! double precision, the algorithm of Arm's optimized-routines `expf` that glibc ships, so on
//! x86-64 glibc with FMA it gives the same bits as `f32::exp`. Ours is the definition, though: the
//! scalar and AVX-512 versions below are bitwise equal on every platform, which a libm call is
//! not, and the SIMD one does eight values per instruction instead of a call per value.

/// `bits(2^(i/32)) - (i << 47)`: adding `k << 47` for `k = 32n + i` scales by `2^n`.
const TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// 32 / ln 2.
const INV_LN2_N: u64 = 0x40471547652b82fe;
/// 1.5 * 2^52: adding it rounds to an integer held in the low mantissa bits.
const SHIFT: u64 = 0x4338000000000000;
/// `2^(r/32) ~ 1 + C2 r + C1 r^2 + C0 r^3` for |r| <= 1/2.
const C: [u64; 3] = [0x3ebc6af84b912394, 0x3f2ebfce50fac4f3, 0x3f962e42ff0c52d6];

/// Whether the table formula covers `x` (|x| below 88); the rest (overflow, underflow to
/// subnormals or zero, infinities, NaN) go to the platform's `exp`.
#[inline]
fn in_range(x: f32) -> bool {
    (x.to_bits() >> 20) & 0x7ff <= 0x42a
}

/// e^x.
#[inline]
pub fn exp(x: f32) -> f32 {
    if !in_range(x) {
        return x.exp();
    }
    let c = C.map(f64::from_bits);
    let (inv, shift) = (f64::from_bits(INV_LN2_N), f64::from_bits(SHIFT));
    let xd = x as f64;
    let kd = inv.mul_add(xd, shift);
    let ki = kd.to_bits();
    let kd = kd - shift;
    let r = inv.mul_add(xd, -kd);
    let s = f64::from_bits(TABLE[(ki & 31) as usize].wrapping_add(ki << 47));
    let z = r.mul_add(c[0], c[1]);
    let r2 = r * r;
    let y = r.mul_add(c[2], 1.0);
    (z.mul_add(r2, y) * s) as f32
}

/// `g[i] = silu(g[i]) * u[i]` with `silu(a) = a / (1 + e^-a)`.
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    for (a, b) in g.iter_mut().zip(u) {
        *a = *a / (1.0 + exp(-*a)) * b;
    }
}

/// `s[i] = e^(s[i] - max)` in place; returns `1 / Σ s[i]` (summed in f64, in order).
pub fn softmax_numerators(s: &mut [f32]) -> f32 {
    let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0f64;
    for v in s.iter_mut() {
        *v = exp(*v - max);
        sum += *v as f64;
    }
    (1.0 / sum) as f32
}

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    //! Eight values at a time in double precision, lane for lane the scalar arithmetic above.

    use std::arch::x86_64::*;

    use super::{C, INV_LN2_N, SHIFT, TABLE};

    /// e^x of eight values; `None` when one is outside the table formula's range.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
    fn exp8(x: __m256) -> Option<__m256> {
        let bits = _mm256_castps_si256(x);
        let top = _mm256_and_si256(_mm256_srli_epi32::<20>(bits), _mm256_set1_epi32(0x7ff));
        if _mm256_movemask_epi8(_mm256_cmpgt_epi32(top, _mm256_set1_epi32(0x42a))) != 0 {
            return None;
        }
        let inv = _mm512_set1_pd(f64::from_bits(INV_LN2_N));
        let shift = _mm512_set1_pd(f64::from_bits(SHIFT));
        let xd = _mm512_cvtps_pd(x);
        let kd = _mm512_fmadd_pd(inv, xd, shift);
        let ki = _mm512_castpd_si512(kd);
        let kd = _mm512_sub_pd(kd, shift);
        let r = _mm512_fmsub_pd(inv, xd, kd);
        // SAFETY: TABLE holds 32 u64, read as four registers of eight.
        let t: [__m512i; 4] = std::array::from_fn(|i| unsafe {
            _mm512_loadu_si512(TABLE.as_ptr().add(8 * i).cast())
        });
        let idx = _mm512_and_si512(ki, _mm512_set1_epi64(31));
        let lo = _mm512_permutex2var_epi64(t[0], idx, t[1]);
        let hi = _mm512_permutex2var_epi64(t[2], idx, t[3]);
        let high_half = _mm512_test_epi64_mask(idx, _mm512_set1_epi64(16));
        let tv = _mm512_mask_blend_epi64(high_half, lo, hi);
        let s = _mm512_castsi512_pd(_mm512_add_epi64(tv, _mm512_slli_epi64::<47>(ki)));
        let c = C.map(|v| _mm512_set1_pd(f64::from_bits(v)));
        let z = _mm512_fmadd_pd(r, c[0], c[1]);
        let r2 = _mm512_mul_pd(r, r);
        let y = _mm512_fmadd_pd(r, c[2], _mm512_set1_pd(1.0));
        let y = _mm512_fmadd_pd(z, r2, y);
        Some(_mm512_cvtpd_ps(_mm512_mul_pd(y, s)))
    }

    /// [`super::silu_mul`], bitwise.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and AVX-512 F/VL.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
    pub unsafe fn silu_mul(g: &mut [f32], u: &[f32]) {
        assert!(u.len() >= g.len());
        let n8 = g.len() / 8 * 8;
        for i in (0..n8).step_by(8) {
            // SAFETY: i + 8 <= len of both.
            unsafe {
                let a = _mm256_loadu_ps(g.as_ptr().add(i));
                match exp8(_mm256_xor_ps(a, _mm256_set1_ps(-0.0))) {
                    Some(e) => {
                        let v = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0), e));
                        let v = _mm256_mul_ps(v, _mm256_loadu_ps(u.as_ptr().add(i)));
                        _mm256_storeu_ps(g.as_mut_ptr().add(i), v);
                    }
                    None => super::silu_mul(&mut g[i..i + 8], &u[i..i + 8]),
                }
            }
        }
        super::silu_mul(&mut g[n8..], &u[n8..]);
    }

    /// [`super::softmax_numerators`] of `G` rows of `n` values (`s[h * n..][..n]`), bitwise:
    /// each row's maximum (the same value whatever order finds it) and numerators as above,
    /// then the `G` in-order f64 sums advanced together, so `G` dependency chains overlap
    /// instead of running one after another.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and AVX-512 F/VL.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
    pub unsafe fn softmax_numerators_rows<const G: usize>(s: &mut [f32], n: usize) -> [f32; G] {
        assert!(s.len() >= G * n);
        for row in s[..G * n].chunks_exact_mut(n) {
            let mut chunks = row.chunks_exact(8);
            let mut m8 = _mm256_set1_ps(f32::NEG_INFINITY);
            for ch in &mut chunks {
                // SAFETY: eight floats. The running maximum is the second operand, so a NaN is
                // skipped as `f32::max` skips it.
                m8 = _mm256_max_ps(unsafe { _mm256_loadu_ps(ch.as_ptr()) }, m8);
            }
            let mut lanes = [0f32; 8];
            // SAFETY: eight floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m8) };
            let max = chunks
                .remainder()
                .iter()
                .chain(&lanes)
                .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let mut chunks = row.chunks_exact_mut(8);
            for ch in &mut chunks {
                // SAFETY: eight floats.
                let x = unsafe { _mm256_sub_ps(_mm256_loadu_ps(ch.as_ptr()), _mm256_set1_ps(max)) };
                match exp8(x) {
                    // SAFETY: as above.
                    Some(e) => unsafe { _mm256_storeu_ps(ch.as_mut_ptr(), e) },
                    None => ch.iter_mut().for_each(|v| *v = super::exp(*v - max)),
                }
            }
            for v in chunks.into_remainder() {
                *v = super::exp(*v - max);
            }
        }
        let mut sums = [0f64; G];
        for t in 0..n {
            for (h, sum) in sums.iter_mut().enumerate() {
                *sum += s[h * n + t] as f64;
            }
        }
        sums.map(|sum| (1.0 / sum) as f32)
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    //! Eight floats at a time as two registers of four doubles, lane for lane the scalar
    //! arithmetic above (the table read by a gather), for CPUs without AVX-512.

    use std::arch::x86_64::*;

    use super::{C, INV_LN2_N, SHIFT, TABLE};

    /// e^x of four doubles in the table formula's range, rounded to f32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp4(xd: __m256d) -> __m128 {
        let inv = _mm256_set1_pd(f64::from_bits(INV_LN2_N));
        let shift = _mm256_set1_pd(f64::from_bits(SHIFT));
        let kd = _mm256_fmadd_pd(inv, xd, shift);
        let ki = _mm256_castpd_si256(kd);
        let kd = _mm256_sub_pd(kd, shift);
        let r = _mm256_fmsub_pd(inv, xd, kd);
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        // SAFETY: every index is below 32, the table's length.
        let tv = unsafe { _mm256_i64gather_epi64::<8>(TABLE.as_ptr().cast(), idx) };
        let s = _mm256_castsi256_pd(_mm256_add_epi64(tv, _mm256_slli_epi64::<47>(ki)));
        let c = C.map(|v| _mm256_set1_pd(f64::from_bits(v)));
        let z = _mm256_fmadd_pd(r, c[0], c[1]);
        let r2 = _mm256_mul_pd(r, r);
        let y = _mm256_fmadd_pd(r, c[2], _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(z, r2, y);
        _mm256_cvtpd_ps(_mm256_mul_pd(y, s))
    }

    /// e^x of eight values; `None` when one is outside the table formula's range.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> Option<__m256> {
        let bits = _mm256_castps_si256(x);
        let top = _mm256_and_si256(_mm256_srli_epi32::<20>(bits), _mm256_set1_epi32(0x7ff));
        if _mm256_movemask_epi8(_mm256_cmpgt_epi32(top, _mm256_set1_epi32(0x42a))) != 0 {
            return None;
        }
        let lo = exp4(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
        let hi = exp4(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x)));
        Some(_mm256_set_m128(hi, lo))
    }

    /// [`super::silu_mul`], bitwise.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(g: &mut [f32], u: &[f32]) {
        assert!(u.len() >= g.len());
        let n8 = g.len() / 8 * 8;
        for i in (0..n8).step_by(8) {
            // SAFETY: i + 8 <= len of both.
            unsafe {
                let a = _mm256_loadu_ps(g.as_ptr().add(i));
                match exp8(_mm256_xor_ps(a, _mm256_set1_ps(-0.0))) {
                    Some(e) => {
                        let v = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0), e));
                        let v = _mm256_mul_ps(v, _mm256_loadu_ps(u.as_ptr().add(i)));
                        _mm256_storeu_ps(g.as_mut_ptr().add(i), v);
                    }
                    None => super::silu_mul(&mut g[i..i + 8], &u[i..i + 8]),
                }
            }
        }
        super::silu_mul(&mut g[n8..], &u[n8..]);
    }

    /// Most rows [`softmax_numerators_rows`] takes.
    pub const MAX_ROWS: usize = 8;

    /// [`super::softmax_numerators`] of `g` rows of `n` values (`s[h * n..][..n]`), bitwise,
    /// each row's `1 / Σ` in `inv[h]`: each row's maximum (the same value whatever order finds
    /// it) and numerators as above, then the `g` in-order f64 sums advanced together, so their
    /// dependency chains overlap instead of running one after another.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax_numerators_rows(s: &mut [f32], g: usize, n: usize, inv: &mut [f32]) {
        assert!(g <= MAX_ROWS && s.len() >= g * n && inv.len() >= g);
        for row in s[..g * n].chunks_exact_mut(n) {
            let mut chunks = row.chunks_exact(8);
            let mut m8 = _mm256_set1_ps(f32::NEG_INFINITY);
            for ch in &mut chunks {
                // SAFETY: eight floats. The running maximum is the second operand, so a NaN is
                // skipped as `f32::max` skips it.
                m8 = _mm256_max_ps(unsafe { _mm256_loadu_ps(ch.as_ptr()) }, m8);
            }
            let mut lanes = [0f32; 8];
            // SAFETY: eight floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m8) };
            let max = chunks
                .remainder()
                .iter()
                .chain(&lanes)
                .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let mut chunks = row.chunks_exact_mut(8);
            for ch in &mut chunks {
                // SAFETY: eight floats.
                let x = unsafe { _mm256_sub_ps(_mm256_loadu_ps(ch.as_ptr()), _mm256_set1_ps(max)) };
                match exp8(x) {
                    // SAFETY: as above.
                    Some(e) => unsafe { _mm256_storeu_ps(ch.as_mut_ptr(), e) },
                    None => ch.iter_mut().for_each(|v| *v = super::exp(*v - max)),
                }
            }
            for v in chunks.into_remainder() {
                *v = super::exp(*v - max);
            }
        }
        let mut sums = [0f64; MAX_ROWS];
        for t in 0..n {
            for (h, sum) in sums[..g].iter_mut().enumerate() {
                *sum += s[h * n + t] as f64;
            }
        }
        for (i, sum) in inv[..g].iter_mut().zip(sums) {
            *i = (1.0 / sum) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every 61st float in [-100, 100] (and the edges of the range) against the platform's
    /// `exp`: within one unit in the last place everywhere (the same bits under x86-64 glibc).
    #[test]
    fn exp_is_within_one_ulp_of_libm() {
        let (mut n, mut same) = (0u64, 0u64);
        let mut check = |x: f32| {
            let (a, b) = (exp(x), x.exp());
            n += 1;
            if a.to_bits() == b.to_bits() {
                same += 1;
            } else {
                let ulps = (a.to_bits() as i64 - b.to_bits() as i64).abs();
                assert!(ulps <= 1, "exp({x}) = {a}, libm {b}");
            }
        };
        for bits in (0u32..=100f32.to_bits()).step_by(61) {
            check(f32::from_bits(bits));
            check(-f32::from_bits(bits));
        }
        for x in [
            88.0,
            88.7,
            -87.9,
            -88.0,
            -103.0,
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            check(x);
        }
        assert!(exp(f32::NAN).is_nan());
        eprintln!("{same} of {n} identical to libm");
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_silu_and_softmax_equal_the_scalar_ones_bitwise() {
        use crate::kernels::Isa;
        for isa in [Isa::Avx2, Isa::Avx512Vnni] {
            if !isa.testable("simd_silu_and_softmax_equal_the_scalar_ones_bitwise") {
                continue;
            }
            let mut next = crate::kernels::tests::uniform(0x2468_ace1);
            for scale in [1.0, 20.0, 300.0] {
                let g: Vec<f32> = (0..1037).map(|_| next(scale)).collect();
                let u: Vec<f32> = (0..1037).map(|_| next(2.0)).collect();
                let (mut want, mut got) = (g.clone(), g.clone());
                silu_mul(&mut want, &u);
                // SAFETY: support checked above.
                unsafe {
                    match isa {
                        Isa::Avx2 => avx2::silu_mul(&mut got, &u),
                        _ => avx512::silu_mul(&mut got, &u),
                    }
                }
                assert_eq!(
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "{}: silu, scale {scale}",
                    isa.name()
                );
                // Three rows of each length, as one attention task's heads.
                for n in [1, 7, 8, 37, 345] {
                    let mut want = g[..3 * n].to_vec();
                    let mut got = want.clone();
                    let a: Vec<f32> = want.chunks_exact_mut(n).map(softmax_numerators).collect();
                    let mut b = [0f32; 3];
                    // SAFETY: as above.
                    unsafe {
                        match isa {
                            Isa::Avx2 => avx2::softmax_numerators_rows(&mut got, 3, n, &mut b),
                            _ => b = avx512::softmax_numerators_rows::<3>(&mut got, n),
                        }
                    }
                    assert_eq!(
                        a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        b.map(f32::to_bits).to_vec(),
                        "{}: softmax sums, scale {scale}, n {n}",
                        isa.name()
                    );
                    assert_eq!(
                        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "{}: softmax, scale {scale}, n {n}",
                        isa.name()
                    );
                }
            }
        }
    }
}
