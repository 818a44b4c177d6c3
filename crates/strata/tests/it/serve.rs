//! `strata serve`: the one-command local cluster, in both of its modes.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::http::{get, post_json};
use testkit::procs;

/// Tests here start whole clusters on two cores: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

fn alive(pid: i32) -> bool {
    // A zombie still has a /proc entry; look at its state.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.split_whitespace().nth(2).is_none_or(|st| st != "Z"))
        .unwrap_or(false)
}

fn one_process_ids(model: &Path) -> Value {
    let out = Command::new(exe())
        .args([
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "16",
            "--json",
        ])
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    serde_json::from_slice::<Value>(&out.stdout).unwrap()["generated_ids"].clone()
}

fn ask(addr: &str) -> Value {
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "return_token_ids": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["choices"][0]["token_ids"].clone()
}

#[test]
fn serve_runs_shard_processes_and_stops_them_all_on_sigterm() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = testkit::real_model();
    let want = one_process_ids(&model);
    let mut serve = procs::spawn(
        exe(),
        &[
            "serve",
            "--model",
            model.to_str().unwrap(),
            "--shards",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--threads",
            "1",
        ]
        .map(String::from),
        "strata tracker listening on ",
        "serve",
    );
    assert_eq!(ask(&serve.addr), want);
    let health = get(&serve.addr, "/health").json();
    assert_eq!(health["shards"].as_array().unwrap().len(), 2);
    let kids = procs::children(serve.pid());
    assert_eq!(kids.len(), 2, "two shard processes");
    serve.signal(15);
    let t = Instant::now();
    while !serve.exited() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(serve.exited(), "serve did not stop on SIGTERM");
    std::thread::sleep(Duration::from_millis(200));
    for k in kids {
        assert!(!alive(k), "shard process {k} outlived serve");
    }
}

#[test]
fn serve_with_one_shard_runs_in_process_and_matches() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = testkit::real_model();
    let want = one_process_ids(&model);
    let serve = procs::spawn(
        exe(),
        &[
            "serve",
            "--model",
            model.to_str().unwrap(),
            "--shards",
            "1",
            "--listen",
            "127.0.0.1:0",
            "--threads",
            "1",
        ]
        .map(String::from),
        "strata tracker listening on ",
        "serve",
    );
    assert!(
        procs::children(serve.pid()).is_empty(),
        "embedded mode starts no processes"
    );
    assert_eq!(ask(&serve.addr), want);
}

