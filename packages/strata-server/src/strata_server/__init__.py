"""strata-server: llama-server's HTTP API (Falcon under gunicorn) over a supervised Strata engine."""

from .app import create_app
from .config import ConfigError, ServerConfig, build_config
from .errors import ServerError

__all__ = ["create_app", "ServerConfig", "build_config", "ConfigError", "ServerError"]
