#!/usr/bin/env python3
"""A chat-completions server that streams with Nagle's algorithm on (no TCP_NODELAY), as some
HTTP servers do by default: for checking what a proxy's ACKs do to a stream's latency.

Each `POST /v1/chat/completions` on a kept-alive connection is answered with a chunked SSE
stream: the response head at once, then `--events` content deltas `--gap-ms` apart, then
`data: [DONE]`. Each write is small, so with Nagle's algorithm a write waits for the ACK of the
one before: a reader that delays its ACKs (up to 40 ms) delays the stream by as much.

    scripts/sse-nagle-server.py PORT [--events 30] [--gap-ms 5]

`scripts/ttft-seq.py PORT` measures it directly and through a proxy.
"""
import argparse
import json
import socket
import threading
import time


def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)


def serve(conn, events, gap):
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
        head, _, buf = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(buf) < length:
            buf += conn.recv(65536)
        buf = buf[length:]
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for i in range(events):
            time.sleep(gap)
            delta = {"choices": [{"index": 0, "delta": {"content": "w%d " % i}}], "object": "chat.completion.chunk"}
            conn.sendall(chunk(b"data: " + json.dumps(delta, separators=(",", ":")).encode() + b"\n\n"))
        conn.sendall(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("port", type=int)
    ap.add_argument("--events", type=int, default=30)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    a = ap.parse_args()
    listener = socket.create_server(("127.0.0.1", a.port))
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn, a.events, a.gap_ms / 1000), daemon=True).start()


if __name__ == "__main__":
    main()
