"""The official openai SDK against warmpath over TLS: a chat (whole and streamed) over https,
and a Responses WebSocket over wss, trusting only the test CA. Prints one JSON object.

    python openai_tls.py BASE_URL MODEL CA_FILE
"""
import json
import ssl
import sys

import openai

base, model, ca = sys.argv[1:4]
ctx = ssl.create_default_context(cafile=ca)
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, http_client=openai.DefaultHttpxClient(verify=ctx))

out = {}
chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
out["chat_tokens"] = chat.usage.completion_tokens
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
)
out["stream_chunks"] = sum(1 for _ in stream)

with client.responses.connect(websocket_connection_options={"ssl": ctx}) as conn:
    conn.response.create(model=model, input="hello", max_output_tokens=4)
    kinds = []
    for event in conn:
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            break
    out["wss_last"] = kinds[-1]
    out["wss_deltas"] = kinds.count("response.output_text.delta")

# A client that trusts only the system's roots refuses warmpath's test certificate.
try:
    openai.OpenAI(base_url=base, api_key="unused", max_retries=0).models.list()
    out["untrusted"] = "accepted"
except openai.APIConnectionError:
    out["untrusted"] = "APIConnectionError"
print(json.dumps(out))
