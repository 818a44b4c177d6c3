//! `strata shard`, `strata tracker` and `strata serve`: the distributed commands.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use proto::v1::SeamDtype;
use proto::ShardTransport;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::model_cmd::parse_range;

#[derive(Args)]
pub struct ShardArgs {
    #[arg(long, env = "STRATA_MODEL")]
    model: PathBuf,
    /// Layer range `A..B` this shard serves.
    #[arg(long)]
    layers: String,
    /// Address to listen on (port 0 picks a free port; the chosen address is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// File holding the shared cluster token.
    #[arg(long)]
    cluster_token_file: PathBuf,
    #[command(flatten)]
    limits: ShardLimits,
}

/// Per-shard limits shared by `shard` and `serve`.
#[derive(Args, Clone)]
pub struct ShardLimits {
    /// Kernel threads (default: all cores; an idle shard's threads sleep).
    #[arg(long)]
    threads: Option<usize>,
    /// Most positions one session may hold.
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    /// KV cache budget in MiB for all sessions together (default: an eighth of the machine's
    /// memory, at most 1024).
    #[arg(long)]
    kv_budget_mib: Option<usize>,
    /// Memory the shard's weights may take, in MiB; a range that needs more is refused at
    /// start (default: half of the machine's memory).
    #[arg(long)]
    weights_budget_mib: Option<usize>,
    /// Per-step activations in MiB; bounds the tokens one step may carry (default 256).
    #[arg(long, default_value_t = 256)]
    scratch_budget_mib: usize,
    /// Activations sent downstream and not yet answered, in MiB (default 64).
    #[arg(long, default_value_t = 64)]
    inflight_budget_mib: usize,
    /// Pin this node's model: a tracker refuses to evict it.
    #[arg(long)]
    pin: bool,
    /// Compute every session's prompt in full instead of starting it on the cached KV blocks
    /// of a token prefix another session already computed.
    #[arg(long)]
    no_prefix_cache: bool,
    #[arg(long, default_value_t = 256)]
    max_sessions: usize,
    /// Milliseconds a session may sit idle before its KV is forgotten.
    #[arg(long, default_value_t = 600_000)]
    kv_ttl_ms: u64,
}

impl ShardLimits {
    fn threads(&self) -> usize {
        self.threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .max(1)
    }

    fn kv_budget_mib(&self) -> usize {
        self.kv_budget_mib
            .unwrap_or_else(|| (machine_memory_mib() / 8).clamp(16, 1024))
    }

    fn weights_budget_mib(&self) -> usize {
        self.weights_budget_mib
            .unwrap_or_else(|| machine_memory_mib() / 2)
    }

    fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "--ctx".to_string(),
            self.ctx.to_string(),
            "--kv-budget-mib".into(),
            self.kv_budget_mib().to_string(),
            "--weights-budget-mib".into(),
            self.weights_budget_mib().to_string(),
            "--scratch-budget-mib".into(),
            self.scratch_budget_mib.to_string(),
            "--inflight-budget-mib".into(),
            self.inflight_budget_mib.to_string(),
            "--max-sessions".into(),
            self.max_sessions.to_string(),
            "--kv-ttl-ms".into(),
            self.kv_ttl_ms.to_string(),
        ];
        if let Some(t) = self.threads {
            v.extend(["--threads".to_string(), t.to_string()]);
        }
        if self.no_prefix_cache {
            v.push("--no-prefix-cache".into());
        }
        if self.pin {
            v.push("--pin".into());
        }
        v
    }
}

#[derive(Args)]
pub struct TrackerArgs {
    /// Shard addresses of one route, comma separated (any order; they are sorted by layer
    /// range).
    #[arg(long, value_delimiter = ',')]
    shards: Vec<String>,
    /// A named route, `NAME=ADDR,ADDR,...` (repeatable): one node's shards of one model. A
    /// tracker may front several models; each request goes only to routes holding its model.
    #[arg(long = "route")]
    routes: Vec<String>,
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    #[arg(long)]
    cluster_token_file: PathBuf,
    #[command(flatten)]
    route: RouteArgs,
}

