//! The one error type of the `gguf` crate.

/// Everything that can go wrong while reading, validating or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("i/o error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("bad magic {found:#010x}: not a GGUF file (expected 0x46554747, \"GGUF\")")]
    BadMagic { found: u32 },
    #[error("unsupported GGUF version {version} (supported: 2 and 3)")]
    UnsupportedVersion { version: u32 },
    #[error("truncated file: {field} needs {needed} bytes at offset {offset} but only {available} remain")]
    Truncated {
        field: String,
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error("{field} is {count}, which cannot fit in the {available} bytes that remain (at least {min_each} bytes each)")]
    CountTooLarge {
        field: String,
        count: u64,
        min_each: u64,
        available: u64,
    },
    #[error("{field}: string is not valid UTF-8")]
    InvalidUtf8 { field: String },
    #[error("{field}: unknown metadata value type {type_id}")]
    UnknownValueType { field: String, type_id: u32 },
    #[error("{field}: arrays nested deeper than {max_depth} levels")]
    NestingTooDeep { field: String, max_depth: usize },
    #[error("duplicate metadata key `{key}`")]
    DuplicateKey { key: String },
    #[error("duplicate tensor name `{name}`")]
    DuplicateTensor { name: String },
    #[error("tensor `{tensor}` has unsupported type id {type_id}")]
    UnsupportedTensorType { tensor: String, type_id: u32 },
    #[error("tensor `{tensor}` has {n_dims} dimensions (at most {max} are allowed)")]
    TooManyDims {
        tensor: String,
        n_dims: u32,
        max: usize,
    },
    #[error("tensor `{tensor}` has shape {shape:?}, whose element count overflows")]
    ShapeOverflow { tensor: String, shape: Vec<u64> },
    #[error("tensor `{tensor}` has a zero dimension in shape {shape:?}")]
    ZeroDim { tensor: String, shape: Vec<u64> },
    #[error(
        "tensor `{tensor}`: first dimension {ne0} is not a multiple of the {ty} block size {block}"
    )]
    BadBlockMultiple {
        tensor: String,
        ne0: u64,
        ty: &'static str,
        block: u64,
    },
    #[error("tensor `{tensor}`: offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error("tensor `{tensor}`: data [{offset}, {end}) lies outside the data section of {data_len} bytes")]
    TensorOutOfBounds {
        tensor: String,
        offset: u64,
        end: u64,
        data_len: u64,
    },
    #[error("`general.alignment` is {alignment}; it must be a nonzero power of two")]
    BadAlignment { alignment: u64 },
    #[error("metadata key `{key}` is missing")]
    MissingKey { key: String },
    #[error("metadata key `{key}` has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },
    #[error("tensor `{name}` not found")]
    MissingTensor { name: String },
    #[error("tensor `{name}` is in none of the parts of this split model present here (absent: {absent})")]
    TensorInAbsentPart { name: String, absent: String },
    #[error("{path} is part {no} of a split model: open its first part, {first}")]
    NotFirstPart {
        path: String,
        no: u64,
        first: String,
    },
    #[error("split model part {path}: {why}")]
    BadPart { path: String, why: String },
    #[error("{what}: length {len} is not a multiple of {multiple}")]
    BadLength {
        what: &'static str,
        len: usize,
        multiple: usize,
    },
}
