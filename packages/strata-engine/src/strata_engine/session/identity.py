"""The engine's identity for session files: which model files it loaded (by role) and the config mapping
whose canonical JSON is the config fingerprint.

The config mapping names everything that changes the meaning of the K/V bytes in a file: the engine and
its version, the backend, the K/V storage type (and int8's scale block), the context limit, the model's
K/V shape, the resolved RoPE per layer (style, base, rotated dims, sliding window), the digest of loaded
adapters / control vectors (this engine loads none: a fixed value), and the arithmetic switches
(compute dtype). It deliberately leaves out what does not change those bytes: the placement
(`--kv-resident`), the prompt cache, the prefill chunk, the number of checkpoints kept, the CPU kernels
(`--cpu-kernels`: both compute in f32 and store the same K/V encoding) and the threads, so a file saved
with one placement or kernel choice restores under another.
"""

from __future__ import annotations

from typing import Any

from strata_sessionfile import EngineIdentity, config_fingerprint, model_fingerprint

from ..protocol import ENGINE_NAME, engine_version

# Version of what this adapter puts in the file beyond the format (engine_fields, checkpoint data).
SESSION_LAYOUT_VERSION = 1
# No LoRA adapter or control vector is loaded (this engine cannot load any yet): a fixed digest, so a
# future engine that loads one writes a different value and its files are refused here, and vice versa.
NO_ADAPTERS_DIGEST = "none"
MODEL_ROLE = "model"


def model_files(runner: Any) -> list[tuple[str, str]]:
    """Every file the runner loaded, by role, in load order (one GGUF file; no adapters)."""
    return [(MODEL_ROLE, str(runner.settings.model_path))]


def config_mapping(runner: Any, *, engine_version_override: str | None = None) -> dict[str, Any]:
    settings, config = runner.settings, runner.config
    return {
        "engine": ENGINE_NAME,
        "engine_version": engine_version_override or engine_version(),
        "session_layout": SESSION_LAYOUT_VERSION,
        "backend": str(settings.backend),  # the plain word (a file's mapping, read back, holds str)
        "kv_type": str(settings.kv_type),
        "kv_int8_scale_block": runner.kv_geometry.scale_block,
        "n_ctx": runner.n_ctx,
        "architecture": config.architecture,
        "n_layer": config.n_layer,
        "n_head_kv": config.n_head_kv,
        "head_dim": config.head_dim,
        "rope": config.rope_fingerprint(),
        "adapters_digest": NO_ADAPTERS_DIGEST,
        "arithmetic": {"compute_dtype": str(settings.compute_dtype)},
    }


def runner_identity(runner: Any, *, engine_version_override: str | None = None) -> EngineIdentity:
    """The runner's model and config identity (the model fingerprint samples the GGUF file: fast)."""
    return EngineIdentity(
        model_fingerprint(model_files(runner)),
        config_fingerprint(config_mapping(runner, engine_version_override=engine_version_override)),
    )
