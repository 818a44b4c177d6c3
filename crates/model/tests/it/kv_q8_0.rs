//! A `q8_0` KV cache (`ModelOptions::kv_type`, llama.cpp's `--cache-type-k/-v q8_0`): the
//! invariants hold as they do for f16 (a split run equals the unsplit one, a session's logits
//! do not depend on its batch or on how its prompt is chunked, all bitwise), its logits stay
//! near f16's, a block takes 17/32 of f16's bytes, and a head width it cannot hold is refused
//! at load.

use gguf::GgufFile;
use model::{Batch, KvCache, KvType, LayerRange, Model, ModelOptions, Row};
use testkit::TinySpec;

use super::invariants::{bits, load_as, logits, prompt, rows_from, run_alone, specs, split_logits};

/// Every family once: llama (heads 64 wide), qwen2 (biases), qwen3 (128 wide, QK norms),
/// gemma3 (sliding windows shorter than the prompt).
fn families() -> Vec<TinySpec> {
    let mut v = vec![TinySpec::default()];
    v.extend(specs().into_iter().filter(|s| s.arch != "llama"));
    v
}

#[test]
fn a_q8_0_cache_keeps_split_batch_and_chunk_invariance_bitwise() {
    for spec in families() {
        let name = spec.arch;
        let m = load_as(&spec, None, 2, KvType::Q8_0);
        let ids = prompt(1, 40);
        let once = run_alone(&m, &ids, ids.len());
        assert!(once.iter().all(|x| x.is_finite()), "{name}");
        for chunk in [1, 7, 16] {
            assert!(
                bits(&run_alone(&m, &ids, chunk)) == bits(&once),
                "{name}: chunks of {chunk} differ"
            );
        }
        let k = spec.n_layers / 2;
        let a = load_as(
            &spec,
            Some(LayerRange { start: 0, end: k }),
            2,
            KvType::Q8_0,
        );
        let end = spec.n_layers;
        let b = load_as(&spec, Some(LayerRange { start: k, end }), 2, KvType::Q8_0);
        let (mut ca, mut cb) = (a.new_cache(64), b.new_cache(64));
        let rows = rows_from(0, &ids);
        let split = split_logits(&a, &b, &rows, &mut [&mut ca], &mut [&mut cb]);
        assert!(bits(&split) == bits(&once), "{name}: split at {k} differs");
        // The session beside two others in one batch, its rows between theirs.
        let others = [prompt(100, 9), prompt(101, 23)];
        let mut rows = Vec::new();
        for (seq, p) in [&others[0], &ids, &others[1]].into_iter().enumerate() {
            rows.extend(p.iter().enumerate().map(|(pos, &token)| Row {
                seq,
                pos,
                token,
                want_logits: seq == 1,
            }));
        }
        let mut caches: Vec<KvCache> = (0..3).map(|_| m.new_cache(64)).collect();
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        let batch = Batch {
            rows: &rows,
            hidden: None,
        };
        let beside = logits(m.forward(batch, &mut refs).unwrap());
        assert!(
            bits(&beside) == bits(&once),
            "{name}: differs beside others"
        );
    }
}

/// Quantizing K and V moves the logits a little, not the answer: next to f16's, the largest
/// difference is a small part of the logits' spread, and most positions keep their best token.
#[test]
fn a_q8_0_cache_stays_near_f16_in_17_32nds_of_its_bytes() {
    for spec in families() {
        let name = spec.arch;
        let ids = prompt(5, 60);
        let f16 = load_as(&spec, None, 2, KvType::F16);
        let q8 = load_as(&spec, None, 2, KvType::Q8_0);
        let (a, b) = (run_alone(&f16, &ids, 60), run_alone(&q8, &ids, 60));
        assert!(bits(&a) != bits(&b), "{name}: q8_0 gave f16's very bits");
        let n_vocab = f16.config().n_vocab;
        let (mut worst, mut same_best) = (0f32, 0);
        for (x, y) in a.chunks_exact(n_vocab).zip(b.chunks_exact(n_vocab)) {
            let spread = x.iter().fold(f32::MIN, |m, v| m.max(*v))
                - x.iter().fold(f32::MAX, |m, v| m.min(*v));
            let diff = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            worst = worst.max(diff / spread);
            let best = |v: &[f32]| (0..v.len()).max_by(|&i, &j| v[i].total_cmp(&v[j]));
            same_best += usize::from(best(x) == best(y));
        }
        eprintln!("{name}: largest difference {worst:.4} of the spread, best token kept at {same_best}/60");
        assert!(worst < 0.05, "{name}: {worst} of the spread");
        assert!(same_best >= 54, "{name}: best token kept at {same_best}/60");
        let (p16, p8) = (f16.new_pool(usize::MAX), q8.new_pool(usize::MAX));
        assert_eq!(p8.block_bytes() * 32, p16.block_bytes() * 17, "{name}");
        assert_eq!(p8.kv_type(), KvType::Q8_0);
    }
}

#[test]
fn a_head_width_q8_0_cannot_hold_is_refused_at_load() {
    // Heads 48 wide: not a whole number of 32-value blocks.
    let spec = TinySpec {
        n_embd: 192,
        ..TinySpec::default()
    };
    let f = GgufFile::from_bytes(testkit::tiny_model_bytes(&spec)).unwrap();
    let load = |kv_type| {
        let opts = ModelOptions {
            n_threads: 1,
            isa: None,
            kv_type,
        };
        Model::load(&f, None, opts)
    };
    let err = load(KvType::Q8_0).err().expect("refused");
    assert!(
        matches!(
            err,
            model::Error::BadConfig {
                field: "kv_type",
                ..
            }
        ),
        "{err}"
    );
    assert!(load(KvType::F16).is_ok());
    assert_eq!(KvType::from_name("q8_0"), Ok(KvType::Q8_0));
    assert!(KvType::from_name("q4_0").is_err());
}
