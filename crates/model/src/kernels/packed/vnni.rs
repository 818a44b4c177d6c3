//! The panel kernels: one panel (16 weight rows) times `RA` activation rows. Each 64-byte
//! chunk of weights is unpacked once for all activation rows; every output element goes
//! through the same instruction sequence whatever `RA` is, so grouping never changes a
//! result.

use std::arch::x86_64::*;

use gguf::quant::{QK, QK_K};

use super::{put_k_act_scales, Layout, PackKind, PANEL, SUBS};

pub const Q40: u8 = 0;
pub const Q41: u8 = 1;
pub const Q8: u8 = 2;
pub const Q50: u8 = 3;
pub const Q51: u8 = 4;
pub const Q4K: u8 = 5;
pub const Q5K: u8 = 6;
pub const Q6K: u8 = 7;
pub const Q2K: u8 = 8;
pub const Q3K: u8 = 9;

/// The kind of a kernel's `KIND` (the inverse of [`kind_id`]), so that its block size and
/// offsets are compile-time constants (see [`PREFETCH`]).
const fn kind_of(id: u8) -> PackKind {
    match id {
        Q40 => PackKind::Q4_0,
        Q41 => PackKind::Q4_1,
        Q8 => PackKind::Q8_0,
        Q50 => PackKind::Q5_0,
        Q51 => PackKind::Q5_1,
        Q4K => PackKind::Q4K,
        Q5K => PackKind::Q5K,
        Q6K => PackKind::Q6K,
        Q2K => PackKind::Q2K,
        Q3K => PackKind::Q3K,
        _ => panic!("not a kind id"),
    }
}

pub fn kind_id(k: PackKind) -> u8 {
    match k {
        PackKind::Q4_0 => Q40,
        PackKind::Q4_1 => Q41,
        PackKind::Q8_0 => Q8,
        PackKind::Q5_0 => Q50,
        PackKind::Q5_1 => Q51,
        PackKind::Q4K => Q4K,
        PackKind::Q5K => Q5K,
        PackKind::Q6K => Q6K,
        PackKind::Q2K => Q2K,
        PackKind::Q3K => Q3K,
    }
}

/// Four activation values (bytes `at..at + 4` of a row) in every lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn bcast4(a: *const u8, at: usize) -> __m512i {
    // SAFETY: the caller keeps `at + 4` within the row.
    _mm512_set1_epi32(unsafe { (a.add(at) as *const i32).read_unaligned() })
}

/// `v * scale` rounded half away from zero, as the scalar quantizers round: truncation plus a
/// step where the (exact) remainder reaches one half. Outside the i32 range it saturates as
/// the scalar conversion does (a NaN is 0, at or above 2^31 is `i32::MAX`; the instruction
/// alone gives `i32::MIN` for both): only garbage activations get there, a block of
/// denormals scaled by infinity or a NaN.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn round_scaled(v: __m512, scale: __m512) -> __m512i {
    let y = _mm512_mul_ps(v, scale);
    let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
    let frac = _mm512_sub_ps(y, t);
    let one = _mm512_set1_epi32(1);
    let q = _mm512_cvttps_epi32(t);
    let q = _mm512_mask_add_epi32(
        q,
        _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5)),
        q,
        one,
    );
    let q = _mm512_mask_sub_epi32(
        q,
        _mm512_cmp_ps_mask::<_CMP_LE_OQ>(frac, _mm512_set1_ps(-0.5)),
        q,
        one,
    );
    let q = _mm512_mask_set1_epi32(
        q,
        _mm512_cmp_ps_mask::<_CMP_GE_OQ>(y, _mm512_set1_ps(2147483648.0)),
        i32::MAX,
    );
    _mm512_mask_set1_epi32(q, _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(y, y), 0)
}

