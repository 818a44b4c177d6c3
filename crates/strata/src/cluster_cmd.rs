//! `strata tracker`, and the flags and helpers it shares with `strata shard` and `strata serve`.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use proto::v1::SeamDtype;
use proto::ShardTransport;

/// TLS to etcd (`https://` registry endpoints) and its users, shard and tracker alike.
#[derive(Args, Clone)]
pub struct RegistryAccess {
    /// PEM file of the CA that signed etcd's certificates: every registry endpoint is then
    /// `https://` (and none may be).
    #[arg(long, value_name = "FILE")]
    registry_ca: Option<PathBuf>,
    /// PEM certificate this process presents to etcd (for an etcd run with
    /// `--client-cert-auth`); with `--registry-key`.
    #[arg(long, value_name = "FILE", requires = "registry_key")]
    registry_cert: Option<PathBuf>,
    /// PEM private key of `--registry-cert`.
    #[arg(long, value_name = "FILE", requires = "registry_cert")]
    registry_key: Option<PathBuf>,
    /// etcd user, for an etcd with authentication on (its password from
    /// `--registry-password-file`).
    #[arg(long, requires = "registry_password_file")]
    registry_user: Option<String>,
    /// File holding the password of `--registry-user` (one line; never on the command line).
    #[arg(long, value_name = "FILE", requires = "registry_user")]
    registry_password_file: Option<PathBuf>,
}

impl RegistryAccess {
    /// How to reach the etcd at `endpoints` (`None`: no registry, and then no TLS flag may be
    /// given either).
    pub(crate) fn connect(&self, endpoints: Option<&String>) -> Result<Option<registry::Connect>> {
        let read = |p: &PathBuf, what: &str| {
            std::fs::read(p).with_context(|| format!("reading {what} {}", p.display()))
        };
        let Some(endpoints) = endpoints else {
            if self.registry_ca.is_some()
                || self.registry_cert.is_some()
                || self.registry_user.is_some()
            {
                bail!("`--registry-ca`, `--registry-cert` and `--registry-user` need `--registry`");
            }
            return Ok(None);
        };
        let identity = match (&self.registry_cert, &self.registry_key) {
            (Some(c), Some(k)) => Some((read(c, "--registry-cert")?, read(k, "--registry-key")?)),
            _ => None,
        };
        let user = match (&self.registry_user, &self.registry_password_file) {
            (Some(u), Some(f)) => {
                let password = String::from_utf8(read(f, "--registry-password-file")?)
                    .context("--registry-password-file is not UTF-8")?;
                Some((
                    u.clone(),
                    password.trim_end_matches(['\r', '\n']).to_string(),
                ))
            }
            _ => None,
        };
        Ok(Some(registry::Connect {
            endpoints: endpoints.clone(),
            user,
            ca_pem: self
                .registry_ca
                .as_ref()
                .map(|p| read(p, "--registry-ca"))
                .transpose()?,
            identity,
        }))
    }
}

/// Per-shard limits shared by `shard` and `serve`.
#[derive(Args, Clone)]
pub struct ShardLimits {
    /// Kernel threads (default: all cores; an idle shard's threads sleep).
    #[arg(long)]
    threads: Option<usize>,
    /// Force an instruction set: scalar, avx2 or avx512-vnni (default: the best this CPU
    /// has). Every one gives bitwise the same activations and tokens (one numeric contract,
    /// carried in the cache recipe), so shards on different CPUs chain and replicate.
    #[arg(long, value_parser = model::Isa::from_name)]
    isa: Option<model::Isa>,
    /// How sessions' K and V are stored: f16, or q8_0 (as llama.cpp's `--cache-type-k/-v
    /// q8_0`: 53% of f16's memory, so about 1.9 times the positions in the same KV budget;
    /// prefill about 0.9 times as fast at 4096 tokens). Part of the cache recipe: a route's
    /// shards must agree, and a model's routes must too (`--layers auto` places a shard among
    /// those of its type).
    #[arg(long, default_value = "f16", value_parser = model::KvType::from_name)]
    kv_type: model::KvType,
    /// Most positions one session may hold (default: the model's trained context, cut to
    /// what the KV budget holds for one session; the shard says at start what it chose).
    #[arg(long)]
    ctx: Option<usize>,
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
    /// Sessions the shard holds at once (all route streams together).
    #[arg(long, default_value_t = 256)]
    max_sessions: usize,
    /// Milliseconds a session may sit idle before its KV is forgotten.
    #[arg(long, default_value_t = 600_000)]
    kv_ttl_ms: u64,
    /// Milliseconds a constrained session's grammar may take for one token on the last
    /// shard (beside the forward pass, which bounds it when longer); a session over it ends
    /// with a typed `grammar_budget` error, and no other session waits for it.
    #[arg(long, default_value_t = 200)]
    grammar_budget_ms: u64,
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

