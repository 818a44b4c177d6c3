//! Speculative decoding through real routes: a tracker started with `--speculative ngram`
//! drafts tokens from each session's own tokens and the last shard verifies them in the decode
//! step itself. What a client receives must be token for token, and log-probability for
//! log-probability, what plain decoding gives: through routes of one, two and three shard
//! processes, at 1, 4 and 16 concurrent sessions, greedy and seeded sampling with penalties, a
//! JSON schema and a tool call (whose sessions never draft, beside ones that do), and across a
//! SIGKILL of a shard of a replicated route. The plain answers are the same tracker's with
//! `"speculative": false`, the per-request opt-out. The whole workload set (50 requests) is
//! `long_the_whole_workload_set_gives_plain_decodings_answers` and, with a draft model,
//! `long_the_whole_workload_set_with_a_draft_model_gives_plain_decodings_answers`
//! (`STRATA_LONG=1`).

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use testkit::http::{post_json, stream_token_ids};
use testkit::observe::{shard_stat, tracker_metric as metric, wait_until};
use testkit::procs::{self, Proc};

pub(super) fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

pub(super) const TOKEN: &str = "test-speculation-token-0123456789";

/// The workload set (`bench/spec-workload.json`): code edits, JSON extractions, chats.
fn workload() -> Vec<(String, Value)> {
    let path = testkit::repo_root().join("bench/spec-workload.json");
    let w: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    w["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["kind"].as_str().unwrap().to_string(),
                r["messages"].clone(),
            )
        })
        .collect()
}

