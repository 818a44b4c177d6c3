//! `strata plan`: what a registry's swarm serves of one model file: each live shard, how many
//! shards serve each layer, the routes a tracker builds from them, what a new shard of a given
//! weights budget would take (`--layers auto` places it the same way), and each route's
//! predicted time per token.
//!
//! The prediction is a model of single-stream decode, printed with its inputs: compute is each
//! shard's own measured time per token where its record has one (the least compute time of
//! its recent one-position steps, as it announced it), and otherwise the weight bytes a token
//! reads on it (each layer's tensors, and the head on the last shard) at the memory read
//! bandwidth measured on this host; seams are one message per hop (tracker to the first
//! shard, shard to shard, the last shard back to the tracker), each half the round trip
//! measured from this host to the shard it reaches: an HTTP/2 PING answered by the shard's
//! server, so that whatever delays its messages (a proxy, a slow link) counts, not only the
//! TCP handshake.

use std::collections::HashMap;
use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use clap::Args;
use registry::placement::{chains, coverage, place, read_live};
use registry::ShardRecord;

use crate::cluster_cmd::{runtime, RegistryAccess};

#[derive(Args)]
pub struct PlanArgs {
    /// etcd endpoints of the swarm (`http://host:port`, or `https://` with `--registry-ca`;
    /// comma separated).
    #[arg(long)]
    registry: String,
    #[command(flatten)]
    registry_access: RegistryAccess,
    /// Key prefix of the cluster in the registry.
    #[arg(long, default_value = "/strata/")]
    registry_prefix: String,
    /// The GGUF model file (or a known model name) whose shards to plan: records match it by
    /// its SHA-256, and its header gives each layer's bytes.
    #[arg(long, value_parser = crate::models::model_path)]
    model: PathBuf,
    /// Also say what a new shard with this weights budget would take (as `strata shard
    /// --layers auto --weights-budget-mib N --kv-type T` would place itself now) and the
    /// routes then.
    #[arg(long)]
    weights_budget_mib: Option<u64>,
    /// Memory read bandwidth of the shard hosts in GB/s, for the compute part of the
    /// prediction (default: measured on this host, all cores).
    #[arg(long)]
    read_gbps: Option<f64>,
    /// The swarm to plan is that of shards storing K and V as this (f16 or q8_0) under this
    /// build's numeric contract: shards that store them otherwise never chain with those, so
    /// they are counted apart and form no route here; a new shard would store them so.
    #[arg(long, default_value = "f16", value_parser = model::KvType::from_name)]
    kv_type: model::KvType,
}

/// Bytes of weights one decoded token reads on a shard of `start..end`: every tensor of its
/// layers, and on the last shard the output norm and head (the embedding is looked up, one row
/// a token, unless the head is tied to it).
fn bytes_per_token(sizes: &model::WeightSizes, start: usize, end: usize) -> u64 {
    let layers: u64 = sizes.layers[start..end].iter().sum();
    let head = if end == sizes.layers.len() {
        sizes.output_norm + sizes.head
    } else {
        0
    };
    layers + head
}

