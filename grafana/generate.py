#!/usr/bin/env python3
"""warmpath's Grafana dashboards, written from the panel lists below.

    python3 grafana/generate.py           # writes grafana/dashboards/*.json
    python3 grafana/generate.py --check   # exits 1 when the JSON files differ from these lists
    python3 grafana/generate.py --queries # every panel query, one JSON object a line (the test
                                          # evaluates each through Prometheus)

The JSON files are what Grafana loads (grafana/provisioning/); this file is where a panel is
changed. Every panel has a unit and a description. Queries may use the dashboards' variables
`$pool` and `$backend` (warmpath), `$instance` and `$model_name` (engines), and
`$__rate_interval`.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

POOL = 'pool=~"$pool"'
PB = 'pool=~"$pool", backend=~"$backend"'
BK = 'backend=~"$backend"'
RI = "$__rate_interval"


def rate(metric, sel="", by=None, fn="rate"):
    inner = f"{fn}({metric}{{{sel}}}[{RI}])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def quantile(q, metric, sel, by):
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{sel}}}[{RI}])))"


def panel(title, unit, description, *targets, kind="timeseries", stack=False):
    """`targets`: (expr, legend) pairs."""
    return {
        "title": title,
        "unit": unit,
        "description": description,
        "targets": list(targets),
        "kind": kind,
        "stack": stack,
    }


def row(title, *panels):
    return (title, list(panels))


OVERVIEW = [
    row(
        "Traffic",
        panel(
            "Requests by route",
            "reqps",
            "Requests finished per second, by API route (warmpath_requests_total). A WebSocket connection "
            "counts once when it ends; its turns are in the WebSockets row.",
            (rate("warmpath_requests_total", BK, "route"), "{{route}}"),
            stack=True,
        ),
        panel(
            "Answers by status",
            "reqps",
            "Requests per second by the HTTP status the client got; 499: the client left first.",
            (rate("warmpath_requests_total", BK, "status"), "{{status}}"),
            stack=True,
        ),
        panel(
            "Error ratio",
            "percentunit",
            "Share of requests answered 5xx (warmpath's own refusals and backend failures it could not "
            "retry away). The alert WarmpathHighErrorRatio fires above 5 % for 5 minutes.",
            (
                f'(sum(rate(warmpath_requests_total{{{BK}, status=~"5.."}}[{RI}])) or vector(0))'
                f' / sum(rate(warmpath_requests_total{{{BK}}}[{RI}]))',
                "5xx share",
            ),
        ),
        panel(
            "Time to first token by pool",
            "s",
            "Arrival at warmpath to the first body byte the client gets (warmpath_ttft_seconds), "
            "p50 / p90 / p99 per pool: queueing, routing, the backend's prefill and any safety hold.",
            (quantile(0.5, "warmpath_ttft_seconds", PB, "pool"), "p50 {{pool}}"),
            (quantile(0.9, "warmpath_ttft_seconds", PB, "pool"), "p90 {{pool}}"),
            (quantile(0.99, "warmpath_ttft_seconds", PB, "pool"), "p99 {{pool}}"),
        ),
        panel(
            "Time to first token p99 by backend",
            "s",
            "p99 time to first token of the requests each backend served (the last one tried).",
            (quantile(0.99, "warmpath_ttft_seconds", PB, "backend"), "{{backend}}"),
        ),
        panel(
            "Request latency by pool",
            "s",
            "Arrival to the last byte sent (warmpath_request_duration_seconds), p50 and p99 per pool.",
            (quantile(0.5, "warmpath_request_duration_seconds", PB, "pool"), "p50 {{pool}}"),
            (quantile(0.99, "warmpath_request_duration_seconds", PB, "pool"), "p99 {{pool}}"),
        ),
        panel(
            "In flight per backend",
            "short",
            "Requests holding a slot on each backend (what least_load and max_inflight_per_backend read).",
            (f"warmpath_backend_inflight{{{PB}}}", "{{backend}}"),
            stack=True,
        ),
        panel(
            "Queued for a backend slot",
            "short",
            "Requests waiting because every backend of the pool was at max_inflight_per_backend, and "
            "queued requests refused per second (full: max_queued; timeout: queue_timeout_ms).",
            (f"sum by (pool) (warmpath_queue_depth{{{POOL}}})", "waiting {{pool}}"),
            (rate("warmpath_queue_rejected_total", POOL, "pool, reason"), "refused/s {{pool}} {{reason}}"),
        ),
        panel(
            "Queue wait",
            "s",
            "How long queued requests waited for a slot, served or not: p50 and p99 per pool.",
            (quantile(0.5, "warmpath_queue_wait_seconds", POOL, "pool"), "p50 {{pool}}"),
            (quantile(0.99, "warmpath_queue_wait_seconds", POOL, "pool"), "p99 {{pool}}"),
        ),
    ),
    row(
        "Cache and routing",
        panel(
            "Routing decisions by reason",
            "ops",
            "Each backend choice per second by why it was made: for cache_aware `cache` (the longest "
            "cached prefix), `load_partial`/`load_uncached` (load outweighed the cache), `new_prefix`, "
            "`affinity`; for the other policies their own reasons (docs/metrics.md).",
            (rate("warmpath_routing_decisions_total", POOL, "pool, reason"), "{{pool}} {{reason}}"),
            stack=True,
        ),
        panel(
            "Prefix cache hit rate (backends)",
            "percentunit",
            "Prompt tokens the backends served from their prefix cache over tokens looked up, from the "
            "backends' own vllm:prefix_cache_* counters, per scraped backend. Cache-aware routing exists "
            "to keep this high; the alert WarmpathPrefixHitRateCollapse watches it.",
            (
                f"sum by (instance) (rate(vllm:prefix_cache_hits_total[{RI}]))"
                f" / sum by (instance) (rate(vllm:prefix_cache_queries_total[{RI}]))",
                "{{instance}}",
            ),
        ),
        panel(
            "Prefix index: blocks per backend",
            "short",
            "Prefix blocks warmpath's index says each backend holds, against its KV capacity in blocks "
            "(cache_aware pools).",
            (f"warmpath_prefix_index_blocks{{{PB}}}", "held {{backend}}"),
            (f"warmpath_prefix_index_capacity_blocks{{{PB}}}", "capacity {{backend}}"),
        ),
        panel(
            "Prefix index memory",
            "bytes",
            "Memory held by each cache_aware pool's prefix index.",
            (f"warmpath_prefix_index_bytes{{{POOL}}}", "{{pool}}"),
        ),
        panel(
            "Stable prefixes: canonicalization",
            "ops",
            "Requests canonicalization changed per second (tools reordered, volatile system-prompt lines "
            "moved behind the prefix), and the bytes it moved.",
            (rate("warmpath_canon_edits_total", POOL, "pool, edit"), "{{pool}} {{edit}}"),
            (rate("warmpath_canon_moved_bytes_total", POOL, "pool"), "bytes moved/s {{pool}}"),
        ),
        panel(
            "Deferred tools: prompt bytes saved",
            "Bps",
            "Prompt bytes per second not sent because tool schemas were replaced by tool_search (less "
            "the tool_search tool itself), and the schemas deferred per second.",
            (rate("warmpath_tools_saved_bytes_total", POOL, "pool"), "bytes {{pool}}"),
            (rate("warmpath_tools_deferred_total", POOL, "pool"), "schemas {{pool}}"),
        ),
        panel(
            "Response cache",
            "reqps",
            "Requests to pools with a response cache, by result: hit (answered by warmpath), miss, "
            "bypass (not deterministic, a Responses request, or no-store).",
            (rate("warmpath_response_cache_requests_total", POOL, "pool, result"), "{{pool}} {{result}}"),
            stack=True,
        ),
    ),
    row(
        "WebSockets",
        panel(
            "Open WebSockets",
            "short",
            "Responses WebSocket connections open now.",
            ("sum(warmpath_websocket_connections)", "open"),
        ),
        panel(
            "Responses turns",
            "ops",
            "Responses turns per second by transport (http, websocket) and outcome.",
            (rate("warmpath_responses_turns_total", "", "transport, outcome"), "{{transport}} {{outcome}}"),
            stack=True,
        ),
        panel(
            "WebSocket closes by code",
            "ops",
            "Connections closed per second by the close code warmpath sent (1000 normal, 1001 going "
            "away, 1006 the client vanished, 1008 policy, 1009 too big, 1012 restart, 1013 try later).",
            (rate("warmpath_websocket_closed_total", "", "code"), "{{code}}"),
        ),
        panel(
            "WebSocket traffic",
            "Bps",
            "Message payload bytes per second: in (client events), out (server events).",
            (rate("warmpath_websocket_message_bytes_total", "", "direction"), "{{direction}}"),
        ),
    ),
    row(
        "Backend health",
        panel(
            "Backends up",
            "short",
            "1 while a backend takes traffic (its probes pass and it is not ejected). The alert "
            "WarmpathBackendDown fires after 1 minute at 0.",
            (f"warmpath_backend_up{{{PB}}}", "{{pool}} {{backend}}"),
        ),
        panel(
            "Ejections",
            "short",
            "Passive ejections (consecutive failures) per backend over the interval.",
            (rate("warmpath_backend_ejections_total", PB, "backend", fn="increase"), "{{backend}}"),
        ),
        panel(
            "Retries",
            "ops",
            "Requests retried on another backend per second, by what failed.",
            (rate("warmpath_retries_total", POOL, "pool, reason"), "{{pool}} {{reason}}"),
        ),
        panel(
            "Upstream errors",
            "ops",
            "Failures talking to a backend per second: connect, io, timeout, status_5xx, stream_cut.",
            (rate("warmpath_upstream_errors_total", BK, "backend, kind"), "{{backend}} {{kind}}"),
        ),
        panel(
            "Health probes",
            "ops",
            "Active probes per second by result: ok, fail, busy (unanswered while serving: not a failure).",
            (rate("warmpath_health_checks_total", PB, "backend, result"), "{{backend}} {{result}}"),
        ),
    ),
    row(
        "Limits and safety",
        panel(
            "Refused by warmpath",
            "reqps",
            "Requests warmpath answered with an error itself, by reason (rate limits, overload, "
            "context length, content policy, bad requests; docs/metrics.md lists them).",
            (rate("warmpath_rejections_total", "", "reason"), "{{reason}}"),
            stack=True,
        ),
        panel(
            "Requests per API key",
            "reqps",
            "Requests per key name by outcome: admitted, limited (429), forbidden (403).",
            (rate("warmpath_key_requests_total", "", "key, outcome"), "{{key}} {{outcome}}"),
        ),
        panel(
            "Per-key limits hit",
            "reqps",
            "Requests and WebSocket upgrades refused by a per-key limit, by key and limit.",
            (rate("warmpath_key_limited_total", "", "key, limit"), "{{key}} {{limit}}"),
        ),
        panel(
            "Tokens per API key",
            "short",
            "Prompt and completion tokens per second per key, from the answers' usage.",
            (rate("warmpath_key_tokens_total", "", "key, kind"), "{{key}} {{kind}}"),
        ),
        panel(
            "Safety verdicts",
            "ops",
            "Safety checks run per second by check, stage (input, output) and verdict (pass, block, "
            "audit_block, error).",
            (rate("warmpath_safety_checks_total", POOL, "check, stage, verdict"), "{{check}} {{stage}} {{verdict}}"),
        ),
        panel(
            "Safety check time",
            "s",
            "p99 time of each safety check, its service call included.",
            (quantile(0.99, "warmpath_safety_check_seconds", "", "check"), "{{check}}"),
        ),
        panel(
            "Held in memory",
            "bytes",
            "Bytes of request bodies and unfinished WebSocket messages held (bounded by [limits] "
            "max_buffered_mib).",
            ("sum(warmpath_buffered_bytes)", "buffered"),
        ),
        panel(
            "Open API connections",
            "short",
            "Connections open on the API listener (bounded by [limits] max_connections), and those shed "
            "per second.",
            ("sum(warmpath_connections_open)", "open"),
            ("sum(rate(warmpath_connections_rejected_total[$__rate_interval]))", "shed/s"),
        ),
    ),
    row(
        "Configuration",
        panel(
            "Policy reloads",
            "short",
            "Policy reloads over the interval: ok, or error (the old policy keeps serving; the log "
            "says why).",
            (rate("warmpath_config_reloads_total", "", "result", fn="increase"), "{{result}}"),
        ),
        panel(
            "Policy file served",
            "short",
            "The first 16 hex digits of the SHA-256 of the policy file each warmpath serves: several "
            "at once means the fleet runs different policies.",
            ("count by (sha256) (warmpath_config_info)", "{{sha256}}"),
        ),
    ),
]

ENGINE_SEL = 'instance=~"$instance", model_name=~"$model_name"'

ENGINE = [
    row(
        "Load",
        panel(
            "Requests running and waiting",
            "short",
            "Sequences in the running batch and queued (new or preempted), per server.",
            (f"vllm:num_requests_running{{{ENGINE_SEL}}}", "running {{instance}}"),
            (f"vllm:num_requests_waiting{{{ENGINE_SEL}}}", "waiting {{instance}}"),
        ),
        panel(
            "KV cache usage",
            "percentunit",
            "Share of KV blocks held by requests (cached but free blocks count as free).",
            (f"vllm:kv_cache_usage_perc{{{ENGINE_SEL}}}", "{{instance}}"),
        ),
        panel(
            "Prefix cache hit rate",
            "percentunit",
            "Prompt tokens served from the prefix cache over prompt tokens looked up.",
            (
                f"sum by (instance) (rate(vllm:prefix_cache_hits_total{{{ENGINE_SEL}}}[{RI}]))"
                f" / sum by (instance) (rate(vllm:prefix_cache_queries_total{{{ENGINE_SEL}}}[{RI}]))",
                "{{instance}}",
            ),
        ),
        panel(
            "Preemptions",
            "ops",
            "Sequences preempted per second for lack of KV blocks.",
            (rate("vllm:num_preemptions_total", ENGINE_SEL, "instance"), "{{instance}}"),
        ),
    ),
    row(
        "Throughput",
        panel(
            "Token throughput",
            "short",
            "Prompt tokens admitted and tokens generated per second.",
            (rate("vllm:prompt_tokens_total", ENGINE_SEL, "instance"), "prompt {{instance}}"),
            (rate("vllm:generation_tokens_total", ENGINE_SEL, "instance"), "generated {{instance}}"),
        ),
        panel(
            "Finished requests",
            "reqps",
            "Requests finished per second by reason (stop, length).",
            (rate("vllm:request_success_total", ENGINE_SEL, "instance, finished_reason"), "{{instance}} {{finished_reason}}"),
            stack=True,
        ),
        panel(
            "Speculative decoding acceptance",
            "percentunit",
            "Proposed tokens accepted over tokens proposed (servers running speculative decoding; "
            "NaN while nothing was proposed).",
            (
                f"sum by (instance) (rate(vllm:spec_decode_num_accepted_tokens_total{{{ENGINE_SEL}}}[{RI}]))"
                f" / sum by (instance) (rate(vllm:spec_decode_num_draft_tokens_total{{{ENGINE_SEL}}}[{RI}]))",
                "{{instance}}",
            ),
        ),
    ),
    row(
        "Latency",
        panel(
            "Time to first token",
            "s",
            "Arrival to first token at the server: p50 and p99.",
            (quantile(0.5, "vllm:time_to_first_token_seconds", ENGINE_SEL, "instance"), "p50 {{instance}}"),
            (quantile(0.99, "vllm:time_to_first_token_seconds", ENGINE_SEL, "instance"), "p99 {{instance}}"),
        ),
        panel(
            "Inter-token latency",
            "s",
            "Time between consecutive tokens of a request: p50 and p99.",
            (quantile(0.5, "vllm:inter_token_latency_seconds", ENGINE_SEL, "instance"), "p50 {{instance}}"),
            (quantile(0.99, "vllm:inter_token_latency_seconds", ENGINE_SEL, "instance"), "p99 {{instance}}"),
        ),
        panel(
            "End-to-end latency",
            "s",
            "Arrival to last token at the server: p50 and p99.",
            (quantile(0.5, "vllm:e2e_request_latency_seconds", ENGINE_SEL, "instance"), "p50 {{instance}}"),
            (quantile(0.99, "vllm:e2e_request_latency_seconds", ENGINE_SEL, "instance"), "p99 {{instance}}"),
        ),
        panel(
            "Where request time goes",
            "s",
            "Mean time per request in the queue, in prefill and in decode.",
            *[
                (
                    f"sum by (instance) (rate(vllm:request_{p}_time_seconds_sum{{{ENGINE_SEL}}}[{RI}]))"
                    f" / sum by (instance) (rate(vllm:request_{p}_time_seconds_count{{{ENGINE_SEL}}}[{RI}]))",
                    f"{p} {{{{instance}}}}",
                )
                for p in ("queue", "prefill", "decode")
            ],
            stack=True,
        ),
    ),
]


def variable(name, label, query, include_all=True):
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "multi": True,
        "includeAll": include_all,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def datasource_variable():
    return {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
    }


def build(uid, title, description, rows, variables):
    panels, pid, y = [], 1, 0
    for title_row, row_panels in rows:
        panels.append(
            {"id": pid, "type": "row", "title": title_row, "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []}
        )
        pid, y = pid + 1, y + 1
        for i, p in enumerate(row_panels):
            x = (i % 3) * 8
            if i and i % 3 == 0:
                y += 8
            panels.append(
                {
                    "id": pid,
                    "type": p["kind"],
                    "title": p["title"],
                    "description": p["description"],
                    "datasource": DATASOURCE,
                    "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
                    "fieldConfig": {
                        "defaults": {
                            "unit": p["unit"],
                            "custom": {"stacking": {"mode": "normal" if p["stack"] else "none"}, "fillOpacity": 10},
                        },
                        "overrides": [],
                    },
                    "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}, "tooltip": {"mode": "multi"}},
                    "targets": [
                        {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + k)}
                        for k, (expr, legend) in enumerate(p["targets"])
                    ],
                }
            )
            pid += 1
        y += 8
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["warmpath", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [datasource_variable()] + variables},
        "annotations": {"list": []},
        "panels": panels,
    }


DASHBOARDS = {
    "warmpath.json": lambda: build(
        "warmpath-overview",
        "warmpath",
        "warmpath, the cache-aware sidecar: traffic, latency, cache and routing, WebSockets, backend "
        "health, limits and safety.",
        OVERVIEW,
        [
            variable("pool", "Pool", "label_values(warmpath_backend_up, pool)"),
            variable("backend", "Backend", 'label_values(warmpath_backend_up{pool=~"$pool"}, backend)'),
        ],
    ),
    "engine.json": lambda: build(
        "warmpath-engine",
        "LLM servers (vLLM metrics)",
        "Model servers by vLLM's metric names: warmpath-engine, and vLLM itself.",
        ENGINE,
        [
            variable("instance", "Server", "label_values(vllm:num_requests_running, instance)"),
            variable("model_name", "Model", 'label_values(vllm:num_requests_running{instance=~"$instance"}, model_name)'),
        ],
    ),
}


def render(make):
    return json.dumps(make(), indent=2, ensure_ascii=False) + "\n"


def main():
    out = os.path.join(HERE, "dashboards")
    if "--queries" in sys.argv:
        for name, make in DASHBOARDS.items():
            for p in make()["panels"]:
                for t in p.get("targets", []):
                    print(json.dumps({"dashboard": name, "panel": p["title"], "refId": t["refId"], "expr": t["expr"]}))
        return 0
    stale = []
    for name, make in DASHBOARDS.items():
        path = os.path.join(out, name)
        text = render(make)
        if "--check" in sys.argv:
            if not os.path.exists(path) or open(path, encoding="utf-8").read() != text:
                stale.append(path)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    if stale:
        print("out of date (run python3 grafana/generate.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
