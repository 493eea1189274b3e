"""The official openai SDK's calls on stored responses, unchanged, against warmpath:
`responses.retrieve`, `responses.input_items.list` (paged by the SDK's own iterator),
`responses.input_tokens.count`, `responses.delete`, background responses with `responses.cancel`,
a stream resumed with `responses.retrieve(stream=True, starting_after=N)`, `responses.compact`,
and another API key finding none of it.
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

# Background: created queued, cancelled while it runs.
bg = client.responses.create(model=model, input="A long story, please.", background=True, max_output_tokens=400)
out["bg_status"] = bg.status
out["cancelled"] = client.responses.cancel(bg.id).status
out["after_cancel"] = client.responses.retrieve(bg.id).status

# A stored response's events, streamed again after sequence number 2.
resumed = list(client.responses.retrieve(second.id, stream=True, starting_after=2))
out["resumed"] = [resumed[0].sequence_number, resumed[-1].type]

# Compaction, then a turn over the compacted items.
compacted = client.responses.compact(model=model, previous_response_id=second.id, instructions="Be brief.",
                                     extra_body={"max_output_tokens": 16})
out["compacted"] = [i.type for i in compacted.output]
third = client.responses.create(model=model, instructions="Be brief.", max_output_tokens=4,
                                input=[*compacted.output, {"role": "user", "content": "Thanks."}])
out["after_compact"] = third.status

client.responses.delete(first.id)
try:
    client.responses.retrieve(first.id)
    out["after_delete"] = "found"
except openai.NotFoundError:
    out["after_delete"] = "not found"
print(json.dumps(out))