/// GB/s of a streaming read of 256 MiB over `threads` threads (the best of three passes).
fn measure_read_gbps(threads: usize) -> f64 {
    const BYTES: usize = 256 << 20;
    let words = BYTES / 8;
    let data: Vec<u64> = (0..words as u64).collect();
    let per = words.div_ceil(threads);
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t0 = Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = data
                .chunks(per)
                .map(|c| s.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a summing thread"))
                .fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(sum);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    BYTES as f64 / best / 1e9
}

/// A message's round trip to the shard at `address`: an HTTP/2 PING on a fresh connection,
/// timed from sending it to its acknowledgement (the same payload), the least of three; `None`
/// when it does not answer within a second. A shard serving TLS answers the clear-text PING by
/// closing the connection, after the same one round trip: a connection closed before any
/// HTTP/2 frame arrived is timed too, one closed after some is not a measure.
fn round_trip(address: &str) -> Option<Duration> {
    use std::io::Write;
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    // SETTINGS (type 4, empty), then PING (type 6, 8 bytes of payload) on stream 0.
    const SETTINGS: [u8; 9] = [0, 0, 0, 4, 0, 0, 0, 0, 0];
    const PAYLOAD: [u8; 8] = *b"strata.p";
    let mut ping = vec![0, 0, 8, 6, 0, 0, 0, 0, 0];
    ping.extend_from_slice(&PAYLOAD);
    let addr = address.to_socket_addrs().ok()?.next()?;
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_nodelay(true).ok()?;
    stream.write_all(PREFACE).ok()?;
    stream.write_all(&SETTINGS).ok()?;
    let mut best: Option<Duration> = None;
    let mut framed = false;
    for _ in 0..3 {
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs(1);
        stream.write_all(&ping).ok()?;
        // Frames until the PING's acknowledgement (type 6, flag 1, our payload), at most
        // 64 KiB of them, all within the second.
        let mut read = 0usize;
        let acked = loop {
            let mut header = [0u8; 9];
            match read_by(&mut stream, &mut header, deadline) {
                Read::Done => {}
                Read::Closed if !framed => break false,
                Read::Closed | Read::Late => return best,
            }
            framed = true;
            let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
            read += 9 + len;
            if read > 64 << 10 {
                return best;
            }
            let mut payload = vec![0u8; len];
            if !matches!(read_by(&mut stream, &mut payload, deadline), Read::Done) {
                return best;
            }
            if header[3] == 6 && header[4] & 1 == 1 && payload == PAYLOAD {
                break true;
            }
        };
        best = Some(best.map_or(t0.elapsed(), |b| b.min(t0.elapsed())));
        if !acked {
            break;
        }
    }
    best
}

enum Read {
    Done,
    /// The peer closed the connection (or reset it).
    Closed,
    /// The deadline passed first.
    Late,
}

/// Fills `buf` from `stream` by `deadline`, however the peer trickles its bytes.
fn read_by(stream: &mut std::net::TcpStream, buf: &mut [u8], deadline: Instant) -> Read {
    use std::io::Read as _;
    let mut filled = 0;
    while filled < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return Read::Late;
        }
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Read::Closed,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Read::Late
            }
            Err(_) => return Read::Closed,
        }
    }
    Read::Done
}

/// Layer runs of equal coverage: `0..12 x1, 12..24 x0`.
fn coverage_runs(cover: &[u32]) -> String {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=cover.len() {
        if i == cover.len() || cover[i] != cover[start] {
            out.push(format!("{start}..{i} x{}", cover[start]));
            start = i;
        }
    }
    out.join(", ")
}

/// A route as `address (start..end) -> ...`.
fn hops(route: &[&ShardRecord]) -> String {
    let hops: Vec<String> = route
        .iter()
        .map(|r| format!("{} ({}..{})", r.address, r.layer_start, r.layer_end))
        .collect();
    hops.join(" -> ")
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// A route's predicted milliseconds per token: compute, seams, and the two summed.
struct Prediction {
    compute_ms: f64,
    /// Of the route's shards, how many had a measured time per token.
    measured: usize,
    shards: usize,
    seams_ms: Option<f64>,
}

impl Prediction {
    fn of(
        route: &[&ShardRecord],
        sizes: &model::WeightSizes,
        gbps: f64,
        rtt: &dyn Fn(&str) -> Option<Duration>,
    ) -> Prediction {
        let compute_ms: f64 = route
            .iter()
            .map(|r| match r.token_step_micros {
                0 => {
                    let bytes =
                        bytes_per_token(sizes, r.layer_start as usize, r.layer_end as usize);
                    bytes as f64 / (gbps * 1e9) * 1e3
                }
                measured => measured as f64 / 1e3,
            })
            .sum();
        // One message into each shard and one back from the last: each hop half a round trip
        // to the shard it reaches (the way back to the tracker counts the last shard's).
        let hops: Option<Vec<f64>> = route
            .iter()
            .map(|r| rtt(&r.address).map(|d| d.as_secs_f64() * 1e3 / 2.0))
            .collect();
        let seams_ms = hops.map(|h| h.iter().sum::<f64>() + h.last().copied().unwrap_or(0.0));
        Prediction {
            compute_ms,
            measured: route.iter().filter(|r| r.token_step_micros > 0).count(),
            shards: route.len(),
            seams_ms,
        }
    }
}

impl std::fmt::Display for Prediction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let source = match self.measured {
            0 => "from the read bandwidth".to_string(),
            n if n == self.shards => "measured by the shards".to_string(),
            n => format!(
                "measured by {n} of {} shards, the rest from the read bandwidth",
                self.shards
            ),
        };
        match self.seams_ms {
            Some(s) => write!(
                f,
                "{:.2} ms a token (compute {:.2}, {source}; seams {:.2})",
                self.compute_ms + s,
                self.compute_ms,
                s
            ),
            None => write!(
                f,
                "compute {:.2} ms a token ({source}); seams unknown (a shard did not answer a ping)",
                self.compute_ms
            ),
        }
    }
}

