//! The panel kernels with AVX2: [`super::vnni`]'s arithmetic on 256-bit registers, a panel's
//! 16 lanes as two halves of 8. Every lane computes what the reference computes for its row,
//! in the same order (exact integer sums, converted once per block, one fused multiply-add
//! into the row's running sum), so the results are bitwise [`super::panel_reference`]'s, and
//! so the AVX-512 kernels' (which equal the same reference): the instruction set never changes
//! a token.
//!
//! `vpdpbusd` (four u8 x i8 products summed into an i32 lane) becomes `vpmaddubsw` (two
//! products summed into an i16 lane, saturating) and `vpmaddwd` (two i16 summed into an i32).
//! The stored values of every kind but Q8_0 keep a pair of products within an i16 (at most
//! 63 x 128 x 2), and several pairs as far as [`i16_terms`] says, so the kernels add
//! `vpmaddubsw` results in i16 lanes and widen them once per group of values: half the
//! multiplications of widening each. Q8_0's stored bytes (up to 255) are multiplied as two
//! nibbles, the high one's sum times 16. Every sum stays an exact integer.

use std::arch::x86_64::*;

use gguf::quant::{QK, QK_K};

use super::vnni::{kind_id, Q2K, Q3K, Q41, Q4K, Q50, Q51, Q5K, Q6K, Q8};
use super::{put_k_act_scales, quantize_k_act_block, Layout, PackKind, PANEL, SUBS};

/// Lanes (weight rows) of one 256-bit half of a panel.
const HALF: usize = PANEL / 2;

/// The kind of a kernel's `KIND`, so that its block size and offsets are compile-time constants.
const fn kind_of(id: u8) -> PackKind {
    match id {
        super::vnni::Q40 => PackKind::Q4_0,
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

/// Four activation values (bytes `at..at + 4` of a row) in every lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bcast4(a: *const u8, at: usize) -> __m256i {
    // SAFETY: the caller keeps `at + 4` within the row.
    _mm256_set1_epi32(unsafe { (a.add(at) as *const i32).read_unaligned() })
}

/// `acc` plus, per 32-bit lane, `a`'s two i16 times `b`'s two i16: `vpdpwssd` (no lane here
/// can overflow: unsigned mins times activation sums).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dpwssd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
}

/// 32 bytes at `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load(at: *const u8) -> __m256i {
    // SAFETY: the caller's contract.
    unsafe { _mm256_loadu_si256(at as *const __m256i) }
}

/// Eight f16 at `at` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x8(at: *const u8) -> __m256 {
    // SAFETY: the caller keeps 16 bytes at `at` in bounds.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(at as *const __m128i) })
}

/// The values `8h + j` (`lo`) and `8h + 4 + j` (`hi`) of this half's lanes of a sub-block,
/// from its nibble chunk `h` and, for `HIGH` bits above the nibble, its planes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunk<const HIGH: usize>(
    sub: *const u8,
    h: usize,
    half: usize,
    planes: [__m256i; 2],
) -> (__m256i, __m256i) {
    let nibble = _mm256_set1_epi8(0x0F);
    // SAFETY: the caller keeps the sub-block's nibble bytes in bounds.
    let c = unsafe { load(sub.add(64 * h + 32 * half)) };
    let lo = _mm256_and_si256(c, nibble);
    let hi = _mm256_and_si256(_mm256_srli_epi32::<4>(c), nibble);
    match HIGH {
        // Bits 2h and 2h + 1 of each byte are the fifth bits of `lo` and `hi`.
        1 => {
            let p = _mm256_srl_epi32(planes[0], _mm_cvtsi32_si128(2 * h as i32));
            let five = _mm256_set1_epi8(0x10);
            (
                _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi32::<4>(p), five)),
                _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi32::<3>(p), five)),
            )
        }
        // Plane h / 2, bits 4(h % 2) .. +2 for `lo` and the next two for `hi`.
        2 => {
            let p = _mm256_srl_epi32(planes[h / 2], _mm_cvtsi32_si128(4 * (h % 2) as i32));
            let top = _mm256_set1_epi8(0x30);
            (
                _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi32::<4>(p), top)),
                _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi32::<2>(p), top)),
            )
        }
        _ => (lo, hi),
    }
}

