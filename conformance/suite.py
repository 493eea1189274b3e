"""warmpath's drop-in claim, checked against real servers: every scenario runs with the official
`openai` Python SDK directly against a backend and through warmpath in front of it, and the two
answers are compared field by field (ids and timestamps aside). Backends: the bundled engine
(`warmpath-engine`) and llama.cpp's `llama-server`, both serving SmolLM2-135M-Instruct from the
same GGUF file. Responses (which neither backend serves the way warmpath does) are compared
with the chat answer to the same conversation; errors by status and shape.

    python conformance/suite.py --warmpath BIN --engine BIN [--llama-server BIN]
                                [--quick] [--table FILE] [--json FILE]

Prints one line per scenario and backend; exits 1 when any fails. `--table` writes the
scenario × backend table (conformance/README.md's is written this way).
"""
import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai

MODEL = "smollm2-135m-instruct"
GGUF = os.path.join(os.environ.get("WARMPATH_CACHE", os.path.expanduser("~/.cache/warmpath")),
                    "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
SYSTEM = "You are a helpful assistant."
VOLATILE = {"id", "created", "system_fingerprint", "timings", "service_tier"}
# What the backend's prefix cache held (a fact of the cache, not of the proxy): compared away.
CACHE_STATE = {"cached_tokens"}
# Before each request: the backend forgets what it cached, so that a prompt is computed the
# same way (from scratch) direct and through warmpath. Set per backend.
FRESH = [lambda: None]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, timeout=120, proc=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer in {timeout} s")


class Servers:
    """The backends and warmpath in front of them, killed at exit."""

    def __init__(self, args, work):
        self.procs, self.backends = [], {}
        logs = lambda name: open(os.path.join(work, f"{name}.log"), "w")  # noqa: E731
        port, events = free_port(), free_port()
        self.kv_events = f"tcp://127.0.0.1:{events}"
        self.spawn([args.engine, "--executor", "llama", "--model", MODEL, "--served-model-name", MODEL,
                    "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
                    "--kv-events-endpoint", self.kv_events], logs("engine"))
        self.backends["engine"] = f"http://127.0.0.1:{port}"
        if args.llama_server:
            port = free_port()
            self.spawn([args.llama_server, "-m", GGUF, "--host", "127.0.0.1", "--port", str(port),
                        "--alias", MODEL, "-c", "2048", "--jinja", "-t", "2", "--metrics", "-np", "1"], logs("llama-server"))
            self.backends["llama-server"] = f"http://127.0.0.1:{port}"
            # Embeddings: a second llama-server in its embedding mode, same GGUF.
            port = free_port()
            self.spawn([args.llama_server, "-m", GGUF, "--host", "127.0.0.1", "--port", str(port),
                        "--alias", MODEL, "-c", "2048", "-t", "2", "--embeddings", "--pooling", "mean", "-np", "1"],
                       logs("llama-server-embeddings"))
            self.backends["llama-server --embeddings"] = f"http://127.0.0.1:{port}"
        for name, url in self.backends.items():
            wait_http(url + "/health")
        # One warmpath per backend, routing only: the request bytes go on as sent.
        self.proxies, self.admins = {}, {}
        for name, url in self.backends.items():
            listen, admin = free_port(), free_port()
            policy = os.path.join(work, f"{name.replace(' ', '')}.toml")
            pool = name.split(" ")[0]
            with open(policy, "w") as f:
                f.write(f'[server]\nlisten = "127.0.0.1:{listen}"\nadmin = "127.0.0.1:{admin}"\n'
                        f'[[pools]]\nname = "{pool}"\nmodels = ["{MODEL}"]\npolicy = "cache_aware"\n'
                        # The model's own tokenizer and template, from its GGUF file: blocks in
                        # its tokens, and input_tokens counted as the backend counts.
                        f'[pools.canon]\ntokenizer_file = "{GGUF}"\n'
                        f'[[pools.backends]]\nname = "{pool}"\nurl = "{url}"\n')
            self.spawn([args.warmpath, "--config", policy], logs(f"warmpath-{name.replace(' ', '')}"))
            wait_http(f"http://127.0.0.1:{admin}/readyz")
            self.proxies[name] = f"http://127.0.0.1:{listen}"
            self.admins[name] = f"http://127.0.0.1:{admin}"

    def spawn(self, cmd, log):
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))

    def close(self):
        for p in self.procs:
            p.kill()
            p.wait()


