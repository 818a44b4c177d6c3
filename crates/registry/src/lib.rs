//! Membership on a real registry (etcd v3). A shard announces itself ([`announce`]) under a
//! key `{prefix}shards/{address}` bound to a lease it keeps alive; the value is its
//! [`ShardRecord`] (address, model digest, layer range, recipe, budgets, free KV, load). A
//! tracker follows the prefix ([`follow`]): a snapshot, then a watch from the snapshot's
//! revision, so it sees every join and leave within a lease's TTL.
//!
//! Faults never tear anything down: an announcer that loses etcd or its lease grants a new
//! lease and announces again when etcd answers, without restarting its process; a follower
//! that loses etcd keeps the last membership it saw (frozen, marked `connected: false`) and
//! replaces it with a fresh snapshot when etcd is back.
//!
//! The registry is advisory: a tracker connects to an announced shard and validates what it
//! says about itself (digest, range, recipe) before any route uses it, so a wrong or hostile
//! entry costs at most a refused connection.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

pub mod placement;

#[allow(clippy::all, missing_docs)]
mod etcd {
    tonic::include_proto!("etcdserverpb");
}

use etcd::auth_client::AuthClient;
use etcd::kv_client::KvClient;
use etcd::lease_client::LeaseClient;
use etcd::watch_client::WatchClient;

/// How long one unary call to etcd may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// The longest value read from the registry; longer ones are ignored.
const MAX_RECORD_BYTES: usize = 64 << 10;
/// The most entries a snapshot reads (a registry with more is misused).
const MAX_MEMBERS: usize = 10_000;
/// Entries per range request of a snapshot.
const PAGE: i64 = 64;
/// The largest message read from etcd: a snapshot page (64 entries, each at most what etcd
/// stores, 1.5 MiB by default) or a watch response.
const MAX_MESSAGE_BYTES: usize = 128 << 20;

/// What a shard says about itself in the registry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRecord {
    /// Where trackers reach it (`host:port`).
    pub address: String,
    /// Differs on every start of a shard process: a restart on the same address is a new
    /// member.
    pub instance: String,
    pub model: String,
    pub digest: String,
    pub layer_start: u32,
    pub layer_end: u32,
    pub n_layers: u32,
    /// The cache recipe, as `block 16 kv f16 ctx 4096 contract 1` (trackers validate it
    /// against the shard itself; [`ShardRecord::arithmetic`] groups shards by it).
    pub recipe: String,
    pub kv_budget_bytes: u64,
    pub kv_free_bytes: u64,
    pub max_sessions: u32,
    pub sessions: u64,
    /// It is going away: no new sessions.
    pub draining: bool,
    /// The weights budget of a shard that placed itself (`--layers auto`), which may move to
    /// other layers when the swarm gains by it ([`placement::should_move`]); 0 for a range
    /// given by hand, which never moves.
    #[serde(default)]
    pub weights_budget_bytes: u64,
    /// The shard's compute time per token on a single stream, as it measured it (the least of
    /// its recent steps of one position of one session); 0 before it has one. `strata plan`
    /// predicts a route's time per token from it.
    #[serde(default)]
    pub token_step_micros: u64,
}

/// The words of a recipe that decide what a route computes ([`ShardRecord::arithmetic`]): how K
/// and V are stored (`f16`, `q8_0`) and the numeric contract.
pub fn arithmetic(kv_dtype: &str, contract: u32) -> String {
    format!("kv {kv_dtype} contract {contract}")
}

/// The most layers a record may claim (no model has nearly this many).
pub const MAX_LAYERS: u32 = 4096;

impl ShardRecord {
    /// A record of a shard not serving yet (no budget, no sessions) of the model file `digest`
    /// names, covering `layers`, that will compute as `arithmetic` says ([`arithmetic`]; its
    /// recipe): what a shard placing itself claims, or a planned shard.
    pub fn placing(
        address: &str,
        instance: &str,
        model: &str,
        digest: &str,
        layers: std::ops::Range<u32>,
        n_layers: u32,
        arithmetic: &str,
    ) -> ShardRecord {
        ShardRecord {
            address: address.to_string(),
            instance: instance.to_string(),
            model: model.to_string(),
            digest: digest.to_string(),
            layer_start: layers.start,
            layer_end: layers.end,
            n_layers,
            recipe: arithmetic.to_string(),
            kv_budget_bytes: 0,
            kv_free_bytes: 0,
            max_sessions: 0,
            sessions: 0,
            draining: false,
            weights_budget_bytes: 0,
            token_step_micros: 0,
        }
    }

