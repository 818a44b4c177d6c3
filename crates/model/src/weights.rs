//! Loading the weights of one contiguous layer range.

use gguf::GgufFile;

use crate::config::LlamaConfig;
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

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: QMatrix,
    pub wk: QMatrix,
    pub wv: QMatrix,
    pub wo: QMatrix,
    pub ffn_norm: Vec<f32>,
    pub w_gate: QMatrix,
    pub w_up: QMatrix,
    pub w_down: QMatrix,
}

/// The weights a range needs: its layers, plus the embedding when it starts at layer 0 and the
/// final norm and output head when it ends at the last layer. Tensor bytes are copied out of the
/// mapping so resident memory is exactly what the range holds.
pub struct Weights {
    pub embd: Option<QMatrix>,
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
    Ok(QMatrix::new(
        info.ty,
        n_rows,
        n_cols,
        f.copy_tensor(info),
        pack,
    ))
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
        c: &LlamaConfig,
        range: LayerRange,
        pack: bool,
    ) -> Result<Self, Error> {
        let kv = c.kv_dim();
        let layers = (range.start..range.end)
            .map(|i| {
                let n = |s: &str| format!("blk.{i}.{s}.weight");
                Ok(LayerWeights {
                    attn_norm: vector(f, &n("attn_norm"), c.n_embd)?,
                    wq: matrix(f, &n("attn_q"), c.n_embd, c.n_embd, pack)?,
                    wk: matrix(f, &n("attn_k"), c.n_embd, kv, pack)?,
                    wv: matrix(f, &n("attn_v"), c.n_embd, kv, pack)?,
                    wo: matrix(f, &n("attn_output"), c.n_embd, c.n_embd, pack)?,
                    ffn_norm: vector(f, &n("ffn_norm"), c.n_embd)?,
                    w_gate: matrix(f, &n("ffn_gate"), c.n_embd, c.n_ff, pack)?,
                    w_up: matrix(f, &n("ffn_up"), c.n_embd, c.n_ff, pack)?,
                    w_down: matrix(f, &n("ffn_down"), c.n_ff, c.n_embd, pack)?,
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let first = range.start == 0;
        let last = range.end == c.n_layers;
        let embd = first
            .then(|| matrix(f, "token_embd.weight", c.n_embd, c.n_vocab, pack))
            .transpose()?;
        let (output_norm, output) = if last {
            let head = match (f.header().tensor("output.weight"), &embd) {
                (Some(_), _) => matrix(f, "output.weight", c.n_embd, c.n_vocab, pack)?,
                // A tied head: share the embedding's bytes when this range holds it.
                (None, Some(e)) => e.clone(),
                (None, None) => matrix(f, "token_embd.weight", c.n_embd, c.n_vocab, pack)?,
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

    /// Bytes of weights held (what this range costs in memory; shared bytes count once).
    pub fn n_bytes(&self) -> usize {
        let m = |q: &QMatrix| q.data.len();
        let shared_head = match (&self.embd, &self.output) {
            (Some(e), Some(o)) if std::sync::Arc::ptr_eq(&e.data, &o.data) => o.data.len(),
            _ => 0,
        };
        let v = |x: &Vec<f32>| x.len() * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                v(&l.attn_norm)
                    + v(&l.ffn_norm)
                    + m(&l.wq)
                    + m(&l.wk)
                    + m(&l.wv)
                    + m(&l.wo)
                    + m(&l.w_gate)
                    + m(&l.w_up)
                    + m(&l.w_down)
            })
            .sum();
        layers + self.embd.as_ref().map_or(0, m) + self.output.as_ref().map_or(0, m) - shared_head
            + self.output_norm.as_ref().map_or(0, v)
    }
}