/// The model file as `plan` sees it: its digest and what each range of it weighs, and a new
/// shard of its swarm (all its layers; the range is filled in where one is placed).
struct Planned<'a> {
    path: &'a Path,
    digest: String,
    sizes: model::WeightSizes,
    n_layers: usize,
    new: ShardRecord,
}

pub fn plan(a: PlanArgs) -> Result<()> {
    if let Some(g) = a.read_gbps.filter(|g| !(g.is_finite() && *g > 0.0)) {
        bail!("--read-gbps must be a positive number of GB/s, not {g}");
    }
    let connect = a
        .registry_access
        .connect(Some(&a.registry))?
        .ok_or_else(|| anyhow!("--registry is required"))?;
    let sizes = model::WeightSizes::of(&gguf::GgufFile::open(&a.model)?)?;
    let digest = shard::file_digest(&a.model)?;
    let n_layers = sizes.layers.len();
    if n_layers == 0 {
        bail!("{} has no layers", a.model.display());
    }
    // A shard of the swarm planned: the model, and what its shards compute as.
    let new = ShardRecord::placing(
        "(new shard)",
        "",
        &a.model.display().to_string(),
        &digest,
        0..n_layers as u32,
        n_layers as u32,
        &registry::arithmetic(a.kv_type.name(), model::NUMERIC_CONTRACT),
    );
    let m = Planned {
        path: &a.model,
        digest,
        n_layers,
        sizes,
        new,
    };
    let (records, claims) = runtime(1)?
        .block_on(read_live(&connect, &a.registry_prefix))
        .map_err(|e| anyhow!("reading the registry: {e}"))?;
    let ours = |r: &&ShardRecord| r.same_swarm(&m.new);
    let mine: Vec<&ShardRecord> = records
        .iter()
        .filter(ours)
        .filter(|r| r.plausible())
        .collect();
    let apart = records
        .iter()
        .filter(|r| r.digest == m.digest && !r.same_swarm(&m.new))
        .count();
    let claiming: Vec<&ShardRecord> = claims.iter().filter(ours).collect();
    print_swarm(
        &a,
        &m,
        &mine,
        (apart, records.len() - mine.len() - apart),
        &claiming,
    );

    let gbps = a.read_gbps.unwrap_or_else(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let g = measure_read_gbps(threads);
        println!("memory read bandwidth measured here: {g:.1} GB/s ({threads} threads)");
        g
    });
    let live: Vec<&ShardRecord> = mine.iter().copied().filter(|r| !r.draining).collect();
    // Each shard's round trip, measured once.
    let rtts: HashMap<&str, Option<Duration>> = live
        .iter()
        .map(|r| (r.address.as_str(), round_trip(&r.address)))
        .collect();
    let rtt = |address: &str| rtts.get(address).copied().flatten();
    let routes = chains(live.clone(), usize::MAX);
    println!(
        "routes (chains of shards covering layers 0..{} once, as a tracker builds them): {}",
        m.n_layers,
        routes.len()
    );
    for (i, route) in routes.iter().enumerate() {
        println!(
            "  route {}: {}: {}",
            i + 1,
            hops(route),
            Prediction::of(route, &m.sizes, gbps, &rtt)
        );
    }
    if let Some(budget_mib) = a.weights_budget_mib {
        let counted = coverage(mine.iter().chain(&claiming).copied(), &m.new);
        print_new_shard(&m, budget_mib, &counted, &live, gbps, &rtt);
    }
    Ok(())
}

