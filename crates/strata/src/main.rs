//! The `strata` binary: every command line surface of the project. Flags are parsed here and
//! only here, then turned into typed options for the library crates.

mod bench;
mod bench_cluster;
mod cluster_cmd;
mod config;
mod draft_model;
mod draft_remote;
mod drafter_cmd;
mod local;
mod model_cmd;
mod models;
mod plan_cmd;
mod serve_cmd;
mod shard_cmd;

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, Parser, Subcommand};
use model::sampling::SamplingParams;
use model::{Isa, ModelOptions};
use serde_json::json;

use crate::local::{GenerateRequest, Local};

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "Distributed inference for GGUF language models",
    after_help = "Settings: every flag can also be given as a STRATA_* variable (--max-sessions: STRATA_MAX_SESSIONS) or in the TOML file of --config, one table per command ([tracker], [shard], ...); the command line wins over the variable, the variable over the file.\n\nLogging: STRATA_LOG sets what is logged to stderr, as a tracing filter (default `warn`; `info` adds a line per request, `strata=debug` every step), e.g. STRATA_LOG=info strata serve ..."
)]
struct Cli {
    /// A TOML file of settings: flags of every command at its top, each command's in its
    /// table (`[tracker]`, `[shard]`, `[serve]`, ...), keyed by the flags' long names.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// How log lines are written to stderr: `text` (for a person) or `json` (one object per
    /// line, for a collector: timestamp, level, target, fields).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// The log format this process writes (`text` or `json`), for the processes it starts
/// (`strata serve`'s shards) to write the same.
static LOG_FORMAT: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

pub(crate) fn log_format() -> &'static str {
    LOG_FORMAT.get().copied().unwrap_or("text")
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt in one process.
    Generate(GenerateArgs),
    /// One prefill of the given ids; prints the top-k logits at every position as JSON.
    Logits(LogitsArgs),
    /// Print the token ids of a text as JSON.
    Tokenize(TokenizeArgs),
    /// Measure prefill and decode speed (reported like llama-bench).
    Bench(bench::BenchArgs),
    /// Inspect a model file and what loading it costs.
    #[command(subcommand)]
    Model(model_cmd::ModelCommand),
    /// What a registry's swarm serves of a model: shards, coverage per layer, routes, what a
    /// new shard of a given budget would take, and each route's predicted time per token.
    Plan(plan_cmd::PlanArgs),
    /// Serve one layer range of a model over gRPC.
    Shard(shard_cmd::ShardArgs),
    /// Drive sessions through a route of shards and serve the OpenAI-compatible API.
    Tracker(cluster_cmd::TrackerArgs),
    /// Serve a draft model in a process of its own: it drafts tokens for the speculating
    /// sessions of trackers started with `--drafter`.
    Drafter(drafter_cmd::DrafterArgs),
    /// Start a local cluster: N shard processes and a tracker (N = 1: one process).
    Serve(serve_cmd::ServeArgs),
}

/// Options shared by every command that runs the model.
#[derive(Args, Clone)]
pub(crate) struct RunArgs {
    /// Path of the GGUF model, or a known model name (fetched and cached: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma3-270m).
    #[arg(long, value_parser = crate::models::model_path)]
    pub(crate) model: PathBuf,
    /// Kernel threads (default: all cores).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// Force an instruction set: scalar, avx2 or avx512-vnni (default: the best available).
    #[arg(long)]
    pub(crate) isa: Option<String>,
    /// How the KV cache stores K and V: f16 or q8_0 (as llama.cpp's `--cache-type-k/-v`).
    #[arg(long, default_value = "f16", value_parser = model::KvType::from_name)]
    pub(crate) kv_type: model::KvType,
}

impl RunArgs {
    fn options(&self) -> Result<ModelOptions> {
        let isa = match self.isa.as_deref() {
            None => None,
            Some(name) => Some(Isa::from_name(name).map_err(|e| anyhow::anyhow!("--isa: {e}"))?),
        };
        let mut opts = ModelOptions {
            isa,
            kv_type: self.kv_type,
            ..ModelOptions::default()
        };
        if let Some(t) = self.threads {
            if t == 0 {
                bail!("`--threads` must be at least 1");
            }
            opts.n_threads = t;
        }
        Ok(opts)
    }