/// [`super::quantize_act_row`], 16 values per instruction and bitwise equal to it: the
/// same maximum, scale and reciprocal; rounding half away from zero as truncation plus a
/// step where the (exact) remainder reaches one half.
///
/// # Safety
/// The CPU must have AVX-512 F/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn quantize_act_row(layout: &Layout, x: &[f32], out: &mut [u8]) {
    assert!(
        !layout.kind.is_k(),
        "K-quant activations are quantized by the reference"
    );
    assert_eq!(x.len(), layout.n_cols);
    assert!(out.len() >= layout.a_row_bytes());
    let offset = layout.kind.offset();
    // Sixteen blocks at a time: their maxima first, then their scales and reciprocals in
    // one vector division each (the same IEEE operations as one block at a time), then
    // the quants, then the per-block sums and corrections in vectors again.
    for g0 in (0..layout.n_blocks).step_by(16) {
        let n = (layout.n_blocks - g0).min(16);
        let mask = ((1u32 << n) - 1) as __mmask16;
        let mut amax = [0f32; 16];
        for (i, m) in amax.iter_mut().enumerate().take(n) {
            // SAFETY: block `g0 + i` of `x` is in bounds by the assertions above.
            let (x0, x1) = unsafe {
                let p = x.as_ptr().add(QK * (g0 + i));
                (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)))
            };
            // `max` returns its second operand when either is NaN: each value goes first
            // against one that is not NaN, so a NaN is skipped as `f32::max` skips it.
            let zero = _mm512_setzero_ps();
            let m01 = _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), zero));
            *m = _mm512_reduce_max_ps(m01);
        }
        // SAFETY: sixteen floats.
        let d = _mm512_div_ps(
            unsafe { _mm512_loadu_ps(amax.as_ptr()) },
            _mm512_set1_ps(127.0),
        );
        // `d != 0.0`, true for NaN as in Rust.
        let nonzero = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(d, _mm512_setzero_ps());
        let id = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0), d);
        let mut ids = [0f32; 16];
        // SAFETY: sixteen floats.
        unsafe { _mm512_storeu_ps(ids.as_mut_ptr(), id) };
        let mut sums = [0i32; 16];
        for (i, sum) in sums.iter_mut().enumerate().take(n) {
            let b = g0 + i;
            // SAFETY: block `b` of `x` (32 floats) and of `out` (32 bytes) is in bounds by
            // the assertions above.
            let (x0, x1) = unsafe {
                (
                    _mm512_loadu_ps(x.as_ptr().add(QK * b)),
                    _mm512_loadu_ps(x.as_ptr().add(QK * b + 16)),
                )
            };
            let id = _mm512_set1_ps(ids[i]);
            // The stored bytes are the low bytes of the rounded values, as `as i8` keeps
            // them, and the sum is theirs (the values differ only for garbage activations).
            let q0 = _mm512_cvtepi32_epi8(round_scaled(x0, id));
            let q1 = _mm512_cvtepi32_epi8(round_scaled(x1, id));
            // SAFETY: as above.
            unsafe {
                _mm_storeu_si128(out.as_mut_ptr().add(QK * b) as *mut __m128i, q0);
                _mm_storeu_si128(out.as_mut_ptr().add(QK * b + 16) as *mut __m128i, q1);
            }
            *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(
                _mm512_cvtepi8_epi32(q0),
                _mm512_cvtepi8_epi32(q1),
            ));
        }
        let f16_round =
            |v: __m512| _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
        // SAFETY (stores): blocks `g0..g0 + n` of the scale, correction and sum arrays are
        // in bounds by the assertions above; the mask keeps to them.
        unsafe {
            let base = out.as_mut_ptr();
            let at = |off: usize| base.add(off + 4 * g0);
            _mm512_mask_storeu_ps(at(layout.a_d()) as *mut f32, mask, f16_round(d));
            let sums = _mm512_loadu_si512(sums.as_ptr() as *const __m512i);
            if offset != 0 {
                let corr = _mm512_mullo_epi32(sums, _mm512_set1_epi32(-offset));
                _mm512_mask_storeu_epi32(at(layout.a_corr()) as *mut i32, mask, corr);
            }
            if layout.kind.has_mins() {
                let s = f16_round(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), d));
                _mm512_mask_storeu_ps(at(layout.a_sums()) as *mut f32, mask, s);
            }
        }
    }
}