    /// A layer range that can exist: non-empty, inside a model of at most [`MAX_LAYERS`].
    pub fn plausible(&self) -> bool {
        self.n_layers > 0
            && self.n_layers <= MAX_LAYERS
            && self.layer_start < self.layer_end
            && self.layer_end <= self.n_layers
            && !self.address.is_empty()
    }
}

impl ShardRecord {
    /// Whether `other` is a shard of the same swarm: the same model file and layer count, and
    /// the same [`ShardRecord::arithmetic`], so that the two may serve one route. Placement
    /// (`--layers auto`, moves, `strata plan`) counts only such shards. A record that names no
    /// arithmetic (the claim of a shard from before claims carried one) counts with every
    /// swarm of its model, so shards of two versions started together still take different
    /// layers.
    pub fn same_swarm(&self, other: &ShardRecord) -> bool {
        let (a, b) = (self.arithmetic(), other.arithmetic());
        self.digest == other.digest
            && self.n_layers == other.n_layers
            && (a == b || a.is_empty() || b.is_empty())
    }

    /// The words of its recipe that decide what a route computes: how K and V are stored and
    /// the numeric contract (`kv q8_0 contract 1`, as [`arithmetic`] writes them). Shards that
    /// differ in them never chain, so routes are built among shards that agree (a tracker
    /// still checks the shards themselves).
    pub fn arithmetic(&self) -> String {
        let words: Vec<&str> = self.recipe.split_whitespace().collect();
        words
            .windows(2)
            .filter(|w| w[0] == "kv" || w[0] == "contract")
            .map(|w| w.join(" "))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Whether `next` says something new enough to write to etcd: anything but the load
    /// figures, the number of sessions, free KV moved by a sixteenth of the budget, or the
    /// time per token moved by an eighth (or measured for the first time). (Every write is a
    /// revision etcd keeps until compaction; figures that flicker are not worth one.)
    pub fn worth_announcing(&self, next: &ShardRecord) -> bool {
        let load = |r: &ShardRecord| ShardRecord {
            kv_free_bytes: 0,
            sessions: 0,
            token_step_micros: 0,
            ..r.clone()
        };
        let kv_step = (self.kv_budget_bytes / 16).max(1);
        let (was, now) = (self.token_step_micros, next.token_step_micros);
        load(self) != load(next)
            || self.sessions != next.sessions
            || self.kv_free_bytes.abs_diff(next.kv_free_bytes) >= kv_step
            || (was == 0) != (now == 0)
            || was.abs_diff(now).saturating_mul(8) > was
    }
}

/// The shards a follower sees.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Members {
    /// By registry key.
    pub shards: BTreeMap<String, ShardRecord>,
    /// Whether the follower's watch is live; `false` means the membership is frozen at what
    /// was last seen.
    pub connected: bool,
    /// The store revision the membership reflects.
    pub revision: i64,
    /// Entries read under the prefix that are not records, by reason (`too_long`,
    /// `malformed`, `impossible_range`, `wrong_key`), counted each time one is read.
    pub rejected: BTreeMap<&'static str, u64>,
}

/// An etcd error, said for logs and operators.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(pub String);

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl From<tonic::Status> for Error {
    fn from(s: tonic::Status) -> Self {
        Error(format!("etcd: {}", s.message()))
    }
}

/// How to reach etcd: its endpoints, one or several, comma separated (`http://host:port`,
/// `host:port`, or `https://host:port` with `ca_pem`), and for TLS the CA that signed etcd's
/// certificates and, for an etcd that asks clients for one (`--client-cert-auth`), this
/// process's certificate and key; for an etcd with authentication on, a user and password.
#[derive(Clone, Default)]
pub struct Connect {
    pub endpoints: String,
    pub ca_pem: Option<Vec<u8>>,
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    pub user: Option<(String, String)>,
}

impl std::fmt::Debug for Connect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connect")
            .field("endpoints", &self.endpoints)
            .field("tls", &self.ca_pem.is_some())
            .field("client_certificate", &self.identity.is_some())
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish()
    }
}

/// The token of an etcd session with authentication on, sent with every request.
#[derive(Clone, Default)]
struct Token(std::sync::Arc<std::sync::RwLock<Option<tonic::metadata::AsciiMetadataValue>>>);

impl tonic::service::Interceptor for Token {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(t) = self.0.read().unwrap_or_else(|e| e.into_inner()).clone() {
            req.metadata_mut().insert("token", t);
        }
        Ok(req)
    }
}

type Svc = InterceptedService<Channel, Token>;

/// A connection to etcd: the channel, and for authentication the credentials and the token
/// of the current session.
#[derive(Clone)]
pub struct Etcd {
    raw: Channel,
    token: Token,
    user: Option<(String, String)>,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish_non_exhaustive()
    }
}

impl Etcd {
    fn svc(&self) -> Svc {
        InterceptedService::new(self.raw.clone(), self.token.clone())
    }