# --- comparing answers ----------------------------------------------------------------------

def plain(obj):
    """The SDK object as JSON data, volatile fields left out."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(exclude_none=False)
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items() if k not in VOLATILE | CACHE_STATE}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    return obj


def diff(a, b, path="$"):
    """Where `a` and `b` differ (floats within 1e-4), as a list of strings."""
    if isinstance(a, float) and isinstance(b, float):
        same = (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-4 * max(1.0, abs(a))
        return [] if same else [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only {'direct' if k in a else 'warmpath'} has it")
            else:
                out += diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def outcome(call):
    """What a call gave: ("ok", data) or ("error", status, the error body)."""
    FRESH[0]()
    try:
        return ("ok", call())
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {"raw": str(e.body)}
        return ("error", e.status_code, body)


# Passes where both sides refused: shown as such in the table.
NOTES = []


def same(direct, proxied):
    if direct[0] == "error" or proxied[0] == "error":
        if direct[0] != proxied[0] or direct[1] != proxied[1]:
            return [f"direct {direct[:2]} vs warmpath {proxied[:2]}: {proxied[-1]}"]
        NOTES.append(f"both answer {direct[1]}")
        return []
    return diff(direct[1], proxied[1])


def chat_messages(user):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


# --- scenarios: each returns a list of differences (empty: pass) -----------------------------

def s_models(d, p):
    ids_d = sorted(m.id for m in d.models.list().data)
    got = p.models.list()
    ids_p = sorted(m.id for m in got.data)
    out = [] if MODEL in ids_p else [f"warmpath lists {ids_p}"]
    out += [] if MODEL in ids_d else [f"the backend lists {ids_d}"]
    for m in got.data:
        if m.object != "model" or not isinstance(m.created, int) or not m.owned_by:
            out.append(f"model entry not in OpenAI's shape: {m}")
    return out


def s_chat(d, p):
    kw = dict(model=MODEL, messages=chat_messages("What is the capital of France?"), max_tokens=24, temperature=0)
    return same(outcome(lambda: plain(d.chat.completions.create(**kw))),
                outcome(lambda: plain(p.chat.completions.create(**kw))))


def stream_of(client, **kw):
    chunks = [plain(c) for c in client.chat.completions.create(stream=True, **kw)]
    return {"deltas": [[ch["delta"] for ch in c["choices"]] for c in chunks],
            "finish": [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]],
            "usage": [c["usage"] for c in chunks if c.get("usage")],
            "object": sorted({c["object"] for c in chunks})}


def s_chat_stream(d, p):
    kw = dict(model=MODEL, messages=chat_messages("Name three colors."), max_tokens=20, temperature=0,
              stream_options={"include_usage": True})
    return same(outcome(lambda: stream_of(d, **kw)), outcome(lambda: stream_of(p, **kw)))


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def s_chat_tools(d, p):
    kw = dict(model=MODEL, messages=chat_messages("What is the weather in Oslo?"), tools=TOOLS,
              max_tokens=40, temperature=0)
    return same(outcome(lambda: plain(d.chat.completions.create(**kw))),
                outcome(lambda: plain(p.chat.completions.create(**kw))))


def s_chat_n(d, p):
    kw = dict(model=MODEL, messages=chat_messages("Say hello."), max_tokens=8, temperature=0, n=2)
    return same(outcome(lambda: plain(d.chat.completions.create(**kw))),
                outcome(lambda: plain(p.chat.completions.create(**kw))))


def s_chat_stop(d, p):
    kw = dict(model=MODEL, messages=chat_messages("Count from one to ten in words."), max_tokens=40,
              temperature=0, stop=["five", "Five"])
    return same(outcome(lambda: plain(d.chat.completions.create(**kw))),
                outcome(lambda: plain(p.chat.completions.create(**kw))))


def s_chat_logprobs(d, p):
    kw = dict(model=MODEL, messages=chat_messages("Say yes."), max_tokens=4, temperature=0, logprobs=True,
              top_logprobs=2)
    return same(outcome(lambda: plain(d.chat.completions.create(**kw))),
                outcome(lambda: plain(p.chat.completions.create(**kw))))


def s_completions(d, p):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    return same(outcome(lambda: plain(d.completions.create(**kw))),
                outcome(lambda: plain(p.completions.create(**kw))))


def s_completions_stream(d, p):
    kw = dict(model=MODEL, prompt="One, two, three,", max_tokens=10, temperature=0)
    get = lambda c: [[ch["text"] for ch in plain(x)["choices"]] for x in c.completions.create(stream=True, **kw)]  # noqa: E731
    return same(outcome(lambda: get(d)), outcome(lambda: get(p)))


def s_embeddings(d, p):
    kw = dict(model=MODEL, input=["warm path", "cold path"])
    return same(outcome(lambda: plain(d.embeddings.create(**kw))), outcome(lambda: plain(p.embeddings.create(**kw))))


def s_responses_http(d, p):
    """Through warmpath's Responses API, against the backend's chat answer to the same turn."""
    FRESH[0]()
    chat = d.chat.completions.create(model=MODEL, messages=chat_messages("What is the capital of France?"),
                                     max_tokens=24, temperature=0)
    FRESH[0]()
    r = p.responses.create(model=MODEL, instructions=SYSTEM, input="What is the capital of France?",
                           max_output_tokens=24, temperature=0)
    out = diff(chat.choices[0].message.content, r.output_text, "$.output_text")
    out += diff(chat.usage.prompt_tokens, r.usage.input_tokens, "$.usage.input_tokens")
    out += diff(chat.usage.completion_tokens, r.usage.output_tokens, "$.usage.output_tokens")
    if r.object != "response" or r.status not in ("completed", "incomplete"):
        out.append(f"not a finished response object: {r.object} {r.status}")
    # Continued by id: warmpath keeps the conversation.
    FRESH[0]()
    r2 = p.responses.create(model=MODEL, previous_response_id=r.id, input="And of Italy?", max_output_tokens=16,
                            temperature=0)
    FRESH[0]()
    chat2 = d.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=chat_messages(
        "What is the capital of France?") + [{"role": "assistant", "content": r.output_text},
                                             {"role": "user", "content": "And of Italy?"}])
    out += diff(chat2.choices[0].message.content, r2.output_text, "$.turn2.output_text")
    return out


def s_responses_ws(d, p):
    FRESH[0]()
    chat = d.chat.completions.create(model=MODEL, messages=chat_messages("Name a fruit."), max_tokens=16,
                                     temperature=0)
    text, done = "", None
    FRESH[0]()
    with p.responses.connect() as conn:
        conn.response.create(model=MODEL, instructions=SYSTEM, input="Name a fruit.", max_output_tokens=16,
                             temperature=0)
        for event in conn:
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
                done = event
                break
    if done is None or done.type not in ("response.completed", "response.incomplete"):
        return [f"the turn ended with {done}"]
    return diff(chat.choices[0].message.content, text, "$.text") + diff(
        chat.choices[0].message.content, done.response.output_text, "$.response.output_text")


def s_responses_api(d, p):
    """The rest of the Responses API, served by warmpath from its own store over this backend:
    input_tokens.count equal to the usage the backend then reports (its own count of the turn),
    retrieve equal to the created object, input_items, a conversation continued by id,
    compact, background and cancel, delete; another API key sees none of it."""
    other = openai.OpenAI(base_url=p.base_url, api_key="another-key", max_retries=0, timeout=120)
    FRESH[0]()
    r1 = p.responses.create(model=MODEL, instructions=SYSTEM, input="What is the capital of France?",
                            max_output_tokens=16, temperature=0)
    ask = dict(model=MODEL, instructions=SYSTEM, previous_response_id=r1.id, input="And of Italy?")
    counted = p.responses.input_tokens.count(**ask).input_tokens
    r2 = p.responses.create(max_output_tokens=8, temperature=0, **ask)
    out = diff(r2.usage.input_tokens, counted, "$.input_tokens.count")
    out += diff(plain(r2), plain(p.responses.retrieve(r2.id)), "$.retrieve")
    kinds = [(i.type, getattr(i, "role", None)) for i in p.responses.input_items.list(r2.id, order="asc")]
    out += diff([("message", "user"), ("message", "assistant"), ("message", "user")], kinds, "$.input_items")
    try:
        other.responses.retrieve(r2.id)
        out.append("another key retrieved the response")
    except openai.NotFoundError:
        pass
    conv = p.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}])
    p.responses.create(model=MODEL, conversation=conv.id, input="What is my name?", max_output_tokens=8, temperature=0)
    out += diff(3, len(list(p.conversations.items.list(conv.id))), "$.conversation.items")
    compacted = p.responses.compact(model=MODEL, instructions=SYSTEM, previous_response_id=r2.id,
                                    extra_body={"max_output_tokens": 32})
    out += diff(["message", "message", "compaction"], [i.type for i in compacted.output], "$.compact.output")
    r3 = p.responses.create(model=MODEL, instructions=SYSTEM, max_output_tokens=8, temperature=0,
                            input=[*compacted.output, {"role": "user", "content": "Thanks."}])
    out += diff(True, r3.status in ("completed", "incomplete"), "$.after_compact")
    bg = p.responses.create(model=MODEL, input="Count to fifty.", background=True, max_output_tokens=200)
    ended = p.responses.cancel(bg.id).status
    out += diff(True, ended in ("cancelled", "completed", "incomplete"), "$.cancel")
    p.responses.delete(r1.id)
    try:
        p.responses.retrieve(r1.id)
        out.append("a deleted response was retrieved")
    except openai.NotFoundError:
        pass
    return out


def s_errors(d, p):
    """Refusals in OpenAI's shape: a bad request as the backend answers it, an unknown model
    and a malformed body as warmpath answers them (404 model_not_found; 400)."""
    out = []
    bad = dict(model=MODEL, messages=chat_messages("hi"), max_tokens=-5)
    got_d, got_p = outcome(lambda: plain(d.chat.completions.create(**bad))), outcome(
        lambda: plain(p.chat.completions.create(**bad)))
    out += [] if got_d[:2] == got_p[:2] else [f"max_tokens=-5: direct {got_d[:2]} vs warmpath {got_p[:2]}"]
    e = outcome(lambda: p.chat.completions.create(model="no-such-model", messages=chat_messages("hi")))
    if e[0] != "error" or e[1] != 404 or e[2].get("code") != "model_not_found":
        out.append(f"unknown model: {e}")
    raw = urllib.request.Request(str(p.base_url) + "chat/completions", data=b"{not json", method="POST",
                                 headers={"content-type": "application/json"})
    try:
        urllib.request.urlopen(raw, timeout=10)
        out.append("malformed JSON was accepted")
    except urllib.error.HTTPError as h:
        body = json.loads(h.read())
        err = body.get("error", {})
        if h.code != 400 or not {"message", "type", "param", "code"} <= set(err):
            out.append(f"malformed JSON: {h.code} {body}")
    return out


# vLLM's metric definitions the bundled engine claims (vllm/v1/metrics/loggers.py): name, type,
# and for histograms the bucket bounds, so that dashboards and alerts built for vLLM read it.
_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
            480.0, 960.0, 1920.0, 7680.0]
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", None),
    "vllm:num_requests_waiting": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:prefix_cache_queries_total": ("counter", None),
    "vllm:prefix_cache_hits_total": ("counter", None),
    "vllm:num_preemptions_total": ("counter", None),
    "vllm:prompt_tokens_total": ("counter", None),
    "vllm:generation_tokens_total": ("counter", None),
    "vllm:request_success_total": ("counter", None),
    "vllm:cache_config_info": ("gauge", None),
    "vllm:time_to_first_token_seconds": ("histogram", [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                                       0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                                                       640.0, 2560.0]),
    "vllm:inter_token_latency_seconds": ("histogram", [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                                       0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]),
    "vllm:e2e_request_latency_seconds": ("histogram", _LATENCY),
    "vllm:request_queue_time_seconds": ("histogram", _LATENCY),
    "vllm:request_prefill_time_seconds": ("histogram", _LATENCY),
    "vllm:request_decode_time_seconds": ("histogram", _LATENCY),
}


def s_vllm_metrics(d, p):
    """The backend's /metrics under vLLM's names, types, labels and bucket bounds."""
    base = str(d.base_url).rsplit("/v1", 1)[0]
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    types, buckets, labels = {}, {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            series = line.rsplit(" ", 1)[0]
            name = series.split("{", 1)[0]
            if name.endswith("_bucket") and 'le="' in series:
                le = series.split('le="', 1)[1].split('"', 1)[0]
                if le != "+Inf":
                    buckets.setdefault(name[: -len("_bucket")], set()).add(float(le))
            labels.setdefault(name, set()).update(
                kv.split("=", 1)[0] for kv in series.partition("{")[2].rstrip("}").split(",") if "=" in kv)
    out = []
    for name, (kind, want) in VLLM_METRICS.items():
        family = name[: -len("_total")] if kind == "counter" and name not in types else name
        if types.get(family) != kind and types.get(name) != kind:
            out.append(f"{name}: type {types.get(family) or types.get(name)!r}, vLLM's is {kind}")
        if want is not None and sorted(buckets.get(name, [])) != want:
            out.append(f"{name}: buckets {sorted(buckets.get(name, []))} != vLLM's")
        seen = labels.get(name) or labels.get(name + "_count") or set()
        if "model_name" not in seen:
            out.append(f"{name}: no model_name label")
    return out


def s_kv_events(d, p):
    """The engine's KV events, decoded with vLLM's own msgspec definitions of them
    (vllm/distributed/kv_events.py, the array layout its publishers send) from its ZMQ socket,
    while a request goes through warmpath."""
    import msgspec
    import zmq

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(KV_EVENTS[0])
    time.sleep(0.5)  # the subscription reaches the publisher
    FRESH[0]()
    p.chat.completions.create(model=MODEL, messages=chat_messages("Tell me about caching. " * 8), max_tokens=4,
                              temperature=0)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    out, stored, seqs = [], [], []
    deadline = time.time() + 10
    while time.time() < deadline and not stored:
        if not sub.poll(200):
            continue
        frames = sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            out.append(f"not [topic, seq, payload]: {len(frames)} frames")
            break
        seqs.append(int.from_bytes(frames[1], "big"))
        try:
            batch = decoder.decode(frames[2])
        except msgspec.ValidationError as e:
            out.append(f"vLLM's decoder refuses a batch: {e}")
            break
        stored += [e for e in batch.events if isinstance(e, BlockStored)]
    sub.close()
    if not stored and not out:
        out.append("no BlockStored event within 10 s of a request")
    for e in stored:
        if len(e.token_ids) != e.block_size * len(e.block_hashes):
            out.append(f"{len(e.token_ids)} token ids for {len(e.block_hashes)} blocks of {e.block_size}")
    if seqs != sorted(seqs):
        out.append(f"sequence numbers out of order: {seqs}")
    return out


def s_render(d, p):
    """The engine's render endpoints in vLLM's `GenerateRequest` shape
    (vllm/entrypoints/serve/disagg/protocol.py: its fields, no others), their token ids the
    prompt generation counts."""
    fields = {"request_id": str, "token_ids": list, "features": (dict, type(None)), "sampling_params": dict,
              "model": (str, type(None)), "stream": (bool, type(None)), "stream_options": (dict, type(None)),
              "cache_salt": (str, type(None)), "priority": int, "kv_transfer_params": (dict, type(None))}
    base = str(d.base_url).rsplit("/v1", 1)[0]

    def post(path, body):
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=30).read())

    out = []
    messages = chat_messages("What is the capital of France?")
    chat = post("/v1/chat/completions/render", {"model": MODEL, "messages": messages, "max_tokens": 8,
                                                "temperature": 0})
    comp = post("/v1/completions/render", {"model": MODEL, "prompt": ["one", "two three"], "max_tokens": 4})
    for g in [chat] + (comp if isinstance(comp, list) else [comp]):
        extra = set(g) - set(fields)
        if extra:
            out.append(f"fields vLLM's GenerateRequest lacks: {sorted(extra)}")
        for k, t in fields.items():
            if k not in g or not isinstance(g[k], t):
                out.append(f"{k}: {g.get(k)!r} is not {t}")
        if not all(isinstance(i, int) for i in g.get("token_ids", [None])):
            out.append("token_ids are not integers")
    if not isinstance(comp, list) or len(comp) != 2:
        out.append(f"completions render: one GenerateRequest per prompt, got {comp!r:.200}")
    if chat.get("sampling_params", {}).get("max_tokens") != 8:
        out.append(f"sampling_params: {chat.get('sampling_params')}")
    FRESH[0]()
    used = d.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens
    if used != len(chat.get("token_ids", [])):
        out.append(f"{len(chat.get('token_ids', []))} rendered ids, {used} prompt tokens generated from")
    return out


def s_load(d, p):
    """warmpath reads the backend's own /metrics under its server's names (cache_aware's load
    scrape): after a request its status page shows the backend's running and waiting counts and
    its prefix-cache hit rate, as the backend's counters say."""
    FRESH[0]()
    messages = chat_messages("Tell me a short story about a cache. " * 4)
    for _ in range(2):
        p.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    admin = ADMINS[0]
    deadline, backend = time.time() + 10, {}
    while time.time() < deadline:
        status = json.loads(urllib.request.urlopen(admin + "/status.json", timeout=10).read())
        backend = status["pools"][0]["backends"][0]
        # Counters read after the second request show its hits (a read from before shows none).
        if backend.get("running_reported") is not None and (backend.get("prefix_hit_rate") or 0) > 0:
            break
        time.sleep(0.3)
    out = []
    if backend.get("running_reported") is None or backend.get("waiting_reported") is None:
        out.append(f"warmpath read no load from it: {backend}")
    if backend.get("prefix_hit_rate") is None:
        out.append(f"warmpath read no prefix-cache counters from it: {backend}")
    elif not 0.0 < backend["prefix_hit_rate"] <= 1.0:
        out.append(f"the same prompt twice, yet a hit rate of {backend['prefix_hit_rate']}")
    return out


