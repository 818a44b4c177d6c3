//! `strata bench`: prefill (ppN) and decode (tgN) speed of one process, reported the way
//! llama-bench reports them so the two can be put side by side.

use std::time::Instant;

use anyhow::Result;
use clap::Args;
use model::{Batch, Row};
use serde_json::json;

use crate::local::Local;
use crate::RunArgs;

#[derive(Args)]
pub struct BenchArgs {
    /// Path of the GGUF model, or a known model name (one-process bench).
    #[arg(long, required_unless_present = "url", value_parser = crate::models::model_path)]
    model: Option<std::path::PathBuf>,
    /// Bench a running tracker instead (e.g. http://127.0.0.1:8080).
    #[arg(long, conflicts_with = "model")]
    url: Option<String>,
    /// API key for the tracker (`--url`), when it requires one.
    #[arg(long, hide_env_values = true)]
    api_key: Option<String>,
    /// Kernel threads (one-process bench).
    #[arg(long)]
    threads: Option<usize>,
    /// Force an instruction set (one-process bench): scalar, avx2 or avx512-vnni (default: the
    /// best available), to measure a smaller machine's kernels on a larger one.
    #[arg(long, conflicts_with = "url")]
    isa: Option<String>,
    /// How the KV cache stores K and V (one-process bench): f16 or q8_0.
    #[arg(long, conflicts_with = "url", value_parser = model::KvType::from_name)]
    kv_type: Option<model::KvType>,
    /// Concurrent clients (cluster bench), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    concurrency: Vec<usize>,
    /// Requests each client sends one after another (cluster bench).
    #[arg(long, default_value_t = 2)]
    requests: usize,
    /// Sessions decoded together in each step (one-process bench), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batch: Vec<usize>,
    /// Prompt lengths to measure (ppN), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "128,512")]
    prompt_tokens: Vec<usize>,
    /// Positions each prefill step computes (one-process bench), as `strata serve
    /// --prefill-chunk` and llama-bench's micro-batch do; 0 computes each prompt in one step.
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// Generated tokens to measure (tgN); 0 skips decode.
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Runs of each test (after one warm-up run, of at most one prefill chunk for ppN).
    #[arg(long, default_value_t = 3)]
    repetitions: usize,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

struct TestResult {
    name: String,
    n_tokens: usize,
    rates: Vec<f64>,
}

impl TestResult {
    fn mean(&self) -> f64 {
        self.rates.iter().sum::<f64>() / self.rates.len().max(1) as f64
    }

