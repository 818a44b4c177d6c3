//! A parsed GGUF file with its bytes (memory mapped, or owned for in-memory fixtures), or a
//! model split into several files (`NAME-00001-of-00003.gguf`, as llama.cpp's `gguf-split`
//! writes them), read as one.
//!
//! A split model's first part holds all its metadata and `split.count`; every part is a GGUF
//! of its own holding some of the tensors (and `split.no`, its index from 0). Opening the first
//! part maps every part present beside it and indexes their tensors together. Parts may be
//! absent (a host that holds only the layers it serves keeps only their parts): a tensor of an
//! absent part is an error when it is asked for, naming the absent parts, never before, so a
//! shard loads from the parts that hold its layers and nothing else.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{parse, Error, Header, TensorInfo};

enum Backing {
    /// The mapping, and the open file for [`GgufFile::in_file`].
    Mmap(memmap2::Mmap, Arc<OpenFile>),
    Owned(Vec<u8>),
}

/// An open model file and what it was when opened, so reads from it after loading can tell
/// that it changed.
#[derive(Debug)]
struct OpenFile {
    file: std::fs::File,
    path: PathBuf,
    len: u64,
    modified: Option<std::time::SystemTime>,
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m, ..) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A tensor's bytes in an open model file (see [`GgufFile::in_file`]).
#[derive(Clone, Debug)]
pub struct InFile {
    file: Arc<OpenFile>,
    start: u64,
    len: u64,
}

impl InFile {
    /// The tensor's size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the file is still the one opened: an error when its size or modification time
    /// changed (cut short, or rewritten in place: its bytes are no longer the model's). A file
    /// replaced by a rename is not noticed, and need not be: the open file is still the old
    /// one. One `fstat`: a reader checks once per batch of [`InFile::read_at`], not per read.
    pub fn check_unchanged(&self) -> Result<(), Error> {
        let f = &self.file;
        let now = f.file.metadata().map_err(|e| f.error(e))?;
        if now.len() != f.len || now.modified().ok() != f.modified {
            return Err(f.invalid(format!(
                "the file changed since it was loaded ({} bytes then, {} now, or written to): \
                 restart the shard on the file as it is now",
                f.len,
                now.len()
            )));
        }
        Ok(())
    }

    /// Reads `out.len()` bytes at `offset` into the tensor; a read past the tensor, or past
    /// the end of a file cut short, is an error.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        let f = &self.file;
        if offset
            .checked_add(out.len() as u64)
            .is_none_or(|end| end > self.len)
        {
            return Err(f.invalid(format!(
                "{} bytes at {offset} are outside a tensor of {} bytes",
                out.len(),
                self.len
            )));
        }
        f.file
            .read_exact_at(out, self.start + offset)
            .map_err(|e| f.error(e))
    }
}

impl OpenFile {
    fn error(&self, source: std::io::Error) -> Error {
        Error::Io {
            path: self.path.display().to_string(),
            source,
        }
    }

    fn invalid(&self, why: String) -> Error {
        self.error(std::io::Error::new(std::io::ErrorKind::InvalidData, why))
    }
}

/// One file: its bytes and where its data section starts.
struct Part {
    backing: Backing,
    data_offset: u64,
}

/// A validated GGUF model. Tensor data is borrowed from the mappings, never copied here.
pub struct GgufFile {
    /// The first part's header, with the tensors of every part present.
    header: Header,
    /// The parts present (the first is always there).
    parts: Vec<Part>,
    /// For a split model, the part (an index into `parts`) of each tensor not in the first.
    part_of: HashMap<String, usize>,
    /// File names of the parts that are not present.
    absent: Vec<String>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.header.version)
            .field("n_tensors", &self.header.tensors().len())
            .field("n_parts", &self.parts.len())
            .field("absent", &self.absent)
            .field("n_bytes", &self.len())
            .finish()
    }
}

/// The most parts a split model may have (as gguf-split's u16 count allows).
const MAX_PARTS: u64 = u16::MAX as u64;

fn map(path: &Path) -> Result<(Backing, Header), Error> {
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    // SAFETY: the mapping is read-only; strata never writes model files while serving them,
    // and every access is bounds-checked against the length validated by `parse`.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    let header = parse(&mmap)?;
    let meta = file.metadata().map_err(io)?;
    let open = OpenFile {
        file,
        path: path.to_path_buf(),
        len: meta.len(),
        modified: meta.modified().ok(),
    };
    Ok((Backing::Mmap(mmap, Arc::new(open)), header))
}

/// `(prefix, number, count)` of a part's path, `PREFIX-0000N-of-0000M.gguf`, if it is named so.
fn split_name(path: &Path) -> Option<(String, u64, u64)> {
    let name = path.file_name()?.to_str()?.strip_suffix(".gguf")?;
    let (head, count) = name.rsplit_once("-of-")?;
    let (prefix, no) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(count) || !digits(no) {
        return None;
    }
    Some((prefix.to_string(), no.parse().ok()?, count.parse().ok()?))
}

fn part_path(dir: &Path, prefix: &str, no: u64, count: u64) -> PathBuf {
    dir.join(format!("{prefix}-{no:05}-of-{count:05}.gguf"))
}