    /// What a shard under these limits computes as, for the registry
    /// ([`registry::arithmetic`]): its KV type and this build's numeric contract.
    pub(crate) fn arithmetic(&self) -> String {
        registry::arithmetic(self.kv_type.name(), model::NUMERIC_CONTRACT)
    }

    pub(crate) fn weights_budget_mib(&self) -> usize {
        self.weights_budget_mib
            .unwrap_or_else(|| machine_memory_mib() / 2)
    }

    /// The same limits as `strata shard` flags (for the shards `serve` starts).
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "--kv-budget-mib".to_string(),
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
        if let Some(i) = self.isa {
            v.extend(["--isa".to_string(), i.name().to_string()]);
        }
        v.extend(["--kv-type".to_string(), self.kv_type.name().to_string()]);
        if let Some(c) = self.ctx {
            v.extend(["--ctx".to_string(), c.to_string()]);
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
    /// tracker may front several models; each request goes only to routes holding it.
    #[arg(long = "route")]
    routes: Vec<String>,
    /// Address the OpenAI-compatible API listens on (port 0 picks a free port; the chosen
    /// address is printed).
    #[arg(long, default_value = "127.0.0.1:8080", value_parser = listen_addr)]
    listen: String,
    /// File holding the shared cluster token the shards expect.
    #[arg(long)]
    cluster_token_file: PathBuf,
    /// CA certificate (PEM) the shards' certificates must chain to: shard links are then TLS.
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// Drafts come from a `strata drafter` at HOST:PORT, a draft model in a process of its
    /// own (reached like the shards: the cluster token, TLS with `--tls-ca`), instead of
    /// n-gram lookup. Its vocabulary is read at start (waiting up to `--startup-wait-ms`); a
    /// route of a model of another vocabulary decodes without drafts and logs why. While the
    /// drafter is unreachable every session decodes without drafts. The draft model's own
    /// settings (threads, KV, drafting ahead) are the drafter's flags.
    #[arg(
        long,
        group = "draft_source",
        conflicts_with_all = ["draft_threads", "draft_kv_mib", "draft_ahead"]
    )]
    drafter: Option<String>,
    /// etcd endpoints (`http://host:port`, or `https://` with `--registry-ca`; comma separated):
    /// routes are built from the shards announced there, as they join and leave (besides any
    /// `--shards` or `--route`).
    #[arg(long)]
    registry: Option<String>,
    #[command(flatten)]
    registry_access: RegistryAccess,
    /// Key prefix of this cluster in the registry.
    #[arg(long, default_value = "/strata/")]
    registry_prefix: String,
    #[command(flatten)]
    route: RouteArgs,
    #[command(flatten)]
    api: ApiArgs,
}

/// A `--listen` value: `HOST:PORT` (a name, an IPv4 address or a bracketed IPv6 one, and a
/// port number), checked when the command line is read, before anything loads; the name is
/// resolved when the address is bound.
pub(crate) fn listen_addr(s: &str) -> Result<String, String> {
    let bad = || format!("`{s}` is not HOST:PORT (for instance 127.0.0.1:8080 or [::1]:0)");
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    port.parse::<u16>().map_err(|_| bad())?;
    let bracketed = host.starts_with('[') && host.ends_with(']') && host.len() > 2;
    let bare_v6 = host.parse::<std::net::Ipv6Addr>().is_ok();
    if host.is_empty()
        || (host.starts_with('[') && !bracketed)
        || (host.contains(':') && !bracketed && !bare_v6)
        || host.contains(char::is_whitespace)
    {
        return Err(bad());
    }
    Ok(s.to_string())
}

