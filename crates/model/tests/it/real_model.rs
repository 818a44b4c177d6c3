//! Parity with llama.cpp on the real model (SmolLM2-135M-Instruct Q4_1), against the reference
//! outputs in `reference/greedy_public.json`, with the tolerances its README asks for;
//! and the split/batch invariants on the real weights, bitwise.

use std::sync::OnceLock;

use gguf::GgufFile;
use model::sampling::top_k;
use model::{Batch, KvCache, LayerRange, Model, ModelOptions, Output, Row};
use serde_json::Value;

fn file() -> &'static GgufFile {
    static F: OnceLock<GgufFile> = OnceLock::new();
    F.get_or_init(|| GgufFile::open(testkit::real_model()).unwrap())
}

fn whole() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| Model::load(file(), None, ModelOptions::default()).unwrap())
}

fn reference() -> &'static Value {
    static R: OnceLock<Value> = OnceLock::new();
    R.get_or_init(|| serde_json::from_str(&testkit::reference_text("greedy_public.json")).unwrap())
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn logits(out: Output) -> Vec<f32> {
    match out {
        Output::Logits(l) => l,
        Output::Hidden(_) => panic!("expected logits"),
    }
}

fn prefill_all(m: &Model, cache: &mut KvCache, ids: &[u32], all: bool) -> Vec<f32> {
    let rows = Row::of_session(cache.len(), ids, all);
    logits(
        m.forward(
            Batch {
                rows: &rows,
                hidden: None,
            },
            &mut [cache],
        )
        .unwrap(),
    )
}

/// Greedy ids and the logits of every step (prompt in one batch, then one token per call, as
/// the reference was produced).
fn greedy(m: &Model, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut cache = m.new_cache(1024);
    let mut l = prefill_all(m, &mut cache, prompt, false);
    let (mut out, mut steps) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let id = top_k(&l, 1)[0].0;
        out.push(id);
        steps.push(l.clone());
        if id == 2 {
            break;
        }
        let row = [Row {
            seq: 0,
            pos: cache.len(),
            token: id,
            want_logits: true,
        }];
        l = logits(
            m.forward(
                Batch {
                    rows: &row,
                    hidden: None,
                },
                &mut [&mut cache],
            )
            .unwrap(),
        );
    }
    (out, steps)
}

#[test]
fn teacher_forced_argmax_matches_llama_cpp_where_the_margin_is_clear() {
    let tf = &reference()["teacher_forced"];
    let input = ids(&tf["ids"]);
    let m = whole();
    let mut cache = m.new_cache(64);
    let all = prefill_all(m, &mut cache, &input, true);
    let n_vocab = m.config().n_vocab;
    let margins = tf["top1_top2_logit_margin_per_position"]
        .as_array()
        .unwrap();
    let mut worst_logit_diff = 0f32;
    let (mut diff_sum, mut n_diffs) = (0f32, 0);
    let mut checked = 0;
    for (pos, top5) in tf["top5_per_position"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let l = &all[pos * n_vocab..(pos + 1) * n_vocab];
        for entry in top5.as_array().unwrap() {
            let id = entry["id"].as_u64().unwrap() as usize;
            let diff = (l[id] - entry["logit"].as_f64().unwrap() as f32).abs();
            worst_logit_diff = worst_logit_diff.max(diff);
            diff_sum += diff;
            n_diffs += 1;
        }
        if margins[pos].as_f64().unwrap() >= 0.75 {
            let want = top5[0]["id"].as_u64().unwrap() as u32;
            assert_eq!(top_k(l, 1)[0].0, want, "argmax differs at position {pos}");
            checked += 1;
        }
    }
    let mean = diff_sum / n_diffs as f32;
    eprintln!("teacher-forced: {checked} positions checked; top-5 logit difference mean {mean:.4}, largest {worst_logit_diff:.4}");
    assert!(checked >= 20);
    // llama.cpp's own one-token and batched evaluations differ by up to 0.58 (reference README).
    assert!(
        worst_logit_diff < 0.75,
        "top-5 logits drift by {worst_logit_diff}"
    );
    assert!(mean < 0.15, "mean top-5 logit difference {mean}");
}

