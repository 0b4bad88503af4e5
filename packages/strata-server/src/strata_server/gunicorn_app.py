"""gunicorn entry: one worker (gthread whose requests are read by its event loop: worker.py) that owns
the engine process. Its threads serve many requests at once: each slot's request on a thread of its own
(the engine batches them), slot-less ones (tokenize, props, ...) beside them; one worker, because the
engine and its slots belong to one process, and threads, because a request's work is waiting on the
engine's lines (the GIL is free meanwhile) and the blocking code stays as it is.

The supervisor starts in the worker (``load`` runs there, after the fork), so the engine is a child
of the process that talks to it. ``worker_exit`` QUITs the engine on any worker shutdown (SIGTERM:
graceful, in-flight requests first; SIGINT/SIGQUIT: quick). If the engine cannot start at all
(bad settings, unloadable model) the worker exits with gunicorn's boot-error status, which stops
the server with that message instead of restarting in a loop.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from gunicorn.app.base import BaseApplication

from .app import create_app
from .config import ServerConfig
from .context import ServerContext
from .engine.supervisor import EngineSupervisor, SupervisorSettings
from .security import SecurityPolicy
from .store import SessionStore, build_store
from .store.trust import StoreFolderRefused
from .wsgi import with_peer_header_case

log = logging.getLogger("strata_server")
WORKER_BOOT_ERROR = 3  # gunicorn's Arbiter.WORKER_BOOT_ERROR: the arbiter halts with this status


def _worker_exit(server: Any, worker: Any) -> None:
    store = getattr(worker.app, "store", None)
    if store is not None:
        log.info("saving the slots' conversations to the session store")
        store.shutdown()
    supervisor = getattr(worker.app, "supervisor", None)
    if supervisor is not None:
        log.info("stopping the engine (QUIT)")
        supervisor.stop()


def _give_up(message: str) -> None:
    sys.stderr.write(f"strata-server: {message}\n")
    sys.stderr.flush()
    os._exit(WORKER_BOOT_ERROR)


class StrataGunicorn(BaseApplication):
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.supervisor: EngineSupervisor | None = None
        self.store: SessionStore | None = None
        super().__init__()

    def load_config(self) -> None:
        config = self.config
        settings = {
            "bind": config.binds(),
            "workers": 1,  # the worker owns the one engine process
            "worker_class": "strata_server.worker.StrataWorker",
            "threads": config.http_threads,
            "timeout": config.timeout,
            "graceful_timeout": 30,
            "keepalive": 5,
            "preload_app": False,
            "proc_name": "strata-server",
            "loglevel": config.effective_log_level(),
            "errorlog": "-",
            "worker_exit": _worker_exit,
            # gunicorn's control socket (one shared path under $HOME) is not needed: no runtime
            # reconfiguration, and two servers on one machine must not fight over it.
            "control_socket_disable": True,
        }
        for key, value in settings.items():
            if key in self.cfg.settings:  # control_socket_disable exists from gunicorn 24 on
                self.cfg.set(key, value)

    def load(self) -> Any:
        logging.basicConfig(
            level=self.config.effective_log_level().upper(),
            stream=sys.stderr,
            format="%(asctime)s [%(process)d] [%(levelname)s] %(name)s: %(message)s",
        )
        settings = SupervisorSettings(
            slot_wait_s=self.config.slot_wait,
            command_timeout_s=self.config.engine_timeout or None,
            n_slots=self.config.engine.n_slots,
            slot_prompt_similarity=self.config.slot_prompt_similarity,
        )
        self.supervisor = EngineSupervisor(self.config.engine_argv(), settings=settings, on_give_up=_give_up)
        self.store = build_store(self.config, self.supervisor)
        context = ServerContext(
            engine=self.supervisor, config=self.config, policy=SecurityPolicy(self.config), store=self.store
        )
        app = create_app(self.supervisor, self.config, context=context)
        self.supervisor.start()
        if self.store is not None:
            try:
                self.store.start()  # scans the folder once the engine is ready
            except StoreFolderRefused as exc:
                self.supervisor.stop()
                _give_up(str(exc))
        return with_peer_header_case(app)
