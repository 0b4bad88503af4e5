"""The names the store gives its files and objects: content hashes of the engine's fingerprints and the
conversation's tokens, never anything a client sent. A leaf: the folder, the object shelf and the remote
tier all name files by it."""

from __future__ import annotations

import re

import attrs
import numpy as np
import xxhash
from strata_sessionfile.records import Header

SUFFIX = ".ssf"
NAME = re.compile(r"^[0-9a-f]{32}\.ssf$")
PENDING_SUFFIX = ".pending"  # written by the engine, not yet fsynced: never indexed under this name
PENDING = re.compile(r"^([0-9a-f]{32}\.ssf)\.pending$")


@attrs.frozen
class Fingerprints:
    """The engine's session fingerprints (its ready line's `session_fingerprints`), as hex."""

    model: str
    config: str

    @classmethod
    def of_ready_line(cls, info: dict) -> Fingerprints | None:
        fp = info.get("session_fingerprints")
        if (
            not isinstance(fp, dict)
            or not isinstance(fp.get("model"), str)
            or not isinstance(fp.get("config"), str)
        ):
            return None
        return cls(fp["model"], fp["config"])

    def match(self, header: Header) -> bool:
        """Whether a session file's header names this engine's model and configuration."""
        return (header.model_fingerprint.hex(), header.config_fingerprint.hex()) == (self.model, self.config)


def conversation_name(fingerprints: Fingerprints, tokens: np.ndarray) -> str:
    """The file name of a conversation: XXH3-128 of the engine's fingerprints and the token ids, so two
    engines sharing the folder never write the same name for different files."""
    h = xxhash.xxh3_128()
    h.update(bytes.fromhex(fingerprints.model) + bytes.fromhex(fingerprints.config))
    h.update(tokens.astype("<i4", copy=False).tobytes())
    return h.hexdigest() + SUFFIX
