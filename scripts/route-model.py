#!/usr/bin/env python3
"""An offline model of `warmpath-bench compare --workload trace`, for trying routing ideas in
seconds instead of minutes: the Mooncake trace at the bench's scale, N engines stepping like the
bundled engine's `sim` executor (token budget, chunked prefill, decode steps, an LRU prefix cache
of whole 32-token trace blocks), and a router that sees what warmpath sees (an index of what it
routed where, prefill tokens not yet answered, in-flight counts).

It is a model, not a measurement: it ignores the proxy, the client, the CPU they share with
the engines, and KV blocks pinned by running requests. Its hit rates run 0.01-0.02 of the
ceiling above the real bench's; use it to rank ideas, then measure them with warmpath-bench.

    scripts/route-model.py [--mult 1.6] [--hot 1024] POLICY[:KEY=VALUE...] ...

Policies: `ca` (warmpath cache_aware: keys mw = miss_weight, bf = balance_factor,
dc = decode_cost_tokens, tie = tie_tokens, tau = work_window_s; nb = 0 breaks ties by
rendezvous only, pop = 0 and frac = 0 keep miss_weight whole for shared and short held
prefixes), `sglang` (thr = cache_threshold), `rr` (round robin). Example, the defaults of
2026-12-03 beside today's:

    scripts/route-model.py ca ca:mw=1:bf=1.5:nb=0:pop=0:frac=0 sglang
"""
import argparse
import collections
import json
import math
import os
import zlib

BLOCK = 32  # tokens per trace block: 512 × the bench's scale 0.0625
PREFILL_S = 60e-6
ITL_S = 0.005
LOAD_FACTOR = 0.5
MAX_SEQS = 16
BUDGET = 2048
TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces", "mooncake_synthetic_trace.jsonl")


