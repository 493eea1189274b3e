//! Writing GGUF files: what tests and tools use to make small models and to check the reader
//! against what it wrote.

use super::{GgmlType, Value, DEFAULT_ALIGNMENT};

/// A GGUF v3 file being built in memory.
#[derive(Debug, Default)]
pub struct Writer {
    meta: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl Writer {
    pub fn new() -> Writer {
        Writer::default()
    }

    pub fn meta(&mut self, key: &str, value: Value) -> &mut Writer {
        self.meta.push((key.to_owned(), value));
        self
    }

    /// A tensor of `dims` (fastest-moving first) whose data, already in `ty`'s layout, is `data`.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Writer {
        self.tensors.push((name.to_owned(), dims.to_vec(), ty, data));
        self
    }

    /// An f32 tensor.
    pub fn f32_tensor(&mut self, name: &str, dims: &[u64], data: &[f32]) -> &mut Writer {
        let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, dims, GgmlType::F32, bytes)
    }

    pub fn finish(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.meta.len() as u64).to_le_bytes());
        for (k, v) in &self.meta {
            string(&mut out, k);
            out.extend_from_slice(&v.type_id().to_le_bytes());
            value(&mut out, v);
        }
        let align = DEFAULT_ALIGNMENT as usize;
        let mut offset = 0usize;
        for (name, dims, ty, data) in &self.tensors {
            string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.id().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = (offset + data.len()).div_ceil(align) * align;
        }
        out.resize(out.len().div_ceil(align) * align, 0);
        for (_, _, _, data) in &self.tensors {
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(align) * align, 0);
        }
        out
    }
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => string(out, s),
        Value::Array(items) => {
            let inner = items.first().map_or(4, Value::type_id);
            out.extend_from_slice(&inner.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                value(out, i);
            }
        }
    }
}
