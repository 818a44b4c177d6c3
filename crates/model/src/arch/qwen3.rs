//! qwen3 (Qwen3 dense): the llama block with NeoX-style RoPE and, instead of Q/K/V biases, an
//! RMS norm over each head of Q and of K before RoPE (`attn_q_norm`, `attn_k_norm`, one weight
//! per head dimension); the head size is `attention.key_length` (128, wider than
//! `n_embd / n_head` on some sizes).

use super::common::{common, Keys};
use crate::config::{Family, ModelConfig, RopeStyle};
use crate::Error;

pub(super) fn config(keys: &Keys<'_>) -> Result<ModelConfig, Error> {
    let mut c = common(keys, Family::Qwen3)?;
    c.block.qk_norm = true;
    c.block.rope = RopeStyle::Neox;
    Ok(c)
}
