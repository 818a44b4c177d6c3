//! Loading the weights of one contiguous layer range.

use gguf::GgufFile;

use crate::config::ModelConfig;
use crate::kernels::packed::PackKind;
use crate::matmul::QMatrix;
use crate::Error;

/// A contiguous range of layers `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerRange {
    pub start: usize,
    pub end: usize,
}

impl LayerRange {
    pub fn new(start: usize, end: usize, n_layers: usize) -> Result<Self, Error> {
        if start >= end || end > n_layers {
            return Err(Error::BadRange {
                start,
                end,
                n_layers,
            });
        }
        Ok(LayerRange { start, end })
    }

    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
}

impl std::fmt::Display for LayerRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

/// One layer's tensors; the optional ones exist exactly when the family's block has them
/// ([`crate::config::BlockSpec`]).
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: QMatrix,
    pub wk: QMatrix,
    pub wv: QMatrix,
    /// Q, K and V biases (`qkv_bias`).
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// Per-head Q and K norm weights, `head_dim` each (`qk_norm`).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub wo: QMatrix,
    /// Norm of the attention output before the residual add (`post_attn_norm`).
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: QMatrix,
    pub w_up: QMatrix,
    pub w_down: QMatrix,
    /// Norm of the FFN output before the residual add (`post_ffn_norm`).
    pub post_ffn_norm: Option<Vec<f32>>,
}

impl LayerWeights {
    fn load(f: &GgufFile, c: &ModelConfig, i: usize, pack: bool) -> Result<Self, Error> {
        let (d, q, kv, b) = (c.n_embd, c.q_dim(), c.kv_dim(), &c.block);
        let w = |s: &str| format!("blk.{i}.{s}.weight");
        let bias = |s: &str| format!("blk.{i}.{s}.bias");
        let opt = |on: bool, name: String, n: usize| on.then(|| vector(f, &name, n)).transpose();
        Ok(LayerWeights {
            attn_norm: vector(f, &w("attn_norm"), d)?,
            wq: matrix(f, &w("attn_q"), d, q, pack)?,
            wk: matrix(f, &w("attn_k"), d, kv, pack)?,
            wv: matrix(f, &w("attn_v"), d, kv, pack)?,
            bq: opt(b.qkv_bias, bias("attn_q"), q)?,
            bk: opt(b.qkv_bias, bias("attn_k"), kv)?,
            bv: opt(b.qkv_bias, bias("attn_v"), kv)?,
            q_norm: opt(b.qk_norm, w("attn_q_norm"), c.head_dim)?,
            k_norm: opt(b.qk_norm, w("attn_k_norm"), c.head_dim)?,
            wo: matrix(f, &w("attn_output"), q, d, pack)?,
            post_attn_norm: opt(b.post_attn_norm, w("post_attention_norm"), d)?,
            ffn_norm: vector(f, &w("ffn_norm"), d)?,
            w_gate: matrix(f, &w("ffn_gate"), d, c.n_ff, pack)?,
            w_up: matrix(f, &w("ffn_up"), d, c.n_ff, pack)?,
            w_down: matrix(f, &w("ffn_down"), c.n_ff, d, pack)?,
            post_ffn_norm: opt(b.post_ffn_norm, w("post_ffw_norm"), d)?,
        })
    }

    /// Bytes this layer holds.
    fn n_bytes(&self) -> usize {
        let m = |q: &QMatrix| q.data.len();
        let v = |x: &Vec<f32>| x.len() * 4;
        let o = |x: &Option<Vec<f32>>| x.as_ref().map_or(0, v);
        [
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.w_gate,
            &self.w_up,
            &self.w_down,
        ]
        .into_iter()
        .map(m)
        .sum::<usize>()
            + v(&self.attn_norm)
            + v(&self.ffn_norm)
            + [&self.bq, &self.bk, &self.bv, &self.q_norm, &self.k_norm]
                .into_iter()
                .map(o)
                .sum::<usize>()
            + o(&self.post_attn_norm)
            + o(&self.post_ffn_norm)
    }
}

/// The weights a range needs: its layers, plus the embedding when it starts at layer 0 and the
/// final norm and output head when it ends at the last layer. Tensor bytes are copied out of the
/// mapping so resident memory is exactly what the range holds.
pub struct Weights {
    pub embd: Option<Embedding>,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Option<Vec<f32>>,
    pub output: Option<QMatrix>,
}

