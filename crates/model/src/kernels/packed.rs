//! Weight matrices repacked at load into panels of 16 rows for the AVX-512 VNNI panel kernel,
//! and the activation rows that pair with them.
//!
//! ggml's block formats keep each row's blocks apart, so a dot kernel multiplies one row's 32
//! values into lanes that must be summed across the register, and spends more instructions on
//! scales and sums than on products. A panel puts 16 rows side by side instead: for each block,
//! lane `r` of a 16-lane register holds four consecutive values of row `r`, so one `vpdpbusd`
//! against four activation values broadcast to every lane advances 16 rows at once, and a block
//! ends with one exact integer sum per row — no reduction across lanes.
//!
//! * panel (rows `16p .. 16p + 16`; rows past the matrix are zero), block after block, each
//!   block: `[quants][d: 16 f16][m: 16 f16 (Q4_1 only)]`. Q4 quants are four 64-byte chunks:
//!   chunk `h` byte `4r + j` holds row `r` value `8h + j` in its low nibble and value
//!   `8h + 4 + j` in its high nibble. Q8_0 quants are eight 64-byte chunks: chunk `g` byte
//!   `4r + j` is row `r` value `4g + j` plus 128. Same bytes as ggml's blocks, scales still f16.
//! * activation row: `[quants: 32 i8 per block][d: f32 per block][correction: i32 per block
//!   (kinds whose stored weights carry an offset)][s: f32 per block (Q4_1)]`.
//!
//! Per row and block the kernel computes the exact integer sum `Σ stored·q + correction`
//! (the correction, `-offset · Σq`, undoes the stored offset), converts it once, and adds it
//! times `d_w · d_a` to the row's running sum with one fused multiply-add; Q4_1 then adds
//! `m · s` the same way. Scales are rounded exactly as ggml's formats round them (f16), so
//! products equal the ggml kernels' up to summation order; the order is fixed per element, so
//! no grouping of rows or activations changes a result.

use gguf::quant::QK;
use gguf::GgmlType;
use half::f16;

/// Weight rows per panel (the lanes of one 512-bit register).
pub const PANEL: usize = 16;

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

    /// Bytes of quants per block of a panel.
    pub fn quant_bytes(self) -> usize {
        match self {
            PackKind::Q8_0 => PANEL * QK,
            PackKind::Q4_0 | PackKind::Q4_1 => PANEL * QK / 2,
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

/// Sizes of the panels and activation rows of one matrix width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub kind: PackKind,
    pub n_cols: usize,
    /// Blocks of 32 values.
    pub n_blocks: usize,
}

impl Layout {
    pub fn new(kind: PackKind, n_cols: usize) -> Layout {
        assert_eq!(n_cols % QK, 0, "packed rows hold whole blocks");
        Layout {
            kind,
            n_cols,
            n_blocks: n_cols / QK,
        }
    }

    /// Bytes of one block of a panel: quants, then 16 f16 `d`, then 16 f16 `m` (Q4_1).
    pub fn block_bytes(&self) -> usize {
        let n_arrays = if self.kind.has_mins() { 2 } else { 1 };
        self.kind.quant_bytes() + n_arrays * 2 * PANEL
    }

    pub fn panel_bytes(&self) -> usize {
        self.n_blocks * self.block_bytes()
    }

    /// Offsets in an activation row: quants (32 bytes per block), d (one f32 per block),
    /// corrections (kinds with an offset: one i32 per block), s (kinds with minimums: one f32
    /// per block).
    pub fn a_d(&self) -> usize {
        QK * self.n_blocks
    }

    pub fn a_corr(&self) -> usize {
        self.a_d() + 4 * self.n_blocks
    }

    pub fn a_sums(&self) -> usize {
        let corr = if self.kind.offset() != 0 { 4 } else { 0 };
        self.a_corr() + corr * self.n_blocks
    }

    pub fn a_row_bytes(&self) -> usize {
        let sums = if self.kind.has_mins() { 4 } else { 0 };
        self.a_sums() + sums * self.n_blocks
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

/// The values (unsigned stored form, 0..=15 or 0..=255) and the f16 bits of the scales of block
/// `b` of a ggml row.
fn ggml_block(kind: PackKind, row: &[u8], b: usize) -> ([u8; QK], [u8; 2], [u8; 2]) {
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
                [blk[2], blk[3]]
            } else {
                [0, 0]
            };
            (q, [blk[0], blk[1]], m)
        }
        PackKind::Q8_0 => {
            let blk = &row[b * 34..(b + 1) * 34];
            for k in 0..QK {
                q[k] = (blk[2 + k] as i8 as i32 + 128) as u8;
            }
            (q, [blk[0], blk[1]], [0, 0])
        }
    }
}

