//! x86-64 SIMD dot products. Two families generated from one source by a macro: AVX2
//! (`maddubs` + `madd`) and AVX-512 VNNI (`vpdpbusd` on 256-bit lanes). Each returns the same
//! per-block integer sums as the scalar reference; only the float accumulation order differs.

use std::arch::x86_64::*;

macro_rules! int_kernels {
    ($module:ident, $features:literal, |$u:ident, $s:ident| $dot:expr) => {
        pub mod $module {
            use super::*;

            /// Sums of 4 adjacent u8*i8 products into 8 i32 lanes.
            #[inline]
            #[target_feature(enable = $features)]
            fn dot_u8i8($u: __m256i, $s: __m256i) -> __m256i {
                $dot
            }

            /// 16 bytes of packed nibbles to 32 bytes: low nibbles first, then high nibbles.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn nibbles(p: *const u8) -> __m256i {
                // SAFETY: the caller guarantees 16 readable bytes at `p`.
                let packed = unsafe { _mm_loadu_si128(p as *const __m128i) };
                let mask = _mm_set1_epi8(0x0F);
                let lo = _mm_and_si128(packed, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
                _mm256_set_m128i(hi, lo)
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn f16(b: &[u8], at: usize) -> f32 {
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                    u16::from_le_bytes([b[at], b[at + 1]]) as i32,
                )))
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn hsum(v: __m256) -> f32 {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_movehdup_ps(s));
                _mm_cvtss_f32(s)
            }

            /// One weight row against `R` activation rows. Each row's arithmetic is exactly the
            /// single-row sequence, so `R` never changes a result (batch invariance); the weight
            /// block is unpacked once for all `R` rows.
            ///
            /// # Safety
            /// The CPU must have the module's features; `w` and every `a[r]` hold `n / 32` blocks.
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q4_1_q8_1<const R: usize>(
                n: usize,
                w: &[u8],
                a: [&[u8]; R],
            ) -> [f32; R] {
                let nb = n / 32;
                assert!(w.len() >= nb * 20 && a.iter().all(|a| a.len() >= nb * 36));
                let mut acc = [_mm256_setzero_ps(); R];
                let mut mins = [0f32; R];
                for i in 0..nb {
                    let wb = &w[i * 20..];
                    // SAFETY: bounds asserted above.
                    let q4 = unsafe { nibbles(wb.as_ptr().add(4)) };
                    let (wd, wm) = (f16(wb, 0), f16(wb, 2));
                    for r in 0..R {
                        let ab = &a[r][i * 36..];
                        // SAFETY: bounds asserted above.
                        let q8 =
                            unsafe { _mm256_loadu_si256(ab.as_ptr().add(4) as *const __m256i) };
                        let sums = _mm256_cvtepi32_ps(dot_u8i8(q4, q8));
                        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd * f16(ab, 0)), sums, acc[r]);
                        mins[r] += wm * f16(ab, 2);
                    }
                }
                let mut out = [0f32; R];
                for r in 0..R {
                    out[r] = hsum(acc[r]) + mins[r];
                }
                out
            }

            /// # Safety
            /// As for [`dot_q4_1_q8_1`].
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q4_0_q8_0<const R: usize>(
                n: usize,
                w: &[u8],
                a: [&[u8]; R],
            ) -> [f32; R] {
                let nb = n / 32;
                assert!(w.len() >= nb * 18 && a.iter().all(|a| a.len() >= nb * 34));
                let mut acc = [_mm256_setzero_ps(); R];
                let eight = _mm256_set1_epi8(8);
                for i in 0..nb {
                    let wb = &w[i * 18..];
                    // SAFETY: bounds asserted above.
                    let x = _mm256_sub_epi8(unsafe { nibbles(wb.as_ptr().add(2)) }, eight);
                    let ax = _mm256_sign_epi8(x, x);
                    let wd = f16(wb, 0);
                    for r in 0..R {
                        let ab = &a[r][i * 34..];
                        // SAFETY: bounds asserted above.
                        let q8 =
                            unsafe { _mm256_loadu_si256(ab.as_ptr().add(2) as *const __m256i) };
                        let sums = _mm256_cvtepi32_ps(dot_u8i8(ax, _mm256_sign_epi8(q8, x)));
                        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd * f16(ab, 0)), sums, acc[r]);
                    }
                }
                let mut out = [0f32; R];
                for r in 0..R {
                    out[r] = hsum(acc[r]);
                }
                out
            }

            /// 32 bytes, 0xFF where bit `i` of `bits` is set (byte `i`), else 0.
            #[inline]
            #[target_feature(enable = $features)]
            fn bit_bytes(bits: u32) -> __m256i {
                let spread = _mm256_shuffle_epi8(
                    _mm256_set1_epi32(bits as i32),
                    _mm256_set_epi64x(
                        0x0303030303030303,
                        0x0202020202020202,
                        0x0101010101010101,
                        0,
                    ),
                );
                let probe = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
                _mm256_cmpeq_epi8(probe, _mm256_set1_epi64x(-1))
            }

            /// # Safety
            /// As for [`dot_q4_1_q8_1`] (`w` holds Q5_0 blocks).
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q5_0_q8_0<const R: usize>(
                n: usize,
                w: &[u8],
                a: [&[u8]; R],
            ) -> [f32; R] {
                let nb = n / 32;
                assert!(w.len() >= nb * 22 && a.iter().all(|a| a.len() >= nb * 34));
                let mut acc = [_mm256_setzero_ps(); R];
                for i in 0..nb {
                    let wb = &w[i * 22..];
                    let qh = u32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
                    // value - 16 as i8: the nibble where the high bit is set, else nibble | 0xF0.
                    let high = _mm256_andnot_si256(bit_bytes(qh), _mm256_set1_epi8(0xF0u8 as i8));
                    // SAFETY: bounds asserted above.
                    let x = _mm256_or_si256(unsafe { nibbles(wb.as_ptr().add(6)) }, high);
                    let ax = _mm256_sign_epi8(x, x);
                    let wd = f16(wb, 0);
                    for r in 0..R {
                        let ab = &a[r][i * 34..];
                        // SAFETY: bounds asserted above.
                        let q8 =
                            unsafe { _mm256_loadu_si256(ab.as_ptr().add(2) as *const __m256i) };
                        let sums = _mm256_cvtepi32_ps(dot_u8i8(ax, _mm256_sign_epi8(q8, x)));
                        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd * f16(ab, 0)), sums, acc[r]);
                    }
                }
                let mut out = [0f32; R];
                for r in 0..R {
                    out[r] = hsum(acc[r]);
                }
                out
            }

            /// # Safety
            /// As for [`dot_q4_1_q8_1`] (`w` holds Q5_1 blocks).
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q5_1_q8_1<const R: usize>(
                n: usize,
                w: &[u8],
                a: [&[u8]; R],
            ) -> [f32; R] {
                let nb = n / 32;
                assert!(w.len() >= nb * 24 && a.iter().all(|a| a.len() >= nb * 36));
                let mut acc = [_mm256_setzero_ps(); R];
                let mut mins = [0f32; R];
                for i in 0..nb {
                    let wb = &w[i * 24..];
                    let qh = u32::from_le_bytes([wb[4], wb[5], wb[6], wb[7]]);
                    let high = _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(0x10));
                    // SAFETY: bounds asserted above.
                    let q5 = _mm256_or_si256(unsafe { nibbles(wb.as_ptr().add(8)) }, high);
                    let (wd, wm) = (f16(wb, 0), f16(wb, 2));
                    for r in 0..R {
                        let ab = &a[r][i * 36..];
                        // SAFETY: bounds asserted above.
                        let q8 =
                            unsafe { _mm256_loadu_si256(ab.as_ptr().add(4) as *const __m256i) };
                        let sums = _mm256_cvtepi32_ps(dot_u8i8(q5, q8));
                        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd * f16(ab, 0)), sums, acc[r]);
                        mins[r] += wm * f16(ab, 2);
                    }
                }
                let mut out = [0f32; R];
                for r in 0..R {
                    out[r] = hsum(acc[r]) + mins[r];
                }
                out
            }

            /// # Safety
            /// As for [`dot_q4_1_q8_1`].
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q8_0_q8_0<const R: usize>(
                n: usize,
                w: &[u8],
                a: [&[u8]; R],
            ) -> [f32; R] {
                let nb = n / 32;
                assert!(w.len() >= nb * 34 && a.iter().all(|a| a.len() >= nb * 34));
                let mut acc = [_mm256_setzero_ps(); R];
                for i in 0..nb {
                    let wb = &w[i * 34..];
                    // SAFETY: bounds asserted above.
                    let x = unsafe { _mm256_loadu_si256(wb.as_ptr().add(2) as *const __m256i) };
                    let ax = _mm256_sign_epi8(x, x);
                    let wd = f16(wb, 0);
                    for r in 0..R {
                        let ab = &a[r][i * 34..];
                        // SAFETY: bounds asserted above.
                        let y = unsafe { _mm256_loadu_si256(ab.as_ptr().add(2) as *const __m256i) };
                        let sums = _mm256_cvtepi32_ps(dot_u8i8(ax, _mm256_sign_epi8(y, x)));
                        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd * f16(ab, 0)), sums, acc[r]);
                    }
                }
                let mut out = [0f32; R];
                for r in 0..R {
                    out[r] = hsum(acc[r]);
                }
                out
            }

            /// # Safety
            /// The CPU must have the module's features; `w`, `a` hold `n / 256` blocks.
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q4k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
                // SAFETY: the caller's contract.
                unsafe { dot_q45k_q8k::<false>(n, w, a) }
            }

            /// # Safety
            /// As for [`dot_q4k_q8k`] (`w` holds Q5_K blocks).
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q5k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
                // SAFETY: the caller's contract.
                unsafe { dot_q45k_q8k::<true>(n, w, a) }
            }

            /// Q4_K, or Q5_K where `FIVE`: eight sub-blocks of 32 values with 6-bit scales and
            /// mins; Q5_K's fifth bits (32 bytes before the nibbles) are or-ed in per pair of
            /// sub-blocks.
            #[target_feature(enable = $features)]
            unsafe fn dot_q45k_q8k<const FIVE: bool>(n: usize, w: &[u8], a: &[u8]) -> f32 {
                let (bs, qs_at) = if FIVE { (176, 48) } else { (144, 16) };
                let nb = n / 256;
                assert!(w.len() >= nb * bs && a.len() >= nb * 292);
                let mut sum = 0f32;
                let mask = _mm256_set1_epi8(0x0F);
                let bit = _mm256_set1_epi8(0x01);
                for i in 0..nb {
                    let (wb, ab) = (&w[i * bs..], &a[i * 292..]);
                    let ad = f32::from_le_bytes([ab[0], ab[1], ab[2], ab[3]]);
                    let scales = &wb[4..16];
                    // SAFETY: bounds asserted above (Q4_K reads no fifth bits).
                    let qh = if FIVE {
                        unsafe { _mm256_loadu_si256(wb.as_ptr().add(16) as *const __m256i) }
                    } else {
                        _mm256_setzero_si256()
                    };
                    let mut isum = _mm256_setzero_si256();
                    let mut msum = 0i32;
                    for j in 0..4 {
                        let (sc1, m1) = gguf::quant::scale_min_k4(2 * j, scales);
                        let (sc2, m2) = gguf::quant::scale_min_k4(2 * j + 1, scales);
                        // SAFETY: bounds asserted above.
                        let (q, y1, y2) = unsafe {
                            (
                                _mm256_loadu_si256(
                                    wb.as_ptr().add(qs_at + 32 * j) as *const __m256i
                                ),
                                _mm256_loadu_si256(ab.as_ptr().add(4 + 64 * j) as *const __m256i),
                                _mm256_loadu_si256(
                                    ab.as_ptr().add(4 + 64 * j + 32) as *const __m256i
                                ),
                            )
                        };
                        let mut lo = _mm256_and_si256(q, mask);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
                        if FIVE {
                            // Fifth bits 2j and 2j + 1 of each byte, moved to bit 4 (masked to
                            // one bit per byte first, so no bit crosses into the next byte).
                            let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j as i32));
                            let h_lo = _mm256_slli_epi16(_mm256_and_si256(h, bit), 4);
                            let h_hi = _mm256_slli_epi16(
                                _mm256_and_si256(_mm256_srli_epi16(h, 1), bit),
                                4,
                            );
                            lo = _mm256_or_si256(lo, h_lo);
                            hi = _mm256_or_si256(hi, h_hi);
                        }
                        let s1 =
                            _mm256_mullo_epi32(dot_u8i8(lo, y1), _mm256_set1_epi32(sc1 as i32));
                        let s2 =
                            _mm256_mullo_epi32(dot_u8i8(hi, y2), _mm256_set1_epi32(sc2 as i32));
                        isum = _mm256_add_epi32(isum, _mm256_add_epi32(s1, s2));
                        let b = |k: usize| {
                            i16::from_le_bytes([ab[260 + 2 * k], ab[261 + 2 * k]]) as i32
                        };
                        msum += m1 as i32 * (b(4 * j) + b(4 * j + 1))
                            + m2 as i32 * (b(4 * j + 2) + b(4 * j + 3));
                    }
                    let isum = hsum_i32(isum);
                    sum += f16(wb, 0) * ad * isum as f32 - f16(wb, 2) * ad * msum as f32;
                }
                sum
            }

            /// The exact integer sum of 256 two-bit values (`n`, `k`: bits `2k` of bytes
            /// `32n..32n + 32` of `qs`, plus their third bit from `high` when given) times a
            /// Q8_K block's values, each group of 16 times its scale (byte `g` of `scales`, i8).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn k_groups_of_16(
                qs: *const u8,
                high: Option<__m256i>,
                q8: *const u8,
                scales: __m128i,
            ) -> i32 {
                let two = _mm256_set1_epi8(0x03);
                let bit = _mm256_set1_epi8(0x01);
                let mut isum = _mm256_setzero_si256();
                for n in 0..2 {
                    // SAFETY: the caller keeps 64 bytes at `qs` and 256 at `q8` readable.
                    let q = unsafe { _mm256_loadu_si256(qs.add(32 * n) as *const __m256i) };
                    for k in 0..4 {
                        let mut v = _mm256_and_si256(
                            _mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * k as i32)),
                            two,
                        );
                        if let Some(h) = high {
                            // Bit 4n + k of each byte, moved to bit 2 (masked to one bit per
                            // byte first, so no bit crosses into the next byte).
                            let b = _mm256_srl_epi16(h, _mm_cvtsi32_si128((4 * n + k) as i32));
                            v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(b, bit), 2));
                        }
                        // SAFETY: as above.
                        let y = unsafe {
                            _mm256_loadu_si256(q8.add(128 * n + 32 * k) as *const __m256i)
                        };
                        // Lanes 0..4 sum group g's 16 values, lanes 4..8 group g + 1's: their
                        // scales spread to match.
                        let g = (8 * n + 2 * k) as i64;
                        let pick =
                            _mm_set_epi64x(0, g * 0x0101_0101_0101_0101 + 0x0101_0101_0000_0000);
                        let lanes = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(scales, pick));
                        isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(dot_u8i8(v, y), lanes));
                    }
                }
                hsum_i32(isum)
            }

            /// `sum(c[g] * bsums[g])` over a Q8_K block's 16 group sums (at `bsums`) and 16
            /// i8 coefficients.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn dot_bsums(bsums: *const u8, c: __m128i) -> i32 {
                // SAFETY: the caller keeps 32 bytes at `bsums` readable.
                let b = unsafe { _mm256_loadu_si256(bsums as *const __m256i) };
                hsum_i32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(c), b))
            }

            /// # Safety
            /// As for [`dot_q4k_q8k`] (`w` holds Q2_K blocks).
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q2k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
                let nb = n / 256;
                assert!(w.len() >= nb * 84 && a.len() >= nb * 292);
                let mut sum = 0f32;
                let nibble = _mm_set1_epi8(0x0F);
                for i in 0..nb {
                    let (wb, ab) = (&w[i * 84..], &a[i * 292..]);
                    let ad = f32::from_le_bytes([ab[0], ab[1], ab[2], ab[3]]);
                    // SAFETY: bounds asserted above.
                    let (isum, msum) = unsafe {
                        let sm = _mm_loadu_si128(wb.as_ptr() as *const __m128i);
                        let (scales, mins) = (
                            _mm_and_si128(sm, nibble),
                            _mm_and_si128(_mm_srli_epi16(sm, 4), nibble),
                        );
                        (
                            k_groups_of_16(wb.as_ptr().add(16), None, ab.as_ptr().add(4), scales),
                            dot_bsums(ab.as_ptr().add(260), mins),
                        )
                    };
                    sum += f16(wb, 80) * ad * isum as f32 - f16(wb, 82) * ad * msum as f32;
                }
                sum
            }

            /// # Safety
            /// As for [`dot_q4k_q8k`] (`w` holds Q3_K blocks).
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q3k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
                let nb = n / 256;
                assert!(w.len() >= nb * 110 && a.len() >= nb * 292);
                let mut sum = 0f32;
                for i in 0..nb {
                    let (wb, ab) = (&w[i * 110..], &a[i * 292..]);
                    let ad = f32::from_le_bytes([ab[0], ab[1], ab[2], ab[3]]);
                    let sc = gguf::quant::q3k_scales(&wb[96..108]);
                    // Values are summed as stored (value + 4, with the third bit from hmask),
                    // and 4 times each group's activation sum taken off.
                    // SAFETY: bounds asserted above.
                    let (stored, corr) = unsafe {
                        let scales = _mm_sub_epi8(
                            _mm_loadu_si128(sc.as_ptr() as *const __m128i),
                            _mm_set1_epi8(32),
                        );
                        let hmask = _mm256_loadu_si256(wb.as_ptr() as *const __m256i);
                        (
                            k_groups_of_16(
                                wb.as_ptr().add(32),
                                Some(hmask),
                                ab.as_ptr().add(4),
                                scales,
                            ),
                            dot_bsums(ab.as_ptr().add(260), scales),
                        )
                    };
                    sum += f16(wb, 108) * ad * (stored - 4 * corr) as f32;
                }
                sum
            }

            /// # Safety
            /// The CPU must have the module's features; `w`, `a` hold `n / 256` blocks.
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q6k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
                let nb = n / 256;
                assert!(w.len() >= nb * 210 && a.len() >= nb * 292);
                let mut sum = 0f32;
                let m4 = _mm256_set1_epi8(0x0F);
                let m2 = _mm256_set1_epi8(0x03);
                let k32 = _mm256_set1_epi8(32);
                for i in 0..nb {
                    let (wb, ab) = (&w[i * 210..], &a[i * 292..]);
                    let ad = f32::from_le_bytes([ab[0], ab[1], ab[2], ab[3]]);
                    let sc = &wb[192..208];
                    let mut isum = _mm256_setzero_si256();
                    for half in 0..2 {
                        // SAFETY: bounds asserted above.
                        let (l0, l1, h) = unsafe {
                            (
                                _mm256_loadu_si256(wb.as_ptr().add(64 * half) as *const __m256i),
                                _mm256_loadu_si256(
                                    wb.as_ptr().add(64 * half + 32) as *const __m256i
                                ),
                                _mm256_loadu_si256(
                                    wb.as_ptr().add(128 + 32 * half) as *const __m256i
                                ),
                            )
                        };
                        let quads = [
                            _mm256_or_si256(
                                _mm256_and_si256(l0, m4),
                                _mm256_slli_epi16(_mm256_and_si256(h, m2), 4),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(l1, m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4),
                            ),
                        ];
                        for (k, q) in quads.into_iter().enumerate() {
                            // SAFETY: bounds asserted above.
                            let y = unsafe {
                                _mm256_loadu_si256(
                                    ab.as_ptr().add(4 + 128 * half + 32 * k) as *const __m256i
                                )
                            };
                            // (q - 32) * y = q * y - 32 * y; both parts as u8 x i8 sums.
                            let qy = dot_u8i8(q, y);
                            let ky = dot_u8i8(k32, y);
                            let d = _mm256_sub_epi32(qy, ky);
                            // Lanes 0..4 cover values 0..16 (scale 2k), lanes 4..8 values 16..32 (scale 2k+1).
                            let s_lo = sc[8 * half + 2 * k] as i8 as i32;
                            let s_hi = sc[8 * half + 2 * k + 1] as i8 as i32;
                            let scales =
                                _mm256_setr_epi32(s_lo, s_lo, s_lo, s_lo, s_hi, s_hi, s_hi, s_hi);
                            isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(d, scales));
                        }
                    }
                    sum += f16(wb, 208) * ad * hsum_i32(isum) as f32;
                }
                sum
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn hsum_i32(v: __m256i) -> i32 {
                let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
                _mm_cvtsi128_si32(s)
            }
        }
    };
}

int_kernels!(avx2, "avx2,fma,f16c", |u, s| _mm256_madd_epi16(
    _mm256_maddubs_epi16(u, s),
    _mm256_set1_epi16(1)
));
int_kernels!(vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", |u, s| {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
});
