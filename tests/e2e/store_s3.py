"""Helpers of the object-store tests (test_store_s3*.py): a greedy chat turn, its reply and reuse, a metric,
the objects under a prefix."""

from __future__ import annotations

import re

import requests

FACTS = " ".join(f"Item {i} is stored in box {i * 7 % 31} on shelf {i % 5}." for i in range(30))
REPLY_TOKENS = 12


def chat(server, messages: list[dict]) -> dict:
    response = requests.post(server.url + "/v1/chat/completions", json={
        "model": "smollm2", "messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0}, timeout=300)
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
