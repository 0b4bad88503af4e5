"""Streaming-safe UTF-8 decoding of token bytes: a token may end in the middle of a character."""

from __future__ import annotations

import codecs


class Utf8Stream:
    """Feed token bytes, get back only complete characters; an incomplete tail is held until the
    bytes that complete it arrive (or `finish` renders it as U+FFFD). Invalid sequences become U+FFFD."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, data: bytes) -> str:
        return self._decoder.decode(data, final=False)

    def finish(self) -> str:
        return self._decoder.decode(b"", final=True)

    @property
    def pending(self) -> bytes:
        """Bytes of an incomplete character held back."""
        return self._decoder.getstate()[0]
