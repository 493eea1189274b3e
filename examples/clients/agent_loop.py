"""An agent loop over warmpath's Responses WebSocket mode, with the official `openai` SDK.

The conversation stays on warmpath: after the first turn the client sends only what is new
(the tools' outputs), and warmpath tokenizes only that delta. The model calls tools until it
answers in text; the tools here are local Python functions.

    pip install 'openai>=2.30' 'websockets>=13'
    python examples/clients/agent_loop.py [BASE_URL] [MODEL] [QUESTION]

BASE_URL defaults to the quick start's http://127.0.0.1:8080/v1, MODEL to
smollm2-135m-instruct. With [auth] on, set OPENAI_API_KEY to a key from `warmpath keys add`.
"""
import json
import os
import sys

import openai

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080/v1"
model = sys.argv[2] if len(sys.argv) > 2 else "smollm2-135m-instruct"
question = sys.argv[3] if len(sys.argv) > 3 else "What will the weather be in Oslo tomorrow?"

TOOLS = [{
    "type": "function",
    "name": "get_weather",
    "description": "The weather forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}]


def get_weather(city: str) -> str:
    return f"sunny in {city}, 21 C"


def run_tool(name: str, arguments: str) -> str:
    args = json.loads(arguments or "{}")
    if name == "get_weather":
        return get_weather(args.get("city", "?"))
    return f"unknown tool {name}"


client = openai.OpenAI(base_url=base, api_key=os.environ.get("OPENAI_API_KEY", "none"), timeout=60)
with client.responses.connect() as conn:
    # The first turn carries the instructions, the tools and the question.
    # Temperature 0: a small model sampled at 1 wanders off.
    conn.response.create(model=model, input=question, tools=TOOLS, instructions="You are a weather agent.",
                         max_output_tokens=200, temperature=0)
    for turn in range(1, 9):
        response = None
        for event in conn:
            if event.type == "response.output_text.delta":
                print(event.delta, end="", flush=True)
            elif event.type in ("response.completed", "response.incomplete"):
                # Incomplete: it hit max_output_tokens; what it wrote is the answer.
                response = event.response
                break
            elif event.type in ("error", "response.failed"):
                raise SystemExit(f"turn {turn}: {event}")
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            print()
            print(f"[{turn} turns; last turn: {response.usage.input_tokens} input tokens, "
                  f"{response.usage.input_tokens_details.cached_tokens} from cache]")
            break
        # Only the new items go up: each call's output, chained on the previous response.
        outputs = []
        for call in calls:
            result = run_tool(call.name, call.arguments)
            print(f"[{call.name}({call.arguments}) -> {result}]")
            outputs.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
        conn.response.create(model=model, previous_response_id=response.id, input=outputs, tools=TOOLS,
                             instructions="You are a weather agent.", max_output_tokens=200, temperature=0)
    else:
        raise SystemExit("no answer after 8 turns")
