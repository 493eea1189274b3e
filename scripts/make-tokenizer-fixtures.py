#!/usr/bin/env python3
"""Writes the tokenizer.json fixtures under wire/tests/data and the ids Hugging Face's own
`tokenizers` library gives for a set of texts, which wire/tests/hf_tokenizer.rs compares
warmpath's loader against; and a chat template with the prompts and ids `transformers`'
`apply_chat_template` gives, which proxy/src/canon/tests.rs compares warmpath's renderer
against. Run once by hand (needs `pip install tokenizers transformers jinja2`); the outputs are
committed, CI only reads them. Names on the command line make only those fixtures.

    python3 scripts/make-tokenizer-fixtures.py [gpt2-style llama3-style llama2-style mistral-style chat]
"""
import glob
import json
import os
import sys

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
    "<s>[INST] Say hi [/INST] Hi!</s>",
    "▁ already marked ▁▁ spaces",
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


def train_spm(normalizer, pre_tokenizer):
    """A SentencePiece-style BPE (Llama 2, Mistral): trained on words cut at spaces, with a small
    alphabet so that rarer characters (CJK, emoji) need the byte fallback; the 256 `<0xXX>`
    byte tokens are ordinary vocabulary entries after the learned ones, as in Llama's file."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=90, show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer)
    doc = json.loads(tok.to_str())
    vocab = doc["model"]["vocab"]
    first = max(vocab.values()) + 1
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = first + b
    doc["normalizer"] = normalizer
    doc["pre_tokenizer"] = pre_tokenizer
    doc["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return Tokenizer.from_str(json.dumps(doc))


def main():
    os.makedirs(OUT, exist_ok=True)
    want = set(sys.argv[1:])
    cases = {
        "gpt2-style": lambda: train(pre_tokenizers.ByteLevel(add_prefix_space=False), None, ["<|endoftext|>"], 3000),
        "llama3-style": lambda: train(
            pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]),
            normalizers.NFC(),
            ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            4000,
        ),
        # Llama 2 / Mistral v0.1: Prepend + Replace normalizers, no pre-tokenizer.
        "llama2-style": lambda: train_spm(
            {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "\u2581"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
            None,
        ),
        # Mistral v0.3 and later: Metaspace, the prefix on the first stretch of text only.
        "mistral-style": lambda: train_spm(
            None, {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
        ),
    }
    for name, make in cases.items():
        if want and name not in want:
            continue
        tok = make()
        with open(os.path.join(OUT, f"{name}.tokenizer.json"), "w", encoding="utf-8") as fh:
            fh.write(tok.to_str(pretty=False))
        expected = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in TEXTS]
        with open(os.path.join(OUT, f"{name}.expected.json"), "w", encoding="utf-8") as fh:
            json.dump(expected, fh, ensure_ascii=False, indent=1)
            fh.write("\n")
        print(name, tok.get_vocab_size(), "ids;", sum(len(e["ids"]) for e in expected), "expected ids")
    if not want or "chat" in want:
        chat_fixture()


# A tool-calling template in the style of current open models (Qwen 2.5, Hermes): tools as JSON
# lines in the system turn, calls as <tool_call> JSON, results as <tool_response>.
TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content.strip() + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CHATS = [
    {
        "messages": [
            {"role": "system", "content": "You are a careful agent.\nÜse tools when needed."},
            {"role": "user", "content": "  What's the weather in Zürich?  "},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 3}"},
            {"role": "tool", "tool_call_id": "c2", "content": "second"},
            {"role": "assistant", "content": "It is 3 °C."},
            {"role": "user", "content": "Thanks <3"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "description": "Weather \"now\" for a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                            "required": ["city"]}}},
            {"type": "function", "function": {"name": "search", "description": "Web search", "parameters": {"type": "object", "properties": {}}}},
        ],
    },
    {"messages": [{"role": "user", "content": "no system, no tools"}], "tools": None},
    {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}], "tools": None},
]


def chat_fixture():
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(OUT, "llama3-style.tokenizer.json"))
    tok.chat_template = TEMPLATE
    cases = []
    for c in CHATS:
        for gen in (True, False):
            text = tok.apply_chat_template(c["messages"], tools=c["tools"], add_generation_prompt=gen, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            cases.append({**c, "add_generation_prompt": gen, "text": text, "ids": ids})
    with open(os.path.join(OUT, "chat-template.expected.json"), "w", encoding="utf-8") as fh:
        json.dump({"template": TEMPLATE, "cases": cases}, fh, ensure_ascii=False, indent=1)
        fh.write("\n")
    print("chat template:", len(cases), "cases")


if __name__ == "__main__":
    main()