SCENARIOS = [
    ("models", "models.list", s_models, True),
    ("chat", "chat, whole", s_chat, True),
    ("chat_stream", "chat, streamed with usage", s_chat_stream, True),
    ("chat_tools", "chat with tools", s_chat_tools, False),
    ("chat_n", "chat, n = 2", s_chat_n, False),
    ("chat_stop", "chat with stop", s_chat_stop, False),
    ("chat_logprobs", "chat with logprobs", s_chat_logprobs, False),
    ("completions", "completions", s_completions, True),
    ("completions_stream", "completions, streamed", s_completions_stream, False),
    ("embeddings", "embeddings (passed through)", s_embeddings, False),
    ("responses_http", "Responses over HTTP, continued by id", s_responses_http, True),
    ("responses_ws", "Responses over WebSocket", s_responses_ws, False),
    ("responses_api", "Responses: retrieve, input items, input tokens, conversations, compact, cancel, delete", s_responses_api, True),
    ("errors", "errors: status and shape", s_errors, True),
    ("vllm_metrics", "vLLM's metric names, types, labels, buckets", s_vllm_metrics, True),
    ("kv_events", "KV events in vLLM's wire format (its msgspec types)", s_kv_events, True),
    ("render", "render endpoints in vLLM's GenerateRequest shape", s_render, True),
    ("load", "its load and prefix hits read by warmpath", s_load, True),
]

