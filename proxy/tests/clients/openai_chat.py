"""The official openai SDK, unchanged, against warmpath: prints one JSON line of findings.

Usage: openai_chat.py BASE_URL MODEL [expect-stream-error]
"""
import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
expect_error = len(sys.argv) > 3
client = openai.OpenAI(base_url=base, api_key="test-key", max_retries=0, timeout=30)
out = {}

if expect_error:
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=50, stream=True)
        out["chunks"] = sum(1 for _ in stream)
        out["raised"] = None
    except openai.APIError as e:
        out["raised"] = type(e).__name__
        out["message"] = str(e)
    print(json.dumps(out))
    sys.exit(0)

out["models"] = [m.id for m in client.models.list()]
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
    max_tokens=8,
    stream=True,
    stream_options={"include_usage": True},
)
text, chunks, usage = "", 0, None
for chunk in stream:
    chunks += 1
    if chunk.choices and chunk.choices[0].delta.content:
        text += chunk.choices[0].delta.content
    if chunk.usage is not None:
        usage = chunk.usage.model_dump()
out.update(stream_chunks=chunks, stream_text=text, stream_usage=usage)

raw = client.chat.completions.with_raw_response.create(
    model=model, messages=[{"role": "user", "content": "again"}], max_tokens=4)
resp = raw.parse()
out.update(backend=raw.headers.get("x-warmpath-backend"), finish=resp.choices[0].finish_reason,
           completion_tokens=resp.usage.completion_tokens)
try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
except openai.NotFoundError as e:
    out["not_found"] = e.body.get("code") if isinstance(e.body, dict) else str(e.body)
print(json.dumps(out))
