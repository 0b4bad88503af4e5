"""The catalog's bounds (store/catalog.py), without a store: a search reads every conversation this server's
index holds and only the newest MAX_SEARCHED_OBJECTS objects of the bucket, and says when it left some out."""

from __future__ import annotations

import numpy as np
from strata_server.store import catalog
from strata_server.store.catalog import Catalog, Row
from strata_server.store.index import StoredConversation
from strata_server.store.remote import Listed


def object_row(i: int, used_at: float) -> Row:
    name = f"{i:032x}.ssf"
    return Row(name[:32], used_at, None, Listed(f"m/c/b/{name}", name, 1000, used_at, f'"{i}"'))


def test_a_search_reads_the_local_conversations_and_the_newest_objects_only(monkeypatch):
    monkeypatch.setattr(catalog, "MAX_SEARCHED_OBJECTS", 2)
    local = Row("f" * 32, 50.0, StoredConversation("f" * 32 + ".ssf", 1000, np.arange(300)), None)
    rows = [object_row(1, 90.0), object_row(2, 80.0), object_row(3, 70.0), local, object_row(4, 40.0)]
    searched = Catalog(store=None)  # the bound needs no store
    kept, partial = searched.searchable(rows)
    assert [r.id for r in kept] == [rows[0].id, rows[1].id, local.id] and partial
    kept, partial = searched.searchable([rows[0], local, rows[1]])
    assert [r.id for r in kept] == [rows[0].id, local.id, rows[1].id] and not partial