#[test]
fn first_step_top5_of_every_prompt_is_in_our_top8_within_llama_cpps_own_spread() {
    let m = whole();
    for g in reference()["greedy"].as_array().unwrap() {
        let prompt = ids(&g["prompt_ids"]);
        let mut cache = m.new_cache(256);
        let l = prefill_all(m, &mut cache, &prompt, false);
        let ours: Vec<u32> = top_k(&l, 8).into_iter().map(|(id, _)| id).collect();
        let mut worst = 0f32;
        for entry in g["top5_per_step"][0].as_array().unwrap() {
            let id = entry["id"].as_u64().unwrap() as u32;
            let diff = (l[id as usize] - entry["logit"].as_f64().unwrap() as f32).abs();
            worst = worst.max(diff);
            assert!(
                ours.contains(&id),
                "{:?}: reference id {id} not in our top 8 {ours:?}",
                g["prompt"]
            );
            // llama.cpp's own one-token and batched evaluations of the same positions differ
            // by up to 0.58 (reference README): int8 activations turn any change of summation
            // order into different roundings downstream, so this is the spread to expect.
            assert!(
                diff <= 0.6,
                "{:?}: logit of {id} differs by {diff}",
                g["prompt"]
            );
        }
        eprintln!(
            "{:?}: first-step top-5 largest logit difference {worst:.4}",
            g["prompt"].as_str().unwrap()
        );
    }
}

#[test]
fn greedy_output_matches_llama_cpp_up_to_the_first_near_tie() {
    let m = whole();
    for g in reference()["greedy"].as_array().unwrap() {
        let prompt = ids(&g["prompt_ids"]);
        let want = ids(&g["generated_ids"]);
        let margins = g["top1_top2_logit_margin_per_step"].as_array().unwrap();
        let n_check = margins
            .iter()
            .position(|m| m.as_f64().unwrap() < 0.25)
            .unwrap_or(want.len());
        let (got, _) = greedy(m, &prompt, want.len());
        assert_eq!(
            got[..n_check],
            want[..n_check],
            "{:?} (checked {n_check} steps)",
            g["prompt"]
        );
        let n_same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        eprintln!(
            "{:?}: {n_same}/{} greedy ids identical (required {n_check})",
            g["prompt"].as_str().unwrap(),
            want.len()
        );
    }
}

#[test]
fn real_model_split_at_several_layers_is_bitwise_the_whole_model() {
    let prompt = ids(&reference()["greedy"][0]["prompt_ids"]);
    let m = whole();
    let mut cache = m.new_cache(64);
    let reference_logits = prefill_all(m, &mut cache, &prompt, true);
    let n = m.config().n_layers;
    for k in [1, 15, 29] {
        let a = Model::load(
            file(),
            Some(LayerRange { start: 0, end: k }),
            ModelOptions::default(),
        )
        .unwrap();
        let b = Model::load(
            file(),
            Some(LayerRange { start: k, end: n }),
            ModelOptions::default(),
        )
        .unwrap();
        let rows: Vec<Row> = prompt
            .iter()
            .enumerate()
            .map(|(pos, &token)| Row {
                seq: 0,
                pos,
                token,
                want_logits: true,
            })
            .collect();
        let (mut ca, mut cb) = (a.new_cache(64), b.new_cache(64));
        let Output::Hidden(h) = a
            .forward(
                Batch {
                    rows: &rows,
                    hidden: None,
                },
                &mut [&mut ca],
            )
            .unwrap()
        else {
            panic!("hidden expected")
        };
        let got = logits(
            b.forward(
                Batch {
                    rows: &rows,
                    hidden: Some(&h),
                },
                &mut [&mut cb],
            )
            .unwrap(),
        );
        assert!(got == reference_logits, "split at {k} differs");
    }
}

#[test]
fn real_model_batched_sessions_equal_sessions_alone() {
    let m = whole();
    let prompts: Vec<Vec<u32>> = reference()["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| ids(&g["prompt_ids"]))
        .collect();
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(m, p, 8).0).collect();
    // All four prompts prefilled in one batch, then decoded together step by step.
    let mut caches: Vec<KvCache> = prompts.iter().map(|_| m.new_cache(256)).collect();
    let mut rows = Vec::new();
    for (s, p) in prompts.iter().enumerate() {
        for (pos, &token) in p.iter().enumerate() {
            rows.push(Row {
                seq: s,
                pos,
                token,
                want_logits: pos + 1 == p.len(),
            });
        }
    }
    let n_vocab = m.config().n_vocab;
    let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
    let mut l = logits(
        m.forward(
            Batch {
                rows: &rows,
                hidden: None,
            },
            &mut refs,
        )
        .unwrap(),
    );
    let mut outs: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    for _ in 0..8 {
        let mut step = Vec::new();
        for s in 0..prompts.len() {
            let id = top_k(&l[s * n_vocab..(s + 1) * n_vocab], 1)[0].0;
            outs[s].push(id);
            step.push(Row {
                seq: s,
                pos: prompts[s].len() + outs[s].len() - 1,
                token: id,
                want_logits: true,
            });
        }
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        l = logits(
            m.forward(
                Batch {
                    rows: &step,
                    hidden: None,
                },
                &mut refs,
            )
            .unwrap(),
        );
    }
    for (s, want) in alone.iter().enumerate() {
        assert_eq!(&outs[s][..want.len()], &want[..], "session {s}");
    }
}