impl GgufFile {
    /// Maps and validates the file at `path`; for the first part of a split model, the parts
    /// present beside it too.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let (backing, header) = map(path)?;
        let count = header.get("split.count").and_then(|v| v.as_u64());
        let no = header.get("split.no").and_then(|v| v.as_u64()).unwrap_or(0);
        let bad = |why: String| Error::BadPart {
            path: path.display().to_string(),
            why,
        };
        let named = split_name(path);
        if let Some((prefix, n, c)) = &named {
            if *n > 1 || no > 0 {
                let dir = path.parent().unwrap_or(Path::new("."));
                return Err(Error::NotFirstPart {
                    path: path.display().to_string(),
                    no: no.max(n.saturating_sub(1)) + 1,
                    first: part_path(dir, prefix, 1, *c).display().to_string(),
                });
            }
        }
        let mut file = GgufFile {
            parts: vec![Part {
                backing,
                data_offset: header.data_offset,
            }],
            header,
            part_of: HashMap::new(),
            absent: Vec::new(),
        };
        let count = match count {
            None | Some(0 | 1) => return Ok(file),
            Some(c) if c > MAX_PARTS => return Err(bad(format!("split.count is {c}"))),
            Some(c) => c,
        };
        let Some((prefix, _, named_count)) = named else {
            return Err(bad(format!(
                "split.count is {count} but the file is not named NAME-00001-of-{count:05}.gguf, \
                 so its other parts cannot be found"
            )));
        };
        if named_count != count {
            return Err(bad(format!(
                "named as one of {named_count} parts, but split.count is {count}"
            )));
        }
        let dir = path.parent().unwrap_or(Path::new("."));
        for no in 2..=count {
            let p = part_path(dir, &prefix, no, count);
            if !p.exists() {
                file.absent.push(
                    p.file_name()
                        .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
                );
                continue;
            }
            let (backing, h) = map(&p)?;
            let their_no = h.get("split.no").and_then(|v| v.as_u64());
            let their_count = h.get("split.count").and_then(|v| v.as_u64());
            if their_no != Some(no - 1) || their_count != Some(count) {
                return Err(Error::BadPart {
                    path: p.display().to_string(),
                    why: format!(
                        "split.no {their_no:?} and split.count {their_count:?}, expected {} of {count}",
                        no - 1
                    ),
                });
            }
            file.header.add_tensors(&h)?;
            let at = file.parts.len();
            for t in h.tensors() {
                file.part_of.insert(t.name.clone(), at);
            }
            file.parts.push(Part {
                backing,
                data_offset: h.data_offset,
            });
        }
        let want = file
            .header
            .get("split.tensors.count")
            .and_then(|v| v.as_u64());
        let have = file.header.tensors().len() as u64;
        if let Some(want) = want.filter(|_| file.absent.is_empty()) {
            if want != have {
                return Err(bad(format!(
                    "split.tensors.count is {want} but the {count} parts hold {have}"
                )));
            }
        }
        Ok(file)
    }

    /// Validates a file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, Error> {
        let header = parse(&bytes)?;
        Ok(Self {
            parts: vec![Part {
                backing: Backing::Owned(bytes),
                data_offset: header.data_offset,
            }],
            header,
            part_of: HashMap::new(),
            absent: Vec::new(),
        })
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    /// File names of a split model's parts that are not present (none for one file).
    pub fn absent_parts(&self) -> &[String] {
        &self.absent
    }

    /// How many files the model was read from.
    pub fn n_parts(&self) -> usize {
        self.parts.len()
    }

    /// The part holding a tensor, and the absolute offset of its data there.
    fn locate(&self, info: &TensorInfo) -> (&Part, u64) {
        let part = &self.parts[self.part_of.get(&info.name).copied().unwrap_or(0)];
        (part, part.data_offset + info.offset)
    }

    /// The data of a tensor (bounds were checked by `parse`).
    pub fn data(&self, info: &TensorInfo) -> &[u8] {
        let (part, start) = self.locate(info);
        let start = start as usize;
        &part.backing.bytes()[start..start + info.n_bytes as usize]
    }

    /// Drops the whole pages of bytes `range` of a tensor's data (a loader has copied them)
    /// from this process's resident set, so a loader's memory is its copies, not the mapping
    /// as well. Nothing happens for a file read into memory.
    pub fn release(&self, info: &TensorInfo, range: std::ops::Range<usize>) {
        let (part, base) = self.locate(info);
        if let Backing::Mmap(m, ..) = &part.backing {
            let page = 4096u64;
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

    /// A tensor's data to be read from the file when needed, not through the mapping: for a
    /// table read a row at a time (an embedding), which then costs no resident memory at all.
    /// (Read through a mapping, each row would map a whole page-cache folio, up to 2 MiB on
    /// current kernels, so a conversation's few thousand rows would map all of it.) `None` for a
    /// file read into memory.
    pub fn in_file(&self, info: &TensorInfo) -> Option<InFile> {
        let (part, start) = self.locate(info);
        match &part.backing {
            Backing::Mmap(_, file) => Some(InFile {
                file: Arc::clone(file),
                start,
                len: info.n_bytes,
            }),
            Backing::Owned(_) => None,
        }
    }

    /// Looks a tensor up by name.
    pub fn tensor(&self, name: &str) -> Result<(&TensorInfo, &[u8]), Error> {
        let Some(info) = self.header.tensor(name) else {
            return Err(if self.absent.is_empty() {
                Error::MissingTensor { name: name.into() }
            } else {
                Error::TensorInAbsentPart {
                    name: name.into(),
                    absent: self.absent.join(", "),
                }
            });
        };
        Ok((info, self.data(info)))
    }

    /// Total size of the files present in bytes.
    pub fn len(&self) -> usize {
        self.parts.iter().map(|p| p.backing.bytes().len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