/// Route settings shared by `tracker` and `serve`.
#[derive(Args, Clone)]
pub struct RouteArgs {
    /// Activation encoding across seams: f32 (exact) or f16 (half the bytes).
    #[arg(long, default_value = "f32")]
    seam: String,
    /// Tokens one step may carry (decode and prefill together).
    #[arg(long, default_value_t = 512)]
    max_step_tokens: usize,
    /// Prompt tokens one session may take in one step.
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// Sessions active on the route at once.
    #[arg(long, default_value_t = 64)]
    max_active: usize,
    /// Steps (micro-batches) in flight along the route at once; 0 = one per shard, so every
    /// shard computes while the others do.
    #[arg(long, default_value_t = 0)]
    pipeline_depth: usize,
    /// How often the tracker probes each shard's health and stats, in milliseconds.
    #[arg(long, default_value_t = 500)]
    health_period_ms: u64,
    /// Active sessions grading work may hold (the rest of --max-active stays for agent work).
    #[arg(long, default_value_t = 48)]
    grading_max_active: usize,
    /// Tokens grading work may take per step while agent work runs or ran recently.
    #[arg(long, default_value_t = 8)]
    grading_step_tokens: usize,
    /// Milliseconds after agent work during which no grading work starts.
    #[arg(long, default_value_t = 50)]
    agent_gap_ms: u64,
    /// How long after agent work grading steps stay capped, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    agent_guard_ms: u64,
    /// Grading work that waited this long joins the next step even beside agent work.
    #[arg(long, default_value_t = 2000)]
    grading_max_wait_ms: u64,
    /// Requests that may wait for a place on the route: agent queue.
    #[arg(long, default_value_t = 64)]
    agent_queue: usize,
    /// Requests that may wait for a place on the route: grading queue.
    #[arg(long, default_value_t = 256)]
    grading_queue: usize,
    /// Largest share one API key may hold of a class's places (active plus queued) and, while
    /// other keys have prompts waiting, of a step's tokens.
    #[arg(long, default_value_t = 0.5)]
    key_share: f64,
    /// SQLite file recording every accepted request's usage per API key (created if absent).
    #[arg(long)]
    ledger: Option<PathBuf>,
    /// API keys with token budgets, one per line: `NAME SECRET BUDGET_TOKENS` (needs --ledger).
    #[arg(long)]
    api_keys: Option<PathBuf>,
    /// File holding the admin API's bearer token (enables `POST /admin/routes/NAME/evict`).
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
}

impl RouteArgs {
    fn config(&self) -> Result<tracker::TrackerConfig> {
        let seam = match self.seam.as_str() {
            "f32" => SeamDtype::SeamF32,
            "f16" => SeamDtype::SeamF16,
            other => bail!("unknown --seam `{other}` (expected f32 or f16)"),
        };
        if self.max_step_tokens == 0 || self.prefill_chunk == 0 || self.max_active == 0 {
            bail!("`--max-step-tokens`, `--prefill-chunk` and `--max-active` must be at least 1");
        }
        let keys = match &self.api_keys {
            Some(p) => tracker::ledger::parse_keys(
                &std::fs::read_to_string(p)
                    .with_context(|| format!("reading API keys from {}", p.display()))?,
            )
            .map_err(|e| anyhow!("{}: {e}", p.display()))?,
            None => Vec::new(),
        };
        let ledger = match &self.ledger {
            Some(p) => Some(Arc::new(
                tracker::ledger::Ledger::open(p, keys).map_err(|e| anyhow!(e))?,
            )),
            None if !keys.is_empty() => bail!("`--api-keys` needs `--ledger` to record usage"),
            None => None,
        };
        if !(self.key_share > 0.0 && self.key_share <= 1.0) {
            bail!("`--key-share` must be in (0, 1], got {}", self.key_share);
        }
        Ok(tracker::TrackerConfig {
            scheduler: engine::SchedulerConfig {
                max_step_tokens: self.max_step_tokens,
                max_prefill_chunk: self.prefill_chunk,
                max_active: self.max_active,
                pipeline_depth: self.pipeline_depth,
                grading_max_active: self.grading_max_active.min(self.max_active),
                grading_step_tokens: self.grading_step_tokens.max(1),
                agent_guard: Duration::from_millis(self.agent_guard_ms),
                agent_gap: Duration::from_millis(self.agent_gap_ms),
                owner_step_share: self.key_share,
                grading_max_wait: Duration::from_millis(self.grading_max_wait_ms),
            },
            admission: engine::AdmissionConfig {
                queue_slots: [self.agent_queue, self.grading_queue],
                key_share: self.key_share,
                ..engine::AdmissionConfig::default()
            },
            seam,
            health_period: Duration::from_millis(self.health_period_ms.max(10)),
            ledger,
            admin_token: match &self.admin_token_file {
                Some(p) => Some(read_token(p)?),
                None => None,
            },
            ..tracker::TrackerConfig::default()
        })
    }
}

