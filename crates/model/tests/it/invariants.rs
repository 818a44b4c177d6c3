//! DESIGN.md invariants 1 and 2 on tiny models in every kernel weight type: a split run equals
//! the unsplit one, and a session's logits do not depend on its batch or on prompt chunking.
//! All comparisons are bitwise.

use gguf::{GgmlType, GgufFile};
use model::{Batch, Isa, KvCache, KvType, LayerRange, Model, ModelOptions, Output, Row};
use testkit::TinySpec;

pub(super) fn specs() -> Vec<TinySpec> {
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
        (GgmlType::F16, GgmlType::F32, false),
        (GgmlType::Q5_0, GgmlType::Q5_1, false),
        (GgmlType::F32, GgmlType::BF16, true),
    ] {
        v.push(TinySpec {
            weight_type,
            embd_type,
            tied_head,
            ..TinySpec::default()
        });
    }
    // Every other family, in the weight types its real files use: qwen2 with Q/K/V biases,
    // qwen3 with QK norms and heads wider than n_embd / n_head, gemma3 with sliding windows
    // shorter than the prompts (five local layers, then a global one).
    for (arch, head_dim, n_layers, weight_type, embd_type, tied_head) in [
        ("qwen2", None, 4, GgmlType::Q5_0, GgmlType::Q8_0, false),
        ("qwen3", Some(128), 4, GgmlType::Q4K, GgmlType::Q6K, true),
        ("gemma3", Some(128), 6, GgmlType::Q4K, GgmlType::Q8_0, true),
    ] {
        v.push(TinySpec {
            arch,
            head_dim,
            n_layers,
            weight_type,
            embd_type,
            tied_head,
            window: 5,
            ..TinySpec::default()
        });
    }
    v
}

fn load(spec: &TinySpec, range: Option<LayerRange>, n_threads: usize) -> Model {
    load_as(spec, range, n_threads, KvType::F16)
}

/// The tiny model of `spec` (layers `range`), its caches storing K and V as `kv_type`.
pub(super) fn load_as(
    spec: &TinySpec,
    range: Option<LayerRange>,
    n_threads: usize,
    kv_type: KvType,
) -> Model {
    let f = GgufFile::from_bytes(testkit::tiny_model_bytes(spec)).unwrap();
    Model::load(
        &f,
        range,
        ModelOptions {
            n_threads,
            isa: None,
            kv_type,
        },
    )
    .unwrap()
}

pub(super) fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (seed * 31 + i * 17) % 250)
        .collect()
}

pub(super) fn logits(out: Output) -> Vec<f32> {
    match out {
        Output::Logits(l) => l,
        Output::Hidden(_) => panic!("expected logits"),
    }
}

/// Logits at every position of `ids`, fed in chunks of `chunk`, for one session alone.
pub(super) fn run_alone(m: &Model, ids: &[u32], chunk: usize) -> Vec<f32> {
    let mut cache = m.new_cache(256);
    let mut all = Vec::new();
    for (ci, part) in ids.chunks(chunk).enumerate() {
        all.extend(feed(m, &mut cache, ci * chunk, part));
    }
    all
}

#[test]
fn split_ranges_give_bitwise_the_unsplit_logits() {
    for spec in specs() {
        let whole = load(&spec, None, 2);
        let ids = prompt(1, 9);
        let reference = run_alone(&whole, &ids, ids.len());
        for k in 1..spec.n_layers {
            let a = load(&spec, Some(LayerRange { start: 0, end: k }), 2);
            let b = load(
                &spec,
                Some(LayerRange {
                    start: k,
                    end: spec.n_layers,
                }),
                2,
            );
            let (mut ca, mut cb) = (a.new_cache(64), b.new_cache(64));
            let rows = rows_from(0, &ids);
            let got = split_logits(&a, &b, &rows, &mut [&mut ca], &mut [&mut cb]);
            assert!(
                got == reference,
                "{} {:?}: split at {k} differs",
                spec.arch,
                spec.weight_type
            );
        }
    }
}