/// Where value `k` (0..32) of lane `r` of a block's quants lives: byte index, and whether it is
/// the high nibble (Q4 kinds).
fn quant_at(kind: PackKind, r: usize, k: usize) -> (usize, bool) {
    match kind {
        PackKind::Q8_0 => (64 * (k / 4) + 4 * r + k % 4, false),
        PackKind::Q4_0 | PackKind::Q4_1 => {
            let (h, within) = (k / 8, k % 8);
            (64 * h + 4 * r + within % 4, within >= 4)
        }
    }
}

/// Repacks up to [`PANEL`] ggml rows (`layout.n_cols` values of `layout.kind` each) into one
/// panel `out` (`layout.panel_bytes()` bytes); missing rows are zero.
pub fn pack_panel(layout: &Layout, rows: &[&[u8]], out: &mut [u8]) {
    assert!(rows.len() <= PANEL);
    let kind = layout.kind;
    out.fill(0);
    let bb = layout.block_bytes();
    let qb = kind.quant_bytes();
    for b in 0..layout.n_blocks {
        let blk = &mut out[b * bb..(b + 1) * bb];
        for (r, row) in rows.iter().enumerate() {
            let (q, d, m) = ggml_block(kind, row, b);
            for (k, &v) in q.iter().enumerate() {
                let (at, high) = quant_at(kind, r, k);
                blk[at] |= if high { v << 4 } else { v };
            }
            blk[qb + 2 * r..][..2].copy_from_slice(&d);
            if kind.has_mins() {
                blk[qb + 2 * PANEL + 2 * r..][..2].copy_from_slice(&m);
            }
        }
    }
}

/// The stored (unsigned) value `k` of block `b`, lane `r` of a panel.
fn stored(layout: &Layout, panel: &[u8], r: usize, b: usize, k: usize) -> i32 {
    let (at, high) = quant_at(layout.kind, r, k);
    let byte = panel[b * layout.block_bytes() + at];
    (match layout.kind {
        PackKind::Q8_0 => byte,
        _ if high => byte >> 4,
        _ => byte & 0x0F,
    }) as i32
}

/// Scales `d` and `m` of block `b`, lane `r` of a panel.
fn scales(layout: &Layout, panel: &[u8], r: usize, b: usize) -> (f32, f32) {
    let at = b * layout.block_bytes() + layout.kind.quant_bytes();
    let m = if layout.kind.has_mins() {
        f16_at(panel, at + 2 * PANEL + 2 * r)
    } else {
        0.0
    };
    (f16_at(panel, at + 2 * r), m)
}

/// Decodes lane `r` of a panel into `out` (`layout.n_cols` values): the values the ggml row
/// decodes to.
pub fn dequantize_panel_row(layout: &Layout, panel: &[u8], r: usize, out: &mut [f32]) {
    let offset = layout.kind.offset();
    for (b, ob) in out.chunks_exact_mut(QK).enumerate() {
        let (d, m) = scales(layout, panel, r, b);
        for (k, o) in ob.iter_mut().enumerate() {
            *o = (stored(layout, panel, r, b, k) - offset) as f32 * d + m;
        }
    }
}

/// Quantizes one activation row `x` into the packed form for `layout` (`a_row_bytes` bytes).
/// Blocks are quantized exactly as [`super::act`] quantizes Q8_0 / Q8_1 blocks.
pub fn quantize_act_row(layout: &Layout, x: &[f32], out: &mut [u8]) {
    let offset = layout.kind.offset();
    for (b, xb) in x.chunks_exact(QK).enumerate() {
        let (d, q) = super::act::q8_block(xb);
        out[b * QK..(b + 1) * QK].copy_from_slice(&q.map(|v| v as u8));
        put_f32(out, layout.a_d() + 4 * b, f16::from_f32(d).to_f32());
        let sum: i32 = q.iter().map(|&v| v as i32).sum();
        if offset != 0 {
            out[layout.a_corr() + 4 * b..][..4].copy_from_slice(&(-offset * sum).to_le_bytes());
        }
        if layout.kind.has_mins() {
            let s = f16::from_f32(sum as f32 * d).to_f32();
            put_f32(out, layout.a_sums() + 4 * b, s);
        }
    }
}

