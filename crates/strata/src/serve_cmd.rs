//! `strata serve`: a local cluster in one command. With one shard it runs inside this process
//! (in-memory transport); with more, it starts shard processes on 127.0.0.1 and supervises
//! them: a shard that dies is started again on the same port, with backoff, and counted
//! (`strata_serve_shard_restarts_total`), so the tracker's route comes back by itself.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use proto::ShardTransport;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::{oneshot, watch};

use crate::cluster_cmd::{
    connect_all, run_tracker, runtime, shard_config, tracker_config, ApiArgs, RouteArgs,
    ShardLimits,
};

#[derive(Args)]
pub struct ServeArgs {
    /// Path of the GGUF model, or a known model name (fetched and cached: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma3-270m).
    #[arg(long, value_parser = crate::models::model_path)]
    model: PathBuf,
    /// Number of shard processes; 1 runs the shard inside this process (in-memory transport).
    #[arg(long, default_value_t = 2)]
    shards: usize,
    /// Address the OpenAI-compatible API listens on.
    #[arg(long, default_value = "127.0.0.1:8080", value_parser = crate::cluster_cmd::listen_addr)]
    listen: String,
    /// Ports of the shard processes on 127.0.0.1, comma separated, one per shard (default:
    /// free ports chosen at start; a restarted shard keeps its port either way).
    #[arg(long, value_delimiter = ',')]
    shard_ports: Vec<u16>,
    #[command(flatten)]
    limits: ShardLimits,
    #[command(flatten)]
    route: RouteArgs,
    #[command(flatten)]
    api: ApiArgs,
}

/// Splits `n_layers` into `n` contiguous ranges whose sizes differ by at most one.
pub fn balanced_ranges(n_layers: usize, n: usize) -> Vec<(usize, usize)> {
    let (base, extra) = (n_layers / n, n_layers % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = (start, start + len);
            start += len;
            r
        })
        .collect()
}

