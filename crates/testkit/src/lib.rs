//! Dev-only helpers: tiny random-weight models of every family strata runs, written as real
//! GGUF files, and the way tests find the real models and llama.cpp's reference outputs.
//!
//! Tiny models exercise the same loader, kernels and forward pass as the real one, in every
//! weight type the kernels support, so the unit suite needs no download.

pub use client as http;
pub mod delay;
pub mod etcd;
pub mod net;
pub mod observe;
pub mod procs;
pub mod tls;

use std::path::{Path, PathBuf};

use gguf::{quant, GgmlType, Value, ValueType, Writer};

/// The shape and encoding of a tiny model.
#[derive(Debug, Clone, Copy)]
pub struct TinySpec {
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub n_ff: usize,
    /// Encoding of the layer matrices.
    pub weight_type: GgmlType,
    /// Encoding of the token embedding (and of the head when tied).
    pub embd_type: GgmlType,
    /// Whether the output head reuses the token embedding (as SmolLM2 does).
    pub tied_head: bool,
    pub seed: u64,
    /// The family: `llama`, `qwen2` (Q/K/V biases), `qwen3` (QK norms), `gemma3` (QK norms,
    /// norms after attention and FFN, sliding windows on five of every six layers).
    pub arch: &'static str,
    /// Head size when it is not `n_embd / n_head` (written as `attention.key_length`).
    pub head_dim: Option<usize>,
    /// gemma3's sliding window.
    pub window: usize,
    /// The chat template the file carries ([`CHATML`], or [`CHATML_THINKING`]).
    pub chat_template: &'static str,
}

impl Default for TinySpec {
    fn default() -> Self {
        TinySpec {
            n_layers: 4,
            n_embd: 256,
            n_head: 4,
            n_head_kv: 2,
            n_ff: 512,
            weight_type: GgmlType::Q4_1,
            embd_type: GgmlType::Q8_0,
            tied_head: true,
            seed: 1,
            arch: "llama",
            head_dim: None,
            window: 8,
            chat_template: CHATML,
        }
    }
}

/// Merges of the tiny vocabulary (byte-level text, as GPT-2 writes them).
const MERGES: [&str; 12] = [
    "Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "Ġ w", "o r", "Ġw or",
];
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// ChatML with a thinking section, in the way Qwen3's template has one: the generation
/// prompt opens `<think>` (the answer starts inside it), or with `enable_thinking` false
/// closes an empty one; an assistant turn's `reasoning_content` is printed in its section.
pub const CHATML_THINKING: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' and message['reasoning_content'] %}{{'<think>\n' + message['reasoning_content'] + '\n</think>\n\n'}}{% endif %}{{ message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif %}{% endif %}";
/// A template that writes tool calls as Llama 3.x's do: the tools listed in the last user
/// turn, a call as a bare JSON object with `parameters`, tool results in `ipython` turns.
pub const CHATML_JSON_TOOLS: &str = "{% for message in messages %}{% if message['role'] == 'user' and loop.last and tools %}{{ '<|im_start|>user\nTo call a function, answer with a JSON object {\"name\": function name, \"parameters\": its arguments}. The functions:\n' }}{% for t in tools %}{{ t | tojson }}{{ '\n' }}{% endfor %}{{ message['content'] + '<|im_end|>\n' }}{% elif message['role'] == 'tool' %}{{ '<|im_start|>ipython\n' + message['content'] + '<|im_end|>\n' }}{% elif message['tool_calls'] %}{{ '<|im_start|>assistant\n' }}{% for c in message['tool_calls'] %}{{ '{\"name\": \"' + c['function']['name'] + '\", \"parameters\": ' }}{{ c['function']['arguments'] | tojson }}{{ '}' }}{% endfor %}{{ '<|im_end|>\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The tiny vocabulary: specials, the 256 byte characters, then one token per merge.
pub fn tiny_vocab() -> Vec<String> {
    let mut v: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable =
            (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let c = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap();
            next += 1;
            c
        };
        v.push(c.to_string());
    }
    for m in MERGES {
        v.push(m.replace(' ', ""));
    }
    v
}

/// A small deterministic generator (splitmix64) for weights.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    fn fill(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

