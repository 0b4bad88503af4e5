"""The supervisor against a fake engine *process*: ready, kill -9, restart with backoff, fail-stop,
give-up statuses, the busy slot, cancelled streams, QUIT on stop."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from strata_server.engine.client import EngineState
from strata_server.engine.supervisor import EngineSupervisor, RestartPolicy, SupervisorSettings
from strata_server.errors import EngineDied, EngineReplyError, EngineUnavailable, SlotBusy

from .fake_engine import FAKE_ENGINE_PATH as FAKE_ENGINE
from .fake_engine import mark_fail_after_gate

FAST = RestartPolicy(base_s=0.05, max_s=0.5, stable_s=5.0, ready_timeout_s=20.0)


def make(
    fake_model: Path,
    *extra: str,
    policy: RestartPolicy = FAST,
    on_give_up=None,
    slot_wait: float = 0.3,
    command_timeout: float = 30.0,
) -> EngineSupervisor:
    argv = [sys.executable, str(FAKE_ENGINE), "serve", "--model", str(fake_model), *extra]
    supervisor = EngineSupervisor(
        argv,
        policy=policy,
        on_give_up=on_give_up,
        settings=SupervisorSettings(
            slot_wait_s=slot_wait, command_timeout_s=command_timeout, stop_timeout_s=5.0
        ),
    )
    supervisor.start()
    return supervisor


@pytest.fixture
def supervised(fake_model):
    made = []

    def factory(*extra, **kwargs):
        supervisor = make(fake_model, *extra, **kwargs)
        made.append(supervisor)
        return supervisor

    yield factory
    for supervisor in made:
        supervisor.stop()


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def complete(supervisor, prompt: str = "hello", n_predict: int = 4) -> dict:
    with supervisor.acquire() as lease:
        return lease.call("COMPLETE", {"prompt": prompt, "n_predict": n_predict, "temperature": 0})


def test_loading_then_ready(supervised):
    supervisor = supervised("--load-delay", "0.5")
    assert supervisor.status().state is EngineState.STARTING
    with pytest.raises(EngineUnavailable, match="Loading model"):
        supervisor.acquire()
    assert supervisor.wait_ready(20).state is EngineState.READY
    assert supervisor.status().info["engine"] == "fake-engine"
    assert complete(supervisor)["stop_type"] == "limit"


def test_kill_9_idle_restarts(supervised):
    supervisor = supervised()
    supervisor.wait_ready(20)
    first_pid = supervisor.engine_pid
    exits = []
    supervisor.add_exit_listener(exits.append)
    os.kill(first_pid, signal.SIGKILL)
    wait_for(lambda: supervisor.status().restarts == 1 and supervisor.status().state is EngineState.READY)
    assert supervisor.engine_pid != first_pid and exits == [-9]
    assert supervisor.status().last_exit == -9
    assert complete(supervisor)["tokens_evaluated"] == 5


def test_forward_passes_are_summed_over_the_engines_restarts(supervised):
    supervisor = supervised()
    supervisor.wait_ready(20)
    assert supervisor.status().n_forward == 0
    complete(supervisor, n_predict=4)  # the fake's passes: one for the prompt, one per token but the last
    with supervisor.command() as lease:
        lease.call("EMBED", {"tokens": [5, 6, 7], "pooling": "mean"})
    assert supervisor.status().n_forward == 4 + 1
    os.kill(supervisor.engine_pid, signal.SIGKILL)
    wait_for(lambda: supervisor.status().restarts == 1 and supervisor.status().state is EngineState.READY)
    assert supervisor.status().n_forward == 5  # the dead engine's passes stay counted
    complete(supervisor, n_predict=3)
    assert supervisor.status().n_forward == 5 + 3


def test_kill_9_mid_generation(supervised):
    supervisor = supervised("--token-delay", "0.05")
    supervisor.wait_ready(20)
    lease = supervisor.acquire()
    events = lease.request("COMPLETE", {"prompt": "long", "n_predict": 200})
    assert next(events)["event"] == "token"
    os.kill(supervisor.engine_pid, signal.SIGKILL)
    with pytest.raises(EngineDied, match="signal 9"):
        for _ in events:
            pass
    lease.release()
    wait_for(lambda: supervisor.status().state is EngineState.READY and supervisor.status().restarts == 1)
    assert complete(supervisor)["stop_type"] == "limit"


def test_requests_during_restart_get_503(supervised):
    supervisor = supervised("--load-delay", "0.8", policy=RestartPolicy(base_s=0.3, stable_s=5.0))
    supervisor.wait_ready(20)
    os.kill(supervisor.engine_pid, signal.SIGKILL)
    wait_for(lambda: supervisor.status().state is EngineState.RESTARTING)
    with pytest.raises(EngineUnavailable, match="Loading model"):
        supervisor.acquire()
    wait_for(lambda: supervisor.status().state is EngineState.READY)


def test_backoff_grows_and_resets():
    policy = RestartPolicy(base_s=0.25, factor=2.0, max_s=2.0)
    assert [policy.delay(n) for n in range(1, 6)] == [0.25, 0.5, 1.0, 2.0, 2.0]


def test_fail_stop_exit_4_restarts(supervised, tmp_path):
    supervisor = supervised()
    supervisor.wait_ready(20)
    complete(supervisor, "keep this conversation")
    path = tmp_path / "s.bin"
    with supervisor.acquire() as lease:
        lease.call("SAVE", {"path": str(path)})
    mark_fail_after_gate(str(path), fail_stop=True)
    with supervisor.acquire() as lease, pytest.raises(EngineReplyError) as info:
        lease.call("RESTORE", {"path": str(path)})
    assert info.value.kind == "fail_stop"
    wait_for(lambda: supervisor.status().restarts == 1 and supervisor.status().state is EngineState.READY)
    assert supervisor.status().last_exit == 4
    assert complete(supervisor, "keep this conversation")["timings"]["cache_n"] == 0


@pytest.mark.parametrize(
    ("extra", "needle"), [(("--fail-load",), "cannot load model"), (("--protocol", "1"), "protocol 1")]
)
def test_give_up_statuses_not_restarted(fake_model, tmp_path, extra, needle):
    pid_file = tmp_path / "pids"
    reports = []
    supervisor = make(fake_model, *extra, "--pid-file", str(pid_file), on_give_up=reports.append)
    try:
        wait_for(lambda: supervisor.status().state is EngineState.FAILED)
        time.sleep(0.3)
        assert len(pid_file.read_text().split()) == 1  # started once, never in a loop
        assert len(reports) == 1 and needle in reports[0]
        with pytest.raises(EngineUnavailable, match=needle):
            supervisor.acquire()
    finally:
        supervisor.stop()


def test_usage_exit_2_gives_up(tmp_path):
    reports = []
    supervisor = EngineSupervisor(
        [sys.executable, str(FAKE_ENGINE), "--bogus-flag"], policy=FAST, on_give_up=reports.append
    )
    supervisor.start()
    try:
        wait_for(lambda: supervisor.status().state is EngineState.FAILED)
        assert "exit status 2" in reports[0]
    finally:
        supervisor.stop()


def test_busy_slot_bounded_wait(supervised):
    supervisor = supervised()
    supervisor.wait_ready(20)
    lease = supervisor.acquire()
    start = time.monotonic()
    with pytest.raises(SlotBusy):
        supervisor.acquire(0.3)
    assert 0.25 < time.monotonic() - start < 2.0
    got = []
    waiter = threading.Thread(target=lambda: got.append(supervisor.acquire(5.0)))
    waiter.start()
    time.sleep(0.1)
    assert supervisor.slots.waiting == 1
    lease.release()
    waiter.join(5)
    got[0].release()


def test_abandoned_stream_is_cancelled_and_channel_stays_in_step(supervised):
    supervisor = supervised("--token-delay", "0.02")
    supervisor.wait_ready(20)
    lease = supervisor.acquire()
    events = lease.request("COMPLETE", {"prompt": "abc", "n_predict": 500})
    next(events)
    events.close()  # the client went away
    started = time.monotonic()
    lease.release()  # sends CANCEL and reads the COMPLETE to its end
    assert time.monotonic() - started < 5
    with supervisor.acquire() as lease:
        assert lease.call("TOKENIZE", {"content": "hi"})["tokens"] == [107, 108]


def test_stop_quits_the_engine(fake_model):
    supervisor = make(fake_model)
    supervisor.wait_ready(20)
    pid = supervisor.engine_pid
    exits = []
    supervisor.add_exit_listener(exits.append)
    supervisor.stop()
    assert supervisor.status().state is EngineState.STOPPED
    assert exits == [0]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_engine_silence_is_treated_as_hung(supervised):
    supervisor = supervised("--token-delay", "2", command_timeout=0.5)
    supervisor.wait_ready(20)
    with supervisor.acquire() as lease, pytest.raises(EngineDied, match="no answer"):
        lease.call("COMPLETE", {"prompt": "x", "n_predict": 3})
    wait_for(lambda: supervisor.status().restarts == 1 and supervisor.status().state is EngineState.READY)


def test_not_ready_as_soon_as_fail_stop_is_announced(supervised, tmp_path):
    supervisor = supervised()
    supervisor.wait_ready(20)
    path = tmp_path / "s.bin"
    with supervisor.acquire() as lease:
        lease.call("SAVE", {"path": str(path)})
    mark_fail_after_gate(str(path), fail_stop=True)
    with supervisor.acquire() as lease, pytest.raises(EngineReplyError):
        lease.call("RESTORE", {"path": str(path)})
    # Before the supervising thread has even reaped the exit, nobody is handed the doomed process.
    assert supervisor.status().state is not EngineState.READY
    with pytest.raises(EngineUnavailable):
        supervisor.acquire()
    wait_for(lambda: supervisor.status().state is EngineState.READY)


# A child that answers its one command with 300 token lines and a result line far larger than the read buffer.
MANY_LINES_CHILD = """
import json, sys
line = sys.stdin.readline()
request = json.loads(line.split(" ", 1)[1])
out = sys.stdout
for i in range(300):
    out.write(json.dumps({"event": "token", "id": request["id"], "token": i}) + "\\n")
out.write(json.dumps({"event": "result", "id": request["id"], "content": "x" * 200000}) + "\\n")
out.flush()
sys.stdin.read()
"""


def test_engine_lines_are_routed_whole_through_the_read_buffer():
    from strata_server.engine.process import READ_BUFFER_BYTES, EngineProcess

    process = EngineProcess([sys.executable, "-c", MANY_LINES_CHILD])
    try:
        call = process.start("COMPLETE", {}, 0)
        events = [call.next_event(timeout=30) for _ in range(301)]
        assert [e["token"] for e in events[:300]] == list(range(300))
        assert events[300]["event"] == "result" and len(events[300]["content"]) == 200000 > READ_BUFFER_BYTES
    finally:
        process.close_input()
        process.wait(10)
        process.kill()
