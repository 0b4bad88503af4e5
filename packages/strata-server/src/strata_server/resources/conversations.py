"""``/conversations``: the conversations the session store keeps (spec/http-api.md, "Kept conversations").

``GET /conversations?offset&limit&q`` lists them (most recently used first), ``GET /conversations/{id}``
gives one with its text, ``DELETE`` removes its file, ``GET /conversations/{id}/file`` downloads the session
file, ``POST /conversations`` (a session file as the body) uploads one. Every request passes the slot
actions' Origin rule (the API key and Host checks are the middleware's); an upload needs
``Content-Type: application/octet-stream`` (a browser cannot send it cross-site without a preflight).
"""

from __future__ import annotations

import threading
from typing import Any

import falcon

from ..context import ServerContext
from ..errors import ApiError, ErrorType, invalid_request
from ..params import read_json
from ..security import check_json_body, check_origin
from ..store.catalog import (
    Catalog,
    CatalogError,
    Entry,
    NotSupported,
    StoreUnreachable,
    UnknownConversation,
    UploadRefused,
)
from ..transcript import MAX_TITLE_CHARS, Transcript, read_transcript

DEFAULT_LIMIT = 20
MAX_LIMIT = 200
UPLOAD_MEDIA = "application/octet-stream"
MAX_UPLOAD_BYTES = 1 << 30  # an upload is also bounded by the store's byte limit
TITLE_CACHE_SIZE = 4096
NO_STORE = (
    "This server keeps no conversations. Start it with `--cache-disk DIR` (or --cache-ram, --cache-store)"
)

# CatalogError -> how it is answered.
ERRORS: dict[type[CatalogError], ErrorType] = {
    UnknownConversation: ErrorType.NOT_FOUND,
    UploadRefused: ErrorType.INVALID_REQUEST,
    NotSupported: ErrorType.NOT_SUPPORTED,
    StoreUnreachable: ErrorType.UNAVAILABLE,
}


# reasons answered otherwise than their class
REASONS: dict[str, ErrorType] = {"invalid_id": ErrorType.INVALID_REQUEST, "loading": ErrorType.UNAVAILABLE}


def api_error(exc: CatalogError) -> ApiError:
    return ApiError(REASONS.get(exc.reason, ERRORS[type(exc)]), str(exc), reason=exc.reason)