/// [`super::quantize_act_row`] for the K-quants (Q8_K blocks of 256), sixteen values per
/// instruction and bitwise equal to it: the first value of the largest magnitude is the
/// signed maximum (NaN skipped, as the reference's comparison skips it), the same scale and
/// rounding ([`round_scaled`]), and the sums taken from the stored bytes.
///
/// # Safety
/// The CPU must have AVX-512 F/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn quantize_k_act_row(layout: &Layout, x: &[f32], out: &mut [u8]) {
    assert!(layout.kind.is_k());
    assert_eq!(x.len(), layout.n_cols);
    assert!(out.len() >= layout.a_row_bytes());
    let top = _mm512_set1_epi32(127);
    for (b, xb) in x.chunks_exact(QK_K).enumerate() {
        // SAFETY (loads): sixteen chunks of sixteen floats make the block.
        let chunk = |c: usize| unsafe { _mm512_loadu_ps(xb.as_ptr().add(16 * c)) };
        // The running maximum is the second operand, so a NaN is skipped.
        let mut m = _mm512_setzero_ps();
        for c in 0..QK_K / 16 {
            m = _mm512_max_ps(_mm512_abs_ps(chunk(c)), m);
        }
        let amax = _mm512_reduce_max_ps(m);
        let mut sums16 = [0i32; QK_K / 16];
        let mut d = 0f32;
        if amax == 0.0 {
            out[QK_K * b..QK_K * (b + 1)].fill(0);
        } else {
            let first = (0..QK_K / 16)
                .find_map(|c| {
                    let eq = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(
                        _mm512_abs_ps(chunk(c)),
                        _mm512_set1_ps(amax),
                    );
                    (eq != 0).then(|| 16 * c + eq.trailing_zeros() as usize)
                })
                .expect("the maximum is one of the block's magnitudes");
            let iscale = -127.0 / xb[first];
            d = 1.0 / iscale;
            let is = _mm512_set1_ps(iscale);
            for (c, sum) in sums16.iter_mut().enumerate() {
                let q = round_scaled(chunk(c), is);
                // The stored byte is the low byte of `min(q, 127)`, as `as i8` keeps it.
                let bytes = _mm512_cvtepi32_epi8(_mm512_min_epi32(q, top));
                // SAFETY: value `16c` of block `b` of `out`, in bounds by the assertions.
                unsafe {
                    _mm_storeu_si128(
                        out.as_mut_ptr().add(QK_K * b + 16 * c) as *mut __m128i,
                        bytes,
                    )
                };
                *sum = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(bytes));
            }
        }
        put_k_act_scales(layout, b, d, &sums16, out);
    }
}

/// The values `8h + j` (`lo`) and `8h + 4 + j` (`hi`) of every lane of a sub-block, from
/// its nibble chunk `h` and, for `HIGH` bits above the nibble, its planes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn chunk<const HIGH: usize>(
    sub: *const u8,
    h: usize,
    planes: [__m512i; 2],
) -> (__m512i, __m512i) {
    let nibble = _mm512_set1_epi8(0x0F);
    // SAFETY: the caller keeps the sub-block's 256 nibble bytes in bounds.
    let c = unsafe { _mm512_loadu_si512(sub.add(64 * h) as *const __m512i) };
    let lo = _mm512_and_si512(c, nibble);
    let hi = _mm512_and_si512(_mm512_srli_epi32::<4>(c), nibble);
    match HIGH {
        // Bits 2h and 2h + 1 of each byte are the fifth bits of `lo` and `hi`.
        1 => {
            let p = _mm512_srl_epi32(planes[0], _mm_cvtsi32_si128(2 * h as i32));
            let five = _mm512_set1_epi8(0x10);
            (
                _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi32::<4>(p), five)),
                _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi32::<3>(p), five)),
            )
        }
        // Plane h / 2, bits 4(h % 2) .. +2 for `lo` and the next two for `hi`.
        2 => {
            let p = _mm512_srl_epi32(planes[h / 2], _mm_cvtsi32_si128(4 * (h % 2) as i32));
            let top = _mm512_set1_epi8(0x30);
            (
                _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi32::<4>(p), top)),
                _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi32::<2>(p), top)),
            )
        }
        _ => (lo, hi),
    }
}