    /// With a user: a fresh token (before every session of announcing or following, so an
    /// expired token costs one reconnection, as a lost connection does).
    async fn login(&self) -> Result<(), Error> {
        let Some((name, password)) = &self.user else {
            return Ok(());
        };
        let mut auth = AuthClient::new(self.raw.clone());
        let r = call(auth.authenticate(etcd::AuthenticateRequest {
            name: name.clone(),
            password: password.clone(),
        }))
        .await
        .map_err(|e| Error(format!("authenticating to etcd as `{name}`: {e}")))?;
        let token = r
            .token
            .parse()
            .map_err(|_| Error("etcd answered a token that is not ASCII".into()))?;
        *self.token.0.write().unwrap_or_else(|e| e.into_inner()) = Some(token);
        Ok(())
    }
}

impl Connect {
    /// Endpoints in clear text.
    pub fn plain(endpoints: &str) -> Connect {
        Connect {
            endpoints: endpoints.to_string(),
            ..Connect::default()
        }
    }
}

/// The channel to etcd. Every endpoint is `https://` when a CA is given and none is then: a
/// CA with clear-text endpoints (or TLS endpoints without one) is an error, not a downgrade.
pub fn channel(c: &Connect) -> Result<Etcd, Error> {
    if c.identity.is_some() && c.ca_pem.is_none() {
        return Err(Error(
            "a client certificate for etcd needs the CA of etcd's certificates too".into(),
        ));
    }
    let mut list = Vec::new();
    for e in c
        .endpoints
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
    {
        let tls = e.starts_with("https://");
        let url = match (tls, &c.ca_pem) {
            (true, None) => {
                return Err(Error(format!(
                    "registry endpoint {e}: TLS to etcd needs the CA that signed its certificate \
                     (--registry-ca)"
                )))
            }
            (false, Some(_)) => {
                return Err(Error(format!(
                    "registry endpoint {e}: a CA is given for etcd, so every endpoint must be \
                     https://"
                )))
            }
            (true, _) => e.to_string(),
            (false, None) if e.starts_with("http://") => e.to_string(),
            (false, None) => format!("http://{e}"),
        };
        let mut ep = Endpoint::from_shared(url.clone())
            .map_err(|err| Error(format!("registry endpoint {e}: {err}")))?
            .connect_timeout(Duration::from_secs(2))
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true);
        if let Some(ca) = &c.ca_pem {
            let host = ep.uri().host().unwrap_or_default().trim_matches(['[', ']']);
            let mut config = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(ca))
                .domain_name(host.to_string());
            if let Some((cert, key)) = &c.identity {
                config = config.identity(tonic::transport::Identity::from_pem(cert, key));
            }
            ep = ep
                .tls_config(config)
                .map_err(|err| Error(format!("registry endpoint {e}: TLS: {err}")))?;
        }
        list.push(ep);
    }
    if list.is_empty() {
        return Err(Error("no registry endpoint given".into()));
    }
    let raw = if list.len() == 1 {
        list.remove(0).connect_lazy()
    } else {
        Channel::balance_list(list.into_iter())
    };
    Ok(Etcd {
        raw,
        token: Token::default(),
        user: c.user.clone(),
    })
}

/// The end of the key range holding every key that starts with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff: to the end of the keyspace.
    vec![0]
}

/// The registry key of a shard.
pub fn shard_key(prefix: &str, address: &str) -> String {
    format!("{prefix}shards/{address}")
}

async fn call<T>(
    f: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, Error> {
    match tokio::time::timeout(CALL_TIMEOUT, f).await {
        Ok(r) => Ok(r?.into_inner()),
        Err(_) => Err(Error(format!(
            "etcd did not answer within {} s",
            CALL_TIMEOUT.as_secs()
        ))),
    }
}

/// A record read from the registry, or why the value is not one: too long, not JSON of a
/// record, an impossible layer range, or filed under a key other than its address's.
fn parse_record(prefix: &str, key: &[u8], value: &[u8]) -> Result<ShardRecord, &'static str> {
    if value.len() > MAX_RECORD_BYTES {
        tracing::warn!(
            key = %String::from_utf8_lossy(key),
            bytes = value.len(),
            "registry entry too long; ignored"
        );
        return Err("too_long");
    }
    match serde_json::from_slice::<ShardRecord>(value) {
        Ok(r) if !r.plausible() => {
            tracing::warn!(key = %String::from_utf8_lossy(key), start = r.layer_start, end = r.layer_end, n_layers = r.n_layers, "registry entry with an impossible layer range; ignored");
            Err("impossible_range")
        }
        Ok(r) if shard_key(prefix, &r.address).as_bytes() == key => Ok(r),
        Ok(r) => {
            tracing::warn!(key = %String::from_utf8_lossy(key), address = %r.address, "registry entry filed under another address's key; ignored");
            Err("wrong_key")
        }
        Err(e) => {
            tracing::warn!(key = %String::from_utf8_lossy(key), error = %e, "registry entry is not a shard record; ignored");
            Err("malformed")
        }
    }
}