/// This half's bit planes of a sub-block (as many as the kind has; the rest zero).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn planes<const HIGH: usize>(sub: *const u8, half: usize) -> [__m256i; 2] {
    let base = PANEL * QK / 2 + 32 * half;
    // SAFETY: the caller keeps the sub-block (with its planes) in bounds.
    unsafe {
        match HIGH {
            1 => [load(sub.add(base)), _mm256_setzero_si256()],
            2 => [load(sub.add(base)), load(sub.add(base + 64))],
            _ => [_mm256_setzero_si256(); 2],
        }
    }
}

/// The values `16c + 4t + j` of this half's lanes of a sub-block of crumbs (Q2_K, Q3_K) from
/// its chunk `c` and, for Q3_K, its plane of third bits (bit `4c + t` of each byte).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn crumbs<const KIND: u8>(chunk: __m256i, plane: __m256i, c: usize, t: usize) -> __m256i {
    let low = _mm256_and_si256(
        _mm256_srl_epi32(chunk, _mm_cvtsi32_si128(2 * t as i32)),
        _mm256_set1_epi8(0x03),
    );
    if KIND != Q3K {
        return low;
    }
    let third = _mm256_slli_epi32::<2>(_mm256_srl_epi32(
        plane,
        _mm_cvtsi32_si128((4 * c + t) as i32),
    ));
    _mm256_or_si256(low, _mm256_and_si256(third, _mm256_set1_epi8(0x04)))
}

/// 16 bytes at `at` (two per lane of this half) widened to 16 i16, lane `r`'s pair in its
/// 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_pairs(at: *const u8) -> __m256i {
    // SAFETY: the caller keeps 16 bytes at `at` in bounds.
    _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(at as *const __m128i) })
}

/// Eight bytes at `at` (one per lane of this half), widened: signed or unsigned.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_bytes<const SIGNED: bool>(at: *const u8) -> __m256i {
    // SAFETY: the caller keeps 8 bytes at `at` in bounds.
    let v = unsafe { _mm_loadl_epi64(at as *const __m128i) };
    if SIGNED {
        _mm256_cvtepi8_epi32(v)
    } else {
        _mm256_cvtepu8_epi32(v)
    }
}

/// Stores the lanes of half `half` of panel `p` whose rows exist.
///
/// # Safety
/// `out[16p + 8 half ..]` must be valid for writes up to row `n_rows`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_rows(out: *mut f32, p: usize, half: usize, n_rows: usize, v: __m256) {
    let r0 = p * PANEL + half * HALF;
    if r0 >= n_rows {
        return;
    }
    let valid = (n_rows - r0).min(HALF);
    // SAFETY (both stores): rows `r0 .. r0 + valid`, the caller's contract.
    if valid == HALF {
        unsafe { _mm256_storeu_ps(out.add(r0), v) };
    } else {
        // Lanes below `valid` only (a partial last panel).
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid as i32), lanes);
        unsafe { _mm256_maskstore_ps(out.add(r0), mask, v) };
    }
}

/// How far ahead of the bytes being multiplied the kernels ask for weights in L1 (a stream of
/// weights read from memory outruns the hardware prefetcher otherwise).
const PREFETCH: usize = 4096;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch_ahead(at: *const u8, len: usize) {
    let mut off = 0;
    while off < len {
        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH + off) as *const i8);
        off += 64;
    }
}

/// The largest value a kernel multiplies as one unsigned byte for `kind`: its stored values,
/// but for Q8_0, whose bytes go through as two nibbles.
const fn lane_max(kind: PackKind) -> i32 {
    match kind {
        PackKind::Q8_0 => 15,
        _ => (1 << (kind.low_bits() + kind.high_bits())) - 1,
    }
}