/// The bit planes of a sub-block (as many as the kind has; the rest zero).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn planes<const HIGH: usize>(sub: *const u8) -> [__m512i; 2] {
    let base = PANEL * QK / 2;
    // SAFETY: the caller keeps the sub-block (with its planes) in bounds.
    unsafe {
        match HIGH {
            1 => [
                _mm512_loadu_si512(sub.add(base) as *const __m512i),
                _mm512_setzero_si512(),
            ],
            2 => [
                _mm512_loadu_si512(sub.add(base) as *const __m512i),
                _mm512_loadu_si512(sub.add(base + 64) as *const __m512i),
            ],
            _ => [_mm512_setzero_si512(); 2],
        }
    }
}

/// Weight rows `0..n_rows` of the consecutive panels `w` times `RA` activation rows, for
/// the legacy kinds (blocks of 32): row `r` . `a[j]` is written to `out[j * stride + r]`,
/// bitwise equal to [`super::panel_reference`]'s lane `r % 16` of panel `r / 16`. Looping
/// over the panels here, not in the caller, pays the call's set-up once per run of panels.
///
/// # Safety
/// The CPU must have AVX-512 F/VL/VNNI, AVX2, FMA and F16C; `KIND` must be [`kind_id`] of
/// the layout's kind; `out[j * stride + r]` must be valid for writes, and written by no
/// one else meanwhile, for every `j < RA` and `r < n_rows`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn panels<const KIND: u8, const RA: usize>(
    layout: &Layout,
    w: &[u8],
    n_rows: usize,
    a: [&[u8]; RA],
    out: *mut f32,
    stride: usize,
) {
    assert_eq!(kind_id(layout.kind), KIND);
    assert!(!layout.kind.is_k());
    let n_panels = n_rows.div_ceil(PANEL);
    assert!(w.len() >= n_panels * layout.panel_bytes());
    assert!(a.iter().all(|a| a.len() >= layout.a_row_bytes()));
    let mins = KIND == Q41 || KIND == Q51;
    let five = KIND == Q50 || KIND == Q51;
    let (bb, d_at, m_at) = const {
        let kind = kind_of(KIND);
        (kind.block_bytes(), kind.d_at(), kind.m_at())
    };
    let (a_d, a_corr, a_sums) = (layout.a_d(), layout.a_corr(), layout.a_sums());
    let ap = a.map(|a| a.as_ptr());
    let far = RA < FAR_PREFETCH_ROWS;
    for p in 0..n_panels {
        // SAFETY: panel `p` is in bounds by the assertion above.
        let wp = unsafe { w.as_ptr().add(p * layout.panel_bytes()) };
        let mut acc = [_mm512_setzero_ps(); RA];
        let mut msum = [_mm512_setzero_ps(); RA];
        for b in 0..layout.n_blocks {
            // SAFETY (every read below): block `b` of the panel and of each activation row
            // is in bounds by the length assertions above.
            let blk = unsafe { wp.add(b * bb) };
            prefetch_ahead(blk, bb, far);
            // Two independent integer sums per row (exact, so splitting cannot change the
            // result) keep the dependency chains short.
            let mut even = [_mm512_setzero_si512(); RA];
            let mut odd = [_mm512_setzero_si512(); RA];
            if !mins {
                for j in 0..RA {
                    even[j] = unsafe { bcast4(ap[j], a_corr + 4 * b) };
                }
            }
            if KIND == Q8 {
                for g in 0..QK / 4 {
                    let wv = unsafe { _mm512_loadu_si512(blk.add(64 * g) as *const __m512i) };
                    for j in 0..RA {
                        let x = unsafe { bcast4(ap[j], QK * b + 4 * g) };
                        if g % 2 == 0 {
                            even[j] = _mm512_dpbusd_epi32(even[j], wv, x);
                        } else {
                            odd[j] = _mm512_dpbusd_epi32(odd[j], wv, x);
                        }
                    }
                }
            } else {
                let pl = if five {
                    unsafe { planes::<1>(blk) }
                } else {
                    [_mm512_setzero_si512(); 2]
                };
                for h in 0..QK / 8 {
                    let (lo, hi) = if five {
                        unsafe { chunk::<1>(blk, h, pl) }
                    } else {
                        unsafe { chunk::<0>(blk, h, pl) }
                    };
                    for j in 0..RA {
                        let (x0, x1) = unsafe {
                            (
                                bcast4(ap[j], QK * b + 8 * h),
                                bcast4(ap[j], QK * b + 8 * h + 4),
                            )
                        };
                        even[j] = _mm512_dpbusd_epi32(even[j], lo, x0);
                        odd[j] = _mm512_dpbusd_epi32(odd[j], hi, x1);
                    }
                }
            }
            let d = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(blk.add(d_at) as *const __m256i) });
            let m = if mins {
                _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(blk.add(m_at) as *const __m256i) })
            } else {
                _mm512_setzero_ps()
            };
            for j in 0..RA {
                let dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even[j], odd[j]));
                let ad = unsafe { (ap[j].add(a_d + 4 * b) as *const f32).read_unaligned() };
                acc[j] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(ad)), acc[j]);
                if mins {
                    let s = unsafe { (ap[j].add(a_sums + 4 * b) as *const f32).read_unaligned() };
                    msum[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(s), msum[j]);
                }
            }
        }
        for j in 0..RA {
            // SAFETY: rows `16p..` of output row `j`, the caller's contract.
            unsafe {
                store_rows(
                    out.add(j * stride),
                    p,
                    n_rows,
                    _mm512_add_ps(acc[j], msum[j]),
                )
            };
        }
    }
}

