//! GGUF files, llama.cpp's model format (v2 and v3): the header, the metadata (typed key/value
//! pairs: architecture, shapes, tokenizer, chat template) and the tensor directory, with the
//! tensor data memory-mapped, not read: a model's weights are used where they lie in the file.
//!
//! Everything a file can get wrong is an error that says what and where: not a GGUF file, a
//! version this reader does not know, a truncated header or tensor, a tensor type it does not
//! know, a missing or mistyped key ([`Gguf::require`]).

mod types;
mod write;

use std::collections::BTreeMap;
use std::path::Path;

pub use types::{GgmlType, Value};
pub use write::Writer;

/// Alignment of the tensor data when `general.alignment` does not say.
const DEFAULT_ALIGNMENT: u64 = 32;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("reading {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not a GGUF file (magic {0:?})")]
    NotGguf([u8; 4]),
    #[error("GGUF version {0} is not supported (2 and 3 are)")]
    Version(u32),
    #[error("the file is truncated: {0}")]
    Truncated(String),
    #[error("{0}")]
    Malformed(String),
    #[error("tensor {tensor}: ggml type {id} is not supported")]
    UnknownType { tensor: String, id: u32 },
    #[error("metadata key {0:?} is missing")]
    MissingKey(String),
    #[error("metadata key {key:?} is {found}, not {expected}")]
    WrongType { key: String, expected: &'static str, found: &'static str },
}

/// One tensor of the directory.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions, fastest-moving first (`dims[0]` is a row's length).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of its data from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of its data.
    pub fn bytes(&self) -> u64 {
        self.elements() / self.ty.block_elements() as u64 * self.ty.block_bytes() as u64
    }
}

/// The bytes of the file: mapped, or owned (a file built in memory).
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// An open GGUF file.
pub struct Gguf {
    pub version: u32,
    meta: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    data_start: usize,
    bytes: Bytes,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("keys", &self.meta.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl Gguf {
    /// Opens and maps `path`, reading the header and directory (the data stays on disk until
    /// used).
    pub fn open(path: &Path) -> Result<Gguf, GgufError> {
        let io = |source| GgufError::Io { path: path.display().to_string(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process; like every memory-mapping
        // model loader, it assumes the file is not truncated while it is in use.
        #[allow(unsafe_code)]
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Gguf::parse(Bytes::Mapped(map))
    }

    /// A GGUF file held in memory.
    pub fn from_vec(bytes: Vec<u8>) -> Result<Gguf, GgufError> {
        Gguf::parse(Bytes::Owned(bytes))
    }

    fn parse(bytes: Bytes) -> Result<Gguf, GgufError> {
        let mut r = types::Reader::new(&bytes);
        let magic: [u8; 4] = r.take(4, "magic")?.try_into().expect("4 bytes");
        if &magic != b"GGUF" {
            return Err(GgufError::NotGguf(magic));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        let mut meta = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key {i}"))?;
            let value = r.value(&key)?;
            meta.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16) as usize);
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor {i} name"))?;
            let n_dims = r.u32(&name)?;
            if n_dims == 0 || n_dims > 4 {
                return Err(GgufError::Malformed(format!("tensor {name}: {n_dims} dimensions")));
            }
            let dims = (0..n_dims).map(|_| r.u64(&name)).collect::<Result<Vec<_>, _>>()?;
            let id = r.u32(&name)?;
            let ty =
                GgmlType::from_id(id).ok_or_else(|| GgufError::UnknownType { tensor: name.clone(), id })?;
            let offset = r.u64(&name)?;
            let info = TensorInfo { name, dims, ty, offset };
            if info.dims[0] % ty.block_elements() as u64 != 0 {
                return Err(GgufError::Malformed(format!(
                    "tensor {}: rows of {} are not whole {ty:?} blocks",
                    info.name, info.dims[0]
                )));
            }
            tensors.push(info);
        }
        let align = match meta.get("general.alignment") {
            Some(Value::U32(a)) if *a > 0 => u64::from(*a),
            _ => DEFAULT_ALIGNMENT,
        };
        let data_start = (r.pos() as u64).div_ceil(align) * align;
        for t in &tensors {
            let end = data_start.checked_add(t.offset).and_then(|o| o.checked_add(t.bytes()));
            if end.is_none_or(|e| e > bytes.len() as u64) {
                return Err(GgufError::Truncated(format!(
                    "tensor {} ({} bytes at offset {}) runs past the end of the file",
                    t.name,
                    t.bytes(),
                    t.offset
                )));
            }
        }
        Ok(Gguf { version, meta, tensors, data_start: data_start as usize, bytes })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta.get(key)
    }

    /// A key that must be there.
    pub fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_owned()))
    }

    /// An unsigned integer key (any width).
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| wrong(key, "an unsigned integer", v))
    }

    pub fn f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        v.as_f32().ok_or_else(|| wrong(key, "a number", v))
    }

    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| wrong(key, "a string", v))
    }

    pub fn array(&self, key: &str) -> Result<&[Value], GgufError> {
        let v = self.require(key)?;
        match v {
            Value::Array(a) => Ok(a),
            _ => Err(wrong(key, "an array", v)),
        }
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.str("general.architecture")
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.meta.keys().map(String::as_str)
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// A tensor's directory entry and its data.
    pub fn tensor(&self, name: &str) -> Option<(&TensorInfo, &[u8])> {
        let (t, range) = self.tensor_range(name)?;
        Some((t, &self.bytes[range]))
    }

    /// A tensor's directory entry and where its data is in [`Gguf::data`].
    pub fn tensor_range(&self, name: &str) -> Option<(&TensorInfo, std::ops::Range<usize>)> {
        let t = self.tensor_info(name)?;
        let start = self.data_start + t.offset as usize;
        Some((t, start..start + t.bytes() as usize))
    }

    /// The whole file.
    pub fn data(&self) -> &[u8] {
        &self.bytes
    }
}

fn wrong(key: &str, expected: &'static str, found: &Value) -> GgufError {
    GgufError::WrongType { key: key.to_owned(), expected, found: found.kind() }
}

#[cfg(test)]
mod tests;