/// How many `vpmaddubsw` results an i16 lane can add up exactly when the unsigned bytes are at
/// most `max` (activations are i8, at least -128 in magnitude): each result is two products,
/// so at most `2 · max · 128`.
const fn i16_terms(max: i32) -> usize {
    (i16::MAX as i32 / (2 * max * 128)) as usize
}

/// Per 16-bit lane, `lo`'s pair of products with `x0` plus `hi`'s with `x1` (two
/// `vpmaddubsw` results, which every kind's bytes keep within an i16 twice over).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair_sums(lo: __m256i, x0: __m256i, hi: __m256i, x1: __m256i) -> __m256i {
    _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1))
}

/// The two i16 of each 32-bit lane summed into an i32 (`vpmaddwd` by ones).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen(v: __m256i) -> __m256i {
    _mm256_madd_epi16(v, _mm256_set1_epi16(1))
}

/// Each 32-bit lane's non-negative value below 2^15 in both of its i16 halves, so that
/// `vpmaddwd` by it multiplies a lane's two i16 sums by it and adds them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn i16_pairs(v: __m256i) -> __m256i {
    _mm256_or_si256(v, _mm256_slli_epi32::<16>(v))
}

/// Weight rows `0..n_rows` of the consecutive panels `w` times `RA` activation rows, for the
/// legacy kinds (blocks of 32): row `r` . `a[j]` is written to `out[j * stride + r]`, bitwise
/// equal to [`super::panel_reference`]'s lane `r % 16` of panel `r / 16`.
///
/// The products of a block are summed in i16 lanes (`vpmaddubsw` results added while they
/// cannot overflow, see [`i16_terms`]) and widened to i32 once a block, which halves the
/// multiplications of summing every result into i32 at once; the block's integer sum is the
/// same exact integer either way.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `KIND` must be [`kind_id`] of the layout's kind;
/// `out[j * stride + r]` must be valid for writes, and written by no one else meanwhile, for
/// every `j < RA` and `r < n_rows`.
#[target_feature(enable = "avx2,fma,f16c")]
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
        // Q8_0: the eight groups of four values, low and high nibbles apart; Q5_0 and Q5_1:
        // two chunks (of two results each) per i16 sum; Q4_0 and Q4_1: all four.
        let terms = match kind {
            PackKind::Q8_0 => QK / 4,
            PackKind::Q5_0 | PackKind::Q5_1 => 4,
            _ => 8,
        };
        assert!(terms <= i16_terms(lane_max(kind)));
        (kind.block_bytes(), kind.d_at(), kind.m_at())
    };
    let (a_d, a_corr, a_sums) = (layout.a_d(), layout.a_corr(), layout.a_sums());
    let ap = a.map(|a| a.as_ptr());
    let nibble = _mm256_set1_epi8(0x0F);
    for p in 0..n_panels {
        // SAFETY: panel `p` is in bounds by the assertion above.
        let wp = unsafe { w.as_ptr().add(p * layout.panel_bytes()) };
        // Both halves of a block while its bytes are in L1 (a half takes 32 bytes of each
        // 64-byte chunk), so the panel streams from memory once.
        let mut acc_of = [[_mm256_setzero_ps(); RA]; 2];
        let mut msum_of = [[_mm256_setzero_ps(); RA]; 2];
        for b in 0..layout.n_blocks {
            for half in 0..2 {
                let acc = &mut acc_of[half];
                let msum = &mut msum_of[half];
                // SAFETY (every read below): block `b` of the panel and of each activation
                // row is in bounds by the length assertions above.
                let blk = unsafe { wp.add(b * bb) };
                if half == 0 {
                    prefetch_ahead(blk, bb);
                }
                // Per activation row, the block's i16 sums: Q8_0's low nibbles and high
                // nibbles; Q5_0 and Q5_1's first and second halves; the others' all in [0].
                let mut s16 = [[_mm256_setzero_si256(); RA]; 2];
                if KIND == Q8 {
                    for g in 0..QK / 4 {
                        let wv = unsafe { load(blk.add(64 * g + 32 * half)) };
                        let lo = _mm256_and_si256(wv, nibble);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(wv), nibble);
                        for j in 0..RA {
                            let x = unsafe { bcast4(ap[j], QK * b + 4 * g) };
                            s16[0][j] = _mm256_add_epi16(s16[0][j], _mm256_maddubs_epi16(lo, x));
                            s16[1][j] = _mm256_add_epi16(s16[1][j], _mm256_maddubs_epi16(hi, x));
                        }
                    }
                } else {
                    let pl = if five {
                        unsafe { planes::<1>(blk, half) }
                    } else {
                        [_mm256_setzero_si256(); 2]
                    };
                    for h in 0..QK / 8 {
                        let (lo, hi) = if five {
                            unsafe { chunk::<1>(blk, h, half, pl) }
                        } else {
                            unsafe { chunk::<0>(blk, h, half, pl) }
                        };
                        let i = if five { h / 2 } else { 0 };
                        for j in 0..RA {
                            let (x0, x1) = unsafe {
                                (
                                    bcast4(ap[j], QK * b + 8 * h),
                                    bcast4(ap[j], QK * b + 8 * h + 4),
                                )
                            };
                            s16[i][j] = _mm256_add_epi16(s16[i][j], pair_sums(lo, x0, hi, x1));
                        }
                    }
                }
                let d = unsafe { f16x8(blk.add(d_at + 2 * HALF * half)) };
                let m = if mins {
                    unsafe { f16x8(blk.add(m_at + 2 * HALF * half)) }
                } else {
                    _mm256_setzero_ps()
                };
                for j in 0..RA {
                    let mut dot = widen(s16[0][j]);
                    if KIND == Q8 {
                        // The high nibbles' sum, times 16.
                        let hi = _mm256_madd_epi16(s16[1][j], _mm256_set1_epi16(16));
                        dot = _mm256_add_epi32(dot, hi);
                    } else if five {
                        dot = _mm256_add_epi32(dot, widen(s16[1][j]));
                    }
                    if !mins {
                        dot = _mm256_add_epi32(dot, unsafe { bcast4(ap[j], a_corr + 4 * b) });
                    }
                    let ad = unsafe { (ap[j].add(a_d + 4 * b) as *const f32).read_unaligned() };
                    let dot = _mm256_cvtepi32_ps(dot);
                    acc[j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(ad)), acc[j]);
                    if mins {
                        let s =
                            unsafe { (ap[j].add(a_sums + 4 * b) as *const f32).read_unaligned() };
                        msum[j] = _mm256_fmadd_ps(m, _mm256_set1_ps(s), msum[j]);
                    }
                }
            }
        }
        for half in 0..2 {
            for j in 0..RA {
                // SAFETY: rows `16p + 8 half ..` of output row `j`, the caller's contract.
                unsafe {
                    store_rows(
                        out.add(j * stride),
                        p,
                        half,
                        n_rows,
                        _mm256_add_ps(acc_of[half][j], msum_of[half][j]),
                    )
                };
            }
        }
    }
}