/// Route settings shared by `tracker` and `serve`.
#[derive(Args, Clone)]
pub struct RouteArgs {
    /// Activation encoding across seams: f32 (exact), f16 (half the bytes) or q8_0 (blocks of
    /// 32 values as 8-bit integers and an f16 scale: 34 bytes where f32 takes 128).
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
    /// Pipelined prefill, the default: a long prompt's next chunk (`--prefill-chunk`
    /// positions) goes down a route of several shards while its earlier chunks are still on
    /// it, so the first shard computes chunk k + 1 while the next computes chunk k (the same
    /// results: shards take steps in order). Needs a pipeline depth above 1 (a route of
    /// several shards). The flag says what is already so.
    #[arg(long)]
    pipeline_prefill: bool,
    /// Each chunk of a prompt waits for the reply to the one before it (pipelined prefill off).
    #[arg(long, conflicts_with = "pipeline_prefill")]
    no_pipeline_prefill: bool,
    /// How often the tracker probes each shard's health and stats, in milliseconds.
    #[arg(long, default_value_t = 500)]
    health_period_ms: u64,
    /// How long the tracker waits at start for every shard to answer, in milliseconds.
    #[arg(long, default_value_t = 60_000)]
    startup_wait_ms: u64,
    /// Milliseconds a route may stay silent while it holds a step before its silent shard is
    /// declared failed. Shards computing a long step say so at a quarter of this, so it bounds
    /// how long a frozen or lost shard goes unnoticed, never how long a step may take.
    #[arg(long, default_value_t = 2000)]
    liveness_ms: u64,
    /// Milliseconds a session of a failed route may wait for another route of its model
    /// (another `--route` of the same model) to take it; it then goes on there with no error
    /// to its client. Past this, or with no other route, it fails with the route's error. A
    /// new request that finds no route of its model open (failing over, a shard restarting,
    /// a route rejoining) waits as long for one before its typed 503.
    #[arg(long, default_value_t = 3000)]
    failover_wait_ms: u64,
    /// Speculative decoding: `ngram` drafts tokens from each session's own prompt and output
    /// (prompt lookup) and verifies them along the route in the decode step itself, so a
    /// client gets exactly the tokens plain decoding gives, several per trip when its text
    /// repeats (the default); `off` decodes one token a step. A request opts out with
    /// `"speculative": false`; a session held to a grammar (JSON schema, tool calls) never
    /// drafts.
    #[arg(long, default_value = "ngram", value_parser = ["off", "ngram"])]
    speculative: String,
    /// The most tokens drafted for one session in one step (1 to 16).
    #[arg(long, default_value_t = 8)]
    draft_max: usize,
    /// Drafts come from this model (a path, or a known name as for `--model`) instead of
    /// n-gram lookup: a smaller model with the same vocabulary (Qwen2.5-Coder-0.5B for the
    /// 1.5B), run in this process on threads of its own, drafting each speculating session's
    /// greedy continuation while the route decodes others. The client still gets exactly the
    /// tokens plain decoding gives. A draft model whose vocabulary differs from the served
    /// model's is refused at start (`serve`) or left unused for that model's routes
    /// (`tracker`, which logs why).
    #[arg(long, value_parser = crate::models::model_path, group = "draft_source")]
    draft_model: Option<PathBuf>,
    /// Kernel threads of the draft model.
    #[arg(long, default_value_t = 2, requires = "draft_model")]
    draft_threads: usize,
    /// MiB of draft KV for every session together (when it is full, the draft KV of the
    /// sessions that drafted least recently goes; they read their tokens again when they
    /// draft next, decoding without drafts meanwhile).
    #[arg(long, default_value_t = 256, requires = "draft_model")]
    draft_kv_mib: usize,
    /// Most milliseconds a session waits for its draft (or for the draft model to read a new
    /// prompt of up to 512 tokens) before it decodes without one.
    #[arg(long, default_value_t = 500, requires = "draft_source")]
    draft_wait_ms: u64,
    /// Tokens the draft model drafts past each draft it handed out, while the route verifies
    /// it (0 to 16): when the route keeps the whole draft, the next one is ready at once. Meant
    /// for a draft model with cores of its own (on cores it shares with the shards it slows
    /// their verification); with one core each on 2 AVX-512 cores, 8 gained nothing measurable
    /// over 0 (code edits 1.27x against 1.23x of plain, JSON 1.31x against 1.37x).
    #[arg(long, default_value_t = 0, requires = "draft_model")]
    draft_ahead: usize,
    /// Decode steps with more sessions than this draft for none: a batch keeps the weights
    /// busy already (on 2 AVX2 cores, 4 speculating streams decoded at 0.83x of plain, one
    /// at 2.04x; measure before raising it).
    #[arg(long, default_value_t = 1)]
    draft_max_batch: usize,
    /// Whose prompts share cached prefix blocks on the shards: `key` keys them by API key, so
    /// one key's prompts never speed up another's (whose time to first token would tell that
    /// someone else sent the same prompt: a way to guess another tenant's secrets); `global`
    /// shares them across every key, for a deployment with one tenant only.
    #[arg(long, default_value = "key", value_parser = ["key", "global"])]
    prefix_cache_scope: String,
    /// How a new session's route is picked among its model's replica routes: `cache` offers it
    /// first to the route whose shards hold the longest cached prefix of its prompt (as far as
    /// this tracker sent them; an agent's next turn finds its last turn's blocks), unless that
    /// route holds more than --cache-route-slack sessions over the least loaded; other routes
    /// measured over three times slower than the fastest only when the faster refuse; `load`
    /// always to the least loaded, whatever it caches and however fast (sessions spread evenly).
    #[arg(long, default_value = "cache", value_parser = ["cache", "load"])]
    route_by: String,
    /// Sessions the route holding a prompt's cached prefix may hold over the least loaded
    /// route and still be offered the session first (`--route-by cache`).
    #[arg(long, default_value_t = 8)]
    cache_route_slack: usize,
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
}

