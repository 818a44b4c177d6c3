//! Weight matrices repacked at load into panels of 16 rows for the AVX-512 VNNI panel kernels,
//! and the activation rows that pair with them.
//!
//! ggml's block formats keep each row's blocks apart, so a dot kernel multiplies one row's 32
//! values into lanes that must be summed across the register, and spends more instructions on
//! scales and sums than on products. A panel puts 16 rows side by side instead: for each block,
//! lane `r` of a 16-lane register holds four consecutive values of row `r`, so one `vpdpbusd`
//! against four activation values broadcast to every lane advances 16 rows at once, and a block
//! ends with one exact integer sum per row — no reduction across lanes.
//!
//! Weights are stored as unsigned values (`stored = value + offset`), 32 values (a *sub-block*)
//! at a time:
//!
//! * 4-bit kinds and the low four bits of 5- and 6-bit kinds: four 64-byte chunks; chunk `h`
//!   byte `4r + j` holds row `r` value `8h + j` in its low nibble and value `8h + 4 + j` in its
//!   high nibble.
//! * 5-bit kinds (Q5_0, Q5_1, Q5_K) add one 64-byte plane of fifth bits: byte `4r + j` bit `t`
//!   is bit 4 of value `4t + j`.
//! * Q6_K adds two 64-byte planes of the top two bits: plane `c` byte `4r + j` bits `2t, 2t + 1`
//!   are bits 4 and 5 of value `16c + 4t + j`.
//! * 2-bit kinds and the low two bits of Q3_K: two 64-byte chunks; chunk `c` byte `4r + j` bits
//!   `2t, 2t + 1` hold row `r` value `16c + 4t + j`. Q3_K adds one plane of third bits: byte
//!   `4r + j` bit `t` is bit 2 of value `4t + j`.
//! * Q8_0: eight 64-byte chunks; chunk `g` byte `4r + j` is row `r` value `4g + j` plus 128.
//!
//! A *block* is the unit of one activation scale: 32 values for the legacy kinds, 256 (eight
//! sub-blocks) for the K-quants. After its quants each block holds its scales, lane by lane:
//!
//! * legacy kinds: `d` (16 f16), then `m` (16 f16, Q4_1 and Q5_1);
//! * Q4_K, Q5_K: the eight 6-bit sub-block scales (8 x 16 u8, sub-block `s` lane `r` at
//!   `16s + r`), the eight 6-bit mins in pairs (4 x 32 u8, pair `k` lane `r` at `32k + 2r`,
//!   `32k + 2r + 1`), `d` and `dmin` (16 f16 each);
//! * Q3_K, Q6_K: the sixteen signed scales of 16 values (16 x 16 i8), then `d` (16 f16);
//! * Q2_K: its sixteen bytes of a 4-bit scale and a 4-bit min per 16 values as the file has
//!   them, in pairs (8 x 32 u8, as Q4_K's mins), `d` and `dmin` (16 f16 each).
//!
//! So every kind keeps the file's bytes, but Q3_K, Q4_K and Q5_K, whose 6-bit scales take 16
//! bytes per row and block instead of 12.
//!
//! The activation row: `[quants: i8 per value][d: f32 per block][corrections][sums]`, where the
//! corrections (`-offset · Σq`, undoing a stored offset) are one i32 per block for the legacy
//! kinds and one per 16 values for Q3_K and Q6_K, and the sums are `Σq · d` as f32 per block
//! (Q4_1, Q5_1) or the integer sum of the values under each integer min as i16 (Q2_K: 16 values,
//! Q4_K, Q5_K: 32). Legacy kinds quantize activations as Q8_0 / Q8_1 blocks, K-quants as Q8_K
//! blocks.
//!
//! Per row and block the kernel computes an exact integer sum (for the K-quants, each
//! sub-block's sum times its integer scale, and the mins times the activation sums, all in i32),
//! converts it once, and adds it times `d_w · d_a` to the row's running sum with one fused
//! multiply-add. Scales are rounded exactly as ggml's formats round them, so products equal the
//! ggml kernels' up to summation order; the order is fixed per element, so no grouping of rows
//! or activations changes a result.

use gguf::quant::{scale_min_k4, QK, QK_K};
use gguf::GgmlType;
use half::f16;

/// Weight rows per panel (the lanes of one 512-bit register).
pub const PANEL: usize = 16;

/// Sub-blocks (of 32 values) in a K-quant block.
const SUBS: usize = QK_K / QK;