#[test]
fn a_sessions_logits_do_not_depend_on_its_batch_companions() {
    for spec in specs() {
        let m = load(&spec, None, 2);
        let target = prompt(7, 6);
        let alone = run_alone(&m, &target, target.len());
        for n_others in [1usize, 3, 7] {
            let others: Vec<Vec<u32>> = (0..n_others)
                .map(|i| prompt(100 + i as u32, 3 + i))
                .collect();
            let mut caches: Vec<KvCache> = (0..=n_others).map(|_| m.new_cache(64)).collect();
            // Interleave the target's rows with the others' so its rows sit at varied offsets.
            let mut rows = Vec::new();
            for (s, ids) in others.iter().enumerate() {
                for (pos, &token) in ids.iter().enumerate() {
                    rows.push(Row {
                        seq: s + 1,
                        pos,
                        token,
                        want_logits: true,
                    });
                }
                if s == 0 {
                    for (pos, &token) in target.iter().enumerate() {
                        rows.push(Row {
                            seq: 0,
                            pos,
                            token,
                            want_logits: true,
                        });
                    }
                }
            }
            let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
            let all = logits(
                m.forward(
                    Batch {
                        rows: &rows,
                        hidden: None,
                    },
                    &mut refs,
                )
                .unwrap(),
            );
            let n_vocab = m.config().n_vocab;
            let mine: Vec<f32> = rows
                .iter()
                .enumerate()
                .filter(|(_, r)| r.seq == 0)
                .flat_map(|(i, _)| all[i * n_vocab..(i + 1) * n_vocab].to_vec())
                .collect();
            assert!(
                mine == alone,
                "{:?}: differs with {n_others} companions",
                spec.weight_type
            );
        }
    }
}

/// Batches in session order run data-parallel (each thread takes whole sessions through every
/// layer with its own buffers): a session's logits are bitwise those it gets alone, wherever
/// it sits, with prompts and single decode rows mixed, on two and three threads, on the whole
/// model and on a range past layer 0.
#[test]
fn data_parallel_batches_give_bitwise_the_logits_alone() {
    for spec in specs() {
        for n_threads in [2, 3] {
            let m = load(&spec, None, n_threads);
            let n_vocab = m.config().n_vocab;
            // Sessions 0..6: prompts of 1 to 6 tokens (a single token is a decode-sized row).
            let prompts: Vec<Vec<u32>> = (0..6)
                .map(|i| prompt(40 + i as u32, 1 + (i * 5) % 6))
                .collect();
            let alone: Vec<Vec<f32>> = prompts.iter().map(|p| run_alone(&m, p, p.len())).collect();
            let mut caches: Vec<KvCache> = prompts.iter().map(|_| m.new_cache(64)).collect();
            let rows = rows_in_session_order(&prompts);
            let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
            let all = feed_rows(&m, &rows, &mut refs);
            let mut at = 0;
            for (seq, p) in prompts.iter().enumerate() {
                let got = &all[at * n_vocab..(at + p.len()) * n_vocab];
                at += p.len();
                assert!(
                    bits(got) == bits(&alone[seq]),
                    "{:?} on {n_threads} threads: session {seq} differs",
                    spec.weight_type
                );
            }
        }
        // A range past layer 0 takes hidden states: split [0, 1) then [1, n) with the second
        // range data-parallel equals the whole model alone.
        let a = load(&spec, Some(LayerRange { start: 0, end: 1 }), 1);
        let b = load(
            &spec,
            Some(LayerRange {
                start: 1,
                end: spec.n_layers,
            }),
            2,
        );
        let whole = load(&spec, None, 1);
        let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(60 + i, 2 + i as usize)).collect();
        let rows = rows_in_session_order(&prompts);
        let mut ca: Vec<KvCache> = prompts.iter().map(|_| a.new_cache(64)).collect();
        let mut cb: Vec<KvCache> = prompts.iter().map(|_| b.new_cache(64)).collect();
        let got = split_logits(
            &a,
            &b,
            &rows,
            &mut ca.iter_mut().collect::<Vec<_>>(),
            &mut cb.iter_mut().collect::<Vec<_>>(),
        );
        let want: Vec<f32> = prompts
            .iter()
            .flat_map(|p| run_alone(&whole, p, p.len()))
            .collect();
        assert!(
            bits(&got) == bits(&want),
            "{:?}: split data-parallel differs",
            spec.weight_type
        );
    }
}