#[derive(Args)]
pub struct ServeArgs {
    #[arg(long, env = "STRATA_MODEL")]
    model: PathBuf,
    /// Number of shard processes; 1 runs the shard inside this process (in-memory transport).
    #[arg(long, default_value_t = 2)]
    shards: usize,
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    #[command(flatten)]
    limits: ShardLimits,
    #[command(flatten)]
    route: RouteArgs,
}

fn read_token(path: &Path) -> Result<String> {
    let t = std::fs::read_to_string(path)
        .with_context(|| format!("reading the cluster token from {}", path.display()))?;
    let t = t.trim().to_string();
    if t.len() < 16 {
        bail!(
            "the cluster token in {} is shorter than 16 characters",
            path.display()
        );
    }
    Ok(t)
}

/// The async runtime of a command. A shard's async side only relays messages between the
/// network and its compute thread, so it gets one worker: every wake-up between its tasks
/// stays on one thread (each cross-thread wake costs tens of microseconds here, and a token
/// crosses each shard four times). The tracker keeps two, so one request's tokenization never
/// holds up the step loop.
fn runtime(workers: usize) -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {}
    }
}

/// gRPC clients for `addrs`, all presenting the cluster token.
fn connect_all(addrs: &[String], token: &str) -> Result<Vec<Arc<dyn ShardTransport>>> {
    addrs
        .iter()
        .map(|addr| proto::connect(addr, token).map(|s| Arc::new(s) as Arc<dyn ShardTransport>))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow!(e.message().to_string()))
}

/// The machine's memory in MiB (`MemTotal`), for budget defaults; 8 GiB when unknown.
fn machine_memory_mib() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<usize>().ok())
        })
        .map_or(8192, |kib| kib / 1024)
}

fn shard_config(
    model: &Path,
    layers: Option<(usize, usize)>,
    limits: &ShardLimits,
    label: String,
    token: String,
) -> shard::ShardConfig {
    shard::ShardConfig {
        model_path: model.to_path_buf(),
        layers,
        n_threads: limits.threads(),
        n_ctx: limits.ctx,
        kv_budget_bytes: limits.kv_budget_mib() << 20,
        kv_ttl: Duration::from_millis(limits.kv_ttl_ms),
        max_sessions: limits.max_sessions,
        weights_budget_bytes: limits.weights_budget_mib() << 20,
        scratch_budget_bytes: limits.scratch_budget_mib << 20,
        inflight_budget_bytes: limits.inflight_budget_mib << 20,
        pinned: limits.pin,
        prefix_cache: !limits.no_prefix_cache,
        label,
        cluster_token: token,
    }
}

pub fn shard(a: ShardArgs) -> Result<()> {
    let token = read_token(&a.cluster_token_file)?;
    let layers = parse_range(&a.layers)?;
    let rt = runtime(1)?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&a.listen)
            .await
            .with_context(|| format!("binding {}", a.listen))?;
        let addr = listener.local_addr()?.to_string();
        let config = shard_config(&a.model, Some(layers), &a.limits, addr.clone(), token);
        let core = tokio::task::spawn_blocking(move || shard::ShardCore::load(config)).await??;
        println!(
            "strata shard listening on {addr} layers {}..{}",
            core.info.layer_start, core.info.layer_end
        );
        std::io::stdout().flush()?;
        shard::serve(core, listener, shutdown_signal()).await?;
        Ok(())
    })
}

async fn run_tracker(
    config: tracker::TrackerConfig,
    routes: Vec<tracker::RouteSpec>,
    listen: &str,
    extra_shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let t = tracker::Tracker::start(config, routes)
        .await
        .map_err(|e| anyhow!("the tracker refuses to start: {e}"))?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let addr = listener.local_addr()?;
    let routes: Vec<String> = t
        .routes()
        .iter()
        .map(|r| {
            let hops: Vec<String> = r
                .shards
                .iter()
                .map(|(a, s, e)| format!("{a} [{s}..{e})"))
                .collect();
            format!("model {} route {}: {}", r.model, r.name, hops.join(" -> "))
        })
        .collect();
    println!(
        "strata tracker listening on http://{addr} {}",
        routes.join("; ")
    );
    std::io::stdout().flush()?;
    t.serve(listener, async move {
        tokio::select! {
            _ = shutdown_signal() => {}
            _ = extra_shutdown => {}
        }
    })
    .await
    .map_err(|e| anyhow!(e))
}

