//! Weight rows repacked at load for the AVX-512 VNNI tile kernel, and the activation rows that
//! pair with them.
//!
//! ggml's block formats interleave an f16 scale with every 32 values, so a dot kernel spends
//! more instructions on scales than on products. The packed forms keep two blocks' quants in
//! one 64-byte unit and the scales as separate f32 arrays:
//!
//! * weight row: `[quants: n_pairs units][d: 2 * n_pairs f32][m: 2 * n_pairs f32 (Q4_1)]`, where
//!   a Q4 unit is 32 bytes (byte `k` = block `2p` value `k` in the low nibble, block `2p + 1`
//!   value `k` in the high nibble) and a Q8_0 unit is 64 bytes of `value + 128`;
//! * activation row: `[quants: 64 bytes per pair][d: 16 f32 per pair, each block's scale
//!   repeated 8 times][correction: 16 i32 per pair][s: 2 * n_pairs f32 (for Q4_1)]`.
//!
//! One `vpdpbusd` then multiplies 64 unsigned weight values by 64 signed activations into 16
//! lanes, lanes 0..8 belonging to block `2p` and 8..16 to block `2p + 1`; the correction (the
//! offset times each lane's activation sum) starts the lane, so signed weights need no sign
//! tricks. Odd block counts are padded with a zero block. Scales are rounded exactly as ggml's
//! formats round them (f16), so products equal the unpacked kernels' up to summation order.

use gguf::quant::QK;
use gguf::GgmlType;
use half::f16;

/// The weight types with a packed form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PackKind {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl PackKind {
    pub fn of(ty: GgmlType) -> Option<PackKind> {
        match ty {
            GgmlType::Q4_0 => Some(PackKind::Q4_0),
            GgmlType::Q4_1 => Some(PackKind::Q4_1),
            GgmlType::Q8_0 => Some(PackKind::Q8_0),
            _ => None,
        }
    }

    pub fn ggml_type(self) -> GgmlType {
        match self {
            PackKind::Q4_0 => GgmlType::Q4_0,
            PackKind::Q4_1 => GgmlType::Q4_1,
            PackKind::Q8_0 => GgmlType::Q8_0,
        }
    }

    /// Bytes of quants per pair of blocks in a weight row.
    pub fn unit_bytes(self) -> usize {
        match self {
            PackKind::Q8_0 => 64,
            PackKind::Q4_0 | PackKind::Q4_1 => 32,
        }
    }

    /// What the unsigned stored weight value must be shifted by: stored = value + offset.
    pub fn offset(self) -> i32 {
        match self {
            PackKind::Q8_0 => 128,
            PackKind::Q4_0 => 8,
            PackKind::Q4_1 => 0,
        }
    }

    pub fn has_mins(self) -> bool {
        self == PackKind::Q4_1
    }
}

/// Sizes of the packed rows of one matrix width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub kind: PackKind,
    pub n_cols: usize,
    /// Blocks of 32 values.
    pub n_blocks: usize,
    /// Pairs of blocks (the last one may be half padding).
    pub n_pairs: usize,
}

impl Layout {
    pub fn new(kind: PackKind, n_cols: usize) -> Layout {
        assert_eq!(n_cols % QK, 0, "packed rows hold whole blocks");
        let n_blocks = n_cols / QK;
        Layout {
            kind,
            n_cols,
            n_blocks,
            n_pairs: n_blocks.div_ceil(2),
        }
    }

    fn scales(&self) -> usize {
        2 * self.n_pairs
    }

    /// Offsets in a weight row: quants, d, m.
    pub fn w_quants(&self) -> usize {
        self.n_pairs * self.kind.unit_bytes()
    }

    pub fn w_row_bytes(&self) -> usize {
        let n_arrays = if self.kind.has_mins() { 2 } else { 1 };
        self.w_quants() + n_arrays * 4 * self.scales()
    }

