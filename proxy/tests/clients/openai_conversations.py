"""The official openai SDK's conversations calls, unchanged, against warmpath:
`conversations.create/retrieve/update/delete`, `conversations.items.create/list/retrieve/delete`,
and `responses.create(conversation=...)` continuing by conversation instead of by
`previous_response_id`. Prints one JSON line of findings.

Usage: openai_conversations.py BASE_URL MODEL
"""
import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="key-a", max_retries=0, timeout=30)
other = openai.OpenAI(base_url=base, api_key="key-b", max_retries=0, timeout=30)
out = {}

conv = client.conversations.create(metadata={"topic": "demo"},
                                   items=[{"type": "message", "role": "user", "content": "My name is Ada."}])
out["created"] = [conv.object, conv.metadata]
r1 = client.responses.create(model=model, conversation=conv.id, input="Hello!", max_output_tokens=8)
r2 = client.responses.create(model=model, conversation=conv.id, input="What is my name?", max_output_tokens=8)
out["response_conversation"] = r2.conversation.id == conv.id
out["history_grew"] = r2.usage.input_tokens > r1.usage.input_tokens

added = client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "Bye."}])
out["added"] = [i.content[0].text for i in added.data]
# Auto-paged one at a time, oldest first.
items = list(client.conversations.items.list(conv.id, limit=1, order="asc"))
out["items"] = [(i.type, i.role) for i in items]
first = client.conversations.items.retrieve(items[0].id, conversation_id=conv.id)
out["first_text"] = first.content[0].text
client.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
out["after_item_delete"] = len(list(client.conversations.items.list(conv.id, limit=100)))

updated = client.conversations.update(conv.id, metadata={"topic": "names"})
out["updated"] = client.conversations.retrieve(conv.id).metadata == updated.metadata == {"topic": "names"}
try:
    other.conversations.retrieve(conv.id)
    out["other_key"] = "found"
except openai.NotFoundError:
    out["other_key"] = "not found"
deleted = client.conversations.delete(conv.id)
out["deleted"] = [deleted.object, deleted.deleted]
try:
    client.conversations.retrieve(conv.id)
    out["after_delete"] = "found"
except openai.NotFoundError:
    out["after_delete"] = "not found"
print(json.dumps(out))
