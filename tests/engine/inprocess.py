"""The serve loop in process: a `ServeLoop` over given slots on a thread, fed through a pipe; every line
it writes is kept with the step it was written at (the step policy's count), so tests count steps,
not seconds."""

from __future__ import annotations

import json
import os
import queue
import threading

from strata_engine.protocol import LineReader, LineWriter
from strata_engine.serve import build_registry, serve_context, serve_loop

TIMEOUT_S = 120


class StepWriter(LineWriter):
    def __init__(self):
        self.lines: queue.Queue[tuple[int, dict] | None] = queue.Queue()
        self.scheduler = None

    def write(self, obj) -> None:
        data = json.dumps(obj, ensure_ascii=False, allow_nan=False)  # what LineWriter would refuse, this does
        self.lines.put((self.scheduler.steps, json.loads(data)))


class InProcessEngine:
    def __init__(self, slots, tokenizer, template):
        self.ctx = serve_context(slots, tokenizer, template)
        self._read, self._write = os.pipe()
        self.writer = StepWriter()
        self.loop = serve_loop(self.ctx, build_registry(), LineReader(self._read), self.writer)
        self.scheduler = self.writer.scheduler = self.loop.scheduler
        self.status = None
        self.log: list[tuple[int, dict]] = []  # every line read so far, with its step
        self._taken: set[int] = set()  # the lines `until` returned
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.status = self.loop.run()
        self.writer.lines.put(None)

    def send(self, verb: str, argument: dict | None = None) -> None:
        line = verb if argument is None else f"{verb} {json.dumps(argument)}"
        os.write(self._write, line.encode() + b"\n")

    def next_line(self) -> dict:
        item = self.writer.lines.get(timeout=TIMEOUT_S)
        assert item is not None, "the serve loop ended"
        self.log.append(item)
        return item[1]

    def until(self, predicate) -> dict:
        """The first line, read already or next, that matches and was not returned before."""
        index = 0
        while True:
            while index >= len(self.log):
                self.next_line()
            line = self.log[index][1]
            if index not in self._taken and predicate(line):
                self._taken.add(index)
                return line
            index += 1

    def terminal(self, request_id: str | None) -> dict:
        return self.until(lambda line: line.get("id") == request_id and line["event"] in ("result", "error"))

    def command(self, verb: str, argument: dict | None = None) -> dict:
        self.send(verb, argument)
        return self.terminal((argument or {}).get("id"))

    def of(self, request_id: str, event: str | None = None) -> list[tuple[int, dict]]:
        """(step, line) of the lines read for that id (of one event)."""
        return [
            (step, line)
            for step, line in self.log
            if line.get("id") == request_id and (event is None or line["event"] == event)
        ]

    def close(self) -> None:
        os.close(self._write)
        self._thread.join(timeout=TIMEOUT_S)
        os.close(self._read)


def alone_then_together(alone: InProcessEngine, together: InProcessEngine, requests: dict[str, dict]) -> dict:
    """Each COMPLETE of `requests` (by id) on the one-slot engine `alone` in turn, then all at once on
    `together` (the i-th in slot i): each gets the same tokens, content and stop type, and its slot holds the
    same conversation (STATUS's digest). Returns the results alone."""
    expected = {}
    for rid, request in requests.items():
        expected[rid] = alone.command("COMPLETE", request)
        expected[rid]["digest"] = alone.command("STATUS")["slots"][0]["tokens_held_digest"]
    for slot, request in enumerate(requests.values()):
        together.send("COMPLETE", {**request, "slot": slot})
    results = {rid: together.terminal(rid) for rid in requests}
    status = together.command("STATUS")["slots"]
    for slot, rid in enumerate(requests):
        for field in ("tokens", "content", "stop_type"):
            assert results[rid][field] == expected[rid][field], (rid, field)
        assert status[slot]["tokens_held_digest"] == expected[rid]["digest"], rid
    return expected


def staggered_match_alone(
    alone: InProcessEngine,
    together: InProcessEngine,
    requests: dict[str, dict],
    every: int,
    checked: list[str],
) -> list[int]:
    """The COMPLETEs of `requests` (by id) on `together` (the i-th in slot i), each sent once the one before has
    streamed `every` tokens (its prompt evaluated between the others' decode steps): those of `checked` get the
    tokens they get on the one-slot engine `alone`. Returns the rows of every decode step of the together run."""
    expected = {rid: alone.command("COMPLETE", {**requests[rid], "id": rid})["tokens"] for rid in checked}
    ids = list(requests)
    slots, rows = together.scheduler.slots, []
    decode_rows = slots.decode_rows

    def counted(steps, argmax_only):
        rows.append(len(steps))
        return decode_rows(steps, argmax_only)

    slots.decode_rows = counted  # the scheduler's steps and the ones it launched ahead (collected here)
    for slot, rid in enumerate(ids):
        together.send("COMPLETE", {**requests[rid], "id": rid, "slot": slot})
        if slot + 1 < len(ids):
            for _ in range(every):
                together.until(lambda line, rid=rid: line.get("id") == rid and line["event"] == "token")
    for rid in ids:
        result = together.terminal(rid)
        assert result["event"] == "result", result
        if rid not in expected:
            continue
        pairs = zip(result["tokens"], expected[rid], strict=True)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        assert first is None, f"{rid}: token {first} of {len(expected[rid])} differs from its run alone"
    return rows
