//! The wire protocol between tracker and shards (protocol version [`PROTOCOL_VERSION`]).
//!
//! The key design decision: one long-lived bidirectional `Route` stream per hop. The tracker
//! opens it to the first shard with a `RouteSetup` naming the rest of the route; each shard
//! opens the next hop itself, so a step's activations cross each seam exactly once and many
//! steps can be in flight along the route. The last shard answers the tracker directly, on a
//! `Replies` stream the tracker opened on it beforehand (one message per step on the way back,
//! not one per hop); each shard acknowledges every step to the shard before it, which is how
//! in-flight activation bytes are released and a silent or dead shard is noticed. Wire types
//! are converted to domain types at the edges (shard and tracker), never used inside policy code.

/// Generated protobuf messages and the tonic client and server.
#[allow(clippy::all, missing_docs)] // reason: generated code
pub mod v1 {
    tonic::include_proto!("strata.v1");
}

pub use v1::*;

mod refusal;
mod transport;
pub use refusal::{reason_from_wire, reason_to_wire, refusal_status, status_refusal};
pub use transport::{
    channel, connect, secrets_equal, Auth, GrpcShard, Link, ReplyStream, ShardTransport, TokenCheck,
};

/// Bumped on any incompatible change of the messages.
pub const PROTOCOL_VERSION: u32 = 8;

/// The metadata key every connection carries the cluster token in.
pub const TOKEN_HEADER: &str = "x-strata-cluster-token";

/// Largest message either side accepts (a 2048-token prefill of a 4096-wide model in f32 is 32 MiB).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Peak and current resident memory of this process in bytes, from Linux `/proc/self/status`
/// (zeros elsewhere). Every strata process reports it; it lives here because every process
/// links this crate.
pub fn rss_bytes() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// Resident memory of this process in bytes that no file backs (`RssAnon`): the heap, where
/// loaded weights are, without the pages of mapped files (a model's header while it is read).
pub fn anon_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("RssAnon:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// Hands the heap's free pages back to the system, after work that allocated and freed tens of
/// megabytes (loading a model, building a grammar vocabulary, compiling a large grammar):
/// glibc keeps what a thread's arena freed, so without this resident memory stays at the
/// work's peak. Nothing happens where the allocator is not glibc's.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Values per block of a q8_0 seam.
pub const Q8_0_BLOCK: usize = 32;

/// Bytes that `n` activations take on a seam of `dtype`.
pub fn seam_bytes(dtype: SeamDtype, n: usize) -> usize {
    match dtype {
        SeamDtype::SeamF32 => 4 * n,
        SeamDtype::SeamF16 => 2 * n,
        SeamDtype::SeamQ80 => n + 2 * n.div_ceil(Q8_0_BLOCK),
    }
}

/// Encodes activations for the seam.
pub fn encode_activations(x: &[f32], dtype: SeamDtype) -> Vec<u8> {
    match dtype {
        SeamDtype::SeamF32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        SeamDtype::SeamF16 => x
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        SeamDtype::SeamQ80 => {
            let mut out = Vec::with_capacity(seam_bytes(dtype, x.len()));
            for block in x.chunks(Q8_0_BLOCK) {
                // A block holding a value that is not finite decodes to NaN throughout (the
                // fault shows, as f32 would show it); magnitudes past 127 times f16's largest
                // saturate there.
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let scale = if block.iter().all(|v| v.is_finite()) {
                    half::f16::from_f32(amax / 127.0).min(half::f16::MAX)
                } else {
                    half::f16::NAN
                };
                let d = scale.to_f32();
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&scale.to_le_bytes());
                out.extend(
                    block
                        .iter()
                        .map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8),
                );
            }
            out
        }
    }
}