/// How far ahead of the bytes being multiplied the kernels ask for weights in L1: a stream of
/// weights read from memory (a decode step, one row or a batch) is otherwise read faster than
/// the hardware prefetcher brings it in. With one activation row this took the legacy kinds'
/// product on matrices read from memory from 20-21 to 24-28 GiB/s (Q4_1) and 20-23 to 21-29
/// (Q5_0); with 16 rows (a batched decode step) from 6.6 to 8.9 GiB/s (Q5_0), 7.7 to 9.5
/// (Q4_0), 10.1 to 11.8 (Q8_0), Q4_1 unchanged, while cache-resident panels keep their speed.
/// The hints must cover a block whose size is a compile-time constant (see [`kind_of`]): with
/// the size read at run time, the eight-row legacy kernels ran at a third of their speed.
const PREFETCH: usize = 4096;

/// How far ahead a stream of few activation rows also asks for weights in L2. With one row the
/// kernel is bound by memory, and this took Qwen2.5-1.5B's decode from 16.9-18.9 to 20.3-20.9
/// tokens/s (three alternating pairs, 2 threads): about the host's streaming bandwidth. With
/// many rows the kernel is bound by compute and the extra hints cost more than they bring
/// (pp512 6-10% lower), so it is not asked for there.
const PREFETCH_L2: usize = 4 * PREFETCH;

/// Fewer activation rows than this per call make a stream that [`PREFETCH_L2`] serves.
const FAR_PREFETCH_ROWS: usize = 4;