# Scenarios that say something of one kind of backend only.
ONLY = {"vllm_metrics": {"engine"}, "kv_events": {"engine"}, "render": {"engine"}}
# Backends that run only some scenarios: llama-server in its embedding mode serves nothing else.
BACKEND_ONLY = {"llama-server --embeddings": {"models", "embeddings"}}
# llama-server in embedding mode serves no chat to measure load with.
# The engine's KV event socket (set when it starts).
KV_EVENTS = [""]
# The admin address of the warmpath in front of the backend being checked.
ADMINS = [""]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmpath", required=True)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--llama-server")
    ap.add_argument("--quick", action="store_true", help="the scenarios marked quick")
    ap.add_argument("--table")
    ap.add_argument("--json")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="warmpath-conformance-")
    servers = Servers(args, work)
    KV_EVENTS[0] = servers.kv_events
    results = {}
    try:
        for name in servers.backends:
            d = openai.OpenAI(base_url=servers.backends[name] + "/v1", api_key="none", max_retries=0, timeout=120)
            p = openai.OpenAI(base_url=servers.proxies[name] + "/v1", api_key="none", max_retries=0, timeout=120)
            FRESH[0] = forget(name, servers.backends[name])
            ADMINS[0] = servers.admins[name]
            for key, title, run, quick in SCENARIOS:
                if (args.quick and not quick) or name not in ONLY.get(key, {name}):
                    continue
                if key not in BACKEND_ONLY.get(name, {key}):
                    continue
                NOTES.clear()
                try:
                    problems = run(d, p)
                except Exception as e:  # noqa: BLE001 - a scenario that raises fails
                    problems = [f"{type(e).__name__}: {e}"]
                results.setdefault(key, {})[name] = problems
                notes = sorted(set(NOTES))
                if notes and not problems:
                    results.setdefault("_notes", {})[f"{key}/{name}"] = notes
                mark = "pass" if not problems else "FAIL"
                tail = f": {problems[:3]}" if problems else (f" ({', '.join(notes)})" if notes else "")
                print(f"{mark:4} {name:12} {title}{tail}", flush=True)
    finally:
        servers.close()
    notes = results.pop("_notes", {})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "notes": notes}, f, indent=1)
    if args.table:
        write_table(args.table, results, list(servers.backends), notes)
    failed = sum(1 for r in results.values() for v in r.values() if v)
    print(f"{failed} failed of {sum(len(r) for r in results.values())}; logs in {work}")
    return 1 if failed else 0