/// Writes a tiny model of `spec.arch` as GGUF bytes.
pub fn tiny_model_bytes(spec: &TinySpec) -> Vec<u8> {
    let vocab = tiny_vocab();
    let n_vocab = vocab.len();
    let mut rng = Rng(spec.seed);
    let mut w = Writer::new(3);
    let u32v = |v: usize| Value::U32(v as u32);
    let a = spec.arch;
    let k = |key: &str| format!("{a}.{key}");
    w.metadata("general.architecture", Value::String(a.into()))
        .metadata("general.name", Value::String("strata-tiny".into()))
        .metadata(&k("block_count"), u32v(spec.n_layers))
        .metadata(&k("context_length"), u32v(512))
        .metadata(&k("embedding_length"), u32v(spec.n_embd))
        .metadata(&k("feed_forward_length"), u32v(spec.n_ff))
        .metadata(&k("attention.head_count"), u32v(spec.n_head))
        .metadata(&k("attention.head_count_kv"), u32v(spec.n_head_kv))
        .metadata(&k("rope.freq_base"), Value::F32(10000.0))
        .metadata(&k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5))
        .metadata(&k("vocab_size"), u32v(n_vocab));
    if let Some(hd) = spec.head_dim {
        w.metadata(&k("attention.key_length"), u32v(hd))
            .metadata(&k("attention.value_length"), u32v(hd));
    }
    if a == "gemma3" {
        w.metadata(&k("attention.sliding_window"), u32v(spec.window));
    }
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
        .metadata("tokenizer.ggml.pre", Value::String("smollm".into()))
        .metadata("tokenizer.ggml.tokens", Value::strings(&vocab))
        .metadata(
            "tokenizer.ggml.token_type",
            Value::Array(
                ValueType::I32,
                (0..n_vocab)
                    .map(|i| Value::I32(if i < SPECIALS.len() { 3 } else { 1 }))
                    .collect(),
            ),
        )
        .metadata("tokenizer.ggml.merges", Value::strings(MERGES))
        .metadata("tokenizer.ggml.bos_token_id", u32v(1))
        .metadata("tokenizer.ggml.eos_token_id", u32v(2))
        .metadata("tokenizer.ggml.add_bos_token", Value::Bool(false))
        .metadata(
            "tokenizer.chat_template",
            Value::String(spec.chat_template.into()),
        );

    let matrix =
        |w: &mut Writer, name: &str, n_cols: usize, n_rows: usize, ty: GgmlType, rng: &mut Rng| {
            let scale = 1.0 / (n_cols as f32).sqrt();
            let data = rng.fill(n_cols * n_rows, scale * 1.7);
            w.tensor(
                name,
                &[n_cols as u64, n_rows as u64],
                ty,
                quant::quantize(ty, &data).expect("quantize"),
            );
        };
    let norm = |w: &mut Writer, name: &str, n: usize, rng: &mut Rng| {
        let data: Vec<f32> = (0..n).map(|_| 1.0 + 0.1 * rng.next()).collect();
        w.tensor(
            name,
            &[n as u64],
            GgmlType::F32,
            quant::quantize(GgmlType::F32, &data).unwrap(),
        );
    };
    let hd = spec.head_dim.unwrap_or(spec.n_embd / spec.n_head);
    let (d, q, kv, ff, ty) = (
        spec.n_embd,
        hd * spec.n_head,
        hd * spec.n_head_kv,
        spec.n_ff,
        spec.weight_type,
    );
    let vector = |w: &mut Writer, name: &str, n: usize, rng: &mut Rng| {
        let data = rng.fill(n, 0.3);
        w.tensor(
            name,
            &[n as u64],
            GgmlType::F32,
            quant::quantize(GgmlType::F32, &data).unwrap(),
        );
    };
    let (bias, qk_norm, post_norms) = (a == "qwen2", a == "qwen3" || a == "gemma3", a == "gemma3");
    let embd = rng.fill(d * n_vocab, 1.0);
    w.tensor(
        "token_embd.weight",
        &[d as u64, n_vocab as u64],
        spec.embd_type,
        quant::quantize(spec.embd_type, &embd).expect("quantize"),
    );
    for i in 0..spec.n_layers {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        let b = |s: &str| format!("blk.{i}.{s}.bias");
        norm(&mut w, &n("attn_norm"), d, &mut rng);
        matrix(&mut w, &n("attn_q"), d, q, ty, &mut rng);
        matrix(&mut w, &n("attn_k"), d, kv, ty, &mut rng);
        matrix(&mut w, &n("attn_v"), d, kv, ty, &mut rng);
        if bias {
            vector(&mut w, &b("attn_q"), q, &mut rng);
            vector(&mut w, &b("attn_k"), kv, &mut rng);
            vector(&mut w, &b("attn_v"), kv, &mut rng);
        }
        if qk_norm {
            norm(&mut w, &n("attn_q_norm"), hd, &mut rng);
            norm(&mut w, &n("attn_k_norm"), hd, &mut rng);
        }
        matrix(&mut w, &n("attn_output"), q, d, ty, &mut rng);
        if post_norms {
            norm(&mut w, &n("post_attention_norm"), d, &mut rng);
        }
        norm(&mut w, &n("ffn_norm"), d, &mut rng);
        matrix(&mut w, &n("ffn_gate"), d, ff, ty, &mut rng);
        matrix(&mut w, &n("ffn_up"), d, ff, ty, &mut rng);
        matrix(&mut w, &n("ffn_down"), ff, d, ty, &mut rng);
        if post_norms {
            norm(&mut w, &n("post_ffw_norm"), d, &mut rng);
        }
    }
    norm(&mut w, "output_norm.weight", d, &mut rng);
    if !spec.tied_head {
        matrix(
            &mut w,
            "output.weight",
            d,
            n_vocab,
            spec.embd_type,
            &mut rng,
        );
    }
    w.to_bytes()
}