/// The HTTP API's access and limits, shared by `tracker` and `serve`.
#[derive(Args, Clone)]
pub struct ApiArgs {
    /// SQLite file recording every accepted request's usage per API key (created if absent).
    #[arg(long)]
    ledger: Option<PathBuf>,
    /// API keys with token budgets, one per line: `NAME SECRET BUDGET_TOKENS` (needs --ledger).
    #[arg(long, conflicts_with = "api_key")]
    api_keys: Option<PathBuf>,
    /// The one API key every request must present (`Authorization: Bearer SECRET`), without a
    /// ledger of budgets.
    #[arg(long, hide_env_values = true)]
    api_key: Option<String>,
    /// Keep `/health` and `/metrics` open to anyone although API keys are on (by default they
    /// need a key too).
    #[arg(long)]
    public_metrics: bool,
    /// The sampling temperature of a generation request that gives none (0 to 2; 0 is
    /// greedy). Without it such a request samples at 1, the OpenAI and Anthropic APIs' own
    /// default; a client that cannot set its temperature (an agent CLI) can be made greedy.
    #[arg(long)]
    default_temperature: Option<f64>,
    /// File holding the admin API's bearer token (enables `POST /admin/routes/NAME/evict`).
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// The API's TLS certificate chain (PEM): with `--tls-key`, the API is HTTPS only.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Milliseconds a connection may take to send a request's headers (and stay idle between
    /// requests) before it is closed.
    #[arg(long, default_value_t = 10_000)]
    http_header_timeout_ms: u64,
    /// Milliseconds a request's body may take to arrive (408 after).
    #[arg(long, default_value_t = 30_000)]
    http_body_timeout_ms: u64,
    /// HTTP connections open at once; more are answered 503 `capacity` (default: the process's
    /// descriptor limit less 64).
    #[arg(long)]
    max_connections: Option<usize>,
    /// Largest request body in MiB (413 beyond).
    #[arg(long, default_value_t = 4)]
    max_body_mib: usize,
}

impl RouteArgs {
    fn scheduler(&self) -> Result<engine::SchedulerConfig> {
        if self.max_step_tokens == 0 || self.prefill_chunk == 0 || self.max_active == 0 {
            bail!("`--max-step-tokens`, `--prefill-chunk` and `--max-active` must be at least 1");
        }
        if !(self.key_share > 0.0 && self.key_share <= 1.0) {
            bail!("`--key-share` must be in (0, 1], got {}", self.key_share);
        }
        Ok(engine::SchedulerConfig {
            max_step_tokens: self.max_step_tokens,
            max_prefill_chunk: self.prefill_chunk,
            max_active: self.max_active,
            pipeline_depth: self.pipeline_depth,
            pipelined_prefill: !self.no_pipeline_prefill,
            grading_max_active: self.grading_max_active.min(self.max_active),
            grading_step_tokens: self.grading_step_tokens.max(1),
            agent_guard: Duration::from_millis(self.agent_guard_ms),
            agent_gap: Duration::from_millis(self.agent_gap_ms),
            owner_step_share: self.key_share,
            grading_max_wait: Duration::from_millis(self.grading_max_wait_ms),
            draft: self.draft()?,
        })
    }

