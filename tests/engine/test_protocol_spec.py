"""Binds spec/engine-protocol.md's tables (verbs, error kinds, reasons, exit statuses) and its version to
strata_engine.protocol's constants, so the spec and the engine cannot drift apart."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import attrs
from strata_engine import protocol as P
from strata_engine.errors import ContextOverflow
from strata_engine.serve import build_registry
from strata_engine.session.verbs import RestorePrefixRequest, SaveRequest, parse_save
from support.spec import code, read_spec, section, table_rows

SPEC = read_spec("engine-protocol.md")
ARGUMENT_WORDS = {kind.value: kind for kind in P.ArgumentKind}  # "JSON object", "optional JSON object"


def argument_kind(cell: str) -> P.ArgumentKind:
    kinds = [kind for word, kind in ARGUMENT_WORDS.items() if cell.startswith(word)]
    assert len(kinds) == 1, f"argument cell {cell!r} must start with one of {list(ARGUMENT_WORDS)}"
    return kinds[0]


def test_verbs_table_is_the_registry():
    rows = table_rows(section(SPEC, "## Lines"))
    registry = build_registry()
    assert sorted(code(r[0]) for r in rows) == registry.verbs
    for verb_cell, argument, _answer in rows:
        verb = code(verb_cell)
        assert argument_kind(argument) is registry.get(verb).argument, verb


def test_error_kinds_table_is_the_enum():
    errors = section(SPEC, "## Errors")
    rows = table_rows(errors)
    assert [code(r[0]) for r in rows] == [k.value for k in P.ErrorKind]


def test_reasons_table_is_the_enum_and_its_kinds():
    errors = section(SPEC, "## Errors")
    rows = table_rows(errors[errors.index("The reasons the protocol itself gives"):])
    assert {code(r[0]): code(r[1]) for r in rows} == {r.value: k.value for r, k in P.REASON_KINDS.items()}
    assert set(P.REASON_KINDS) == set(P.Reason)
    too_long = next(r for r in rows if code(r[0]) == P.Reason.LINE_TOO_LONG)
    assert f"{P.MAX_LINE_BYTES >> 20} MiB" in too_long[2]


def test_exit_statuses_table_is_the_enum():
    rows = table_rows(section(SPEC, "## Exit statuses"))
    assert [(int(r[0]), code(r[1])) for r in rows] == [(int(s), s.name) for s in P.ExitStatus]


def test_ready_line_names_the_protocol_version_and_engine():
    ready = section(SPEC, "## Start-up")
    assert int(re.search(r'"protocol": (\d+)', ready).group(1)) == P.PROTOCOL_VERSION == 2
    assert f"protocol version **{P.PROTOCOL_VERSION}**" in SPEC
    assert re.search(r'"engine": "([^"]+)"', ready).group(1) == P.ENGINE_NAME


def test_slot_verbs_are_the_registry_s_slotted_verbs():
    """The verbs Lines says act on one slot are the ones the registry marks so (they take `slot`, slot_busy)."""
    lines = " ".join(section(SPEC, "## Lines").split())
    named = lines[lines.index("- `slot`: for the verbs that act on one slot"):].split(")", 1)[0]
    registry = build_registry()
    assert sorted(re.findall(r"`([A-Z_]+)`", named)) == sorted(v for v in registry.verbs if registry.get(v).slotted)


def test_the_verbs_answered_off_the_step_loop_are_the_worker_s():
    """Scheduling names the verbs run on the worker thread, and those that start stepped jobs."""
    scheduling = " ".join(section(SPEC, "## Scheduling").split())
    worker = scheduling[scheduling.index("- `TOKENIZE`"):].split(" run on worker threads", 1)[0]
    registry = build_registry()
    on_worker = sorted(v for v in registry.verbs if registry.get(v).dispatch is P.Dispatch.WORKER)
    assert sorted(set(re.findall(r"`([A-Z_]+)`", worker)) - {"COMPLETE"}) == on_worker
    assert sorted(v for v in registry.verbs if registry.get(v).dispatch is P.Dispatch.JOB) == ["COMPLETE", "EMBED"]
    assert {v for v in registry.verbs if registry.get(v).dispatch is P.Dispatch.JOB} == P.CANCELLABLE_VERBS


def test_the_cut_chunk_rule_is_the_scheduler_s():
    from strata_engine import scheduler

    scheduling = " ".join(section(SPEC, "## Scheduling").split())
    assert (f"cut to a quarter of `--prefill-chunk` (at least {scheduler.MIN_CUT_CHUNK} tokens" in scheduling
            and scheduler.CUT_CHUNK_SHARE == 4)  # "a quarter"


def test_every_mapped_exception_names_a_listed_kind_and_reason():
    for cls, kind, reason in P.ERROR_LINES:
        assert P.REASON_KINDS[reason] is kind, cls
        exc = cls(10, 5) if cls is ContextOverflow else cls("x")
        payload = P.error_payload(exc)
        assert (payload["type"], payload["reason"]) == (kind.value, reason.value)
    assert P.error_payload(ValueError("x"))["reason"] == P.Reason.UNEXPECTED


def test_the_protocol_module_loads_no_other_engine_code():
    """strata-server imports the vocabulary from it: only the exceptions (a leaf module) come with it."""
    probe = "import json, sys, strata_engine.protocol; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                       check=True).stdout)
    assert [m for m in loaded if m.startswith("strata_engine")] == \
        ["strata_engine", "strata_engine.errors", "strata_engine.protocol"]
    assert "numpy" not in loaded


def test_every_engine_exception_is_defined_in_errors_or_protocol():
    """One module of exceptions (errors.py, plus the protocol's own two), all under EngineError."""
    import importlib
    import inspect
    import pkgutil

    import strata_engine
    from strata_engine.errors import EngineError

    defined = {}
    for info in pkgutil.walk_packages(strata_engine.__path__, "strata_engine."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                defined[name] = obj
    assert {cls.__module__ for cls in defined.values()} == {"strata_engine.errors", "strata_engine.protocol"}
    assert all(issubclass(cls, EngineError) for cls in defined.values())
    assert {"ProtocolError", "FailStop"} == {n for n, c in defined.items() if c.__module__ == "strata_engine.protocol"}


def test_session_verbs_objects_are_the_parsers_fields():
    """SAVE's and RESTORE_PREFIX's objects in Lines name the fields (and defaults) their parsers take."""
    rows = {code(r[0]): r[1] for r in table_rows(section(SPEC, "## Lines"))}
    for verb, request in (("SAVE", SaveRequest), ("RESTORE_PREFIX", RestorePrefixRequest)):
        spec_fields = dict(re.findall(r'"(\w+)": ([^,}]+)', rows[verb]))
        assert set(spec_fields) == {"slot"} | {f.name for f in attrs.fields(request)}, verb
        for field in attrs.fields(request):
            if field.default is not attrs.NOTHING and isinstance(field.default, bool):
                assert spec_fields[field.name].strip().endswith(f"= {json.dumps(field.default)}"), (verb, field.name)
    assert parse_save({"path": "x.ssf"}) == SaveRequest("x.ssf", sync=True)
    assert parse_save({"path": "x.ssf", "sync": False}).sync is False
