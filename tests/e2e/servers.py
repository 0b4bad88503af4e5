"""End-to-end helpers: a real strata-server (gunicorn + the real engine + the real default model) on
loopback."""

from __future__ import annotations

from pathlib import Path

from support.data import load_reference
from support.server_process import ServerProcess

E2E_CTX = "2048"
# A ceiling, not a wait: the first server of a fresh clone compiles the engine's kernels (minutes on a busy machine).
HEALTHY_WITHIN_S = 600


def start_server(
    tmp: Path,
    *flags: str,
    name: str = "server",
    env: dict[str, str] | None = None,
    port: int | None = None,
    own_group: bool = False,
    wait: bool = True,
) -> ServerProcess:
    """A started server (healthy unless `wait` is false: the caller then waits, starting others meanwhile)."""
    server = ServerProcess(
        "-c", E2E_CTX, *flags, log_path=tmp / f"{name}.log", env=env, port=port, own_group=own_group
    )
    return server.start(wait_healthy=HEALTHY_WITHIN_S if wait else 0)


def other_model_copy(smollm2_path: Path, folder: Path) -> Path:
    """SmolLM2 with one byte of its metadata changed: it loads and runs the same, but its model
    fingerprint (which covers the metadata block) differs — "another model" for restore purposes."""
    data = bytearray(smollm2_path.read_bytes())
    at = data.find(b"general.name")
    assert 0 < at < 4096, "general.name not found in the GGUF header"
    value = at + len(b"general.name") + 4 + 8  # type u32, length u64, then the string
    data[value] = ord("X") if data[value] != ord("X") else ord("Y")
    path = folder / "smollm2-other.gguf"
    path.write_bytes(bytes(data))
    return path


def reference_tokenizations() -> list[tuple[str, list[int]]]:
    """llama.cpp's /tokenize (add_special true) of the reference texts for SmolLM2."""
    data = load_reference("llamacpp-smollm2-135m.json")
    return [(t["text"], t["tokens"]) for t in data["tokenize"] if t.get("add_special")]