/// Every prompt's rows from position 0, session after session.
fn rows_in_session_order(prompts: &[Vec<u32>]) -> Vec<Row> {
    prompts
        .iter()
        .enumerate()
        .flat_map(|(seq, p)| {
            p.iter().enumerate().map(move |(pos, &token)| Row {
                seq,
                pos,
                token,
                want_logits: true,
            })
        })
        .collect()
}

/// Logits of `rows` run through range `a` then, from its hidden states, range `b`.
pub(super) fn split_logits(
    a: &Model,
    b: &Model,
    rows: &[Row],
    ca: &mut [&mut KvCache],
    cb: &mut [&mut KvCache],
) -> Vec<f32> {
    let Output::Hidden(h) = a.forward(Batch { rows, hidden: None }, ca).unwrap() else {
        panic!("first range returns hidden states")
    };
    logits(
        b.forward(
            Batch {
                rows,
                hidden: Some(&h),
            },
            cb,
        )
        .unwrap(),
    )
}

fn feed_rows(m: &Model, rows: &[Row], caches: &mut [&mut KvCache]) -> Vec<f32> {
    logits(m.forward(Batch { rows, hidden: None }, caches).unwrap())
}

#[test]
fn chunked_prefill_gives_bitwise_the_one_shot_logits() {
    for spec in specs() {
        let m = load(&spec, None, 2);
        let ids = prompt(3, 11);
        let once = run_alone(&m, &ids, ids.len());
        for chunk in [1, 2, 4, 5] {
            assert!(
                run_alone(&m, &ids, chunk) == once,
                "{:?}: chunk {chunk} differs",
                spec.weight_type
            );
        }
    }
}

/// A long prompt crosses many attention tiles and blocks: its logits at every position are
/// bitwise the same fed in chunks of 16, 512 or all at once, for heads the fused kernels take
/// (64, 128 wide, sliding windows) and for one they do not (32 wide).
#[test]
fn a_3000_token_prompt_gives_bitwise_the_same_logits_in_chunks_of_16_512_or_3000() {
    let n = 3000;
    let mut long = vec![
        TinySpec::default(),
        TinySpec {
            n_head: 8,
            ..TinySpec::default()
        },
    ];
    long.extend(
        specs()
            .into_iter()
            .filter(|s| s.arch == "qwen3" || s.arch == "gemma3"),
    );
    for spec in long {
        let m = load(&spec, None, 2);
        let ids = prompt(9, n);
        let in_chunks = |chunk: usize| {
            let mut cache = m.new_cache(n);
            let mut all = Vec::new();
            for (ci, part) in ids.chunks(chunk).enumerate() {
                all.extend(feed(&m, &mut cache, ci * chunk, part));
            }
            all
        };
        let once = in_chunks(n);
        assert!(once.iter().all(|x| x.is_finite()));
        for chunk in [16, 512] {
            let got = in_chunks(chunk);
            assert!(
                bits(&got) == bits(&once),
                "{} head {}: chunks of {chunk} differ",
                spec.arch,
                spec.head_dim.unwrap_or(spec.n_embd / spec.n_head)
            );
        }
    }
}

#[test]
fn thread_count_does_not_change_results() {
    let spec = TinySpec::default();
    let ids = prompt(5, 7);
    let one = run_alone(&load(&spec, None, 1), &ids, 7);
    let three = run_alone(&load(&spec, None, 3), &ids, 7);
    assert!(one == three);
}