    fn draft(&self) -> Result<engine::DraftConfig> {
        self.draft_from(self.draft_model.is_some().then_some("--draft-model"))
    }

    /// How routes draft; `model`: the flag naming a draft model they draft from
    /// (`--draft-model`, or a tracker's `--drafter`).
    fn draft_from(&self, model: Option<&str>) -> Result<engine::DraftConfig> {
        if self.draft_max_batch == 0 {
            bail!(
                "`--draft-max-batch` must be at least 1 (`--speculative off` turns drafting off)"
            );
        }
        if !(1..=shard::MAX_DRAFT).contains(&self.draft_max) {
            bail!(
                "`--draft-max` must be 1 to {}, got {}",
                shard::MAX_DRAFT,
                self.draft_max
            );
        }
        match self.speculative.as_str() {
            "ngram" if model.is_some() => Ok(engine::DraftConfig {
                max_batch: self.draft_max_batch,
                ..engine::DraftConfig::model(
                    self.draft_max,
                    Duration::from_millis(self.draft_wait_ms),
                )
            }),
            "ngram" => Ok(engine::DraftConfig {
                max_batch: self.draft_max_batch,
                ..engine::DraftConfig::ngram(self.draft_max)
            }),
            _ if model.is_some() => {
                bail!(
                    "`{}` drafts for speculation, which `--speculative off` turns off",
                    model.unwrap_or_default()
                )
            }
            _ => Ok(engine::DraftConfig::OFF),
        }
    }

    /// The file of `--draft-model`, when given.
    pub fn draft_model_path(&self) -> Option<&Path> {
        self.draft_model.as_deref()
    }

    /// The draft model of `--draft-model`, loaded, with its thread started.
    fn draft_model(&self) -> Result<Option<Arc<dyn tracker::DraftModel>>> {
        let Some(path) = &self.draft_model else {
            return Ok(None);
        };
        if self.draft_threads == 0 || self.draft_kv_mib == 0 {
            bail!("`--draft-threads` and `--draft-kv-mib` must be at least 1");
        }
        if self.draft_ahead > shard::MAX_DRAFT {
            bail!(
                "`--draft-ahead` must be 0 to {}, got {}",
                shard::MAX_DRAFT,
                self.draft_ahead
            );
        }
        let draft = crate::draft_model::DraftModel::load(
            path,
            self.draft_threads,
            self.draft_kv_mib << 20,
            usize::MAX,
            self.draft_ahead,
        )?;
        Ok(Some(Arc::new(draft)))
    }

    fn seam(&self) -> Result<SeamDtype> {
        match self.seam.as_str() {
            "f32" => Ok(SeamDtype::SeamF32),
            "f16" => Ok(SeamDtype::SeamF16),
            "q8_0" => Ok(SeamDtype::SeamQ80),
            other => bail!("unknown --seam `{other}` (expected f32, f16 or q8_0)"),
        }
    }
}