fn fresh_token() -> Result<String> {
    let mut bytes = [0u8; 32];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom for a cluster token")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Refuses a draft model whose vocabulary differs from the served model's, naming the
/// difference; from the two files' headers, before the draft model's weights are loaded.
fn check_draft_vocabulary(target: &gguf::GgufFile, target_path: &Path, draft: &Path) -> Result<()> {
    let draft_file =
        gguf::GgufFile::open(draft).with_context(|| format!("opening {}", draft.display()))?;
    let target = text::Tokenizer::from_header(target.header())?;
    let theirs = text::Tokenizer::from_header(draft_file.header())
        .with_context(|| format!("reading the vocabulary of {}", draft.display()))?;
    if let Some(why) = target.difference(&theirs) {
        bail!(
            "the draft model {} cannot draft for {}: their vocabularies differ ({why})",
            draft.file_name().map_or_else(
                || draft.display().to_string(),
                |n| n.to_string_lossy().into()
            ),
            target_path.display()
        );
    }
    Ok(())
}

pub fn serve(a: ServeArgs) -> Result<()> {
    if a.shards == 0 {
        bail!("`--shards` must be at least 1");
    }
    if !a.shard_ports.is_empty() && a.shard_ports.len() != a.shards {
        bail!(
            "`--shard-ports` names {} ports for {} shards",
            a.shard_ports.len(),
            a.shards
        );
    }
    let file =
        gguf::GgufFile::open(&a.model).with_context(|| format!("opening {}", a.model.display()))?;
    let n_layers = model::ModelConfig::from_header(file.header())?.n_layers;
    if let Some(draft) = a.route.draft_model_path() {
        check_draft_vocabulary(&file, &a.model, draft)?;
    }
    drop(file);
    let config = tracker_config(&a.route, &a.api)?;
    if a.shards > n_layers {
        bail!(
            "`--shards` is {} but the model has only {n_layers} layers",
            a.shards
        );
    }
    let rt = runtime(2)?;
    rt.block_on(async {
        if a.shards == 1 {
            // Embedded: the shard lives in this process behind the in-memory transport.
            let link = proto::Link::plain(&fresh_token()?);
            let cfg = shard_config(&a.model, None, &a.limits, "embedded".into(), link);
            let core = tokio::task::spawn_blocking(move || shard::ShardCore::load(cfg)).await??;
            eprintln!("strata serve: {}", core.context);
            let shards: Vec<Arc<dyn ShardTransport>> = vec![Arc::new(shard::LocalShard::new(core))];
            let routes = vec![tracker::RouteSpec {
                name: "local".into(),
                shards,
            }];
            return run_tracker(config, routes, &a.listen, std::future::pending(), |_| {}).await;
        }
        let token = fresh_token()?;
        let dir = std::env::temp_dir().join(format!("strata-serve-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let token_file = dir.join("cluster-token");
        {
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .mode(0o600)
                .open(&token_file)?;
            f.write_all(token.as_bytes())?;
        }
        let exe = std::env::current_exe().context("locating the strata binary")?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let metrics: Arc<OnceLock<Arc<tracker::Metrics>>> = Arc::default();
        let mut supervisors = Vec::new();
        let mut addrs = Vec::new();
        for (i, (start, end)) in balanced_ranges(n_layers, a.shards).into_iter().enumerate() {
            let spec = ShardSpec {
                exe: exe.clone(),
                model: a.model.clone(),
                layers: format!("{start}..{end}"),
                token_file: token_file.clone(),
                limits: a.limits.to_args(),
                port: a.shard_ports.get(i).copied().unwrap_or(0),
            };
            let (ready_tx, ready_rx) = oneshot::channel();
            supervisors.push(tokio::spawn(supervise(
                spec,
                ready_tx,
                stop_rx.clone(),
                Arc::clone(&metrics),
            )));
            let addr = ready_rx
                .await
                .map_err(|_| anyhow!("shard {start}..{end} did not start"))??;
            eprintln!("strata serve: shard {start}..{end} on {addr}");
            addrs.push(addr);
        }
        let shards = connect_all(&addrs, &proto::Link::plain(&token))?;
        let routes = vec![tracker::RouteSpec {
            name: "local".into(),
            shards,
        }];
        let on_start = |t: &tracker::Tracker| {
            let m = t.metrics();
            m.describe(
                "strata_serve_shard_restarts_total",
                "counter",
                "shard processes strata serve started again after they died",
            );
            let _ = metrics.set(m);
        };
        let result = run_tracker(config, routes, &a.listen, std::future::pending(), on_start).await;
        let _ = stop_tx.send(true);
        for s in supervisors {
            let _ = tokio::time::timeout(Duration::from_secs(10), s).await;
        }
        let _ = std::fs::remove_dir_all(&dir);
        result
    })
}

/// How `serve` starts one shard process.
struct ShardSpec {
    exe: PathBuf,
    model: PathBuf,
    layers: String,
    token_file: PathBuf,
    limits: Vec<String>,
    /// 0 until the first start has chosen one; then the port every restart takes again.
    port: u16,
}

/// Starts one shard process, waits for its address, and drains its output.
async fn start(spec: &ShardSpec) -> Result<(tokio::process::Child, String)> {
    let mut cmd = tokio::process::Command::new(&spec.exe);
    cmd.arg("shard")
        .arg("--model")
        .arg(&spec.model)
        .arg("--layers")
        .arg(&spec.layers)
        .arg("--listen")
        .arg(format!("127.0.0.1:{}", spec.port))
        .arg("--cluster-token-file")
        .arg(&spec.token_file)
        .args(&spec.limits);
    // The shard's settings are the flags above, not what this process's environment says
    // for serve (a STRATA_LISTEN of serve's is not the shard's address).
    for name in crate::shard_env_names() {
        cmd.env_remove(name);
    }
    cmd.env("STRATA_LOG_FORMAT", crate::log_format())
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    // The child dies with this process (the signal is sent when the thread that started it
    // ends: a runtime worker, which lives as long as the runtime does).
    // SAFETY: prctl in the child before exec; async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting a shard process")?;
    let stdout = child.stdout.take().expect("piped");
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
        .await
        .map_err(|_| anyhow!("shard {} did not start within 120 s", spec.layers))??
        .ok_or_else(|| anyhow!("shard {} exited before it was ready", spec.layers))?;
    let addr = line
        .strip_prefix("strata shard listening on ")
        .and_then(|r| r.split_whitespace().next())
        .ok_or_else(|| anyhow!("unexpected shard output: {line}"))?
        .to_string();
    // Keep draining its stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, addr))
}

/// Stops a child: SIGTERM, then SIGKILL after five seconds.
async fn stop(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id() {
        // SAFETY: sending a signal to a child we spawned.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    }
    if tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}

/// Keeps one shard running until `stop_rx` says stop: its first address goes to `ready`;
/// each time it dies it is started again on the same port, after a pause that doubles from
/// 250 ms to 10 s while it keeps dying young (reset once it has run for a minute).
async fn supervise(
    mut spec: ShardSpec,
    ready: oneshot::Sender<Result<String>>,
    mut stop_rx: watch::Receiver<bool>,
    metrics: Arc<OnceLock<Arc<tracker::Metrics>>>,
) {
    let mut ready = Some(ready);
    let mut backoff = Duration::from_millis(250);
    loop {
        let (mut child, addr) = match start(&spec).await {
            Ok(started) => started,
            Err(e) => {
                if let Some(r) = ready.take() {
                    let _ = r.send(Err(e));
                    return;
                }
                eprintln!(
                    "strata serve: restarting shard {} failed: {e:#}",
                    spec.layers
                );
                if wait_or_stop(&mut stop_rx, backoff).await {
                    return;
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        if spec.port == 0 {
            spec.port = addr
                .rsplit(':')
                .next()
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
        }
        if let Some(r) = ready.take() {
            let _ = r.send(Ok(addr.clone()));
        }
        let started = Instant::now();
        let status = tokio::select! {
            status = child.wait() => status,
            _ = stopped(&mut stop_rx) => {
                stop(&mut child).await;
                return;
            }
        };
        eprintln!(
            "strata serve: shard {} on {addr} exited ({}); starting it again",
            spec.layers,
            status.map_or_else(|e| e.to_string(), |s| s.to_string())
        );
        if let Some(m) = metrics.get() {
            m.inc(
                "strata_serve_shard_restarts_total",
                &[("shard", addr.as_str())],
                1.0,
            );
        }
        if started.elapsed() > Duration::from_secs(60) {
            backoff = Duration::from_millis(250);
        }
        if wait_or_stop(&mut stop_rx, backoff).await {
            return;
        }
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

/// Resolves once told to stop (or once nobody can tell it anymore).
async fn stopped(stop_rx: &mut watch::Receiver<bool>) {
    let _ = stop_rx.wait_for(|s| *s).await;
}

/// Sleeps `pause`; `true` when told to stop meanwhile.
async fn wait_or_stop(stop_rx: &mut watch::Receiver<bool>, pause: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(pause) => false,
        _ = stopped(stop_rx) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_balanced_and_cover_every_layer() {
        assert_eq!(balanced_ranges(30, 2), vec![(0, 15), (15, 30)]);
        assert_eq!(
            balanced_ranges(30, 4),
            vec![(0, 8), (8, 16), (16, 23), (23, 30)]
        );
        assert_eq!(balanced_ranges(3, 3), vec![(0, 1), (1, 2), (2, 3)]);
    }
}
