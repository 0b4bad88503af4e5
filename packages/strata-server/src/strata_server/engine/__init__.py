"""The engine side of the server: the client interface, one child process, its supervisor."""

from .client import EngineClient, EngineLease, EngineState, EngineStatus, engine_call
from .supervisor import EngineSupervisor, RestartPolicy, SupervisorSettings

__all__ = [
    "EngineClient",
    "EngineLease",
    "EngineState",
    "EngineStatus",
    "engine_call",
    "EngineSupervisor",
    "RestartPolicy",
    "SupervisorSettings",
]