#[test]
fn truncating_the_cache_then_re_appending_matches_never_appending() {
    let m = load(&TinySpec::default(), None, 2);
    let ids = prompt(9, 8);
    let reference = run_alone(&m, &ids, 8);
    let mut cache = m.new_cache(64);
    let detour: Vec<Row> = [ids[..5].to_vec(), vec![200, 201, 202]]
        .concat()
        .iter()
        .enumerate()
        .map(|(pos, &token)| Row {
            seq: 0,
            pos,
            token,
            want_logits: false,
        })
        .collect();
    let _ = m
        .forward(
            Batch {
                rows: &detour,
                hidden: None,
            },
            &mut [&mut cache],
        )
        .unwrap();
    cache.truncate(5);
    let rest: Vec<Row> = ids[5..]
        .iter()
        .enumerate()
        .map(|(i, &token)| Row {
            seq: 0,
            pos: 5 + i,
            token,
            want_logits: true,
        })
        .collect();
    let got = logits(
        m.forward(
            Batch {
                rows: &rest,
                hidden: None,
            },
            &mut [&mut cache],
        )
        .unwrap(),
    );
    let n_vocab = m.config().n_vocab;
    assert!(got == reference[5 * n_vocab..]);
}

#[test]
fn malformed_batches_are_typed_errors() {
    let m = load(&TinySpec::default(), None, 1);
    let mut cache = m.new_cache(4);
    let gap = [Row {
        seq: 0,
        pos: 1,
        token: 5,
        want_logits: true,
    }];
    let err = m
        .forward(
            Batch {
                rows: &gap,
                hidden: None,
            },
            &mut [&mut cache],
        )
        .unwrap_err();
    assert!(
        matches!(err, model::Error::PositionGap { expected: 0, .. }),
        "{err}"
    );
    let bad_token = [Row {
        seq: 0,
        pos: 0,
        token: 99_999,
        want_logits: true,
    }];
    let err = m
        .forward(
            Batch {
                rows: &bad_token,
                hidden: None,
            },
            &mut [&mut cache],
        )
        .unwrap_err();
    assert!(matches!(err, model::Error::TokenOutOfRange { .. }), "{err}");
    let no_cache = [Row {
        seq: 3,
        pos: 0,
        token: 5,
        want_logits: true,
    }];
    let err = m
        .forward(
            Batch {
                rows: &no_cache,
                hidden: None,
            },
            &mut [&mut cache],
        )
        .unwrap_err();
    assert!(matches!(err, model::Error::NoSuchCache { .. }), "{err}");
    let rows: Vec<Row> = (0..5)
        .map(|pos| Row {
            seq: 0,
            pos,
            token: 5,
            want_logits: true,
        })
        .collect();
    let err = m
        .forward(
            Batch {
                rows: &rows,
                hidden: None,
            },
            &mut [&mut cache],
        )
        .unwrap_err();
    assert!(
        matches!(err, model::Error::ContextFull { n_ctx: 4, .. }),
        "{err}"
    );
    assert_eq!(cache.len(), 0, "a refused batch leaves the cache untouched");
}

