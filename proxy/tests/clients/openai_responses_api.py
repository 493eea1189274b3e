"""The official openai SDK's calls on stored responses, unchanged, against warmpath:
`responses.retrieve`, `responses.input_items.list` (paged by the SDK's own iterator),
`responses.input_tokens.count`, `responses.delete`, and another API key finding none of it.
Prints one JSON line of findings.

Usage: openai_responses_api.py BASE_URL MODEL
"""
import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="key-a", max_retries=0, timeout=30)
other = openai.OpenAI(base_url=base, api_key="key-b", max_retries=0, timeout=30)
out = {}

first = client.responses.create(model=model, input="Say hello.", instructions="Be brief.", max_output_tokens=8)
ask = dict(model=model, previous_response_id=first.id, instructions="Be brief.", input="And goodbye?")
counted = client.responses.input_tokens.count(**ask)
second = client.responses.create(max_output_tokens=8, **ask)
out["counted"] = counted.input_tokens
out["reported"] = second.usage.input_tokens

got = client.responses.retrieve(second.id)
out["retrieved_same"] = got.model_dump() == second.model_dump()
out["retrieved_text"] = got.output_text == second.output_text

# Paged two at a time by the SDK's auto-pagination (it follows `after` = last_id).
items = list(client.responses.input_items.list(second.id, limit=2))
out["items"] = [(i.type, getattr(i, "role", None)) for i in items]
out["items_asc_first"] = client.responses.input_items.list(second.id, order="asc").data[0].content[0].text

try:
    other.responses.retrieve(second.id)
    out["other_key"] = "found"
except openai.NotFoundError:
    out["other_key"] = "not found"

client.responses.delete(first.id)
try:
    client.responses.retrieve(first.id)
    out["after_delete"] = "found"
except openai.NotFoundError:
    out["after_delete"] = "not found"
print(json.dumps(out))
