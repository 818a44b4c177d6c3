//! A real cluster on 127.0.0.1: shard processes and a tracker process, talked to over HTTP.
//! Parity with one process, concurrency, cancellation, token checks and route validation.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::http::{get, post_json, SseStream};
use testkit::observe::{self, tracker_metric};
use testkit::procs::{self, Proc};

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

fn model() -> PathBuf {
    testkit::real_model()
}

fn reference_prompts() -> Vec<Vec<u32>> {
    let r: Value = serde_json::from_str(&testkit::reference_text("greedy_public.json")).unwrap();
    r["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            g["prompt_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

/// Greedy ids from `strata generate` in one process.
fn one_process(prompt: &[u32], n: usize) -> Vec<u64> {
    one_process_with(prompt, n, &[])
}

/// The same, `strata generate` given `flags` too.
fn one_process_with(prompt: &[u32], n: usize, flags: &[&str]) -> Vec<u64> {
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let out = Command::new(exe())
        .args([
            "generate",
            "--model",
            model().to_str().unwrap(),
            "--prompt-ids",
            &ids.join(","),
            "--max-tokens",
            &n.to_string(),
            "--json",
        ])
        .args(flags)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn complete_ids(addr: &str, prompt: &[u32], n: usize) -> Vec<u64> {
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() == prompt.len() as u64);
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Cluster tests run one at a time: they start several processes on two cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

struct Cluster {
    shards: Vec<Proc>,
    tracker: Proc,
}

fn cluster(ranges: &[&str]) -> Cluster {
    cluster_with(ranges, &["--health-period-ms", "100"])
}

/// Shards of `ranges` (one kernel thread each) and a tracker over them started with `flags`.
fn cluster_with(ranges: &[&str], flags: &[&str]) -> Cluster {
    let token = procs::token_file("test-cluster-token-0123456789");
    let m = model();
    let shards: Vec<Proc> = ranges
        .iter()
        .map(|r| procs::shard(exe(), &m, r, &token, &["--threads", "1"]))
        .collect();
    let refs: Vec<&Proc> = shards.iter().collect();
    let tracker = procs::tracker(exe(), &refs, &token, flags);
    Cluster { shards, tracker }
}

fn shard_stat(addr: &str, shard: &str, field: &str) -> u64 {
    observe::shard_stat(addr, shard, field).unwrap_or(u64::MAX)
}

fn metric(addr: &str, name: &str, shard: &str) -> f64 {
    let text = get(addr, "/metrics").body;
    let key = format!("{name}{{shard=\"{shard}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{key} not in metrics"))
}

fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if f() {
            return Some(t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn two_and_three_shard_routes_match_one_process_and_both_shards_work() {
    let _serial = serial();
    let prompts = reference_prompts();
    let alone: Vec<Vec<u64>> = prompts.iter().map(|p| one_process(p, 32)).collect();
    for ranges in [&["0..15", "15..30"][..], &["0..10", "10..20", "20..30"][..]] {
        let c = cluster(ranges);
        for (p, want) in prompts.iter().zip(&alone) {
            assert_eq!(
                &complete_ids(&c.tracker.addr, p, 32),
                want,
                "route {ranges:?}, prompt {p:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(300));
        for s in &c.shards {
            let prefill = metric(
                &c.tracker.addr,
                "strata_shard_prefill_tokens_total",
                &s.addr,
            );
            let decode = metric(&c.tracker.addr, "strata_shard_decode_tokens_total", &s.addr);
            assert!(
                prefill > 0.0 && decode > 0.0,
                "shard {} did no work: {prefill} {decode}",
                s.addr
            );
            // Exported even when nothing moved (these shards run one kernel thread).
            let moves = metric(
                &c.tracker.addr,
                "strata_shard_kernel_thread_moves_total",
                &s.addr,
            );
            assert_eq!(moves, 0.0, "shard {} has no kernel worker to move", s.addr);
        }
        // Every seam carried activations and had its round trip measured (from the next
        // shard's acknowledgements); the route's messaging time was recorded per step.
        for pair in c.shards.windows(2) {
            let hop = format!("{}->{}", pair[0].addr, pair[1].addr);
            let bytes = hop_metric(&c.tracker.addr, "strata_seam_bytes_total", &hop);
            let rtts = hop_metric(&c.tracker.addr, "strata_seam_latency_seconds_count", &hop);
            assert!(
                bytes > 0.0 && rtts > 0.0,
                "hop {hop}: {bytes} bytes, {rtts} round trips"
            );
        }
        assert!(tracker_metric(&c.tracker.addr, "strata_route_overhead_seconds_count") > 0.0);
        // The first shard started decode steps on the last shard's token hints (passed up by
        // the middle shard of three) and the tracker's steps used them; only the first starts
        // any.
        let early = |shard: &Proc, outcome: &str| {
            labelled_sum(
                &c.tracker.addr,
                "strata_shard_early_steps_total",
                &[("shard", &shard.addr), ("outcome", outcome)],
            )
        };
        let first = &c.shards[0];
        assert!(
            early(first, "used") > 0.0,
            "route {ranges:?}: no early step used ({} started, {} discarded)",
            early(first, "started"),
            early(first, "discarded")
        );
        for s in &c.shards[1..] {
            assert_eq!(early(s, "started"), 0.0, "shard {}", s.addr);
        }
    }
}

/// The sum of metric `name` over the series labelled `hop`.
fn hop_metric(addr: &str, name: &str, hop: &str) -> f64 {
    labelled_sum(addr, name, &[("hop", hop)])
}

/// The sum of metric `name` over the series carrying every one of `labels`.
fn labelled_sum(addr: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    get(addr, "/metrics")
        .body
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.trim().parse::<f64>().ok())
        .sum()
}

#[test]
fn concurrent_sessions_match_alone_and_cancellation_frees_kv_everywhere() {
    let _serial = serial();
    let prompts = reference_prompts();
    let alone: Vec<Vec<u64>> = prompts.iter().map(|p| one_process(p, 24)).collect();
    let c = cluster(&["0..15", "15..30"]);
    let addr = c.tracker.addr.clone();

    // Four concurrent sessions with different prompts.
    let handles: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|p| {
            let addr = addr.clone();
            std::thread::spawn(move || complete_ids(&addr, &p, 24))
        })
        .collect();
    for (h, want) in handles.into_iter().zip(&alone) {
        assert_eq!(&h.join().unwrap(), want);
    }

    let long_alone = one_process(&prompts[0], 300);
    assert_eq!(long_alone.len(), 300);
    // A streaming session that disconnects while two others run.
    let long = json!({"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "stream": true, "ignore_eos": true});
    let mut stream = SseStream::open(&addr, "/v1/completions", &long).unwrap();
    assert_eq!(stream.status, 200);
    // The other two must still be running when the stream is dropped: 300 tokens of a prompt
    // that does not end early (deterministic, greedy).
    let others: Vec<_> = (0..2)
        .map(|_| {
            let (addr, p) = (addr.clone(), prompts[0].clone());
            std::thread::spawn(move || complete_ids(&addr, &p, 300))
        })
        .collect();
    for _ in 0..3 {
        stream.next_data().expect("tokens stream");
    }
    let held = |n: u64| {
        c.shards
            .iter()
            .all(|s| shard_stat(&addr, &s.addr, "sessions") == n)
    };
    assert!(
        wait_until(Duration::from_secs(5), || held(3)).is_some(),
        "three sessions should be held, shards hold {:?}",
        c.shards
            .iter()
            .map(|s| shard_stat(&addr, &s.addr, "sessions"))
            .collect::<Vec<_>>()
    );
    drop(stream);
    let freed = wait_until(Duration::from_secs(1), || held(2));
    assert!(
        freed.is_some(),
        "the cancelled session's KV was not freed within a second on every shard"
    );
    eprintln!(
        "cancelled session released on every shard {:?} after the disconnect",
        freed.unwrap()
    );
    for h in others {
        assert_eq!(
            h.join().unwrap(),
            long_alone,
            "a session changed when another was cancelled"
        );
    }
    let zero = wait_until(Duration::from_secs(2), || {
        c.shards.iter().all(|s| {
            shard_stat(&addr, &s.addr, "kv_bytes_in_use") == 0
                && shard_stat(&addr, &s.addr, "sessions") == 0
        })
    });
    assert!(zero.is_some(), "KV in use did not return to zero");
}

/// A client that hangs up while its long prompt is being prefilled (in 32-token steps, a
/// request that is not streamed): the tracker cancels the session with its next step and the
/// shards drop it, having computed a small part of the prompt instead of all of it.
#[test]
fn a_client_that_hangs_up_mid_prefill_stops_the_work_on_every_shard() {
    use std::io::Write;
    let _serial = serial();
    let Cluster { shards, tracker } = cluster_with(
        &["0..15", "15..30"],
        &[
            "--health-period-ms",
            "100",
            "--max-step-tokens",
            "32",
            "--prefill-chunk",
            "32",
        ],
    );
    let t = tracker.addr.clone();
    let prompt: Vec<u32> = eight_prompts()
        .concat()
        .into_iter()
        .cycle()
        .take(1600)
        .collect();
    let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}).to_string();
    let prefilled = |s: &Proc| metric(&t, "strata_shard_prefill_tokens_total", &s.addr) as u64;
    let mut client = std::net::TcpStream::connect(&t).unwrap();
    write!(
        client,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || prefilled(&shards[1]) > 0).is_some(),
        "the prompt's prefill reached the last shard"
    );
    let at_hangup: Vec<u64> = shards.iter().map(prefilled).collect();
    drop(client);
    let gone = wait_until(Duration::from_secs(5), || {
        tracker_metric(&t, "strata_cancelled_total") == 1.0
            && shards
                .iter()
                .all(|s| shard_stat(&t, &s.addr, "sessions") == 0)
    });
    assert!(
        gone.is_some(),
        "the session was cancelled and dropped on every shard"
    );
    // The scrape that saw the session gone carries its last count.
    let done: Vec<u64> = shards.iter().map(prefilled).collect();
    eprintln!(
        "{} prompt tokens; computed per shard at the hang-up {at_hangup:?}, in the end {done:?}; dropped {:?} after it",
        prompt.len(),
        gone.unwrap()
    );
    for d in done {
        assert!(
            d < prompt.len() as u64 / 2,
            "a shard went on computing the prompt of a client that had gone: {d} of {} tokens",
            prompt.len()
        );
    }
}

#[test]
fn api_surface_validation_streaming_and_errors() {
    let _serial = serial();
    let c = cluster(&["0..15", "15..30"]);
    let addr = &c.tracker.addr;
    let models = get(addr, "/v1/models").json();
    let id = models["data"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(id, "SmolLM2-135M-Instruct.Q4_1");

    let r = post_json(
        addr,
        "/v1/chat/completions",
        &json!({"model": id, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 30, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert!(v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .contains('4'));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    assert_eq!(
        v["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            .as_array()
            .unwrap()
            .len(),
        2
    );

    let mut s = SseStream::open(addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "stream": true, "temperature": 0})).unwrap();
    let mut datas = Vec::new();
    while let Some(d) = s.next_data() {
        datas.push(d);
    }
    assert_eq!(datas.last().unwrap(), "[DONE]");
    let last_chunk: Value = serde_json::from_str(&datas[datas.len() - 2]).unwrap();
    // Usage comes only when `stream_options.include_usage` asks for it (as OpenAI sends it).
    assert!(last_chunk.get("usage").is_none(), "{last_chunk}");
    assert!(last_chunk["choices"][0]["finish_reason"].is_string());

    for (body, param) in [
        (json!({"prompt": "x", "temperature": 9}), "temperature"),
        (json!({"prompt": "x", "max_tokens": -1}), "max_tokens"),
        (json!({"prompt": []}), "prompt"),
        (json!({"prompt": "x", "max_tokens": 100000}), "max_tokens"),
    ] {
        let r = post_json(addr, "/v1/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["param"], param, "{}", r.body);
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert!(e["error"]["message"].is_string() && e["error"]["code"].is_string());
    }
    let r = testkit::http::request("POST", addr, "/v1/completions", None, &[]).unwrap();
    assert_eq!(r.status, 400, "{}", r.body);
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"model": "gpt-9", "prompt": "x"}),
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["reason"], "not_resident");
    let health = get(addr, "/health");
    assert_eq!(health.status, 200);
    assert_eq!(health.json()["status"], "ok");
}

#[test]
fn connections_without_the_cluster_token_are_refused() {
    let _serial = serial();
    let token = procs::token_file("right-token-abcdef0123456789");
    let shard = procs::shard(exe(), &model(), "0..30", &token, &["--threads", "1"]);
    let wrong = procs::token_file("wrong-token-abcdef0123456789-x");
    let out = Command::new(exe())
        .args([
            "tracker",
            "--shards",
            &shard.addr,
            "--listen",
            "127.0.0.1:0",
            "--cluster-token-file",
            wrong.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("refused the cluster token"), "{err}");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        use proto::ShardTransport;
        let no = proto::connect(&shard.addr, &proto::Link::plain("not-the-token-at-all")).unwrap();
        let e = no.describe(Duration::from_secs(5)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let yes = proto::connect(
            &shard.addr,
            &proto::Link::plain("right-token-abcdef0123456789"),
        )
        .unwrap();
        assert_eq!(
            yes.describe(Duration::from_secs(5))
                .await
                .unwrap()
                .layer_end,
            30
        );
    });
}

#[test]
fn a_route_with_a_gap_or_overlap_is_refused_naming_the_shard() {
    let _serial = serial();
    let token = procs::token_file("test-cluster-token-0123456789");
    let a = procs::shard(exe(), &model(), "0..10", &token, &["--threads", "1"]);
    let b = procs::shard(exe(), &model(), "12..30", &token, &["--threads", "1"]);
    let err = refused_route(&[&a, &b], &token);
    assert!(
        err.contains("layers 10..12 are not covered") && err.contains(&b.addr),
        "{err}"
    );
}

/// What a tracker given the route of `shards` prints as it exits 1, refusing it.
fn refused_route(shards: &[&Proc], token: &Path) -> String {
    let addrs: Vec<&str> = shards.iter().map(|s| s.addr.as_str()).collect();
    let out = Command::new(exe())
        .args([
            "tracker",
            "--shards",
            &addrs.join(","),
            "--listen",
            "127.0.0.1:0",
        ])
        .arg("--cluster-token-file")
        .arg(token)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Seam bytes per token: 576 activations as f32, f16, or q8_0 (18 blocks of 32 values, 34
/// bytes each); the lossy encodings still answer.
#[test]
fn f16_and_q8_0_seams_carry_a_half_and_about_a_quarter_of_the_bytes_per_token() {
    let _serial = serial();
    let token = procs::token_file("test-cluster-token-0123456789");
    let m = model();
    for (seam, bytes_per_token) in [
        ("f32", 576.0 * 4.0),
        ("f16", 576.0 * 2.0),
        ("q8_0", 18.0 * 34.0),
    ] {
        let a = procs::shard(exe(), &m, "0..15", &token, &["--threads", "1"]);
        let b = procs::shard(exe(), &m, "15..30", &token, &["--threads", "1"]);
        let t = procs::tracker(
            exe(),
            &[&a, &b],
            &token,
            &["--health-period-ms", "100", "--seam", seam],
        );
        let ids = complete_ids(&t.addr, &reference_prompts()[0], 8);
        assert_eq!(ids.len(), 8);
        std::thread::sleep(Duration::from_millis(300));
        let sent = metric(&t.addr, "strata_shard_seam_bytes_out_total", &a.addr);
        let tokens = metric(&t.addr, "strata_shard_prefill_tokens_total", &a.addr)
            + metric(&t.addr, "strata_shard_decode_tokens_total", &a.addr);
        assert_eq!(sent / tokens, bytes_per_token, "seam {seam}");
    }
}

/// Shards caching K and V as `q8_0` answer as one process caching them so does, token for
/// token; a route whose shards cache them differently is refused at start, naming the shard
/// (the cache recipe's `kv_dtype`).
#[test]
fn a_q8_0_kv_route_answers_as_one_process_and_a_mixed_route_is_refused() {
    let _serial = serial();
    let token = procs::token_file("test-cluster-token-0123456789");
    let m = model();
    let q8 = ["--threads", "1", "--kv-type", "q8_0"];
    let a = procs::shard(exe(), &m, "0..15", &token, &q8);
    let b = procs::shard(exe(), &m, "15..30", &token, &q8);
    let t = procs::tracker(exe(), &[&a, &b], &token, &["--health-period-ms", "100"]);
    let health = get(&t.addr, "/health").json();
    for s in health["shards"].as_array().unwrap() {
        assert_eq!(s["kv_dtype"], "q8_0", "{health}");
    }
    for prompt in &reference_prompts()[..2] {
        let want = one_process_with(prompt, 12, &["--kv-type", "q8_0"]);
        assert_eq!(complete_ids(&t.addr, prompt, 12), want);
    }
    drop(t);
    let f16 = procs::shard(exe(), &m, "15..30", &token, &["--threads", "1"]);
    let err = refused_route(&[&a, &f16], &token);
    assert!(
        err.contains(&format!(
            "shard {} (layers 15..30) stores K and V as f16",
            f16.addr
        )),
        "{err}"
    );
}

/// Eight distinct prompts: the four reference prompts and each joined to the next.
fn eight_prompts() -> Vec<Vec<u32>> {
    let r = reference_prompts();
    let mut out = r.clone();
    for i in 0..4 {
        out.push([r[i].clone(), r[(i + 1) % 4].clone()].concat());
    }
    out
}

fn concurrently(addr: &str, prompts: &[Vec<u32>], n: usize) -> Vec<Vec<u64>> {
    let handles: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|p| {
            let addr = addr.to_string();
            std::thread::spawn(move || complete_ids(&addr, &p, n))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// 1, 2, 4 and 8 concurrent sessions through a 2-shard route (two micro-batches in flight) each
/// give exactly their tokens alone; again with prefill chunked to 16-token steps.
#[test]
fn one_to_eight_concurrent_sessions_match_alone_also_with_chunked_prefill() {
    let _serial = serial();
    let prompts = eight_prompts();
    let alone: Vec<Vec<u64>> = prompts.iter().map(|p| one_process(p, 32)).collect();
    let token = procs::token_file("test-cluster-token-0123456789");
    let m = model();
    for tracker_flags in [
        &[][..],
        &["--max-step-tokens", "16", "--prefill-chunk", "16"][..],
    ] {
        let shards: Vec<Proc> = ["0..15", "15..30"]
            .iter()
            .map(|r| procs::shard(exe(), &m, r, &token, &["--threads", "1"]))
            .collect();
        let refs: Vec<&Proc> = shards.iter().collect();
        let mut flags = vec!["--health-period-ms", "100"];
        flags.extend_from_slice(tracker_flags);
        let tracker = procs::tracker(exe(), &refs, &token, &flags);
        for n in [1, 2, 4, 8] {
            let got = concurrently(&tracker.addr, &prompts[..n], 32);
            for (i, (g, want)) in got.iter().zip(&alone).enumerate() {
                assert_eq!(g, want, "{n} concurrent {tracker_flags:?}: prompt {i}");
            }
        }
        let in_flight = tracker_metric(&tracker.addr, "strata_steps_in_flight");
        assert!(in_flight <= 2.0, "at most one micro-batch per shard");
    }
}

/// A shard that forgot sessions (idle past its TTL while the route was stalled) answers
/// cache_miss; the tracker replays those sessions from their known tokens under the same
/// route, and every client gets exactly the tokens of an undisturbed run.
#[test]
fn evicted_sessions_are_replayed_and_clients_see_identical_output() {
    let _serial = serial();
    let prompts = reference_prompts();
    let alone: Vec<Vec<u64>> = prompts.iter().map(|p| one_process(p, 32)).collect();
    let token = procs::token_file("test-cluster-token-0123456789");
    let m = model();
    let first = procs::shard(exe(), &m, "0..15", &token, &["--threads", "1"]);
    let second = procs::shard(
        exe(),
        &m,
        "15..30",
        &token,
        // Longer than any step of the test build on a slow host (a shorter TTL evicted
        // sessions between their own steps, with no stall), shorter than the stall below.
        &["--threads", "1", "--kv-ttl-ms", "1500"],
    );
    // The stall is longer than the second shard's TTL, not than the route's liveness.
    let tracker = procs::tracker(
        exe(),
        &[&first, &second],
        &token,
        &["--health-period-ms", "100", "--liveness-ms", "6000"],
    );
    let addr = tracker.addr.clone();
    let runner = {
        let prompts = prompts.clone();
        let addr = addr.clone();
        std::thread::spawn(move || concurrently(&addr, &prompts, 32))
    };
    // Let the sessions start, then stall the route at the first shard for longer than the
    // second shard's TTL: the micro-batch not in the next step has sat idle there too long.
    assert!(
        wait_until(Duration::from_secs(10), || {
            shard_stat(&addr, &second.addr, "sessions") == prompts.len() as u64
        })
        .is_some(),
        "all sessions should reach the second shard"
    );
    first.signal(19);
    std::thread::sleep(Duration::from_millis(2500));
    first.signal(18);
    let got = runner.join().unwrap();
    for (i, (g, want)) in got.iter().zip(&alone).enumerate() {
        assert_eq!(g, want, "prompt {i} after eviction and replay");
    }
    let evictions = shard_stat(&addr, &second.addr, "evictions");
    let replays = tracker_metric(&addr, "strata_replays_total");
    eprintln!("second shard evictions {evictions}, tracker replays {replays}");
    assert!(evictions >= 1, "the stall should have evicted a session");
    assert!(
        replays >= 1.0,
        "an evicted session should have been replayed"
    );
}

/// The prefix cache is partitioned by API key: a key's repeated prompt starts on its cached
/// blocks on every shard, another key's same prompt computes every position (so its time to
/// first token tells it nothing of what others sent), and the answers are the same.
#[test]
fn cached_prefix_blocks_are_shared_within_a_key_and_never_across_keys() {
    let _serial = serial();
    let prompt: Vec<u32> = eight_prompts()[4..].concat();
    assert!(prompt.len() > 32, "two full blocks and more");
    let keys = procs::ApiKeys::new(
        "prefix",
        &[("alice", "sk-alice-0123"), ("bob", "sk-bob-4567")],
    );
    let mut flags = vec!["--health-period-ms", "100"];
    flags.extend(keys.flags());
    // The shards' counters are read without a key.
    flags.push("--public-metrics");
    let Cluster { shards, tracker } = cluster_with(&["0..15", "15..30"], &flags);
    let t = tracker.addr.clone();
    // The answer's token ids and the prompt tokens its usage says came from the cache.
    let ask_in = |secret: &str, group: Value| -> (Vec<u64>, u64) {
        let auth = format!("Bearer {secret}");
        let mut body =
            json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": true});
        body.as_object_mut()
            .unwrap()
            .extend(group.as_object().unwrap().clone());
        let r = testkit::http::request(
            "POST",
            &t,
            "/v1/completions",
            Some(&body),
            &[("authorization", &auth)],
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let ids = v["choices"][0]["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        (
            ids,
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        )
    };
    let ask = |secret: &str| ask_in(secret, json!({}));
    let reused = || -> Vec<u64> {
        shards
            .iter()
            .map(|s| metric(&t, "strata_shard_prefix_reused_tokens_total", &s.addr) as u64)
            .collect()
    };
    let blocks = ((prompt.len() - 1) / 16 * 16) as u64;
    let (want, cached) = ask("sk-alice-0123");
    assert_eq!(cached, 0, "nothing cached before the first request");
    assert_eq!(
        ask("sk-alice-0123"),
        (want.clone(), blocks),
        "usage says what was reused"
    );
    assert!(
        wait_until(Duration::from_secs(10), || reused() == vec![blocks; 2]).is_some(),
        "alice's repeat starts on her cached blocks on both shards: {:?}",
        reused()
    );
    assert_eq!(
        ask("sk-bob-4567"),
        (want.clone(), 0),
        "bob gets the same answer, computed"
    );
    assert_eq!(ask("sk-alice-0123"), (want.clone(), blocks));
    // The counters are the tracker's scrape of each shard (every health period): wait until
    // both have counted alice's third request, then nothing more may come.
    assert!(
        wait_until(Duration::from_secs(10), || reused() == vec![2 * blocks; 2]).is_some(),
        "alice's second and third requests reused her prefix, bob's nothing: {:?}",
        reused()
    );
    // Another tracker on the same shards whose key is also named alice, with another secret:
    // another tenant (the partition follows the secret, not the name).
    let other_keys = procs::ApiKeys::new("prefix-other", &[("alice", "sk-other-alice-89")]);
    let token = procs::token_file("test-cluster-token-0123456789");
    let refs: Vec<&Proc> = shards.iter().collect();
    let other = procs::tracker(exe(), &refs, &token, &other_keys.flags());
    let auth = "Bearer sk-other-alice-89";
    let body =
        json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": true});
    let r = testkit::http::request(
        "POST",
        &other.addr,
        "/v1/completions",
        Some(&body),
        &[("authorization", auth)],
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    let got: Vec<u64> = r.json()["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(got, want);
    assert_eq!(
        reused(),
        vec![2 * blocks; 2],
        "the other tracker's alice reused nothing of this one's alice"
    );
    // A request naming a cache group (`prompt_cache_key`, `cache_salt`) narrows its key's
    // partition: alice's group starts apart from her own ungrouped blocks, then reuses its
    // own; bob naming alice's group reaches nothing of hers.
    let group = json!({"prompt_cache_key": "project-a"});
    assert_eq!(ask_in("sk-alice-0123", group.clone()), (want.clone(), 0));
    assert_eq!(
        ask_in("sk-alice-0123", group.clone()),
        (want.clone(), blocks)
    );
    assert_eq!(ask_in("sk-bob-4567", group.clone()), (want.clone(), 0));
    let salted = json!({"prompt_cache_key": "project-a", "cache_salt": "s1"});
    assert_eq!(ask_in("sk-alice-0123", salted), (want.clone(), 0));
    assert!(
        wait_until(Duration::from_secs(10), || reused() == vec![3 * blocks; 2]).is_some(),
        "only alice's second request in her group reused blocks: {:?}",
        reused()
    );
}

/// Alice keeps a six-digit secret in her system prompt. Bob, guessing it, waits as long for
/// his first token when he guesses right as when he guesses wrong: 8 + 8 trials in a shuffled
/// order, each under its own key (so no trial starts on blocks of an earlier one of bob's),
/// and the slowest right guess is slower than the fastest wrong one. Alice's own repeat still
/// starts on her cached blocks (its usage says so).
#[test]
fn a_guess_at_another_keys_prompt_takes_as_long_right_as_wrong() {
    let _serial = serial();
    let bobs: Vec<(String, String)> = (0..16)
        .map(|i| (format!("bob{i}"), format!("sk-bob-{i}-4567")))
        .collect();
    let mut pairs = vec![("alice", "sk-alice-0123")];
    pairs.extend(bobs.iter().map(|(n, s)| (n.as_str(), s.as_str())));
    let keys = procs::ApiKeys::new("oracle", &pairs);
    let Cluster {
        shards: _shards,
        tracker,
    } = cluster_with(&["0..15", "15..30"], &keys.flags());
    let t = tracker.addr.clone();
    // The secret early in a system prompt of about 200 tokens: a guess that reached alice's
    // blocks would skip nearly all of its prefill.
    let prompt = |code: &str| {
        format!(
            "System: the vault code is {code}. You are the vault's assistant. {}\nUser: hello\nAssistant:",
            "Answer questions about opening hours, deposits and the lockers, politely and briefly. "
                .repeat(10)
        )
    };
    // Seconds to the first streamed token.
    let first_token = |secret: &str, text: &str| -> f64 {
        let auth = format!("Bearer {secret}");
        let body = json!({"prompt": text, "max_tokens": 1, "temperature": 0, "stream": true});
        let started = Instant::now();
        let mut s = SseStream::open_with(&t, "/v1/completions", &body, &[("authorization", &auth)])
            .unwrap();
        assert_eq!(s.status, 200);
        s.next_data().expect("a first token");
        started.elapsed().as_secs_f64()
    };
    // The prompt's tokens and those of them usage says were cached.
    let cached = |secret: &str, text: &str| -> (u64, u64) {
        let auth = format!("Bearer {secret}");
        let body = json!({"prompt": text, "max_tokens": 1, "temperature": 0});
        let r = testkit::http::request(
            "POST",
            &t,
            "/v1/completions",
            Some(&body),
            &[("authorization", &auth)],
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let usage = &r.json()["usage"];
        (
            usage["prompt_tokens"].as_u64().unwrap(),
            usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        )
    };
    let secret = prompt("402917");
    let (n_prompt, first) = cached("sk-alice-0123", &secret);
    assert!(
        n_prompt > 150 && first == 0,
        "{n_prompt} tokens, {first} cached"
    );
    let alice_repeat = first_token("sk-alice-0123", &secret);
    let (_, alice_cached) = cached("sk-alice-0123", &secret);
    assert_eq!(
        alice_cached,
        (n_prompt - 1) / 16 * 16,
        "alice's repeat starts on her blocks"
    );
    // Trial i guesses right when `order[i]` is even: a fixed shuffle of 8 right, 8 wrong.
    let order = [3, 8, 14, 1, 6, 11, 0, 9, 4, 15, 12, 7, 2, 13, 10, 5];
    let (mut right, mut wrong) = (Vec::new(), Vec::new());
    for (i, o) in order.iter().enumerate() {
        let bob = format!("sk-bob-{i}-4567");
        if o % 2 == 0 {
            right.push(first_token(&bob, &secret));
        } else {
            wrong.push(first_token(
                &bob,
                &prompt(&format!("{}", 500_000 + 7919 * o)),
            ));
        }
    }
    let slowest_right = right.iter().cloned().fold(0.0, f64::max);
    let fastest_wrong = wrong.iter().cloned().fold(f64::MAX, f64::min);
    eprintln!(
        "time to first token: alice's cached repeat {alice_repeat:.3} s ({alice_cached} tokens cached); bob right {right:.3?}, wrong {wrong:.3?}"
    );
    assert!(
        slowest_right > fastest_wrong,
        "bob's right guesses (slowest {slowest_right:.3} s) are all faster than his wrong ones (fastest {fastest_wrong:.3} s)"
    );
}

/// A conversation continued link by link with `previous_response_id` (each link's prompt is
/// the last one's, its answer and a new note) reuses, at every link, every full block of the
/// last link's prompt, also when steps carry 40 tokens so long prompts go in chunks: a chunk
/// short of the prompt's end stops on a block boundary, where the next one continues on the
/// cache (a chunk ending inside a block cut every later one off it, and a long chain
/// recomputed most of its prompt at every link).
#[test]
fn every_link_of_a_long_response_chain_reuses_the_last_links_prompt() {
    let _serial = serial();
    let Cluster {
        shards: _shards,
        tracker,
    } = cluster_with(&["0..15", "15..30"], &["--max-step-tokens", "40"]);
    let mut previous: Option<(String, u64)> = None;
    let mut cached_per_link = Vec::new();
    for i in 0..40 {
        let mut body = json!({
            "input": format!("Note {i}: the quick brown fox jumps over the lazy dog."),
            "max_output_tokens": 1,
            "temperature": 0,
            "store": true,
        });
        if let Some((id, _)) = &previous {
            body["previous_response_id"] = json!(id);
        }
        let r = post_json(&tracker.addr, "/v1/responses", &body);
        assert_eq!(r.status, 200, "link {i}: {}", r.body);
        let v = r.json();
        let n_in = v["usage"]["input_tokens"].as_u64().unwrap();
        let cached = v["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        cached_per_link.push(cached);
        if let Some((_, last_in)) = &previous {
            assert_eq!(
                cached,
                last_in / 16 * 16,
                "link {i} ({n_in} prompt tokens) reuses every full block of the last link's {last_in}; per link so far {cached_per_link:?}"
            );
        }
        previous = Some((v["id"].as_str().unwrap().to_string(), n_in));
    }
    let (_, last_in) = previous.unwrap();
    assert!(
        last_in > 400,
        "the chain's prompt grew past ten steps: {last_in}"
    );
}

/// A prompt seen before starts on the cached KV of every position but its last on every shard
/// of a 3-shard route (each shard takes the same positions from its cache: the full blocks, and
/// the leading positions of the block the first answer's tokens filled), and the
/// answers stay those of one process: asked again alone, by four sessions at once, and through
/// a second tracker that prefills in 16-token chunks (each chunk taken from the cache). A route
/// whose last shard keeps no prefix cache answers the first shard's reuse with cache_miss and
/// the tracker recomputes the session: the same answer again.
#[test]
fn a_repeated_prompt_starts_on_cached_prefix_blocks_on_every_shard_with_the_same_answer() {
    let _serial = serial();
    let prompt: Vec<u32> = eight_prompts()[4..].concat();
    assert!(prompt.len() > 32, "two full blocks and more");
    let want = one_process(&prompt, 16);
    let c = cluster(&["0..10", "10..20", "20..30"]);
    let reused = |tracker: &str, shards: &[Proc]| -> Vec<f64> {
        std::thread::sleep(Duration::from_millis(300));
        shards
            .iter()
            .map(|s| metric(tracker, "strata_shard_prefix_reused_tokens_total", &s.addr))
            .collect()
    };
    let t = c.tracker.addr.clone();
    assert_eq!(complete_ids(&t, &prompt, 16), want);
    assert_eq!(
        reused(&t, &c.shards),
        vec![0.0; 3],
        "nothing cached before the first request"
    );
    assert_eq!(complete_ids(&t, &prompt, 16), want);
    // 16 generated tokens filled the block where the prompt ends, so it is registered.
    let positions = (prompt.len() - 1) as f64;
    assert_eq!(reused(&t, &c.shards), vec![positions; 3]);
    for got in concurrently(&t, &vec![prompt.clone(); 4], 16) {
        assert_eq!(got, want);
    }
    assert_eq!(reused(&t, &c.shards), vec![5.0 * positions; 3]);

    let token = procs::token_file("test-cluster-token-0123456789");
    let refs: Vec<&Proc> = c.shards.iter().collect();
    let chunked = procs::tracker(
        exe(),
        &refs,
        &token,
        &[
            "--health-period-ms",
            "100",
            "--max-step-tokens",
            "16",
            "--prefill-chunk",
            "16",
        ],
    );
    assert_eq!(complete_ids(&chunked.addr, &prompt, 16), want);
    assert_eq!(reused(&chunked.addr, &c.shards), vec![6.0 * positions; 3]);
    drop(c);

    let m = model();
    let first = procs::shard(exe(), &m, "0..15", &token, &["--threads", "1"]);
    let last = procs::shard(
        exe(),
        &m,
        "15..30",
        &token,
        &["--threads", "1", "--no-prefix-cache"],
    );
    let tracker = procs::tracker(
        exe(),
        &[&first, &last],
        &token,
        &["--health-period-ms", "100"],
    );
    for _ in 0..2 {
        assert_eq!(complete_ids(&tracker.addr, &prompt, 16), want);
    }
    let shards = [first, last];
    assert_eq!(reused(&tracker.addr, &shards), vec![positions, 0.0]);
    assert_eq!(tracker_metric(&tracker.addr, "strata_replays_total"), 1.0);
}
