//! The integration tests of `gguf`, one test binary (one link) with a module per scenario.

mod block_decoding;
mod hostile_input;