/// The model, the registry's shards of its swarm (and how many of it storing K and V
/// otherwise, and of other models: `(apart, others)`), the claims of shards placing
/// themselves, and the coverage per layer.
fn print_swarm(
    a: &PlanArgs,
    m: &Planned,
    mine: &[&ShardRecord],
    (apart, others): (usize, usize),
    claiming: &[&ShardRecord],
) {
    println!(
        "model {} ({} layers, sha256 {}..., {:.1} MiB of weights)",
        m.path.display(),
        m.n_layers,
        &m.digest[..12],
        mib(m.sizes.range(0, m.n_layers))
    );
    println!(
        "registry {} prefix {}: {} shards of this model ({} draining) storing K and V as {} ({}), {apart} of it of another KV type or numeric contract (never in these routes), {others} of other models, {} placing themselves now",
        a.registry,
        a.registry_prefix,
        mine.len(),
        mine.iter().filter(|r| r.draining).count(),
        a.kv_type.name(),
        m.new.arithmetic(),
        claiming.len()
    );
    if apart > 0 {
        println!(
            "  (a tracker serves a model under one KV type and contract: while routes of one kind serve, it refuses the other's)"
        );
    }
    let mut sorted = mine.to_vec();
    sorted.sort_by_key(|r| (r.layer_start, r.layer_end, r.address.clone()));
    for r in &sorted {
        println!(
            "  shard {} layers {}..{}{}: {:.1} MiB of weights, {} sessions, KV {:.0} of {:.0} MiB free",
            r.address,
            r.layer_start,
            r.layer_end,
            if r.draining { " (draining)" } else { "" },
            mib(m.sizes.range(r.layer_start as usize, r.layer_end as usize)),
            r.sessions,
            mib(r.kv_free_bytes),
            mib(r.kv_budget_bytes),
        );
    }
    for r in claiming {
        println!(
            "  placing {} layers {}..{} (loading)",
            r.address, r.layer_start, r.layer_end
        );
    }
    let cover = coverage(mine.iter().copied(), &m.new);
    println!(
        "layers served (shards taking sessions per layer): {}",
        coverage_runs(&cover)
    );
}

/// Where a new shard of `budget_mib` would go given the layers' coverage (`counted`, claims
/// included), the routes then, and the prediction of each new one (its seams like the slowest
/// measured).
fn print_new_shard(
    m: &Planned,
    budget_mib: u64,
    counted: &[u32],
    live: &[&ShardRecord],
    gbps: f64,
    rtt: &dyn Fn(&str) -> Option<Duration>,
) {
    let budget = budget_mib.saturating_mul(1 << 20);
    let Some(range) = place(counted, |s, e| m.sizes.range(s, e) <= budget) else {
        println!(
            "a new shard with {budget_mib} MiB for weights holds no layer (the smallest one-layer range needs {:.1} MiB)",
            (0..m.n_layers)
                .map(|i| mib(m.sizes.range(i, i + 1)))
                .fold(f64::MAX, f64::min)
        );
        return;
    };
    let new = ShardRecord {
        layer_start: range.start as u32,
        layer_end: range.end as u32,
        ..m.new.clone()
    };
    let mut with_new = live.to_vec();
    with_new.push(&new);
    let after = chains(with_new, usize::MAX);
    println!(
        "a new shard with {budget_mib} MiB for weights would take layers {}..{} ({:.1} MiB); routes then: {}",
        range.start,
        range.end,
        mib(m.sizes.range(range.start, range.end)),
        after.len()
    );
    let slowest = live.iter().filter_map(|r| rtt(&r.address)).max();
    let rtt_new = |address: &str| {
        if address == new.address {
            slowest
        } else {
            rtt(address)
        }
    };
    for route in after
        .iter()
        .filter(|c| c.iter().any(|r| r.address == new.address))
    {
        println!(
            "  new route: {}: {}",
            hops(route),
            Prediction::of(route, &m.sizes, gbps, &rtt_new)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::coverage_runs;

    #[test]
    fn coverage_is_printed_as_runs_of_equal_counts() {
        assert_eq!(coverage_runs(&[1, 1, 2, 0, 0]), "0..2 x1, 2..3 x2, 3..5 x0");
        assert_eq!(coverage_runs(&[0]), "0..1 x0");
        assert_eq!(coverage_runs(&[]), "");
    }
}