/// Reference for the panel kernel, element by element in the same order, so the SIMD kernel
/// must equal it bitwise. Also the fallback where AVX-512 is missing: `out[r]` = lane `r` of
/// `panel` . `a`.
pub fn panel_reference(layout: &Layout, panel: &[u8], a: &[u8]) -> [f32; PANEL] {
    let kind = layout.kind;
    std::array::from_fn(|r| {
        let (mut acc, mut mins) = (0f32, 0f32);
        for b in 0..layout.n_blocks {
            let mut dot = if kind.offset() != 0 {
                get_i32(a, layout.a_corr() + 4 * b)
            } else {
                0
            };
            for k in 0..QK {
                dot += stored(layout, panel, r, b, k) * a[QK * b + k] as i8 as i32;
            }
            let (d, m) = scales(layout, panel, r, b);
            let ad = get_f32(a, layout.a_d() + 4 * b);
            acc = (dot as f32).mul_add(d * ad, acc);
            if kind.has_mins() {
                mins = m.mul_add(get_f32(a, layout.a_sums() + 4 * b), mins);
            }
        }
        acc + mins
    })
}

#[cfg(target_arch = "x86_64")]
pub mod vnni {
    //! The panel kernel: one panel (16 weight rows) times `RA` activation rows. Each 64-byte
    //! chunk of weights is unpacked once for all activation rows; every output element goes
    //! through the same instruction sequence whatever `RA` is, so grouping never changes a
    //! result.

    use std::arch::x86_64::*;

    use gguf::quant::QK;

    use super::{Layout, PackKind, PANEL};

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