/// A free port on 127.0.0.1 (bound, then released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn serve_pins_shard_ports_and_restarts_a_shard_that_dies() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = testkit::real_model();
    let want = one_process_ids(&model);
    let ports = [free_port(), free_port()];
    let serve = procs::spawn(
        exe(),
        &[
            "serve",
            "--model",
            model.to_str().unwrap(),
            "--shards",
            "2",
            "--shard-ports",
            &format!("{},{}", ports[0], ports[1]),
            "--listen",
            "127.0.0.1:0",
            "--threads",
            "1",
            "--health-period-ms",
            "100",
        ]
        .map(String::from),
        "strata tracker listening on ",
        "serve",
    );
    assert_eq!(ask(&serve.addr), want);
    let health = get(&serve.addr, "/health").json();
    let addrs: Vec<&str> = health["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["address"].as_str().unwrap())
        .collect();
    assert_eq!(
        addrs,
        [
            format!("127.0.0.1:{}", ports[0]),
            format!("127.0.0.1:{}", ports[1])
        ]
    );
    let kids = procs::children(serve.pid());
    assert_eq!(kids.len(), 2);
    // Kill the last shard: serve starts it again on its port and the route comes back.
    let _ = Command::new("kill")
        .args(["-9", &kids[1].to_string()])
        .status();
    let t = Instant::now();
    while get(&serve.addr, "/health").status == 200 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut back = false;
    while t.elapsed() < Duration::from_secs(30) {
        if get(&serve.addr, "/health").status == 200 && procs::children(serve.pid()).len() == 2 {
            back = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        back,
        "the shard was not restarted: {}",
        get(&serve.addr, "/health").body
    );
    assert_eq!(ask(&serve.addr), want);
    let restarts: f64 = get(&serve.addr, "/metrics")
        .body
        .lines()
        .filter(|l| l.starts_with("strata_serve_shard_restarts_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(restarts, 1.0);
    let new_kids = procs::children(serve.pid());
    assert!(!new_kids.contains(&kids[1]), "{new_kids:?}");
}

#[test]
fn bench_url_shows_progress_measures_every_prompt_size_and_reports_the_run_alone() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = testkit::real_model();
    let serve = procs::spawn(
        exe(),
        &[
            "serve",
            "--model",
            model.to_str().unwrap(),
            "--shards",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--threads",
            "1",
        ]
        .map(String::from),
        "strata tracker listening on ",
        "serve",
    );
    let run = || {
        let out = Command::new(exe())
            .args([
                "bench",
                "--url",
                &format!("http://{}", serve.addr),
                "--prompt-tokens",
                "16,48",
                "--gen-tokens",
                "4",
                "--concurrency",
                "1,2",
                "--requests",
                "1",
                "--json",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            serde_json::from_slice::<Value>(&out.stdout).unwrap(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (first, progress) = run();
    assert!(
        progress.contains("16-token prompts, 2 concurrent"),
        "{progress}"
    );
    assert!(
        progress.contains("48-token prompts, 1 concurrent"),
        "{progress}"
    );
    let runs = first["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 4);
    let sizes: Vec<u64> = runs
        .iter()
        .map(|r| r["prompt_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [16, 16, 48, 48]);
    // Each run reports its own requests (2 warm-ups and 6 measured) and their tokens, not the
    // tracker's lifetime totals.
    let (second, _) = run();
    for v in [&first, &second] {
        assert_eq!(v["run_counts"]["requests"], 8.0, "{}", v["run_counts"]);
        for s in v["shards"].as_array().unwrap() {
            // Each of the 8 requests decodes at most its 4 tokens on each shard.
            let decoded = s["run_decode_tokens"].as_f64().unwrap();
            assert!(decoded > 0.0 && decoded <= 32.0, "{s}");
        }
    }
}

/// `--default-temperature 0` makes greedy every generation request that gives no temperature,
/// on each API (whatever its seed), and a request's own temperature still wins.
#[test]
fn a_default_temperature_applies_to_requests_that_give_none() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = testkit::real_model();
    let serve = procs::serve(exe(), &model, "1", &["--default-temperature", "0"]);
    let addr = &serve.addr;
    let prompt = "Write a short poem about the sea.";
    let completion = |extra: Value| {
        let mut body = json!({"prompt": prompt, "max_tokens": 24});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = post_json(addr, "/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let greedy = completion(json!({"temperature": 0}));
    assert_eq!(completion(json!({"seed": 1})), greedy);
    assert_eq!(completion(json!({"seed": 2, "temperature": null})), greedy);
    // The request's own temperature wins: sampled at 2 with several seeds, some answer differs.
    let sampled: Vec<String> = (0..4)
        .map(|seed| completion(json!({"seed": seed, "temperature": 2})))
        .collect();
    assert!(sampled.iter().any(|s| *s != greedy), "{sampled:?}");

    let response = |extra: Value| {
        let mut body = json!({"input": prompt, "max_output_tokens": 24});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = post_json(addr, "/v1/responses", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let (plain, explicit) = (response(json!({})), response(json!({"temperature": 0})));
    assert_eq!(plain["temperature"], json!(0.0), "{plain}");
    let text = |r: &Value| r["output"][0]["content"][0]["text"].clone();
    assert_eq!(text(&plain), text(&explicit), "{plain}");

    let message = |extra: Value| {
        let mut body = json!({"max_tokens": 24, "messages": [{"role": "user", "content": prompt}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = post_json(addr, "/v1/messages", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["content"].clone()
    };
    assert_eq!(message(json!({})), message(json!({"temperature": 0})));
}
