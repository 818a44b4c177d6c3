//! The command line surfaces, run as a user runs them: the real binary, real files.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;
use testkit::TinySpec;

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("run strata")
}

fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "strata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json output")
}

fn tiny() -> String {
    testkit::write_tiny_model(&TinySpec::default(), "cli")
        .display()
        .to_string()
}

fn real() -> String {
    testkit::real_model().display().to_string()
}

#[test]
fn generate_json_reports_ids_text_top5_and_timings() {
    let m = tiny();
    let out = json_of(&strata(&[
        "generate",
        "--model",
        &m,
        "--prompt",
        "the world",
        "--max-tokens",
        "6",
        "--json",
    ]));
    assert_eq!(out["generated_ids"].as_array().unwrap().len(), 6);
    assert_eq!(out["top5"].as_array().unwrap().len(), 6);
    assert_eq!(out["top5"][0].as_array().unwrap().len(), 5);
    assert!(out["timings"]["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(out["prompt_ids"].as_array().unwrap().len() >= 2);
    // Greedy: the first generated id is the top-1 of step 0.
    assert_eq!(out["generated_ids"][0], out["top5"][0][0]["id"]);
}

#[test]
fn same_seed_gives_same_tokens_and_another_seed_differs() {
    let m = tiny();
    let run = |seed: &str| {
        json_of(&strata(&[
            "generate",
            "--model",
            &m,
            "--prompt-ids",
            "40,50,60",
            "--max-tokens",
            "12",
            "--temperature",
            "50",
            "--seed",
            seed,
            "--json",
        ]))["generated_ids"]
            .clone()
    };
    assert_eq!(run("5"), run("5"));
    assert_ne!(run("5"), run("6"));
}

#[test]
fn tokenize_matches_the_reference_with_and_without_special_parsing() {
    let m = real();
    let plain = json_of(&strata(&[
        "tokenize",
        "--model",
        &m,
        "Hello world <|im_end|>",
    ]));
    let special = json_of(&strata(&[
        "tokenize",
        "--model",
        &m,
        "--special",
        "Hello world <|im_end|>",
    ]));
    let reference: Value =
        serde_json::from_str(&testkit::reference_text("tokenizer_public.json")).unwrap();
    let e = reference["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["special_tokens_differ"].as_bool().unwrap())
        .unwrap()
        .clone();
    let plain_ref = json_of(&strata(&[
        "tokenize",
        "--model",
        &m,
        e["text"].as_str().unwrap(),
    ]));
    let special_ref = json_of(&strata(&[
        "tokenize",
        "--model",
        &m,
        "--special",
        e["text"].as_str().unwrap(),
    ]));
    assert_eq!(plain_ref, e["ids"]);
    assert_eq!(special_ref, e["ids_parse_special"]);
    assert_ne!(plain, special);
    assert_eq!(special.as_array().unwrap().last().unwrap(), 2);
}

#[test]
fn chat_generation_on_the_real_model_answers_and_stops_at_end_of_turn() {
    let m = real();
    let out = json_of(&strata(&[
        "generate",
        "--model",
        &m,
        "--chat",
        "--prompt",
        "What is 2+2?",
        "--max-tokens",
        "40",
        "--json",
    ]));
    assert_eq!(out["stop_reason"], "eos");
    assert!(
        out["text"].as_str().unwrap().contains('4'),
        "{}",
        out["text"]
    );
    assert_eq!(out["generated_ids"].as_array().unwrap().last().unwrap(), 2);
}

#[test]
fn logits_prints_top_k_for_every_position() {
    let m = real();
    let out = json_of(&strata(&[
        "logits",
        "--model",
        &m,
        "--ids",
        "504,3575,282,4649,314",
        "--top-k",
        "3",
    ]));
    let positions = out["top_k"].as_array().unwrap();
    assert_eq!(positions.len(), 5);
    assert_eq!(
        positions[4][0]["id"], 7042,
        "' Paris' follows 'The capital of France is'"
    );
}

#[test]
fn resident_weight_memory_follows_the_layer_range() {
    let m = real();
    for layers in ["0..15", "15..30", "0..30"] {
        let out = json_of(&strata(&[
            "model", "info", "--model", &m, "--layers", layers, "--json",
        ]));
        let own = out["range_tensor_bytes"].as_f64().unwrap();
        let held = out["weight_bytes"].as_f64().unwrap();
        let in_file = out["in_file_weight_bytes"].as_f64().unwrap();
        let rss_growth = out["anon_rss_after_load_bytes"].as_f64().unwrap()
            - out["anon_rss_before_load_bytes"].as_f64().unwrap();
        // Weights are held in the kernels' panel layout (the file's bytes, plus zero rows
        // completing a matrix's last panel), but for the embedding of a first shard whose head
        // is not tied to it (SmolLM2's is): read from the file a row at a time. Resident memory
        // follows what is held.
        let packing = (held + in_file) / own;
        assert!(
            (1.0..=1.25).contains(&packing),
            "{layers}: held {held} bytes and {in_file} in the file for {own} bytes of tensors"
        );
        assert_eq!(
            in_file > 0.0,
            layers == "0..15",
            "{layers}: {in_file} bytes in the file"
        );
        let ratio = rss_growth / held;
        eprintln!(
            "{layers}: tensors {:.1} MiB, held {:.1} MiB, rss growth {:.1} MiB ({ratio:.3})",
            own / 1048576.0,
            held / 1048576.0,
            rss_growth / 1048576.0
        );
        // Within 10%, or 6 MiB for the smallest range (the allocator reuses a few MiB the
        // header's parse freed, resident before the load).
        let slack = (0.1 * held).max(6.0 * 1048576.0);
        assert!(
            (rss_growth - held).abs() <= slack,
            "{layers}: rss grew {rss_growth} for {held} bytes held"
        );
    }
}

#[test]
fn a_corrupt_model_file_is_a_clear_error_not_a_panic() {
    let dir = std::env::temp_dir().join(format!("strata-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bytes = testkit::tiny_model_bytes(&TinySpec::default());
    let cases: [(&str, Vec<u8>, &str); 3] = [
        (
            "truncated",
            bytes[..bytes.len() / 2].to_vec(),
            "outside the data section",
        ),
        (
            "magic",
            [b"GGUX".as_slice(), &bytes[4..]].concat(),
            "not a GGUF file",
        ),
        ("empty", Vec::new(), "truncated file"),
    ];
    for (name, data, expect) in cases {
        let p = dir.join(format!("{name}.gguf"));
        std::fs::write(&p, data).unwrap();
        let out = strata(&[
            "generate",
            "--model",
            p.to_str().unwrap(),
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert!(err.contains(expect), "{name}: {err}");
        assert!(!err.contains("panicked"), "{name}: {err}");
    }
    let out = strata(&["generate", "--model", "/nonexistent.gguf", "--prompt", "hi"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent.gguf"));
    assert!(Path::new(&tiny()).exists());
}

/// `--log-format json` (or `STRATA_LOG_FORMAT=json`): every log line on stderr is one JSON
/// object with a timestamp, level, target and fields; without it, plain text.
#[test]
fn log_format_json_writes_one_object_per_line() {
    let token = testkit::procs::token_file("log-format-token-0123456789");
    let run = |format: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
        if let Some(f) = format {
            cmd.args(["--log-format", f]);
        }
        // A tracker whose shard is not there: it logs its attempts to reach it until killed.
        let mut child = cmd
            .args([
                "tracker",
                "--shards",
                "127.0.0.1:9",
                "--listen",
                "127.0.0.1:0",
            ])
            .arg("--cluster-token-file")
            .arg(&token)
            .env("STRATA_LOG", "debug")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1500));
        child.kill().unwrap();
        String::from_utf8(child.wait_with_output().unwrap().stderr).unwrap()
    };
    let json = run(Some("json"));
    let lines: Vec<&str> = json.lines().collect();
    assert!(!lines.is_empty(), "no log lines");
    for l in &lines {
        let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
        for k in ["timestamp", "level", "target", "fields"] {
            assert!(v.get(k).is_some(), "no {k} in {l}");
        }
    }
    let text = run(None);
    assert!(
        !text.is_empty() && serde_json::from_str::<Value>(text.lines().next().unwrap()).is_err()
    );
    let bad = strata(&["--log-format", "yaml", "tokenize", "--model", &tiny(), "hi"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--log-format"));
}

/// Settings from a `--config` file and `STRATA_*` variables: the file fills what the command
/// line leaves, a variable wins over the file, a flag over both; a key no flag has, or a value
/// its flag refuses, is an error naming it (exit 2), not something ignored.
#[test]
fn settings_come_from_flags_then_variables_then_the_config_file() {
    let m = tiny();
    let dir = std::env::temp_dir().join(format!("strata-cli-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("strata.toml");
    std::fs::write(
        &file,
        format!(
            "log-format = \"text\"\n[generate]\nmodel = {m:?}\nprompt = \"the world\"\n\
             max-tokens = 5\njson = true\n[tracker]\nregistry = \"http://127.0.0.1:1\"\n"
        ),
    )
    .unwrap();
    let f = file.display().to_string();
    let run = |args: &[&str], env: &[(&str, &str)]| {
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(args)
            .envs(env.iter().copied())
            .output()
            .expect("run strata")
    };
    let n_ids = |out: &Output| json_of(out)["generated_ids"].as_array().unwrap().len();
    assert_eq!(n_ids(&run(&["generate", "--config", &f], &[])), 5);
    assert_eq!(n_ids(&run(&["--config", &f, "generate"], &[])), 5);
    let env = [("STRATA_MAX_TOKENS", "3")];
    assert_eq!(n_ids(&run(&["generate", "--config", &f], &env)), 3);
    let flag = ["generate", "--config", &f, "--max-tokens", "2"];
    assert_eq!(n_ids(&run(&flag, &env)), 2);
    assert_eq!(
        n_ids(&run(&["generate"], &[("STRATA_CONFIG", &f)])),
        5,
        "STRATA_CONFIG names the file too"
    );
    // Without a file: every flag from its variable.
    let env = [
        ("STRATA_MODEL", m.as_str()),
        ("STRATA_PROMPT", "the world"),
        ("STRATA_MAX_TOKENS", "4"),
        ("STRATA_JSON", "true"),
    ];
    assert_eq!(n_ids(&run(&["generate"], &env)), 4);

    for (text, want) in [
        (
            "[generate]\nmax-tokenz = 5\n",
            "`max-tokenz` (at [generate]) is not a flag of `strata generate`",
        ),
        (
            "[generate]\nmax-tokens = \"five\"\n",
            "`max-tokens` (at [generate]): invalid value 'five'",
        ),
        (
            "[generate]\njson = \"yes\"\n",
            "`json` (at [generate]): a switch is `true` or `false`",
        ),
        ("[genrate]\n", "[genrate] is not a command of strata"),
        (
            "[tracker]\nlisten = \"127.0.0.1:7\"\nlistne = 8\n",
            "`listne` (at [tracker])",
        ),
        // Another command's plain values are checked too, before anything loads.
        (
            "[tracker]\nlisten = 7\n",
            "`listen` (at [tracker]): invalid value '7'",
        ),
        (
            "[shard]\nthreads = \"x\"\n",
            "`threads` (at [shard]): invalid value 'x'",
        ),
        ("[generate\n", "TOML parse error"),
    ] {
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, text).unwrap();
        let out = run(&["generate", "--config", &bad.display().to_string()], &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text:?}: {err}");
        assert!(err.contains(want), "{text:?}: {err}");
    }
    let out = run(&["generate", "--config", "/nonexistent/strata.toml"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/strata.toml"));
}

/// Speculation's flags out of range are refused at start, naming the flag and the range.
#[test]
fn speculation_flags_out_of_range_are_refused_naming_them() {
    let m = tiny();
    for (flag, value, want) in [
        ("--draft-max", "17", "`--draft-max` must be 1 to 16, got 17"),
        ("--draft-max", "0", "`--draft-max` must be 1 to 16, got 0"),
        (
            "--draft-max-batch",
            "0",
            "`--draft-max-batch` must be at least 1",
        ),
        (
            "--speculative",
            "maybe",
            "invalid value 'maybe' for '--speculative",
        ),
    ] {
        let mut args = vec!["serve", "--model", &m, flag, value];
        if flag != "--speculative" {
            args.extend(["--speculative", "ngram"]);
        }
        let out = strata(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value}");
        assert!(err.contains(want), "{flag} {value}: {err}");
    }
    // A draft model's settings need one, and a draft model needs speculation on.
    for (args, want) in [
        (
            &["--draft-model", &m, "--speculative", "off"][..],
            "`--draft-model` drafts for speculation, which `--speculative off` turns off",
        ),
        (&["--draft-wait-ms", "5"][..], "--draft-model"),
        (
            &["--draft-model", &m, "--draft-threads", "0"][..],
            "`--draft-threads` and `--draft-kv-mib` must be at least 1",
        ),
        (
            &["--draft-model", &m, "--draft-ahead", "17"][..],
            "`--draft-ahead` must be 0 to 16, got 17",
        ),
    ] {
        let mut all = vec!["serve", "--model", &m];
        all.extend(args);
        let out = strata(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // The same for a tracker's drafter process, which is one draft model or the other.
    let token = testkit::procs::token_file("test-cli-drafter-token-0123456789");
    let token = token.to_str().unwrap();
    for (args, want) in [
        (
            &["--drafter", "127.0.0.1:9", "--speculative", "off"][..],
            "`--drafter` drafts for speculation, which `--speculative off` turns off",
        ),
        (
            &["--drafter", "127.0.0.1:9", "--draft-model", &m][..],
            "cannot be used with",
        ),
        (
            &["--drafter", "127.0.0.1:9", "--draft-threads", "1"][..],
            "'--drafter <DRAFTER>' cannot be used with '--draft-threads",
        ),
    ] {
        let mut all = vec![
            "tracker",
            "--shards",
            "127.0.0.1:9",
            "--cluster-token-file",
            token,
        ];
        all.extend(args);
        let out = strata(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn a_default_temperature_out_of_range_is_refused_naming_it() {
    let m = tiny();
    for value in ["2.5", "-0.1", "NaN"] {
        let flag = format!("--default-temperature={value}");
        let out = strata(&["serve", "--model", &m, &flag]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{value}");
        assert!(
            err.contains("`--default-temperature` must be between 0 and 2"),
            "{value}: {err}"
        );
    }
}

/// `--rebalance-period-s` moves a shard that placed itself: with a range given by hand, which
/// never moves, it is refused naming it rather than ignored.
#[test]
fn a_rebalance_period_with_a_given_range_is_refused_naming_it() {
    let m = tiny();
    let token = testkit::procs::token_file("cli-rebalance-token-0123456789");
    let token = token.display().to_string();
    let out = strata(&[
        "shard",
        "--model",
        &m,
        "--layers",
        "0..2",
        "--rebalance-period-s",
        "5",
        "--cluster-token-file",
        &token,
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--rebalance-period-s") && err.contains("--layers auto"),
        "{err}"
    );
}

/// `--layers auto` places a shard from the registry's live shards: without `--registry` it is
/// refused at start, naming what is missing; a budget too small for any layer is refused
/// naming the budget (test `hosts::shards_placing_themselves_form_routes_survive_a_loss_and_rebalance`
/// places shards for real).
#[test]
fn layers_auto_without_a_registry_is_refused_naming_it() {
    let m = tiny();
    let token = testkit::procs::token_file("cli-layers-auto-token-0123456789");
    let token = token.display().to_string();
    let out = strata(&[
        "shard",
        "--model",
        &m,
        "--layers",
        "auto",
        "--cluster-token-file",
        &token,
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--layers auto") && err.contains("--registry"),
        "{err}"
    );
    let out = strata(&[
        "shard",
        "--model",
        &m,
        "--layers",
        "3-5",
        "--cluster-token-file",
        &token,
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("not of the form A..B"), "{err}");
    let etcd = testkit::etcd::Etcd::start();
    let out = strata(&[
        "shard",
        "--model",
        &m,
        "--layers",
        "auto",
        "--cluster-token-file",
        &token,
        "--registry",
        &etcd.endpoint(),
        "--weights-budget-mib",
        "0",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("a weights budget of 0 MiB holds no layer"),
        "{err}"
    );
}