// ---- announcing -------------------------------------------------------------------------

/// A shard's presence in the registry, kept by a background task.
#[derive(Debug)]
pub struct Announcer {
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
    registered: watch::Receiver<bool>,
}

/// Dropped without [`Announcer::withdraw`], it stops keeping the lease, as a crashed process
/// would: the record goes when the lease runs out.
impl Drop for Announcer {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

impl Announcer {
    /// Whether the record is in the registry under a live lease, as last known.
    pub fn registered(&self) -> watch::Receiver<bool> {
        self.registered.clone()
    }

    /// Takes the record out of the registry (key deleted, lease revoked), waiting at most
    /// `within` for etcd; past that the lease expires on its own.
    pub async fn withdraw(mut self, within: Duration) {
        let _ = self.stop.send(true);
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(within, t).await;
        }
    }
}

/// Announces `record` under its address's key, bound to a lease of `ttl` kept alive, and
/// re-announces each change of it (at most once every two seconds). Lost connections and lost
/// leases are recovered by announcing again with a new lease.
pub fn announce(
    endpoints: &Connect,
    prefix: &str,
    ttl: Duration,
    record: watch::Receiver<ShardRecord>,
) -> Result<Announcer, Error> {
    let channel = channel(endpoints)?;
    let (stop, stop_rx) = watch::channel(false);
    let (registered_tx, registered) = watch::channel(false);
    let prefix = prefix.to_string();
    let task = tokio::spawn(async move {
        let mut record = record;
        let mut stop_rx = stop_rx;
        let mut backoff = Duration::from_millis(200);
        loop {
            let started = Instant::now();
            let ended = keep_announced(
                &channel,
                &prefix,
                ttl,
                &mut record,
                &mut stop_rx,
                &registered_tx,
            )
            .await;
            let _ = registered_tx.send(false);
            let e = match ended {
                Ok(()) => return,
                Err(e) => e,
            };
            // One warning per outage; the retries of the same one are debug.
            if started.elapsed() > Duration::from_secs(10) {
                backoff = Duration::from_millis(200);
            }
            if backoff == Duration::from_millis(200) {
                tracing::warn!(error = %e, "registry: announcing again shortly");
            } else {
                tracing::debug!(error = %e, "registry: announcing again shortly");
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop_rx.changed() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    });
    Ok(Announcer {
        stop,
        task: Some(task),
        registered,
    })
}

/// One lease's life: grant, put, keep alive and update until stopped (`Ok`) or until etcd or
/// the lease is lost (`Err`).
async fn keep_announced(
    channel: &Etcd,
    prefix: &str,
    ttl: Duration,
    record: &mut watch::Receiver<ShardRecord>,
    stop: &mut watch::Receiver<bool>,
    registered: &watch::Sender<bool>,
) -> Result<(), Error> {
    if *stop.borrow() {
        return Ok(());
    }
    channel.login().await?;
    let mut kv = KvClient::new(channel.svc());
    let mut lease = LeaseClient::new(channel.svc());
    let ttl_secs = ttl.as_secs().max(1) as i64;
    let granted = call(lease.lease_grant(etcd::LeaseGrantRequest {
        ttl: ttl_secs,
        id: 0,
    }))
    .await?;
    if !granted.error.is_empty() {
        return Err(Error(format!("etcd refused a lease: {}", granted.error)));
    }
    let id = granted.id;
    let current = record.borrow_and_update().clone();
    let key = shard_key(prefix, &current.address);
    let put = |kv: &mut KvClient<Svc>, value: Vec<u8>| {
        let mut kv = kv.clone();
        let key = key.clone();
        async move {
            call(kv.put(etcd::PutRequest {
                key: key.into_bytes(),
                value,
                lease: id,
            }))
            .await
        }
    };
    let mut written = serde_json::to_vec(&current).expect("a record serializes");
    let put_at = put(&mut kv, written.clone())
        .await?
        .header
        .map_or(0, |h| h.revision);
    // The key is watched from just after that put: a delete, or a put of another value or
    // under another lease (someone else's write), is undone at the next update tick.
    let (_own_key_requests, mut own_key) = watch_key(channel, &key, put_at).await?;
    let _ = registered.send(true);
    tracing::info!(key = %key, lease = id, ttl_secs, "registry: announced");
    // etcd answers the stream's headers with its first reply, and replies only to requests:
    // the first keep-alive goes in before the call is awaited.
    let (tx, rx) = mpsc::channel(4);
    tx.send(etcd::LeaseKeepAliveRequest { id })
        .await
        .map_err(|_| Error("the keep-alive stream closed".into()))?;
    let mut replies = call(lease.lease_keep_alive(ReceiverStream::new(rx))).await?;
    let mut keep = tokio::time::interval((ttl / 3).max(Duration::from_millis(200)));
    keep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut update = tokio::time::interval(Duration::from_secs(2));
    update.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_heard = Instant::now();
    let mut dirty = false;
    // Taking the key back from another live lease waits this long, doubling each time.
    let mut contest = Duration::from_secs(2);
    let mut hold_until = Instant::now();
    let mut record_open = true;
    loop {
        tokio::select! {
            _ = keep.tick() => {
                if last_heard.elapsed() > ttl {
                    return Err(Error("etcd stopped answering keep-alives".into()));
                }
                if tx.send(etcd::LeaseKeepAliveRequest { id }).await.is_err() {
                    return Err(Error("the keep-alive stream closed".into()));
                }
            }
            reply = replies.message() => match reply {
                Ok(Some(r)) if r.ttl > 0 => last_heard = Instant::now(),
                Ok(Some(_)) => return Err(Error(format!("lease {id} expired"))),
                Ok(None) => return Err(Error("the keep-alive stream ended".into())),
                Err(s) => return Err(s.into()),
            },
            changed = record.changed(), if record_open => {
                // A dropped record has nothing more to say: the last one stays announced.
                match changed {
                    Ok(()) => dirty = true,
                    Err(_) => record_open = false,
                }
            }
            event = own_key.message() => {
                let r = event?.ok_or_else(|| Error("the watch of our own key ended".into()))?;
                if r.canceled {
                    return Err(Error("the watch of our own key was canceled".into()));
                }
                if let Some(wait) = take_back_after(&r.events, id, &written, &key, &mut contest) {
                    hold_until = Instant::now() + wait;
                    dirty = true;
                }
            }
            _ = update.tick(), if dirty && Instant::now() >= hold_until => {
                dirty = false;
                let now = record.borrow_and_update().clone();
                written = serde_json::to_vec(&now).expect("a record serializes");
                put(&mut kv, written.clone()).await?;
            }
            _ = stop.changed() => {
                let _ = call(kv.delete_range(etcd::DeleteRangeRequest {
                    key: key.clone().into_bytes(),
                    range_end: Vec::new(),
                }))
                .await;
                let _ = call(lease.lease_revoke(etcd::LeaseRevokeRequest { id })).await;
                tracing::info!(key = %key, "registry: withdrawn");
                return Ok(());
            }
        }
    }
}

/// A watch of exactly `key`, from just after `revision`: the request stream's sender (the
/// watch lasts as long as it lives) and the events.
type KeyWatch = (
    mpsc::Sender<etcd::WatchRequest>,
    tonic::Streaming<etcd::WatchResponse>,
);

async fn watch_key(channel: &Etcd, key: &str, revision: i64) -> Result<KeyWatch, Error> {
    let (req_tx, req_rx) = mpsc::channel(1);
    req_tx
        .send(etcd::WatchRequest {
            request_union: Some(etcd::watch_request::RequestUnion::CreateRequest(
                etcd::WatchCreateRequest {
                    key: key.as_bytes().to_vec(),
                    range_end: Vec::new(),
                    start_revision: revision + 1,
                    progress_notify: false,
                },
            )),
        })
        .await
        .map_err(|_| Error("the watch stream closed".into()))?;
    let mut watcher = WatchClient::new(channel.svc());
    let events = call(watcher.watch(ReceiverStream::new(req_rx))).await?;
    Ok((req_tx, events))
}

/// How long to wait before putting our record back after these watch events on our key, if
/// it is to be put back: at once when it was deleted or overwritten under no lease; after
/// `contest` (which then doubles) when another live lease holds it, so two processes given one
/// address never flap the record (and the routes) every tick.
fn take_back_after(
    events: &[etcd::Event],
    lease: i64,
    written: &[u8],
    key: &str,
    contest: &mut Duration,
) -> Option<Duration> {
    match events.iter().map(|e| foreign(e, lease, written)).max()? {
        Foreign::Ours => None,
        Foreign::Removed => {
            tracing::warn!(key = %key, "registry: our record was deleted or overwritten; announcing it again");
            Some(Duration::ZERO)
        }
        Foreign::Claimed => {
            tracing::error!(key = %key, retry_in = ?*contest, "registry: another process announces itself under this shard's address; check the --advertise addresses");
            let wait = *contest;
            *contest = (*contest * 2).min(MAX_CONTEST_BACKOFF);
            Some(wait)
        }
    }
}

/// The longest a shard waits before taking its key back from another live lease.
const MAX_CONTEST_BACKOFF: Duration = Duration::from_secs(64);

/// Whose doing a watch event on our own key is, in increasing order of concern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Foreign {
    /// Our own write.
    Ours,
    /// Deleted, or overwritten by a value bound to no lease (an operator's put, which would
    /// outlive us), or under our lease with another value.
    Removed,
    /// Overwritten by another live lease: another process under our address.
    Claimed,
}

fn foreign(e: &etcd::Event, lease: i64, written: &[u8]) -> Foreign {
    if e.r#type != etcd::event::EventType::Put as i32 {
        return Foreign::Removed;
    }
    match &e.kv {
        Some(kv) if kv.lease == lease && kv.value == written => Foreign::Ours,
        Some(kv) if kv.lease != 0 && kv.lease != lease => Foreign::Claimed,
        _ => Foreign::Removed,
    }
}

