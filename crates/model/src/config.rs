//! Llama-family hyperparameters read from GGUF metadata.

use gguf::Header;

use crate::Error;

/// The shape of a llama-architecture model (SmolLM2, TinyLlama, Llama 2/3, Mistral all use it).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub rope_base: f32,
    /// Number of leading dimensions of each head that RoPE rotates.
    pub rope_dim: usize,
    /// Linear RoPE scaling: positions are multiplied by this (1.0 = none).
    pub rope_freq_scale: f32,
    pub rms_eps: f32,
}

impl LlamaConfig {
    pub fn from_header(h: &Header) -> Result<Self, Error> {
        let arch = h.str("general.architecture")?;
        if arch != "llama" {
            return Err(Error::UnsupportedArchitecture {
                arch: arch.to_string(),
            });
        }
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| -> Result<usize, Error> { Ok(h.u64(&key(k))? as usize) };
        let n_embd = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        let n_head_kv = h
            .opt(&key("attention.head_count_kv"), |h, k| h.u64(k))?
            .map_or(n_head, |v| v as usize);
        let n_vocab = match h.opt(&key("vocab_size"), |h, k| h.u64(k))? {
            Some(v) => v as usize,
            None => h.array("tokenizer.ggml.tokens")?.len(),
        };
        let bad = |field: &'static str, value: usize, why: &'static str| Error::BadConfig {
            field,
            value: value.to_string(),
            why,
        };
        if n_head == 0 || n_embd % n_head != 0 {
            return Err(bad(
                "attention.head_count",
                n_head,
                "must divide embedding_length",
            ));
        }
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(bad(
                "attention.head_count_kv",
                n_head_kv,
                "must divide head_count",
            ));
        }
        let head_dim = n_embd / n_head;
        let rope_dim = h
            .opt(&key("rope.dimension_count"), |h, k| h.u64(k))?
            .map_or(head_dim, |v| v as usize);
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(bad(
                "rope.dimension_count",
                rope_dim,
                "must be even and at most the head size",
            ));
        }
        let scale = h
            .opt(&key("rope.scaling.factor"), |h, k| h.f64(k))?
            .or(h.opt(&key("rope.scale_linear"), |h, k| h.f64(k))?)
            .unwrap_or(1.0);
        let scaling_type = h.opt(&key("rope.scaling.type"), |h, k| {
            h.str(k).map(str::to_string)
        })?;
        if let Some(t) = scaling_type.filter(|t| t != "linear" && t != "none") {
            return Err(Error::BadConfig {
                field: "rope.scaling.type",
                value: t,
                why: "only linear rope scaling is supported",
            });
        }
        Ok(LlamaConfig {
            n_layers: u("block_count")?,
            n_embd,
            n_ff: u("feed_forward_length")?,
            n_head,
            n_head_kv,
            head_dim,
            n_vocab,
            n_ctx_train: u("context_length")?,
            rope_base: h
                .opt(&key("rope.freq_base"), |h, k| h.f64(k))?
                .unwrap_or(10000.0) as f32,
            rope_dim,
            rope_freq_scale: if scale > 0.0 {
                (1.0 / scale) as f32
            } else {
                1.0
            },
            rms_eps: h.f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
        })
    }

    /// Width of one position's K (or V) for one layer.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}
