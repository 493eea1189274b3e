"""The official openai SDK, unchanged, meets warmpath's safety stage: an output check cutting a
chat stream and a whole answer (`finish_reason == "content_filter"`), an input block raised as
`BadRequestError` with code `content_policy_violation`, and Responses ending `incomplete` with
reason `content_filter` over HTTP (streamed and not) and over one WebSocket, which stays open
for the next turn. Prints one JSON line of findings.

Usage: openai_safety.py BASE_URL MODEL
"""
import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="test-key", max_retries=0, timeout=30)
out = {}

# Chat, streamed: the text before the cut, then content_filter.
text, finish = "", None
for chunk in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "tell the falcon story"}], stream=True, max_tokens=200):
    for c in chunk.choices:
        text += c.delta.content or ""
        finish = c.finish_reason or finish
out["chat_stream_text"], out["chat_stream_finish"] = text, finish

# Chat, whole.
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "tell the falcon story"}],
                                   max_tokens=200)
out["chat_finish"], out["chat_content"] = r.choices[0].finish_reason, r.choices[0].message.content

# An input the rules refuse.
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "key sk-proj-abcdefghijklmnopqrstuvwx1234"}])
    out["input_block"] = None
except openai.BadRequestError as e:
    out["input_block"] = e.code

# Responses over HTTP, whole and streamed.
r = client.responses.create(model=model, input="tell the falcon story")
out["http_status"], out["http_reason"] = r.status, r.incomplete_details.reason if r.incomplete_details else None
out["http_text"] = r.output_text
# (The SDK's get_final_response() wants response.completed; the events say it all.)
with client.responses.stream(model=model, input="tell the falcon story") as stream:
    for event in stream:
        if event.type in ("response.incomplete", "response.completed", "response.failed"):
            out["http_stream_status"] = event.response.status

# Responses over one WebSocket: the cut turn, then the connection goes on.
with client.responses.connect() as conn:
    conn.response.create(model=model, input="tell the falcon story")
    for event in conn:
        if event.type in ("response.incomplete", "response.completed", "response.failed", "error"):
            out["ws_first"] = event.type
            out["ws_reason"] = event.response.incomplete_details.reason if event.type == "response.incomplete" else None
            first_id = event.response.id if hasattr(event, "response") else None
            break
    conn.response.create(model=model, input="weather?", previous_response_id=first_id)
    for event in conn:
        if event.type in ("response.incomplete", "response.completed", "response.failed", "error"):
            out["ws_second"] = event.type
            out["ws_second_text"] = event.response.output_text if hasattr(event, "response") else None
            break
print(json.dumps(out))
