//! Kernel throughput, to judge each kernel against the machine's limits: GFLOP/s for the
//! products (criterion's "elem/s" here count floating-point operations, 2 per multiply-add) and
//! GB/s for the memory-bound ones (bytes read). Run: `cargo bench -p model --bench kernels`.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gguf::GgmlType;
use half::f16;
use model::kernels::{act, attn, packed, Kernels, PANEL_ACTS};
use model::matmul::{matmul, ActScratch, Product, QMatrix};
use model::pool::ThreadPool;
use model::{Isa, KvType};

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s as f32 / u32::MAX as f32 * 2.0 - 1.0
        })
        .collect()
}

fn matrix(ty: GgmlType, rows: usize, cols: usize, pack: bool) -> QMatrix {
    let data = gguf::quant::quantize(ty, &values(rows * cols, 7)).expect("a quantizable type");
    QMatrix::new(ty, rows, cols, data, pack)
}

/// The quantized weight types, each with a one-row kernel and a panel kernel, Q4_1 first (the
/// reference point).
const TYPES: [GgmlType; 10] = [
    GgmlType::Q4_1,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// The one-row kernel of each type (ggml's block layout, one thread: the path of CPUs without
/// AVX-512 VNNI), 256 rows of 1536 values (cache-resident, 100-400 KB),
/// in GB/s of weights.
fn row_dot(c: &mut Criterion) {
    let k = Kernels::detect();
    let mut g = c.benchmark_group("row_dot_256x1536");
    let (rows, cols) = (256, 1536);
    for ty in TYPES {
        let w = matrix(ty, rows, cols, false);
        let at = act::act_type(ty);
        let mut a = vec![0u8; at.row_bytes(cols)];
        act::quantize_row(at, &values(cols, 11), &mut a);
        g.throughput(Throughput::Bytes(w.data.len() as u64));
        g.bench_function(BenchmarkId::from_parameter(format!("{ty:?}")), |b| {
            let mut scratch = Vec::new();
            b.iter(|| {
                let mut s = 0f32;
                for r in 0..rows {
                    s += k.dot(ty, cols, black_box(w.row(r)), black_box(&a), &mut scratch);
                }
                black_box(s)
            })
        });
    }
    g.finish();
}

/// Four panels (64 packed weight rows, 21-104 KB: cache-resident) against 8, 4 and 1
/// activation rows, Qwen2.5-1.5B's width (1536): the inner kernel of every product.
fn panel(c: &mut Criterion) {
    let k = Kernels::detect();
    if !k.packs_weights() {
        return;
    }
    // Eight activation rows (prefill), and four and one (batched and single decode steps),
    // whose kernels differ in registers and prefetching.
    for n_acts in [PANEL_ACTS, 4, 1] {
        let mut g = c.benchmark_group(format!("packed_panels_64x{n_acts}"));
        for ty in TYPES {
            let (rows, cols) = (4 * packed::PANEL, 1536);
            let w = matrix(ty, rows, cols, true);
            let layout = w.packed.expect("packed");
            let acts: Vec<Vec<u8>> = (0..n_acts)
                .map(|j| {
                    let mut a = vec![0u8; layout.a_row_bytes()];
                    k.quantize_packed_act(&layout, &values(cols, 11 + j as u32), &mut a);
                    a
                })
                .collect();
            let ar: Vec<&[u8]> = acts.iter().map(Vec::as_slice).collect();
            g.throughput(Throughput::Elements((2 * rows * n_acts * cols) as u64));
            g.bench_function(BenchmarkId::from_parameter(format!("{ty:?}")), |b| {
                let mut out = vec![0f32; n_acts * rows];
                b.iter(|| {
                    // SAFETY: `out` holds n_acts rows of `rows` values.
                    unsafe {
                        k.packed_panels(
                            &layout,
                            black_box(&w.data),
                            rows,
                            black_box(&ar),
                            out.as_mut_ptr(),
                            rows,
                        )
                    };
                    black_box(&out);
                })
            });
        }
        g.finish();
    }
}

/// The batched product on 8960 x 1536 matrices (Qwen2.5-1.5B's FFN up projection) of each
/// type, with all threads, packed when the CPU has the panel kernels. It goes round enough
/// matrices (at least 256 MiB) that each is read from memory, not from the last-level cache, as
/// a decode step reads a model's weights: with one activation row (bound by memory: GB/s of
/// weights) and with 16 (a batched decode step: GFLOP/s).
fn product(c: &mut Criterion) {
    let k = Kernels::detect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = ThreadPool::new(threads);
    let (n_out, n_in) = (8960, 1536);
    for ty in TYPES {
        let w = matrix(ty, n_out, n_in, k.packs_weights());
        let copies: Vec<QMatrix> = (1..(256 << 20) / w.data.len() + 1)
            .map(|_| QMatrix {
                data: w.data.iter().copied().collect(),
                ..w.clone()
            })
            .collect();
        let mut g = c.benchmark_group(format!("matmul_8960x1536_{ty:?}"));
        g.sample_size(20);
        for rows in [1usize, 16] {
            let x = values(rows * n_in, 3);
            let mut out = vec![0f32; rows * n_out];
            let mut scratch = ActScratch::default();
            g.throughput(if rows == 1 {
                Throughput::Bytes(w.data.len() as u64)
            } else {
                Throughput::Elements((2 * rows * n_out * n_in) as u64)
            });
            let mut turn = 0;
            g.bench_function(BenchmarkId::from_parameter(format!("{rows} rows")), |b| {
                b.iter(|| {
                    turn = (turn + 1) % copies.len();
                    matmul(
                        &k,
                        &pool,
                        black_box(&x),
                        &mut [Product {
                            w: &copies[turn],
                            out: &mut out,
                        }],
                        &mut scratch,
                    );
                })
            });
        }
        g.finish();
    }
}

/// Quantizing one activation row for the packed product (GB/s of f32 input).
fn quantize(c: &mut Criterion) {
    let k = Kernels::detect();
    let layout = packed::Layout::new(packed::PackKind::Q4_1, 1536);
    let x = values(1536, 5);
    let mut out = vec![0u8; layout.a_row_bytes()];
    let mut g = c.benchmark_group("quantize_act_row");
    g.throughput(Throughput::Bytes((x.len() * 4) as u64));
    g.bench_function("1536 values", |b| {
        b.iter(|| k.quantize_packed_act(&layout, black_box(&x), &mut out))
    });
    g.finish();
}

/// Attention's inner products over f16 K/V rows (GB/s of f16 read), 64-wide heads.
fn attention(c: &mut Criterion) {
    let k = Kernels::detect();
    let q = values(64, 9);
    let rows: Vec<f16> = values(64 * 1024, 13)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let mut o = vec![0f32; 64];
    let mut g = c.benchmark_group("attention_1024_positions");
    g.throughput(Throughput::Bytes((rows.len() * 2) as u64));
    g.bench_function("dot_f16", |b| {
        b.iter(|| {
            let mut s = 0f32;
            for r in rows.chunks_exact(64) {
                s += k.dot_f16(black_box(&q), r);
            }
            black_box(s)
        })
    });
    g.bench_function("axpy_f16", |b| {
        b.iter(|| {
            for r in rows.chunks_exact(64) {
                k.axpy_f16(0.5, black_box(r), &mut o);
            }
        })
    });
    g.bench_function("dot_f16 scalar reference", |b| {
        b.iter(|| {
            let mut s = 0f32;
            for r in rows.chunks_exact(64) {
                s += attn::dot_f16(black_box(&q), r);
            }
            black_box(s)
        })
    });
    g.finish();
}

/// One attention task as a decode step runs it: 3 query heads sharing a 64-wide KV head over
/// 128 positions (GFLOP/s: 2 per multiply-add of Q.K and of the weighted sum of V).
fn fused_attention(c: &mut Criterion) {
    let k = Kernels::detect();
    let (g, n_pos, hd) = (3, 128, attn::FUSED_HEAD_DIMS[0]);
    let q = values(g * hd, 9);
    let row = |seed| -> Vec<f16> { values(hd, seed).into_iter().map(f16::from_f32).collect() };
    let ks: Vec<Vec<f16>> = (0..n_pos).map(|t| row(100 + t as u32)).collect();
    let vs: Vec<Vec<f16>> = (0..n_pos).map(|t| row(1000 + t as u32)).collect();
    let (mut scores, mut out) = (vec![0f32; g * n_pos], vec![0f32; g * hd]);
    let mut tile = vec![0f32; attn::tile_floats(hd)];
    let mut grp = c.benchmark_group("fused_attention");
    grp.throughput(Throughput::Elements((g * n_pos * hd * 4) as u64));
    grp.bench_function("3 heads x 128 positions", |b| {
        b.iter(|| {
            black_box(k.fused_attention(
                hd,
                black_box(&q),
                n_pos,
                0.125,
                false,
                |t| &ks[t][..],
                |t| &vs[t][..],
                &mut scores,
                &mut tile,
                &mut out,
            ))
        })
    });
    grp.finish();
}

/// A prefill chunk's attention as one task runs it: 8 consecutive query rows at the end of a
/// 4096-position context, 6 heads of width 128 sharing one KV head (Qwen2.5-1.5B's shape), in
/// blocks of 1, 2, 4 and 8 rows (GFLOP/s as above). K and V (2 MiB) come from beyond L2.
fn prefill_attention(c: &mut Criterion) {
    for isa in [Isa::Avx2, Isa::Avx512Vnni] {
        if let Some(k) = Kernels::new(isa) {
            for ty in [KvType::F16, KvType::Q8_0] {
                prefill_attention_on(c, &k, isa, ty);
            }
        }
    }
}

/// Eight query rows at the end of a 4096-position context, Qwen2.5-1.5B's shape, K and V rows
/// of type `ty`.
fn prefill_attention_on(c: &mut Criterion, k: &Kernels, isa: Isa, ty: KvType) {
    let (g, n_ctx, hd, n_rows) = (6, 4096, 128, 8);
    let raw = values(n_rows * g * hd, 9);
    let mut q = vec![0f32; raw.len()];
    ty.round(&raw.iter().map(|x| x * 4.0).collect::<Vec<_>>(), &mut q);
    let row = |seed| -> Vec<f16> {
        let mut r = vec![f16::ZERO; ty.row_units(hd)];
        ty.store(&values(hd, seed), &mut r);
        r
    };
    let ks: Vec<Vec<f16>> = (0..n_ctx).map(|t| row(100 + t as u32)).collect();
    let vs: Vec<Vec<f16>> = (0..n_ctx).map(|t| row(10000 + t as u32)).collect();
    let ranges: Vec<(usize, usize)> = (n_ctx - n_rows..n_ctx).map(|p| (0, p + 1)).collect();
    let mut scores = vec![0f32; g * n_rows * n_ctx];
    let mut out = vec![0f32; n_rows * g * hd];
    let mut tile = vec![0f32; attn::tile_floats(hd)];
    let q8 = ty == KvType::Q8_0;
    let mut grp = c.benchmark_group(format!("prefill_attention/{}/{}", isa.name(), ty.name()));
    let flops: usize = ranges.iter().map(|r| g * r.1 * hd * 4).sum();
    grp.throughput(Throughput::Elements(flops as u64));
    for block in [1, 2, 4, 8] {
        if block > 1 && k.attention_block_rows() < block {
            continue;
        }
        grp.bench_function(BenchmarkId::new("rows per block", block), |b| {
            b.iter(|| {
                for (i, rs) in ranges.chunks(block).enumerate() {
                    let at = i * block * g * hd;
                    let qb = &q[at..at + rs.len() * g * hd];
                    let ob = &mut out[at..at + rs.len() * g * hd];
                    let done = if block == 1 {
                        k.fused_attention(
                            hd,
                            qb,
                            rs[0].1,
                            0.125,
                            q8,
                            |t| &ks[t][..],
                            |t| &vs[t][..],
                            &mut scores,
                            &mut tile,
                            ob,
                        )
                    } else {
                        k.attention_block(
                            hd,
                            qb,
                            rs,
                            0.125,
                            q8,
                            |t| &ks[t][..],
                            |t| &vs[t][..],
                            &mut scores,
                            &mut tile,
                            ob,
                        )
                    };
                    assert!(done, "no fused attention kernel on this machine");
                }
                black_box(&out);
            })
        });
    }
    grp.finish();
}

criterion_group!(
    benches,
    row_dot,
    panel,
    product,
    quantize,
    attention,
    fused_attention,
    prefill_attention
);
criterion_main!(benches);