/// The weight types with a packed form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PackKind {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl PackKind {
    pub const ALL: [PackKind; 10] = [
        PackKind::Q4_0,
        PackKind::Q4_1,
        PackKind::Q5_0,
        PackKind::Q5_1,
        PackKind::Q8_0,
        PackKind::Q2K,
        PackKind::Q3K,
        PackKind::Q4K,
        PackKind::Q5K,
        PackKind::Q6K,
    ];

    pub fn of(ty: GgmlType) -> Option<PackKind> {
        PackKind::ALL.into_iter().find(|k| k.ggml_type() == ty)
    }

    pub fn ggml_type(self) -> GgmlType {
        match self {
            PackKind::Q4_0 => GgmlType::Q4_0,
            PackKind::Q4_1 => GgmlType::Q4_1,
            PackKind::Q5_0 => GgmlType::Q5_0,
            PackKind::Q5_1 => GgmlType::Q5_1,
            PackKind::Q8_0 => GgmlType::Q8_0,
            PackKind::Q2K => GgmlType::Q2K,
            PackKind::Q3K => GgmlType::Q3K,
            PackKind::Q4K => GgmlType::Q4K,
            PackKind::Q5K => GgmlType::Q5K,
            PackKind::Q6K => GgmlType::Q6K,
        }
    }

    /// A K-quant: blocks of 256 values with integer sub-block scales.
    pub const fn is_k(self) -> bool {
        self.scale_groups() > 0
    }

    /// K-quants: how many integer scales a block has (each for `256 / scale_groups` values);
    /// 0 for the legacy kinds.
    pub const fn scale_groups(self) -> usize {
        match self {
            PackKind::Q4K | PackKind::Q5K => SUBS,
            PackKind::Q2K | PackKind::Q3K | PackKind::Q6K => 2 * SUBS,
            _ => 0,
        }
    }

    /// Values under one integer scale (K-quants).
    pub fn group_values(self) -> usize {
        QK_K / self.scale_groups()
    }

    /// Bits of each value kept in the chunks of a sub-block: whole bytes (Q8_0), crumbs of two
    /// bits (Q2_K, Q3_K) or nibbles.
    pub const fn low_bits(self) -> usize {
        match self {
            PackKind::Q8_0 => 8,
            PackKind::Q2K | PackKind::Q3K => 2,
            _ => 4,
        }
    }

    /// Values per block (one activation scale).
    pub const fn block_values(self) -> usize {
        if self.is_k() {
            QK_K
        } else {
            QK
        }
    }

    /// Bits above the [`PackKind::low_bits`] that each value stores in planes.
    pub const fn high_bits(self) -> usize {
        match self {
            PackKind::Q5_0 | PackKind::Q5_1 | PackKind::Q5K | PackKind::Q3K => 1,
            PackKind::Q6K => 2,
            _ => 0,
        }
    }

    /// Bytes of quants per sub-block (32 values) of a panel: its chunks, then its planes.
    pub const fn sub_bytes(self) -> usize {
        self.chunk_bytes() + 64 * self.high_bits()
    }

    /// Bytes of a sub-block's chunks (the low bits of its values).
    const fn chunk_bytes(self) -> usize {
        PANEL * QK * self.low_bits() / 8
    }

    /// Bytes of quants per block of a panel.
    pub const fn quant_bytes(self) -> usize {
        self.sub_bytes() * self.block_values() / QK
    }

    /// What the unsigned stored weight value must be shifted by: stored = value + offset.
    pub const fn offset(self) -> i32 {
        match self {
            PackKind::Q8_0 => 128,
            PackKind::Q4_0 => 8,
            PackKind::Q5_0 => 16,
            PackKind::Q3K => 4,
            PackKind::Q6K => 32,
            _ => 0,
        }
    }

    /// Legacy kinds with a per-block minimum (`m`, paired with the activation's `Σq · d`).
    pub const fn has_mins(self) -> bool {
        matches!(self, PackKind::Q4_1 | PackKind::Q5_1)
    }

    /// K-quants with integer mins beside their scales (Q2_K, Q4_K, Q5_K), paired with the
    /// activation's integer sums.
    pub const fn has_k_mins(self) -> bool {
        matches!(self, PackKind::Q2K | PackKind::Q4K | PackKind::Q5K)
    }

    /// Offset in a block of the integer scales (K-quants: u8 for Q4_K and Q5_K, i8 for Q3_K and
    /// Q6_K; Q2_K's share their bytes with its mins).
    pub const fn sc_at(self) -> usize {
        self.quant_bytes()
    }

    /// Offset in a block of the K-quant mins, in pairs of u8 (Q2_K: its scale and min bytes
    /// as ggml stores them, the scale in the low nibble, in pairs too).
    pub const fn mins_at(self) -> usize {
        match self {
            PackKind::Q2K => self.sc_at(),
            _ => self.sc_at() + PANEL * SUBS,
        }
    }

    /// Offset in a block of the 16 f16 `d`.
    pub const fn d_at(self) -> usize {
        match self {
            PackKind::Q4K | PackKind::Q5K => self.mins_at() + PANEL * SUBS,
            PackKind::Q2K | PackKind::Q3K | PackKind::Q6K => self.sc_at() + PANEL * 2 * SUBS,
            _ => self.quant_bytes(),
        }
    }

    /// Offset in a block of the 16 f16 `m` (Q4_1, Q5_1) or `dmin` (Q4_K, Q5_K).
    pub const fn m_at(self) -> usize {
        self.d_at() + 2 * PANEL
    }

    /// Bytes of one block of a panel (a constant of the kind, whatever the matrix's width, so
    /// that a kernel made for one kind walks its blocks with a compile-time stride).
    pub const fn block_bytes(self) -> usize {
        let mins = self.has_mins() || self.has_k_mins();
        self.m_at() + if mins { 2 * PANEL } else { 0 }
    }

    /// Offset in a block of the byte holding integer scale `g` of lane `r` (K-quants).
    pub const fn scale_byte_at(self, g: usize, r: usize) -> usize {
        match self {
            PackKind::Q2K => self.min_byte_at(g, r),
            _ => self.sc_at() + PANEL * g + r,
        }
    }

    /// Offset in a block of the byte holding min `g` of lane `r` (K-quants with mins): pairs
    /// of groups side by side, so one widening load gives a lane's pair.
    pub const fn min_byte_at(self, g: usize, r: usize) -> usize {
        self.mins_at() + 32 * (g / 2) + 2 * r + g % 2
    }
}

