#!/usr/bin/env python3
"""Writes the tokenizer.json fixtures under wire/tests/data and the ids Hugging Face's own
`tokenizers` library gives for a set of texts, which wire/tests/hf_tokenizer.rs compares
warmpath's loader against. Run once by hand (needs `pip install tokenizers`); the outputs are
committed, CI only reads them.

    python3 scripts/make-tokenizer-fixtures.py
"""
import glob
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "wire", "tests", "data")

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.\n\nIt's 12345 o'clock; we're done.",
    "fn main() {\n    let x = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n",
    "  leading spaces and trailing   \n\n\n\t\ttabs\r\nCRLF",
    "Ünïcödé — naïve café, 日本語のテキスト, emoji 🎉🎉 and e\u0301 (decomposed)",
    '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}',
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "numbers 3.14159 1e-10 0x1F 100000000 and IDs 7f3a9c21-0b44",
    "",
    " ",
    "\n",
    "a",
]


def corpus():
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    files += sorted(glob.glob(os.path.join(ROOT, "proxy", "src", "**", "*.rs"), recursive=True))[:40]
    for f in files:
        with open(f, encoding="utf-8") as fh:
            yield fh.read()
    yield "\n".join(TEXTS)


def train(pre, normalizer, specials, vocab):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


def main():
    os.makedirs(OUT, exist_ok=True)
    cases = {
        "gpt2-style": train(pre_tokenizers.ByteLevel(add_prefix_space=False), None, ["<|endoftext|>"], 3000),
        "llama3-style": train(
            pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]),
            normalizers.NFC(),
            ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            4000,
        ),
    }
    for name, tok in cases.items():
        with open(os.path.join(OUT, f"{name}.tokenizer.json"), "w", encoding="utf-8") as fh:
            fh.write(tok.to_str(pretty=False))
        expected = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in TEXTS]
        with open(os.path.join(OUT, f"{name}.expected.json"), "w", encoding="utf-8") as fh:
            json.dump(expected, fh, ensure_ascii=False, indent=1)
            fh.write("\n")
        print(name, tok.get_vocab_size(), "ids;", sum(len(e["ids"]) for e in expected), "expected ids")


if __name__ == "__main__":
    main()