    /// Four activation values (bytes `at..at + 4` of a row) in every lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn bcast4(a: *const u8, at: usize) -> __m512i {
        // SAFETY: the caller keeps `at + 4` within the row.
        _mm512_set1_epi32(unsafe { (a.add(at) as *const i32).read_unaligned() })
    }

    /// [`super::quantize_act_row`], 16 values per instruction and bitwise equal to it: the
    /// same maximum, scale and reciprocal; rounding half away from zero as truncation plus a
    /// step where the (exact) remainder reaches one half.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/VL/VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    pub unsafe fn quantize_act_row(layout: &Layout, x: &[f32], out: &mut [u8]) {
        assert_eq!(x.len(), layout.n_cols);
        assert!(out.len() >= layout.a_row_bytes());
        let offset = layout.kind.offset();
        let (half, minus_half, one) = (
            _mm512_set1_ps(0.5),
            _mm512_set1_ps(-0.5),
            _mm512_set1_epi32(1),
        );
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
                *m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
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
                let round = |v: __m512| {
                    let y = _mm512_mul_ps(v, id);
                    let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                    let frac = _mm512_sub_ps(y, t);
                    let q = _mm512_cvttps_epi32(t);
                    let q = _mm512_mask_add_epi32(
                        q,
                        _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, half),
                        q,
                        one,
                    );
                    _mm512_mask_sub_epi32(
                        q,
                        _mm512_cmp_ps_mask::<_CMP_LE_OQ>(frac, minus_half),
                        q,
                        one,
                    )
                };
                let (q0, q1) = (round(x0), round(x1));
                // SAFETY: as above.
                unsafe {
                    _mm_storeu_si128(
                        out.as_mut_ptr().add(QK * b) as *mut __m128i,
                        _mm512_cvtepi32_epi8(q0),
                    );
                    _mm_storeu_si128(
                        out.as_mut_ptr().add(QK * b + 16) as *mut __m128i,
                        _mm512_cvtepi32_epi8(q1),
                    );
                }
                *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
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

    /// Weight rows `0..n_rows` of the consecutive panels `w` times `RA` activation rows:
    /// row `r` . `a[j]` is written to `out[j * stride + r]`, bitwise equal to
    /// [`super::panel_reference`]'s lane `r % 16` of panel `r / 16`. Looping over the panels
    /// here, not in the caller, pays the call's set-up once per run of panels.
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
        debug_assert_eq!(kind_id(layout.kind), KIND);
        let n_panels = n_rows.div_ceil(PANEL);
        assert!(w.len() >= n_panels * layout.panel_bytes());
        assert!(a.iter().all(|a| a.len() >= layout.a_row_bytes()));
        let (bb, qb) = (layout.block_bytes(), layout.kind.quant_bytes());
        let (a_d, a_corr, a_sums) = (layout.a_d(), layout.a_corr(), layout.a_sums());
        let ap = a.map(|a| a.as_ptr());
        let nibble = _mm512_set1_epi8(0x0F);
        for p in 0..n_panels {
            // SAFETY: panel `p` is in bounds by the assertion above.
            let wp = unsafe { w.as_ptr().add(p * layout.panel_bytes()) };
            let mut acc = [_mm512_setzero_ps(); RA];
            let mut mins = [_mm512_setzero_ps(); RA];
            for b in 0..layout.n_blocks {
                // SAFETY (every read below): block `b` of the panel and of each activation row
                // is in bounds by the length assertions above.
                let blk = unsafe { wp.add(b * bb) };
                // Two independent integer sums per row (exact, so splitting cannot change the
                // result) keep the dependency chains short.
                let mut even = [_mm512_setzero_si512(); RA];
                let mut odd = [_mm512_setzero_si512(); RA];
                if KIND != Q41 {
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
                    for h in 0..QK / 8 {
                        let c = unsafe { _mm512_loadu_si512(blk.add(64 * h) as *const __m512i) };
                        let lo = _mm512_and_si512(c, nibble);
                        let hi = _mm512_and_si512(_mm512_srli_epi32::<4>(c), nibble);
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
                let d =
                    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(blk.add(qb) as *const __m256i) });
                let m = if KIND == Q41 {
                    _mm512_cvtph_ps(unsafe {
                        _mm256_loadu_si256(blk.add(qb + 2 * PANEL) as *const __m256i)
                    })
                } else {
                    _mm512_setzero_ps()
                };
                for j in 0..RA {
                    let dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even[j], odd[j]));
                    let ad = unsafe { (ap[j].add(a_d + 4 * b) as *const f32).read_unaligned() };
                    acc[j] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(ad)), acc[j]);
                    if KIND == Q41 {
                        let s =
                            unsafe { (ap[j].add(a_sums + 4 * b) as *const f32).read_unaligned() };
                        mins[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(s), mins[j]);
                    }
                }
            }
            // The last panel of a matrix may hold fewer rows: only theirs are stored.
            let valid = (n_rows - p * PANEL).min(PANEL);
            let mask = ((1u32 << valid) - 1) as __mmask16;
            for j in 0..RA {
                // SAFETY: rows `16p..16p + valid` of output row `j`, the caller's contract.
                unsafe {
                    _mm512_mask_storeu_ps(
                        out.add(j * stride + p * PANEL),
                        mask,
                        _mm512_add_ps(acc[j], mins[j]),
                    )
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::tests::data;

    const KINDS: [PackKind; 3] = [PackKind::Q4_0, PackKind::Q4_1, PackKind::Q8_0];

    /// `n_rows` ggml rows of `kind` and the panels they pack into.
    fn rows_and_panel(
        kind: PackKind,
        n_rows: usize,
        n: usize,
        seed: u32,
    ) -> (Vec<Vec<u8>>, Vec<u8>) {
        let layout = Layout::new(kind, n);
        let rows: Vec<Vec<u8>> = (0..n_rows)
            .map(|r| gguf::quant::quantize(kind.ggml_type(), &data(n, seed + r as u32)).unwrap())
            .collect();
        let refs: Vec<&[u8]> = rows.iter().map(Vec::as_slice).collect();
        let mut panel = vec![0u8; layout.panel_bytes()];
        pack_panel(&layout, &refs, &mut panel);
        (rows, panel)
    }

    #[test]
    fn panels_decode_to_the_ggml_values_and_hold_as_many_bytes() {
        for kind in KINDS {
            for n in [32, 64, 96, 576] {
                let layout = Layout::new(kind, n);
                assert_eq!(
                    layout.panel_bytes(),
                    PANEL * kind.ggml_type().row_bytes(n),
                    "{kind:?}: a panel holds exactly its rows' bytes"
                );
                let (rows, panel) = rows_and_panel(kind, 11, n, 3);
                for r in 0..PANEL {
                    let mut want = vec![0f32; n];
                    if let Some(row) = rows.get(r) {
                        gguf::quant::dequantize(kind.ggml_type(), row, &mut want).unwrap();
                    }
                    let mut got = vec![1f32; n];
                    dequantize_panel_row(&layout, &panel, r, &mut got);
                    assert_eq!(want, got, "{kind:?} n={n} lane {r}");
                }
            }
        }
    }

    /// The panel product equals the ggml-format reference kernel up to summation order.
    #[test]
    fn panel_product_matches_the_ggml_kernel() {
        let scalar = super::super::Kernels::new(super::super::Isa::Scalar).unwrap();
        let mut scratch = Vec::new();
        for kind in KINDS {
            for n in [32, 96, 576, 1536] {
                let layout = Layout::new(kind, n);
                let ty = kind.ggml_type();
                let (rows, panel) = rows_and_panel(kind, PANEL, n, 5);
                let x = data(n, 11);
                let at = super::super::act::act_type(ty);
                let mut a = vec![0u8; at.row_bytes(n)];
                super::super::act::quantize_row(at, &x, &mut a);
                let mut ap = vec![0u8; layout.a_row_bytes()];
                quantize_act_row(&layout, &x, &mut ap);
                let got = panel_reference(&layout, &panel, &ap);
                for (r, row) in rows.iter().enumerate() {
                    let want = scalar.dot(ty, n, row, &a, &mut scratch);
                    assert!(
                        (want - got[r]).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{kind:?} n={n} row {r}: {} vs {want}",
                        got[r]
                    );
                }
            }
        }
    }

    /// The SIMD activation quantizer writes bitwise the reference's bytes, including blocks of
    /// zeros, exact halves and a lone maximum.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_activation_quantizer_equals_the_reference_bitwise() {
        if !super::super::Isa::Avx512Vnni.is_supported() {
            return;
        }
        // 48 blocks (three groups of sixteen), 18 (one and a part), 7 (a part only).
        for (kind, n) in KINDS.iter().flat_map(|&k| [(k, 1536), (k, 576), (k, 224)]) {
            let layout = Layout::new(kind, n);
            let mut x = data(n, 7);
            x[32..64].fill(0.0);
            for (i, v) in x[64..96].iter_mut().enumerate() {
                *v = (i as f32 - 15.5) * 127.0 / 16.0 / 15.5;
            }
            x[100] = 3.0e4;
            x[200] = -1.0e-30;
            let (mut want, mut got) = (
                vec![0u8; layout.a_row_bytes()],
                vec![1u8; layout.a_row_bytes()],
            );
            quantize_act_row(&layout, &x, &mut want);
            // SAFETY: support checked above.
            unsafe { vnni::quantize_act_row(&layout, &x, &mut got) };
            assert_eq!(want, got, "{kind:?} {n}");
        }
    }

    /// Every grouping of activation rows, on a run of panels whose last is partial, gives
    /// bitwise the element-by-element reference, and nothing is written past the last row.
    #[test]
    fn panel_kernel_equals_the_reference_bitwise() {
        let fast = super::super::Kernels::detect();
        let scalar = super::super::Kernels::new(super::super::Isa::Scalar).unwrap();
        for kind in KINDS {
            let n = 576 + 32;
            let layout = Layout::new(kind, n);
            let n_rows = 2 * PANEL + 8;
            let panels: Vec<u8> = (0..3)
                .flat_map(|p| rows_and_panel(kind, PANEL, n, 40 + 100 * p as u32).1)
                .collect();
            let acts: Vec<Vec<u8>> = (0..11)
                .map(|r| {
                    let mut a = vec![0u8; layout.a_row_bytes()];
                    quantize_act_row(&layout, &data(n, 80 + r), &mut a);
                    a
                })
                .collect();
            let a: Vec<&[u8]> = acts.iter().map(Vec::as_slice).collect();
            let stride = n_rows + 3;
            for k in [&fast, &scalar] {
                let mut out = vec![f32::NAN; a.len() * stride];
                // SAFETY: `out` holds `a.len()` rows of `stride >= n_rows` values.
                unsafe { k.packed_panels(&layout, &panels, n_rows, &a, out.as_mut_ptr(), stride) };
                for (j, aj) in a.iter().enumerate() {
                    for (p, panel) in panels.chunks_exact(layout.panel_bytes()).enumerate() {
                        let want = panel_reference(&layout, panel, aj);
                        for r in 0..PANEL.min(stride - p * PANEL) {
                            let got = out[j * stride + p * PANEL + r];
                            if p * PANEL + r < n_rows {
                                assert_eq!(got.to_bits(), want[r].to_bits(), "{kind:?} [{j}][{r}]");
                            } else {
                                assert!(
                                    got.is_nan(),
                                    "{kind:?} wrote row {} of {n_rows}",
                                    p * PANEL + r
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