pub fn tracker(a: TrackerArgs) -> Result<()> {
    let token = read_token(&a.cluster_token_file)?;
    let config = a.route.config()?;
    let mut named: Vec<(String, Vec<String>)> = Vec::new();
    if !a.shards.is_empty() {
        named.push(("default".into(), a.shards.clone()));
    }
    for r in &a.routes {
        let (name, addrs) = r
            .split_once('=')
            .ok_or_else(|| anyhow!("`--route {r}`: expected NAME=ADDR,ADDR,..."))?;
        if named.iter().any(|(n, _)| n == name) {
            bail!("route `{name}` is given twice");
        }
        named.push((name.into(), addrs.split(',').map(str::to_string).collect()));
    }
    if named.is_empty() {
        bail!("give the shards of at least one route: `--shards A,B` or `--route NAME=A,B`");
    }
    let rt = runtime(2)?;
    rt.block_on(async {
        let routes = named
            .into_iter()
            .map(|(name, addrs)| {
                Ok(tracker::RouteSpec {
                    name,
                    shards: connect_all(&addrs, &token)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        run_tracker(config, routes, &a.listen, std::future::pending()).await
    })
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

/// Child shard processes, stopped (SIGTERM, then SIGKILL) when dropped.
struct Children(Vec<tokio::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &self.0 {
            if let Some(pid) = c.id() {
                // SAFETY: sending a signal to a child we spawned.
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        for c in &mut self.0 {
            while std::time::Instant::now() < deadline {
                if matches!(c.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.start_kill();
        }
    }
}

pub fn serve(a: ServeArgs) -> Result<()> {
    if a.shards == 0 {
        bail!("`--shards` must be at least 1");
    }
    let config = a.route.config()?;
    let file =
        gguf::GgufFile::open(&a.model).with_context(|| format!("opening {}", a.model.display()))?;
    let n_layers = model::LlamaConfig::from_header(file.header())?.n_layers;
    drop(file);
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
            let cfg = shard_config(&a.model, None, &a.limits, "embedded".into(), fresh_token()?);
            let core = tokio::task::spawn_blocking(move || shard::ShardCore::load(cfg)).await??;
            let shards: Vec<Arc<dyn ShardTransport>> = vec![Arc::new(shard::LocalShard::new(core))];
            let routes = vec![tracker::RouteSpec {
                name: "local".into(),
                shards,
            }];
            return run_tracker(config, routes, &a.listen, std::future::pending()).await;
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
        let mut children = Children(Vec::new());
        let mut addrs = Vec::new();
        let mut died = Vec::new();
        for (start, end) in balanced_ranges(n_layers, a.shards) {
            let mut cmd = tokio::process::Command::new(&exe);
            cmd.arg("shard")
                .arg("--model")
                .arg(&a.model)
                .arg("--layers")
                .arg(format!("{start}..{end}"))
                .arg("--listen")
                .arg("127.0.0.1:0")
                .arg("--cluster-token-file")
                .arg(&token_file)
                .args(a.limits.to_args())
                .stdout(Stdio::piped())
                .stdin(Stdio::null());
            // SAFETY: prctl in the child before exec; async-signal-safe.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                    Ok(())
                });
            }
            let mut child = cmd.spawn().context("starting a shard process")?;
            let stdout = child.stdout.take().expect("piped");
            children.0.push(child);
            let mut lines = BufReader::new(stdout).lines();
            let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
                .await
                .map_err(|_| anyhow!("shard {start}..{end} did not start within 120 s"))??
                .ok_or_else(|| anyhow!("shard {start}..{end} exited before it was ready"))?;
            let addr = line
                .strip_prefix("strata shard listening on ")
                .and_then(|r| r.split_whitespace().next())
                .ok_or_else(|| anyhow!("unexpected shard output: {line}"))?
                .to_string();
            eprintln!("strata serve: shard {start}..{end} on {addr}");
            addrs.push(addr);
            // Keep draining its stdout so the child never blocks on a full pipe.
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            died.push(rx);
            tokio::spawn(async move {
                while let Ok(Some(_)) = lines.next_line().await {}
                let _ = tx.send(());
            });
        }
        let shards = connect_all(&addrs, &token)?;
        let routes = vec![tracker::RouteSpec {
            name: "local".into(),
            shards,
        }];
        let result = run_tracker(config, routes, &a.listen, std::future::pending()).await;
        drop(children);
        let _ = std::fs::remove_dir_all(&dir);
        result
    })
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
