//! One answer on every machine: whole models give bitwise the same logits with every
//! instruction set this CPU has (scalar, AVX2, AVX-512 VNNI), on tiny models of every family
//! in every weight type and on the real Qwen2.5-Coder-0.5B (1.5B among the long tests), for prompts computed in one step,
//! in chunks, and decoded token by token. The kernels share one numeric contract (the panel
//! kernels' exact block sums, the same `exp`, one order of every reduction), so a shard's
//! results never depend on the CPU it runs on.

use gguf::{GgmlType, GgufFile};
use model::{Batch, Isa, KvCache, KvType, Model, ModelOptions, Output, Row};
use testkit::TinySpec;

/// Every instruction set this CPU can run, best last.
fn isas() -> Vec<Isa> {
    let all: Vec<Isa> = [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni]
        .into_iter()
        .filter(|i| {
            let ok = i.is_supported();
            if !ok {
                eprintln!("{} is not on this CPU: not compared", i.name());
            }
            ok
        })
        .collect();
    assert!(all.len() >= 2 || !cfg!(target_arch = "x86_64"));
    all
}

fn specs() -> Vec<TinySpec> {
    let mut v = Vec::new();
    for (weight_type, embd_type, tied_head) in [
        (GgmlType::Q4_1, GgmlType::Q8_0, true),
        (GgmlType::Q4_0, GgmlType::Q8_0, false),
        (GgmlType::Q8_0, GgmlType::F16, false),
        (GgmlType::Q4K, GgmlType::Q6K, false),
        (GgmlType::Q6K, GgmlType::Q4K, true),
        (GgmlType::Q2K, GgmlType::Q3K, false),
        (GgmlType::Q3K, GgmlType::Q5K, true),
        (GgmlType::Q5K, GgmlType::Q2K, false),
        (GgmlType::Q5_0, GgmlType::Q5_1, false),
        (GgmlType::F16, GgmlType::F32, false),
    ] {
        v.push(TinySpec {
            weight_type,
            embd_type,
            tied_head,
            ..TinySpec::default()
        });
    }
    for (arch, head_dim, n_layers, weight_type, embd_type) in [
        ("qwen2", None, 4, GgmlType::Q5_0, GgmlType::Q8_0),
        ("qwen3", Some(128), 4, GgmlType::Q4K, GgmlType::Q6K),
        ("gemma3", Some(128), 6, GgmlType::Q4K, GgmlType::Q8_0),
    ] {
        v.push(TinySpec {
            arch,
            head_dim,
            n_layers,
            weight_type,
            embd_type,
            tied_head: true,
            window: 5,
            ..TinySpec::default()
        });
    }
    v
}

fn logits(out: Output) -> Vec<f32> {
    match out {
        Output::Logits(l) => l,
        Output::Hidden(_) => panic!("expected logits"),
    }
}

/// The bits of the logits of every position of `ids`, fed in chunks of `chunk` positions.
fn run(m: &Model, ids: &[u32], chunk: usize) -> Vec<u32> {
    let mut cache: KvCache = m.new_cache(ids.len() + 1);
    let mut bits = Vec::new();
    for (c, part) in ids.chunks(chunk).enumerate() {
        let rows: Vec<Row> = part
            .iter()
            .enumerate()
            .map(|(k, &token)| Row {
                seq: 0,
                pos: c * chunk + k,
                token,
                want_logits: true,
            })
            .collect();
        let out = m
            .forward(
                Batch {
                    rows: &rows,
                    hidden: None,
                },
                &mut [&mut cache],
            )
            .unwrap();
        bits.extend(logits(out).iter().map(|x| x.to_bits()));
    }
    bits
}

fn load(bytes: Vec<u8>, isa: Isa, kv_type: KvType) -> Model {
    let f = GgufFile::from_bytes(bytes).unwrap();
    Model::load(
        &f,
        None,
        ModelOptions {
            n_threads: 2,
            isa: Some(isa),
            kv_type,
        },
    )
    .unwrap()
}

#[test]
fn tiny_models_of_every_family_and_type_give_bitwise_the_same_logits_on_every_isa() {
    every_isa_alike(specs(), KvType::F16);
}

/// The same with K and V stored as `q8_0`, for every family.
#[test]
fn a_q8_0_cache_gives_bitwise_the_same_logits_on_every_isa() {
    let families = specs()
        .into_iter()
        .filter(|s| s.arch != "llama" || s.weight_type == GgmlType::Q4K)
        .collect();
    every_isa_alike(families, KvType::Q8_0);
}

fn every_isa_alike(specs: Vec<TinySpec>, kv_type: KvType) {
    let isas = isas();
    let ids: Vec<u32> = (0..40u32).map(|i| 3 + (i * 37) % 250).collect();
    for spec in specs {
        let bytes = testkit::tiny_model_bytes(&spec);
        let mut first: Option<(Isa, Vec<u32>)> = None;
        for &isa in &isas {
            let m = load(bytes.clone(), isa, kv_type);
            // In one step, in chunks of 7, and one token a step: all the same bits.
            let whole = run(&m, &ids, ids.len());
            assert_eq!(
                whole,
                run(&m, &ids, 7),
                "{} {:?}",
                isa.name(),
                spec.weight_type
            );
            assert_eq!(
                whole,
                run(&m, &ids, 1),
                "{} {:?}",
                isa.name(),
                spec.weight_type
            );
            match &first {
                None => first = Some((isa, whole)),
                Some((i0, want)) => assert!(
                    *want == whole,
                    "{} {:?} (embedding {:?}): {} and {} logits differ",
                    spec.arch,
                    spec.weight_type,
                    spec.embd_type,
                    i0.name(),
                    isa.name()
                ),
            }
        }
    }
}

/// The real Qwen2.5-Coder-0.5B (Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0): seven tokens, every ISA.
#[test]
fn the_real_qwen_0_5b_gives_bitwise_the_same_logits_on_every_isa() {
    real_qwen_on_every_isa("qwen2.5-coder-0.5b");
}

/// The same with Qwen2.5-Coder-1.5B, the model issue 33 measured (25 s with all three
/// instruction sets on two AVX-512 cores, most of it the scalar pass; in CI, as the issue asks).
#[test]
fn the_real_qwen_1_5b_gives_bitwise_the_same_logits_on_every_isa() {
    real_qwen_on_every_isa("qwen2.5-coder-1.5b");
}

fn real_qwen_on_every_isa(name: &str) {
    let path = testkit::named_model(name);
    let ids = [9707u32, 11, 847, 829, 374, 264, 1273];
    let mut first: Option<(Isa, Vec<u32>)> = None;
    for isa in isas() {
        let f = GgufFile::open(&path).unwrap();
        let m = Model::load(
            &f,
            None,
            ModelOptions {
                n_threads: 2,
                isa: Some(isa),
                kv_type: KvType::F16,
            },
        )
        .unwrap();
        let got = run(&m, &ids, ids.len());
        match &first {
            None => first = Some((isa, got)),
            Some((i0, want)) => {
                let differ = want.iter().zip(&got).filter(|(a, b)| a != b).count();
                assert_eq!(
                    differ,
                    0,
                    "{name}: {} and {} differ in {differ} logits",
                    i0.name(),
                    isa.name()
                );
            }
        }
    }
}