    fn stddev(&self) -> f64 {
        let m = self.mean();
        let n = self.rates.len();
        if n < 2 {
            return 0.0;
        }
        (self.rates.iter().map(|r| (r - m).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
    }
}

/// Deterministic token ids that avoid the control tokens at the start of the vocabulary.
fn bench_tokens(n: usize, n_vocab: usize) -> Vec<u32> {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (100 + s % (n_vocab as u64 - 100)) as u32
        })
        .collect()
}

fn time_prefill(local: &Local, tokens: &[u32], chunk: usize) -> Result<f64> {
    let mut cache = local.model.new_cache(tokens.len());
    let chunk = if chunk == 0 { tokens.len() } else { chunk };
    let t = Instant::now();
    local.prefill(&mut cache, tokens, chunk, false)?;
    Ok(tokens.len() as f64 / t.elapsed().as_secs_f64())
}

/// Decodes `tokens` one position per step for `batch` sessions at once; aggregate tokens/s.
fn time_decode(local: &Local, tokens: &[u32], batch: usize) -> Result<f64> {
    let mut caches: Vec<model::KvCache> = (0..batch)
        .map(|_| local.model.new_cache(tokens.len()))
        .collect();
    let mut logits = Vec::new();
    let t = Instant::now();
    for (pos, &token) in tokens.iter().enumerate() {
        let rows: Vec<Row> = (0..batch)
            .map(|seq| Row {
                seq,
                pos,
                token,
                want_logits: true,
            })
            .collect();
        let mut refs: Vec<&mut model::KvCache> = caches.iter_mut().collect();
        // As a shard does: one logits buffer reused step after step.
        local.model.forward_into(
            Batch {
                rows: &rows,
                hidden: None,
            },
            &mut refs,
            &mut logits,
        )?;
    }
    Ok((tokens.len() * batch) as f64 / t.elapsed().as_secs_f64())
}

pub fn run(a: BenchArgs) -> Result<()> {
    if let Some(url) = &a.url {
        return crate::bench_cluster::run(crate::bench_cluster::UrlBench {
            url,
            api_key: a.api_key.as_deref(),
            concurrency: &a.concurrency,
            requests: a.requests,
            prompt_tokens: &a.prompt_tokens,
            gen_tokens: a.gen_tokens,
            json: a.json,
        });
    }
    let run = RunArgs {
        model: a
            .model
            .clone()
            .expect("clap requires --model without --url"),
        threads: a.threads,
        isa: a.isa.clone(),
        kv_type: a.kv_type.unwrap_or_default(),
    };
    let local = run.load()?;
    let n_vocab = local.model.config().n_vocab;
    let mut results = Vec::new();
    let reps = a.repetitions.max(1);
    for &n in &a.prompt_tokens {
        let tokens = bench_tokens(n, n_vocab);
        let chunk = a.prefill_chunk;
        let warm = if chunk == 0 { n } else { n.min(chunk) };
        time_prefill(&local, &tokens[..warm], chunk)?;
        let rates = (0..reps)
            .map(|_| time_prefill(&local, &tokens, chunk))
            .collect::<Result<Vec<_>>>()?;
        results.push(TestResult {
            name: format!("pp{n}"),
            n_tokens: n,
            rates,
        });
    }
    if a.gen_tokens > 0 {
        let tokens = bench_tokens(a.gen_tokens, n_vocab);
        for &b in &a.batch {
            let b = b.max(1);
            time_decode(&local, &tokens, b)?;
            let rates = (0..reps)
                .map(|_| time_decode(&local, &tokens, b))
                .collect::<Result<Vec<_>>>()?;
            let name = if b == 1 {
                format!("tg{}", a.gen_tokens)
            } else {
                format!("tg{} x{b}", a.gen_tokens)
            };
            results.push(TestResult {
                name,
                n_tokens: a.gen_tokens * b,
                rates,
            });
        }
    }
    let (peak_rss, rss) = proto::rss_bytes();
    let threads = local.model.n_threads();
    let isa = local.model.isa().name();
    let model_name = run
        .model
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned());
    if a.json {
        let tests: Vec<_> = results
            .iter()
            .map(|r| {
                json!({
                    "test": r.name,
                    "n_tokens": r.n_tokens,
                    "avg_ts": r.mean(),
                    "stddev_ts": r.stddev(),
                    "samples_ts": r.rates,
                })
            })
            .collect();
        println!(
            "{}",
            json!({
                "model": model_name,
                "model_bytes": local.file_bytes,
                "weight_bytes": local.model.weight_bytes(),
                "threads": threads,
                "isa": isa,
                "prefill_chunk": a.prefill_chunk,
                "kv_type": local.model.kv_type().name(),
                "peak_rss_bytes": peak_rss,
                "rss_bytes": rss,
                "tests": tests,
            })
        );
    } else {
        println!("| model | size | backend | threads | test | t/s |");
        println!("| --- | ---: | --- | ---: | ---: | ---: |");
        for r in &results {
            println!(
                "| {model_name} | {:.2} MiB | cpu ({isa}) | {threads} | {} | {:.2} ± {:.2} |",
                local.file_bytes as f64 / (1 << 20) as f64,
                r.name,
                r.mean(),
                r.stddev()
            );
        }
        let chunk = match a.prefill_chunk {
            0 => "one step per prompt".to_string(),
            n => format!("steps of {n} positions"),
        };
        println!(
            "\nprefill in {chunk}; {} K and V; peak RSS {:.1} MiB",
            local.model.kv_type().name(),
            peak_rss as f64 / (1 << 20) as f64
        );
    }
    Ok(())
}
