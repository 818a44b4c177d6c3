//! A GGUF writer, used to make test models and corrupt variants of them.

use crate::{GgmlType, Value, ValueType, DEFAULT_ALIGNMENT};

struct PendingTensor {
    name: String,
    shape: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// Builds a GGUF file in memory. Shapes are innermost-first, as in ggml.
pub struct Writer {
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for Writer {
    fn default() -> Self {
        Self::new(3)
    }
}

impl Writer {
    pub fn new(version: u32) -> Self {
        Self {
            version,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    pub fn metadata(&mut self, key: &str, value: Value) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor whose `data` is already encoded as `ty`.
    pub fn tensor(&mut self, name: &str, shape: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            shape: shape.to_vec(),
            ty,
            data,
        });
        self
    }

    fn alignment(&self) -> u64 {
        self.metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// Serializes the file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment() as usize;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for d in &t.shape {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&(t.ty as u32).to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len()).div_ceil(align) * align;
        }
        let data_start = out.len().div_ceil(align) * align;
        out.resize(data_start, 0);
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend_from_slice(&t.data);
        }
        out
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(ty, items) => {
            out.extend_from_slice(&(*ty as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                debug_assert_eq!(item.value_type(), *ty);
                put_value(out, item);
            }
        }
    }
}

impl Value {
    /// An array of strings.
    pub fn strings<S: AsRef<str>>(items: impl IntoIterator<Item = S>) -> Value {
        Value::Array(
            ValueType::String,
            items
                .into_iter()
                .map(|s| Value::String(s.as_ref().to_string()))
                .collect(),
        )
    }
}
