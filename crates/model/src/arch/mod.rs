//! Model families: one file each, saying what differs (metadata keys, which optional tensors
//! exist, how the block is assembled) over the shared building blocks of [`crate::forward`]
//! (norms, RoPE in both styles, attention with optional biases, QK norms and sliding windows,
//! the gated FFN with SiLU or GELU, the head). Adding a family is one file here and its tests.
//! Tensor names are ggml's, shared by every family (`blk.N.attn_q.weight`, ...).

mod gemma3;
mod llama;
mod qwen2;
mod qwen3;

use crate::config::{Keys, ModelConfig};
use crate::Error;

/// The families strata runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama 2/3, SmolLM2, TinyLlama, Mistral.
    Llama,
    /// Qwen2 and Qwen2.5: biases on Q, K and V.
    Qwen2,
    /// Qwen3: per-head Q and K norms, no biases.
    Qwen3,
    /// Gemma 3: scaled embedding, QK norms, norms after attention and FFN, GELU, sliding
    /// windows on five of every six layers.
    Gemma3,
}

/// `general.architecture` values strata runs.
pub const SUPPORTED: &str = "llama, qwen2, qwen3, gemma3";

impl Family {
    pub fn named(arch: &str) -> Result<Family, Error> {
        match arch {
            "llama" => Ok(Family::Llama),
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" => Ok(Family::Qwen3),
            "gemma3" => Ok(Family::Gemma3),
            other => Err(Error::UnsupportedArchitecture {
                arch: other.to_string(),
            }),
        }
    }

    /// The `general.architecture` name.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
        }
    }

    pub(crate) fn config(self, keys: &Keys<'_>) -> Result<ModelConfig, Error> {
        match self {
            Family::Llama => llama::config(keys),
            Family::Qwen2 => qwen2::config(keys),
            Family::Qwen3 => qwen3::config(keys),
            Family::Gemma3 => gemma3::config(keys),
        }
    }
}

/// The keys every family reads the same way: a llama-shaped model's sizes, RoPE and norm
/// epsilon. `head_dim` is `attention.key_length` when the file says, else `n_embd / n_head`.
pub(crate) fn common(keys: &Keys<'_>, family: Family) -> Result<ModelConfig, Error> {
    let n_embd = keys.usize("embedding_length")?;
    let n_head = keys.usize("attention.head_count")?;
    let n_head_kv = keys.opt_usize("attention.head_count_kv")?.unwrap_or(n_head);
    let head_dim = match keys.opt_usize("attention.key_length")? {
        Some(k) => k,
        None if n_head > 0 && n_embd % n_head == 0 => n_embd / n_head,
        None => {
            return Err(Error::BadConfig {
                field: "attention.head_count",
                value: n_head.to_string(),
                why: "must divide embedding_length when attention.key_length is absent",
            })
        }
    };
    if let Some(v) = keys.opt_usize("attention.value_length")? {
        if v != head_dim {
            return Err(Error::BadConfig {
                field: "attention.value_length",
                value: v.to_string(),
                why: "must equal attention.key_length",
            });
        }
    }
    let n_layers = keys.usize("block_count")?;
    let rope_base = keys.opt_f32("rope.freq_base")?.unwrap_or(10000.0);
    let rope_freq_scale = keys.rope_freq_scale()?;
    Ok(ModelConfig {
        family,
        n_layers,
        n_embd,
        n_ff: keys.usize("feed_forward_length")?,
        n_head,
        n_head_kv,
        head_dim,
        n_vocab: keys.n_vocab()?,
        n_ctx_train: keys.usize("context_length")?,
        rope_base,
        rope_dim: keys.opt_usize("rope.dimension_count")?.unwrap_or(head_dim),
        rope_freq_scale,
        rms_eps: keys.f32("attention.layer_norm_rms_epsilon")?,
        embd_scale: None,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        block: crate::config::BlockSpec {
            qkv_bias: false,
            qk_norm: false,
            post_attn_norm: false,
            post_ffn_norm: false,
            ffn_act: crate::config::FfnAct::Silu,
            rope: crate::config::RopeStyle::Normal,
        },
        layers: vec![
            crate::config::LayerSpec {
                rope_base,
                rope_freq_scale,
                window: None,
            };
            n_layers
        ],
    })
}
