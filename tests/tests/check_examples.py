"""Checks examples/ and grafana/'s YAML as far as this machine can without Docker or a
cluster: every file parses; compose services' build files and mounted host paths exist;
Kubernetes objects are whole (apiVersion, kind, name), their volumes name ConfigMaps of the same
file and their probes name ports the container declares; every policy the examples embed is
written out for `warmpath check-config`. Prints one JSON object: {"policies": [paths],
"prometheus": [paths], "errors": [...]}.

    python3 check_examples.py REPO OUT_DIR
"""
import json
import os
import sys

import yaml

repo, out_dir = sys.argv[1], sys.argv[2]
errors, policies, prometheus = [], [], []


def load_all(path):
    try:
        with open(path) as f:
            return [d for d in yaml.safe_load_all(f) if d is not None]
    except Exception as e:  # noqa: BLE001 - a parse error is the finding
        errors.append(f"{path}: {e}")
        return []


def rel(base, p):
    return os.path.normpath(os.path.join(base, p))


# Every YAML file of examples/ and grafana/ parses.
for top in ("examples", "grafana"):
    for dirpath, _, files in os.walk(os.path.join(repo, top)):
        for name in files:
            if name.endswith((".yml", ".yaml")):
                load_all(os.path.join(dirpath, name))

# Compose: build contexts, Dockerfiles and mounted host paths exist.
compose = os.path.join(repo, "examples/compose/docker-compose.yml")
base = os.path.dirname(compose)
(doc,) = load_all(compose) or [{}]
services = doc.get("services", {})
for want in ("warmpath", "prometheus", "grafana"):
    if want not in services:
        errors.append(f"compose: no {want} service")
if sum(1 for s in services.values() if "vllm" in str(s.get("image", ""))) < 2:
    errors.append("compose: fewer than two vLLM servers")
for name, svc in services.items():
    build = svc.get("build")
    if build:
        ctx = rel(base, build.get("context", "."))
        if not os.path.isfile(os.path.join(ctx, build.get("dockerfile", "Dockerfile"))):
            errors.append(f"compose {name}: no Dockerfile {build}")
    for v in svc.get("volumes", []):
        src = v.split(":")[0]
        if src.startswith((".", "/")) and not os.path.exists(rel(base, src)):
            errors.append(f"compose {name}: mounts {src}, which does not exist")
        if src.endswith(".toml"):
            policies.append(rel(base, src))
        if src.endswith("prometheus.yml"):
            prometheus.append(rel(base, src))

# Kubernetes: objects whole, volumes and probes pointing at what exists; the policies out.
for path in sorted(os.listdir(os.path.join(repo, "examples/kubernetes"))):
    full = os.path.join(repo, "examples/kubernetes", path)
    docs = load_all(full)
    maps = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ConfigMap"}
    services = [d for d in docs if d.get("kind") == "Service"]
    if not any(d.get("kind") == "ServiceMonitor" for d in docs):
        errors.append(f"{path}: no ServiceMonitor (the Prometheus Operator's scrape of warmpath)")
    for mon in (d for d in docs if d.get("kind") == "ServiceMonitor"):
        want = mon["spec"]["selector"]["matchLabels"]
        hits = [s for s in services if want.items() <= s["metadata"].get("labels", {}).items()]
        ports = {p.get("name") for s in hits for p in s["spec"]["ports"]}
        if not hits:
            errors.append(f"{path}: ServiceMonitor {mon['metadata']['name']} selects no Service of the file")
        for ep in mon["spec"]["endpoints"]:
            if ep.get("port") not in ports:
                errors.append(f"{path}: ServiceMonitor scrapes port {ep.get('port')}, which its Service lacks")
    for d in docs:
        for k in ("apiVersion", "kind"):
            if k not in d:
                errors.append(f"{path}: an object without {k}")
        if not d.get("metadata", {}).get("name"):
            errors.append(f"{path}: a {d.get('kind')} without a name")
        spec = d.get("spec", {}).get("template", {}).get("spec")
        if not spec:
            continue
        for vol in spec.get("volumes", []):
            cm = vol.get("configMap", {}).get("name")
            if cm and cm not in maps:
                errors.append(f"{path}: volume {vol['name']} names ConfigMap {cm}, not in the file")
        for c in spec.get("containers", []):
            ports = {p.get("name") for p in c.get("ports", [])} | {p.get("containerPort") for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                if port is not None and port not in ports:
                    errors.append(f"{path}: {c['name']}'s {probe} uses port {port}, which it does not declare")
    for name, cm in maps.items():
        for key, text in cm.get("data", {}).items():
            if key.endswith(".toml"):
                out = os.path.join(out_dir, f"{path}-{name}-{key}")
                with open(out, "w") as f:
                    f.write(text)
                policies.append(out)

print(json.dumps({"policies": policies, "prometheus": prometheus, "errors": errors}))
