//! The `tokenizer.json` loader against the Hugging Face `tokenizers` library: the fixtures were
//! trained and encoded by it (`scripts/make-tokenizer-fixtures.py`), warmpath must give the same
//! ids for the same texts.

use std::path::PathBuf;

use warmpath_wire::tokenizer::Tokenizer;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn check(style: &str) {
    let tok = Tokenizer::from_file(&data(&format!("{style}.tokenizer.json"))).expect("loads");
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(data(&format!("{style}.expected.json"))).expect("reads"),
    )
    .expect("json");
    let mut checked = 0;
    for case in expected.as_array().expect("array") {
        let text = case["text"].as_str().expect("text");
        let want: Vec<u32> =
            case["ids"].as_array().expect("ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
        let got = tok.encode_with_special(text);
        assert_eq!(got, want, "{style}: {text:?}");
        checked += want.len();
        // Decoding gives the (normalized) text back; SentencePiece styles, with a space in
        // front where the normalizer put a `▁`.
        let back = tok.decode(&got).expect("decodes");
        if text.is_ascii() && !text.contains("<s>") {
            let back = match style {
                "llama2-style" if !text.is_empty() => back.strip_prefix(' ').expect("prefix"),
                // Metaspace puts no `▁` before text that starts with a space.
                "mistral-style" if !text.is_empty() && !text.starts_with(' ') => {
                    back.strip_prefix(' ').expect("prefix")
                }
                _ => &back,
            };
            assert_eq!(back, text);
        }
    }
    assert!(checked > 200, "the fixture holds real cases ({checked} ids)");
}

#[test]
fn llama2_style_sentencepiece_with_byte_fallback_matches_huggingface() {
    // Prepend + Replace normalizers: a `▁` before every stretch of text, after specials too.
    check("llama2-style");
    let tok = Tokenizer::from_file(&data("llama2-style.tokenizer.json")).expect("loads");
    assert!(!tok.splits_lines(), "SentencePiece text is encoded whole");
    assert_eq!(tok.special_id("</s>"), Some(2));
    // Characters outside the trained alphabet are their bytes' tokens, and decode back.
    let ids = tok.encode("日本");
    assert_eq!(ids.len(), 7, "a ▁ and six byte tokens: {ids:?}");
    assert_eq!(tok.decode(&ids).expect("decodes"), " 日本");
}

#[test]
fn mistral_style_metaspace_matches_huggingface() {
    // Metaspace with prepend_scheme "first": no `▁` after a special token.
    check("mistral-style");
}

#[test]
fn gpt2_style_matches_huggingface() {
    check("gpt2-style");
}

#[test]
fn llama3_style_with_nfc_matches_huggingface() {
    check("llama3-style");
    let tok = Tokenizer::from_file(&data("llama3-style.tokenizer.json")).expect("loads");
    assert!(tok.splits_lines(), "the Llama 3 split cuts after newlines");
    assert_eq!(tok.special_id("<|im_end|>"), Some(2));
    assert!(tok.is_special(2) && !tok.is_special(300));
    // NFC: the decomposed é encodes as the composed one.
    assert_eq!(tok.encode("e\u{301}"), tok.encode("\u{e9}"));
}

#[test]
fn unsupported_files_are_refused_with_the_reason() {
    let text = std::fs::read_to_string(data("gpt2-style.tokenizer.json")).expect("reads");
    let mut doc: serde_json::Value = serde_json::from_str(&text).expect("json");
    doc["model"]["byte_fallback"] = true.into();
    let err = Tokenizer::from_json("t", &doc.to_string()).expect_err("refused");
    assert!(err.to_string().contains("with byte_fallback"), "a byte-level pre-tokenizer: {err}");

    let mut doc: serde_json::Value = serde_json::from_str(&text).expect("json");
    doc["normalizer"] = serde_json::json!({"type": "Lowercase"});
    let err = Tokenizer::from_json("t", &doc.to_string()).expect_err("refused");
    assert!(err.to_string().contains("Lowercase"), "{err}");

    let mut doc: serde_json::Value = serde_json::from_str(&text).expect("json");
    doc["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"});
    assert!(Tokenizer::from_json("t", &doc.to_string()).is_err());

    assert!(Tokenizer::from_json("t", "not json").is_err());
    assert!(Tokenizer::from_json("t", "{}").is_err());
}

/// `wp32k` written out as a `tokenizer.json` (vocabulary in the byte-level alphabet, merges
/// recovered from the ranks) loads back into the same tokenizer: the rank rebuilding is exact
/// on a 32k vocabulary learned by BPE.
#[test]
fn wp32k_written_as_tokenizer_json_loads_back_identical() {
    let wp = Tokenizer::wp32k();
    let json = as_tokenizer_json(&wp);
    let back = Tokenizer::from_json("wp32k.json", &json).expect("loads");
    let texts = [
        "The quick brown fox jumps over the lazy dog. It's 12345 o'clock.",
        "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n\n\n  spaced   out  \t",
        "日本語のテキスト, café, 🎉 <|im_start|>user\nhi<|im_end|>\n",
    ];
    for t in texts {
        assert_eq!(back.encode_with_special(t), wp.encode_with_special(t), "{t:?}");
        assert_eq!(back.encode(t), wp.encode(t), "{t:?}");
    }
    assert_eq!(back.vocab_size(), wp.vocab_size());
}

/// GPT-2's byte → character table (the inverse of the loader's).
fn byte_chars() -> Vec<char> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut shifted = 0;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                char::from(b)
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).expect("char")
            }
        })
        .collect()
}

fn as_tokenizer_json(tok: &Tokenizer) -> String {
    use std::collections::HashMap;
    let chars = byte_chars();
    let text = |b: &[u8]| b.iter().map(|&x| chars[x as usize]).collect::<String>();
    let ordinary = (0..tok.vocab_size() as u32).filter(|&i| !tok.is_special(i));
    let tokens: Vec<Vec<u8>> = ordinary.map(|i| tok.decode_bytes(&[i]).expect("id")).collect();
    let rank: HashMap<&[u8], usize> = tokens.iter().enumerate().map(|(r, t)| (t.as_slice(), r)).collect();
    let mut merges = Vec::new();
    for (r, t) in tokens.iter().enumerate().filter(|(_, t)| t.len() > 1) {
        // Merge with the lower ranks only, lowest first, until two parts remain.
        let mut parts: Vec<Vec<u8>> = t.chunks(1).map(<[u8]>::to_vec).collect();
        while parts.len() > 2 {
            let (_, k) = (0..parts.len() - 1)
                .filter_map(|k| {
                    let joined = [parts[k].as_slice(), &parts[k + 1]].concat();
                    rank.get(joined.as_slice()).filter(|&&jr| jr < r).map(|&jr| (jr, k))
                })
                .min()
                .expect("a learned token splits into lower-ranked tokens");
            let next = parts.remove(k + 1);
            parts[k].extend(next);
        }
        merges.push(format!("{} {}", text(&parts[0]), text(&parts[1])));
    }
    let vocab: serde_json::Map<String, serde_json::Value> =
        tokens.iter().enumerate().map(|(r, t)| (text(t), r.into())).collect();
    let added: Vec<serde_json::Value> = (0..tok.vocab_size() as u32)
        .filter(|&i| tok.is_special(i))
        .map(|i| serde_json::json!({"id": i, "content": tok.decode(&[i]).expect("id"), "special": true}))
        .collect();
    let pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    serde_json::json!({
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]},
        "model": {"type": "BPE", "vocab": vocab, "merges": merges, "byte_fallback": false, "ignore_merges": true}
    })
    .to_string()
}
