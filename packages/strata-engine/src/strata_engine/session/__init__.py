"""The engine's session adapter: a conversation written to one session file and read back.

* `EngineSession` (adapter.py): strata_sessionfile's SessionSource / SessionTarget / StagingTarget over
  a `ModelRunner`'s K/V pool and running state, with the gate, the residency refill and fail-stop.
* fields.py: the engine fields and checkpoint bytes a file carries beside the K/V.
* buffers.py: the host memory saves and restores work in (block buffers, a host staging area).
* identity.py: the model files by role and the config mapping behind the config fingerprint.
* verbs.py: the serve protocol's `SAVE <path>` / `RESTORE <path>` handlers (`register_session_verbs`),
  `SessionOptions` (restore mode auto|staged|streaming, block size, the test-only fault point from
  ``STRATA_ENGINE_SESSION_FAULT``).

In-process use::

    session = EngineSession(runner)                       # or with SamplerAccess.of_completer(completer)
    strata_sessionfile.save(path, session)
    strata_sessionfile.restore(path, EngineSession(other_runner), mode="auto")
"""

from .adapter import EngineSession, FaultPoint, SamplerAccess
from .buffers import BlockBufferCache
from .identity import config_mapping, model_files, runner_identity
from .verbs import FAULT_ENV, SessionOptions, SessionVerbs, register_session_verbs

__all__ = [
    "FAULT_ENV",
    "BlockBufferCache",
    "EngineSession",
    "FaultPoint",
    "SamplerAccess",
    "SessionOptions",
    "SessionVerbs",
    "config_mapping",
    "model_files",
    "register_session_verbs",
    "runner_identity",
]