/// [`panels`] for the K-quants (blocks of 256 in eight sub-blocks), with [`super::vnni`]'s
/// `panels_k` arithmetic: each sub-block's exact integer sum times its integer scale into one
/// i32 per row and block, the mins times the activation's sums into another, each converted
/// once per block. Products are summed in i16 lanes as far as [`i16_terms`] allows, as in
/// [`panels`]: Q4_K and Q5_K's (unsigned scales) are multiplied by their scale as they widen.
///
/// # Safety
/// As for [`panels`].
#[target_feature(enable = "avx2,fma,f16c")]
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
    let offset = KIND == Q3K || KIND == Q6K;
    let two_bit = KIND == Q2K || KIND == Q3K;
    let (bb, sub_bytes, sc_at, mins_at, d_at, m_at) = const {
        let kind = kind_of(KIND);
        // Q2_K, Q3_K: a group of 16 values (four results) per i16 sum; Q6_K: one chunk (two
        // results); Q4_K, Q5_K: two chunks (four).
        let terms = match kind {
            PackKind::Q6K => 2,
            _ => 4,
        };
        assert!(terms <= i16_terms(lane_max(kind)));
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
    for p in 0..n_panels {
        // SAFETY: panel `p` is in bounds by the assertion above.
        let wp = unsafe { w.as_ptr().add(p * layout.panel_bytes()) };
        // Both halves of a block while its bytes are in L1 (a half takes 32 bytes of each
        // 64-byte chunk), so the panel streams from memory once.
        let mut acc_of = [[_mm256_setzero_ps(); RA]; 2];
        let mut mins_of = [[_mm256_setzero_ps(); RA]; 2];
        for b in 0..layout.n_blocks {
            for half in 0..2 {
                let acc = &mut acc_of[half];
                let mins = &mut mins_of[half];
                // SAFETY (every read below): block `b` of the panel and of each activation
                // row is in bounds by the length assertions above.
                let blk = unsafe { wp.add(b * bb) };
                if half == 0 {
                    // The scales here, each sub-block's quants as it comes: a block's
                    // dozens of lines asked for at once outrun the CPU's fill buffers.
                    prefetch_ahead(blk.wrapping_add(SUBS * sub_bytes), bb - SUBS * sub_bytes);
                }
                let mut total = [_mm256_setzero_si256(); RA];
                let mut msum = [_mm256_setzero_si256(); RA];
                for s in 0..SUBS {
                    let sub = unsafe { blk.add(s * sub_bytes) };
                    if half == 0 {
                        prefetch_ahead(sub, sub_bytes);
                    }
                    // The sub-block's two halves (of 16 values, or for Q4_K and Q5_K two
                    // chunks each) summed in i16 lanes; Q6_K's in i32 (`g`) chunk by chunk.
                    let mut s16 = [[_mm256_setzero_si256(); RA]; 2];
                    let mut g = [[_mm256_setzero_si256(); RA]; 2];
                    if offset {
                        for j in 0..RA {
                            let at = a_corr + corr_bytes * b + 8 * s;
                            g[0][j] = unsafe { bcast4(ap[j], at) };
                            g[1][j] = unsafe { bcast4(ap[j], at + 4) };
                        }
                    }
                    if two_bit {
                        let plane = if KIND == Q3K {
                            unsafe { load(sub.add(2 * 64 + 32 * half)) }
                        } else {
                            _mm256_setzero_si256()
                        };
                        for (c, part) in s16.iter_mut().enumerate() {
                            let chunk = unsafe { load(sub.add(64 * c + 32 * half)) };
                            for t in 0..4 {
                                let v = crumbs::<KIND>(chunk, plane, c, t);
                                for j in 0..RA {
                                    let at = QK_K * b + QK * s + 16 * c + 4 * t;
                                    let x = unsafe { bcast4(ap[j], at) };
                                    part[j] = _mm256_add_epi16(part[j], _mm256_maddubs_epi16(v, x));
                                }
                            }
                        }
                    } else {
                        let pl = match KIND {
                            Q5K => unsafe { planes::<1>(sub, half) },
                            Q6K => unsafe { planes::<2>(sub, half) },
                            _ => [_mm256_setzero_si256(); 2],
                        };
                        for h in 0..QK / 8 {
                            let (lo, hi) = match KIND {
                                Q5K => unsafe { chunk::<1>(sub, h, half, pl) },
                                Q6K => unsafe { chunk::<2>(sub, h, half, pl) },
                                _ => unsafe { chunk::<0>(sub, h, half, pl) },
                            };
                            let i = h / 2;
                            for j in 0..RA {
                                let at = QK_K * b + QK * s + 8 * h;
                                let (x0, x1) =
                                    unsafe { (bcast4(ap[j], at), bcast4(ap[j], at + 4)) };
                                let t = pair_sums(lo, x0, hi, x1);
                                if KIND == Q6K {
                                    g[i][j] = _mm256_add_epi32(g[i][j], widen(t));
                                } else {
                                    s16[i][j] = _mm256_add_epi16(s16[i][j], t);
                                }
                            }
                        }
                    }
                    if KIND == Q2K {
                        // Lane `r`'s two bytes (scale | min << 4) of this sub-block's halves.
                        let pair = unsafe { lane_pairs(blk.add(mins_at + 32 * s + 16 * half)) };
                        let nibble = _mm256_set1_epi32(0x0F);
                        let s0 = i16_pairs(_mm256_and_si256(pair, nibble));
                        let s1 = i16_pairs(_mm256_and_si256(_mm256_srli_epi32::<16>(pair), nibble));
                        let m = _mm256_and_si256(
                            _mm256_srli_epi32::<4>(pair),
                            _mm256_set1_epi32(0x000F_000F),
                        );
                        for j in 0..RA {
                            let both = _mm256_add_epi32(
                                _mm256_madd_epi16(s16[0][j], s0),
                                _mm256_madd_epi16(s16[1][j], s1),
                            );
                            total[j] = _mm256_add_epi32(total[j], both);
                            let sums = unsafe { bcast4(ap[j], a_sums + sums_bytes * b + 4 * s) };
                            msum[j] = dpwssd(msum[j], m, sums);
                        }
                    } else if offset {
                        // Q3_K and Q6_K: signed scales, each times its half's i32 sum (the
                        // activation's offset correction included).
                        let sc = |i: usize| unsafe {
                            lane_bytes::<true>(blk.add(sc_at + PANEL * i + HALF * half))
                        };
                        let (s0, s1) = (sc(2 * s), sc(2 * s + 1));
                        for j in 0..RA {
                            if KIND == Q3K {
                                g[0][j] = _mm256_add_epi32(g[0][j], widen(s16[0][j]));
                                g[1][j] = _mm256_add_epi32(g[1][j], widen(s16[1][j]));
                            }
                            let both = _mm256_add_epi32(
                                _mm256_mullo_epi32(s0, g[0][j]),
                                _mm256_mullo_epi32(s1, g[1][j]),
                            );
                            total[j] = _mm256_add_epi32(total[j], both);
                        }
                    } else {
                        let s0 = i16_pairs(unsafe {
                            lane_bytes::<false>(blk.add(sc_at + PANEL * s + HALF * half))
                        });
                        for j in 0..RA {
                            let both = _mm256_add_epi32(
                                _mm256_madd_epi16(s16[0][j], s0),
                                _mm256_madd_epi16(s16[1][j], s0),
                            );
                            total[j] = _mm256_add_epi32(total[j], both);
                        }
                    }
                }
                let d = unsafe { f16x8(blk.add(d_at + 2 * HALF * half)) };
                let ad = ap.map(|a| unsafe {
                    _mm256_set1_ps((a.add(a_d + 4 * b) as *const f32).read_unaligned())
                });
                for j in 0..RA {
                    let dd = _mm256_mul_ps(d, ad[j]);
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[j]), dd, acc[j]);
                }
                if KIND == Q4K || KIND == Q5K {
                    for k in 0..SUBS / 2 {
                        // Lane `r`'s pair of mins.
                        let mp = unsafe { lane_pairs(blk.add(mins_at + 32 * k + 16 * half)) };
                        for j in 0..RA {
                            let s = unsafe { bcast4(ap[j], a_sums + sums_bytes * b + 4 * k) };
                            msum[j] = dpwssd(msum[j], mp, s);
                        }
                    }
                }
                if KIND == Q2K || KIND == Q4K || KIND == Q5K {
                    let dmin = unsafe { f16x8(blk.add(m_at + 2 * HALF * half)) };
                    for j in 0..RA {
                        let md = _mm256_mul_ps(dmin, ad[j]);
                        mins[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum[j]), md, mins[j]);
                    }
                }
            }
        }
        for half in 0..2 {
            for j in 0..RA {
                // SAFETY: rows `16p + 8 half ..` of output row `j`, the caller's contract.
                unsafe {
                    store_rows(
                        out.add(j * stride),
                        p,
                        half,
                        n_rows,
                        _mm256_sub_ps(acc_of[half][j], mins_of[half][j]),
                    )
                };
            }
        }
    }
}

