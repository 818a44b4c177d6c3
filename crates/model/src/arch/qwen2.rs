//! qwen2 (Qwen2, Qwen2.5, Qwen2.5-Coder): the llama block with a bias on each of the Q, K and V
//! projections (`attn_q.bias`, `attn_k.bias`, `attn_v.bias`) and NeoX-style RoPE (the head's two
//! halves rotated together) with the file's base (1e6 for Qwen2.5). `output` is optional (the
//! small models tie it to `token_embd`).

use super::common::{common, Keys};
use crate::config::{Family, ModelConfig, RopeStyle};
use crate::Error;

pub(super) fn config(keys: &Keys<'_>) -> Result<ModelConfig, Error> {
    let mut c = common(keys, Family::Qwen2)?;
    c.block.qkv_bias = true;
    c.block.rope = RopeStyle::Neox;
    Ok(c)
}