/// Sizes of the panels and activation rows of one matrix width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub kind: PackKind,
    pub n_cols: usize,
    /// Blocks of [`PackKind::block_values`] values.
    pub n_blocks: usize,
}

impl Layout {
    pub fn new(kind: PackKind, n_cols: usize) -> Layout {
        assert_eq!(
            n_cols % kind.block_values(),
            0,
            "packed rows hold whole blocks"
        );
        Layout {
            kind,
            n_cols,
            n_blocks: n_cols / kind.block_values(),
        }
    }

    pub fn panel_bytes(&self) -> usize {
        self.n_blocks * self.kind.block_bytes()
    }

    /// Offsets in an activation row: quants (one byte per value), d (one f32 per block),
    /// corrections (i32: one per block for legacy kinds with an offset, one per 16 values for
    /// Q3_K and Q6_K), sums (Q4_1, Q5_1: one f32 per block; Q2_K, Q4_K, Q5_K: one i16 per
    /// integer scale).
    pub fn a_d(&self) -> usize {
        self.n_cols
    }

    pub fn a_corr(&self) -> usize {
        self.a_d() + 4 * self.n_blocks
    }

    pub fn corr_bytes(&self) -> usize {
        match self.kind {
            k if k.offset() == 0 => 0,
            k if k.is_k() => 4 * k.scale_groups(),
            _ => 4,
        }
    }

    pub fn a_sums(&self) -> usize {
        self.a_corr() + self.corr_bytes() * self.n_blocks
    }

    pub fn sums_bytes(&self) -> usize {
        if self.kind.has_mins() {
            4
        } else if self.kind.has_k_mins() {
            2 * self.kind.scale_groups()
        } else {
            0
        }
    }

