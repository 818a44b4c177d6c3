//! The panel product without SIMD, for CPUs without AVX2 (and `--isa scalar`): the arithmetic
//! of [`super::panel_reference`], so its results are bitwise those of the AVX2 and AVX-512
//! kernels. The reference finds every value's bits one call at a time; this decodes a block's
//! values for all sixteen lanes once, through a table of where each value's bits live, and
//! multiplies them by every activation row.

use gguf::quant::{QK, QK_K};

use super::{
    get_f32, get_i32, high_at, k_min, k_scale, low_mask, offset_corrected, quant_at, scales,
    Layout, PackKind, PANEL,
};

/// Where each value of a sub-block keeps its bits, for lane 0 (lane `r` is `4r` bytes on):
/// the byte and shift of its low bits and, for kinds with planes, of its high bits.
struct Places {
    low: [(usize, u32); QK],
    high: [(usize, u32); QK],
}

impl Places {
    fn of(kind: PackKind) -> Places {
        let high = kind.high_bits() > 0;
        Places {
            low: std::array::from_fn(|k| {
                let (at, shift) = quant_at(kind, 0, k);
                (at, shift as u32)
            }),
            high: std::array::from_fn(|k| {
                if high {
                    let (at, shift) = high_at(kind, 0, k);
                    (at, shift as u32)
                } else {
                    (0, 0)
                }
            }),
        }
    }
}

/// The stored values of block `b` of a panel, lane by lane (`values[r][i]`).
fn decode_block(
    layout: &Layout,
    places: &Places,
    panel: &[u8],
    b: usize,
    values: &mut [[i32; QK_K]; PANEL],
) {
    let kind = layout.kind;
    let (low_mask, low_bits) = (low_mask(kind) as u32, kind.low_bits() as u32);
    let high_mask = (1u32 << kind.high_bits()) - 1;
    let blk = &panel[b * kind.block_bytes()..];
    for s in 0..kind.block_values() / QK {
        let sub = &blk[s * kind.sub_bytes()..];
        for (r, lane) in values.iter_mut().enumerate() {
            for k in 0..QK {
                let (at, shift) = places.low[k];
                let mut v = (sub[at + 4 * r] as u32 >> shift) & low_mask;
                if high_mask != 0 {
                    let (at, shift) = places.high[k];
                    v |= ((sub[at + 4 * r] as u32 >> shift) & high_mask) << low_bits;
                }
                lane[QK * s + k] = v as i32;
            }
        }
    }
}

/// Most activation rows one call takes (its running sums live on the stack).
pub const MOST_ACTS: usize = 8;

/// Every lane of `panel` times every row of `acts` (at most [`MOST_ACTS`]): `out[j][r]` = lane
/// `r` . `acts[j]`, bitwise [`super::panel_reference`]'s.
pub fn panel_products(layout: &Layout, panel: &[u8], acts: &[&[u8]], out: &mut [[f32; PANEL]]) {
    assert_eq!(out.len(), acts.len());
    assert!(acts.len() <= MOST_ACTS);
    let kind = layout.kind;
    let bv = kind.block_values();
    let places = Places::of(kind);
    let mut values = [[0i32; QK_K]; PANEL];
    let mut acc = [[0f32; PANEL]; MOST_ACTS];
    let mut mins = [[0f32; PANEL]; MOST_ACTS];
    for b in 0..layout.n_blocks {
        decode_block(layout, &places, panel, b, &mut values);
        for (j, a) in acts.iter().enumerate() {
            let ad = get_f32(a, layout.a_d() + 4 * b);
            let q = |i: usize| a[bv * b + i] as i8 as i32;
            for (r, lane) in values.iter().enumerate() {
                let (d, m) = scales(layout, panel, r, b);
                let dot_of =
                    |from: usize, to: usize| -> i32 { (from..to).map(|i| lane[i] * q(i)).sum() };
                if !kind.is_k() {
                    let mut dot = if offset_corrected(kind) {
                        get_i32(a, layout.a_corr() + 4 * b)
                    } else {
                        0
                    };
                    dot += dot_of(0, QK);
                    acc[j][r] = (dot as f32).mul_add(d * ad, acc[j][r]);
                    if kind.has_mins() {
                        mins[j][r] = m.mul_add(get_f32(a, layout.a_sums() + 4 * b), mins[j][r]);
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
                    mins[j][r] = (msum as f32).mul_add(m * ad, mins[j][r]);
                }
                acc[j][r] = (total as f32).mul_add(d * ad, acc[j][r]);
            }
        }
    }
    for (o, (acc, mins)) in out.iter_mut().zip(acc.iter().zip(&mins)) {
        *o = std::array::from_fn(|r| {
            if kind.is_k() {
                acc[r] - mins[r]
            } else {
                acc[r] + mins[r]
            }
        });
    }
}
