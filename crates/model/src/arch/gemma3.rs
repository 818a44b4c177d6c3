//! gemma3 (Gemma 3 text): the token embedding scaled by sqrt(n_embd); per layer an RMS norm
//! before attention (`attn_norm`), per-head RMS norms of Q and K (`attn_q_norm`, `attn_k_norm`),
//! NeoX-style RoPE, attention with head size `attention.key_length` (256: Q is wider than the
//! residual stream), an RMS norm of its output before the residual add (`post_attention_norm`),
//! the pre-FFN norm (`ffn_norm`), a GELU(tanh)-gated FFN and an RMS norm of its output
//! (`post_ffw_norm`). Five of every six layers attend through a sliding window of
//! `attention.sliding_window` positions with RoPE base 10000 (llama.cpp's fixed values for
//! Gemma 3); every sixth layer attends to all positions with the file's base. The head is tied to
//! `token_embd` (no `output` tensor), with no final soft-capping.

use super::common::{common, Keys};
use crate::config::{Family, FfnAct, ModelConfig, RopeStyle};
use crate::Error;

/// Every sixth layer (5, 11, 17, ...) attends to all positions; the others through the window.
const GLOBAL_EVERY: usize = 6;
/// RoPE base of the sliding-window layers.
const LOCAL_ROPE_BASE: f32 = 10000.0;

pub(super) fn config(keys: &Keys<'_>) -> Result<ModelConfig, Error> {
    let mut c = common(keys, Family::Gemma3)?;
    let window = keys.usize("attention.sliding_window")?;
    c.embd_scale = Some((c.n_embd as f32).sqrt());
    // Gemma 3 27B (62 layers) scales queries by the residual width per head, the others by the
    // head size (as llama.cpp does; the file does not say).
    if c.n_layers == 62 {
        c.attn_scale = 1.0 / ((c.n_embd / c.n_head) as f32).sqrt();
    }
    c.block.qk_norm = true;
    c.block.post_attn_norm = true;
    c.block.post_ffn_norm = true;
    c.block.ffn_act = FfnAct::GeluTanh;
    c.block.rope = RopeStyle::Neox;
    for (i, l) in c.layers.iter_mut().enumerate() {
        if (i + 1) % GLOBAL_EVERY != 0 {
            l.rope_base = LOCAL_ROPE_BASE;
            l.rope_freq_scale = 1.0;
            l.window = Some(window);
        }
    }
    Ok(c)
}
