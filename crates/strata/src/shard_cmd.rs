//! `strata shard`: loads a layer range (given, or chosen from the registry with `--layers auto`),
//! announces it and serves it until a signal drains it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;

use crate::cluster_cmd::{
    link, listen_addr, loopback, read_file, read_token, runtime, shard_config, shutdown_signal,
    RegistryAccess, ShardLimits,
};
use crate::model_cmd::parse_range;

#[derive(Args)]
pub struct ShardArgs {
    /// Path of the GGUF model, or a known model name (fetched and cached: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma3-270m).
    #[arg(long, value_parser = crate::models::model_path)]
    model: PathBuf,
    /// Layer range `A..B` this shard serves, or `auto`: chosen at start from the registry's
    /// live shards of the same model file storing K and V alike (`--kv-type`; the layers no
    /// shard serves first, then the layers the fewest serve), as many as
    /// `--weights-budget-mib` holds; needs `--registry`.
    #[arg(long)]
    layers: String,
    /// Address to listen on (port 0 picks a free port; the chosen address is printed).
    #[arg(long, default_value = "127.0.0.1:0", value_parser = listen_addr)]
    listen: String,
    /// File holding the shared cluster token (at least 16 characters) every connection must
    /// present.
    #[arg(long)]
    cluster_token_file: PathBuf,
    /// This shard's TLS certificate chain (PEM): with `--tls-key`, the shard serves TLS only.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// CA certificate (PEM) the next shard's certificate must chain to: connections to it
    /// are then TLS.
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    #[command(flatten)]
    limits: ShardLimits,
    #[command(flatten)]
    membership: ShardMembership,
}

/// How a shard joins a registry and leaves.
#[derive(Args, Clone)]
pub struct ShardMembership {
    /// etcd endpoints (`http://host:port`, or `https://` with `--registry-ca`; comma separated):
    /// the shard announces itself there under a lease it keeps alive, and trackers on the same
    /// registry build routes from it.
    #[arg(long)]
    registry: Option<String>,
    #[command(flatten)]
    registry_access: RegistryAccess,
    /// Key prefix of this cluster in the registry (several clusters may share one etcd).
    #[arg(long, default_value = "/strata/")]
    registry_prefix: String,
    /// Seconds the shard's lease lives without a keep-alive: how long a lost shard stays
    /// announced.
    #[arg(long, default_value_t = 3)]
    registry_ttl_s: u64,
    /// The address trackers reach this shard on, as announced (default: the listen address;
    /// needed when listening on 0.0.0.0).
    #[arg(long)]
    advertise: Option<String>,
    /// On SIGTERM or Ctrl-C the shard drains: it leaves the registry, says so to trackers
    /// (which give it no new sessions and move its sessions to other routes where they can),
    /// and exits once it holds no session or after this many milliseconds.
    #[arg(long, default_value_t = 30_000)]
    drain_timeout_ms: u64,
    /// With `--layers auto`: seconds between the shard's checks of whether its moving to other
    /// layers would give the model more than a quarter more complete routes (checked too a
    /// few seconds after a member joins, leaves or starts draining); when it would, the shard drains
    /// as on SIGTERM (its sessions move) and starts again, placing itself. 0: it never moves.
    /// Default 60; refused with a range given by hand, which never moves.
    #[arg(long)]
    rebalance_period_s: Option<u64>,
}

/// How long a shard lets the membership settle after a change before it judges a move: a
/// shard restarting or a burst of joins is not a swarm to rebalance for.
const REBALANCE_SETTLE: Duration = Duration::from_secs(3);

