//! Reference codecs for the block formats: plain scalar code, written for clarity. The fast
//! paths live in the `model` crate and are tested against these.
//!
//! Layouts follow ggml (all little endian). `QK` is 32 for the legacy formats and 256 for K-quants.

use half::{bf16, f16};

use crate::{Error, GgmlType};

pub const QK: usize = 32;
pub const QK_K: usize = 256;

#[inline]
pub fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

#[inline]
fn put_f16(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// The 6-bit scale and min of sub-block `j` in a Q4_K / Q5_K `scales[12]` field.
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 16 signed scales of a Q3_K block from its packed `scales[12]` field.
pub fn q3k_scales(packed: &[u8]) -> [i8; 16] {
    let mut aux = [0u32; 4];
    for (i, a) in aux.iter_mut().take(3).enumerate() {
        *a = u32::from_le_bytes([
            packed[4 * i],
            packed[4 * i + 1],
            packed[4 * i + 2],
            packed[4 * i + 3],
        ]);
    }
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4);
    aux[3] = ((aux[1] >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4);
    aux[0] = (aux[0] & KMASK2) | ((tmp & KMASK1) << 4);
    aux[1] = (aux[1] & KMASK2) | (((tmp >> 2) & KMASK1) << 4);
    let mut out = [0i8; 16];
    for (i, a) in aux.iter().enumerate() {
        for (k, byte) in a.to_le_bytes().iter().enumerate() {
            out[4 * i + k] = *byte as i8;
        }
    }
    out
}

fn check_len(ty: GgmlType, bytes: &[u8], out: &[f32]) -> Result<(), Error> {
    if !out.len().is_multiple_of(ty.block_size()) {
        return Err(Error::BadLength {
            what: "dequantize output",
            len: out.len(),
            multiple: ty.block_size(),
        });
    }
    let need = ty.row_bytes(out.len());
    if bytes.len() != need {
        return Err(Error::BadLength {
            what: "dequantize input bytes",
            len: bytes.len(),
            multiple: ty.type_size(),
        });
    }
    Ok(())
}

/// Decodes `out.len()` values of type `ty` from `bytes`.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), Error> {
    check_len(ty, bytes, out)?;
    let bs = ty.type_size();
    let n = ty.block_size();
    for (blk, y) in bytes.chunks_exact(bs).zip(out.chunks_exact_mut(n)) {
        dequantize_block(ty, blk, y);
    }
    Ok(())
}

fn dequantize_block(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    match ty {
        GgmlType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => y[0] = f16_at(b, 0),
        GgmlType::BF16 => y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::Q4_0 => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                y[j] = ((b[2 + j] & 0xF) as i32 - 8) as f32 * d;
                y[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        GgmlType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for j in 0..16 {
                y[j] = (b[4 + j] & 0xF) as f32 * d + m;
                y[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let legacy0 = ty == GgmlType::Q5_0;
            let d = f16_at(b, 0);
            let (m, qh_at) = if legacy0 { (0.0, 2) } else { (f16_at(b, 2), 4) };
            let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
            let qs = &b[qh_at + 4..];
            let off = if legacy0 { 16 } else { 0 };
            for j in 0..16 {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                let x0 = ((qs[j] as u32 & 0xF) | h0) as i32 - off;
                let x1 = ((qs[j] as u32 >> 4) | h1) as i32 - off;
                y[j] = x0 as f32 * d + m;
                y[j + 16] = x1 as f32 * d + m;
            }
        }
        GgmlType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        GgmlType::Q8_1 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = (b[4 + j] as i8) as f32 * d;
            }
        }
        GgmlType::Q2K => dequant_q2k(b, y),
        GgmlType::Q3K => dequant_q3k(b, y),
        GgmlType::Q4K => dequant_q4k(b, y),
        GgmlType::Q5K => dequant_q5k(b, y),
        GgmlType::Q6K => dequant_q6k(b, y),
        GgmlType::Q8K => {
            let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            for j in 0..QK_K {
                y[j] = (b[4 + j] as i8) as f32 * d;
            }
        }
    }
}

/// The 256 unsigned 2-bit values of a Q2_K block, in element order; element `i` is
/// `d * (scales[i / 16] & 0xF) * q - dmin * (scales[i / 16] >> 4)` (`scales` the bytes 0..16,
/// `d` and `dmin` the f16 at bytes 80 and 82).
pub fn q2k_values(b: &[u8]) -> [u8; QK_K] {
    // Element 128n + 32k + l sits in bits 2k of byte 16 + 32n + l.
    std::array::from_fn(|i| (b[16 + 32 * (i / 128) + i % 32] >> (2 * ((i % 128) / 32))) & 3)
}

