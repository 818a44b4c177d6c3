//! `strata serve`: the one-command local cluster, in both of its modes.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::http::{get, post_json};
use testkit::procs;

fn exe() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_strata"))
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
