//! Plain scalar dot products of one weight row with one quantized activation row: the
//! reference every SIMD path is tested against. Integer sums are exact, so only the order of
//! the per-block float multiply-adds is fixed here.

use gguf::quant::{f16_at, q2k_values, q3k_scales, q3k_values, q5k_values, q6k_values};
use gguf::quant::{scale_min_k4, QK_K};
use gguf::GgmlType;

pub fn dot_q4_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, ab) in w.chunks_exact(18).zip(a.chunks_exact(34)).take(n / 32) {
        let mut isum = 0i32;
        for j in 0..16 {
            let lo = (wb[2 + j] & 0xF) as i32 - 8;
            let hi = (wb[2 + j] >> 4) as i32 - 8;
            isum += lo * ab[2 + j] as i8 as i32 + hi * ab[18 + j] as i8 as i32;
        }
        sum += f16_at(wb, 0) * f16_at(ab, 0) * isum as f32;
    }
    sum
}

pub fn dot_q4_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, ab) in w.chunks_exact(20).zip(a.chunks_exact(36)).take(n / 32) {
        let mut isum = 0i32;
        for j in 0..16 {
            let lo = (wb[4 + j] & 0xF) as i32;
            let hi = (wb[4 + j] >> 4) as i32;
            isum += lo * ab[4 + j] as i8 as i32 + hi * ab[20 + j] as i8 as i32;
        }
        sum += f16_at(wb, 0) * f16_at(ab, 0) * isum as f32 + f16_at(wb, 2) * f16_at(ab, 2);
    }
    sum
}

/// The 5-bit value `j` (0..32) of a Q5 block: a nibble of `qs` and a bit of `qh`.
fn q5(qs: &[u8], qh: u32, j: usize) -> i32 {
    let nib = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
    (nib as i32) | ((((qh >> j) & 1) as i32) << 4)
}

pub fn dot_q5_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, ab) in w.chunks_exact(22).zip(a.chunks_exact(34)).take(n / 32) {
        let qh = u32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
        let isum: i32 = (0..32)
            .map(|j| (q5(&wb[6..], qh, j) - 16) * ab[2 + j] as i8 as i32)
            .sum();
        sum += f16_at(wb, 0) * f16_at(ab, 0) * isum as f32;
    }
    sum
}

pub fn dot_q5_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, ab) in w.chunks_exact(24).zip(a.chunks_exact(36)).take(n / 32) {
        let qh = u32::from_le_bytes([wb[4], wb[5], wb[6], wb[7]]);
        let isum: i32 = (0..32)
            .map(|j| q5(&wb[8..], qh, j) * ab[4 + j] as i8 as i32)
            .sum();
        sum += f16_at(wb, 0) * f16_at(ab, 0) * isum as f32 + f16_at(wb, 2) * f16_at(ab, 2);
    }
    sum
}

pub fn dot_q8_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, ab) in w.chunks_exact(34).zip(a.chunks_exact(34)).take(n / 32) {
        let mut isum = 0i32;
        for j in 0..32 {
            isum += wb[2 + j] as i8 as i32 * ab[2 + j] as i8 as i32;
        }
        sum += f16_at(wb, 0) * f16_at(ab, 0) * isum as f32;
    }
    sum
}

/// The exact integer dot product of weight values `q` with Q8_K activation bytes `q8` (i8).
fn int_dot<T: Copy + Into<i32>>(q: &[T], q8: &[u8]) -> i32 {
    q.iter()
        .zip(q8)
        .map(|(&v, &y)| v.into() * y as i8 as i32)
        .sum()
}

fn q8k_parts(ab: &[u8]) -> (f32, &[u8], [i16; 16]) {
    let d = f32::from_le_bytes([ab[0], ab[1], ab[2], ab[3]]);
    let mut bsums = [0i16; 16];
    for (j, b) in bsums.iter_mut().enumerate() {
        *b = i16::from_le_bytes([ab[260 + 2 * j], ab[261 + 2 * j]]);
    }
    (d, &ab[4..260], bsums)
}

