//! A parsed GGUF file with its bytes (memory mapped, or owned for in-memory fixtures).

use std::path::Path;

use crate::{parse, Error, Header, TensorInfo};

enum Backing {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

/// A validated GGUF file. Tensor data is borrowed from the mapping, never copied here.
pub struct GgufFile {
    backing: Backing,
    header: Header,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.header.version)
            .field("n_tensors", &self.header.tensors().len())
            .field("n_bytes", &self.bytes().len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and validates the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let io = |source| Error::Io {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only; strata never writes model files while serving them,
        // and every access is bounds-checked against the length validated by `parse`.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let header = parse(&mmap)?;
        Ok(Self {
            backing: Backing::Mmap(mmap),
            header,
        })
    }

    /// Validates a file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, Error> {
        let header = parse(&bytes)?;
        Ok(Self {
            backing: Backing::Owned(bytes),
            header,
        })
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    fn bytes(&self) -> &[u8] {
        match &self.backing {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }

    /// The data of a tensor (bounds were checked by `parse`).
    pub fn data(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.header.data_offset + info.offset) as usize;
        &self.bytes()[start..start + info.n_bytes as usize]
    }

    /// Drops the whole pages of bytes `range` of a tensor's data (a loader has copied them)
    /// from this process's resident set, so a loader's memory is its copies, not the mapping
    /// as well. Nothing happens for a file read into memory.
    pub fn release(&self, info: &TensorInfo, range: std::ops::Range<usize>) {
        if let Backing::Mmap(m) = &self.backing {
            let page = 4096u64;
            let base = self.header.data_offset + info.offset;
            let start = (base + range.start as u64).div_ceil(page) * page;
            let end = (base + range.end.min(info.n_bytes as usize) as u64) / page * page;
            if end > start {
                // SAFETY: a read-only shared file mapping; DONTNEED only drops clean pages, which
                // are read back from the file if touched again.
                let _ = unsafe {
                    m.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        start as usize,
                        (end - start) as usize,
                    )
                };
            }
        }
    }

    /// Looks a tensor up by name.
    pub fn tensor(&self, name: &str) -> Result<(&TensorInfo, &[u8]), Error> {
        let info = self
            .header
            .tensor(name)
            .ok_or_else(|| Error::MissingTensor { name: name.into() })?;
        Ok((info, self.data(info)))
    }

    /// Total size of the file in bytes.
    pub fn len(&self) -> usize {
        self.bytes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes().is_empty()
    }
}