/// The horizontal sum of eight i32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// [`super::quantize_act_row`] for the K-quants (Q8_K blocks of 256), eight values per
/// instruction and bitwise equal to it: the first value of the largest magnitude is the
/// signed maximum (NaN skipped, as the reference's comparison skips it); values rounded half
/// away from zero as truncation plus a step where the (exact) remainder reaches one half, a
/// NaN to 0 as the reference's conversion gives. A block whose scale is not finite (its
/// largest magnitude below about 4e-37: no real activation) is the reference's own.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_k_act_row(layout: &Layout, x: &[f32], out: &mut [u8]) {
    assert!(layout.kind.is_k());
    assert_eq!(x.len(), layout.n_cols);
    assert!(out.len() >= layout.a_row_bytes());
    let sign = _mm256_set1_ps(-0.0);
    for (b, xb) in x.chunks_exact(QK_K).enumerate() {
        // SAFETY (loads): 32 chunks of eight floats make the block.
        let chunk =
            |c: usize| _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(xb.as_ptr().add(8 * c)) });
        // The running maximum is the second operand, so a NaN is skipped.
        let mut m = _mm256_setzero_ps();
        for c in 0..QK_K / 8 {
            m = _mm256_max_ps(chunk(c), m);
        }
        let mut lanes = [0f32; 8];
        // SAFETY: eight floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
        let amax = lanes.iter().fold(0f32, |a, &v| if v > a { v } else { a });
        let mut sums16 = [0i32; QK_K / 16];
        let mut d = 0f32;
        if amax == 0.0 {
            out[QK_K * b..QK_K * (b + 1)].fill(0);
        } else {
            let first = (0..QK_K / 8)
                .find_map(|c| {
                    let eq = _mm256_cmp_ps::<_CMP_EQ_OQ>(chunk(c), _mm256_set1_ps(amax));
                    let bits = _mm256_movemask_ps(eq);
                    (bits != 0).then(|| 8 * c + bits.trailing_zeros() as usize)
                })
                .expect("the maximum is one of the block's magnitudes");
            let iscale = -127.0 / xb[first];
            if !iscale.is_finite() {
                quantize_k_act_block(layout, b, xb, out);
                continue;
            }
            d = 1.0 / iscale;
            let is = _mm256_set1_ps(iscale);
            let (half, minus_half) = (_mm256_set1_ps(0.5), _mm256_set1_ps(-0.5));
            // Values 32g .. 32g + 32: four vectors of eight, packed to bytes in order.
            for g in 0..QK_K / 32 {
                let q = std::array::from_fn::<__m256i, 4, _>(|k| {
                    // SAFETY: value `32g + 8k` of the block.
                    let v = unsafe { _mm256_loadu_ps(xb.as_ptr().add(32 * g + 8 * k)) };
                    let y = _mm256_mul_ps(v, is);
                    let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                    let frac = _mm256_sub_ps(y, t);
                    let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half));
                    let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(frac, minus_half));
                    let q = _mm256_add_epi32(_mm256_sub_epi32(_mm256_cvttps_epi32(t), up), down);
                    // A NaN product is 0; every other is within [-127, 127] (|y| <= 127).
                    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(y, y));
                    _mm256_andnot_si256(nan, q)
                });
                let words = _mm256_packs_epi16(
                    _mm256_packs_epi32(q[0], q[1]),
                    _mm256_packs_epi32(q[2], q[3]),
                );
                let bytes =
                    _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                // SAFETY: values `32g ..` of block `b` of `out`, in bounds by the assertions.
                unsafe {
                    _mm256_storeu_si256(
                        out.as_mut_ptr().add(QK_K * b + 32 * g) as *mut __m256i,
                        bytes,
                    )
                };
                sums16[2 * g] = sum_i32(_mm256_add_epi32(q[0], q[1]));
                sums16[2 * g + 1] = sum_i32(_mm256_add_epi32(q[2], q[3]));
            }
        }
        put_k_act_scales(layout, b, d, &sums16, out);
    }
}
