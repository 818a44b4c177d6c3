//! llama (Llama 2/3, SmolLM2, TinyLlama, Mistral): pre-norm blocks of grouped-query attention
//! with adjacent-pair RoPE and a SiLU-gated FFN; every layer attends to every position before
//! it. Tensors per layer: `attn_norm`, `attn_q`, `attn_k`, `attn_v`, `attn_output`, `ffn_norm`,
//! `ffn_gate`, `ffn_up`, `ffn_down`; `output` is optional (tied to `token_embd` without it).

use super::common::{common, Keys};
use crate::config::{Family, ModelConfig};
use crate::Error;

pub(super) fn config(keys: &Keys<'_>) -> Result<ModelConfig, Error> {
    common(keys, Family::Llama)
}
