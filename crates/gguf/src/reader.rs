//! The bounds-checked header parser.

use std::collections::HashMap;

use crate::{Error, GgmlType, Value, ValueType, DEFAULT_ALIGNMENT, MAX_DIMS};

const MAGIC: u32 = 0x4655_4747;
const MAX_ARRAY_DEPTH: usize = 2;
/// The smallest tensor info record: name length, n_dims, type, offset.
const MIN_TENSOR_INFO: u64 = 8 + 4 + 4 + 8;
/// The smallest metadata record: key length, value type, one byte of value.
const MIN_KV: u64 = 8 + 4 + 1;

/// One tensor's index entry. `offset` is relative to the start of the data section.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions, innermost (contiguous) first, as in ggml's `ne`.
    pub shape: Vec<u64>,
    pub ty: GgmlType,
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Everything before the tensor data: version, metadata, tensor index, data offset.
#[derive(Debug, Clone)]
pub struct Header {
    pub version: u32,
    pub alignment: u64,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
    metadata: Vec<(String, Value)>,
    metadata_idx: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_idx: HashMap<String, usize>,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, field: &dyn Fn() -> String) -> Result<&'a [u8], Error> {
        if n > self.remaining() {
            return Err(Error::Truncated {
                field: field(),
                offset: self.pos as u64,
                needed: n,
                available: self.remaining(),
            });
        }
        let n = n as usize;
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, field: &dyn Fn() -> String) -> Result<[u8; N], Error> {
        let s = self.take(N as u64, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, field: &dyn Fn() -> String) -> Result<u32, Error> {
        self.array::<4>(field).map(u32::from_le_bytes)
    }

    fn u64(&mut self, field: &dyn Fn() -> String) -> Result<u64, Error> {
        self.array::<8>(field).map(u64::from_le_bytes)
    }

    /// Checks that `count` items of at least `min_each` bytes can still be present.
    fn check_count(
        &self,
        count: u64,
        min_each: u64,
        field: &dyn Fn() -> String,
    ) -> Result<(), Error> {
        let fits = count
            .checked_mul(min_each)
            .is_some_and(|b| b <= self.remaining());
        if fits {
            Ok(())
        } else {
            Err(Error::CountTooLarge {
                field: field(),
                count,
                min_each,
                available: self.remaining(),
            })
        }
    }

    fn string(&mut self, field: &dyn Fn() -> String) -> Result<String, Error> {
        let len = self.u64(&|| format!("{} (length)", field()))?;
        let bytes = self.take(len, field)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| Error::InvalidUtf8 { field: field() })
    }

    fn value(
        &mut self,
        ty: ValueType,
        depth: usize,
        field: &dyn Fn() -> String,
    ) -> Result<Value, Error> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(field)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(field)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(field)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(field)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(field)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(field)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(field)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(field)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(field)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(field)?)),
            ValueType::Bool => Value::Bool(self.array::<1>(field)?[0] != 0),
            ValueType::String => Value::String(self.string(field)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(Error::NestingTooDeep {
                        field: field(),
                        max_depth: MAX_ARRAY_DEPTH,
                    });
                }
                let type_id = self.u32(&|| format!("{} (array element type)", field()))?;
                let elem = ValueType::from_id(type_id).ok_or_else(|| Error::UnknownValueType {
                    field: field(),
                    type_id,
                })?;
                let count = self.u64(&|| format!("{} (array length)", field()))?;
                let count_field = || format!("{} (array length)", field());
                self.check_count(count, elem.min_size(), &count_field)?;
                let mut items = Vec::with_capacity(count as usize);
                for i in 0..count {
                    let item_field = || format!("{}[{i}]", field());
                    items.push(self.value(elem, depth + 1, &item_field)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

/// Parses and validates the header of a GGUF file held in `bytes` (the whole file).
pub fn parse(bytes: &[u8]) -> Result<Header, Error> {
    let mut c = Cursor { bytes, pos: 0 };
    let magic = c.u32(&|| "magic".into())?;
    if magic != MAGIC {
        return Err(Error::BadMagic { found: magic });
    }
    let version = c.u32(&|| "version".into())?;
    if !(2..=3).contains(&version) {
        return Err(Error::UnsupportedVersion { version });
    }
    let n_tensors = c.u64(&|| "tensor_count".into())?;
    let n_kv = c.u64(&|| "metadata_kv_count".into())?;
    c.check_count(n_kv, MIN_KV, &|| "metadata_kv_count".into())?;
    c.check_count(n_tensors, MIN_TENSOR_INFO, &|| "tensor_count".into())?;

    let mut metadata = Vec::with_capacity(n_kv as usize);
    let mut metadata_idx = HashMap::with_capacity(n_kv as usize);
    for kv_idx in 0..n_kv {
        let key = c.string(&|| format!("metadata[{kv_idx}].key"))?;
        let type_id = c.u32(&|| format!("metadata `{key}` (value type)"))?;
        let ty = ValueType::from_id(type_id).ok_or_else(|| Error::UnknownValueType {
            field: format!("metadata `{key}`"),
            type_id,
        })?;
        let value = c.value(ty, 0, &|| format!("metadata `{key}`"))?;
        if metadata_idx.insert(key.clone(), metadata.len()).is_some() {
            return Err(Error::DuplicateKey { key });
        }
        metadata.push((key, value));
    }

    let alignment = match metadata_idx.get("general.alignment") {
        Some(&i) => {
            let a = metadata[i].1.as_u64().unwrap_or(0);
            if a == 0 || !a.is_power_of_two() {
                return Err(Error::BadAlignment { alignment: a });
            }
            a
        }
        None => DEFAULT_ALIGNMENT,
    };

    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut tensor_idx = HashMap::with_capacity(n_tensors as usize);
    for t_idx in 0..n_tensors {
        let name = c.string(&|| format!("tensor[{t_idx}].name"))?;
        let n_dims = c.u32(&|| format!("tensor `{name}` (n_dims)"))?;
        if n_dims as usize > MAX_DIMS || n_dims == 0 {
            return Err(Error::TooManyDims {
                tensor: name,
                n_dims,
                max: MAX_DIMS,
            });
        }
        let mut shape = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            shape.push(c.u64(&|| format!("tensor `{name}` (dim {d})"))?);
        }
        let type_id = c.u32(&|| format!("tensor `{name}` (type)"))?;
        let ty = GgmlType::from_id(type_id, &name)?;
        let offset = c.u64(&|| format!("tensor `{name}` (offset)"))?;
        if shape.contains(&0) {
            return Err(Error::ZeroDim {
                tensor: name,
                shape,
            });
        }
        let n_elements = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| Error::ShapeOverflow {
                tensor: name.clone(),
                shape: shape.clone(),
            })?;
        let block = ty.block_size() as u64;
        if shape[0] % block != 0 {
            return Err(Error::BadBlockMultiple {
                tensor: name,
                ne0: shape[0],
                ty: ty.name(),
                block,
            });
        }
        let n_bytes = (n_elements / block)
            .checked_mul(ty.type_size() as u64)
            .ok_or_else(|| Error::ShapeOverflow {
                tensor: name.clone(),
                shape: shape.clone(),
            })?;
        if offset % alignment != 0 {
            return Err(Error::MisalignedTensor {
                tensor: name,
                offset,
                alignment,
            });
        }
        if tensor_idx.insert(name.clone(), tensors.len()).is_some() {
            return Err(Error::DuplicateTensor { name });
        }
        tensors.push(TensorInfo {
            name,
            shape,
            ty,
            offset,
            n_bytes,
        });
    }

    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let data_len = (bytes.len() as u64).saturating_sub(data_offset);
    for t in &tensors {
        let end = t.offset.saturating_add(t.n_bytes);
        if end > data_len {
            return Err(Error::TensorOutOfBounds {
                tensor: t.name.clone(),
                offset: t.offset,
                end,
                data_len,
            });
        }
    }

    Ok(Header {
        version,
        alignment,
        data_offset,
        metadata,
        metadata_idx,
        tensors,
        tensor_idx,
    })
}

