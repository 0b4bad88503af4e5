"""The kept-conversations API (`/conversations`) over the object store and under a session key, with real
servers (SmolLM2) and a real SeaweedFS:

* A server on the object store alone (no --cache-disk) lists a conversation another server uploaded and it never
  fetched (title, turns, tokens, bytes from the object's header; `where: object store`; on the chat page in
  Chromium too, a screenshot under tests/e2e/screenshots/conversations-store/), shows its messages,
  downloads it (the object's bytes), renames it (the object written again, its MAC and hashes covering the
  title), deletes it (the object goes), refuses a bad upload (nothing put) and takes a good one (the object put
  under its key), renames it, then continues it with its history restored from that object (the longer
  object inherits the title).
* A server with a folder and the same bucket lists the objects it never fetched beside its own files, and
  downloads one from the bucket (nothing fetched into its folder).
* Under --session-key-file a llama.cpp slot file uploaded is converted and written with the server's MAC, kept
  and continued; a format v1 file without a MAC or with another key's is refused, nothing stored.
"""

from __future__ import annotations

import time

import pytest
import requests
import strata_sessionfile as sf
from strata_server.transcript import read_notes
from strata_sessionfile import llamacpp
from strata_sessionfile.format import Flags
from strata_sessionfile.objstore import S3Source

from .browser import Browser, missing_browser
from .servers import start_server
from .store_s3 import FACTS, cached_tokens, chat, objects, reply_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SYSTEM = {"role": "system", "content": "You are a careful assistant. Facts: " + FACTS}
OTHER_SYSTEM = {  # shares no block with SYSTEM: a chat under it replaces a slot's whole conversation
    "role": "system",
    "content": "You are a terse clerk. Records: "
    + " ".join(f"Crate {i} holds {i * 3 % 17} apples." for i in range(40)),
}
OCTETS = {"Content-Type": "application/octet-stream"}
LISTED_WITHIN_S = 60.0


def api(server, method: str, path: str, **kw) -> requests.Response:
    return requests.request(method, server.url + path, timeout=120, **kw)


def listed(server, **params) -> dict:
    answer = api(server, "GET", "/conversations", params={"limit": 200, **params})
    assert answer.status_code == 200, answer.text
    return answer.json()


def await_listed(server, n: int) -> list[dict]:
    deadline = time.monotonic() + LISTED_WITHIN_S
    while (found := listed(server))["total"] < n and time.monotonic() < deadline:
        time.sleep(0.2)
    assert found["total"] == n, found
    return found["conversations"]


def object_bytes(s3_store, key: str) -> bytes:
    return s3_store.client().get_object(Bucket=s3_store.bucket, Key=key)["Body"].read()


def page_shows_the_object(server, tmp, conversation_id: str, messages: list[dict]) -> None:
    """The chat page (Chromium) lists the object with its turns and place, and opens it with its messages."""
    why = missing_browser()
    if why is not None:
        pytest.fail(why)
    page = Browser(tmp / "chromium-profile", "conversations-store")
    try:
        page.driver.get(server.url + "/")
        item = page.until(
            lambda: [
                li for li in page.css("#conversations li") if li.get_attribute("data-id") == conversation_id
            ],
            "the object in the list",
        )[0]
        meta = item.find_element("css selector", ".muted").text
        assert "3 messages" in meta and meta.endswith("object store"), meta
        item.find_element("css selector", ".title").click()
        page.until(lambda: len(page.css("#messages li")) >= 3, "the object's messages")
        shown = [li.text for li in page.css("#messages li.user")]
        assert any(messages[1]["content"] in text for text in shown), shown
        page.shot("object-store-listed-and-opened")
    finally:
        page.quit()