def load(path, speedup=10.0, mult=1.0, hot=0):
    reqs = []
    for line in open(path):
        r = json.loads(line)
        blocks = list(r["hash_ids"])
        toks = max(1, round(r["input_length"] * 0.0625))
        out = min(32, max(1, round(r["output_length"] * 0.0625)))
        if hot:
            blocks = [("hot", i) for i in range(hot // BLOCK)] + blocks
            toks += hot
        reqs.append((r["timestamp"] / 1000.0 / speedup / mult, blocks, toks, out))
    return reqs


class Lru:
    def __init__(self, cap):
        self.cap, self.d = cap, collections.OrderedDict()

    def match(self, blocks, toks):
        n = 0
        for b in blocks[: (toks - 1) // BLOCK]:
            if b not in self.d:
                break
            n += 1
        return n

    def touch(self, blocks):
        for b in reversed(blocks):  # leaf first, as engines free a sequence's blocks
            self.d[b] = 1
            self.d.move_to_end(b)
        while len(self.d) > self.cap:
            self.d.popitem(last=False)


class Engine:
    def __init__(self, cap):
        self.cache, self.t = Lru(cap), 0.0
        self.waiting, self.running = collections.deque(), []
        self.work = self.reqs = 0

    def run_until(self, until, events):
        while (self.waiting or self.running) and self.t < until:
            while self.waiting and len(self.running) < MAX_SEQS:
                r = self.waiting.popleft()
                hit = self.cache.match(r["blocks"], r["toks"])
                r["cached"] = min(hit * BLOCK, r["toks"] - 1)
                r["left"] = r["toks"] - r["cached"]
                self.cache.touch(r["blocks"][:hit])
                self.work += r["left"]
                self.running.append(r)
            decodes = [r for r in self.running if r["left"] == 0]
            budget, prefill = BUDGET - len(decodes), 0
            for r in self.running:
                if r["left"] > 0 and budget > 0:
                    c = min(r["left"], budget)
                    r["left"] -= c
                    budget -= c
                    prefill += c
                    r["first"] = r["left"] == 0
            dt = prefill * PREFILL_S + (ITL_S * (1 + LOAD_FACTOR * len(decodes) / MAX_SEQS) if decodes else 0)
            self.t += max(dt, 1e-4)
            keep = []
            for r in self.running:
                if r["left"] == 0:
                    if r.pop("first", False):
                        r["ttft"] = self.t - r["arr"]
                        self.cache.touch(r["blocks"][: r["toks"] // BLOCK])
                        events.append(("first", r))
                    r["out"] -= 1
                    if r["out"] <= 0:
                        events.append(("end", r))
                        continue
                keep.append(r)
            self.running = keep
        self.t = max(self.t, until) if not (self.waiting or self.running) else self.t


def rank(key, i):
    return zlib.crc32(repr((key, i)).encode())


class Router:
    def __init__(self, n, cap, kind, kw):
        self.n, self.kind, self.kw = n, kind, kw
        self.index = [Lru(cap) for _ in range(n)]
        self.pending, self.inflight = [0] * n, [0] * n
        self.recent, self.at, self.rr = [0.0] * n, 0.0, -1
        self.shared = {}

    def pick(self, r):
        n, blocks, toks, kw = self.n, r["blocks"], r["toks"], self.kw
        m = [self.index[i].match(blocks, toks) for i in range(n)]
        if self.kind == "rr":
            self.rr += 1
            return self.rr % n
        if self.kind == "sglang":
            best = max(range(n), key=lambda i: m[i])
            if m[best] * BLOCK / toks > kw.get("thr", 0.3):
                return best
            return min(range(n), key=lambda i: (self.inflight[i], i))
        decay = math.exp(-(r["arr"] - self.at) / kw.get("tau", 10.0))
        self.recent, self.at = [w * decay for w in self.recent], r["arr"]
        mean = sum(self.inflight) / n
        bound = kw.get("bf", 3.0) * mean + 1
        cands = [i for i in range(n) if self.inflight[i] <= bound] or list(range(n))
        mw, dc, tie = kw.get("mw", 8.0), kw.get("dc", 32), kw.get("tie", 64)
        held = max(m)
        if held:
            # The weight of a held prefix: in full for a prompt that is all history, less for a
            # short held prefix (frac) and for one many requests lately shared (pop).
            key = blocks[held - 1]
            n, at = self.shared.get(key, (0, -1e9))
            n = n * math.exp(-(r["arr"] - at) / kw.get("tau", 10.0))
            self.shared[key] = (n + 1, r["arr"])
            share = min(1.0, held * BLOCK / toks) if kw.get("frac", 1) else 1.0
            mw = 1 + (mw - 1) * share / max(1.0, n) ** kw.get("pop", 1)
        cost = {i: mw * (toks - min(m[i] * BLOCK, toks)) + self.pending[i] + dc * self.inflight[i] for i in cands}
        best = min(cost.values())
        key = blocks[min(held + 2, len(blocks)) - 1]
        nb = kw.get("nb", 1)
        return max(
            (i for i in cands if cost[i] <= best + tie),
            key=lambda i: (m[i], -int(self.recent[i] / tie) if nb else 0, rank(key, i)),
        )


def run(reqs, kind, cap, n, kw):
    engines = [Engine(cap) for _ in range(n)]
    router, events, done = Router(n, cap, kind, kw), [], []
    for arr, blocks, toks, out in reqs:
        for e in engines:
            e.run_until(arr, events)
        for ev, r in events:
            if ev == "first":
                router.pending[r["eng"]] -= r["pend"]
            else:
                router.inflight[r["eng"]] -= 1
        events.clear()
        r = {"arr": arr, "blocks": blocks, "toks": toks, "out": out}
        i = router.pick(r)
        r["eng"], r["pend"] = i, toks - min(router.index[i].match(blocks, toks) * BLOCK, toks)
        router.index[i].touch(blocks[: toks // BLOCK])
        router.recent[i] += r["pend"]
        router.pending[i] += r["pend"]
        router.inflight[i] += 1
        engines[i].waiting.append(r)
        engines[i].reqs += 1
        done.append(r)
    for e in engines:
        e.run_until(1e18, events)
    ttft = sorted(r["ttft"] for r in done)
    q = lambda p: ttft[min(len(ttft) - 1, int(p * len(ttft)))] * 1000
    work, reqn = [e.work for e in engines], [e.reqs for e in engines]
    return {
        "hit": sum(r["cached"] for r in done) / sum(r["toks"] for r in done),
        "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
        "wimb": max(work) / (sum(work) / n), "rimb": max(reqn) / (sum(reqn) / n),
        "own_p99": sorted((r["toks"] - r["cached"]) * PREFILL_S * 1000 for r in done)[int(0.99 * len(done))],
    }


def ceiling(reqs, cap):
    c, hits, total = Lru(cap), 0, 0
    for _, blocks, toks, _ in reqs:
        hits += min(c.match(blocks, toks) * BLOCK, toks - 1)
        total += toks
        c.touch(blocks[: toks // BLOCK])
    return hits / total


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--mult", type=float, default=1.0, help="arrivals this much faster (high-load: 1.6)")
    ap.add_argument("--hot", type=int, default=0, help="tokens of a system prompt every request shares")
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--cap", type=int, default=6267, help="each engine's KV in 32-token blocks (bench: 0.15x the working set)")
    ap.add_argument("policies", nargs="+")
    a = ap.parse_args()
    reqs = load(a.trace, mult=a.mult, hot=a.hot)
    ceil = ceiling(reqs, a.cap * a.backends)
    print(f"{len(reqs)} requests, partition ceiling {ceil:.3f}")
    for spec in a.policies:
        kind, *kv = spec.split(":")
        r = run(reqs, kind, a.cap, a.backends, {k: float(v) for k, v in (x.split("=") for x in kv)})
        print(f"{spec:32s} hit/ceiling {r['hit'] / ceil:.3f}  TTFT p50 {r['p50']:.0f} p90 {r['p90']:.0f} "
              f"p99 {r['p99']:.0f} ms (own prefill p99 {r['own_p99']:.0f})  work imbalance {r['wimb']:.2f}  "
              f"requests {r['rimb']:.2f}")


if __name__ == "__main__":
    main()