impl Header {
    /// Adds the tensors of another part of a split model to this (the first) part's index.
    pub(crate) fn add_tensors(&mut self, other: &Header) -> Result<(), Error> {
        for t in &other.tensors {
            if self
                .tensor_idx
                .insert(t.name.clone(), self.tensors.len())
                .is_some()
            {
                return Err(Error::DuplicateTensor {
                    name: t.name.clone(),
                });
            }
            self.tensors.push(t.clone());
        }
        Ok(())
    }

    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata_idx.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_idx.get(name).map(|&i| &self.tensors[i])
    }

    fn require(&self, key: &str) -> Result<&Value, Error> {
        self.get(key)
            .ok_or_else(|| Error::MissingKey { key: key.into() })
    }

    fn wrong(key: &str, expected: &'static str, v: &Value) -> Error {
        Error::WrongType {
            key: key.into(),
            expected,
            found: v.type_name(),
        }
    }

    /// A required non-negative integer of any width.
    pub fn u64(&self, key: &str) -> Result<u64, Error> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| Self::wrong(key, "unsigned integer", v))
    }

    /// A required float (f32, f64 or an integer).
    pub fn f64(&self, key: &str) -> Result<f64, Error> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| Self::wrong(key, "number", v))
    }

    pub fn str(&self, key: &str) -> Result<&str, Error> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::wrong(key, "string", v))
    }

    pub fn array(&self, key: &str) -> Result<&[Value], Error> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| Self::wrong(key, "array", v))
    }

    /// An optional value: `Ok(None)` when absent, an error when present with the wrong type.
    pub fn opt<T>(
        &self,
        key: &str,
        f: impl Fn(&Self, &str) -> Result<T, Error>,
    ) -> Result<Option<T>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => f(self, key).map(Some),
        }
    }

    pub fn bool(&self, key: &str) -> Result<bool, Error> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| Self::wrong(key, "bool", v))
    }
}