/// Decodes activations from the seam; `None` when the byte count does not fit the dtype.
pub fn decode_activations(bytes: &[u8], dtype: SeamDtype) -> Option<Vec<f32>> {
    match dtype {
        SeamDtype::SeamF32 => bytes.len().is_multiple_of(4).then(|| {
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        }),
        SeamDtype::SeamF16 => bytes.len().is_multiple_of(2).then(|| {
            bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect()
        }),
        SeamDtype::SeamQ80 => {
            // Whole blocks of 2 + 32 bytes, then a last block of 2 + r bytes (0 < r < 32).
            let block = 2 + Q8_0_BLOCK;
            if matches!(bytes.len() % block, 1 | 2) {
                return None;
            }
            let mut out = Vec::with_capacity(bytes.len());
            for b in bytes.chunks(block) {
                let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                out.extend(b[2..].iter().map(|&q| f32::from(q as i8) * d));
            }
            Some(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_seam_round_trips_exactly() {
        let x = [0.0f32, -1.5, 3.25e-7, 65504.0, f32::MIN_POSITIVE];
        let b = encode_activations(&x, SeamDtype::SeamF32);
        assert_eq!(decode_activations(&b, SeamDtype::SeamF32).unwrap(), x);
    }

    #[test]
    fn f16_seam_halves_bytes_and_keeps_three_digits() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.0371).collect();
        let b = encode_activations(&x, SeamDtype::SeamF16);
        assert_eq!(b.len(), 2 * x.len());
        let y = decode_activations(&b, SeamDtype::SeamF16).unwrap();
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= a.abs() * 1e-3 + 1e-4, "{a} vs {b}");
        }
        assert!(decode_activations(&[1, 2, 3], SeamDtype::SeamF16).is_none());
    }

    /// q8_0: about a quarter of f32's bytes (34 a block of 32 values); each value within half
    /// a step of its block's scale; a short last block keeps only its values; a block of zeros
    /// stays zeros; byte counts no encoding gives are refused.
    #[test]
    fn q8_0_seam_takes_34_bytes_a_block_and_keeps_each_value_within_half_a_step() {
        let x: Vec<f32> = (0..1000)
            .map(|i| {
                ((i * 7919) % 1000) as f32 * 0.0123 - 6.0 + if i % 97 == 0 { 40.0 } else { 0.0 }
            })
            .collect();
        let b = encode_activations(&x, SeamDtype::SeamQ80);
        assert_eq!(b.len(), 31 * 34 + 2 + 8);
        assert_eq!(b.len(), seam_bytes(SeamDtype::SeamQ80, x.len()));
        let y = decode_activations(&b, SeamDtype::SeamQ80).unwrap();
        assert_eq!(y.len(), x.len());
        for (block_x, block_y) in x.chunks(32).zip(y.chunks(32)) {
            let amax = block_x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let step = half::f16::from_f32(amax / 127.0).to_f32();
            for (a, b) in block_x.iter().zip(block_y) {
                assert!(
                    (a - b).abs() <= step * 0.5 + amax * 1e-3,
                    "{a} vs {b} (step {step})"
                );
            }
        }
        let zeros = encode_activations(&[0.0; 64], SeamDtype::SeamQ80);
        assert_eq!(
            decode_activations(&zeros, SeamDtype::SeamQ80).unwrap(),
            [0.0; 64]
        );
        for n in [0, 1, 31, 32, 33, 64, 65] {
            assert_eq!(
                seam_bytes(SeamDtype::SeamQ80, n),
                encode_activations(&vec![1.0; n], SeamDtype::SeamQ80).len()
            );
        }
        for bad in [1, 2, 35, 36] {
            assert!(
                decode_activations(&vec![0; bad], SeamDtype::SeamQ80).is_none(),
                "{bad}"
            );
        }
        // Any other count decodes (a peer's bytes never panic), to the values it encodes.
        assert_eq!(
            decode_activations(&[0, 0, 5], SeamDtype::SeamQ80).unwrap(),
            [0.0]
        );
        // Past f16's range the block saturates (no NaN); a value that is not finite makes its
        // block NaN, never zero; the other blocks keep theirs.
        let q8 = SeamDtype::SeamQ80;
        let mut big = vec![1.0f32; 64];
        big[0] = 1e7;
        let y = decode_activations(&encode_activations(&big, q8), q8).unwrap();
        assert!(y.iter().all(|v| v.is_finite()) && y[0] > 8e6, "{}", y[0]);
        for bad in [f32::NAN, f32::INFINITY] {
            let mut x = vec![1.0f32; 64];
            x[3] = bad;
            let y = decode_activations(&encode_activations(&x, q8), q8).unwrap();
            assert!(y[..32].iter().all(|v| v.is_nan()), "{bad}");
            assert!(y[32..].iter().all(|v| (v - 1.0).abs() < 0.01), "{bad}");
        }
    }
}
