"""The session store with --session-key-file (real servers, SmolLM2): a file written without a MAC is moved
aside at the scan and the prompt is answered cold, right; the files the keyed server writes carry its MAC and
a keyed server restores them; --session-key-optional takes unauthenticated files."""

from __future__ import annotations

import re
import secrets
from pathlib import Path

import pytest
import requests
import strata_sessionfile as sf
from strata_sessionfile.format import Flags

from .servers import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FACTS = " ".join(f"Item {i} is stored in box {i * 7 % 31} on shelf {i % 5}." for i in range(30))
PROMPT = "Inventory notes, read carefully. " + FACTS


def complete(server, prompt: str, **fields) -> dict:
    response = requests.post(
        server.url + "/completion",
        json={"prompt": prompt, "n_predict": 8, "temperature": 0, **fields},
        timeout=300,
    )
    response.raise_for_status()
    return response.json()


def metric(server, name: str) -> float:
    text = requests.get(server.url + "/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def stored(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.ssf"))


def test_a_keyed_store_moves_unauthenticated_files_aside_and_restores_its_own(module_tmp):
    folder, key_path = module_tmp / "store-key", module_tmp / "store.key"
    key_path.write_bytes(secrets.token_bytes(32))
    keyed = ("--cache-disk", str(folder), "--metrics", "--session-key-file", str(key_path))
    longer = PROMPT + " Where is item 12?"

    plain = start_server(module_tmp, "--cache-disk", str(folder), name="key-plain")
    try:
        cold = complete(plain, longer)  # a new server: evaluated cold
    finally:
        assert plain.stop() == 0  # saved at shutdown, without a MAC
    (unauthenticated,) = stored(folder)
    assert not sf.inspect(unauthenticated, verify=False).header.flags & Flags.AUTHENTICATED

    other_folder = module_tmp / "store-key-optional"
    other_folder.mkdir()
    (other_folder / unauthenticated.name).write_bytes(unauthenticated.read_bytes())

    server = start_server(module_tmp, *keyed, name="key-1")
    try:
        body = complete(server, longer)
        assert body["timings"]["cache_n"] == 0 and body["content"] == cold["content"]
        assert metric(server, 'strata:store_bad_files_total{reason="mac_missing"}') >= 1
        assert metric(server, 'strata:store_lookups_total{result="hit"}') == 0
    finally:
        assert server.stop() == 0  # saves the conversation, now with the key's MAC
    assert any(p.name.startswith(unauthenticated.name) for p in (folder / ".bad").iterdir())
    key = sf.SessionKey.from_file(key_path)
    files = stored(folder)  # the same conversation under the same name, now authenticated
    assert files and all(
        sf.inspect(p, verify=False, key=key).header.flags & Flags.AUTHENTICATED for p in files
    )

    server = start_server(module_tmp, *keyed, name="key-2")
    try:
        again = complete(server, longer + " And item 7?")
        assert again["timings"]["cache_n"] > 400
        assert metric(server, 'strata:store_lookups_total{result="hit"}') == 1
    finally:
        assert server.stop() == 0

    optional = start_server(
        module_tmp,
        "--cache-disk",
        str(other_folder),
        "--session-key-file",
        str(key_path),
        "--session-key-optional",
        name="key-optional",
    )
    try:
        body = complete(optional, longer)
        assert body["timings"]["cache_n"] > 400 and body["content"] == cold["content"]  # taken without a MAC
    finally:
        assert optional.stop() == 0
