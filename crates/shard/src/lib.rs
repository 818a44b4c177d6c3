//! The shard: one process serving one contiguous layer range of one model.
//!
//! The key design decision: all model state has one owner, a compute thread ([`worker`], driven
//! through the handle in [`core`]) that holds the weights and every session's KV cache, keyed
//! by the route stream that opened it, and runs steps one at a time; gRPC handlers and the
//! route relay talk to it by message. A compute thread that panics stops the shard: every
//! stream and RPC is then refused with a typed failure. A shard never invents work: it executes the
//! fragments the tracker planned, refuses (typed) what it cannot hold, and forwards the
//! activations of what it accepted to the next shard of the route.

mod core;
#[cfg(feature = "fault-injection")]
mod faulty;
mod grammar;
mod messages;
mod relay;
mod replies;
mod route;
mod service;
mod worker;

use std::path::PathBuf;

pub use crate::core::{file_digest, vocab_file, ComputeStopped, ShardCore};
#[cfg(feature = "fault-injection")]
pub use faulty::{Fault, FaultyShard};
pub use messages::Counters;
pub use route::run_route;
pub use service::{serve, LocalShard, ShardService};
pub use worker::MAX_DRAFT;

/// Everything a shard needs to start, validated by the binary.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    pub model_path: PathBuf,
    /// `None` serves every layer.
    pub layers: Option<(usize, usize)>,
    pub n_threads: usize,
    /// The instruction set the kernels use (`None`: the best this CPU has); every one gives
    /// bitwise the same results ([`model::NUMERIC_CONTRACT`]).
    pub isa: Option<model::Isa>,
    /// How sessions' K and V are stored (the cache recipe's `kv_dtype`: a route's shards, and a
    /// model's routes, all store them alike).
    pub kv_type: model::KvType,
    /// Most positions one session may hold; `0` chooses: the model's trained context, cut to
    /// what the KV budget holds for one session ([`ShardCore::context`] says which and why).
    pub n_ctx: usize,
    /// Bytes of KV cache all sessions together may hold.
    pub kv_budget_bytes: usize,
    /// A session idle this long is forgotten (its next fragment gets `cache_miss`).
    pub kv_ttl: std::time::Duration,
    pub max_sessions: usize,
    /// Bytes the range's weights may take (loading more is refused).
    pub weights_budget_bytes: usize,
    /// Bytes of per-step activations; bounds the tokens one step may carry.
    pub scratch_budget_bytes: usize,
    /// Activation bytes sent downstream and not yet answered.
    pub inflight_budget_bytes: usize,
    /// The model must never be evicted from this node (advertised to trackers).
    pub pinned: bool,
    /// Start sessions on cached KV blocks of a token prefix other sessions computed (full
    /// blocks, registered after each step; K and V are a function of the tokens alone).
    pub prefix_cache: bool,
    /// The address this shard is known by (for errors, metrics and hop timings).
    pub label: String,
    /// How this shard reaches the next one (and the token every connection to it must present).
    pub link: proto::Link,
    /// This shard's own certificate and key (PEM): with them it serves TLS only.
    pub tls_identity: Option<TlsIdentity>,
    /// How long a constrained session's grammar may take for one token: its mask (computed
    /// beside the step's forward pass) must be ready this long after the step started, or
    /// when the forward pass ends if that is later; a session over it fails with
    /// `grammar_budget`.
    pub grammar_budget: std::time::Duration,
}

/// A certificate chain and its private key, in PEM.
#[derive(Clone)]
pub struct TlsIdentity {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsIdentity(..)")
    }
}

/// Bytes as MiB, for the numbers refusals name.
pub(crate) fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Model(#[from] model::Error),
    #[error(transparent)]
    Gguf(#[from] gguf::Error),
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("{0}")]
    Budget(String),
    #[error("{0}")]
    Stopped(#[from] ComputeStopped),
}