#[test]
fn memory_follows_the_range() {
    let spec = TinySpec {
        tied_head: false,
        ..TinySpec::default()
    };
    let f = GgufFile::from_bytes(testkit::tiny_model_bytes(&spec)).unwrap();
    let sum = |pred: &dyn Fn(&str) -> bool| -> usize {
        f.header()
            .tensors()
            .iter()
            .filter(|t| pred(&t.name))
            .map(|t| t.n_bytes as usize)
            .sum()
    };
    let in_layers = |name: &str, a: usize, b: usize| {
        name.strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok())
            .is_some_and(|i| (a..b).contains(&i))
    };
    // Every ISA repacks the quantized weights into panels (a few bytes of scales per block
    // more than ggml's layout, and rows padded to a whole panel): the two halves hold exactly
    // what the whole model holds, and each holds its own tensors' file bytes to within 1%.
    let opts = ModelOptions {
        isa: Some(Isa::Scalar),
        ..ModelOptions::default()
    };
    let whole = Model::load(&f, None, opts).unwrap();
    let first = Model::load(&f, Some(LayerRange { start: 0, end: 2 }), opts).unwrap();
    let last = Model::load(&f, Some(LayerRange { start: 2, end: 4 }), opts).unwrap();
    assert_eq!(
        first.weight_bytes() + last.weight_bytes(),
        whole.weight_bytes()
    );
    let near = |held: usize, want: usize| held >= want && held - want <= want / 100;
    let want = sum(&|n| in_layers(n, 0, 2) || n == "token_embd.weight");
    assert!(
        near(first.weight_bytes(), want),
        "{} vs {want}",
        first.weight_bytes()
    );
    let want = sum(&|n| in_layers(n, 2, 4) || n == "output.weight" || n == "output_norm.weight");
    assert!(
        near(last.weight_bytes(), want),
        "{} vs {want}",
        last.weight_bytes()
    );
}

/// Feeds `ids` at positions `start..` to one cache and returns the logits of every row.
/// One session's rows for `ids` from position `start`, each wanting logits.
pub(super) fn rows_from(start: usize, ids: &[u32]) -> Vec<Row> {
    ids.iter()
        .enumerate()
        .map(|(i, &token)| Row {
            seq: 0,
            pos: start + i,
            token,
            want_logits: true,
        })
        .collect()
}

pub(super) fn feed(m: &Model, cache: &mut KvCache, start: usize, ids: &[u32]) -> Vec<f32> {
    feed_rows(m, &rows_from(start, ids), &mut [cache])
}

#[test]
fn a_session_started_on_a_shared_prefix_gives_bitwise_its_own_logits() {
    for spec in specs() {
        let m = load(&spec, None, 2);
        let n_vocab = m.config().n_vocab;
        let pool = m.new_pool(usize::MAX);
        let root = model::KvPool::prefix_root(0);
        let ids = prompt(5, 40);
        // Computed alone, from nothing.
        let reference = run_alone(&m, &ids, ids.len());
        // A first session computes the prompt in two chunks and registers its full blocks.
        let mut first = pool.new_cache(64);
        feed(&m, &mut first, 0, &ids[..25]);
        feed(&m, &mut first, 25, &ids[25..]);
        pool.register(&mut first, &ids, root);
        if pool.is_windowed() {
            // Sliding-window pools share no prefixes (see `kv.rs`).
            assert_eq!(first.n_shared_blocks(), 0);
            let mut second = pool.new_cache(64);
            assert_eq!(pool.attach(&mut second, &ids, root, 32), 0);
            continue;
        }
        assert_eq!(first.n_shared_blocks(), 2);
        // A second starts on those blocks and computes only the rest.
        let mut second = pool.new_cache(64);
        let held = pool.attach(&mut second, &ids, root, ids.len() - 1);
        assert_eq!(held, 32);
        let got = feed(&m, &mut second, held, &ids[held..]);
        assert_eq!(
            bits(&got),
            bits(&reference[held * n_vocab..]),
            "{:?}",
            spec.weight_type
        );
        // Rewinding into a shared block and recomputing from there copies the block first:
        // the result is the same, and the first session's blocks are untouched.
        second.truncate(20);
        let again = feed(&m, &mut second, 20, &ids[20..]);
        assert_eq!(bits(&again), bits(&reference[20 * n_vocab..]));
        assert_eq!(second.n_shared_blocks(), 1);
        drop(second);
        let mut third = pool.new_cache(64);
        let held = pool.attach(&mut third, &ids, root, 32);
        let got = feed(&m, &mut third, held, &ids[held..]);
        assert_eq!(bits(&got), bits(&reference[held * n_vocab..]));
    }
}