fn dequant_q2k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (i, q) in q2k_values(b).into_iter().enumerate() {
        let sc = b[i / 16];
        let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
        y[i] = dl * q as f32 - ml;
    }
}

/// The 256 signed 3-bit values (-4..=3) of a Q3_K block, in element order; element `i` is
/// scaled by `q3k_scales[i / 16] - 32` times `d` (the f16 at byte 108).
pub fn q3k_values(b: &[u8]) -> [i8; QK_K] {
    // Element 128n + 32k + l: bits 2k of byte 32 + 32n + l, and bit 4n + k of hmask byte l
    // (clear means 4 is subtracted).
    std::array::from_fn(|i| {
        let (n, k, l) = (i / 128, (i % 128) / 32, i % 32);
        let lo = ((b[32 + 32 * n + l] >> (2 * k)) & 3) as i8;
        let high = (b[l] >> (4 * n + k)) & 1;
        lo - if high != 0 { 0 } else { 4 }
    })
}

fn dequant_q3k(b: &[u8], y: &mut [f32]) {
    let scales = q3k_scales(&b[96..108]);
    let d = f16_at(b, 108);
    for (i, q) in q3k_values(b).into_iter().enumerate() {
        let dl = d * (scales[i / 16] as i32 - 32) as f32;
        y[i] = dl * q as f32;
    }
}

fn dequant_q4k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for j in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &qs[32 * j..32 * j + 32];
        for l in 0..32 {
            y[64 * j + l] = d1 * (q[l] & 0xF) as f32 - min1;
            y[64 * j + 32 + l] = d2 * (q[l] >> 4) as f32 - min2;
        }
    }
}

/// The 256 unsigned 5-bit values of a Q5_K block, in element order; sub-block `s` (values
/// `32s..32s + 32`) has the scale and min [`scale_min_k4`]`(s, &b[4..16])`.
pub fn q5k_values(b: &[u8]) -> [u8; QK_K] {
    let (qh, qs) = (&b[16..48], &b[48..176]);
    // Element 64j + 32h + l: nibble h of qs[32j + l], fifth bit 2j + h of qh[l].
    std::array::from_fn(|i| {
        let (j, h, l) = (i / 64, (i % 64) / 32, i % 32);
        let nib = (qs[32 * j + l] >> (4 * h)) & 0xF;
        nib | (((qh[l] >> (2 * j + h)) & 1) << 4)
    })
}

fn dequant_q5k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    for (i, q) in q5k_values(b).into_iter().enumerate() {
        let (sc, m) = scale_min_k4(i / 32, &b[4..16]);
        y[i] = d * sc as f32 * q as f32 - dmin * m as f32;
    }
}