/// Prefetches the cache lines of `len` bytes at [`PREFETCH`] bytes past `at`, and if `far`
/// at [`PREFETCH_L2`] into L2 (hints: an address past the matrix is harmless, and it is never
/// dereferenced).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn prefetch_ahead(at: *const u8, len: usize, far: bool) {
    let mut off = 0;
    while off < len {
        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH + off) as *const i8);
        if far {
            _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(PREFETCH_L2 + off) as *const i8);
        }
        off += 64;
    }
}

/// Stores the rows of panel `p` that exist (the last panel of a matrix may hold fewer).
///
/// # Safety
/// `out[16p .. min(16p + 16, n_rows)]` must be valid for writes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn store_rows(out: *mut f32, p: usize, n_rows: usize, v: __m512) {
    let valid = (n_rows - p * PANEL).min(PANEL);
    let mask = ((1u32 << valid) - 1) as __mmask16;
    // SAFETY: the caller's contract.
    unsafe { _mm512_mask_storeu_ps(out.add(p * PANEL), mask, v) };
}

/// 32 bytes at `at` (two per lane) widened to 32 i16, lane `r`'s pair in its 32-bit lane (AVX2
/// widening of each half: AVX-512 BW is not required).
///
/// # Safety
/// 32 bytes at `at` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn lane_pairs(at: *const u8) -> __m512i {
    // SAFETY: the caller's contract.
    let (lo, hi) = unsafe {
        (
            _mm_loadu_si128(at as *const __m128i),
            _mm_loadu_si128(at.add(16) as *const __m128i),
        )
    };
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_cvtepu8_epi16(lo)),
        _mm256_cvtepu8_epi16(hi),
    )
}

/// The values `16c + 4t + j` of every lane of a sub-block of crumbs (Q2_K, Q3_K) from its
/// chunk `c` (`chunk`) and, for Q3_K, its plane of third bits (bit `4c + t` of each byte).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn crumbs<const KIND: u8>(chunk: __m512i, plane: __m512i, c: usize, t: usize) -> __m512i {
    let low = _mm512_and_si512(
        _mm512_srl_epi32(chunk, _mm_cvtsi32_si128(2 * t as i32)),
        _mm512_set1_epi8(0x03),
    );
    if KIND != Q3K {
        return low;
    }
    // The bit to bit 0 of its byte, then to bit 2: shifts within 32-bit lanes carry other
    // bytes' bits across, and the mask drops them.
    let third = _mm512_slli_epi32::<2>(_mm512_srl_epi32(
        plane,
        _mm_cvtsi32_si128((4 * c + t) as i32),
    ));
    _mm512_or_si512(low, _mm512_and_si512(third, _mm512_set1_epi8(0x04)))
}

