"""A stored conversation given a title: its session file written again with new notes in its engine fields, the
K/V bytes copied from the old file as they are (strata-sessionfile's writer drives a `SessionSource` that reads
the verified old file), so the hashes and the MAC cover the title too. The tokens are unchanged, so is the name.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import strata_sessionfile as sf
from strata_sessionfile import EngineIdentity, Part, Snapshot

from ..transcript import Notes, read_notes, with_notes


class CompressedFile(Exception):
    """A compressed session file: its parts cannot be copied by offset (the store never writes one)."""


class FileSource:
    """`sf.SessionSource` of a verified session file whose engine fields are replaced."""

    def __init__(self, path: Path, inspection: sf.Inspection, engine_fields: bytes) -> None:
        if inspection.layout.compressed is not None:
            raise CompressedFile(f"{path.name} is compressed")
        self.path = path
        self.inspection = inspection
        self.state = attrs.evolve(inspection.metadata.state, engine_fields=engine_fields)
        self.extents = {(e.layer, e.part): e for e in inspection.layout.extents}
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)

    def close(self) -> None:
        os.close(self.fd)

    def identity(self) -> EngineIdentity:
        metadata = self.inspection.metadata
        return EngineIdentity(metadata.model, metadata.config)

    def snapshot(self) -> Snapshot:
        return Snapshot(self.state, self.inspection.metadata.layers)

    def copy_out(self, layer: int, part: Part, offset: int, dest: memoryview) -> None:
        extent = self.extents[(layer, part)]
        at = self.inspection.layout.data_offset + extent.data_offset + offset
        got = os.preadv(self.fd, [dest], at)
        if got != len(dest):
            raise sf.SessionFileError(f"{self.path.name} shrank while it was copied")


def retitled(path: Path, target: Path, title: str, key: sf.SessionKey | None, require_mac: bool) -> int:
    """Write `path`'s conversation to `target` (not fsynced: the store commits it) with `title` in its notes;
    the bytes written. `path` is verified in full first (hashes, MAC): a bad file is refused, not copied."""
    inspection = sf.inspect(path, verify=True, read_threads=1, key=key, require_mac=require_mac)
    old = read_notes(inspection.metadata.state.engine_fields) or Notes()
    encoded = attrs.evolve(old, title=title).encode()
    if encoded is None:
        raise ValueError("the notes with this title are over the engine's bound")
    source = FileSource(path, inspection, with_notes(inspection.metadata.state.engine_fields, encoded))
    try:
        report = sf.save(str(target), source, key=key)
    finally:
        source.close()
    return int(report.bytes_written)
