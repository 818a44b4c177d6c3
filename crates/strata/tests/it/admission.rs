//! Admission, backpressure and priority on the real model, through real processes on
//! 127.0.0.1: work that cannot fit is refused at admission naming the limit, overload gets fast
//! typed refusals with bounded memory, and agent latency holds under a grading burst.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::http::{get, request, SseStream};
use testkit::procs::{self, Proc};

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

/// One test at a time: they measure memory and latency on a 2-core machine.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn serve(shards: usize, extra: &[&str]) -> Proc {
    let model = testkit::real_model();
    let mut args: Vec<String> = [
        "serve",
        "--model",
        model.to_str().unwrap(),
        "--shards",
        &shards.to_string(),
        "--listen",
        "127.0.0.1:0",
        "--threads",
        if shards == 1 { "2" } else { "1" },
    ]
    .map(String::from)
    .to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    procs::spawn(exe(), &args, "strata tracker listening on ", "serve")
}

/// Sum of a metric's samples whose line starts with `prefix` (name plus labels).
fn metric_sum(addr: &str, prefix: &str) -> f64 {
    get(addr, "/metrics")
        .body
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn has_series(addr: &str, prefix: &str) -> bool {
    get(addr, "/metrics")
        .body
        .lines()
        .any(|l| l.starts_with(prefix))
}

fn complete(addr: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Value, Option<String>) {
    let r = request("POST", addr, "/v1/completions", Some(body), headers).expect("request");
    let retry = r.header("retry-after").map(str::to_string);
    (r.status, r.json(), retry)
}

/// Peak and current resident set of a process, in bytes.
fn rss(pid: i32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .map_or(0.0, |kib| kib * 1024.0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// Nearest-rank percentile of a latency histogram (sorted samples).
fn percentile(samples: &[Duration], p: f64) -> Duration {
    let mut s = samples.to_vec();
    s.sort();
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// A 2-shard route with a 4 MiB KV budget per shard (22 blocks of 16 positions for 15
/// layers): a request that could never fit is terminal (413); one that does not fit beside
/// a running session is refused at admission (503, Retry-After, the shard and the numbers)
/// without ever being queued; after the running session ends it is admitted.
#[test]
fn work_that_cannot_fit_is_refused_at_admission_naming_the_limit() {
    let _serial = serial();
    // The context is given: left to choose, a shard sizes it to what this budget holds.
    let t = serve(2, &["--kv-budget-mib", "4", "--ctx", "4096"]);
    let prompt = "The capital of France is";
    let (status, body, retry) = complete(
        &t.addr,
        &json!({"prompt": prompt, "max_tokens": 400, "temperature": 0}),
        &[],
    );
    let e = &body["error"];
    assert_eq!(status, 413, "{body}");
    assert_eq!(e["reason"], "too_large");
    assert_eq!(e["retryable"], false);
    assert!(retry.is_none());
    assert!(
        e["limit"]
            .as_str()
            .unwrap()
            .starts_with("kv_budget on shard 127.0.0.1:"),
        "{body}"
    );

    // 6 prompt tokens + 250 = 16 blocks of 22 on each shard, held while the stream is open
    // (one token a step, so it is surely open when the second request comes).
    let mut long = SseStream::open(
        &t.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 250, "temperature": 0, "ignore_eos": true, "stream": true, "speculative": false}),
    )
    .unwrap();
    assert_eq!(long.status, 200);
    assert!(long.next_data().is_some());
    let second = json!({"prompt": prompt, "max_tokens": 150, "temperature": 0});
    let (status, body, retry) = complete(&t.addr, &second, &[]);
    let e = &body["error"];
    assert_eq!(status, 503, "{body}");
    assert_eq!(e["reason"], "capacity");
    assert_eq!(e["retryable"], true);
    assert_eq!(retry.as_deref(), Some("1"));
    let message = e["message"].as_str().unwrap();
    assert!(
        message.starts_with("kv_budget on shard 127.0.0.1:")
            && message.contains(": need 1.8 MiB, free 1.1 MiB of 3.9 MiB"),
        "{message}"
    );
    assert_eq!(
        metric_sum(&t.addr, "strata_queue_depth"),
        0.0,
        "nothing was queued"
    );
    assert!(
        metric_sum(
            &t.addr,
            "strata_refusals_total{reason=\"capacity\",class=\"capacity\""
        ) >= 1.0
    );
    assert!(has_series(
        &t.addr,
        "strata_refusals_total{reason=\"budget\",class=\"budget\""
    ));

    // Closing the long stream cancels it and returns its reservation.
    drop(long);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body, _) = complete(&t.addr, &second, &[]);
        if status == 200 {
            break;
        }
        assert_eq!(status, 503, "{body}");
        assert!(
            Instant::now() < deadline,
            "never admitted after the release: {body}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The answer reaches its client before the route publishes its gauges again: every
    // reservation is back within a few of the route's loop turns.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut reserved = metric_sum(&t.addr, "strata_admission_kv_reserved_bytes");
    while reserved != 0.0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        reserved = metric_sum(&t.addr, "strata_admission_kv_reserved_bytes");
    }
    assert_eq!(reserved, 0.0, "every reservation returned");
}

/// Ten times more concurrent requests than there are places (2 active + 2 queued): the excess
/// gets fast typed refusals, every admitted request completes with the tokens it gives alone,
/// and no process's memory grows by more than a bound.
#[test]
fn overload_gets_fast_typed_refusals_and_bounded_memory() {
    let _serial = serial();
    let t = serve(
        2,
        &[
            "--max-active",
            "2",
            "--grading-max-active",
            "2",
            "--agent-queue",
            "2",
            "--key-share",
            "1",
        ],
    );
    let body = json!({"prompt": "Water boils at a temperature of", "max_tokens": 12, "temperature": 0, "return_token_ids": true});
    let (status, alone, _) = complete(&t.addr, &body, &[]);
    assert_eq!(status, 200);
    let want = alone["choices"][0]["token_ids"].clone();
    let mut pids = vec![t.pid()];
    pids.extend(procs::children(t.pid()));
    assert_eq!(pids.len(), 3, "tracker and two shards");
    let before: Vec<f64> = pids.iter().map(|&p| rss(p).1).collect();

    let n = 40;
    let results: Vec<(u16, Value, Duration)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|_| {
                let (addr, body) = (&t.addr, &body);
                s.spawn(move || {
                    let t0 = Instant::now();
                    let (status, v, _) = complete(addr, body, &[]);
                    (status, v, t0.elapsed())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok: Vec<_> = results.iter().filter(|r| r.0 == 200).collect();
    let refused: Vec<_> = results.iter().filter(|r| r.0 != 200).collect();
    assert!(ok.len() >= 4, "at least the places are used: {}", ok.len());
    assert!(!refused.is_empty(), "the excess is refused");
    for (_, v, _) in &ok {
        assert_eq!(
            v["choices"][0]["token_ids"], want,
            "admitted work is correct"
        );
    }
    for (status, v, _) in &refused {
        assert_eq!(*status, 503, "{v}");
        assert_eq!(v["error"]["reason"], "capacity");
        assert_eq!(v["error"]["limit"], "queue_slots[agent]");
        assert_eq!(v["error"]["retryable"], true);
    }
    let slowest_refusal = refused.iter().map(|r| r.2).max().unwrap();
    let fastest_completion = ok.iter().map(|r| r.2).min().unwrap();
    println!(
        "{} admitted, {} refused; slowest refusal {slowest_refusal:?}, fastest completion {fastest_completion:?}",
        ok.len(),
        refused.len()
    );
    assert!(
        slowest_refusal < fastest_completion,
        "a refusal never waits behind generation"
    );
    for (&pid, b) in pids.iter().zip(&before) {
        let (peak, now) = rss(pid);
        println!(
            "pid {pid}: rss before {:.1} MiB, after {:.1} MiB, peak {:.1} MiB",
            b / 1048576.0,
            now / 1048576.0,
            peak / 1048576.0
        );
        assert!(
            now - b < 64.0 * 1048576.0,
            "memory grew by more than 64 MiB"
        );
    }
    assert_eq!(
        metric_sum(
            &t.addr,
            "strata_refusals_total{reason=\"capacity\",class=\"capacity\",priority=\"agent\"}"
        ),
        refused.len() as f64
    );
}

/// Agent calls keep their latency while 100 grading requests burst against the same model:
/// agent p99 under the burst stays within 1.5 times its p99 alone (both measured by the client
/// in this run), and every grading request completes.
///
/// 400 calls a phase: the p99 is then the 5th slowest call. On two cores shared by the test,
/// the tracker and the shard's two compute threads, a few calls in a hundred take 30-50% longer
/// whether grading work runs or not (the OS preempting a compute thread), so with 100 calls the
/// p99 (the 2nd slowest) was one such call in one phase and not in the other often enough to
/// fail one CI run in a few (1.57x on 100 calls against 0.90-1.09x on 400 in repeated runs).
#[test]
fn agent_latency_holds_under_a_grading_burst() {
    let _serial = serial();
    let t = serve(1, &[]);
    let agent = json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let call = |addr: &str| {
        let t0 = Instant::now();
        let (status, v, _) = complete(addr, &agent, &[]);
        assert_eq!(status, 200, "{v}");
        t0.elapsed()
    };
    for _ in 0..3 {
        call(&t.addr);
    }
    let n = 400;
    let alone: Vec<Duration> = (0..n).map(|_| call(&t.addr)).collect();
    let grading = json!({"prompt": "Write a short grading note about the answer 42.", "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let (under, graded) = std::thread::scope(|s| {
        let burst: Vec<_> = (0..100)
            .map(|_| {
                let (addr, body) = (&t.addr, &grading);
                s.spawn(move || complete(addr, body, &[("x-strata-priority", "grading")]).0)
            })
            .collect();
        // Let the burst arrive, then measure agent calls while it is being served.
        std::thread::sleep(Duration::from_millis(300));
        let under: Vec<Duration> = (0..n).map(|_| call(&t.addr)).collect();
        let graded: Vec<u16> = burst.into_iter().map(|h| h.join().unwrap()).collect();
        (under, graded)
    });
    let (p50a, p99a) = (percentile(&alone, 50.0), percentile(&alone, 99.0));
    let (p50b, p99b) = (percentile(&under, 50.0), percentile(&under, 99.0));
    println!(
        "agent alone p50 {p50a:?} p99 {p99a:?}; under a 100-request grading burst p50 {p50b:?} p99 {p99b:?} ({:.2}x)",
        p99b.as_secs_f64() / p99a.as_secs_f64()
    );
    assert!(
        graded.iter().all(|&s| s == 200),
        "every grading request completes: {graded:?}"
    );
    let wait = metric_sum(
        &t.addr,
        "strata_queue_wait_seconds_count{priority=\"grading\"",
    );
    assert_eq!(wait, 100.0, "all 100 grading sessions were scheduled");
    assert!(
        p99b.as_secs_f64() <= 1.5 * p99a.as_secs_f64(),
        "agent p99 {p99b:?} under the burst exceeds 1.5 x {p99a:?}"
    );
    assert_eq!(metric_sum(&t.addr, "strata_swaps_total"), 0.0);
}

/// API keys with token budgets and a durable usage ledger: unknown keys are refused (401), a
/// key over its budget gets `budget` (429, terminal), distinct from `capacity`; after the
/// tracker is killed with SIGKILL mid-request and restarted on the same ledger, every accepted
/// request is there: the finished ones charged what they used, the interrupted one its prompt
/// and the tokens last checkpointed for it (at most a second behind; never its reservation).
#[test]
fn the_usage_ledger_survives_kill_9_and_budgets_are_refused_as_budget() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("strata-ledger-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("ledger.sqlite");
    let keys = dir.join("keys");
    std::fs::write(&keys, "alice sk-alice-0123 100000\nbob sk-bob-4567 50\n").unwrap();
    // The operator's view stays open here: this test reads refusal counters without a key.
    let flags = [
        "--ledger",
        db.to_str().unwrap(),
        "--api-keys",
        keys.to_str().unwrap(),
        "--public-metrics",
    ];
    let t = serve(1, &flags);
    let alice = [("authorization", "Bearer sk-alice-0123")];
    let bob = [("authorization", "Bearer sk-bob-4567")];
    let short = json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0});

    let (status, body, _) = complete(&t.addr, &short, &[]);
    assert_eq!(
        (status, body["error"]["reason"].as_str()),
        (401, Some("unauthorized"))
    );

    let mut used = 0;
    let mut prompt_tokens = 0;
    for _ in 0..3 {
        let (status, body, _) = complete(&t.addr, &short, &alice);
        assert_eq!(status, 200, "{body}");
        used += body["usage"]["total_tokens"].as_u64().unwrap();
        prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
    }
    let (status, body, retry) = complete(
        &t.addr,
        &json!({"prompt": "The capital of France is", "max_tokens": 60}),
        &bob,
    );
    let e = &body["error"];
    assert_eq!(status, 429, "{body}");
    assert_eq!(e["reason"], "budget");
    assert_eq!(e["limit"], "token_budget[bob]");
    assert_eq!(e["retryable"], false);
    assert!(retry.is_none());
    assert!(
        metric_sum(
            &t.addr,
            "strata_refusals_total{reason=\"budget\",class=\"budget\""
        ) >= 1.0
    );
    assert_eq!(
        metric_sum(
            &t.addr,
            "strata_refusals_total{reason=\"capacity\",class=\"capacity\""
        ),
        0.0,
        "a budget refusal is not a capacity refusal"
    );

    // A long request is in flight when the tracker dies, after more than a checkpoint interval
    // of tokens.
    let max_tokens = 4000;
    let mut long = SseStream::open_with(
        &t.addr,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": max_tokens, "ignore_eos": true, "stream": true}),
        &alice,
    )
    .unwrap();
    assert_eq!(long.status, 200);
    let mut received = 0u64;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(2500) {
        assert!(long.next_data().is_some());
        received += 1;
    }
    t.signal(9);
    drop(t);
    drop(long);

    let t = serve(1, &flags);
    let r = request("GET", &t.addr, "/v1/usage", None, &alice).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let u = r.json();
    println!("alice after the restart: {u}");
    assert_eq!(u["requests"], json!({"done": 3, "interrupted": 1}));
    let interrupted = u["charged_tokens"].as_u64().unwrap() - used;
    println!("the interrupted request: {received} tokens received, charged {interrupted} (prompt {prompt_tokens})");
    assert!(
        interrupted > prompt_tokens,
        "what it generated (checkpointed) is billed: {interrupted}"
    );
    // At most what was generated by the crash: what the client had, and the few tokens of
    // the steps in flight.
    assert!(
        interrupted <= prompt_tokens + received + 16,
        "{interrupted} charged, {received} tokens received"
    );
    assert!(
        interrupted < prompt_tokens + max_tokens,
        "not its reservation"
    );
    assert_eq!(u["reserved_tokens"], 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Steps are sized so that no shard's scratch or in-flight budget can be exceeded: with 1 MiB
/// of activations allowed in flight and two micro-batches in flight, a 2-shard route of the
/// 576-wide model carries at most 227 tokens per step, so a ~300-token prompt is prefilled in
/// chunks and still answered; every pool's use and budget is exported per shard.
#[test]
fn steps_fit_the_shards_scratch_and_inflight_budgets_and_pools_are_exported() {
    let _serial = serial();
    let t = serve(2, &["--inflight-budget-mib", "1"]);
    let prompt = "The capital of France is Paris. ".repeat(40);
    let (status, body, _) = complete(
        &t.addr,
        &json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}),
        &[],
    );
    assert_eq!(status, 200, "{body}");
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > 256);
    let metrics = get(&t.addr, "/metrics").body;
    let bucket = |le: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("strata_batch_tokens_bucket{") && l.contains(&format!("le=\"{le}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert!(bucket("+Inf") > 0.0);
    assert_eq!(
        bucket("256"),
        bucket("+Inf"),
        "no step carried more than 256 tokens"
    );
    for pool in ["weights", "kv", "scratch", "inflight"] {
        let budget = "strata_shard_pool_budget_bytes{shard=";
        let lines: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with(budget) && l.contains(&format!("pool=\"{pool}\"")))
            .collect();
        assert_eq!(lines.len(), 2, "{pool} budget on both shards: {lines:?}");
    }
    assert!(metrics
        .lines()
        .any(|l| l.starts_with("strata_shard_pool_budget_bytes{")
            && l.contains("pool=\"inflight\"")
            && l.ends_with(" 1048576")));
}
