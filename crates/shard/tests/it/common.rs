//! Helpers the shard's integration tests share.

use std::time::Duration;

use proto::v1::{Fragment, Sampling};
use shard::ShardConfig;
use testkit::TinySpec;

/// A fragment of `tokens` at `start_pos` that asks for a sampled token (default sampling when
/// the session starts).
pub fn frag(session_id: u64, start_pos: u32, tokens: &[u32]) -> Fragment {
    Fragment {
        session_id,
        start_pos,
        tokens: tokens.to_vec(),
        want_output: true,
        sampling: (start_pos == 0).then(Sampling::default),
        n_top_logprobs: 0,
        want_logprob: false,
        reuse_prefix: false,
        prefix: vec![],
        cache_salt: 0,
        n_draft: 0,
    }
}

/// A whole tiny model on one thread with the given KV budget and idle time.
pub fn config(kv_budget_bytes: usize, kv_ttl: Duration) -> ShardConfig {
    let path = testkit::write_tiny_model(&TinySpec::default(), "shard-refusals");
    ShardConfig {
        model_path: path,
        layers: None,
        n_threads: 1,
        isa: None,
        kv_type: model::KvType::F16,
        n_ctx: 64,
        kv_budget_bytes,
        kv_ttl,
        max_sessions: 8,
        weights_budget_bytes: 1 << 30,
        scratch_budget_bytes: 64 << 20,
        inflight_budget_bytes: 64 << 20,
        pinned: false,
        prefix_cache: true,
        label: "test-shard".into(),
        link: proto::Link::plain("unused-in-process-token"),
        tls_identity: None,
        grammar_budget: std::time::Duration::from_millis(200),
    }
}
