#!/usr/bin/env python3
"""Where TTFT tails come from, per run of `warmpath-bench compare --per-request DIR`.

For each TSV in DIR: TTFT p50/p90/p99 and the p99 of own prefill (uncached tokens × the prefill
cost: the TTFT with no queue, which no router can beat); the slowest 1 % of requests (their prompt and uncached
tokens, and how long they waited beyond their own prefill); and, by uncached tokens, the wait
beyond own prefill (TTFT − uncached × the engines' prefill cost per token) at p50 and p90.
The wait is what routing controls: the work queued ahead on the engine it picked.

    scripts/ttft-tail.py DIR [--prefill-us 60]
"""
import argparse
import csv
import glob
import os
import statistics as st


def quantile(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--prefill-us", type=float, default=60.0, help="engines' prefill µs per token")
    a = ap.parse_args()
    per_ms = a.prefill_us / 1000.0
    for path in sorted(glob.glob(os.path.join(a.dir, "*.tsv"))):
        rows = [r for r in csv.DictReader(open(path), delimiter="\t") if r["ok"] == "1" and r["ttft_ms"]]
        if not rows:
            continue
        ttft = [float(r["ttft_ms"]) for r in rows]
        unc = [int(r["prompt_tokens"] or 0) - int(r["cached_tokens"] or 0) for r in rows]
        wait = [t - u * per_ms for t, u in zip(ttft, unc)]
        p99 = quantile(ttft, 0.99)
        tail = [i for i, t in enumerate(ttft) if t >= p99]
        own = [u * per_ms for u in unc]
        print(f"{os.path.basename(path)}: {len(rows)} requests, TTFT p50 {quantile(ttft, .5):.0f} "
              f"p90 {quantile(ttft, .9):.0f} p99 {p99:.0f} ms; own prefill p99 {quantile(own, .99):.0f} ms "
              f"(the floor with no queue)")
        print(f"  slowest 1 % ({len(tail)}): prompt {st.median(int(rows[i]['prompt_tokens'] or 0) for i in tail):.0f} "
              f"tokens, uncached {st.median(unc[i] for i in tail):.0f} (own prefill "
              f"{st.median(unc[i] for i in tail) * per_ms:.0f} ms), waited {st.median(wait[i] for i in tail):.0f} ms "
              f"beyond it (medians)")
        buckets = {}
        for u, w in zip(unc, wait):
            buckets.setdefault(min(u // 500, 6), []).append(w)
        cells = []
        for k, v in sorted(buckets.items()):
            label = f"{k * 500}+" if k == 6 else f"{k * 500}-{k * 500 + 499}"
            cells.append(f"{label}: {len(v)} wait p50 {quantile(v, .5):.0f} p90 {quantile(v, .9):.0f}")
        print("  by uncached tokens — " + "; ".join(cells))


if __name__ == "__main__":
    main()
