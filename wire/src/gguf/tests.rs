//! The reader against files the writer made, against damaged ones, and (where it is installed)
//! against the SmolLM2 file the quick start serves.

use super::*;

fn sample() -> Writer {
    let mut w = Writer::new();
    w.meta("general.architecture", Value::String("llama".into()))
        .meta("llama.block_count", Value::U32(2))
        .meta("llama.rope.freq_base", Value::F32(10_000.0))
        .meta(
            "tokenizer.ggml.tokens",
            Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
        )
        .meta("flag", Value::Bool(true))
        .f32_tensor("norm", &[4], &[1.0, 2.0, 3.0, 4.0])
        .tensor("q", &[32, 2], GgmlType::Q8_0, vec![7; 2 * 34]);
    w
}

#[test]
fn what_the_writer_writes_the_reader_reads() {
    let g = Gguf::from_vec(sample().finish()).expect("reads");
    assert_eq!(g.version, 3);
    assert_eq!(g.architecture().expect("arch"), "llama");
    assert_eq!(g.u64("llama.block_count").expect("u32"), 2);
    assert_eq!(g.f32("llama.rope.freq_base").expect("f32"), 10_000.0);
    assert_eq!(g.array("tokenizer.ggml.tokens").expect("array").len(), 2);
    assert_eq!(g.get("flag").and_then(Value::as_bool), Some(true));
    let (info, data) = g.tensor("norm").expect("tensor");
    assert_eq!((info.dims.as_slice(), info.ty), (&[4u64][..], GgmlType::F32));
    assert_eq!(&data[..8], &[0, 0, 128, 63, 0, 0, 0, 64]);
    let (info, data) = g.tensor("q").expect("tensor");
    assert_eq!((info.bytes(), data.len(), data[67]), (68, 68, 7));
    assert_eq!(info.offset % 32, 0, "tensor data is aligned");
}

#[test]
fn damaged_files_say_what_is_wrong() {
    let good = sample().finish();
    let err = |b: Vec<u8>| Gguf::from_vec(b).expect_err("refused").to_string();
    assert!(err(b"GGML\x03\0\0\0".to_vec()).contains("not a GGUF file"));
    let mut v9 = good.clone();
    v9[4] = 9;
    assert!(err(v9).contains("version 9"));
    // Cut in the header, and cut in the tensor data.
    assert!(err(good[..40].to_vec()).contains("truncated"), "{}", err(good[..40].to_vec()));
    let short = err(good[..good.len() - 40].to_vec());
    assert!(short.contains("tensor q") && short.contains("past the end"), "{short}");
    // An unknown tensor type.
    let mut w = Writer::new();
    w.tensor("x", &[32], GgmlType::Q8_0, vec![0; 34]);
    let mut b = w.finish();
    let at = b.windows(4).position(|win| win == 8u32.to_le_bytes()).expect("type id");
    b[at] = 99;
    assert!(err(b).contains("tensor x: ggml type 99"));
    // Missing and mistyped keys.
    let g = Gguf::from_vec(good).expect("reads");
    assert!(g.u64("llama.embedding_length").expect_err("missing").to_string().contains("is missing"));
    let e = g.u64("general.architecture").expect_err("a string").to_string();
    assert!(e.contains("is a string, not an unsigned integer"), "{e}");
}

/// The quick start's model, where `scripts/ensure-deps` installed it.
#[test]
fn the_smollm2_file_reads_where_installed() {
    let Some(path) = crate::models::smollm2_path() else { return };
    let g = Gguf::open(&path).expect("opens");
    assert_eq!(g.architecture().expect("arch"), "llama");
    assert_eq!(g.u64("llama.block_count").expect("layers"), 30);
    assert_eq!(g.tensors().len(), 272);
    let (emb, _) = g.tensor("token_embd.weight").expect("embedding");
    assert_eq!((emb.dims.as_slice(), emb.ty), (&[576u64, 49152][..], GgmlType::Q8_0));
}

/// The SmolLM2 file's tokenizer and chat template, where installed.
#[test]
fn the_smollm2_chat_format_renders_its_template() {
    use crate::chat_template::ChatFormat;
    use crate::openai::{ChatMessage, Role};
    let Some(path) = crate::models::smollm2_path() else { return };
    let g = Gguf::open(&path).expect("opens");
    let f = ChatFormat::from_gguf("smollm2", &g).expect("format");
    assert_eq!(f.stop_ids, [2]);
    assert_eq!(f.bos, None, "add_bos_token is false");
    let msgs = [ChatMessage::text(Role::User, "What is 12 + 30?")];
    let text = f.render_text(&msgs, &[], true).expect("renders");
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = f.render_tokens(&msgs, &[], true).expect("tokens");
    assert_eq!(ids[0], 1, "<|im_start|> is special token 1");
    assert_eq!(f.tokenizer.decode(&ids).expect("decodes"), text);
    // Digits are split one by one (the `smollm` pre-tokenizer).
    let digits = f.tokenizer.encode("12 + 30");
    assert_eq!(f.tokenizer.decode(&digits[..1]).expect("decodes"), "1");
    // A completion prompt rendered by the client: its special-token strings are the tokens.
    assert_eq!(f.prompt_ids(&text), ids, "as the template renders it");
}
