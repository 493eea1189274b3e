#!/usr/bin/env python3
"""Time to first token of sequential streamed chat requests, as a client sees it.

Each request is a fresh TCP connection carrying one `POST /v1/chat/completions` with
`stream: true`; its TTFT is the time from the request's first byte sent to the first byte of a
non-empty `content` delta received. Requests run one after another, so what is measured is the
path's latency, not a queue: a proxy in front of a server adds its own delay (and any delayed
ACK or Nagle wait the two sides' sockets cause) and nothing else.

    scripts/ttft-seq.py PORT [-n 30] [--warmup 5] [--words 50] [--max-tokens 8]

prints, over the `-n` measured requests, the p50 and p90 of the TTFT, of the whole answer's
time, and of each answer's longest wait between two reads after its first token. Used for the llama-server rows
of bench/results/overhead-reactor-2026-12-07.md.
"""
import argparse
import json
import socket
import time


def one(port, body):
    """One streamed request: seconds to its first content byte (None when none came), to its
    end, and the longest wait between two reads after the first content (a stream's stall)."""
    s = socket.create_connection(("127.0.0.1", port))
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        "content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    ).encode()
    start = time.perf_counter()
    s.sendall(head + body)
    seen, first, last, stall = b"", None, None, 0.0
    while True:
        data = s.recv(65536)
        now = time.perf_counter()
        if not data:
            break
        if first is not None:
            stall = max(stall, now - last)
        last = now
        seen += data
        if first is None and b'"content":"' in seen.replace(b'"content":""', b""):
            first = now - start
        if b"[DONE]" in seen or b'"error"' in seen:
            break
    s.close()
    return first, time.perf_counter() - start, stall


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("port", type=int)
    ap.add_argument("-n", type=int, default=30, help="requests measured")
    ap.add_argument("--warmup", type=int, default=5, help="requests sent first and not counted")
    ap.add_argument("--words", type=int, default=50, help="the prompt: 'hello there ' this many times")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--model", default="m")
    a = ap.parse_args()
    body = json.dumps(
        {
            "model": a.model,
            "messages": [{"role": "user", "content": "hello there " * a.words}],
            "max_tokens": a.max_tokens,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    for _ in range(a.warmup):
        one(a.port, body)
    runs = [one(a.port, body) for _ in range(a.n)]
    missing = sum(r[0] is None for r in runs)
    if missing:
        raise SystemExit(f"{missing} of {a.n} requests streamed no content")

    def pct(v):
        v = sorted(v)
        return v[len(v) // 2] * 1000, v[int(len(v) * 0.9)] * 1000

    print(
        "ttft ms p50 %.1f p90 %.1f; whole answer ms p50 %.1f p90 %.1f; longest stall ms p50 %.1f p90 %.1f"
        % (pct([r[0] for r in runs]) + pct([r[1] for r in runs]) + pct([r[2] for r in runs]))
    )


if __name__ == "__main__":
    main()
