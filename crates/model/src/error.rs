//! The one error type of the `model` crate.

/// Errors from loading weights or running a forward pass.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Gguf(#[from] gguf::Error),
    #[error("unsupported architecture `{arch}` (supported: llama, qwen2, qwen3, gemma3)")]
    UnsupportedArchitecture { arch: String },
    #[error("bad model config: {field} is {value} ({why})")]
    BadConfig {
        field: &'static str,
        value: String,
        why: &'static str,
    },
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    BadShape {
        name: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("layer range {start}..{end} is invalid for a model with {n_layers} layers")]
    BadRange {
        start: usize,
        end: usize,
        n_layers: usize,
    },
    #[error("token id {token} is out of range (vocabulary has {n_vocab} tokens)")]
    TokenOutOfRange { token: u32, n_vocab: usize },
    #[error("batch row {row_idx}: session {seq} position {pos} does not follow its cache (next position is {expected})")]
    PositionGap {
        row_idx: usize,
        seq: usize,
        pos: usize,
        expected: usize,
    },
    #[error("batch row {row_idx}: session index {seq} but only {n_caches} caches were passed")]
    NoSuchCache {
        row_idx: usize,
        seq: usize,
        n_caches: usize,
    },
    #[error("session {seq}: position {pos} exceeds the context length {n_ctx}")]
    ContextFull {
        seq: usize,
        pos: usize,
        n_ctx: usize,
    },
    #[error("batch input: {what}")]
    BadInput { what: String },
    #[error("kv cache for layers {cache_start}..{cache_end} does not match the model range {start}..{end}")]
    CacheMismatch {
        cache_start: usize,
        cache_end: usize,
        start: usize,
        end: usize,
    },
    #[error(transparent)]
    KvExhausted(#[from] crate::kv::KvExhausted),
}