def test_the_fleets_conversations_on_the_object_store_alone_and_beside_a_folder(module_tmp, s3_store):
    flags = (
        "--cache-store",
        f"s3://{s3_store.bucket}/pages",
        "--cache-store-endpoint",
        s3_store.endpoint_url,
    )
    disk_a = module_tmp / "disk-a"
    messages = [SYSTEM, {"role": "user", "content": "Where is item 12?"}]
    a = start_server(module_tmp, "--cache-disk", str(disk_a), *flags, name="pages-a", env=s3_store.env())
    try:
        first = chat(a, messages)
    finally:
        assert a.stop() == 0  # the shutdown save, uploaded before the server exits
    (key,) = objects(s3_store, "pages/")
    body = object_bytes(s3_store, key)
    client = s3_store.client()
    with S3Source(client, s3_store.bucket, key) as source:
        n_tokens = sf.inspect(source, verify=False).metadata.state.n_tokens
    conversation_id = key.rpartition("/")[2].removesuffix(".ssf")
    kept_messages = [*messages, {"role": "assistant", "content": reply_of(first)}]

    b = start_server(module_tmp, *flags, name="pages-b", env=s3_store.env())  # the object store alone
    try:
        (entry,) = await_listed(b, 1)  # never fetched by B: listed from the bucket
        assert entry["id"] == conversation_id and entry["title"] == "Where is item 12?"
        assert (entry["n_messages"], entry["n_tokens"], entry["n_bytes"]) == (3, n_tokens, len(body))
        assert entry["where"] == ["object store"] and entry["text_from"] == "notes" and entry["used_at"] > 0
        one = api(b, "GET", f"/conversations/{conversation_id}").json()
        assert one["messages"] == kept_messages
        assert listed(b, q="ITEM 12")["total"] == 1 and listed(b, q="item 13")["total"] == 0

        page_shows_the_object(b, module_tmp, conversation_id, kept_messages)

        download = api(b, "GET", f"/conversations/{conversation_id}/file")
        assert download.status_code == 200 and download.content == body
        assert download.headers["Content-Type"] == "application/octet-stream"

        etag = client.head_object(Bucket=s3_store.bucket, Key=key)["ETag"]
        renamed = api(b, "PATCH", f"/conversations/{conversation_id}", json={"title": "Boxes  and shelves"})
        assert renamed.status_code == 200, renamed.text
        assert renamed.json()["title"] == "Boxes and shelves" and renamed.json()["id"] == conversation_id
        assert client.head_object(Bucket=s3_store.bucket, Key=key)["ETag"] != etag  # the object written again
        with S3Source(client, s3_store.bucket, key) as source:
            inspection = sf.inspect(source, verify=True)  # its hashes cover the new notes
        notes = read_notes(inspection.metadata.state.engine_fields)
        assert notes.title == "Boxes and shelves" and list(notes.messages) == kept_messages
        assert api(b, "GET", f"/conversations/{conversation_id}").json()["title"] == "Boxes and shelves"

        gone = api(b, "DELETE", f"/conversations/{conversation_id}")
        assert gone.status_code == 200 and gone.json() == {"id": conversation_id, "deleted": True}
        assert objects(s3_store, "pages/") == [] and listed(b)["total"] == 0
        missing = api(b, "GET", f"/conversations/{conversation_id}/file")
        assert missing.status_code == 404 and missing.json()["error"]["reason"] == "not_found"

        for bad in (body[:-100], b"not a session file" * 50):
            refused = api(b, "POST", "/conversations", data=bad, headers=OCTETS)
            assert refused.status_code == 400 and refused.json()["error"]["reason"], refused.text
        assert objects(s3_store, "pages/") == []  # nothing put

        uploaded = api(b, "POST", "/conversations", data=body, headers=OCTETS)  # A's file, as it was
        assert uploaded.status_code == 201, uploaded.text
        kept = uploaded.json()
        assert kept["created"] and kept["id"] == conversation_id and kept["n_messages"] == 3
        assert kept["where"] == ["object store"] and kept["title"] == "Where is item 12?"
        assert objects(s3_store, "pages/") == [key] and object_bytes(s3_store, key) == body
        twice = api(b, "POST", "/conversations", data=body, headers=OCTETS)
        assert twice.status_code == 200 and not twice.json()["created"]

        titled = api(b, "PATCH", f"/conversations/{conversation_id}", json={"title": "Crates"})
        assert titled.status_code == 200 and titled.json()["where"] == ["object store"], titled.text
        following = [*kept_messages, {"role": "user", "content": "And item 7?"}]
        assert cached_tokens(chat(b, following)) >= n_tokens - 2  # restored from the uploaded object
    finally:
        assert b.stop() == 0
    (longer_key,) = objects(s3_store, "pages/")  # B's turn replaced the object it extends
    longer_id = longer_key.rpartition("/")[2].removesuffix(".ssf")
    assert longer_id != conversation_id

    a = start_server(module_tmp, "--cache-disk", str(disk_a), *flags, name="pages-a2", env=s3_store.env())
    try:
        files = sorted(disk_a.glob("*.ssf"))
        by_id = {c["id"]: c for c in await_listed(a, 2)}
        assert by_id[conversation_id]["where"] == ["disk"]  # A's own file (its object was deleted)
        assert by_id[longer_id]["where"] == ["object store"] and by_id[longer_id]["n_messages"] == 5
        assert by_id[longer_id]["title"] == "Crates"  # B's next turn inherited the object's title
        download = api(a, "GET", f"/conversations/{longer_id}/file")
        assert download.status_code == 200 and download.content == object_bytes(s3_store, longer_key)
        assert sorted(disk_a.glob("*.ssf")) == files  # listed and downloaded, never fetched into the folder
    finally:
        assert a.stop() == 0


