//! `strata model info`: what a GGUF holds, and what loading one layer range of it costs.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use model::{LayerRange, Model};
use serde_json::json;

use crate::RunArgs;

#[derive(Subcommand)]
pub enum ModelCommand {
    /// Load a layer range and report its tensors, the bytes it holds and resident memory.
    Info(InfoArgs),
}

#[derive(Args)]
pub struct InfoArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Layer range `A..B` (default: every layer).
    #[arg(long)]
    layers: Option<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Parses `A..B`.
pub fn parse_range(s: &str) -> Result<(usize, usize)> {
    let Some((a, b)) = s.split_once("..") else {
        bail!("layer range `{s}` is not of the form A..B");
    };
    Ok((a.trim().parse()?, b.trim().parse()?))
}

fn in_range(name: &str, r: LayerRange) -> bool {
    name.strip_prefix("blk.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|i| i.parse::<usize>().ok())
        .is_some_and(|i| i >= r.start && i < r.end)
}

pub fn run(cmd: ModelCommand) -> Result<()> {
    let ModelCommand::Info(a) = cmd;
    let path: PathBuf = a.run.model.clone();
    let file = gguf::GgufFile::open(&path)?;
    // Memory no file backs, so the growth below is the weights alone (not the pages of the
    // header just read, unmapped with the file after loading).
    let anon_before = proto::anon_rss_bytes();
    let config = model::ModelConfig::from_header(file.header())?;
    let range = match &a.layers {
        Some(s) => {
            let (start, end) = parse_range(s)?;
            LayerRange::new(start, end, config.n_layers)?
        }
        None => LayerRange::new(0, config.n_layers, config.n_layers)?,
    };
    // What the range's own tensors add up to, from the file's index alone.
    let h = file.header();
    let bytes_of = |name: &str| h.tensor(name).map_or(0, |t| t.n_bytes);
    let mut own: u64 = h
        .tensors()
        .iter()
        .filter(|t| in_range(&t.name, range))
        .map(|t| t.n_bytes)
        .sum();
    if range.start == 0 {
        own += bytes_of("token_embd.weight");
    }
    if range.end == config.n_layers {
        own += bytes_of("output_norm.weight");
        // A tied head shares the embedding when this range holds it, else it is a copy.
        own += match (h.tensor("output.weight"), range.start == 0) {
            (Some(t), _) => t.n_bytes,
            (None, true) => 0,
            (None, false) => bytes_of("token_embd.weight"),
        };
    }
    let m = Model::load(&file, Some(range), a.run.options()?)?;
    drop(file);
    let (peak, rss_after) = proto::rss_bytes();
    let anon_after = proto::anon_rss_bytes();
    let v = json!({
        "model": path.display().to_string(),
        "layers": format!("{range}"),
        "n_layers": config.n_layers,
        "range_tensor_bytes": own,
        "weight_bytes": m.weight_bytes(),
        "in_file_weight_bytes": m.in_file_weight_bytes(),
        "anon_rss_before_load_bytes": anon_before,
        "anon_rss_after_load_bytes": anon_after,
        "rss_after_load_bytes": rss_after,
        "peak_rss_bytes": peak,
        "isa": m.isa().name(),
    });
    if a.json {
        println!("{v}");
    } else {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!("model        {}", path.display());
        println!("layers       {range} of {}", config.n_layers);
        println!(
            "tensors      {:.2} MiB (the range's own tensors in the file)",
            mib(own)
        );
        println!("weights held {:.2} MiB", mib(m.weight_bytes() as u64));
        if m.in_file_weight_bytes() > 0 {
            println!(
                "embedding    {:.2} MiB read from the file a row per token, not held",
                mib(m.in_file_weight_bytes() as u64)
            );
        }
        println!(
            "rss          {:.2} MiB after load (heap {:.2} MiB before, {:.2} MiB after), peak {:.2} MiB",
            mib(rss_after),
            mib(anon_before),
            mib(anon_after),
            mib(peak)
        );
    }
    Ok(())
}
