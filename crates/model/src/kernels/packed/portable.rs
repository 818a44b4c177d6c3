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

/// The exact integer dot product of two runs of values.
fn dot(w: &[i32], a: &[i32]) -> i32 {
    w.iter().zip(a).map(|(w, a)| w * a).sum()
}

/// Every lane of `panel` times every row of `acts` (at most [`MOST_ACTS`]): `out[j][r]` = lane
/// `r` . `acts[j]`, bitwise [`super::panel_reference`]'s (the same exact integer sums, and the
/// same float operations in the same order). A block's values and scales are decoded once for
/// all the rows, and each row's block of activations once for all the lanes.
pub fn panel_products(layout: &Layout, panel: &[u8], acts: &[&[u8]], out: &mut [[f32; PANEL]]) {
    assert_eq!(out.len(), acts.len());
    assert!(acts.len() <= MOST_ACTS);
    let kind = layout.kind;
    let bv = kind.block_values();
    let places = Places::of(kind);
    // Legacy kinds: one group of the block's 32 values.
    let (groups, gv) = if kind.is_k() {
        (kind.scale_groups(), kind.group_values())
    } else {
        (1, QK)
    };
    let mut values = [[0i32; QK_K]; PANEL];
    let mut lane_scales = [(0f32, 0f32); PANEL];
    let mut k_scales = [[0i32; 16]; PANEL];
    let mut k_mins = [[0i32; 16]; PANEL];
    let mut q = [0i32; QK_K];
    let mut acc = [[0f32; PANEL]; MOST_ACTS];
    let mut mins = [[0f32; PANEL]; MOST_ACTS];
    for b in 0..layout.n_blocks {
        decode_block(layout, &places, panel, b, &mut values);
        for r in 0..PANEL {
            lane_scales[r] = scales(layout, panel, r, b);
            if kind.is_k() {
                for g in 0..groups {
                    k_scales[r][g] = k_scale(layout, panel, r, b, g);
                    if kind.has_k_mins() {
                        k_mins[r][g] = k_min(layout, panel, r, b, g);
                    }
                }
            }
        }
        for (j, a) in acts.iter().enumerate() {
            let ad = get_f32(a, layout.a_d() + 4 * b);
            for (q, &x) in q[..bv].iter_mut().zip(&a[bv * b..bv * (b + 1)]) {
                *q = x as i8 as i32;
            }
            if !kind.is_k() {
                let corr = if offset_corrected(kind) {
                    get_i32(a, layout.a_corr() + 4 * b)
                } else {
                    0
                };
                let sum = kind.has_mins().then(|| get_f32(a, layout.a_sums() + 4 * b));
                for (r, lane) in values.iter().enumerate() {
                    let (d, m) = lane_scales[r];
                    let dot = corr + dot(&lane[..QK], &q[..QK]);
                    acc[j][r] = (dot as f32).mul_add(d * ad, acc[j][r]);
                    if let Some(sum) = sum {
                        mins[j][r] = m.mul_add(sum, mins[j][r]);
                    }
                }
                continue;
            }
            let mut corr = [0i32; 16];
            let mut asums = [0i32; 16];
            for g in 0..groups {
                if kind.offset() != 0 {
                    corr[g] = get_i32(a, layout.a_corr() + layout.corr_bytes() * b + 4 * g);
                }
                if kind.has_k_mins() {
                    let at = layout.a_sums() + layout.sums_bytes() * b + 2 * g;
                    asums[g] = i16::from_le_bytes([a[at], a[at + 1]]) as i32;
                }
            }
            for (r, lane) in values.iter().enumerate() {
                let (d, m) = lane_scales[r];
                let (mut total, mut msum) = (0i32, 0i32);
                for g in 0..groups {
                    let at = gv * g;
                    let dot = corr[g] + dot(&lane[at..at + gv], &q[at..at + gv]);
                    total += k_scales[r][g] * dot;
                    msum += k_mins[r][g] * asums[g];
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
