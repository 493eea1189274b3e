"""The official openai SDK, unchanged, runs a tool-calling conversation through warmpath's
Responses API: over one WebSocket (`client.responses.connect()`) and over HTTP with
`previous_response_id`. Prints one JSON line of findings.

Usage: openai_responses.py BASE_URL MODEL
"""
import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="test-key", max_retries=0, timeout=30)
tools = [{
    "type": "function",
    "name": "get_weather",
    "description": "The weather forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}]
question = "What will the weather be in Oslo tomorrow?"
out = {}


def calls_of(response):
    return [i for i in response.output if i.type == "function_call"]


# WebSocket mode: the second turn sends only the tool's output.
with client.responses.connect() as conn:
    conn.response.create(model=model, input=question, tools=tools, instructions="You are a weather agent.")
    kinds, first = [], None
    for event in conn:
        kinds.append(event.type)
        if event.type == "response.completed":
            first = event.response
            break
        if event.type in ("error", "response.failed"):
            raise SystemExit(f"first turn failed: {event}")
    call = calls_of(first)[0]
    out["ws_first_kinds"] = kinds
    out["ws_call"] = {"name": call.name, "arguments": json.loads(call.arguments)}
    conn.response.create(
        model=model, previous_response_id=first.id, tools=tools, instructions="You are a weather agent.",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny in Oslo, 21 C"}])
    text, second = "", None
    for event in conn:
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            second = event.response
            break
        if event.type in ("error", "response.failed"):
            raise SystemExit(f"second turn failed: {event}")
    out["ws_text"] = text
    out["ws_final"] = second.output_text
    out["ws_cached"] = second.usage.input_tokens_details.cached_tokens
    # A reference to nothing: an error event, and the connection goes on.
    conn.response.create(model=model, previous_response_id="resp_nope", input="more")
    for event in conn:
        if event.type == "error":
            out["ws_error_code"] = event.error.code if hasattr(event, "error") and event.error else None
            break

# Two lanes on one connection (`stream_id`), both in flight at once.
with client.responses.connect() as conn:
    conn.response.create(model=model, input="hello", max_output_tokens=3, stream_id="left")
    conn.response.create(model=model, input="hi", max_output_tokens=3, stream_id="right")
    lanes = []
    for event in conn:
        if event.type in ("response.completed", "response.incomplete"):
            lanes.append(event.stream_id)
            if len(lanes) == 2:
                break
        if event.type in ("error", "response.failed"):
            raise SystemExit(f"a lane failed: {event}")
    out["ws_lanes"] = sorted(lanes)

# HTTP: the same conversation chained by previous_response_id.
r1 = client.responses.create(model=model, input=question, tools=tools, instructions="You are a weather agent.")
call = calls_of(r1)[0]
r2 = client.responses.create(
    model=model, previous_response_id=r1.id, tools=tools, instructions="You are a weather agent.",
    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny in Oslo, 21 C"}])
out["http_call"] = call.name
out["http_final"] = r2.output_text
out["http_cached"] = r2.usage.input_tokens_details.cached_tokens
with client.responses.stream(model=model, input="hello", max_output_tokens=200) as stream:
    streamed = stream.get_final_response()
out["http_stream_status"] = streamed.status
try:
    client.responses.create(model=model, previous_response_id="resp_nope", input="x")
    out["http_not_found"] = None
except openai.NotFoundError as e:
    out["http_not_found"] = e.code
print(json.dumps(out))