/// Writes a tiny model to a fresh file under the system temp dir and returns its path.
pub fn write_tiny_model(spec: &TinySpec, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-testkit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    let path = dir.join(format!("{name}.gguf"));
    // Write then rename, so tests running in parallel never read a half-written file.
    let tmp = dir.join(format!("{name}.{:?}.tmp", std::thread::current().id()));
    std::fs::write(&tmp, tiny_model_bytes(spec)).expect("write tiny model");
    std::fs::rename(&tmp, &path).expect("rename tiny model");
    path
}

/// The repository root: two levels above the running test's crate (cargo and nextest give
/// its folder at run time), else above testkit's own as it was built. The run-time folder
/// comes first because one build cache serves several clones: testkit built in one clone is
/// reused unchanged by another, which must not look for its models in the first.
pub fn repo_root() -> PathBuf {
    let crate_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    crate_dir
        .join("../..")
        .canonicalize()
        .unwrap_or_else(|e| panic!("repo root above {}: {e}", crate_dir.display()))
}

/// The real model: `STRATA_MODEL` if set, else whatever `scripts/fetch-model.sh` prints (it is
/// cached and checksummed, so this is fast after the first time). Panics with the reason when
/// the model cannot be had: the real-model suite must not silently skip.
pub fn real_model() -> PathBuf {
    match std::env::var_os("STRATA_MODEL") {
        Some(p) => PathBuf::from(p),
        None => named_model("smollm2-135m"),
    }
}

/// A known model by name (`scripts/fetch-model.sh --list`), fetched, checksummed and cached
/// by that script the first time. Panics with the reason when it cannot be had.
pub fn named_model(name: &str) -> PathBuf {
    let script = repo_root().join("scripts/fetch-model.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg(name)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} {name} failed: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).expect("utf-8 path").trim())
}

/// The real models with llama.cpp reference files: (fetch name, reference file).
pub const REAL_MODELS: [(&str, &str); 3] = [
    (
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.json",
    ),
    (
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.json",
    ),
    ("gemma3-270m", "gemma-3-270m-q4_k_m.json"),
];

/// llama.cpp's reference outputs: `reference/` in the repository (llama.cpp's output for the
/// real models, kept as data so a lone clone passes its tests), or `STRATA_REFERENCE_DIR`.
pub fn reference_dir() -> PathBuf {
    match std::env::var_os("STRATA_REFERENCE_DIR") {
        Some(p) => PathBuf::from(p),
        None => repo_root().join("reference"),
    }
}

/// Reads a reference file as text.
pub fn reference_text(name: &str) -> String {
    let p = reference_dir().join(name);
    std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("cannot read reference {}: {e}", p.display()))
}

/// Writes the GGUF `bytes` as a split model of `n_parts` files in `dir`, as llama.cpp's
/// `gguf-split` lays one out: `PREFIX-00001-of-0000N.gguf` holds all the metadata, every part
/// its share of the tensors in file order (contiguous groups, so layers stay together) and
/// `split.no`, `split.count` and `split.tensors.count`. Returns the first part's path.
pub fn write_split(bytes: &[u8], dir: &Path, prefix: &str, n_parts: usize) -> PathBuf {
    let f = gguf::GgufFile::from_bytes(bytes.to_vec()).expect("a valid GGUF to split");
    let tensors = f.header().tensors();
    let per_part = tensors.len().div_ceil(n_parts);
    std::fs::create_dir_all(dir).expect("create the split's directory");
    for (no, group) in tensors.chunks(per_part).enumerate() {
        let mut w = Writer::new(3);
        if no == 0 {
            for (k, v) in f.header().metadata() {
                w.metadata(k, v.clone());
            }
        }
        w.metadata("split.no", Value::U16(no as u16));
        w.metadata("split.count", Value::U16(n_parts as u16));
        w.metadata("split.tensors.count", Value::I32(tensors.len() as i32));
        for t in group {
            w.tensor(&t.name, &t.shape, t.ty, f.data(t).to_vec());
        }
        let path = dir.join(format!("{prefix}-{:05}-of-{n_parts:05}.gguf", no + 1));
        std::fs::write(&path, w.to_bytes()).expect("write a part");
    }
    dir.join(format!("{prefix}-00001-of-{n_parts:05}.gguf"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clone of the repository alone, with nothing beside it, has every reference file the
    /// tests read.
    #[test]
    fn reference_data_lives_in_the_repository() {
        if std::env::var_os("STRATA_REFERENCE_DIR").is_some() {
            return;
        }
        let dir = reference_dir();
        assert!(dir.starts_with(repo_root()), "{}", dir.display());
        for name in ["greedy_public.json", "tokenizer_public.json"] {
            let text = reference_text(name);
            assert!(text.trim_start().starts_with('{'), "{name} is not JSON");
        }
    }
}