/// The 256 signed 6-bit values (`q - 32`) of a Q6_K block, in element order; element `i` is
/// scaled by `scales[i / 16]` (the i8 at byte `192 + i / 16`) times `d` (f16 at byte 208).
pub fn q6k_values(b: &[u8]) -> [i8; QK_K] {
    let mut out = [0i8; QK_K];
    for n in 0..2 {
        let (ql, qh) = (&b[64 * n..128], &b[128 + 32 * n..192]);
        let o = &mut out[128 * n..];
        for l in 0..32 {
            o[l] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
            o[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            o[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            o[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    out
}

fn dequant_q6k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for (i, q) in q6k_values(b).into_iter().enumerate() {
        y[i] = d * (b[192 + i / 16] as i8) as f32 * q as f32;
    }
}

/// Encodes `src` as `ty` with simple round-to-nearest reference quantizers (good enough for
/// test models; not llama.cpp's importance-weighted search).
pub fn quantize(ty: GgmlType, src: &[f32]) -> Result<Vec<u8>, Error> {
    if !src.len().is_multiple_of(ty.block_size()) {
        return Err(Error::BadLength {
            what: "quantize input",
            len: src.len(),
            multiple: ty.block_size(),
        });
    }
    let mut out = Vec::with_capacity(ty.row_bytes(src.len()));
    match ty {
        GgmlType::F32 => src
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => src.iter().for_each(|&v| put_f16(&mut out, v)),
        GgmlType::BF16 => src
            .iter()
            .for_each(|&v| out.extend_from_slice(&bf16::from_f32(v).to_le_bytes())),
        GgmlType::Q4_0 | GgmlType::Q5_0 => {
            let (levels, half) = if ty == GgmlType::Q4_0 {
                (15, 8.5)
            } else {
                (31, 16.5)
            };
            for x in src.chunks_exact(QK) {
                let max = x
                    .iter()
                    .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -(half - 0.5);
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q: Vec<u8> = x
                    .iter()
                    .map(|&v| ((v * id + half) as i32).clamp(0, levels) as u8)
                    .collect();
                put_f16(&mut out, d);
                pack_low_bits(&mut out, &q, ty == GgmlType::Q5_0);
            }
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 => {
            let levels = if ty == GgmlType::Q4_1 { 15 } else { 31 };
            for x in src.chunks_exact(QK) {
                let min = x.iter().copied().fold(f32::INFINITY, f32::min);
                let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / levels as f32;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q: Vec<u8> = x
                    .iter()
                    .map(|&v| (((v - min) * id + 0.5) as i32).clamp(0, levels) as u8)
                    .collect();
                put_f16(&mut out, d);
                put_f16(&mut out, min);
                pack_low_bits(&mut out, &q, ty == GgmlType::Q5_1);
            }
        }
        GgmlType::Q8_0 | GgmlType::Q8_1 => {
            for x in src.chunks_exact(QK) {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q: Vec<i8> = x.iter().map(|&v| (v * id).round() as i8).collect();
                put_f16(&mut out, d);
                if ty == GgmlType::Q8_1 {
                    put_f16(
                        &mut out,
                        q.iter().map(|&v| v as i32).sum::<i32>() as f32 * d,
                    );
                }
                out.extend(q.iter().map(|&v| v as u8));
            }
        }
        GgmlType::Q2K => src
            .chunks_exact(QK_K)
            .for_each(|x| quantize_q2k(x, &mut out)),
        GgmlType::Q3K => src
            .chunks_exact(QK_K)
            .for_each(|x| quantize_q3k(x, &mut out)),
        GgmlType::Q4K => src
            .chunks_exact(QK_K)
            .for_each(|x| quantize_q45k(x, 15, &mut out)),
        GgmlType::Q5K => src
            .chunks_exact(QK_K)
            .for_each(|x| quantize_q45k(x, 31, &mut out)),
        GgmlType::Q6K => src
            .chunks_exact(QK_K)
            .for_each(|x| quantize_q6k(x, &mut out)),
        GgmlType::Q8K => {
            for x in src.chunks_exact(QK_K) {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q: Vec<i8> = x
                    .iter()
                    .map(|&v| (v * id).round().clamp(-127.0, 127.0) as i8)
                    .collect();
                out.extend_from_slice(&d.to_le_bytes());
                out.extend(q.iter().map(|&v| v as u8));
                for s in q.chunks_exact(16) {
                    out.extend_from_slice(
                        &(s.iter().map(|&v| v as i16).sum::<i16>()).to_le_bytes(),
                    );
                }
            }
        }
    }
    Ok(out)
}

/// Packs 32 values as nibbles (value j in the low half of byte j, value j+16 in the high half),
/// preceded, for 5-bit formats, by the 32 fifth bits as a little-endian u32.
fn pack_low_bits(out: &mut Vec<u8>, q: &[u8], five_bits: bool) {
    if five_bits {
        let mut qh = 0u32;
        for (j, &v) in q.iter().enumerate() {
            qh |= (((v >> 4) & 1) as u32) << j;
        }
        out.extend_from_slice(&qh.to_le_bytes());
    }
    for j in 0..16 {
        out.push((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4));
    }
}

/// The signed value of largest magnitude in `x` (the first, on a tie); 0 for an empty slice.
fn signed_max(x: &[f32]) -> f32 {
    x.iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

/// Unsigned values with a per-group min, `x ~= scale * q - min` with `q` in `0..=levels` and
/// `min >= 0`: the integer scales and mins (`0..=top` each, of `d` and `dmin`), the two
/// super-block scales as stored (f16) and the values. `groups` is the number of groups.
struct MinQuant {
    ls: Vec<u8>,
    lm: Vec<u8>,
    d: f32,
    dmin: f32,
    q: [u8; QK_K],
}

fn quantize_with_mins(x: &[f32], groups: usize, levels: u8, top: u8) -> MinQuant {
    let size = QK_K / groups;
    let (mut scales, mut mins) = (vec![0f32; groups], vec![0f32; groups]);
    for (j, sub) in x.chunks_exact(size).enumerate() {
        let lo = sub.iter().copied().fold(f32::INFINITY, f32::min).min(0.0);
        let hi = sub.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        scales[j] = (hi - lo) / levels as f32;
        mins[j] = -lo;
    }
    let d = scales.iter().copied().fold(0f32, f32::max) / top as f32;
    let dmin = mins.iter().copied().fold(0f32, f32::max) / top as f32;
    let int = |v: f32, of: f32| {
        if of > 0.0 {
            (v / of).round().min(top as f32) as u8
        } else {
            0
        }
    };
    let ls: Vec<u8> = scales.iter().map(|&s| int(s, d)).collect();
    let lm: Vec<u8> = mins.iter().map(|&m| int(m, dmin)).collect();
    let (d16, dmin16) = (f16::from_f32(d).to_f32(), f16::from_f32(dmin).to_f32());
    let mut q = [0u8; QK_K];
    for j in 0..groups {
        let (sc, m) = (d16 * ls[j] as f32, dmin16 * lm[j] as f32);
        for l in 0..size {
            let v = if sc > 0.0 {
                ((x[size * j + l] + m) / sc).round()
            } else {
                0.0
            };
            q[size * j + l] = v.clamp(0.0, levels as f32) as u8;
        }
    }
    MinQuant { ls, lm, d, dmin, q }
}

fn quantize_q2k(x: &[f32], out: &mut Vec<u8>) {
    // Sixteen groups of 16 values, x ~= d * sc * q - dmin * m with q in 0..=3 and 4-bit sc, m.
    let mq = quantize_with_mins(x, 16, 3, 15);
    out.extend((0..16).map(|j| mq.ls[j] | (mq.lm[j] << 4)));
    // Value 128n + 32k + l sits in bits 2k of byte 32n + l.
    for n in 0..2 {
        for l in 0..32 {
            let v = |k: usize| mq.q[128 * n + 32 * k + l] << (2 * k);
            out.push(v(0) | v(1) | v(2) | v(3));
        }
    }
    put_f16(out, mq.d);
    put_f16(out, mq.dmin);
}

/// Sixteen groups of 16 values with signed integer scales, `x ~= d * sc * q`: `d`, the scales
/// in `-sc_top..sc_top` (the group scale of largest magnitude maps to `-sc_top`) and the values
/// stored as `q + top` in `0..2 * top` (each group's value of largest magnitude maps to `-top`).
fn signed_groups(x: &[f32], top: i32, sc_top: i32) -> (f32, [i8; 16], [u8; QK_K]) {
    let mut sub_scales = [0f32; 16];
    for (j, sub) in x.chunks_exact(16).enumerate() {
        sub_scales[j] = signed_max(sub) / -(top as f32);
    }
    let d = signed_max(&sub_scales) / -(sc_top as f32);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let sc_range = (-sc_top as f32, (sc_top - 1) as f32);
    let sc = sub_scales.map(|s| (s * id).round().clamp(sc_range.0, sc_range.1) as i8);
    let d16 = f16::from_f32(d).to_f32();
    let mut q = [0u8; QK_K];
    for j in 0..16 {
        let s = d16 * sc[j] as f32;
        for i in 16 * j..16 * j + 16 {
            let v = if s != 0.0 { (x[i] / s).round() } else { 0.0 };
            q[i] = (v.clamp(-top as f32, (top - 1) as f32) as i32 + top) as u8;
        }
    }
    (d, sc, q)
}

fn quantize_q3k(x: &[f32], out: &mut Vec<u8>) {
    // x ~= d * sc * q with q in -4..=3 and sc in -32..=31, q stored as q + 4: two low bits in
    // `qs`, the third in `hmask`.
    let (d, sc, l) = signed_groups(x, 4, 32);
    // Value i = 128n + 32k + idx: bit 4n + k of hmask[idx], bits 2k of qs[32n + idx].
    let mut hmask = [0u8; 32];
    let mut qs = [0u8; 64];
    for (i, &v) in l.iter().enumerate() {
        let (n, k, idx) = (i / 128, (i % 128) / 32, i % 32);
        hmask[idx] |= (v >> 2) << (4 * n + k);
        qs[32 * n + idx] |= (v & 3) << (2 * k);
    }
    // The 6-bit scales (sc + 32): low nibbles in bytes 0..8, top two bits in bytes 8..12.
    let mut packed = [0u8; 12];
    for (j, &s) in sc.iter().enumerate() {
        let u = (s as i32 + 32) as u8;
        packed[j % 8] |= (u & 0xF) << (4 * (j / 8));
        packed[8 + j % 4] |= (u >> 4) << (2 * (j / 4));
    }
    out.extend_from_slice(&hmask);
    out.extend_from_slice(&qs);
    out.extend_from_slice(&packed);
    put_f16(out, d);
}

/// Q4_K (`levels` 15) or Q5_K (31): eight sub-blocks of 32 values, x ~= d * sc * q - dmin * m
/// with 6-bit sc and m.
fn quantize_q45k(x: &[f32], levels: u8, out: &mut Vec<u8>) {
    let mq = quantize_with_mins(x, 8, levels, 63);
    let (ls, lm) = (&mq.ls, &mq.lm);
    let mut packed = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            packed[j] = ls[j];
            packed[j + 4] = lm[j];
        } else {
            packed[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4);
            packed[j - 4] |= (ls[j] >> 4) << 6;
            packed[j] |= (lm[j] >> 4) << 6;
        }
    }
    put_f16(out, mq.d);
    put_f16(out, mq.dmin);
    out.extend_from_slice(&packed);
    let q = &mq.q;
    if levels > 15 {
        // Fifth bits: value 64j + l at bit 2j of qh[l], value 64j + 32 + l at bit 2j + 1.
        out.extend((0..32).map(|l| {
            (0..4).fold(0u8, |h, j| {
                h | ((q[64 * j + l] >> 4) << (2 * j)) | ((q[64 * j + 32 + l] >> 4) << (2 * j + 1))
            })
        }));
    }
    for j in 0..4 {
        for l in 0..32 {
            out.push((q[64 * j + l] & 0xF) | ((q[64 * j + 32 + l] & 0xF) << 4));
        }
    }
}

fn quantize_q6k(x: &[f32], out: &mut Vec<u8>) {
    // x ~= d * sc * (q - 32) with q in 0..64 and sc an i8.
    let (d, sc, q) = signed_groups(x, 32, 128);
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for n in 0..2 {
        for l in 0..32 {
            let base = 128 * n;
            let (q1, q2, q3, q4) = (
                q[base + l],
                q[base + l + 32],
                q[base + l + 64],
                q[base + l + 96],
            );
            ql[64 * n + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
            ql[64 * n + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
            qh[32 * n + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&v| v as u8));
    put_f16(out, d);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect()
    }

    #[test]
    fn round_trips_stay_within_the_format_step() {
        let x = ramp(512);
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (ty, tol) in [
            (GgmlType::F32, 0.0),
            (GgmlType::F16, 1e-3),
            (GgmlType::BF16, 1e-2),
            (GgmlType::Q8_0, amax / 127.0),
            (GgmlType::Q8_1, amax / 127.0),
            (GgmlType::Q8K, amax / 127.0),
            (GgmlType::Q5_0, amax / 15.0),
            (GgmlType::Q5_1, 2.0 * amax / 31.0),
            (GgmlType::Q4_0, amax / 7.0),
            (GgmlType::Q4_1, 2.0 * amax / 15.0),
            (GgmlType::Q2K, 2.0 * amax / 3.0 * 1.2),
            (GgmlType::Q3K, amax / 4.0 * 1.2),
            (GgmlType::Q4K, 2.0 * amax / 15.0 * 1.2),
            (GgmlType::Q5K, 2.0 * amax / 31.0 * 1.2),
            (GgmlType::Q6K, amax / 31.0 * 1.2),
        ] {
            let bytes = quantize(ty, &x).unwrap();
            assert_eq!(bytes.len(), ty.row_bytes(x.len()), "{ty}");
            let mut y = vec![0f32; x.len()];
            dequantize(ty, &bytes, &mut y).unwrap();
            let err = x
                .iter()
                .zip(&y)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err <= tol + 1e-6, "{ty}: max error {err} > {tol}");
        }
    }

    #[test]
    fn wrong_lengths_are_errors_not_panics() {
        let mut y = vec![0f32; 32];
        assert!(dequantize(GgmlType::Q4_0, &[0u8; 17], &mut y).is_err());
        assert!(quantize(GgmlType::Q4_0, &[0.0; 31]).is_err());
        assert!(quantize(GgmlType::Q2K, &[0.0; 255]).is_err());
    }
}
