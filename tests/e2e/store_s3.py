"""Helpers of the object-store tests (test_store_s3*.py): a greedy chat turn, its reply and reuse, a metric,
the objects under a prefix, a chat's two turns on a server that never stops."""

from __future__ import annotations

import re

import attrs
import requests

from .servers import start_server

FACTS = " ".join(f"Item {i} is stored in box {i * 7 % 31} on shelf {i % 5}." for i in range(30))
REPLY_TOKENS = 12


def chat(server, messages: list[dict]) -> dict:
    response = requests.post(
        server.url + "/v1/chat/completions",
        json={"model": "smollm2", "messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0},
        timeout=300,
    )
    response.raise_for_status()
    return response.json()


def reply_of(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(server, name: str) -> float:
    text = requests.get(server.url + "/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def objects(s3_store, prefix: str) -> list[str]:
    listing = s3_store.client().list_objects_v2(Bucket=s3_store.bucket, Prefix=prefix)
    return [o["Key"] for o in listing.get("Contents", [])]


@attrs.frozen
class ReferenceChat:
    messages: list  # the first turn's messages
    first: dict  # the first turn's reply
    following: list  # the next turn's messages
    reference: dict  # the next turn's reply from the server that held the chat between the turns


def reference_chat(module_tmp, item: int, next_item: int, name: str) -> ReferenceChat:
    """A chat about `item`, then `next_item`, on a server without a store that never stops (it holds the chat
    between turns): the replies a restored conversation must reproduce."""
    messages = [
        {"role": "system", "content": "You are a careful assistant. Facts: " + FACTS},
        {"role": "user", "content": f"Where is item {item}?"},
    ]
    never_stopped = start_server(module_tmp, name=name)
    try:
        first = chat(never_stopped, messages)
        following = [
            *messages,
            {"role": "assistant", "content": reply_of(first)},
            {"role": "user", "content": f"And item {next_item}?"},
        ]
        reference = chat(never_stopped, following)
        assert cached_tokens(reference) >= first["usage"]["prompt_tokens"]
    finally:
        assert never_stopped.stop() == 0
    return ReferenceChat(messages, first, following, reference)
