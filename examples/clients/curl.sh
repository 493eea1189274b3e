#!/usr/bin/env bash
# curl recipes for warmpath: each call as a client makes it. Run them all against the quick
# start (scripts/run), or any warmpath:
#
#   examples/clients/curl.sh [BASE] [ADMIN] [MODEL]
#
# BASE defaults to http://127.0.0.1:8080, ADMIN to http://127.0.0.1:8081, MODEL to
# smollm2-135m-instruct. With [auth] on, export WARMPATH_KEY (a key from `warmpath keys add`).
set -euo pipefail
BASE=${1:-http://127.0.0.1:8080}
ADMIN=${2:-http://127.0.0.1:8081}
MODEL=${3:-smollm2-135m-instruct}
AUTH=(-H "authorization: Bearer ${WARMPATH_KEY:-none}")
JSON=(-H 'content-type: application/json')

echo '# the models the pools serve'
curl -sSf "${AUTH[@]}" "$BASE/v1/models"
echo

echo '# a chat completion; -i shows how warmpath routed it (x-warmpath-route, x-warmpath-backend)'
curl -sSf -i "${AUTH[@]}" "${JSON[@]}" "$BASE/v1/chat/completions" -d '{
  "model": "'"$MODEL"'", "max_tokens": 32, "temperature": 0,
  "messages": [{"role": "system", "content": "You are a helpful assistant."},
               {"role": "user", "content": "What is the capital of France?"}]}'
echo

echo '# the same, streamed (server-sent events), with usage at the end'
curl -sSfN "${AUTH[@]}" "${JSON[@]}" "$BASE/v1/chat/completions" -d '{
  "model": "'"$MODEL"'", "max_tokens": 16, "stream": true, "stream_options": {"include_usage": true},
  "messages": [{"role": "user", "content": "Count to five."}]}'

echo '# a Responses turn, then one continuing it by id (warmpath keeps the conversation)'
first=$(curl -sSf "${AUTH[@]}" "${JSON[@]}" "$BASE/v1/responses" -d '{
  "model": "'"$MODEL"'", "input": "My name is Ada.", "max_output_tokens": 32}')
echo "$first"
id=$(printf '%s' "$first" | python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])')
curl -sSf "${AUTH[@]}" "${JSON[@]}" "$BASE/v1/responses" -d '{
  "model": "'"$MODEL"'", "previous_response_id": "'"$id"'", "input": "What is my name?", "max_output_tokens": 32}'
echo

echo '# your own request id, returned and logged'
curl -sSf -o /dev/null -D - "${AUTH[@]}" -H 'x-request-id: my-trace-123' "$BASE/health" | grep -i '^x-request-id'

echo '# the load balancer probe on the API port, and readiness on the admin port'
curl -sSf -o /dev/null -w '%{http_code}\n' "$BASE/health"
curl -sSf "$ADMIN/readyz"

echo '# what warmpath is doing: the status page JSON, and a few metrics'
curl -sSf "$ADMIN/status.json" | python3 -c 'import json, sys; s = json.load(sys.stdin); print([(p["name"], [(b["name"], b["state"]) for b in p["backends"]]) for p in s["pools"]])'
curl -sSf "$ADMIN/metrics" | grep -E '^warmpath_(requests_total|routing_decisions_total)' | head -5

echo '# reload the policy file (it is checked first; a bad one is refused and the old one serves)'
curl -sSf -X POST "$ADMIN/reload"