/// A conversation whose last message changed shares all but the block where it differs: the
/// second session takes the first session's whole blocks and the leading positions of the block
/// where the two part (copied before its own positions are written), computes only the rest, and
/// gets bitwise the logits of its prompt computed alone; the first session's blocks are
/// untouched (it continues exactly, and a third session with its prompt takes its registered
/// blocks and computes the same logits).
#[test]
fn a_session_takes_the_cached_positions_of_the_block_where_it_parts() {
    for spec in specs() {
        let m = load(&spec, None, 2);
        let n_vocab = m.config().n_vocab;
        let pool = m.new_pool(usize::MAX);
        if pool.is_windowed() {
            continue;
        }
        let root = model::KvPool::prefix_root(0);
        let ids = prompt(7, 56);
        // The same first 37 tokens, then others.
        let mut other = ids[..37].to_vec();
        other.extend(prompt(8, 12));
        let mut first = pool.new_cache(64);
        feed(&m, &mut first, 0, &ids);
        pool.register(&mut first, &ids, root);
        assert_eq!(first.n_shared_blocks(), 3);
        let mut second = pool.new_cache(64);
        let held = pool.attach(&mut second, &other, root, other.len() - 1);
        assert_eq!(held, 37, "{:?}", spec.weight_type);
        let got = feed(&m, &mut second, held, &other[held..]);
        let want = run_alone(&m, &other, other.len());
        assert_eq!(
            bits(&got),
            bits(&want[held * n_vocab..]),
            "{:?}",
            spec.weight_type
        );
        // At most what the caller allows: a position short of the match, or whole blocks only.
        let mut short = pool.new_cache(64);
        assert_eq!(pool.attach(&mut short, &other, root, 35), 35);
        let mut whole = pool.new_cache(64);
        assert_eq!(pool.attach(&mut whole, &other, root, 32), 32);
        // The first session goes on exactly, on blocks the second did not write into.
        let more = prompt(9, 5);
        let mut full: Vec<u32> = ids.clone();
        full.extend(&more);
        let went_on = feed(&m, &mut first, ids.len(), &more);
        let alone = run_alone(&m, &full, full.len());
        assert_eq!(bits(&went_on), bits(&alone[ids.len() * n_vocab..]));
        // Its three registered blocks (its last, partial block was never registered).
        let mut third = pool.new_cache(64);
        assert_eq!(pool.attach(&mut third, &ids, root, ids.len() - 1), 48);
        let got = feed(&m, &mut third, 48, &ids[48..]);
        assert_eq!(bits(&got), bits(&alone[48 * n_vocab..56 * n_vocab]));
    }
}

