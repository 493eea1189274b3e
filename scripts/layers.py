#!/usr/bin/env python3
"""The proxy's layers, checked: every `use crate::…` (and inline `crate::…` path) in
proxy/src must point at a module of a lower layer, or of the same top-level module. Prints each
import that runs back up (or sideways between two modules of one layer) and exits 1 when there
are more than ALLOWED. docs/ARCHITECTURE.md draws the same table.

    python3 scripts/layers.py          # from the repository root
"""
import os
import re
import sys

# Bottom first. A module may import from the layers before its own.
LAYERS = [
    ["config", "request", "observe"],          # foundations: plain data, the parsed request, metrics
    ["limits", "upstream", "tls", "shared", "otlp"],   # connection-level limits and TLS, connections to backends and to Redis, trace export
    ["tools", "safety"],                       # deferred tool discovery, safety checks (pure)
    ["canon", "cache", "session", "route", "embedded", "auth"],  # the stages, each owning its state
    ["state", "policy"],                       # shared state, pools with every stage's part, request context; the policy file loaded
    ["pipeline"],                              # one LLM request through the stages, in order
    ["responses"],                             # a Responses turn over the pipeline
    ["http", "ws"],                            # entry points, siblings
    ["entry", "shutdown", "build"],            # pingora's ProxyHttp: which entry point a request goes to; the drain; the state built from a policy
    ["reload"],                                # policy reloads: a new state swapped in
    ["server"],                                # assembly: everything built from the policy file
    ["cli", "main", "lib"],                    # the command line
]
ALLOWED = 0

def layer_of(mod):
    for i, names in enumerate(LAYERS):
        if mod in names:
            return i
    return None

def top_module(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    return rel[0]

def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
    src = os.path.join(root, "proxy", "src")
    bad, unknown = [], set()
    for dirpath, _, files in os.walk(src):
        for fn in sorted(files):
            if not fn.endswith(".rs"):
                continue
            path = os.path.join(dirpath, fn)
            here = top_module(src, path)
            text = re.sub(r"//[^\n]*", "", open(path, encoding="utf-8").read())
            text = re.sub(r"#\[cfg\(test\)\]\s*mod\s+tests\s*\{.*", "", text, flags=re.S)
            if fn == "tests.rs":
                continue  # a module's own test file
            targets = set(re.findall(r"(?<![:\w])crate::(\w+)", text))
            for block in re.findall(r"use\s+crate::\{([^;]*)\};", text, flags=re.S):
                targets |= set(re.findall(r"(?:^|[,{\s])(\w+)(?=::|\s*[,}]|$)", block))
            for t in sorted(targets):
                if t == here or t in ("self", "super"):
                    continue
                lh, lt = layer_of(here), layer_of(t)
                if lh is None:
                    unknown.add(here)
                    continue
                if lt is None:
                    unknown.add(t)
                    continue
                if lt >= lh:
                    bad.append(f"{os.path.relpath(path, root)}: {here} (layer {lh}) imports {t} (layer {lt})")
    for u in sorted(unknown):
        print(f"module {u} is in no layer: add it to LAYERS in scripts/layers.py and to docs/ARCHITECTURE.md")
    for b in bad:
        print(b)
    print(f"{len(bad)} imports up or across the layers (allowed: {ALLOWED})")
    sys.exit(1 if unknown or len(bad) > ALLOWED else 0)

if __name__ == "__main__":
    main()