def test_a_slot_file_uploaded_under_a_session_key_is_written_with_the_servers_mac(module_tmp, smollm2_path):
    folder, slots, key_path = module_tmp / "disk-keyed", module_tmp / "slots-keyed", module_tmp / "keyed.key"
    slots.mkdir()
    key_path.write_bytes(bytes(range(7, 39)))
    key = sf.SessionKey.from_file(key_path)
    flags = ("--cache-disk", str(folder), "--cache-idle-seconds", "0.5", "--slot-save-path", str(slots))
    server = start_server(module_tmp, *flags, "--session-key-file", str(key_path), name="keyed")
    try:
        messages = [SYSTEM, {"role": "user", "content": "Where is item 12?"}]
        first = chat(server, messages)
        (one,) = await_listed(server, 1)  # saved when the slot idled
        saved = api(
            server, "POST", "/slots/0?action=save", json={"filename": "chat.bin", "format": "llama.cpp"}
        )
        assert saved.status_code == 200, saved.text
        chat(server, [OTHER_SYSTEM, {"role": "user", "content": "What does crate 3 hold?"}])
        assert {c["title"] for c in await_listed(server, 2)} == {one["title"], "What does crate 3 hold?"}
        assert api(server, "DELETE", f"/conversations/{one['id']}").status_code == 200
        files = sorted(folder.glob("*.ssf"))
        slot_file = slots / "chat.bin"

        # A format v1 file of the same conversation without a MAC, or with another key's: refused.
        config = llamacpp.config_of(files[0])
        for other, reason in ((None, "mac_missing"), (sf.SessionKey(bytes(range(32))), "mac_wrong_key")):
            converted = module_tmp / "converted.ssf"
            llamacpp.slot_to_session(slot_file, smollm2_path, converted, config=config, key=other)
            refused = api(server, "POST", "/conversations", data=converted.read_bytes(), headers=OCTETS)
            assert refused.status_code == 400 and refused.json()["error"]["reason"] == reason, refused.text
        assert sorted(folder.glob("*.ssf")) == files

        uploaded = api(server, "POST", "/conversations", data=slot_file.read_bytes(), headers=OCTETS)
        assert uploaded.status_code == 201, uploaded.text
        kept = uploaded.json()
        assert kept["n_tokens"] == saved.json()["n_saved"] and kept["text_from"] == "tokens"
        stored = folder / f"{kept['id']}.ssf"
        assert sf.inspect(stored, verify=True, key=key).header.flags & Flags.AUTHENTICATED

        following = [
            *messages,
            {"role": "assistant", "content": reply_of(first)},
            {"role": "user", "content": "Bye."},
        ]
        assert cached_tokens(chat(server, following)) >= first["usage"]["prompt_tokens"]  # restored from it
    finally:
        assert server.stop() == 0