pub fn shard(a: ShardArgs) -> Result<()> {
    let token = read_token(&a.cluster_token_file)?;
    let layers = match a.layers.as_str() {
        "auto" if a.membership.registry.is_none() => {
            bail!("--layers auto chooses a range from the registry's live shards: give --registry")
        }
        "auto" => None,
        given => Some(parse_range(given)?),
    };
    let rebalance_period_s = match (layers, a.membership.rebalance_period_s) {
        (Some(_), Some(_)) => {
            bail!("--rebalance-period-s moves a shard that placed itself: it needs --layers auto")
        }
        (_, period) => period.unwrap_or(60),
    };
    let link = link(token, a.tls_ca.as_deref())?;
    let tls_identity = match (&a.tls_cert, &a.tls_key) {
        (Some(c), Some(k)) => Some(shard::TlsIdentity {
            cert_pem: read_file(c, "the shard certificate")?,
            key_pem: read_file(k, "the shard key")?,
        }),
        _ => None,
    };
    let rt = runtime(1)?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&a.listen)
            .await
            .with_context(|| format!("binding {}", a.listen))?;
        let local = listener.local_addr()?;
        if tls_identity.is_none() && !loopback(&local) {
            eprintln!(
                "strata shard: warning: listening on {local} without TLS: the cluster token and every activation cross the network in clear (give --tls-cert and --tls-key)"
            );
        }
        let addr = match &a.membership.advertise {
            Some(adv) => adv.clone(),
            None if local.ip().is_unspecified() && a.membership.registry.is_some() => bail!(
                "listening on {local}: give `--advertise HOST:PORT`, the address trackers reach this shard on"
            ),
            None => local.to_string(),
        };
        let registry = a
            .membership
            .registry_access
            .connect(a.membership.registry.as_ref())?;
        let (layers, claim, sizes) = match (layers, &registry) {
            (Some(given), _) => (given, None, None),
            (None, Some(connect)) => {
                let prefix = &a.membership.registry_prefix;
                let (range, claim, sizes) =
                    place_itself(&a.model, &a.limits, connect, prefix, &addr).await?;
                (range, Some(claim), Some(sizes))
            }
            (None, None) => unreachable!("--layers auto without --registry was refused above"),
        };
        // A shard that placed itself and rebalances says its budget in its record: it may
        // move (others weigh its move as it does theirs).
        let movable_budget = match sizes {
            Some(_) if rebalance_period_s > 0 => {
                (a.limits.weights_budget_mib() as u64) << 20
            }
            _ => 0,
        };
        let config = shard::ShardConfig {
            tls_identity,
            ..shard_config(&a.model, Some(layers), &a.limits, addr.clone(), link)
        };
        let loaded = tokio::task::spawn_blocking(move || shard::ShardCore::load(config))
            .await
            .map_err(anyhow::Error::from)
            .and_then(|r| r.map_err(anyhow::Error::from));
        let core = match loaded {
            Ok(core) => core,
            Err(e) => {
                // A range it could not load is not kept from other shards for the claim's lease.
                if let Some(claim) = claim {
                    claim.release().await;
                }
                return Err(e);
            }
        };
        let announcer = match &registry {
            Some(connect) => Some(announce(&core, connect, &a.membership, movable_budget)?),
            None => None,
        };
        if let (Some(claim), Some(announcer)) = (claim, &announcer) {
            // A shard placing itself is ready once its range is in the registry; its claim
            // then says nothing more.
            let mut registered = announcer.registered();
            let announced = tokio::time::timeout(
                Duration::from_secs(30),
                registered.wait_for(|r| *r),
            )
            .await;
            if !matches!(announced, Ok(Ok(_))) {
                eprintln!("strata shard {addr}: warning: not announced in the registry within 30 s");
            }
            claim.release().await;
        }
        eprintln!("strata shard {addr}: {}", core.context);
        println!(
            "strata shard listening on {addr} layers {}..{}",
            core.info.layer_start, core.info.layer_end
        );
        std::io::stdout().flush()?;
        let (move_tx, move_rx) = tokio::sync::oneshot::channel();
        if let (Some(connect), Some(sizes)) = (&registry, sizes) {
            if rebalance_period_s > 0 {
                tokio::spawn(rebalance(
                    connect.clone(),
                    a.membership.registry_prefix.clone(),
                    addr.clone(),
                    sizes,
                    Duration::from_secs(rebalance_period_s),
                    move_tx,
                ));
            }
        }
        let moving = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let drain = drain(
            Arc::clone(&core),
            announcer,
            Duration::from_millis(a.membership.drain_timeout_ms),
            move_rx,
            Arc::clone(&moving),
        );
        shard::serve(core, listener, drain).await?;
        if moving.load(std::sync::atomic::Ordering::Acquire) {
            // Drained and out of the registry: the same command again places the shard anew.
            // (The running program's own file, even if its path was replaced since.)
            use std::os::unix::process::CommandExt;
            let e = std::process::Command::new("/proc/self/exe")
                .arg0(std::env::args_os().next().unwrap_or_else(|| "strata".into()))
                .args(std::env::args_os().skip(1))
                .exec();
            bail!("starting again on other layers: {e}");
        }
        Ok(())
    })
}

