//! Model families: one file each, saying what differs (metadata keys, which optional tensors
//! exist, how the block is assembled) over the shared building blocks of [`crate::forward`]
//! (norms, RoPE in both styles, attention with optional biases, QK norms and sliding windows,
//! the gated FFN with SiLU or GELU, the head). Adding a family is one file here and its tests.
//! Tensor names are ggml's, shared by every family (`blk.N.attn_q.weight`, ...).

mod gemma3;
mod llama;
mod qwen2;
mod qwen3;

mod common;

use common::Keys;
use gguf::Header;

use crate::config::{Family, ModelConfig};
use crate::Error;

impl ModelConfig {
    /// Reads the config of whatever family `general.architecture` names.
    pub fn from_header(h: &Header) -> Result<Self, Error> {
        let arch = h.str("general.architecture")?;
        let family = Family::named(arch)?;
        let c = config_of(family, &Keys { h, arch })?;
        c.check()?;
        Ok(c)
    }
}

/// Reads the config of a family from its metadata keys.
fn config_of(family: Family, keys: &Keys<'_>) -> Result<ModelConfig, Error> {
    match family {
        Family::Llama => llama::config(keys),
        Family::Qwen2 => qwen2::config(keys),
        Family::Qwen3 => qwen3::config(keys),
        Family::Gemma3 => gemma3::config(keys),
    }
}
