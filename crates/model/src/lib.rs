//! The llama-family transformer: configuration from GGUF metadata, weights of one contiguous
//! layer range, kernels, and a batched forward pass.
//!
//! The key design decision: weights are immutable and shared; per-session KV state is passed
//! *into* [`forward`](Model::forward), never stored beside the weights. A batch is a list of
//! rows from any number of sessions, and every kernel fixes its reduction order per output
//! element, so a row's result is bitwise independent of what else is in the batch.

pub mod kernels;
