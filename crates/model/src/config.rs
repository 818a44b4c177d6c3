//! A model's hyperparameters, whatever its family: the shape of its layers and how each layer's
//! block is assembled from the shared building blocks ([`BlockSpec`], [`LayerSpec`]). Plain
//! data: each family's file in `crate::arch` reads its own metadata keys into this.

use crate::Error;

/// The gated feed-forward network's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnAct {
    /// `silu(gate) * up` (llama, qwen).
    Silu,
    /// `gelu(gate) * up`, GELU in its tanh form, as ggml tabulates it (gemma).
    GeluTanh,
}

/// Which dimensions RoPE rotates together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i + 1)` (llama's "normal" RoPE).
    Normal,
    /// The two halves: `(i, i + rope_dim / 2)` (GPT-NeoX's; qwen, gemma).
    Neox,
}

/// How every layer's block is built: which optional parts it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSpec {
    /// Q, K and V projections add a bias (`attn_q.bias`, ...).
    pub qkv_bias: bool,
    /// Q and K are RMS-normed per head before RoPE (`attn_q_norm`, `attn_k_norm`).
    pub qk_norm: bool,
    /// The attention output is RMS-normed before it joins the residual stream
    /// (`post_attention_norm`).
    pub post_attn_norm: bool,
    /// The FFN output is RMS-normed before it joins the residual stream (`post_ffw_norm`).
    pub post_ffn_norm: bool,
    pub ffn_act: FfnAct,
    pub rope: RopeStyle,
}

/// What differs from one layer to the next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerSpec {
    pub rope_base: f32,
    /// Linear RoPE scaling: positions are multiplied by this (1.0 = none).
    pub rope_freq_scale: f32,
    /// Sliding-window attention: a position attends to this many positions, itself included
    /// (`None`: every position before it).
    pub window: Option<usize>,
}

/// The shape of a model and how its layers are built.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Width of one attention head (not always `n_embd / n_head`: gemma's is 256).
    pub head_dim: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    /// The RoPE base of full-attention layers (what a cache recipe names).
    pub rope_base: f32,
    /// Number of leading dimensions of each head that RoPE rotates.
    pub rope_dim: usize,
    /// The RoPE scaling of full-attention layers.
    pub rope_freq_scale: f32,
    pub rms_eps: f32,
    /// The token embedding is multiplied by this before the first layer (gemma: sqrt(n_embd)).
    pub embd_scale: Option<f32>,
    /// Attention scores are `q . k` times this (1/sqrt(head_dim) unless a family says other).
    pub attn_scale: f32,
    pub block: BlockSpec,
    /// One per layer.
    pub layers: Vec<LayerSpec>,
}

impl ModelConfig {
    /// Width of one position's K (or V) for one layer.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Width of the attention's query and output (all heads).
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Whether any layer attends through a sliding window.
    pub fn has_window(&self) -> bool {
        self.layers.iter().any(|l| l.window.is_some())
    }

    pub(crate) fn check(&self) -> Result<(), Error> {
        let bad = |field: &'static str, value: usize, why: &'static str| Error::BadConfig {
            field,
            value: value.to_string(),
            why,
        };
        if self.n_layers == 0 {
            return Err(bad("block_count", 0, "a model has at least one layer"));
        }
        if self.n_head == 0 || self.head_dim == 0 {
            return Err(bad(
                "attention.head_count",
                self.n_head,
                "must be at least 1",
            ));
        }
        if self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return Err(bad(
                "attention.head_count_kv",
                self.n_head_kv,
                "must divide head_count",
            ));
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return Err(bad(
                "rope.dimension_count",
                self.rope_dim,
                "must be even and at most the head size",
            ));
        }
        if self.n_vocab == 0 || self.n_embd == 0 || self.n_ff == 0 {
            return Err(bad(
                "embedding_length",
                self.n_embd,
                "embedding, feed-forward and vocabulary sizes must be at least 1",
            ));
        }
        if let Some(w) = self
            .layers
            .iter()
            .find_map(|l| l.window.filter(|&w| w == 0))
        {
            return Err(bad("attention.sliding_window", w, "must be at least 1"));
        }
        Ok(())
    }
}

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
}
