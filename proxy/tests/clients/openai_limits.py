"""The official openai SDK against warmpath's API keys and limits, unchanged: a second call
while the key's one concurrent slot is held gets 429 with retry-after, and the SDK's own retry
waits and gets through; a wrong key raises AuthenticationError, a model the key may not use
PermissionDeniedError. Prints one JSON object.

    python openai_limits.py BASE_URL MODEL KEY LIMITED_KEY
"""
import json
import sys
import threading
import time

import openai

base, model, key, limited = sys.argv[1:5]
statuses = []


def log(response):
    statuses.append(response.status_code)


client = openai.OpenAI(
    base_url=base,
    api_key=key,
    max_retries=5,
    # The SDK's own HTTP client, with a hook that sees every try.
    http_client=openai.DefaultHttpxClient(event_hooks={"response": [log]}),
)
holder = openai.OpenAI(base_url=base, api_key=key, max_retries=0)

started = threading.Event()


def hold():
    stream = holder.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=100, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 0:
            started.set()


t = threading.Thread(target=hold)
t.start()
started.wait(10)
t0 = time.monotonic()
raw = client.chat.completions.with_raw_response.create(
    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
)
waited = time.monotonic() - t0
answer = raw.parse()
t.join()

out = {
    "statuses": statuses,
    "waited_s": waited,
    "text": answer.choices[0].message.content,
    "remaining_requests_header": raw.headers.get("x-ratelimit-remaining-requests"),
}
try:
    openai.OpenAI(base_url=base, api_key="wp-wrong", max_retries=0).models.list()
except openai.AuthenticationError:
    out["wrong_key"] = "AuthenticationError"
try:
    openai.OpenAI(base_url=base, api_key=limited, max_retries=0).chat.completions.create(
        model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
except openai.PermissionDeniedError:
    out["forbidden"] = "PermissionDeniedError"
print(json.dumps(out))