/// The tracker's whole configuration from its route and API flags.
pub fn tracker_config(route: &RouteArgs, api: &ApiArgs) -> Result<tracker::TrackerConfig> {
    let keys = match &api.api_keys {
        Some(p) => tracker::ledger::parse_keys(
            &std::fs::read_to_string(p)
                .with_context(|| format!("reading API keys from {}", p.display()))?,
        )
        .map_err(|e| anyhow!("{}: {e}", p.display()))?,
        None => Vec::new(),
    };
    let ledger = match &api.ledger {
        Some(p) => Some(Arc::new(
            tracker::ledger::Ledger::open(p, keys).map_err(|e| anyhow!(e))?,
        )),
        None if !keys.is_empty() => bail!("`--api-keys` needs `--ledger` to record usage"),
        None => None,
    };
    if api.api_key.as_ref().is_some_and(|k| k.len() < 16) {
        bail!("`--api-key` must be at least 16 characters");
    }
    if route.liveness_ms < 100 {
        bail!("`--liveness-ms` must be at least 100");
    }
    if let Some(t) = api.default_temperature {
        if !(0.0..=2.0).contains(&t) {
            bail!("`--default-temperature` must be between 0 and 2, not {t}");
        }
    }
    let tls = match (&api.tls_cert, &api.tls_key) {
        (Some(cert), Some(key)) => Some(api_tls(cert, key)?),
        _ => None,
    };
    let http = tracker::HttpConfig {
        header_timeout: Duration::from_millis(api.http_header_timeout_ms.max(1)),
        body_timeout: Duration::from_millis(api.http_body_timeout_ms.max(1)),
        max_connections: api
            .max_connections
            .unwrap_or_else(tracker::default_max_connections)
            .max(1),
        max_body_bytes: api.max_body_mib.max(1) << 20,
        tls,
    };
    let scheduler = route.scheduler()?;
    Ok(tracker::TrackerConfig {
        scheduler,
        draft_model: route.draft_model()?,
        admission: engine::AdmissionConfig {
            queue_slots: [route.agent_queue, route.grading_queue],
            key_share: route.key_share,
            ..engine::AdmissionConfig::default()
        },
        seam: route.seam()?,
        health_period: Duration::from_millis(route.health_period_ms.max(10)),
        startup_wait: Duration::from_millis(route.startup_wait_ms),
        liveness: Duration::from_millis(route.liveness_ms),
        failover_wait: Duration::from_millis(route.failover_wait_ms),
        prefix_scope: match route.prefix_cache_scope.as_str() {
            "key" => tracker::PrefixScope::Key,
            "global" => tracker::PrefixScope::Global,
            other => bail!("`--prefix-cache-scope` must be `key` or `global`, not `{other}`"),
        },
        route_choice: tracker::RouteChoice {
            by_cache: match route.route_by.as_str() {
                "cache" => true,
                "load" => false,
                other => bail!("`--route-by` must be `cache` or `load`, not `{other}`"),
            },
            slack: route.cache_route_slack,
        },
        ledger,
        admin_token: match &api.admin_token_file {
            Some(p) => Some(read_token(p)?),
            None => None,
        },
        api_key: api.api_key.clone(),
        public_metrics: api.public_metrics,
        default_temperature: api.default_temperature,
        http,
        ..tracker::TrackerConfig::default()
    })
}

pub(crate) fn read_file(path: &Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {what} from {}", path.display()))
}

/// The API's TLS configuration from a certificate chain and key in PEM.
fn api_tls(cert: &Path, key: &Path) -> Result<Arc<tokio_rustls::rustls::ServerConfig>> {
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_slice_iter(&read_file(cert, "the API certificate")?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow!("{}: {e}", cert.display()))?;
    if certs.is_empty() {
        bail!("{} holds no certificate", cert.display());
    }
    let key = PrivateKeyDer::from_pem_slice(&read_file(key, "the API key")?)
        .map_err(|e| anyhow!("{}: {e}", key.display()))?;
    let mut config = tokio_rustls::rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("the API certificate and key do not fit together")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// How this process reaches shards: the cluster token, and TLS when a CA is given.
pub fn link(token: String, ca: Option<&Path>) -> Result<proto::Link> {
    Ok(proto::Link {
        token,
        ca_pem: ca
            .map(|p| read_file(p, "the shards' CA certificate"))
            .transpose()?,
    })
}

pub fn read_token(path: &Path) -> Result<String> {
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
/// crosses each shard four times). The tracker keeps two; tokenization runs on blocking
/// threads beside them.
pub fn runtime(workers: usize) -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {}
    }
}