/// The requests of a run: `per_kind` requests of each kind of the workload (all of them with
/// `usize::MAX`), each greedy and seeded at temperature 0.8 with penalties, `max_tokens` long,
/// then one JSON-schema answer and one tool call; all with token ids and log-probabilities.
pub(super) fn cases(per_kind: usize, max_tokens: usize) -> Vec<Value> {
    let mut taken: Vec<(String, Value)> = Vec::new();
    for (kind, messages) in workload() {
        if taken.iter().filter(|(k, _)| *k == kind).count() < per_kind {
            taken.push((kind, messages));
        }
    }
    let mut out = Vec::new();
    for (i, (_, messages)) in taken.into_iter().enumerate() {
        out.push(json!({"messages": messages, "max_tokens": max_tokens, "temperature": 0}));
        out.push(
            json!({"messages": messages, "max_tokens": max_tokens, "temperature": 0.8,
                        "seed": 100 + i, "presence_penalty": 0.4, "frequency_penalty": 0.2,
                        "repetition_penalty": 1.1}),
        );
    }
    out.push(json!({
        "messages": [{"role": "user", "content": "Describe a cat as JSON."}],
        "max_tokens": 48, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "cat", "schema": {
            "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"], "additionalProperties": false}}}}));
    out.push(json!({
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "max_tokens": 40, "temperature": 0, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "get_weather", "strict": true,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"], "additionalProperties": false}}}]}));
    for c in &mut out {
        c["return_token_ids"] = json!(true);
        c["logprobs"] = json!(true);
        c["top_logprobs"] = json!(2);
    }
    out
}

/// One answer: its token ids, log-probabilities and text, as the client received them.
fn answer(addr: &str, case: &Value, speculative: bool) -> Value {
    let mut body = case.clone();
    body["speculative"] = json!(speculative);
    let r = post_json(addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let mut v = r.json();
    let c = &mut v["choices"][0];
    // A tool call's id names the response (a counter), not anything generated.
    if let Some(calls) = c["message"]["tool_calls"].as_array_mut() {
        for call in calls {
            call["id"] = Value::Null;
        }
    }
    json!({"ids": c["token_ids"], "logprobs": c["logprobs"], "message": c["message"],
           "finish_reason": c["finish_reason"]})
}

/// Every case answered with `in_flight` requests at once.
pub(super) fn answers(
    addr: &str,
    cases: &[Value],
    in_flight: usize,
    speculative: bool,
) -> Vec<Value> {
    let mut out = Vec::with_capacity(cases.len());
    for batch in cases.chunks(in_flight) {
        let handles: Vec<_> = batch
            .iter()
            .map(|c| {
                let (addr, c) = (addr.to_string(), c.clone());
                std::thread::spawn(move || answer(&addr, &c, speculative))
            })
            .collect();
        out.extend(handles.into_iter().map(|h| h.join().unwrap()));
    }
    out
}

pub(super) fn assert_same(plain: &[Value], got: &[Value], what: &str) {
    assert_eq!(plain.len(), got.len());
    for (i, (p, g)) in plain.iter().zip(got).enumerate() {
        assert_eq!(p, g, "{what}: case {i} differs from plain decoding");
    }
}

/// The shards of one route over SmolLM2's 30 layers, cut into `ranges`.
pub(super) fn route(ranges: &[&str], token: &Path) -> Vec<Proc> {
    let m = testkit::real_model();
    ranges
        .iter()
        .map(|r| procs::shard(exe(), &m, r, token, &["--threads", "1"]))
        .collect()
}

fn spec_tracker(shards: &[Proc], token: &Path, draft_max: &str) -> Proc {
    let refs: Vec<&Proc> = shards.iter().collect();
    procs::tracker(
        exe(),
        &refs,
        token,
        &[
            "--speculative",
            "ngram",
            "--draft-max",
            draft_max,
            // Every decode step drafts, however many sessions it holds.
            "--draft-max-batch",
            "16",
        ],
    )
}

/// A tracker over `shards` drafting from the draft model `draft` in its own process (one
/// thread, up to `draft_max` tokens), for steps of up to 16 sessions.
fn draft_model_tracker(shards: &[Proc], token: &Path, draft: &Path, draft_max: &str) -> Proc {
    let refs: Vec<&Proc> = shards.iter().collect();
    procs::tracker(
        exe(),
        &refs,
        token,
        &[
            "--draft-model",
            draft.to_str().unwrap(),
            "--draft-threads",
            "1",
            "--draft-max",
            draft_max,
            "--draft-max-batch",
            "16",
        ],
    )
}

/// Drafted and kept tokens so far; at least one kept and one rejected.
pub(super) fn assert_verified(addr: &str, what: &str) {
    let drafted = metric(addr, "strata_spec_drafted_tokens_total");
    let accepted = metric(addr, "strata_spec_accepted_tokens_total");
    eprintln!("{what}: drafted {drafted}, kept {accepted}");
    assert!(
        accepted > 0.0 && accepted < drafted,
        "{what}: drafts were verified, some kept and some not ({accepted} of {drafted})"
    );
}

/// A route of two shards: every answer at 1, 4 and 16 concurrent sessions equals plain
/// decoding's, and drafted tokens were verified, some kept and some rejected.
#[test]
fn speculation_through_two_shards_gives_plain_decodings_answers_at_1_4_and_16_sessions() {
    let token = procs::token_file(TOKEN);
    let cases = cases(1, 40);
    let shards = route(&["0..15", "15..30"], &token);
    let tracker = spec_tracker(&shards, &token, "8");
    let addr = &tracker.addr;
    // Plain answers do not depend on what shares their batch (batch invariance, tested on
    // its own): taken 4 at a time.
    let plain = answers(addr, &cases, 4, false);
    assert_eq!(metric(addr, "strata_spec_drafted_tokens_total"), 0.0);
    assert_same(&plain, &answers(addr, &cases, 1, true), "one at a time");
    assert_same(&plain, &answers(addr, &cases, 4, true), "4 at once");
    // Every case twice: 16 sessions at once.
    let twice: Vec<Value> = cases.iter().chain(&cases).cloned().collect();
    let plain_twice: Vec<Value> = plain.iter().chain(&plain).cloned().collect();
    assert_same(&plain_twice, &answers(addr, &twice, 16, true), "16 at once");
    assert_verified(addr, "two shards");
    // Decode positions include the verified drafts; the acceptance histogram counts steps.
    assert!(metric(addr, "strata_spec_accepted_length_count") > 0.0);
    // Speculation is the default: a tracker given no flag drafts for a lone session, with the
    // same answer.
    let refs: Vec<&Proc> = shards.iter().collect();
    let default = procs::tracker(exe(), &refs, &token, &[]);
    let one = answer(&default.addr, &cases[0], true);
    assert_eq!(one, plain[0]);
    assert!(metric(&default.addr, "strata_spec_drafted_tokens_total") > 0.0);
}

/// Routes of one shard (drafting up to 3 tokens) and of three (up to 16, the most a fragment
/// may carry): every answer, one at a time and 4 at once, equals plain decoding's.
#[test]
fn speculation_through_one_and_three_shards_gives_plain_decodings_answers() {
    let token = procs::token_file(TOKEN);
    let cases = cases(1, 32);
    for (ranges, draft_max) in [
        (&["0..30"][..], "3"),
        (&["0..10", "10..20", "20..30"][..], "16"),
    ] {
        let shards = route(ranges, &token);
        let tracker = spec_tracker(&shards, &token, draft_max);
        let addr = &tracker.addr;
        let plain = answers(addr, &cases, 4, false);
        assert_same(&plain, &answers(addr, &cases, 1, true), "one at a time");
        assert_same(&plain, &answers(addr, &cases, 4, true), "4 at once");
        assert_verified(addr, &format!("{ranges:?}, draft-max {draft_max}"));
    }
}

/// The whole workload set (50 requests, each greedy and seeded with penalties) through a route
/// of two shards, 16 at a time: every answer equals plain decoding's.
#[test]
fn long_the_whole_workload_set_gives_plain_decodings_answers() {
    let token = procs::token_file(TOKEN);
    let cases = cases(usize::MAX, 32);
    assert_eq!(cases.len(), 2 * 50 + 2);
    let shards = route(&["0..15", "15..30"], &token);
    let tracker = spec_tracker(&shards, &token, "8");
    let addr = &tracker.addr;
    let plain = answers(addr, &cases, 16, false);
    let got = answers(addr, &cases, 16, true);
    assert_same(&plain, &got, "the workload set, 16 at once");
    assert_verified(addr, "the workload set");
}

/// The same with drafts from a draft model (SmolLM2 itself, drafting up to 8 tokens, as many
/// as each session's acceptance allows), one at a time and 16 at once.
#[test]
fn long_the_whole_workload_set_with_a_draft_model_gives_plain_decodings_answers() {
    let token = procs::token_file(TOKEN);
    let cases = cases(usize::MAX, 32);
    let m = testkit::real_model();
    let shards = route(&["0..15", "15..30"], &token);
    let tracker = draft_model_tracker(&shards, &token, &m, "8");
    let addr = &tracker.addr;
    let plain = answers(addr, &cases, 16, false);
    assert_same(&plain, &answers(addr, &cases, 1, true), "one at a time");
    assert_same(&plain, &answers(addr, &cases, 16, true), "16 at once");
    assert_verified(addr, "the workload set with a draft model");
}

/// The body of streamed request `i` of the failover run: code edits, greedy and seeded.
pub(super) fn streamed(i: usize) -> Value {
    let w = workload();
    let mut b = json!({"messages": w[i % 8].1, "max_tokens": 64, "stream": true,
                       "return_token_ids": true, "temperature": 0});
    if i % 2 == 1 {
        b["temperature"] = json!(0.8);
        b["seed"] = json!(7 + i);
    }
    b
}

pub(super) fn stream_ids(addr: &str, body: &Value) -> Result<Vec<u64>, String> {
    stream_token_ids(addr, "/v1/chat/completions", body)
}

/// Two routes of two shards, speculating; 8 streamed sessions; a shard of the first route is
/// killed while both routes hold sessions and drafts have been kept: every stream goes on on
/// the other route with no error and exactly the plain tokens.
#[test]
fn a_speculating_session_moved_by_a_shard_kill_keeps_plain_decodings_tokens() {
    moved_by_a_shard_kill(&["--speculative", "ngram"]);
}

/// The same with drafts from a draft model (SmolLM2 itself), which forgets the moved sessions
/// and reads them again for their new route.
#[test]
fn a_session_drafting_from_a_draft_model_moved_by_a_shard_kill_keeps_plain_decodings_tokens() {
    let m = testkit::real_model();
    moved_by_a_shard_kill(&["--draft-model", m.to_str().unwrap(), "--draft-threads", "1"]);
}

/// 8 streams over two replicated routes, drafting; a SIGKILL of a shard of one route moves its
/// sessions to the other, and every stream gets plain decoding's tokens.
fn moved_by_a_shard_kill(drafter: &[&str]) {
    let token = procs::token_file(TOKEN);
    let m = testkit::real_model();
    let mut shards: Vec<Proc> = ["0..15", "15..30", "0..12", "12..30"]
        .iter()
        .map(|r| procs::shard(exe(), &m, r, &token, &["--threads", "1"]))
        .collect();
    let tracker = procs::tracker_routes(
        exe(),
        &[
            ("a", &[&shards[0], &shards[1]]),
            ("b", &[&shards[2], &shards[3]]),
        ],
        &token,
        &[
            &[
                "--health-period-ms",
                "100",
                "--liveness-ms",
                "1000",
                "--draft-max-batch",
                "8",
                // The plain runs before left their prompts cached on one route, where a route
                // chosen by cache would send all 8 streams.
                "--route-by",
                "load",
            ],
            drafter,
        ]
        .concat(),
    );
    let addr = tracker.addr.clone();
    let want: Vec<Vec<u64>> = (0..8)
        .map(|i| {
            let mut b = streamed(i);
            b["speculative"] = json!(false);
            stream_ids(&addr, &b).unwrap()
        })
        .collect();
    let before = metric(&addr, "strata_migrations_total");
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || stream_ids(&addr, &streamed(i)))
        })
        .collect();
    // The first route's last shard (the one killed) and the second route's first hold
    // sessions, and drafts were kept.
    let ready = wait_until(Duration::from_secs(60), || {
        shard_stat(&addr, &shards[1].addr, "sessions").unwrap_or(0) > 0
            && shard_stat(&addr, &shards[2].addr, "sessions").unwrap_or(0) > 0
            && metric(&addr, "strata_spec_accepted_tokens_total") > 0.0
    });
    assert!(ready, "the streams never held sessions on both routes");
    shards[1].signal(libc::SIGKILL);
    for (i, h) in handles.into_iter().enumerate() {
        let got = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("stream {i} saw an error: {e}"));
        assert_eq!(got, want[i], "stream {i} differs from plain decoding");
    }
    assert!(
        metric(&addr, "strata_migrations_total") > before,
        "no session moved"
    );
    let _ = shards.remove(1);
}