def forget(name, url):
    """How backend `name` at `url` drops its prefix cache."""
    def post(path):
        try:
            urllib.request.urlopen(urllib.request.Request(url + path, data=b"", method="POST"), timeout=10).read()
        except urllib.error.HTTPError:
            pass
    if name == "engine":
        return lambda: post("/reset_prefix_cache")
    # llama-server: its slots' cached prompts erased.
    return lambda: [post(f"/slots/{i}?action=erase") for i in range(SLOTS)]


SLOTS = 1


def write_table(path, results, backends, notes):
    lines = ["| scenario | " + " | ".join(backends) + " |", "| --- |" + " --- |" * len(backends)]
    for key, title, _, _ in SCENARIOS:
        if key not in results:
            continue
        cells = []
        for b in backends:
            v = results[key].get(b)
            note = notes.get(f"{key}/{b}")
            ok = "pass" + (f" ({', '.join(note)})" if note else "")
            cells.append("—" if v is None else (ok if not v else "FAIL: " + "; ".join(v)[:200].replace("|", "\\|")))
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if os.path.exists(path):
        doc = open(path).read()
        start, end = "<!-- table: written by conformance/suite.py -->", "<!-- end of table -->"
        if start in doc and end in doc:
            head, rest = doc.split(start, 1)
            tail = rest.split(end, 1)[1]
            text = head + start + "\n" + text + end + tail
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