fn matrix(
    f: &GgufFile,
    name: &str,
    n_cols: usize,
    n_rows: usize,
    pack: bool,
) -> Result<QMatrix, Error> {
    let (info, _) = f.tensor(name)?;
    let expected = vec![n_cols as u64, n_rows as u64];
    if info.shape != expected {
        return Err(Error::BadShape {
            name: name.into(),
            found: info.shape.clone(),
            expected,
        });
    }
    if pack && PackKind::of(info.ty).is_some() {
        // Packed straight from the mapping, whose pages are dropped as they are consumed.
        let src = f.data(info);
        return Ok(QMatrix::packed_from(info.ty, n_rows, n_cols, src, |n| {
            f.release(info, 0..n)
        }));
    }
    // Copied straight from the mapping, whose pages are dropped once consumed.
    let src = f.data(info);
    let m = QMatrix::copied_from(info.ty, n_rows, n_cols, src);
    f.release(info, 0..src.len());
    Ok(m)
}

/// The token embedding: a row looked up per token.
pub enum Embedding {
    /// Held in memory: the range's output head too (tied), or a file read into memory.
    Held(QMatrix),
    /// Read from the model file a row at a time, in ggml's layout: it costs no resident memory
    /// (a 150k-token vocabulary's table is 90 to 200 MiB, of which a conversation uses a few
    /// thousand rows), and a row read costs far less than the layers computing on it.
    InFile {
        ty: gguf::GgmlType,
        n_cols: usize,
        rows: gguf::InFile,
    },
}

impl Embedding {
    /// Decodes row `r` into `out` (`buf`: room for the encoded row, reused across calls).
    pub fn dequantize_row(
        &self,
        r: usize,
        out: &mut [f32],
        buf: &mut Vec<u8>,
    ) -> Result<(), Error> {
        match self {
            Embedding::Held(m) => m.dequantize_row(r, out),
            Embedding::InFile { ty, n_cols, rows } => {
                let row_bytes = ty.row_bytes(*n_cols);
                buf.resize(row_bytes, 0);
                rows.read_at((r * row_bytes) as u64, buf)?;
                gguf::quant::dequantize(*ty, buf, out)?;
            }
        }
        Ok(())
    }

    /// Whether the rows can still be read as they were loaded (an embedding read from a file
    /// that changed since cannot): checked once per step, before its rows are read.
    pub fn check(&self) -> Result<(), Error> {
        match self {
            Embedding::Held(_) => Ok(()),
            Embedding::InFile { rows, .. } => Ok(rows.check_unchanged()?),
        }
    }

    /// Bytes it holds in memory.
    fn held_bytes(&self) -> usize {
        match self {
            Embedding::Held(m) => m.data.len(),
            Embedding::InFile { .. } => 0,
        }
    }
}

/// The token embedding of a range that does not also use it as its output head: left in the
/// file (see [`Embedding::InFile`]), or copied for a file read into memory.
fn embedding(f: &GgufFile, c: &ModelConfig) -> Result<Embedding, Error> {
    let name = "token_embd.weight";
    let (info, src) = f.tensor(name)?;
    let expected = vec![c.n_embd as u64, c.n_vocab as u64];
    if info.shape != expected {
        return Err(Error::BadShape {
            name: name.into(),
            found: info.shape.clone(),
            expected,
        });
    }
    Ok(match f.in_file(info) {
        Some(rows) => Embedding::InFile {
            ty: info.ty,
            n_cols: c.n_embd,
            rows,
        },
        None => Embedding::Held(QMatrix::copied_from(info.ty, c.n_vocab, c.n_embd, src)),
    })
}