/// Judges, every `period` and [`REBALANCE_SETTLE`] after the membership changes who serves
/// which layers (a member joins or leaves, or drains), whether the shard at `me` should move to other layers ([`registry::placement::should_move`],
/// sizes of ranges from `sizes`); the first time it should, says where on `moving` and ends.
async fn rebalance(
    connect: registry::Connect,
    prefix: String,
    me: String,
    sizes: model::WeightSizes,
    period: Duration,
    mut moving: tokio::sync::oneshot::Sender<std::ops::Range<usize>>,
) {
    let mut members = match registry::follow(&connect, &prefix) {
        Ok(m) => m,
        Err(e) => {
            eprintln!(
                "strata shard {me}: warning: not following the registry, so never moving: {e}"
            );
            return;
        }
    };
    // Who serves which layers, as last judged: records change with every session's load
    // figures, which no move depends on, so only a change of this is judged again at once.
    let shape = |m: &registry::Members| -> Vec<(String, String, u32, u32, bool)> {
        m.shards
            .values()
            .map(|r| {
                (
                    r.address.clone(),
                    r.instance.clone(),
                    r.layer_start,
                    r.layer_end,
                    r.draining,
                )
            })
            .collect()
    };
    let mut judged_shape = shape(&members.borrow());
    loop {
        tokio::select! {
            changed = members.changed() => {
                if changed.is_err() {
                    return;
                }
                if shape(&members.borrow_and_update()) == judged_shape {
                    continue;
                }
                tokio::time::sleep(REBALANCE_SETTLE).await;
            }
            _ = tokio::time::sleep(period) => {}
            _ = moving.closed() => return,
        }
        judged_shape = {
            let m = members.borrow_and_update();
            if !m.connected {
                continue;
            }
            shape(&m)
        };
        // The records and the claims of shards placing themselves (a move or a join under way),
        // read afresh; judged off the async worker, which serves the shard's streams.
        let (records, claims) = match registry::placement::read_live(&connect, &prefix).await {
            Ok(live) => live,
            Err(_) => continue,
        };
        let (me2, sizes2) = (me.clone(), sizes.clone());
        let judged = tokio::task::spawn_blocking(move || {
            registry::placement::should_move(&records, &claims, &me2, |s, e| {
                // A record may name another layer count than this file's: no such range fits.
                if e <= sizes2.layers.len() {
                    sizes2.range(s, e)
                } else {
                    u64::MAX
                }
            })
        })
        .await;
        if let Ok(Some(to)) = judged {
            eprintln!(
                "strata shard {me}: moving to layers {}..{}: the model gains complete routes",
                to.start, to.end
            );
            let _ = moving.send(to);
            return;
        }
    }
}

/// `--layers auto`: the range this shard takes, from the live records of its model file in the
/// registry and the claims of shards placing themselves at the same time
/// (`registry::placement`), and what each range costs once loaded (read from the file's
/// header), within the weights budget. The range stays claimed until the claim is released
/// (once the shard is announced) or its lease runs out.
async fn place_itself(
    model: &Path,
    limits: &ShardLimits,
    connect: &registry::Connect,
    prefix: &str,
    address: &str,
) -> Result<(
    (usize, usize),
    registry::placement::Claim,
    model::WeightSizes,
)> {
    let path = model.to_path_buf();
    let (digest, sizes) = tokio::task::spawn_blocking(move || -> Result<_> {
        let digest = shard::file_digest(&path)?;
        let sizes = model::WeightSizes::of(&gguf::GgufFile::open(&path)?)?;
        Ok((digest, sizes))
    })
    .await??;
    let n_layers = sizes.layers.len();
    let me = registry::ShardRecord::placing(
        address,
        &std::process::id().to_string(),
        &model.display().to_string(),
        &digest,
        0..n_layers as u32,
        n_layers as u32,
        &limits.arithmetic(),
    );
    let budget = (limits.weights_budget_mib() as u64) << 20;
    let placed = registry::placement::place_and_claim(
        connect,
        prefix,
        &me,
        Duration::from_secs(120),
        Duration::from_millis(500),
        |s, e| sizes.range(s, e) <= budget,
    )
    .await
    .map_err(|e| anyhow!("--layers auto: {e}"))?;
    let Some((range, cover, claim, apart)) = placed else {
        let smallest = (0..n_layers)
            .map(|i| sizes.range(i, i + 1))
            .min()
            .unwrap_or(0);
        bail!(
            "--layers auto: a weights budget of {} MiB holds no layer of {} (the smallest range of one layer needs {:.1} MiB)",
            limits.weights_budget_mib(),
            model.display(),
            smallest as f64 / (1u64 << 20) as f64
        );
    };
    // Shards of this model computing otherwise never chain with this one, and a tracker
    // serves a model under one KV type and contract (a swarm changing its type passes here).
    if apart > 0 {
        eprintln!(
            "strata shard: warning: {apart} live shards of this model store K and V as another type or compute under another numeric contract: this shard never chains with them, and a tracker serving their routes refuses routes of this one's kind until theirs are gone"
        );
    }
    let served = cover.iter().filter(|&&c| c > 0).count();
    eprintln!(
        "strata shard: --layers auto: layers {}..{} of {n_layers} ({:.1} MiB of a {} MiB weights budget; {served} of {n_layers} layers were served or claimed by other shards of this model storing K and V alike)",
        range.start,
        range.end,
        sizes.range(range.start, range.end) as f64 / (1u64 << 20) as f64,
        limits.weights_budget_mib(),
    );
    Ok(((range.start, range.end), claim, sizes))
}