// ---- following ------------------------------------------------------------------------

/// Follows the shards announced under `prefix`: the receiver always holds the membership as
/// last seen. The task ends when every receiver is dropped.
pub fn follow(endpoints: &Connect, prefix: &str) -> Result<watch::Receiver<Members>, Error> {
    let channel = channel(endpoints)?;
    let (tx, rx) = watch::channel(Members::default());
    let prefix = prefix.to_string();
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(200);
        loop {
            let started = Instant::now();
            let e = follow_once(&channel, &prefix, &tx).await;
            if tx.is_closed() {
                return;
            }
            // Frozen: the last membership stays as it was. One warning per outage.
            let was_connected = tx.send_if_modified(|m| std::mem::replace(&mut m.connected, false));
            if was_connected {
                tracing::warn!(error = %e, "registry: watch lost; membership frozen until etcd answers");
            } else {
                tracing::debug!(error = %e, "registry: etcd still away");
            }
            if started.elapsed() > Duration::from_secs(10) {
                backoff = Duration::from_millis(200);
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    });
    Ok(rx)
}

/// A snapshot and the watch that follows it, until something breaks: why it broke.
async fn follow_once(channel: &Etcd, prefix: &str, tx: &watch::Sender<Members>) -> Error {
    let key = format!("{prefix}shards/").into_bytes();
    let end = prefix_end(&key);
    if let Err(e) = channel.login().await {
        return e;
    }
    let (shards, revision, read_rejected) = match snapshot(channel, prefix, &key, &end).await {
        Ok(s) => s,
        Err(e) => return e,
    };
    tx.send_modify(|m| {
        for (reason, n) in read_rejected {
            *m.rejected.entry(reason).or_default() += n;
        }
        m.shards = shards;
        m.connected = true;
        m.revision = revision;
    });
    match watch_from(channel, prefix, key, end, revision, tx).await {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

/// What a snapshot read: the records by key, the revision, and the entries rejected by reason.
type Snapshot = (
    BTreeMap<String, ShardRecord>,
    i64,
    BTreeMap<&'static str, u64>,
);

/// Every record under the prefix, read in pages all at one revision (the first page's).
async fn snapshot(channel: &Etcd, prefix: &str, key: &[u8], end: &[u8]) -> Result<Snapshot, Error> {
    let (entries, revision) = read_range(channel, key, end).await?;
    let mut shards = BTreeMap::new();
    let mut rejected = BTreeMap::new();
    for e in &entries {
        match parse_record(prefix, &e.key, &e.value) {
            Ok(r) => {
                shards.insert(String::from_utf8_lossy(&e.key).into_owned(), r);
            }
            Err(reason) => *rejected.entry(reason).or_default() += 1,
        }
    }
    Ok((shards, revision, rejected))
}

/// Every entry of `[key, end)`, at most [`MAX_MEMBERS`], read in pages all at one revision (the
/// first page's), and that revision.
async fn read_range(
    channel: &Etcd,
    key: &[u8],
    end: &[u8],
) -> Result<(Vec<etcd::KeyValue>, i64), Error> {
    let mut kv = KvClient::new(channel.svc()).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let mut entries = Vec::new();
    let mut from = key.to_vec();
    let mut revision = 0;
    loop {
        let page = call(kv.range(etcd::RangeRequest {
            key: from.clone(),
            range_end: end.to_vec(),
            limit: PAGE,
            revision,
        }))
        .await?;
        if revision == 0 {
            revision = page.header.map_or(0, |h| h.revision);
        }
        let more = page.more;
        entries.extend(page.kvs);
        match entries.last() {
            Some(last) if more && entries.len() < MAX_MEMBERS => {
                from = last.key.clone();
                from.push(0);
            }
            _ => break,
        }
    }
    if entries.len() >= MAX_MEMBERS {
        tracing::warn!(
            limit = MAX_MEMBERS,
            "registry: more entries than a tracker reads; the rest are ignored"
        );
    }
    Ok((entries, revision))
}

/// Watches `[key, end)` from just after `revision`, applying every event to the membership.
async fn watch_from(
    channel: &Etcd,
    prefix: &str,
    key: Vec<u8>,
    end: Vec<u8>,
    revision: i64,
    tx: &watch::Sender<Members>,
) -> Result<std::convert::Infallible, Error> {
    let mut watcher = WatchClient::new(channel.svc()).max_decoding_message_size(MAX_MESSAGE_BYTES);
    // The request stream stays open as long as `req_tx` lives: dropping it ends the watch.
    let (req_tx, req_rx) = mpsc::channel(1);
    req_tx
        .send(etcd::WatchRequest {
            request_union: Some(etcd::watch_request::RequestUnion::CreateRequest(
                etcd::WatchCreateRequest {
                    key,
                    range_end: end,
                    start_revision: revision + 1,
                    progress_notify: true,
                },
            )),
        })
        .await
        .map_err(|_| Error("the watch stream closed".into()))?;
    let mut events = call(watcher.watch(ReceiverStream::new(req_rx))).await?;
    loop {
        let Some(r) = events.message().await? else {
            return Err(Error("the watch stream ended".into()));
        };
        if r.canceled || r.compact_revision > 0 {
            let reason = if r.cancel_reason.is_empty() {
                "compacted"
            } else {
                &r.cancel_reason
            };
            return Err(Error(format!(
                "the watch was canceled ({reason}); reading a fresh snapshot"
            )));
        }
        let revision = r.header.map_or(0, |h| h.revision);
        tx.send_if_modified(|m| {
            let changed = apply(m, prefix, &r.events);
            let newer = revision > m.revision;
            m.revision = m.revision.max(revision);
            changed || newer
        });
    }
}

/// Applies watch events to the membership; whether a record changed.
fn apply(m: &mut Members, prefix: &str, events: &[etcd::Event]) -> bool {
    let mut changed = false;
    for e in events {
        let Some(kv) = &e.kv else { continue };
        let k = String::from_utf8_lossy(&kv.key).into_owned();
        let put = e.r#type == etcd::event::EventType::Put as i32;
        // A put of something that is not a record takes the key out, as a delete does.
        let parsed = match put {
            true => parse_record(prefix, &kv.key, &kv.value).map(Some),
            false => Ok(None),
        };
        match parsed {
            Ok(Some(rec)) => changed |= m.shards.insert(k, rec.clone()).as_ref() != Some(&rec),
            Ok(None) => changed |= m.shards.remove(&k).is_some(),
            Err(reason) => {
                *m.rejected.entry(reason).or_default() += 1;
                m.shards.remove(&k);
                changed = true;
            }
        }
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_range_ends_after_every_key_of_the_prefix() {
        assert_eq!(prefix_end(b"/strata/shards/"), b"/strata/shards0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    /// Shards are grouped into routes by how they store K and V and their numeric contract,
    /// not by their context or block size; a record without them groups with its like.
    #[test]
    fn a_records_arithmetic_is_its_kv_type_and_contract() {
        let with = |recipe: &str| ShardRecord {
            recipe: recipe.into(),
            ..ShardRecord::placing("127.0.0.1:1", "x", "m", "d", 0..2, 2, "")
        };
        let a = with("block 16 kv q8_0 ctx 4096 contract 1");
        assert_eq!(a.arithmetic(), "kv q8_0 contract 1");
        assert_eq!(
            a.arithmetic(),
            with("block 16 kv q8_0 ctx 99 contract 1").arithmetic()
        );
        assert_ne!(
            a.arithmetic(),
            with("block 16 kv f16 ctx 4096 contract 1").arithmetic()
        );
        assert_ne!(
            a.arithmetic(),
            with("block 16 kv q8_0 ctx 4096 contract 2").arithmetic()
        );
        assert_eq!(with("").arithmetic(), "");
        assert_eq!(with("kv").arithmetic(), "");
        // What a claim carries, as `arithmetic` writes it, groups with the full recipe.
        assert_eq!(with(&arithmetic("q8_0", 1)).arithmetic(), a.arithmetic());
        assert!(a.same_swarm(&with(&arithmetic("q8_0", 1))));
        assert!(!a.same_swarm(&with(&arithmetic("f16", 1))));
        assert!(!a.same_swarm(&ShardRecord {
            digest: "e".into(),
            ..a.clone()
        }));
        // An older shard's claim names none: it counts with every swarm of its model.
        assert!(a.same_swarm(&with("")) && with("").same_swarm(&a));
    }

    #[test]
    fn records_are_read_only_under_their_own_key_and_within_bounds() {
        let r = ShardRecord {
            address: "127.0.0.1:1".into(),
            instance: "x".into(),
            model: "m".into(),
            digest: "d".into(),
            layer_start: 0,
            layer_end: 2,
            n_layers: 2,
            recipe: String::new(),
            kv_budget_bytes: 1,
            kv_free_bytes: 1,
            max_sessions: 1,
            sessions: 0,
            draining: false,
            weights_budget_bytes: 0,
            token_step_micros: 0,
        };
        let v = serde_json::to_vec(&r).unwrap();
        let key = shard_key("/s/", "127.0.0.1:1");
        assert_eq!(parse_record("/s/", key.as_bytes(), &v), Ok(r.clone()));
        // Filed under another address: ignored (it could not be validated as that address).
        assert_eq!(
            parse_record("/s/", b"/s/shards/10.0.0.1:1", &v),
            Err("wrong_key")
        );
        assert_eq!(
            parse_record("/s/", key.as_bytes(), b"{not json"),
            Err("malformed")
        );
        // Impossible ranges are not members (a chain search over them could not end).
        for (a, b, n) in [
            (0, 0, 0),
            (0, 2, 0),
            (2, 2, 4),
            (3, 2, 4),
            (0, 5, 4),
            (0, 1, 1 << 20),
        ] {
            let bad = ShardRecord {
                layer_start: a,
                layer_end: b,
                n_layers: n,
                ..r.clone()
            };
            let v = serde_json::to_vec(&bad).unwrap();
            assert_eq!(
                parse_record("/s/", key.as_bytes(), &v),
                Err("impossible_range"),
                "{a}..{b} of {n}"
            );
        }
        let long = vec![b' '; MAX_RECORD_BYTES + 1];
        assert_eq!(parse_record("/s/", key.as_bytes(), &long), Err("too_long"));
    }

    #[test]
    fn only_material_changes_are_announced_again() {
        let r = ShardRecord {
            address: "a:1".into(),
            instance: "1".into(),
            model: "m".into(),
            digest: "d".into(),
            layer_start: 0,
            layer_end: 1,
            n_layers: 1,
            recipe: String::new(),
            kv_budget_bytes: 1600,
            kv_free_bytes: 1600,
            max_sessions: 4,
            sessions: 0,
            draining: false,
            weights_budget_bytes: 0,
            token_step_micros: 0,
        };
        let with = |f: &dyn Fn(&mut ShardRecord)| {
            let mut n = r.clone();
            f(&mut n);
            n
        };
        assert!(!r.worth_announcing(&r));
        assert!(!r.worth_announcing(&with(&|n| n.kv_free_bytes = 1550)));
        assert!(r.worth_announcing(&with(&|n| n.kv_free_bytes = 1500)));
        assert!(r.worth_announcing(&with(&|n| n.sessions = 1)));
        assert!(r.worth_announcing(&with(&|n| n.draining = true)));
        // The time per token: its first measure, then a move of more than an eighth.
        assert!(r.worth_announcing(&with(&|n| n.token_step_micros = 20_000)));
        let timed = with(&|n| n.token_step_micros = 20_000);
        assert!(!timed.worth_announcing(&with(&|n| n.token_step_micros = 22_000)));
        assert!(timed.worth_announcing(&with(&|n| n.token_step_micros = 23_000)));
        assert!(timed.worth_announcing(&with(&|n| n.token_step_micros = 17_000)));
    }

    #[test]
    fn tls_and_clear_text_endpoints_are_never_mixed_up() {
        // Channels are lazy: building one needs a runtime, not a server.
        let rt = tokio::runtime::Runtime::new().unwrap();
        let _guard = rt.enter();
        let e = channel(&Connect::plain("https://10.0.0.1:2379")).unwrap_err();
        assert!(
            e.0.contains("https://10.0.0.1:2379") && e.0.contains("--registry-ca"),
            "{e}"
        );
        let with_ca = |endpoints: &str| Connect {
            endpoints: endpoints.into(),
            ca_pem: Some(b"not checked until a connection".to_vec()),
            ..Connect::default()
        };
        let e = channel(&with_ca("http://10.0.0.1:2379")).unwrap_err();
        assert!(e.0.contains("must be https://"), "{e}");
        let e = channel(&Connect {
            identity: Some((Vec::new(), Vec::new())),
            ..Connect::plain("http://10.0.0.1:2379")
        })
        .unwrap_err();
        assert!(e.0.contains("needs the CA"), "{e}");
        assert!(channel(&Connect::plain(" , ")).is_err());
        assert!(channel(&Connect::plain("10.0.0.1:2379")).is_ok());
    }
}
