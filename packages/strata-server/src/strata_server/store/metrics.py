"""The session store's Prometheus series (`strata:store_*`), rendered with the server's other metrics."""

from __future__ import annotations

import bisect
import enum
import threading
from collections import Counter

from .uploads import UploadResult

# Seconds; a restore of a few MB takes milliseconds, a save of hundreds of MB up to a second or two.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

Row = tuple[str, str, str, list[tuple[str, float]]]  # name, type, help, [(suffix and labels, value)]


class Lookup(enum.StrEnum):
    """What a request's lookup found (the `result` label of strata:store_lookups_total)."""

    HIT = "hit"  # a stored conversation was restored into the slot
    MISS = "miss"  # nothing stored is at least --cache-min-reuse tokens longer than what the slot holds
    HELD = "held"  # the slot already holds the prompt's longest stored prefix (or more)
    REFUSED = "refused"  # a match was found but its file was refused (bad file, or no resume point)


class SaveTrigger(enum.StrEnum):
    """Why a conversation was saved (the `trigger` label of strata:store_saves_total)."""

    REPLACE = "replace"  # its slot was about to take another conversation
    IDLE = "idle"  # its slot was idle for --cache-idle-seconds
    SHUTDOWN = "shutdown"  # SIGTERM / SIGINT
    WRITE_BEHIND = "write_behind"  # a completion just extended it (with --cache-store)
    UPLOAD = "upload"  # a client uploaded it (POST /conversations)
    RENAME = "rename"  # written again with a title (PATCH /conversations/{id})


class WriteBehind(enum.StrEnum):
    """What a write-behind found after a completion (the `result` label of strata:store_write_behind_total)."""

    SAVED = "saved"  # the slot's conversation was saved (and queued for its upload)
    NOTHING = "nothing"  # nothing new to save: stored already, too short, or unknown
    BUSY = "busy"  # the slot had already taken the next request: that request's end saves it
    FAILED = "failed"  # the engine's SAVE failed (counted in strata:store_save_failures_total too)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def samples(self) -> list[tuple[str, float]]:
        rows, running = [], 0
        for bound, count in zip((*map(_number, self.buckets), "+Inf"), self.counts, strict=True):
            running += count
            rows.append((f'_bucket{{le="{bound}"}}', running))
        return rows + [("_sum", self.sum), ("_count", running)]


class StoreMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lookups: Counter[Lookup] = Counter()
        self.saves: Counter[SaveTrigger] = Counter()
        self.save_failures = 0
        self.save_bytes = 0
        self.restore_bytes = 0
        self.restored_tokens = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.bad_files: Counter[str] = Counter()
        self.fetches = 0  # conversations downloaded from the object store (--cache-store)
        self.fetch_bytes = 0
        self.remote_failures = 0  # object-store lookups or downloads that failed (the prompt went on locally)
        self.save_seconds = Histogram()
        self.restore_seconds = Histogram()
        self.write_behinds: Counter[WriteBehind] = Counter()
        self.write_behind_lease_seconds = Histogram()  # the slot's lease held by a write-behind's SAVE
        self.uploads: Counter[UploadResult] = Counter()
        self.upload_bytes = 0
        self.upload_seconds = Histogram()
        self.upload_queue_bytes = 0
        self.upload_queue_limit = 0

    def lookup(self, result: Lookup) -> None:
        with self._lock:
            self.lookups[result] += 1

    def saved(self, trigger: SaveTrigger, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.saves[trigger] += 1
            self.save_bytes += nbytes
            self.save_seconds.observe(seconds)

    def save_failed(self) -> None:
        with self._lock:
            self.save_failures += 1

    def restored(self, nbytes: int, n_kept: int, seconds: float) -> None:
        with self._lock:
            self.lookups[Lookup.HIT] += 1
            self.restore_bytes += nbytes
            self.restored_tokens += n_kept
            self.restore_seconds.observe(seconds)

    def evicted(self, nbytes: int) -> None:
        with self._lock:
            self.evictions += 1
            self.evicted_bytes += nbytes

    def bad_file(self, reason: str) -> None:
        with self._lock:
            self.bad_files[reason] += 1

    def fetched(self, nbytes: int) -> None:
        with self._lock:
            self.fetches += 1
            self.fetch_bytes += nbytes

    def remote_failed(self) -> None:
        with self._lock:
            self.remote_failures += 1

    def write_behind(self, result: WriteBehind, lease_s: float | None = None) -> None:
        with self._lock:
            self.write_behinds[result] += 1
            if lease_s is not None:
                self.write_behind_lease_seconds.observe(lease_s)

    def uploaded(self, result: UploadResult, nbytes: int = 0, seconds: float | None = None) -> None:
        with self._lock:
            self.uploads[result] += 1
            self.upload_bytes += nbytes
            if seconds is not None:
                self.upload_seconds.observe(seconds)

    def upload_queue(self, nbytes: int, limit: int) -> None:
        with self._lock:
            self.upload_queue_bytes, self.upload_queue_limit = nbytes, limit

    def rows(self, bytes_held: int, files_held: int, limit_bytes: int) -> list[Row]:
        with self._lock:
            return [
                (
                    "strata:store_lookups_total",
                    "counter",
                    "Prompts looked up in the session store, by result.",
                    [(f'{{result="{r}"}}', self.lookups[r]) for r in Lookup],
                ),
                (
                    "strata:store_saves_total",
                    "counter",
                    "Conversations saved to the session store, by trigger.",
                    [(f'{{trigger="{t}"}}', self.saves[t]) for t in SaveTrigger],
                ),
                (
                    "strata:store_save_failures_total",
                    "counter",
                    "Session store saves that failed (nothing replaced).",
                    [("", self.save_failures)],
                ),
                (
                    "strata:store_save_bytes_total",
                    "counter",
                    "Bytes written by session store saves.",
                    [("", self.save_bytes)],
                ),
                (
                    "strata:store_restore_bytes_total",
                    "counter",
                    "Bytes read by session store restores.",
                    [("", self.restore_bytes)],
                ),
                (
                    "strata:store_restored_tokens_total",
                    "counter",
                    "Tokens kept in the slot by session store restores.",
                    [("", self.restored_tokens)],
                ),
                (
                    "strata:store_evictions_total",
                    "counter",
                    "Stored conversations evicted (least recently used).",
                    [("", self.evictions)],
                ),
                (
                    "strata:store_evicted_bytes_total",
                    "counter",
                    "Bytes of the evicted conversations.",
                    [("", self.evicted_bytes)],
                ),
                (
                    "strata:store_bad_files_total",
                    "counter",
                    "Store files that failed validation and were moved aside, by reason.",
                    [(f'{{reason="{r}"}}', n) for r, n in sorted(self.bad_files.items())] or [("", 0)],
                ),
                (
                    "strata:store_fetches_total",
                    "counter",
                    "Conversations the object store (--cache-store) "
                    "supplied for a prompt: downloaded into --cache-disk, or without it restored straight from the "
                    "object.",
                    [("", self.fetches)],
                ),
                (
                    "strata:store_fetch_bytes_total",
                    "counter",
                    "Bytes downloaded from the object store into --cache-disk.",
                    [("", self.fetch_bytes)],
                ),
                (
                    "strata:store_remote_failures_total",
                    "counter",
                    "Object-store lookups or downloads that failed.",
                    [("", self.remote_failures)],
                ),
                (
                    "strata:store_write_behind_total",
                    "counter",
                    "Write-behind saves after a completion (with --cache-store), by result.",
                    [(f'{{result="{r}"}}', self.write_behinds[r]) for r in WriteBehind],
                ),
                (
                    "strata:store_write_behind_lease_seconds",
                    "histogram",
                    "How long a write-behind save held its slot (the engine's SAVE; a request for the slot waits).",
                    self.write_behind_lease_seconds.samples(),
                ),
                (
                    "strata:store_uploads_total",
                    "counter",
                    "Uploads to the object store (--cache-store), by result.",
                    [(f'{{result="{r}"}}', self.uploads[r]) for r in UploadResult],
                ),
                (
                    "strata:store_upload_bytes_total",
                    "counter",
                    "Bytes uploaded to the object store.",
                    [("", self.upload_bytes)],
                ),
                (
                    "strata:store_upload_seconds",
                    "histogram",
                    "Object-store upload latency.",
                    self.upload_seconds.samples(),
                ),
                (
                    "strata:store_upload_queue_bytes",
                    "gauge",
                    "Bytes of files waiting for their upload to the object store.",
                    [("", self.upload_queue_bytes)],
                ),
                (
                    "strata:store_upload_queue_limit_bytes",
                    "gauge",
                    "The upload queue's byte limit (--cache-store-queue).",
                    [("", self.upload_queue_limit)],
                ),
                (
                    "strata:store_bytes",
                    "gauge",
                    "Bytes of this server's files in the session store.",
                    [("", bytes_held)],
                ),
                (
                    "strata:store_files",
                    "gauge",
                    "This server's files in the session store.",
                    [("", files_held)],
                ),
                (
                    "strata:store_limit_bytes",
                    "gauge",
                    "The session store's byte limit (--cache-disk-max).",
                    [("", limit_bytes)],
                ),
                (
                    "strata:store_save_seconds",
                    "histogram",
                    "Session store save latency.",
                    self.save_seconds.samples(),
                ),
                (
                    "strata:store_restore_seconds",
                    "histogram",
                    "Session store restore latency.",
                    self.restore_seconds.samples(),
                ),
            ]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
