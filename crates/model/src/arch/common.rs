//! What every family reads the same way: typed access to its metadata keys, and the sizes,
//! RoPE and norm epsilon of a llama-shaped model.

use gguf::Header;

use crate::config::{BlockSpec, Family, FfnAct, LayerSpec, ModelConfig, RopeStyle};
use crate::Error;

/// A family's metadata keys (`{arch}.{key}`), read with typed errors naming the key.
pub struct Keys<'a> {
    pub h: &'a Header,
    pub arch: &'a str,
}

impl Keys<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    pub fn usize(&self, k: &str) -> Result<usize, Error> {
        Ok(self.h.u64(&self.key(k))? as usize)
    }

    pub fn opt_usize(&self, k: &str) -> Result<Option<usize>, Error> {
        Ok(self
            .h
            .opt(&self.key(k), |h, k| h.u64(k))?
            .map(|v| v as usize))
    }

    pub fn f32(&self, k: &str) -> Result<f32, Error> {
        Ok(self.h.f64(&self.key(k))? as f32)
    }

    pub fn opt_f32(&self, k: &str) -> Result<Option<f32>, Error> {
        Ok(self.h.opt(&self.key(k), |h, k| h.f64(k))?.map(|v| v as f32))
    }

    pub fn opt_str(&self, k: &str) -> Result<Option<String>, Error> {
        self.h
            .opt(&self.key(k), |h, k| h.str(k).map(str::to_string))
            .map_err(Error::from)
    }

    /// The vocabulary size: `{arch}.vocab_size`, else the tokenizer's token count.
    pub fn n_vocab(&self) -> Result<usize, Error> {
        match self.opt_usize("vocab_size")? {
            Some(v) => Ok(v),
            None => Ok(self.h.array("tokenizer.ggml.tokens")?.len()),
        }
    }

    /// Linear RoPE scaling as a factor on positions (1.0 = none); another scaling type is an
    /// error naming it.
    pub fn rope_freq_scale(&self) -> Result<f32, Error> {
        if let Some(t) = self
            .opt_str("rope.scaling.type")?
            .filter(|t| t != "linear" && t != "none")
        {
            return Err(Error::BadConfig {
                field: "rope.scaling.type",
                value: t,
                why: "only linear rope scaling is supported",
            });
        }
        let factor = match self.opt_f32("rope.scaling.factor")? {
            Some(f) => Some(f),
            None => self.opt_f32("rope.scale_linear")?,
        };
        Ok(match factor {
            Some(f) if f > 0.0 => 1.0 / f,
            _ => 1.0,
        })
    }
}

/// The keys every family reads the same way: a llama-shaped model's sizes, RoPE and norm
/// epsilon. `head_dim` is `attention.key_length` when the file says, else `n_embd / n_head`.
pub fn common(keys: &Keys<'_>, family: Family) -> Result<ModelConfig, Error> {
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
        block: BlockSpec {
            qkv_bias: false,
            qk_norm: false,
            post_attn_norm: false,
            post_ffn_norm: false,
            ffn_act: FfnAct::Silu,
            rope: RopeStyle::Normal,
        },
        layers: vec![
            LayerSpec {
                rope_base,
                rope_freq_scale,
                window: None,
            };
            n_layers
        ],
    })
}
