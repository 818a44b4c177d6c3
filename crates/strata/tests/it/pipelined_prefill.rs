//! Pipelined prefill (the default, issue 30) through real shard processes: on a route of two
//! shards a long prompt's chunks go down the route one after another without waiting for the
//! earlier ones' replies, and every answer (token ids and log-probabilities, greedy and
//! seeded, one prompt at a time and several at once) is bitwise what the same shards give
//! through a tracker that sends one chunk at a time (`--no-pipeline-prefill`). The prefix cache is off, so every prompt
//! is computed whole both ways.

use std::path::Path;

use serde_json::{json, Value};
use testkit::http::post_json;
use testkit::observe::tracker_metric as metric;
use testkit::procs::{self, Proc};

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

const TOKEN: &str = "test-pipelined-prefill-token-0123456789";

/// Prompts of about 100 to 400 tokens, answered greedily and by seeded sampling.
fn cases() -> Vec<Value> {
    let text = "The river runs past the mill, under the old stone bridge, and on to the sea. \
                Every spring the water rises and the miller counts the sacks of grain. ";
    let mut out = Vec::new();
    for (i, (repeats, temperature)) in [(5, 0.0), (9, 0.9), (14, 0.0), (20, 0.9)]
        .into_iter()
        .enumerate()
    {
        let prompt = format!(
            "{} Question {i}: what does the miller count?",
            text.repeat(repeats)
        );
        out.push(
            json!({"prompt": prompt, "max_tokens": 8, "temperature": temperature,
                        "seed": 5 + i, "logprobs": 2, "return_token_ids": true,
                        "ignore_eos": true}),
        );
    }
    out
}

fn answer(addr: &str, case: &Value) -> Value {
    let r = post_json(addr, "/v1/completions", case);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    json!({"ids": v["choices"][0]["token_ids"], "logprobs": v["choices"][0]["logprobs"]})
}

fn all_at_once(addr: &str, cases: &[Value]) -> Vec<Value> {
    let handles: Vec<_> = cases
        .iter()
        .map(|c| {
            let (addr, c) = (addr.to_string(), c.clone());
            std::thread::spawn(move || answer(&addr, &c))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn a_pipelined_prompt_gives_bitwise_the_answers_of_one_chunk_at_a_time() {
    let token = procs::token_file(TOKEN);
    let m = testkit::real_model();
    let shards: Vec<Proc> = ["0..15", "15..30"]
        .iter()
        .map(|r| {
            procs::shard(
                exe(),
                &m,
                r,
                &token,
                &["--threads", "1", "--no-prefix-cache"],
            )
        })
        .collect();
    let refs: Vec<&Proc> = shards.iter().collect();
    // Chunks of 32 positions: a 400-token prompt is 13 of them.
    let small = ["--prefill-chunk", "32", "--max-step-tokens", "64"];
    let plain = procs::tracker(
        exe(),
        &refs,
        &token,
        &[&small[..], &["--no-pipeline-prefill"]].concat(),
    );
    // Pipelined is the default.
    let piped = procs::tracker(exe(), &refs, &token, &small);
    let cases = cases();
    let want: Vec<Value> = cases.iter().map(|c| answer(&plain.addr, c)).collect();
    for (i, case) in cases.iter().enumerate() {
        assert_eq!(
            want[i]["ids"].as_array().map(Vec::len),
            Some(8),
            "{}",
            want[i]
        );
        assert_eq!(answer(&piped.addr, case), want[i], "case {i}, alone");
    }
    let chunks = metric(&piped.addr, "strata_pipelined_chunks_total");
    assert!(
        chunks > 0.0,
        "no chunk went down the route while another was on it"
    );
    assert_eq!(metric(&plain.addr, "strata_pipelined_chunks_total"), 0.0);
    for (i, got) in all_at_once(&piped.addr, &cases).into_iter().enumerate() {
        assert_eq!(got, want[i], "case {i}, all at once");
    }
}