    /// Offsets in an activation row: quants (64 bytes per pair), d (one f32 per block),
    /// per-lane corrections (kinds with an offset only: 64 bytes per pair), s (kinds with
    /// minimums only: one f32 per block). Kept compact so a step's activation rows stay in cache
    /// while every weight row group streams past them.
    pub fn a_d(&self) -> usize {
        64 * self.n_pairs
    }

    pub fn a_corr(&self) -> usize {
        self.a_d() + 4 * self.scales()
    }

    pub fn a_sums(&self) -> usize {
        let corr = if self.kind.offset() != 0 {
            64 * self.n_pairs
        } else {
            0
        };
        self.a_corr() + corr
    }

    pub fn a_row_bytes(&self) -> usize {
        self.a_sums() + 4 * self.scales()
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn put_f32(out: &mut [u8], at: usize, v: f32) {
    out[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn get_f32(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn get_i32(b: &[u8], at: usize) -> i32 {
    i32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The values (unsigned stored form, 0..=15 or 0..=255) and scales of block `b` of a ggml row.
fn ggml_block(kind: PackKind, row: &[u8], b: usize) -> ([u8; QK], f32, f32) {
    let mut q = [0u8; QK];
    match kind {
        PackKind::Q4_0 | PackKind::Q4_1 => {
            let (size, head) = if kind == PackKind::Q4_0 {
                (18, 2)
            } else {
                (20, 4)
            };
            let blk = &row[b * size..(b + 1) * size];
            for k in 0..16 {
                q[k] = blk[head + k] & 0x0F;
                q[k + 16] = blk[head + k] >> 4;
            }
            let m = if kind == PackKind::Q4_1 {
                f16_at(blk, 2)
            } else {
                0.0
            };
            (q, f16_at(blk, 0), m)
        }
        PackKind::Q8_0 => {
            let blk = &row[b * 34..(b + 1) * 34];
            for k in 0..QK {
                q[k] = (blk[2 + k] as i8 as i32 + 128) as u8;
            }
            (q, f16_at(blk, 0), 0.0)
        }
    }
}

/// Repacks one ggml row (`layout.n_cols` values of `layout.kind`) into `out`
/// (`layout.w_row_bytes()` bytes).
pub fn pack_weight_row(layout: &Layout, row: &[u8], out: &mut [u8]) {
    let kind = layout.kind;
    out.fill(0);
    let unit = kind.unit_bytes();
    let d_at = layout.w_quants();
    let m_at = d_at + 4 * layout.scales();
    for b in 0..layout.n_blocks {
        let (q, d, m) = ggml_block(kind, row, b);
        let (p, second) = (b / 2, b % 2 == 1);
        let u = &mut out[p * unit..(p + 1) * unit];
        match kind {
            PackKind::Q8_0 => u[if second { 32 } else { 0 }..][..QK].copy_from_slice(&q),
            PackKind::Q4_0 | PackKind::Q4_1 => {
                for k in 0..QK {
                    u[k] |= if second { q[k] << 4 } else { q[k] };
                }
            }
        }
        put_f32(out, d_at + 4 * b, d);
        if kind.has_mins() {
            put_f32(out, m_at + 4 * b, m);
        }
    }
}

/// Decodes row `row` (packed) into `out` (`layout.n_cols` values): the same values the ggml
/// row decodes to.
pub fn dequantize_packed_row(layout: &Layout, row: &[u8], out: &mut [f32]) {
    let kind = layout.kind;
    let unit = kind.unit_bytes();
    let d_at = layout.w_quants();
    let m_at = d_at + 4 * layout.scales();
    for (b, ob) in out.chunks_exact_mut(QK).enumerate() {
        let (p, second) = (b / 2, b % 2 == 1);
        let u = &row[p * unit..(p + 1) * unit];
        let d = get_f32(row, d_at + 4 * b);
        let m = if kind.has_mins() {
            get_f32(row, m_at + 4 * b)
        } else {
            0.0
        };
        for (k, o) in ob.iter_mut().enumerate() {
            let stored = match kind {
                PackKind::Q8_0 => u[if second { 32 } else { 0 } + k],
                _ if second => u[k] >> 4,
                _ => u[k] & 0x0F,
            } as i32;
            *o = (stored - kind.offset()) as f32 * d + m;
        }
    }
}

/// Quantizes one activation row `x` into the packed form for `layout` (`a_row_bytes` bytes).
/// Blocks are quantized exactly as [`super::act`] quantizes Q8_0 / Q8_1 blocks.
pub fn quantize_act_row(layout: &Layout, x: &[f32], out: &mut [u8]) {
    out.fill(0);
    let offset = layout.kind.offset();
    for (b, xb) in x.chunks_exact(QK).enumerate() {
        let (d, q) = super::act::q8_block(xb);
        out[b * QK..(b + 1) * QK].copy_from_slice(&q.map(|v| v as u8));
        put_f32(out, layout.a_d() + 4 * b, f16::from_f32(d).to_f32());
        if offset != 0 {
            for l in 0..8 {
                let sum4: i32 = q[4 * l..4 * l + 4].iter().map(|&v| v as i32).sum();
                let corr = -offset * sum4;
                out[layout.a_corr() + 4 * (8 * b + l)..][..4].copy_from_slice(&corr.to_le_bytes());
            }
        }
        if layout.kind.has_mins() {
            let sum: i32 = q.iter().map(|&v| v as i32).sum();
            let s = f16::from_f32(sum as f32 * d).to_f32();
            put_f32(out, layout.a_sums() + 4 * b, s);
        }
    }
}

/// The 8-lane sum in the fixed tree the SIMD kernel (and ggml's `hsum_float_8`) uses.
pub fn reduce8(v: [f32; 8]) -> f32 {
    let q: [f32; 4] = std::array::from_fn(|i| v[i] + v[i + 4]);
    (q[0] + q[2]) + (q[1] + q[3])
}

/// The 16-lane sum: halves, then as [`reduce8`].
pub fn reduce16(v: [f32; 16]) -> f32 {
    reduce8(std::array::from_fn(|i| v[i] + v[i + 8]))
}

/// Reference for the tile kernel, lane by lane in the same order, so the SIMD kernel must equal
/// it bitwise. Also the fallback where AVX-512 is missing.
///
/// The order is ggml's: per block, eight lanes of four-product integer sums, converted and
/// multiplied by the block's combined scale into eight running lanes (one fused multiply-add);
/// the lanes summed at the end; the Q4_1 minimum terms summed apart and added last. Keeping
/// ggml's order keeps our logits closest to llama.cpp's (measured on the real model).
pub fn dot_reference(layout: &Layout, w: &[u8], a: &[u8]) -> f32 {
    let kind = layout.kind;
    let unit = kind.unit_bytes();
    let d_at = layout.w_quants();
    let mut acc = [0f32; 8];
    for b in 0..layout.n_blocks {
        let (p, h) = (b / 2, b % 2);
        let u = &w[p * unit..(p + 1) * unit];
        let wv = |i: usize| -> i32 {
            match kind {
                PackKind::Q8_0 => u[32 * h + i] as i32,
                _ if h == 0 => (u[i] & 0x0F) as i32,
                _ => (u[i] >> 4) as i32,
            }
        };
        let wd = get_f32(w, d_at + 4 * b);
        for (lane, acc) in acc.iter_mut().enumerate() {
            let at = 16 * p + 8 * h + lane;
            let mut dot = if kind.offset() != 0 {
                get_i32(a, layout.a_corr() + 4 * at)
            } else {
                0
            };
            for j in 0..4 {
                let i = 4 * lane + j;
                dot += wv(i) * a[64 * p + 32 * h + i] as i8 as i32;
            }
            let ad = get_f32(a, layout.a_d() + 4 * b);
            *acc = (dot as f32).mul_add(wd * ad, *acc);
        }
    }
    let sum = reduce8(acc);
    if !kind.has_mins() {
        return sum;
    }
    let m_at = d_at + 4 * layout.scales();
    let mut mins = [0f32; 16];
    for c in 0..layout.scales().div_ceil(16) {
        for (lane, acc) in mins.iter_mut().enumerate() {
            // Lanes past the end add 0 * 0, as the masked SIMD loads do.
            let b = 16 * c + lane;
            let (m, s) = if b < layout.scales() {
                (
                    get_f32(w, m_at + 4 * b),
                    get_f32(a, layout.a_sums() + 4 * b),
                )
            } else {
                (0.0, 0.0)
            };
            *acc = m.mul_add(s, *acc);
        }
    }
    sum + reduce16(mins)
}

#[cfg(target_arch = "x86_64")]
pub mod vnni {
    //! The tile kernel: `RW` weight rows times `RA` activation rows, each weight unit unpacked
    //! once for all activation rows and each activation block loaded once for all weight rows.
    //! Every output element goes through the same instruction sequence whatever `RW` and `RA`
    //! are, so grouping never changes a result.

    use std::arch::x86_64::*;

    use super::{Layout, PackKind};

    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    fn reduce8(h: __m256) -> f32 {
        let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    fn reduce16(v: __m512) -> f32 {
        reduce8(_mm256_add_ps(
            _mm512_castps512_ps256(v),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
        ))
    }

    /// Block `h` (0 or 1) of weight unit `p` of a row as 32 unsigned bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    unsafe fn block<const KIND: u8>(w: *const u8, p: usize, h: usize) -> __m256i {
        if KIND == Q8 {
            // SAFETY: the caller guarantees the row holds `n_pairs` units.
            unsafe { _mm256_loadu_si256(w.add(64 * p + 32 * h) as *const __m256i) }
        } else {
            // SAFETY: as above.
            let v = unsafe { _mm256_loadu_si256(w.add(32 * p) as *const __m256i) };
            let v = if h == 0 { v } else { _mm256_srli_epi16::<4>(v) };
            _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
        }
    }

    pub const Q40: u8 = 0;
    pub const Q41: u8 = 1;
    pub const Q8: u8 = 2;

    pub fn kind_id(k: PackKind) -> u8 {
        match k {
            PackKind::Q4_0 => Q40,
            PackKind::Q4_1 => Q41,
            PackKind::Q8_0 => Q8,
        }
    }

    /// `out[i][j] = w[i] . a[j]`, bitwise equal to [`super::dot_reference`].
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/VL/VNNI, AVX2 and FMA; every `w[i]` must hold
    /// `layout.w_row_bytes()` bytes and every `a[j]` `layout.a_row_bytes()` bytes of the
    /// layout's kind (`KIND` = [`kind_id`] of it).
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    pub unsafe fn tile<const KIND: u8, const RW: usize, const RA: usize>(
        layout: &Layout,
        w: [&[u8]; RW],
        a: [&[u8]; RA],
    ) -> [[f32; RA]; RW] {
        debug_assert_eq!(kind_id(layout.kind), KIND);
        assert!(w.iter().all(|w| w.len() >= layout.w_row_bytes()));
        assert!(a.iter().all(|a| a.len() >= layout.a_row_bytes()));
        let d_at = layout.w_quants();
        let wp = w.map(|w| w.as_ptr());
        let ap = a.map(|a| a.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); RA]; RW];
        // Block by block, in order; the second block of an odd count's last pair is padding and
        // is skipped, not added.
        for b in 0..layout.n_blocks {
            let (p, h) = (b / 2, b % 2);
            let mut wq = [_mm256_setzero_si256(); RW];
            let mut wd = [_mm256_setzero_ps(); RW];
            for i in 0..RW {
                // SAFETY: lengths asserted above; d holds 2 * n_pairs floats.
                unsafe {
                    wq[i] = block::<KIND>(wp[i], p, h);
                    wd[i] =
                        _mm256_set1_ps((wp[i].add(d_at + 4 * b) as *const f32).read_unaligned());
                }
            }
            let at = 64 * p + 32 * h;
            for j in 0..RA {
                // SAFETY: lengths asserted above.
                let (x, xd, corr) = unsafe {
                    (
                        _mm256_loadu_si256(ap[j].add(at) as *const __m256i),
                        _mm256_set1_ps(
                            (ap[j].add(layout.a_d() + 4 * b) as *const f32).read_unaligned(),
                        ),
                        if KIND == Q41 {
                            _mm256_setzero_si256()
                        } else {
                            _mm256_loadu_si256(ap[j].add(layout.a_corr() + at) as *const __m256i)
                        },
                    )
                };
                for i in 0..RW {
                    // Q4_1 values are unsigned and need no correction: starting from a zeroed
                    // register (a free zero idiom) saves copying the correction for every row.
                    let start = if KIND == Q41 {
                        _mm256_setzero_si256()
                    } else {
                        corr
                    };
                    let dot = _mm256_dpbusd_epi32(start, wq[i], x);
                    let scale = _mm256_mul_ps(wd[i], xd);
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[i][j]);
                }
            }
        }
        let mut out = [[0f32; RA]; RW];
        for i in 0..RW {
            for j in 0..RA {
                out[i][j] = reduce8(acc[i][j]);
            }
        }
        if KIND == Q41 {
            let n = 2 * layout.n_pairs;
            let m_at = d_at + 4 * n;
            let s_at = layout.a_sums();
            for i in 0..RW {
                for j in 0..RA {
                    let mut mins = _mm512_setzero_ps();
                    for c in 0..n.div_ceil(16) {
                        let left = n - 16 * c;
                        let mask: __mmask16 = if left >= 16 { 0xFFFF } else { (1 << left) - 1 };
                        // SAFETY: the masked loads read only the `left` floats that exist.
                        let (m, s) = unsafe {
                            (
                                _mm512_maskz_loadu_ps(mask, wp[i].add(m_at + 64 * c) as *const f32),
                                _mm512_maskz_loadu_ps(mask, ap[j].add(s_at + 64 * c) as *const f32),
                            )
                        };
                        mins = _mm512_fmadd_ps(m, s, mins);
                    }
                    out[i][j] += reduce16(mins);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::tests::data;

    const KINDS: [PackKind; 3] = [PackKind::Q4_0, PackKind::Q4_1, PackKind::Q8_0];

    #[test]
    fn packed_rows_decode_to_the_ggml_values() {
        for kind in KINDS {
            for n in [32, 64, 96, 576] {
                let layout = Layout::new(kind, n);
                let row = gguf::quant::quantize(kind.ggml_type(), &data(n, 3)).unwrap();
                let mut packed = vec![0u8; layout.w_row_bytes()];
                pack_weight_row(&layout, &row, &mut packed);
                let (mut want, mut got) = (vec![0f32; n], vec![0f32; n]);
                gguf::quant::dequantize(kind.ggml_type(), &row, &mut want).unwrap();
                dequantize_packed_row(&layout, &packed, &mut got);
                assert_eq!(want, got, "{kind:?} n={n}");
            }
        }
    }

    /// The packed product equals the ggml-format reference kernel up to summation order.
    #[test]
    fn packed_product_matches_the_ggml_kernel() {
        let scalar = super::super::Kernels::new(super::super::Isa::Scalar).unwrap();
        let mut scratch = Vec::new();
        for kind in KINDS {
            for n in [32, 96, 576, 1536] {
                let layout = Layout::new(kind, n);
                let ty = kind.ggml_type();
                let row = gguf::quant::quantize(ty, &data(n, 5)).unwrap();
                let mut packed = vec![0u8; layout.w_row_bytes()];
                pack_weight_row(&layout, &row, &mut packed);
                let x = data(n, 11);
                let at = super::super::act::act_type(ty);
                let mut a = vec![0u8; at.row_bytes(n)];
                super::super::act::quantize_row(at, &x, &mut a);
                let mut ap = vec![0u8; layout.a_row_bytes()];
                quantize_act_row(&layout, &x, &mut ap);
                let want = scalar.dot(ty, n, &row, &a, &mut scratch);
                let got = dot_reference(&layout, &packed, &ap);
                assert!(
                    (want - got).abs() <= 1e-4 * (1.0 + want.abs()),
                    "{kind:?} n={n}: {got} vs {want}"
                );
            }
        }
    }

    /// Every tile shape gives bitwise the lane-by-lane reference for every element.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn tile_kernel_equals_the_reference_bitwise() {
        if !super::super::Isa::Avx512Vnni.is_supported() {
            return;
        }
        for kind in KINDS {
            let n = 576 + 32;
            let layout = Layout::new(kind, n);
            let ws: Vec<Vec<u8>> = (0..4)
                .map(|r| {
                    let row = gguf::quant::quantize(kind.ggml_type(), &data(n, 40 + r)).unwrap();
                    let mut p = vec![0u8; layout.w_row_bytes()];
                    pack_weight_row(&layout, &row, &mut p);
                    p
                })
                .collect();
            let acts: Vec<Vec<u8>> = (0..4)
                .map(|r| {
                    let mut a = vec![0u8; layout.a_row_bytes()];
                    quantize_act_row(&layout, &data(n, 80 + r), &mut a);
                    a
                })
                .collect();
            let w4 = [&ws[0][..], &ws[1], &ws[2], &ws[3]];
            let a4 = [&acts[0][..], &acts[1], &acts[2], &acts[3]];
            let id = vnni::kind_id(kind);
            // SAFETY: support checked above; rows sized by the layout.
            let (t44, t41, t14) = unsafe {
                match id {
                    vnni::Q40 => (
                        vnni::tile::<{ vnni::Q40 }, 4, 4>(&layout, w4, a4),
                        vnni::tile::<{ vnni::Q40 }, 4, 1>(&layout, w4, [a4[2]]),
                        vnni::tile::<{ vnni::Q40 }, 1, 4>(&layout, [w4[1]], a4),
                    ),
                    vnni::Q41 => (
                        vnni::tile::<{ vnni::Q41 }, 4, 4>(&layout, w4, a4),
                        vnni::tile::<{ vnni::Q41 }, 4, 1>(&layout, w4, [a4[2]]),
                        vnni::tile::<{ vnni::Q41 }, 1, 4>(&layout, [w4[1]], a4),
                    ),
                    _ => (
                        vnni::tile::<{ vnni::Q8 }, 4, 4>(&layout, w4, a4),
                        vnni::tile::<{ vnni::Q8 }, 4, 1>(&layout, w4, [a4[2]]),
                        vnni::tile::<{ vnni::Q8 }, 1, 4>(&layout, [w4[1]], a4),
                    ),
                }
            };
            for i in 0..4 {
                for j in 0..4 {
                    let r = dot_reference(&layout, &ws[i], &acts[j]);
                    assert_eq!(t44[i][j].to_bits(), r.to_bits(), "{kind:?} 4x4 [{i}][{j}]");
                }
                let r = dot_reference(&layout, &ws[i], &acts[2]);
                assert_eq!(t41[i][0].to_bits(), r.to_bits(), "{kind:?} 4x1 [{i}]");
                let r = dot_reference(&layout, &ws[1], &acts[i]);
                assert_eq!(t14[0][i].to_bits(), r.to_bits(), "{kind:?} 1x4 [{i}]");
            }
        }
    }
}
