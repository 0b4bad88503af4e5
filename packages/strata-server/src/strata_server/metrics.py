"""Prometheus counters: the peer's ``llamacpp:*`` set, plus Strata's slot-file and engine counters."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping

from .slot_manager import SlotManager

CONTENT_TYPE = "text/plain; version=0.0.4"


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.start_time = time.time()
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0
        self.prompt_seconds = 0.0
        self.tokens_predicted = 0
        self.tokens_predicted_seconds = 0.0
        # the steps with a completion processing (sum of the results' step_share) and the slots processing in
        # each (of their n_steps): n_busy_slots_per_decode; n_decode_total is the engine's own count of passes
        self.busy_steps = 0.0
        self.n_busy_slot_steps = 0
        self.n_tokens_max = 0
        self.saves = 0
        self.save_bytes = 0
        self.save_ms = 0.0
        self.save_failures = 0
        self.restores = 0
        self.restore_bytes = 0
        self.restore_ms = 0.0
        self.erases = 0
        self.refusals: Counter[str] = Counter()
        self.fail_stops = 0
        self.engine_exits: Counter[int] = Counter()

    def record_completion(self, result: Mapping) -> None:
        timings = result.get("timings") or {}
        prompt_n = int(timings.get("prompt_n", 0))
        predicted_n = int(timings.get("predicted_n", 0))
        with self._lock:
            self.prompt_tokens += prompt_n
            self.prompt_tokens_cached += int(timings.get("cache_n", 0))
            self.prompt_seconds += float(timings.get("prompt_ms", 0.0)) / 1000
            self.tokens_predicted += predicted_n
            if predicted_n > 1:  # as the peer, whose generation clock starts at the first token
                self.tokens_predicted_seconds += float(timings.get("predicted_ms", 0.0)) / 1000
            # the engine's batched steps, each shared by the slots processing in it (spec/engine-protocol.md)
            self.busy_steps += float(result.get("step_share", 0.0))
            self.n_busy_slot_steps += int(result.get("n_steps", 0))
            self.n_tokens_max = max(self.n_tokens_max, int(result.get("n_tokens_held", 0)))

    def record_save(self, n_written: int, save_ms: float) -> None:
        with self._lock:
            self.saves += 1
            self.save_bytes += n_written
            self.save_ms += save_ms

    def record_save_failure(self) -> None:
        with self._lock:
            self.save_failures += 1

    def record_restore(self, n_read: int, restore_ms: float) -> None:
        with self._lock:
            self.restores += 1
            self.restore_bytes += n_read
            self.restore_ms += restore_ms

    def record_refusal(self, reason: str) -> None:
        with self._lock:
            self.refusals[reason] += 1

    def record_fail_stop(self) -> None:
        with self._lock:
            self.fail_stops += 1

    def record_erase(self) -> None:
        with self._lock:
            self.erases += 1

    def record_engine_exit(self, code: int) -> None:
        with self._lock:
            self.engine_exits[code] += 1

    def render(self, slots: SlotManager, engine_restarts: int, n_forward: int) -> str:
        """The text of /metrics; ``n_forward``: the engine's forward passes (``EngineStatus.n_forward``)."""
        states, held = slots.snapshot(), slots.ledger.snapshot()
        waiting = slots.waiting
        with self._lock:
            rows: list[tuple[str, str, str, list[tuple[str, float]]]] = [
                (
                    "llamacpp:prompt_tokens_total",
                    "counter",
                    "Number of prompt tokens processed.",
                    [("", self.prompt_tokens)],
                ),
                (
                    "llamacpp:prompt_tokens_cached_total",
                    "counter",
                    "Prompt tokens reused from the held conversation.",
                    [("", self.prompt_tokens_cached)],
                ),
                (
                    "llamacpp:prompt_seconds_total",
                    "counter",
                    "Prompt process time",
                    [("", self.prompt_seconds)],
                ),
                (
                    "llamacpp:tokens_predicted_total",
                    "counter",
                    "Number of generation tokens processed.",
                    [("", self.tokens_predicted)],
                ),
                (
                    "llamacpp:tokens_predicted_seconds_total",
                    "counter",
                    "Predict process time",
                    [("", self.tokens_predicted_seconds)],
                ),
                (
                    "llamacpp:n_decode_total",
                    "counter",
                    "Total number of llama_decode() calls",
                    [("", n_forward)],
                ),
                ("llamacpp:n_tokens_max", "counter", "Largest observed n_tokens.", [("", self.n_tokens_max)]),
                (
                    "llamacpp:spec_decode_num_draft_tokens_total",
                    "counter",
                    "Draft tokens proposed (no speculative decoding in Strata).",
                    [("", 0)],
                ),
                (
                    "llamacpp:spec_decode_num_accepted_tokens_total",
                    "counter",
                    "Draft tokens accepted.",
                    [("", 0)],
                ),
                ("llamacpp:spec_decode_num_drafts_total", "counter", "Drafts generated.", [("", 0)]),
                (
                    "llamacpp:prompt_tokens_seconds",
                    "gauge",
                    "Average prompt throughput in tokens/s.",
                    [("", ratio(self.prompt_tokens, self.prompt_seconds))],
                ),
                (
                    "llamacpp:predicted_tokens_seconds",
                    "gauge",
                    "Average generation throughput in tokens/s.",
                    [("", ratio(self.tokens_predicted, self.tokens_predicted_seconds))],
                ),
                (
                    "llamacpp:requests_processing",
                    "gauge",
                    "Number of requests processing.",
                    [("", sum(s.busy for s in states))],
                ),
                ("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", [("", waiting)]),
                (
                    "llamacpp:n_busy_slots_per_decode",
                    "gauge",
                    "Average number of busy slots per llama_decode() call",
                    [("", ratio(self.n_busy_slot_steps, self.busy_steps))],
                ),
                # Strata's per slot (llama-server has no per-slot series): busy or idle, and tokens held.
                (
                    "strata:slot_is_processing",
                    "gauge",
                    "Whether the slot is serving a request (1) or idle (0).",
                    [(f'{{id_slot="{s.id}"}}', int(s.busy)) for s in states],
                ),
                (
                    "strata:slot_tokens_held",
                    "gauge",
                    "Tokens the slot holds as far as the server knows (absent: unknown).",
                    [
                        (f'{{id_slot="{i}"}}', r.n_tokens)
                        for i, r in enumerate(held)
                        if r.n_tokens is not None
                    ],
                ),
                ("strata:slot_saves_total", "counter", "Slot saves completed.", [("", self.saves)]),
                (
                    "strata:slot_save_bytes_total",
                    "counter",
                    "Bytes written by slot saves.",
                    [("", self.save_bytes)],
                ),
                (
                    "strata:slot_save_milliseconds_total",
                    "counter",
                    "Time spent in slot saves.",
                    [("", self.save_ms)],
                ),
                (
                    "strata:slot_save_failures_total",
                    "counter",
                    "Slot saves that failed (old file kept).",
                    [("", self.save_failures)],
                ),
                ("strata:slot_restores_total", "counter", "Slot restores completed.", [("", self.restores)]),
                (
                    "strata:slot_restore_bytes_total",
                    "counter",
                    "Bytes read by slot restores.",
                    [("", self.restore_bytes)],
                ),
                (
                    "strata:slot_restore_milliseconds_total",
                    "counter",
                    "Time spent in slot restores.",
                    [("", self.restore_ms)],
                ),
                (
                    "strata:slot_restore_refusals_total",
                    "counter",
                    "Restores refused before touching the live conversation, by reason.",
                    [(f'{{reason="{_escape(r)}"}}', n) for r, n in sorted(self.refusals.items())]
                    or [("", 0)],
                ),
                (
                    "strata:slot_restore_fail_stops_total",
                    "counter",
                    "Restores that failed after their gate (the engine restarted).",
                    [("", self.fail_stops)],
                ),
                ("strata:slot_erases_total", "counter", "Slot erases.", [("", self.erases)]),
                (
                    "strata:engine_restarts_total",
                    "counter",
                    "Times the engine process was restarted.",
                    [("", engine_restarts)],
                ),
                (
                    "strata:engine_exits_total",
                    "counter",
                    "Engine process exits, by exit status.",
                    [(f'{{status="{c}"}}', n) for c, n in sorted(self.engine_exits.items())] or [("", 0)],
                ),
            ]
        return render_rows(rows)


def render_rows(rows: list[tuple[str, str, str, list[tuple[str, float]]]]) -> str:
    """Prometheus text of (name, type, help, [(suffix and labels, value)]) rows."""
    lines = []
    for name, kind, help_text, samples in rows:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines += [f"{name}{labels} {_number(value)}" for labels, value in samples]
    return "\n".join(lines) + "\n"


def ratio(count: float, per: float) -> float:
    """count / per (tokens per second, busy slots per step); 0 before anything was counted."""
    return count / per if per > 0 else 0.0


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
