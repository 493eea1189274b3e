//! warmpath's tokenizers against llama.cpp's own tokenizer tests: the vocabulary-only GGUF files
//! of its `models/` directory, each with test texts and the ids llama.cpp's tokenizer (checked by
//! its authors against the models' reference tokenizers) gives them. `scripts/ensure-deps`
//! installs them into the cache (`scripts/llama-cpp-vocabs`).

use std::path::Path;

use warmpath_wire::gguf::Gguf;
use warmpath_wire::tokenizer::Tokenizer;

/// The texts and expected ids of one vocabulary: cases separated by `__ggml_vocab_test__` lines,
/// one line of space-separated ids per case.
fn cases(dir: &Path, vocab: &str) -> Vec<(String, Vec<u32>)> {
    let read = |ext: &str| {
        std::fs::read_to_string(dir.join(format!("ggml-vocab-{vocab}.gguf.{ext}"))).expect("fixture reads")
    };
    let inp = read("inp");
    const SEP: &str = "\n__ggml_vocab_test__\n";
    let texts: Vec<&str> = inp.strip_suffix(SEP).unwrap_or(&inp).split(SEP).collect();
    let out = read("out");
    let ids: Vec<Vec<u32>> =
        out.lines().map(|l| l.split_whitespace().map(|i| i.parse().expect("id")).collect()).collect();
    assert_eq!(texts.len(), ids.len(), "{vocab}: as many texts as id lines");
    texts.into_iter().map(str::to_owned).zip(ids).collect()
}

/// Every case of `vocab` encodes to llama.cpp's ids and decodes back to the text.
fn check(vocab: &str, prefix_space: bool) {
    let Some(dir) = warmpath_wire::models::llama_cpp_vocab_dir() else { return };
    let file = Gguf::open(&dir.join(format!("ggml-vocab-{vocab}.gguf"))).expect("opens");
    let tok = Tokenizer::from_gguf(vocab, &file).expect("loads");
    let cases = cases(&dir, vocab);
    assert!(cases.len() >= 30, "{vocab}: {} cases", cases.len());
    let mut ids_checked = 0;
    for (text, want) in &cases {
        let got = tok.encode(text);
        assert_eq!(&got, want, "{vocab}: {text:?}");
        ids_checked += got.len();
        let back = tok.decode(&got).expect("decodes");
        let back =
            if prefix_space && !text.is_empty() { back.strip_prefix(' ').expect("prefix") } else { &back };
        assert_eq!(back, text, "{vocab}: decodes back");
    }
    assert!(ids_checked > 300, "{vocab}: {ids_checked} ids");
}

#[test]
fn llama_sentencepiece_matches_llama_cpp() {
    check("llama-spm", true);
}

#[test]
fn phi3_sentencepiece_matches_llama_cpp() {
    check("phi-3", true);
}

#[test]
fn llama3_byte_level_bpe_matches_llama_cpp() {
    check("llama-bpe", false);
}

#[test]
fn gpt2_byte_level_bpe_matches_llama_cpp() {
    check("gpt-2", false);
}

#[test]
fn sentencepiece_specials_and_byte_fallback() {
    let Some(dir) = warmpath_wire::models::llama_cpp_vocab_dir() else { return };
    let file = Gguf::open(&dir.join("ggml-vocab-llama-spm.gguf")).expect("opens");
    let tok = Tokenizer::from_gguf("llama-spm", &file).expect("loads");
    assert_eq!(tok.vocab_size(), 32_000);
    let (bos, eos) = (tok.special_id("<s>").expect("bos"), tok.special_id("</s>").expect("eos"));
    assert_eq!((bos, eos), (1, 2));
    assert!(tok.is_special(1) && !tok.is_special(15043));
    // Specials in a rendered template are their ids; the text after each gets its own `▁`,
    // as in llama.cpp (and the `tokenizers` library's Prepend normalizer).
    let ids = tok.encode_with_special("<s>[INST] Hello [/INST] Hi</s>");
    assert_eq!(ids[0], 1);
    assert_eq!(*ids.last().expect("ids"), 2);
    assert_eq!(&ids[1..ids.len() - 1], &tok.encode("[INST] Hello [/INST] Hi")[..]);
    // As user text, "<s>" is characters, not BOS.
    assert!(!tok.encode("<s>").contains(&1));
    // A character with no token of its own is its UTF-8 bytes' tokens (<0xF0> ...).
    let emoji = tok.encode("🦙");
    assert!(emoji.len() >= 4, "{emoji:?}");
    assert_eq!(tok.decode(&emoji).expect("decodes"), " 🦙");
}