/// Q4_K and Q5_K blocks: eight sub-blocks of 32 unsigned values `q`, each with a 6-bit scale
/// and min in `scales` (the 12 bytes after `d` and `dmin`).
fn dot_k_mins_block(wb: &[u8], q: &[u8; QK_K], ab: &[u8]) -> f32 {
    let (ad, q8, bsums) = q8k_parts(ab);
    let scales = &wb[4..16];
    let (mut isum, mut msum) = (0i32, 0i32);
    for s in 0..8 {
        let (sc, m) = scale_min_k4(s, scales);
        let at = 32 * s..32 * s + 32;
        isum += int_dot(&q[at.clone()], &q8[at]) * sc as i32;
        msum += m as i32 * (bsums[2 * s] as i32 + bsums[2 * s + 1] as i32);
    }
    f16_at(wb, 0) * ad * isum as f32 - f16_at(wb, 2) * ad * msum as f32
}

pub fn dot_q4k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, ab) in w.chunks_exact(144).zip(a.chunks_exact(292)).take(n / QK_K) {
        let qs = &wb[16..144];
        let q =
            std::array::from_fn(|i| (qs[32 * (i / 64) + i % 32] >> (4 * ((i % 64) / 32))) & 0xF);
        sum += dot_k_mins_block(wb, &q, ab);
    }
    sum
}

pub fn dot_q5k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, ab) in w.chunks_exact(176).zip(a.chunks_exact(292)).take(n / QK_K) {
        sum += dot_k_mins_block(wb, &q5k_values(wb), ab);
    }
    sum
}

pub fn dot_q2k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, ab) in w.chunks_exact(84).zip(a.chunks_exact(292)).take(n / QK_K) {
        let (ad, q8, bsums) = q8k_parts(ab);
        let q = q2k_values(wb);
        let (mut isum, mut msum) = (0i32, 0i32);
        for g in 0..16 {
            let at = 16 * g..16 * g + 16;
            isum += int_dot(&q[at.clone()], &q8[at]) * (wb[g] & 0xF) as i32;
            msum += (wb[g] >> 4) as i32 * bsums[g] as i32;
        }
        sum += f16_at(wb, 80) * ad * isum as f32 - f16_at(wb, 82) * ad * msum as f32;
    }
    sum
}

pub fn dot_q3k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, ab) in w.chunks_exact(110).zip(a.chunks_exact(292)).take(n / QK_K) {
        let (ad, q8, _) = q8k_parts(ab);
        let (q, scales) = (q3k_values(wb), q3k_scales(&wb[96..108]));
        let mut isum = 0i32;
        for g in 0..16 {
            let at = 16 * g..16 * g + 16;
            isum += int_dot(&q[at.clone()], &q8[at]) * (scales[g] as i32 - 32);
        }
        sum += f16_at(wb, 108) * ad * isum as f32;
    }
    sum
}

pub fn dot_q6k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, ab) in w.chunks_exact(210).zip(a.chunks_exact(292)).take(n / QK_K) {
        let (ad, q8, _) = q8k_parts(ab);
        let q = q6k_values(wb);
        let mut isum = 0i32;
        for g in 0..16 {
            let at = 16 * g..16 * g + 16;
            isum += int_dot(&q[at.clone()], &q8[at]) * wb[192 + g] as i8 as i32;
        }
        sum += f16_at(wb, 208) * ad * isum as f32;
    }
    sum
}

/// Any other weight type: decode the weight row to f32 and take a plain f32 dot with the
/// activation row (stored as f32). Slow, exact to the format, used for rare types.
pub fn dot_dequant_f32(ty: GgmlType, n: usize, w: &[u8], a: &[u8], scratch: &mut Vec<f32>) -> f32 {
    scratch.resize(n, 0.0);
    gguf::quant::dequantize(ty, &w[..ty.row_bytes(n)], scratch)
        .expect("row length checked at load");
    let mut sum = 0f32;
    for (x, ab) in scratch.iter().zip(a.chunks_exact(4)) {
        sum += x * f32::from_le_bytes([ab[0], ab[1], ab[2], ab[3]]);
    }
    sum
}