/// Drafts from a draft model (`--draft-model`, here SmolLM2 itself: the same vocabulary, and
/// drafts that greedy decoding keeps while sampled ones are often rejected) through routes of
/// one, two and three shards: every answer equals plain decoding's, one at a time (and on two
/// shards 4 and 16 at once), and drafted tokens were verified under the `model` drafter. `serve` refuses at start a draft model whose
/// vocabulary differs from its model's, naming the difference.
#[test]
fn a_draft_model_gives_plain_decodings_answers_and_another_vocabulary_is_refused() {
    let token = procs::token_file(TOKEN);
    let cases = cases(1, 32);
    let m = testkit::real_model();
    for ranges in [
        &["0..15", "15..30"][..],
        &["0..30"],
        &["0..10", "10..20", "20..30"],
    ] {
        let shards = route(ranges, &token);
        let tracker = draft_model_tracker(&shards, &token, &m, "6");
        let addr = &tracker.addr;
        let plain = answers(addr, &cases, 4, false);
        assert_eq!(metric(addr, "strata_spec_drafted_tokens_total"), 0.0);
        assert_same(&plain, &answers(addr, &cases, 1, true), "one at a time");
        if ranges.len() == 2 {
            assert_same(&plain, &answers(addr, &cases, 4, true), "4 at once");
            let twice: Vec<Value> = cases.iter().chain(&cases).cloned().collect();
            let plain_twice: Vec<Value> = plain.iter().chain(&plain).cloned().collect();
            assert_same(&plain_twice, &answers(addr, &twice, 16, true), "16 at once");
            let by_model = testkit::http::get(addr, "/metrics");
            assert!(
                by_model
                    .body
                    .contains("strata_spec_drafted_tokens_total{drafter=\"model\""),
                "drafts counted under the model drafter"
            );
        }
        assert_verified(addr, &format!("a draft model, {ranges:?}"));
    }

    let gemma = testkit::named_model("gemma3-270m");
    let out = std::process::Command::new(exe())
        .args([
            "serve",
            "--shards",
            "1",
            "--listen",
            "127.0.0.1:0",
            "--model",
        ])
        .arg(&m)
        .arg("--draft-model")
        .arg(&gemma)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("cannot draft for") && stderr.contains("tokenizer models differ"),
        "{stderr}"
    );
}
