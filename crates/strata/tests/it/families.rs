//! The real Qwen2.5-Coder and Gemma 3 files through real routes on 127.0.0.1: a 2-shard and a
//! 3-shard route give exactly `strata generate`'s tokens, concurrent sessions give what they
//! give alone, and Gemma 3's `long_window` prompt (longer than its sliding window) comes out of
//! a 2-shard route as out of one process.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};
use testkit::http::post_json;
use testkit::procs::{self, Proc};

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Greedy ids of `strata generate` in one process.
fn one_process(model: &Path, prompt: &[u64], n: usize) -> Vec<u64> {
    let list: Vec<String> = prompt.iter().map(u64::to_string).collect();
    let out = Command::new(exe())
        .args([
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt-ids",
            &list.join(","),
            "--max-tokens",
            &n.to_string(),
            "--json",
            "--threads",
            "2",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ids(&serde_json::from_slice::<Value>(&out.stdout).unwrap()["generated_ids"])
}

fn through(addr: &str, prompt: &[u64], n: usize) -> Vec<u64> {
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": true, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    ids(&r.json()["choices"][0]["token_ids"])
}

fn route(model: &Path, ranges: &[&str]) -> (Vec<Proc>, Proc) {
    let token = procs::token_file("families-token-0123456789abc");
    let shards: Vec<Proc> = ranges
        .iter()
        .map(|r| procs::shard(exe(), model, r, &token, &["--threads", "1"]))
        .collect();
    let refs: Vec<&Proc> = shards.iter().collect();
    let tracker = procs::tracker(exe(), &refs, &token, &[]);
    (shards, tracker)
}

/// The reference prompts of a model's reference file (their ids), shortest first.
fn prompts(reference: &str) -> Vec<(String, Vec<u64>)> {
    let r: Value = serde_json::from_str(&testkit::reference_text(reference)).unwrap();
    let mut v: Vec<(String, Vec<u64>)> = r["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["name"].as_str().unwrap().to_string(),
                ids(&g["prompt_ids"]),
            )
        })
        .collect();
    v.sort_by_key(|(_, p)| p.len());
    v
}

fn routes_equal_one_process(name: &str, reference: &str, two: &[&str], three: &[&str]) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model: PathBuf = testkit::named_model(name);
    let n = 12;
    let all = prompts(reference);
    let short: Vec<&(String, Vec<u64>)> = all.iter().filter(|(_, p)| p.len() < 100).collect();
    let want: Vec<Vec<u64>> = short
        .iter()
        .map(|(_, p)| one_process(&model, p, n))
        .collect();
    for ranges in [two, three] {
        let (_shards, t) = route(&model, ranges);
        for ((entry, p), w) in short.iter().zip(&want) {
            assert_eq!(&through(&t.addr, p, n), w, "{name} {entry} on {ranges:?}");
        }
        // All at once: each session gives what it gave alone.
        let got: Vec<Vec<u64>> = std::thread::scope(|s| {
            let hs: Vec<_> = short
                .iter()
                .map(|(_, p)| s.spawn(|| through(&t.addr, p, n)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got, want, "{name} concurrent on {ranges:?}");
    }
}

#[test]
fn qwen2_routes_give_one_process_tokens() {
    routes_equal_one_process(
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.json",
        &["0..12", "12..24"],
        &["0..8", "8..16", "16..24"],
    );
}

#[test]
fn gemma3_routes_give_one_process_tokens_also_past_the_window() {
    routes_equal_one_process(
        "gemma3-270m",
        "gemma-3-270m-q4_k_m.json",
        &["0..9", "9..18"],
        &["0..5", "5..11", "11..18"],
    );
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = testkit::named_model("gemma3-270m");
    let (_, long) = prompts("gemma-3-270m-q4_k_m.json")
        .into_iter()
        .find(|(n, _)| n == "long_window")
        .unwrap();
    assert!(long.len() > 512);
    let want = one_process(&model, &long, 8);
    let (_shards, t) = route(&model, &["0..9", "9..18"]);
    assert_eq!(through(&t.addr, &long, 8), want);
}
