//! GGUF: the file format strata loads models from.
//!
//! The key design decision: a GGUF file is untrusted input. [`parse`] walks the header with a
//! bounds-checked cursor and validates every count, length, dimension and offset against the
//! bytes actually present *before* allocating anything sized by them, so a truncated or hostile
//! file yields an [`Error`] that names the field and the numbers, never a panic or a huge
//! allocation. Tensor data is never copied by the reader: [`GgufFile`] keeps the file memory
//! mapped and hands out byte slices; callers copy only the tensors they need.
//!
//! The crate also owns the tensor encodings ([`GgmlType`] and the reference block codecs in
//! [`quant`]) and a [`Writer`] used to make small test models.

mod error;
mod file;
pub mod quant;
mod reader;
mod types;
mod value;
mod writer;

pub use error::Error;
pub use file::{GgufFile, InFile};
pub use reader::{parse, Header, TensorInfo};
pub use types::GgmlType;
pub use value::{Value, ValueType};
pub use writer::Writer;

/// Default alignment of the tensor data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The most dimensions a tensor may have (as in ggml).
pub const MAX_DIMS: usize = 4;