fn vector(f: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>, Error> {
    let (info, data) = f.tensor(name)?;
    if info.shape != [n as u64] {
        return Err(Error::BadShape {
            name: name.into(),
            found: info.shape.clone(),
            expected: vec![n as u64],
        });
    }
    let mut out = vec![0f32; n];
    gguf::quant::dequantize(info.ty, data, &mut out)?;
    Ok(out)
}

impl Weights {
    /// Loads `range`; matrices with a packed form are repacked when `pack` is set.
    pub fn load(
        f: &GgufFile,
        c: &ModelConfig,
        range: LayerRange,
        pack: bool,
    ) -> Result<Self, Error> {
        let layers = (range.start..range.end)
            .map(|i| LayerWeights::load(f, c, i, pack))
            .collect::<Result<Vec<_>, Error>>()?;
        let first = range.start == 0;
        let last = range.end == c.n_layers;
        let tied = f.header().tensor("output.weight").is_none();
        let embd = if !first {
            None
        } else if tied && last {
            // Also the output head, which reads all of it every token: loaded like a matrix.
            Some(Embedding::Held(matrix(
                f,
                "token_embd.weight",
                c.n_embd,
                c.n_vocab,
                pack,
            )?))
        } else {
            Some(embedding(f, c)?)
        };
        let (output_norm, output) = if last {
            if f.header().tensor("output.weight").is_none() && !f.absent_parts().is_empty() {
                // Tied to the embedding, or in a part not present: which, cannot be told.
                f.tensor("output.weight")?;
            }
            let head = match (f.header().tensor("output.weight"), &embd) {
                (Some(_), _) => matrix(f, "output.weight", c.n_embd, c.n_vocab, pack)?,
                // A tied head: share the embedding's bytes when this range holds it.
                (None, Some(Embedding::Held(e))) => e.clone(),
                (None, _) => matrix(f, "token_embd.weight", c.n_embd, c.n_vocab, pack)?,
            };
            (Some(vector(f, "output_norm.weight", c.n_embd)?), Some(head))
        } else {
            (None, None)
        };
        Ok(Weights {
            embd,
            layers,
            output_norm,
            output,
        })
    }

    /// Bytes of the embedding read from the model file a row at a time (not held).
    pub fn in_file_bytes(&self) -> usize {
        match &self.embd {
            Some(Embedding::InFile { rows, .. }) => rows.len() as usize,
            _ => 0,
        }
    }

    /// Bytes of weights held (what this range costs in memory; shared bytes count once).
    pub fn n_bytes(&self) -> usize {
        let m = |q: &QMatrix| q.data.len();
        let shared_head = match (&self.embd, &self.output) {
            (Some(Embedding::Held(e)), Some(o)) if std::sync::Arc::ptr_eq(&e.data, &o.data) => {
                o.data.len()
            }
            _ => 0,
        };
        let v = |x: &Vec<f32>| x.len() * 4;
        let layers: usize = self.layers.iter().map(LayerWeights::n_bytes).sum();
        layers
            + self.embd.as_ref().map_or(0, Embedding::held_bytes)
            + self.output.as_ref().map_or(0, m)
            - shared_head
            + self.output_norm.as_ref().map_or(0, v)
    }
}

/// What each part of a model costs in memory once loaded from its file (matrices repacked as
/// the kernels of every instruction set hold them), read from the file's header alone: for a
/// shard choosing its layer range before it loads one (`strata shard --layers auto`). A model
/// read into memory ([`GgufFile::from_bytes`], fixtures) also holds its embedding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightSizes {
    /// Bytes of each layer's tensors.
    pub layers: Vec<u64>,
    /// The output head and its norm (held by a range ending at the last layer; a head tied to
    /// the embedding is the embedding, looked up there too). A range starting at layer 0 holds
    /// no other embedding: it reads it from the file a row at a time ([`Embedding::InFile`]).
    pub head: u64,
    pub output_norm: u64,
}

impl WeightSizes {
    /// Reads the sizes from `f`'s header (no tensor data is read).
    pub fn of(f: &GgufFile) -> Result<WeightSizes, Error> {
        let h = f.header();
        let c = ModelConfig::from_header(h)?;
        let size = |name: &str| -> Result<u64, Error> {
            let info = h
                .tensor(name)
                .ok_or_else(|| gguf::Error::MissingTensor { name: name.into() })?;
            Ok(loaded_bytes(info))
        };
        let mut layers = vec![0u64; c.n_layers];
        for info in h.tensors() {
            let Some(rest) = info.name.strip_prefix("blk.") else {
                continue;
            };
            let layer = rest.split('.').next().and_then(|i| i.parse::<usize>().ok());
            if let Some(bytes) = layer.and_then(|i| layers.get_mut(i)) {
                *bytes += loaded_bytes(info);
            }
        }
        let tied = h.tensor("output.weight").is_none();
        Ok(WeightSizes {
            layers,
            head: size(if tied {
                "token_embd.weight"
            } else {
                "output.weight"
            })?,
            output_norm: size("output_norm.weight")?,
        })
    }

    /// Bytes a shard of layers `start..end` holds (as [`Weights::n_bytes`] counts them).
    pub fn range(&self, start: usize, end: usize) -> u64 {
        let mut bytes: u64 = self.layers[start..end].iter().sum();
        if end == self.layers.len() {
            bytes += self.output_norm + self.head;
        }
        bytes
    }
}

/// A tensor's bytes once loaded: a matrix with a packed form as whole panels of
/// [`crate::kernels::packed::PANEL`] rows, another matrix as in the file, a vector as f32.
fn loaded_bytes(info: &gguf::TensorInfo) -> u64 {
    match (info.shape.as_slice(), PackKind::of(info.ty)) {
        (&[cols, rows], Some(kind)) if (cols as usize).is_multiple_of(kind.block_values()) => {
            let layout = crate::kernels::packed::Layout::new(kind, cols as usize);
            (rows as usize).div_ceil(crate::kernels::packed::PANEL) as u64
                * layout.panel_bytes() as u64
        }
        (&[_, _], _) => info.n_bytes,
        (&[n], _) => 4 * n,
        _ => info.n_bytes,
    }
}
