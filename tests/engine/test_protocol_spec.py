"""Binds spec/engine-protocol.md's tables (verbs and their objects, error kinds, reasons, exit statuses) and its
version to strata_engine.protocol's constants and strata_engine.wire's verbs, so the spec and the engine cannot
drift apart."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import attrs
from strata_engine import protocol as P
from strata_engine import wire
from strata_engine.completion import CompletionRequest
from strata_engine.errors import ContextOverflow, InvalidRequest
from strata_engine.sampling import SamplingParams
from strata_engine.serve import build_registry
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
    rows = table_rows(errors[errors.index("The reasons the protocol itself gives") :])
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
    named = lines[lines.index("- `slot`: for the verbs that act on one slot") :].split(")", 1)[0]
    registry = build_registry()
    assert sorted(re.findall(r"`([A-Z_]+)`", named)) == sorted(
        v for v in registry.verbs if registry.get(v).slotted
    )


def test_the_verbs_answered_off_the_step_loop_are_the_worker_s():
    """Scheduling names the verbs run on the worker thread, and those that start stepped jobs."""
    scheduling = " ".join(section(SPEC, "## Scheduling").split())
    worker = scheduling[scheduling.index("- `TOKENIZE`") :].split(" run on worker threads", 1)[0]
    registry = build_registry()
    on_worker = sorted(v for v in registry.verbs if registry.get(v).dispatch is P.Dispatch.WORKER)
    assert sorted(set(re.findall(r"`([A-Z_]+)`", worker)) - {"COMPLETE"}) == on_worker
    assert sorted(v for v in registry.verbs if registry.get(v).dispatch is P.Dispatch.JOB) == [
        "COMPLETE",
        "EMBED",
    ]
    assert {v for v in registry.verbs if registry.get(v).dispatch is P.Dispatch.JOB} == P.CANCELLABLE_VERBS


def test_the_cut_chunk_rule_is_the_scheduler_s():
    from strata_engine import scheduler

    scheduling = " ".join(section(SPEC, "## Scheduling").split())
    assert (
        f"cut to a quarter of `--prefill-chunk` (at least {scheduler.MIN_CUT_CHUNK} tokens" in scheduling
        and scheduler.CUT_CHUNK_SHARE == 4
    )  # "a quarter"


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
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    )
    assert [m for m in loaded if m.startswith("strata_engine")] == [
        "strata_engine",
        "strata_engine.errors",
        "strata_engine.protocol",
    ]
    assert "numpy" not in loaded


def test_the_wire_layer_loads_no_numpy():
    """The server and its tests' fake engine speak through it: the protocol, the exceptions and the settings'
    enums come with it, no engine code."""
    probe = "import json, sys, strata_engine.wire; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    )
    assert [m for m in loaded if m.startswith("strata_engine")] == [
        "strata_engine",
        "strata_engine.errors",
        "strata_engine.protocol",
        "strata_engine.settings",
        "strata_engine.wire",
    ]
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
    assert {"ProtocolError", "FailStop"} == {
        n for n, c in defined.items() if c.__module__ == "strata_engine.protocol"
    }


def test_every_verb_s_object_is_its_argument_class():
    """Each verb's object in Lines (COMPLETE's: its section's table) names the fields of its class in wire.VERBS
    (besides every verb's `id` and `slot`), with the same boolean defaults."""
    rows = {code(r[0]): r[1] for r in table_rows(section(SPEC, "## Lines"))}
    assert set(rows) == set(wire.VERBS)
    for verb, cell in rows.items():
        arguments = wire.VERBS[verb].arguments
        if verb in ("COMPLETE", "PROMPT_TOKENS"):  # "COMPLETE's (below)"
            spec_fields = {code(r[0]): f"{r[1]} = {r[2]}" for r in table_rows(section(SPEC, "## COMPLETE"))}
        else:
            spec_fields = dict(re.findall(r'"(\w+)": ([^,}]+)', cell))
        assert set(spec_fields) - {"id", "slot"} == {f.name for f in attrs.fields(arguments)}, verb
        for field in attrs.fields(arguments):
            default = field.default
            if verb in ("COMPLETE", "PROMPT_TOKENS"):  # None there: the engine's default, the spec's column
                default = getattr(
                    CompletionRequest(), field.name, getattr(SamplingParams(), field.name, None)
                )
            if isinstance(default, bool):
                assert spec_fields[field.name].strip().endswith(f"= {json.dumps(default)}"), (
                    verb,
                    field.name,
                )


def test_arguments_name_every_bad_field_and_ignore_unknown_ones():
    assert wire.arguments(wire.SaveArgs, {"path": "x.ssf", "other": 1}) == wire.SaveArgs("x.ssf", sync=True)
    assert wire.arguments(wire.SaveArgs, {"path": "x.ssf", "sync": False}).sync is False
    try:
        wire.arguments(
            wire.RestorePrefixArgs, {"path": "a\nb", "cut_to": -1, "min_keep": "3", "discard_held": 0}
        )
    except InvalidRequest as exc:
        assert [p.split()[0] for p in exc.problems] == ["path", "cut_to", "min_keep", "discard_held"]
        assert P.error_payload(exc)["reason"] == P.Reason.BAD_FIELD
    else:
        raise AssertionError("bad fields accepted")