/// The shard's record in the registry, from what it loaded and its live counters.
fn shard_record(
    core: &shard::ShardCore,
    instance: &str,
    movable_budget: u64,
) -> registry::ShardRecord {
    let info = &core.info;
    let stats = core.stats();
    let recipe = info.recipe.as_ref().map_or_else(String::new, |r| {
        format!(
            "block {} kv {} ctx {} contract {}",
            r.block_size, r.kv_dtype, r.n_ctx, r.numeric_contract
        )
    });
    let budgets = info.budgets.unwrap_or_default();
    registry::ShardRecord {
        address: info.listen.clone(),
        instance: instance.to_string(),
        model: info.model_name.clone(),
        digest: info.model_digest.clone(),
        layer_start: info.layer_start,
        layer_end: info.layer_end,
        n_layers: info.n_layers,
        recipe,
        kv_budget_bytes: stats.kv_bytes_budget,
        kv_free_bytes: stats.kv_bytes_budget.saturating_sub(stats.kv_bytes_in_use),
        max_sessions: budgets.max_sessions,
        sessions: stats.sessions,
        draining: stats.draining,
        weights_budget_bytes: movable_budget,
        token_step_micros: stats.token_step_micros,
    }
}

/// Announces the shard in the registry and keeps its record's load figures current.
fn announce(
    core: &Arc<shard::ShardCore>,
    endpoints: &registry::Connect,
    m: &ShardMembership,
    movable_budget: u64,
) -> Result<registry::Announcer> {
    // A restart on the same address is a new member: trackers rebuild its routes.
    let instance = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let (tx, rx) = tokio::sync::watch::channel(shard_record(core, &instance, movable_budget));
    let announcer = registry::announce(
        endpoints,
        &m.registry_prefix,
        Duration::from_secs(m.registry_ttl_s.max(1)),
        rx,
    )
    .map_err(|e| anyhow!("{e}"))?;
    let weak = Arc::downgrade(core);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let Some(core) = weak.upgrade() else { return };
            let now = shard_record(&core, &instance, movable_budget);
            tx.send_if_modified(|r| {
                let worth = r.worth_announcing(&now);
                if worth {
                    *r = now;
                }
                worth
            });
        }
    });
    Ok(announcer)
}

/// Resolves when the shard may stop: after a signal, or a move decided on `move_to`, once it
/// has drained (no session left) or `timeout` after. A stop leaves the registry at once; a move
/// stays in it, marked draining, until its sessions are gone (other shards see a move under
/// way and wait for it), then leaves and sets `moving`, unless a signal came meanwhile.
async fn drain(
    core: Arc<shard::ShardCore>,
    announcer: Option<registry::Announcer>,
    timeout: Duration,
    move_to: tokio::sync::oneshot::Receiver<std::ops::Range<usize>>,
    moving: Arc<std::sync::atomic::AtomicBool>,
) {
    let move_to = async {
        if move_to.await.is_err() {
            // No rebalancing: only a signal stops the shard.
            std::future::pending::<()>().await;
        }
    };
    let is_move = tokio::select! {
        _ = shutdown_signal() => false,
        _ = move_to => true,
    };
    let t0 = std::time::Instant::now();
    core.drain();
    let mut announcer = announcer;
    if !is_move {
        if let Some(a) = announcer.take() {
            a.withdraw(Duration::from_secs(2)).await;
        }
    }
    eprintln!(
        "strata shard: draining ({} sessions, at most {} ms)",
        core.stats().sessions,
        timeout.as_millis()
    );
    let drained = async {
        while core.stats().sessions > 0 && t0.elapsed() < timeout {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    // A second signal (the first, during a move) stops it at once.
    let signalled = tokio::select! {
        _ = drained => false,
        _ = shutdown_signal() => true,
    };
    if let Some(a) = announcer {
        a.withdraw(Duration::from_secs(2)).await;
    }
    if is_move && !signalled {
        moving.store(true, std::sync::atomic::Ordering::Release);
    }
    eprintln!(
        "strata shard: drained in {} ms, {} sessions left",
        t0.elapsed().as_millis(),
        core.stats().sessions
    );
}