    pub(crate) fn load(&self) -> Result<Local> {
        Local::load(&self.model, self.options()?)
    }
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Prompt text (special tokens such as <|im_start|> are parsed).
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sample among the k most likely tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sample among the most likely tokens whose probabilities sum to this (1: all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one (0: none).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalty on tokens of the last 64 (1: none).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when this text is generated (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Treat the prompt as a user message and apply the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Context length (positions) of the session.
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    /// Prompt tokens per forward call.
    #[arg(long, default_value_t = 512)]
    batch_size: usize,
}

#[derive(Args)]
struct LogitsArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Token ids to run as one prompt, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    ids: Vec<u32>,
    /// How many of the highest logits to print at every position.
    #[arg(long, default_value_t = 5)]
    top_k: usize,
}

#[derive(Args)]
struct TokenizeArgs {
    /// Path of the GGUF model whose tokenizer to use, or a known model name.
    #[arg(long, value_parser = crate::models::model_path)]
    model: PathBuf,
    /// Parse special-token text (such as <|im_end|>) into special tokens.
    #[arg(long)]
    special: bool,
    /// The text to tokenize.
    text: String,
}

/// The command line, with the `STRATA_*` variables and the `--config` file under it.
fn parse_cli() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cmd = match config::apply_file(config::with_env(Cli::command()), &args) {
        Ok(cmd) => cmd,
        Err(e) => {
            eprintln!("strata: {e}");
            std::process::exit(2);
        }
    };
    let matches = cmd.get_matches_from(args);
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// The variables of `strata shard`'s flags (see [`config::env_names`]).
pub(crate) fn shard_env_names() -> Vec<String> {
    use clap::CommandFactory;
    let root = config::with_env(Cli::command());
    root.find_subcommand("shard")
        .map(config::env_names)
        .unwrap_or_default()
}

fn main() {
    use std::io::IsTerminal;
    let cli = parse_cli();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr);
    let _ = LOG_FORMAT.set(match cli.log_format {
        LogFormat::Text => "text",
        LogFormat::Json => "json",
    });
    match cli.log_format {
        // Colours only for a person at a terminal; a log file or collector gets plain text.
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.json().with_ansi(false).init(),
    }
    if let Some(path) = &cli.config {
        tracing::info!(config = %path.display(), "settings read from the file");
    }
    let result = match cli.command {
        Command::Generate(a) => generate(a),
        Command::Logits(a) => logits(a),
        Command::Tokenize(a) => tokenize(a),
        Command::Bench(a) => bench::run(a),
        Command::Model(c) => model_cmd::run(c),
        Command::Plan(a) => plan_cmd::plan(a),
        Command::Shard(a) => shard_cmd::shard(a),
        Command::Tracker(a) => cluster_cmd::tracker(a),
        Command::Drafter(a) => drafter_cmd::drafter(a),
        Command::Serve(a) => serve_cmd::serve(a),
    };
    if let Err(e) = result {
        eprintln!("strata: {e:#}");
        std::process::exit(1);
    }
}

fn top_json(top: &[(u32, f32)]) -> serde_json::Value {
    top.iter()
        .map(|&(id, logit)| json!({ "id": id, "logit": logit }))
        .collect()
}

fn generate(a: GenerateArgs) -> Result<()> {
    let local = a.run.load()?;
    let prompt_ids = match (&a.prompt, &a.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(p), None) if a.chat => local.encode_chat(&[text::ChatMessage::new("user", p)])?,
        (Some(p), None) => local.encode_prompt(p),
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let req = GenerateRequest {
        prompt_ids: prompt_ids.clone(),
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            repeat_penalty: a.repeat_penalty,
            seed: a.seed,
            ..SamplingParams::default()
        },
        stop: a.stop.clone(),
        n_top: if a.json { 5 } else { 0 },
        batch_size: a.batch_size,
        n_ctx: a.ctx,
    };
    let stdout = std::io::stdout();
    let out = local.generate(&req, |piece| {
        if !a.json {
            let mut lock = stdout.lock();
            let _ = lock.write_all(piece.as_bytes());
            let _ = lock.flush();
        }
    })?;
    let per_s = |n: usize, d: std::time::Duration| {
        if d.is_zero() {
            0.0
        } else {
            n as f64 / d.as_secs_f64()
        }
    };
    if a.json {
        let n_gen = out.generated_ids.len();
        let v = json!({
            "prompt_ids": prompt_ids,
            "generated_ids": out.generated_ids,
            "text": out.text,
            "stop_reason": out.stop_reason.as_str(),
            "top5": out.top.iter().map(|t| top_json(t)).collect::<Vec<_>>(),
            "timings": {
                "prompt_tokens": prompt_ids.len(),
                "prompt_ms": out.prompt_time.as_secs_f64() * 1e3,
                "prompt_tokens_per_s": per_s(prompt_ids.len(), out.prompt_time),
                "generated_tokens": n_gen,
                "decode_ms": out.decode_time.as_secs_f64() * 1e3,
                "decode_tokens_per_s": per_s(n_gen.saturating_sub(1), out.decode_time),
                "ttft_ms": out.ttft.as_secs_f64() * 1e3,
            },
            "threads": local.model.n_threads(),
            "isa": local.model.isa().name(),
        });
        println!("{v}");
    } else {
        println!();
        std::io::stdout().flush()?;
        eprintln!(
            "[{} prompt tokens at {:.1} t/s, {} generated at {:.1} t/s, stop: {}]",
            prompt_ids.len(),
            per_s(prompt_ids.len(), out.prompt_time),
            out.generated_ids.len(),
            per_s(out.generated_ids.len().saturating_sub(1), out.decode_time),
            out.stop_reason.as_str()
        );
    }
    Ok(())
}

fn logits(a: LogitsArgs) -> Result<()> {
    let local = a.run.load()?;
    let mut cache = local.model.new_cache(a.ids.len());
    let logits = local.prefill(&mut cache, &a.ids, a.ids.len(), true)?;
    let n_vocab = local.model.config().n_vocab;
    let positions: Vec<serde_json::Value> = logits
        .chunks_exact(n_vocab)
        .map(|l| top_json(&model::sampling::top_k(l, a.top_k)))
        .collect();
    println!("{}", json!({ "ids": a.ids, "top_k": positions }));
    Ok(())
}

fn tokenize(a: TokenizeArgs) -> Result<()> {
    let file = gguf::GgufFile::open(&a.model)?;
    let tok = text::Tokenizer::from_header(file.header())?;
    println!("{}", json!(tok.encode(&a.text, true, a.special)));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every flag and argument of every command says what it is for in `--help`.
    #[test]
    fn every_flag_has_help_text() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{path} --{id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "strata", &mut missing);
        assert!(
            missing.is_empty(),
            "flags without help:\n{}",
            missing.join("\n")
        );
    }
}