    pub fn a_row_bytes(&self) -> usize {
        self.a_sums() + self.sums_bytes() * self.n_blocks
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

/// One block of a ggml row, decoded: the stored (unsigned) values, the f16 bits of `d` and of
/// `m` / `dmin`, and for K-quants the integer scales (Q3_K and Q6_K: per 16 values, as i8 bits;
/// Q2_K: per 16 values, each byte scale and min as the file has them) and Q4_K's and Q5_K's
/// mins.
struct GgmlBlock {
    q: [u8; QK_K],
    d: [u8; 2],
    m: [u8; 2],
    sc: [u8; 2 * SUBS],
    mins: [u8; SUBS],
}

/// Block `b` of a ggml row of `kind`.
fn ggml_block(kind: PackKind, row: &[u8], b: usize) -> GgmlBlock {
    let size = kind.ggml_type().row_bytes(kind.block_values());
    let blk = &row[b * size..(b + 1) * size];
    let mut out = GgmlBlock {
        q: [0; QK_K],
        d: [blk[0], blk[1]],
        m: [0, 0],
        sc: [0; 2 * SUBS],
        mins: [0; SUBS],
    };
    let q = &mut out.q;
    match kind {
        PackKind::Q4_0 | PackKind::Q4_1 | PackKind::Q5_0 | PackKind::Q5_1 => {
            // [d][m (Q4_1, Q5_1)][qh: u32 (Q5)][qs: 16 bytes of nibbles]
            let head = if kind.has_mins() { 4 } else { 2 };
            let (qh, qs) = if kind.high_bits() == 1 {
                let h = &blk[head..head + 4];
                (u32::from_le_bytes([h[0], h[1], h[2], h[3]]), head + 4)
            } else {
                (0, head)
            };
            for k in 0..16 {
                let hi = |i: usize| (((qh >> i) & 1) << 4) as u8;
                q[k] = (blk[qs + k] & 0x0F) | hi(k);
                q[k + 16] = (blk[qs + k] >> 4) | hi(k + 16);
            }
            if kind.has_mins() {
                out.m = [blk[2], blk[3]];
            }
        }
        PackKind::Q8_0 => {
            for k in 0..QK {
                q[k] = (blk[2 + k] as i8 as i32 + 128) as u8;
            }
        }
        PackKind::Q4K | PackKind::Q5K => {
            // [d][dmin][scales: 12][qh: 32 (Q5_K)][qs: 128]
            out.m = [blk[2], blk[3]];
            let (qh, qs) = if kind == PackKind::Q5K {
                (&blk[16..48], &blk[48..176])
            } else {
                (&blk[0..0], &blk[16..144])
            };
            for s in 0..SUBS {
                (out.sc[s], out.mins[s]) = scale_min_k4(s, &blk[4..16]);
            }
            for j in 0..4 {
                for l in 0..32 {
                    let hi = |bit: usize| {
                        if qh.is_empty() {
                            0
                        } else {
                            ((qh[l] >> bit) & 1) << 4
                        }
                    };
                    q[64 * j + l] = (qs[32 * j + l] & 0xF) | hi(2 * j);
                    q[64 * j + 32 + l] = (qs[32 * j + l] >> 4) | hi(2 * j + 1);
                }
            }
        }
        PackKind::Q6K => {
            // [ql: 128][qh: 64][scales: 16 i8][d]
            out.d = [blk[208], blk[209]];
            for (o, v) in q.iter_mut().zip(gguf::quant::q6k_values(blk)) {
                *o = (v as i32 + 32) as u8;
            }
            out.sc.copy_from_slice(&blk[192..208]);
        }
        PackKind::Q3K => {
            // [hmask: 32][qs: 64][scales: 12, 6-bit, biased by 32][d]
            out.d = [blk[108], blk[109]];
            for (o, v) in q.iter_mut().zip(gguf::quant::q3k_values(blk)) {
                *o = (v + 4) as u8;
            }
            let scales = gguf::quant::q3k_scales(&blk[96..108]);
            out.sc = scales.map(|s| (s - 32) as u8);
        }
        PackKind::Q2K => {
            // [scales: 16, scale | min << 4][qs: 64][d][dmin]
            (out.d, out.m) = ([blk[80], blk[81]], [blk[82], blk[83]]);
            q.copy_from_slice(&gguf::quant::q2k_values(blk));
            out.sc.copy_from_slice(&blk[0..16]);
        }
    }
    out
}

/// Where the low bits of value `k` (0..32) of lane `r` of a sub-block live: byte index, and
/// the shift of their lowest bit.
fn quant_at(kind: PackKind, r: usize, k: usize) -> (usize, usize) {
    // A 64-byte chunk holds four values of each lane per bit position, so it spans 4 * 8 /
    // low_bits values.
    let per_chunk = 32 / kind.low_bits();
    let (c, within) = (k / per_chunk, k % per_chunk);
    (64 * c + 4 * r + within % 4, kind.low_bits() * (within / 4))
}

/// Where the bits above the low bits of value `k` (0..32) of lane `r` of a sub-block live:
/// byte index in the sub-block and the shift of its lowest bit.
fn high_at(kind: PackKind, r: usize, k: usize) -> (usize, usize) {
    let base = kind.chunk_bytes();
    match kind.high_bits() {
        1 => (base + 4 * r + k % 4, k / 4),
        _ => (base + 64 * (k / 16) + 4 * r + k % 4, 2 * ((k % 16) / 4)),
    }
}

/// Repacks up to [`PANEL`] ggml rows (`layout.n_cols` values of `layout.kind` each) into one
/// panel `out` (`layout.panel_bytes()` bytes); missing rows are zero.
pub fn pack_panel(layout: &Layout, rows: &[&[u8]], out: &mut [u8]) {
    assert!(rows.len() <= PANEL);
    let kind = layout.kind;
    out.fill(0);
    let bb = kind.block_bytes();
    let sub = kind.sub_bytes();
    let (low_mask, high_mask) = (low_mask(kind), (1u8 << kind.high_bits()) - 1);
    for b in 0..layout.n_blocks {
        let blk = &mut out[b * bb..(b + 1) * bb];
        for (r, row) in rows.iter().enumerate() {
            let g = ggml_block(kind, row, b);
            for (i, &v) in g.q[..kind.block_values()].iter().enumerate() {
                let (s, k) = (i / QK, i % QK);
                let (at, shift) = quant_at(kind, r, k);
                blk[s * sub + at] |= (v & low_mask) << shift;
                if kind.high_bits() > 0 {
                    let (at, shift) = high_at(kind, r, k);
                    blk[s * sub + at] |= ((v >> kind.low_bits()) & high_mask) << shift;
                }
            }
            blk[kind.d_at() + 2 * r..][..2].copy_from_slice(&g.d);
            if kind.has_mins() || kind.has_k_mins() {
                blk[kind.m_at() + 2 * r..][..2].copy_from_slice(&g.m);
            }
            for (s, &v) in g.sc[..kind.scale_groups()].iter().enumerate() {
                blk[kind.scale_byte_at(s, r)] = v;
            }
            if matches!(kind, PackKind::Q4K | PackKind::Q5K) {
                for (s, &v) in g.mins.iter().enumerate() {
                    blk[kind.min_byte_at(s, r)] = v;
                }
            }
        }
    }
}

/// The mask of a value's low bits (all of a Q8_0 byte).
fn low_mask(kind: PackKind) -> u8 {
    (((1u16 << kind.low_bits()) - 1) & 0xFF) as u8
}

/// The stored (unsigned) value `i` of block `b`, lane `r` of a panel.
fn stored(layout: &Layout, panel: &[u8], r: usize, b: usize, i: usize) -> i32 {
    let kind = layout.kind;
    let sub = &panel[b * kind.block_bytes() + (i / QK) * kind.sub_bytes()..];
    let k = i % QK;
    let (at, shift) = quant_at(kind, r, k);
    let low = (sub[at] >> shift) & low_mask(kind);
    let top = if kind.high_bits() > 0 {
        let (at, shift) = high_at(kind, r, k);
        ((sub[at] >> shift) & ((1 << kind.high_bits()) - 1)) << kind.low_bits()
    } else {
        0
    };
    (low | top) as i32
}

/// `d` and `m` (or `dmin`) of block `b`, lane `r` of a panel.
fn scales(layout: &Layout, panel: &[u8], r: usize, b: usize) -> (f32, f32) {
    let at = b * layout.kind.block_bytes();
    let m = if layout.kind.has_mins() || layout.kind.has_k_mins() {
        f16_at(panel, at + layout.kind.m_at() + 2 * r)
    } else {
        0.0
    };
    (f16_at(panel, at + layout.kind.d_at() + 2 * r), m)
}

/// The integer scale `g` of a K-quant block `b`, lane `r` (of [`PackKind::group_values`]
/// values), and its min.
fn k_scale(layout: &Layout, panel: &[u8], r: usize, b: usize, g: usize) -> i32 {
    let v = panel[b * layout.kind.block_bytes() + layout.kind.scale_byte_at(g, r)];
    match layout.kind {
        PackKind::Q3K | PackKind::Q6K => v as i8 as i32,
        PackKind::Q2K => (v & 0x0F) as i32,
        _ => v as i32,
    }
}

fn k_min(layout: &Layout, panel: &[u8], r: usize, b: usize, g: usize) -> i32 {
    let v = panel[b * layout.kind.block_bytes() + layout.kind.min_byte_at(g, r)];
    match layout.kind {
        PackKind::Q2K => (v >> 4) as i32,
        _ => v as i32,
    }
}

/// Decodes lane `r` of a panel into `out` (`layout.n_cols` values): the values the ggml row
/// decodes to, by the same float operations as [`gguf::quant::dequantize`].
pub fn dequantize_panel_row(layout: &Layout, panel: &[u8], r: usize, out: &mut [f32]) {
    let kind = layout.kind;
    let offset = kind.offset();
    for (b, ob) in out.chunks_exact_mut(kind.block_values()).enumerate() {
        let (d, m) = scales(layout, panel, r, b);
        for (i, o) in ob.iter_mut().enumerate() {
            let v = stored(layout, panel, r, b, i) - offset;
            *o = match kind {
                PackKind::Q2K | PackKind::Q4K | PackKind::Q5K => {
                    let g = i / kind.group_values();
                    let (d1, m1) = (
                        d * k_scale(layout, panel, r, b, g) as f32,
                        m * k_min(layout, panel, r, b, g) as f32,
                    );
                    d1 * v as f32 - m1
                }
                PackKind::Q3K | PackKind::Q6K => {
                    d * k_scale(layout, panel, r, b, i / 16) as f32 * v as f32
                }
                _ => v as f32 * d + m,
            };
        }
    }
}

/// Block `b` (the 256 values `xb`) of a K-quant activation row, as [`quantize_act_row`]
/// writes it.
pub(super) fn quantize_k_act_block(layout: &Layout, b: usize, xb: &[f32], out: &mut [u8]) {
    let (d, q) = super::act::q8k_values(xb);
    out[b * QK_K..(b + 1) * QK_K].copy_from_slice(&q.map(|v| v as u8));
    let sums16 = std::array::from_fn(|g| q[16 * g..16 * g + 16].iter().map(|&v| v as i32).sum());
    put_k_act_scales(layout, b, d, &sums16, out);
}

/// Block `b`'s scale `d` of a K-quant activation row, and from the sums of its values
/// sixteen at a time, its offset corrections (one per 16 values) or its sums under each
/// integer min (of 16 values for Q2_K, 32 for Q4_K and Q5_K): what every quantizer writes
/// after the quants.
pub(super) fn put_k_act_scales(
    layout: &Layout,
    b: usize,
    d: f32,
    sums16: &[i32; 16],
    out: &mut [u8],
) {
    let kind = layout.kind;
    let offset = kind.offset();
    put_f32(out, layout.a_d() + 4 * b, d);
    if offset != 0 {
        for (g, sum) in sums16.iter().enumerate() {
            let at = layout.a_corr() + layout.corr_bytes() * b + 4 * g;
            out[at..at + 4].copy_from_slice(&(-offset * sum).to_le_bytes());
        }
    }
    if kind.has_k_mins() {
        let per = kind.group_values() / 16;
        for (g, part) in sums16.chunks_exact(per).enumerate() {
            let at = layout.a_sums() + layout.sums_bytes() * b + 2 * g;
            let sum: i32 = part.iter().sum();
            out[at..at + 2].copy_from_slice(&(sum as i16).to_le_bytes());
        }
    }
}

/// Quantizes one activation row `x` into the packed form for `layout` (`a_row_bytes` bytes).
/// Blocks are quantized exactly as [`super::act`] quantizes Q8_0 / Q8_1 / Q8_K blocks.
pub fn quantize_act_row(layout: &Layout, x: &[f32], out: &mut [u8]) {
    let kind = layout.kind;
    let offset = kind.offset();
    if kind.is_k() {
        for (b, xb) in x.chunks_exact(QK_K).enumerate() {
            quantize_k_act_block(layout, b, xb, out);
        }
        return;
    }
    for (b, xb) in x.chunks_exact(QK).enumerate() {
        let (d, q) = super::act::q8_block(xb);
        out[b * QK..(b + 1) * QK].copy_from_slice(&q.map(|v| v as u8));
        put_f32(out, layout.a_d() + 4 * b, f16::from_f32(d).to_f32());
        let sum: i32 = q.iter().map(|&v| v as i32).sum();
        if offset != 0 {
            out[layout.a_corr() + 4 * b..][..4].copy_from_slice(&(-offset * sum).to_le_bytes());
        }
        if kind.has_mins() {
            let s = f16::from_f32(sum as f32 * d).to_f32();
            put_f32(out, layout.a_sums() + 4 * b, s);
        }
    }
}

/// Reference for the panel kernels, element by element in the same order, so the SIMD kernels
/// (AVX2 and AVX-512) must equal it bitwise: `out[r]` = lane `r` of `panel` . `a`.
pub fn panel_reference(layout: &Layout, panel: &[u8], a: &[u8]) -> [f32; PANEL] {
    let kind = layout.kind;
    let bv = kind.block_values();
    let act = |i: usize| a[i] as i8 as i32;
    std::array::from_fn(|r| {
        let (mut acc, mut mins) = (0f32, 0f32);
        for b in 0..layout.n_blocks {
            let (d, m) = scales(layout, panel, r, b);
            let ad = get_f32(a, layout.a_d() + 4 * b);
            let dot_of = |from: usize, to: usize| -> i32 {
                (from..to)
                    .map(|i| stored(layout, panel, r, b, i) * act(bv * b + i))
                    .sum()
            };
            if !kind.is_k() {
                let mut dot = if offset_corrected(kind) {
                    get_i32(a, layout.a_corr() + 4 * b)
                } else {
                    0
                };
                dot += dot_of(0, QK);
                acc = (dot as f32).mul_add(d * ad, acc);
                if kind.has_mins() {
                    mins = m.mul_add(get_f32(a, layout.a_sums() + 4 * b), mins);
                }
                continue;
            }
            let (mut total, mut msum) = (0i32, 0i32);
            let gv = kind.group_values();
            for g in 0..kind.scale_groups() {
                let mut dot = dot_of(gv * g, gv * g + gv);
                if kind.offset() != 0 {
                    dot += get_i32(a, layout.a_corr() + layout.corr_bytes() * b + 4 * g);
                }
                total += k_scale(layout, panel, r, b, g) * dot;
                if kind.has_k_mins() {
                    let at = layout.a_sums() + layout.sums_bytes() * b + 2 * g;
                    let asum = i16::from_le_bytes([a[at], a[at + 1]]) as i32;
                    msum += k_min(layout, panel, r, b, g) * asum;
                }
            }
            if kind.has_k_mins() {
                mins = (msum as f32).mul_add(m * ad, mins);
            }
            acc = (total as f32).mul_add(d * ad, acc);
        }
        if kind.is_k() {
            acc - mins
        } else {
            acc + mins
        }
    })
}

/// Legacy kinds whose activation row carries a per-block offset correction.
fn offset_corrected(kind: PackKind) -> bool {
    !kind.is_k() && kind.offset() != 0
}

#[cfg(target_arch = "x86_64")]
pub mod avx2;
pub mod portable;
#[cfg(target_arch = "x86_64")]
pub mod vnni;

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::tests::data;

    const LEGACY: [PackKind; 5] = [
        PackKind::Q4_0,
        PackKind::Q4_1,
        PackKind::Q5_0,
        PackKind::Q5_1,
        PackKind::Q8_0,
    ];

    /// Row widths to test a kind at: several blocks, and one block.
    fn widths(kind: PackKind) -> [usize; 3] {
        if kind.is_k() {
            [256, 768, 1536]
        } else {
            [32, 96, 576]
        }
    }

    /// One ggml row of `kind`, quantized from test values.
    fn ggml_row(kind: PackKind, n: usize, seed: u32) -> Vec<u8> {
        gguf::quant::quantize(kind.ggml_type(), &data(n, seed)).unwrap()
    }

    /// `n_rows` ggml rows of `kind` and the panel they pack into.
    fn rows_and_panel(
        kind: PackKind,
        n_rows: usize,
        n: usize,
        seed: u32,
    ) -> (Vec<Vec<u8>>, Vec<u8>) {
        let layout = Layout::new(kind, n);
        let rows: Vec<Vec<u8>> = (0..n_rows)
            .map(|r| ggml_row(kind, n, seed + r as u32))
            .collect();
        let refs: Vec<&[u8]> = rows.iter().map(Vec::as_slice).collect();
        let mut panel = vec![0u8; layout.panel_bytes()];
        pack_panel(&layout, &refs, &mut panel);
        (rows, panel)
    }

    #[test]
    fn panels_decode_to_the_ggml_values_and_hold_as_many_bytes() {
        for kind in PackKind::ALL {
            for n in widths(kind) {
                let layout = Layout::new(kind, n);
                // Q3_K, Q4_K and Q5_K keep their twelve bytes of 6-bit scales (and mins) as
                // sixteen.
                let unpacked = match kind {
                    PackKind::Q3K | PackKind::Q4K | PackKind::Q5K => 4 * layout.n_blocks,
                    _ => 0,
                };
                assert_eq!(
                    layout.panel_bytes(),
                    PANEL * (kind.ggml_type().row_bytes(n) + unpacked),
                    "{kind:?}: a panel holds its rows' bytes"
                );
                let (rows, panel) = rows_and_panel(kind, 11, n, 3);
                for r in 0..PANEL {
                    let mut want = vec![0f32; n];
                    if let Some(row) = rows.get(r) {
                        gguf::quant::dequantize(kind.ggml_type(), row, &mut want).unwrap();
                    }
                    let mut got = vec![1f32; n];
                    dequantize_panel_row(&layout, &panel, r, &mut got);
                    let same = want.iter().zip(&got).all(|(w, g)| w == g);
                    assert!(same, "{kind:?} n={n} lane {r}");
                }
            }
        }
    }

    /// The panel product equals the ggml-format reference kernel up to summation order.
    #[test]
    fn panel_product_matches_the_ggml_kernel() {
        let scalar = super::super::Kernels::new(super::super::Isa::Scalar).unwrap();
        let mut scratch = Vec::new();
        for kind in PackKind::ALL {
            for n in widths(kind) {
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

    /// The SIMD activation quantizers write bitwise the reference's bytes, including blocks
    /// of zeros, exact halves, a lone maximum, a NaN and (K-quants) a block too small to
    /// scale: AVX-512's for every kind, AVX2's for the K-quants.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_activation_quantizer_equals_the_reference_bitwise() {
        use super::super::Isa;
        let test = "simd_activation_quantizer_equals_the_reference_bitwise";
        let (avx2, avx512) = (Isa::Avx2.testable(test), Isa::Avx512Vnni.testable(test));
        // 48 blocks (three groups of sixteen), 18 (one and a part), 7 (a part only); the
        // K-quants' blocks of 256: six, and one.
        let legacy = LEGACY.iter().flat_map(|&k| [(k, 1536), (k, 576), (k, 224)]);
        let k_quants = PackKind::ALL
            .into_iter()
            .filter(|k| k.is_k())
            .flat_map(|k| [(k, 1536), (k, 256)]);
        for (kind, n) in legacy.chain(k_quants) {
            let layout = Layout::new(kind, n);
            let mut x = data(n, 7);
            x[32..64].fill(0.0);
            for (i, v) in x[64..96].iter_mut().enumerate() {
                *v = (i as f32 - 15.5) * 127.0 / 16.0 / 15.5;
            }
            x[100] = 3.0e4;
            x[200] = -1.0e-30;
            if n > 256 {
                // NaNs (in either half of a block of 32), and (a block of 256) the largest
                // magnitude twice, of both signs (the first is the signed maximum).
                x[300] = f32::NAN;
                x[350] = f32::NAN;
                x[320] = -2.5e3;
                x[400] = 2.5e3;
                x[512..n.min(768)].fill(0.0);
            }
            if n > 1024 {
                // Blocks whose scale overflows (-127 / 1e-38 for a K-quant, 127 / (1e-38 /
                // 127) for the others), with a subnormal in one.
                x[768..1024].fill(1.0e-38);
                x[800] = -1.0e-39;
            }
            let mut want = vec![0u8; layout.a_row_bytes()];
            quantize_act_row(&layout, &x, &mut want);
            let check = |isa: &str, quantize: unsafe fn(&Layout, &[f32], &mut [u8])| {
                let mut got = vec![1u8; layout.a_row_bytes()];
                // SAFETY: support checked by the caller.
                unsafe { quantize(&layout, &x, &mut got) };
                assert_eq!(want, got, "{isa} {kind:?} {n}");
            };
            if avx512 {
                if kind.is_k() {
                    check("avx512", vnni::quantize_k_act_row);
                } else {
                    check("avx512", vnni::quantize_act_row);
                }
            }
            if avx2 && kind.is_k() {
                check("avx2", avx2::quantize_k_act_row);
            }
        }
    }

    /// The kernel families this CPU runs (the others named on stderr as not checked).
    fn kernels_here() -> Vec<super::super::Kernels> {
        use super::super::{Isa, Kernels};
        [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni]
            .into_iter()
            .filter_map(|isa| {
                let k = Kernels::new(isa);
                if k.is_none() {
                    eprintln!("{} not on this CPU: not checked", isa.name());
                }
                k
            })
            .collect()
    }

    /// With every instruction set this CPU has, every grouping of activation rows, on a run
    /// of panels whose last is partial, gives bitwise the element-by-element reference, and
    /// nothing is written past the last row.
    #[test]
    fn panel_kernel_equals_the_reference_bitwise() {
        let fast = super::super::Kernels::detect();
        let isas = kernels_here();
        for kind in PackKind::ALL {
            let n = if kind.is_k() { 768 } else { 576 + 32 };
            let layout = Layout::new(kind, n);
            // The last panel partial in its second half of eight rows.
            let n_rows = 2 * PANEL + 11;
            let panels: Vec<u8> = (0..3)
                .flat_map(|p| rows_and_panel(kind, PANEL, n, 40 + 100 * p as u32).1)
                .collect();
            let acts: Vec<Vec<u8>> = (0..11)
                .map(|r| {
                    let mut a = vec![0u8; layout.a_row_bytes()];
                    let mut x = data(n, 80 + r);
                    // Activations at full scale, so that the integer sums are large.
                    if r == 3 {
                        x.iter_mut().for_each(|v| *v = v.signum());
                    }
                    fast.quantize_packed_act(&layout, &x, &mut a);
                    a
                })
                .collect();
            let a: Vec<&[u8]> = acts.iter().map(Vec::as_slice).collect();
            let stride = n_rows + 3;
            for k in &isas {
                let mut out = vec![f32::NAN; a.len() * stride];
                // SAFETY: `out` holds `a.len()` rows of `stride >= n_rows` values.
                unsafe { k.packed_panels(&layout, &panels, n_rows, &a, out.as_mut_ptr(), stride) };
                for (j, aj) in a.iter().enumerate() {
                    for (p, panel) in panels.chunks_exact(layout.panel_bytes()).enumerate() {
                        let want = panel_reference(&layout, panel, aj);
                        for r in 0..PANEL.min(stride - p * PANEL) {
                            let got = out[j * stride + p * PANEL + r];
                            if p * PANEL + r < n_rows {
                                assert_eq!(
                                    got.to_bits(),
                                    want[r].to_bits(),
                                    "{kind:?} {} [{j}][{r}]",
                                    k.isa().name()
                                );
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

    /// Every stored value at its largest (all quant bits set) against activations all -128,
    /// all 127 or alternating, alone and four at a time: the kernels' integer sums are sized
    /// for exactly these bounds (AVX2 adds products in i16 lanes), and must neither saturate
    /// nor wrap.
    #[test]
    fn panel_kernel_at_extreme_values_equals_the_reference_bitwise() {
        let fast = super::super::Kernels::detect();
        let isas = kernels_here();
        for kind in PackKind::ALL {
            let n = if kind.is_k() { 512 } else { 64 };
            let layout = Layout::new(kind, n);
            let (_, mut panel) = rows_and_panel(kind, PANEL, n, 9);
            let bb = kind.block_bytes();
            for b in 0..layout.n_blocks {
                panel[b * bb..b * bb + kind.quant_bytes()].fill(0xFF);
            }
            let acts: Vec<Vec<u8>> = [[0x80u8, 0x80], [0x7F, 0x7F], [0x80, 0x7F], [0x7F, 0x80]]
                .into_iter()
                .cycle()
                .take(5)
                .map(|[even, odd]| {
                    let mut a = vec![0u8; layout.a_row_bytes()];
                    fast.quantize_packed_act(&layout, &data(n, 3), &mut a);
                    for (i, q) in a[..n].iter_mut().enumerate() {
                        *q = if i % 2 == 0 { even } else { odd };
                    }
                    a
                })
                .collect();
            let a: Vec<&[u8]> = acts.iter().map(Vec::as_slice).collect();
            for k in &isas {
                let mut out = vec![f32::NAN; a.len() * PANEL];
                // SAFETY: `out` holds `a.len()` rows of PANEL values.
                unsafe { k.packed_panels(&layout, &panel, PANEL, &a, out.as_mut_ptr(), PANEL) };
                for (j, aj) in a.iter().enumerate() {
                    let want = panel_reference(&layout, &panel, aj);
                    for (r, want) in want.iter().enumerate() {
                        assert!(want.is_finite(), "{kind:?} reference [{j}][{r}]");
                        assert_eq!(
                            out[j * PANEL + r].to_bits(),
                            want.to_bits(),
                            "{kind:?} {} [{j}][{r}]: {} vs {want}",
                            k.isa().name(),
                            out[j * PANEL + r]
                        );
                    }
                }
            }
        }
    }
}
