//! Transformer language models from GGUF files (the llama, qwen2, qwen3 and gemma3 families,
//! [`arch`]): configuration from metadata, weights of one contiguous layer range, kernels, and
//! a batched forward pass.
//!
//! The key design decision: weights are immutable and shared; per-session KV state is passed
//! *into* [`Model::forward`], never stored beside the weights. A batch is a list of rows from
//! any number of sessions, and every kernel fixes its reduction order per output element, so a
//! row's result is bitwise independent of what else is in the batch or how a prompt is chunked.

pub mod arch;
mod config;
mod error;
mod forward;
pub mod kernels;
mod kv;
pub mod matmul;
pub mod pool;
pub mod sampling;
mod weights;

pub use config::Family;
pub use config::{BlockSpec, FfnAct, LayerSpec, ModelConfig, RopeStyle};
pub use error::Error;
pub use forward::{Batch, Model, ModelOptions, Output, Row};
pub use kernels::{Isa, Kernels, NUMERIC_CONTRACT};
pub use kv::{KvCache, KvExhausted, KvPool, KvType, BLOCK_POSITIONS};
pub use weights::{LayerRange, WeightSizes};