/// gRPC clients for `addrs` over `link`.
pub fn connect_all(addrs: &[String], link: &proto::Link) -> Result<Vec<Arc<dyn ShardTransport>>> {
    addrs
        .iter()
        .map(|addr| proto::connect(addr, link).map(|s| Arc::new(s) as Arc<dyn ShardTransport>))
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

pub fn shard_config(
    model: &Path,
    layers: Option<(usize, usize)>,
    limits: &ShardLimits,
    label: String,
    link: proto::Link,
) -> shard::ShardConfig {
    shard::ShardConfig {
        model_path: model.to_path_buf(),
        layers,
        n_threads: limits.threads(),
        isa: limits.isa,
        kv_type: limits.kv_type,
        n_ctx: limits.ctx.unwrap_or(0),
        kv_budget_bytes: limits.kv_budget_mib() << 20,
        kv_ttl: Duration::from_millis(limits.kv_ttl_ms),
        max_sessions: limits.max_sessions,
        weights_budget_bytes: limits.weights_budget_mib() << 20,
        scratch_budget_bytes: limits.scratch_budget_mib << 20,
        inflight_budget_bytes: limits.inflight_budget_mib << 20,
        pinned: limits.pin,
        prefix_cache: !limits.no_prefix_cache,
        label,
        link,
        tls_identity: None,
        grammar_budget: Duration::from_millis(limits.grammar_budget_ms.clamp(1, 3_600_000)),
    }
}

/// Whether `addr` can only be reached from this host.
pub(crate) fn loopback(addr: &SocketAddr) -> bool {
    addr.ip().is_loopback()
}

/// Starts the tracker on `routes` and serves the API on `listen` until a signal or
/// `extra_shutdown`.
pub async fn run_tracker(
    config: tracker::TrackerConfig,
    routes: Vec<tracker::RouteSpec>,
    listen: &str,
    extra_shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    on_start: impl FnOnce(&tracker::Tracker),
) -> Result<()> {
    let keys_on = config.api_key.is_some() || config.ledger.as_ref().is_some_and(|l| l.has_keys());
    let https = config.http.tls.is_some();
    let t = tracker::Tracker::start(config, routes)
        .await
        .map_err(|e| anyhow!("the tracker refuses to start: {e}"))?;
    on_start(&t);
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let addr = listener.local_addr()?;
    if !loopback(&addr) && !keys_on {
        eprintln!(
            "strata tracker: warning: the API on {addr} is open to anyone who can reach it: give --api-key or --api-keys"
        );
    }
    if !loopback(&addr) && !https {
        eprintln!(
            "strata tracker: warning: the API on {addr} is plain HTTP: keys and prompts cross the network in clear (give --tls-cert and --tls-key)"
        );
    }
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
    let scheme = if https { "https" } else { "http" };
    println!(
        "strata tracker listening on {scheme}://{addr} {}",
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
    let link = link(token, a.tls_ca.as_deref())?;
    let mut config = tracker::TrackerConfig {
        registry: a
            .registry_access
            .connect(a.registry.as_ref())?
            .map(|connect| tracker::RegistryConfig {
                connect,
                prefix: a.registry_prefix.clone(),
                link: link.clone(),
            }),
        ..tracker_config(&a.route, &a.api)?
    };
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
    if named.is_empty() && a.registry.is_none() {
        bail!("give the shards of at least one route (`--shards A,B` or `--route NAME=A,B`) or a registry to build routes from (`--registry http://HOST:2379`)");
    }
    for (name, addrs) in &named {
        if let Some(twice) = addrs
            .iter()
            .enumerate()
            .find_map(|(i, a)| addrs[..i].contains(a).then_some(a))
        {
            bail!("route `{name}` names shard {twice} twice: a route passes each shard once");
        }
    }
    if a.drafter.is_some() {
        config.scheduler.draft = a.route.draft_from(Some("--drafter"))?;
    }
    let rt = runtime(2)?;
    rt.block_on(async {
        if let Some(address) = &a.drafter {
            let drafter =
                crate::draft_remote::RemoteDraft::connect(address, &link, config.startup_wait)
                    .await?;
            config.draft_model = Some(Arc::new(drafter));
        }
        let routes = named
            .into_iter()
            .map(|(name, addrs)| {
                Ok(tracker::RouteSpec {
                    name,
                    shards: connect_all(&addrs, &link)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        run_tracker(config, routes, &a.listen, std::future::pending(), |_| {}).await
    })
}

#[cfg(test)]
mod tests {
    use super::listen_addr;

    /// `--listen` is checked as the command line is read: `HOST:PORT`, nothing else.
    #[test]
    fn a_listen_address_is_host_and_port() {
        for ok in [
            "127.0.0.1:0",
            "0.0.0.0:8080",
            "localhost:9000",
            "[::1]:0",
            "[::]:443",
            ":::8080",
            "::1:80",
        ] {
            assert_eq!(listen_addr(ok).as_deref(), Ok(ok));
        }
        for bad in [
            "nonsense",
            "5",
            ":80",
            "127.0.0.1:",
            "127.0.0.1:99999",
            "1:2:80",
            "a b:80",
            "[]:80",
        ] {
            let e = listen_addr(bad).unwrap_err();
            assert!(e.contains("is not HOST:PORT"), "{bad}: {e}");
        }
    }
}