pub(super) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A sliding-window layer keeps K and V only inside its window: along a session far longer
/// than the window, the pool holds the windowed part of a bounded number of blocks (the pool's
/// counts), costs less than keeping everything, and the logits are bitwise those of a cache
/// that keeps every position of every layer. A rewind inside the kept slack continues exactly;
/// one behind it forgets the session.
#[test]
fn a_sliding_window_layer_keeps_kv_only_inside_its_window() {
    let spec = specs()
        .into_iter()
        .find(|s| s.arch == "gemma3")
        .expect("a gemma3 spec");
    let m = load(&spec, None, 2);
    let (n_vocab, kv_dim) = (m.config().n_vocab, m.config().kv_dim());
    let ids = prompt(9, 230);
    let chunk = 7;
    let everything = model::KvPool::new(m.range(), kv_dim, usize::MAX);
    let pool = m.new_pool(usize::MAX);
    assert!(pool.is_windowed());
    let keep = pool.window_keep_positions();
    assert_eq!(keep, spec.window - 1 + model::BLOCK_POSITIONS);
    let most = (keep + chunk).div_ceil(model::BLOCK_POSITIONS) + 1;
    let (mut full, mut windowed) = (everything.new_cache(256), pool.new_cache(256));
    let global_part = pool.block_bytes() - pool.window_block_bytes();
    for (ci, part) in ids.chunks(chunk).enumerate() {
        let start = ci * chunk;
        let want = feed(&m, &mut full, start, part);
        let got = feed(&m, &mut windowed, start, part);
        assert_eq!(bits(&got), bits(&want), "chunk at {start}");
        let blocks = windowed.n_blocks();
        assert!(
            windowed.n_window_blocks() <= most,
            "{} windowed blocks at length {}",
            windowed.n_window_blocks(),
            windowed.len()
        );
        assert_eq!(pool.window_blocks_in_use(), windowed.n_window_blocks());
        assert_eq!(
            pool.bytes_in_use(),
            blocks * global_part + windowed.n_window_blocks() * pool.window_block_bytes()
        );
        assert_eq!(pool.bytes_in_use(), windowed.n_bytes());
    }
    // Five of the six layers are windowed: past the window, the session costs little more
    // than its one global layer.
    assert_eq!(pool.window_block_bytes() * 6, pool.block_bytes() * 5);
    assert!(pool.bytes_in_use() * 3 < everything.bytes_in_use());
    // Rewinding by a few positions stays inside the kept slack: the same logits again.
    let len = windowed.len();
    windowed.truncate(len - 3);
    full.truncate(len - 3);
    assert_eq!(windowed.len(), len - 3);
    let want = feed(&m, &mut full, len - 3, &ids[len - 3..]);
    let got = feed(&m, &mut windowed, len - 3, &ids[len - 3..]);
    assert_eq!(bits(&got), bits(&want));
    assert_eq!(bits(&got[..n_vocab]), bits(&want[..n_vocab]));
    // Rewinding behind it cannot be continued: everything is forgotten and given back.
    windowed.truncate(len - keep - 40);
    assert_eq!(windowed.len(), 0);
    assert_eq!(pool.bytes_in_use(), 0);
    let again = feed(&m, &mut windowed, 0, &ids[..20]);
    assert_eq!(bits(&again), bits(&run_alone(&m, &ids[..20], 20)));
}

/// What a shard placing itself reads from the header alone (`WeightSizes`) is exactly what each
/// range holds once loaded from its file, in every weight type (packed or not, tied head or
/// not); a first range whose head is not tied reads the embedding from the file instead of
/// holding it, with bitwise the activations of a held one.
#[test]
fn weight_sizes_from_the_header_equal_what_every_range_loads() {
    for (i, spec) in specs().into_iter().enumerate() {
        let path = testkit::write_tiny_model(&spec, &format!("weight-sizes-{i}"));
        let f = GgufFile::open(&path).unwrap();
        let sizes = model::WeightSizes::of(&f).unwrap();
        let n = sizes.layers.len();
        assert_eq!(n, spec.n_layers, "{spec:?}");
        let ids = prompt(3, 7);
        for (start, end) in [(0, n), (0, 1), (1, n), (1, n - 1), (n - 1, n)] {
            let range = Some(LayerRange { start, end });
            let options = ModelOptions {
                n_threads: 1,
                isa: None,
                kv_type: KvType::F16,
            };
            let m = Model::load(&f, range, options).unwrap();
            assert_eq!(
                sizes.range(start, end),
                m.weight_bytes() as u64,
                "{spec:?} layers {start}..{end}"
            );
            let in_file = start == 0 && !(spec.tied_head && end == n);
            assert_eq!(
                m.in_file_weight_bytes() > 0,
                in_file,
                "{spec:?} {start}..{end}"
            );
            if start == 0 {
                let held = load(&spec, range, 1);
                assert_eq!(held.in_file_weight_bytes(), 0);
                let out = |m: &Model| {
                    let rows = rows_from(0, &ids);
                    let mut cache = m.new_cache(16);
                    match m.forward(
                        Batch {
                            rows: &rows,
                            hidden: None,
                        },
                        &mut [&mut cache],
                    ) {
                        Ok(Output::Logits(v) | Output::Hidden(v)) => bits(&v),
                        Err(e) => panic!("{e}"),
                    }
                };
                assert_eq!(out(&m), out(&held), "{spec:?} {start}..{end}");
            }
        }
    }
}