/// [`panels`] for the K-quants (blocks of 256 in eight sub-blocks): each sub-block's exact
/// integer sum is multiplied by its integer scale into one i32 per row and block (Q2_K, Q3_K,
/// Q6_K: each half's, with its own scale and, where the kind stores an offset, its offset
/// correction), the mins times the activation's sums into another (`vpdpwssd` over pairs of
/// mins), and each is converted once per block.
///
/// # Safety
/// As for [`panels`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn panels_k<const KIND: u8, const RA: usize>(
    layout: &Layout,
    w: &[u8],
    n_rows: usize,
    a: [&[u8]; RA],
    out: *mut f32,
    stride: usize,
) {
    assert_eq!(kind_id(layout.kind), KIND);
    assert!(layout.kind.is_k());
    let n_panels = n_rows.div_ceil(PANEL);
    assert!(w.len() >= n_panels * layout.panel_bytes());
    assert!(a.iter().all(|a| a.len() >= layout.a_row_bytes()));
    // Kinds with a scale per 16 values, those with a stored offset, those of two-bit chunks.
    let halves = KIND == Q2K || KIND == Q3K || KIND == Q6K;
    let offset = KIND == Q3K || KIND == Q6K;
    let two_bit = KIND == Q2K || KIND == Q3K;
    let (bb, sub_bytes, sc_at, mins_at, d_at, m_at) = const {
        let kind = kind_of(KIND);
        (
            kind.block_bytes(),
            kind.sub_bytes(),
            kind.sc_at(),
            kind.mins_at(),
            kind.d_at(),
            kind.m_at(),
        )
    };
    let (a_d, a_corr, a_sums) = (layout.a_d(), layout.a_corr(), layout.a_sums());
    let (corr_bytes, sums_bytes) = (layout.corr_bytes(), layout.sums_bytes());
    let ap = a.map(|a| a.as_ptr());
    let far = RA < FAR_PREFETCH_ROWS;
    for p in 0..n_panels {
        // SAFETY: panel `p` is in bounds by the assertion above.
        let wp = unsafe { w.as_ptr().add(p * layout.panel_bytes()) };
        let mut acc = [_mm512_setzero_ps(); RA];
        let mut mins = [_mm512_setzero_ps(); RA];
        for b in 0..layout.n_blocks {
            // SAFETY (every read below): block `b` of the panel and of each activation row
            // is in bounds by the length assertions above.
            let blk = unsafe { wp.add(b * bb) };
            let mut total = [_mm512_setzero_si512(); RA];
            let mut msum = [_mm512_setzero_si512(); RA];
            for s in 0..SUBS {
                let sub = unsafe { blk.add(s * sub_bytes) };
                prefetch_ahead(sub, sub_bytes, far);
                // With a scale per 16 values: the sums of values 0..16 and 16..32, from their
                // offset corrections where the kind has them; else two chains of one sum.
                let mut g = [[_mm512_setzero_si512(); RA]; 2];
                if offset {
                    for j in 0..RA {
                        let at = a_corr + corr_bytes * b + 8 * s;
                        g[0][j] = unsafe { bcast4(ap[j], at) };
                        g[1][j] = unsafe { bcast4(ap[j], at + 4) };
                    }
                }
                if two_bit {
                    let plane = if KIND == Q3K {
                        unsafe { _mm512_loadu_si512(sub.add(2 * 64) as *const __m512i) }
                    } else {
                        _mm512_setzero_si512()
                    };
                    for (c, half) in g.iter_mut().enumerate() {
                        let chunk =
                            unsafe { _mm512_loadu_si512(sub.add(64 * c) as *const __m512i) };
                        for t in 0..4 {
                            let v = crumbs::<KIND>(chunk, plane, c, t);
                            for j in 0..RA {
                                let at = QK_K * b + QK * s + 16 * c + 4 * t;
                                half[j] =
                                    _mm512_dpbusd_epi32(half[j], v, unsafe { bcast4(ap[j], at) });
                            }
                        }
                    }
                } else {
                    let pl = match KIND {
                        Q5K => unsafe { planes::<1>(sub) },
                        Q6K => unsafe { planes::<2>(sub) },
                        _ => [_mm512_setzero_si512(); 2],
                    };
                    for h in 0..QK / 8 {
                        let (lo, hi) = match KIND {
                            Q5K => unsafe { chunk::<1>(sub, h, pl) },
                            Q6K => unsafe { chunk::<2>(sub, h, pl) },
                            _ => unsafe { chunk::<0>(sub, h, pl) },
                        };
                        for j in 0..RA {
                            let at = QK_K * b + QK * s + 8 * h;
                            let (x0, x1) = unsafe { (bcast4(ap[j], at), bcast4(ap[j], at + 4)) };
                            if halves {
                                let i = h / 2;
                                g[i][j] = _mm512_dpbusd_epi32(g[i][j], lo, x0);
                                g[i][j] = _mm512_dpbusd_epi32(g[i][j], hi, x1);
                            } else {
                                g[0][j] = _mm512_dpbusd_epi32(g[0][j], lo, x0);
                                g[1][j] = _mm512_dpbusd_epi32(g[1][j], hi, x1);
                            }
                        }
                    }
                }
                if KIND == Q2K {
                    // Lane `r`'s two bytes (scale | min << 4) of this sub-block's halves.
                    let pair = unsafe { lane_pairs(blk.add(mins_at + 32 * s)) };
                    let nibble = _mm512_set1_epi32(0x0F);
                    let s0 = _mm512_and_si512(pair, nibble);
                    let s1 = _mm512_and_si512(_mm512_srli_epi32::<16>(pair), nibble);
                    let m = _mm512_and_si512(
                        _mm512_srli_epi32::<4>(pair),
                        _mm512_set1_epi32(0x000F_000F),
                    );
                    for j in 0..RA {
                        let both = _mm512_add_epi32(
                            _mm512_mullo_epi32(s0, g[0][j]),
                            _mm512_mullo_epi32(s1, g[1][j]),
                        );
                        total[j] = _mm512_add_epi32(total[j], both);
                        let sums = unsafe { bcast4(ap[j], a_sums + sums_bytes * b + 4 * s) };
                        msum[j] = _mm512_dpwssd_epi32(msum[j], m, sums);
                    }
                } else if halves {
                    let sc = |i: usize| {
                        let v = unsafe {
                            _mm_loadu_si128(blk.add(sc_at + PANEL * i) as *const __m128i)
                        };
                        _mm512_cvtepi8_epi32(v)
                    };
                    let (s0, s1) = (sc(2 * s), sc(2 * s + 1));
                    for j in 0..RA {
                        let both = _mm512_add_epi32(
                            _mm512_mullo_epi32(s0, g[0][j]),
                            _mm512_mullo_epi32(s1, g[1][j]),
                        );
                        total[j] = _mm512_add_epi32(total[j], both);
                    }
                } else {
                    let s0 = _mm512_cvtepu8_epi32(unsafe {
                        _mm_loadu_si128(blk.add(sc_at + PANEL * s) as *const __m128i)
                    });
                    for j in 0..RA {
                        let sum = _mm512_add_epi32(g[0][j], g[1][j]);
                        total[j] = _mm512_add_epi32(total[j], _mm512_mullo_epi32(s0, sum));
                    }
                }
            }
            prefetch_ahead(
                blk.wrapping_add(SUBS * sub_bytes),
                bb - SUBS * sub_bytes,
                far,
            );
            let d = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(blk.add(d_at) as *const __m256i) });
            let ad = ap.map(|a| unsafe {
                _mm512_set1_ps((a.add(a_d + 4 * b) as *const f32).read_unaligned())
            });
            for j in 0..RA {
                let dd = _mm512_mul_ps(d, ad[j]);
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[j]), dd, acc[j]);
            }
            if KIND == Q4K || KIND == Q5K {
                for k in 0..SUBS / 2 {
                    // Lane `r`'s pair of mins.
                    let mp = unsafe { lane_pairs(blk.add(mins_at + 32 * k)) };
                    for j in 0..RA {
                        let s = unsafe { bcast4(ap[j], a_sums + sums_bytes * b + 4 * k) };
                        msum[j] = _mm512_dpwssd_epi32(msum[j], mp, s);
                    }
                }
            }
            if KIND == Q2K || KIND == Q4K || KIND == Q5K {
                let dmin =
                    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(blk.add(m_at) as *const __m256i) });
                for j in 0..RA {
                    let md = _mm512_mul_ps(dmin, ad[j]);
                    mins[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum[j]), md, mins[j]);
                }
            }
        }
        for j in 0..RA {
            // SAFETY: rows `16p..` of output row `j`, the caller's contract.
            unsafe {
                store_rows(
                    out.add(j * stride),
                    p,
                    n_rows,
                    _mm512_sub_ps(acc[j], mins[j]),
                )
            };
        }
    }
}
