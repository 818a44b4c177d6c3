//! One answer on every machine, through real processes: shards forced onto different
//! instruction sets (`strata shard --isa`) chain into a route whose tokens and
//! log-probabilities are bitwise one process's, and sessions moved by a shard kill from a
//! route on the best instruction set to a replica on the next best go on with exactly the
//! fault-free tokens. (Whole models and every kernel are compared across instruction sets in
//! the model crate's tests; this is the swarm's side of the same contract.) On a CPU with
//! AVX-512 the pair is AVX-512 and AVX2; on an AVX2 CPU, AVX2 and scalar.

use std::path::Path;
use std::time::Duration;

use model::Isa;
use serde_json::{json, Value};
use testkit::http::{post_json, stream_token_ids};
use testkit::observe::{shard_stat, tracker_metric as metric, wait_until};
use testkit::procs::{self, Proc};

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

const TOKEN: &str = "test-mixed-isa-token-0123456789";

/// The best instruction set here and the next best.
fn best_and_next() -> (&'static str, &'static str) {
    let (best, next) = match Isa::detect() {
        Isa::Avx512Vnni => (Isa::Avx512Vnni, Isa::Avx2),
        Isa::Avx2 => (Isa::Avx2, Isa::Scalar),
        Isa::Scalar => (Isa::Scalar, Isa::Scalar),
    };
    if best == next {
        eprintln!("mixed_isa: this CPU runs only the scalar kernels; both sides are scalar");
    }
    (best.name(), next.name())
}

fn shard(range: &str, isa: &str, token: &Path) -> Proc {
    procs::shard(
        exe(),
        &testkit::real_model(),
        range,
        token,
        &["--threads", "1", "--isa", isa],
    )
}

/// Prompts answered greedily and by seeded sampling, with log-probabilities.
fn cases() -> Vec<Value> {
    let prompts = [
        "Once upon a time, in a small village,",
        "def fibonacci(n):",
        "Q: What is the capital of Norway?\nA:",
    ];
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        for temperature in [0.0, 0.9] {
            out.push(
                json!({"prompt": p, "max_tokens": 16, "temperature": temperature,
                            "seed": 11 + i, "logprobs": 2, "return_token_ids": true,
                            "ignore_eos": true}),
            );
        }
    }
    out
}

fn answer(addr: &str, case: &Value) -> Value {
    let r = post_json(addr, "/v1/completions", case);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    json!({"ids": v["choices"][0]["token_ids"], "logprobs": v["choices"][0]["logprobs"]})
}

/// A shard on the next best instruction set chained to one on the best: every answer,
/// log-probabilities included, is bitwise the one of one process on the best.
#[test]
fn a_route_of_shards_on_different_isas_gives_one_processs_answers() {
    let token = procs::token_file(TOKEN);
    let (best, next) = best_and_next();
    let one = [shard("0..30", best, &token)];
    let mixed = [shard("0..15", next, &token), shard("15..30", best, &token)];
    let one_t = procs::tracker(exe(), &one.iter().collect::<Vec<_>>(), &token, &[]);
    let mixed_t = procs::tracker(exe(), &mixed.iter().collect::<Vec<_>>(), &token, &[]);
    for (i, case) in cases().iter().enumerate() {
        let want = answer(&one_t.addr, case);
        assert_eq!(want["ids"].as_array().map(Vec::len), Some(16), "{want}");
        assert_eq!(
            answer(&mixed_t.addr, case),
            want,
            "case {i}: {next} + {best} differs from one {best} process"
        );
    }
}

fn streamed(i: usize) -> Value {
    let prompts = [
        "def quicksort(xs):",
        "The history of Rome",
        "fn main() {",
        "Dear Sir,",
    ];
    json!({"prompt": prompts[i % 4], "max_tokens": 24, "stream": true, "return_token_ids": true,
           "ignore_eos": true, "temperature": if i.is_multiple_of(2) { 0.0 } else { 0.8 }, "seed": 40 + i})
}

/// One streamed request's token ids, or the error event it got.
fn stream_ids(addr: &str, i: usize) -> Result<Vec<u64>, String> {
    stream_token_ids(addr, "/v1/completions", &streamed(i))
}

/// The 8 streams at once.
fn all_streams(addr: &str) -> Vec<std::thread::JoinHandle<Result<Vec<u64>, String>>> {
    (0..8)
        .map(|i| {
            let addr = addr.to_string();
            std::thread::spawn(move || stream_ids(&addr, i))
        })
        .collect()
}

/// Two replica routes, the first on the best instruction set and the second on the next
/// best; 8 streams; a shard of the first route is killed while both routes hold sessions:
/// every stream goes on with no error and exactly the tokens one fault-free process on the
/// next best instruction set gives.
#[test]
fn failover_from_the_best_isa_to_the_next_keeps_every_streams_tokens() {
    let token = procs::token_file(TOKEN);
    let (best, next) = best_and_next();
    let want: Vec<Vec<u64>> = {
        let reference = [shard("0..30", next, &token)];
        let t = procs::tracker(exe(), &reference.iter().collect::<Vec<_>>(), &token, &[]);
        all_streams(&t.addr)
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    };
    let shards = [
        shard("0..15", best, &token),
        shard("15..30", best, &token),
        shard("0..12", next, &token),
        shard("12..30", next, &token),
    ];
    let tracker = procs::tracker_routes(
        exe(),
        &[
            ("best", &[&shards[0], &shards[1]]),
            ("next", &[&shards[2], &shards[3]]),
        ],
        &token,
        // By load alone: both routes must hold sessions, however their paces compare.
        &[
            "--health-period-ms",
            "100",
            "--liveness-ms",
            "1000",
            "--route-by",
            "load",
        ],
    );
    let addr = tracker.addr.clone();
    let before = metric(&addr, "strata_migrations_total");
    let handles = all_streams(&addr);
    // Both routes hold sessions: the best route's last shard (the one killed) and the next
    // route's first. (Its last shard gets them only once the scalar prefill of the first
    // layers is done: on a loaded machine, after the best route's short streams have ended.)
    let both_busy = wait_until(Duration::from_secs(60), || {
        shard_stat(&addr, &shards[1].addr, "sessions").unwrap_or(0) > 0
            && shard_stat(&addr, &shards[2].addr, "sessions").unwrap_or(0) > 0
    });
    assert!(both_busy, "the streams never held sessions on both routes");
    shards[1].signal(libc::SIGKILL);
    for (i, h) in handles.into_iter().enumerate() {
        let got = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("stream {i} saw an error: {e}"));
        assert_eq!(
            got, want[i],
            "stream {i} differs from one fault-free {next} process"
        );
    }
    assert!(
        metric(&addr, "strata_migrations_total") > before,
        "no session moved off the {best} route"
    );
}

/// A shard says which numeric contract it computes under (its cache recipe, which the
/// tracker's route check compares), and the tracker shows it per shard.
#[test]
fn a_shard_says_which_numeric_contract_it_computes_under() {
    let token = procs::token_file(TOKEN);
    let s = shard("0..30", best_and_next().1, &token);
    let t = procs::tracker(exe(), &[&s], &token, &[]);
    let health = testkit::http::get(&t.addr, "/health");
    assert_eq!(health.status, 200, "{}", health.body);
    let shards = health.json()["shards"].clone();
    assert_eq!(
        shards[0]["numeric_contract"],
        json!(model::NUMERIC_CONTRACT),
        "{shards}"
    );
}