def query_int(req: falcon.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = req.get_param(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise invalid_request(f"'{name}' must be an integer, got {raw[:32]!r}") from None
    if not lo <= value <= hi:
        raise invalid_request(f"'{name}' must be in [{lo}, {hi}], got {value}")
    return value


class Transcripts:
    """Each conversation's text, read once per version (an id names immutable tokens; its notes change with a
    rename: this server's forgets it, another server's gives its object a new ETag)."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str], Transcript] = {}

    def forget(self, conversation_id: str) -> None:
        """Its file was written again or removed (a rename, a delete): read it again next time."""
        with self._lock:
            for version in [v for v in self._cache if v[0] == conversation_id]:
                del self._cache[version]

    def of(self, catalog: Catalog, entries: list[Entry]) -> dict[str, Transcript]:
        with self._lock:
            found = {
                e.id: self._cache[(e.id, e.version)] for e in entries if (e.id, e.version) in self._cache
            }
        missing = [e for e in entries if e.id not in found]
        if missing:
            with self.ctx.engine.command() as lease:
                for e in missing:
                    text = str(
                        lease.call("DETOKENIZE", {"tokens": e.conversation.tokens.tolist()})["content"]
                    )
                    found[e.id] = read_transcript(text, catalog.notes(e))
            with self._lock:
                if len(self._cache) > TITLE_CACHE_SIZE:
                    self._cache.clear()
                self._cache.update({(e.id, e.version): found[e.id] for e in missing})
        return found


def entry_fields(entry: Entry, transcript: Transcript) -> dict[str, Any]:
    return {
        "id": entry.id,
        "title": transcript.title,
        "n_messages": len(transcript.messages) if transcript.messages is not None else None,
        "n_tokens": entry.conversation.n_tokens,
        "n_bytes": entry.conversation.nbytes,
        "used_at": entry.used_at,
        "where": list(entry.where),
        "text_from": "notes" if transcript.from_notes else "tokens",
    }


class ConversationsResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.transcripts = Transcripts(ctx)

    def _catalog(self, req: falcon.Request) -> Catalog:
        check_origin(req, self.ctx.policy, "the conversations API")
        if self.ctx.store is None:
            raise ApiError(ErrorType.NOT_SUPPORTED, NO_STORE)
        return Catalog(self.ctx.store)

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        catalog = self._catalog(req)
        offset = query_int(req, "offset", 0, 0, 1 << 31)
        limit = query_int(req, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        query = (req.get_param("q") or "").strip().lower()
        partial = False
        try:
            rows = catalog.rows()
            if query:  # every title searched is read (objects' headers once, kept)
                rows, partial = catalog.searchable(rows)
                entries = catalog.entries(rows)
                texts = self.transcripts.of(catalog, entries)
                entries = [e for e in entries if query in texts[e.id].title.lower()]
                total, page = len(entries), entries[offset : offset + limit]
            else:  # only the page's objects are read
                total, page = len(rows), catalog.entries(rows[offset : offset + limit])
        except CatalogError as exc:
            raise api_error(exc) from None
        texts = self.transcripts.of(catalog, page)
        resp.media = {
            "conversations": [entry_fields(e, texts[e.id]) for e in page],
            "total": total,
            "offset": offset,
            "limit": limit,
            "partial": partial,
        }

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        catalog = self._catalog(req)
        media = (req.content_type or "").split(";", 1)[0].strip().lower()
        if media != UPLOAD_MEDIA:
            raise ApiError(
                ErrorType.INVALID_REQUEST,
                f"an upload needs Content-Type: {UPLOAD_MEDIA} (got {req.content_type or 'none'})",
                status=415,
            )
        limit = min(MAX_UPLOAD_BYTES, self.ctx.store.settings.max_bytes if self.ctx.store else 0)
        if req.content_length is not None and req.content_length > limit:
            raise ApiError(
                ErrorType.INVALID_REQUEST,
                f"the upload is {req.content_length} bytes; the limit is {limit}",
                status=413,
                reason="too_large",
            )
        stream = req.bounded_stream
        try:
            entry, created = catalog.upload(iter(lambda: stream.read(1 << 20), b""), limit)
        except CatalogError as exc:
            raise api_error(exc) from None
        if created:  # the same id may have named a file with other notes before (deleted since)
            self.transcripts.forget(entry.id)
        resp.status = falcon.HTTP_201 if created else falcon.HTTP_200
        resp.media = {
            **entry_fields(entry, self.transcripts.of(catalog, [entry])[entry.id]),
            "created": created,
        }

    def on_get_one(self, req: falcon.Request, resp: falcon.Response, conversation_id: str) -> None:
        catalog = self._catalog(req)
        try:
            entry = catalog.get(conversation_id)
        except CatalogError as exc:
            raise api_error(exc) from None
        transcript = self.transcripts.of(catalog, [entry])[entry.id]
        messages = list(transcript.messages) if transcript.messages is not None else None
        resp.media = {**entry_fields(entry, transcript), "text": transcript.text, "messages": messages}

    def on_patch_one(self, req: falcon.Request, resp: falcon.Response, conversation_id: str) -> None:
        catalog = self._catalog(req)
        check_json_body(req, "renames")
        title = read_json(req, self.ctx.config.max_body_bytes).get("title")
        if not isinstance(title, str) or not title.strip():
            raise invalid_request("'title' must be a non-empty string")
        title = " ".join(title.split())
        if len(title) > MAX_TITLE_CHARS:
            raise invalid_request(f"'title' must be at most {MAX_TITLE_CHARS} characters, got {len(title)}")
        try:
            entry = catalog.retitle(conversation_id, title)
        except CatalogError as exc:
            raise api_error(exc) from None
        self.transcripts.forget(entry.id)
        resp.media = entry_fields(entry, self.transcripts.of(catalog, [entry])[entry.id])

    def on_delete_one(self, req: falcon.Request, resp: falcon.Response, conversation_id: str) -> None:
        catalog = self._catalog(req)
        try:
            entry = catalog.delete(conversation_id, self.ctx.config.slot_wait)
        except CatalogError as exc:
            raise api_error(exc) from None
        self.transcripts.forget(entry.id)
        resp.media = {"id": entry.id, "deleted": True}

    def on_get_file(self, req: falcon.Request, resp: falcon.Response, conversation_id: str) -> None:
        catalog = self._catalog(req)
        try:
            stream, size = catalog.open(conversation_id)
        except CatalogError as exc:
            raise api_error(exc) from None
        resp.content_type = UPLOAD_MEDIA
        resp.set_header("Content-Disposition", f'attachment; filename="{conversation_id}.ssf"')
        resp.set_stream(stream, size)
