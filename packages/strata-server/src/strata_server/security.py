"""Request checks that run before any resource: Host, CORS/OPTIONS, loading 503, API key;
and the extra rules for slot actions (JSON Content-Type, no foreign Origin).

Order as the peer (tools/server/server-http.cpp), with the Host check first: Host -> OPTIONS
short-circuit (no auth) -> 503 while the engine is not ready -> API key.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

import falcon

from .config import LOOPBACK_HOSTS, ServerConfig
from .engine.client import EngineClient, EngineState
from .errors import ApiError, EngineUnavailable, ErrorType
from .webui import WEBUI_PATHS

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
# The page and its two files are read without a key (it asks for one; llama-server b11549 exempts its page too)
# and while the engine loads; the page's own requests carry the user's key. Any other method needs the key.
PAGE_PATHS = WEBUI_PATHS
PAGE_METHODS = frozenset({"GET", "HEAD"})
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_ANY = "*"  # --cors-origins value: any origin, never with credentials (Strata's default)
CORS_LOCALHOST = (
    "localhost"  # --cors-origins value: origins on a loopback host, any scheme and port (the peer's)
)
_WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})


def split_host_header(value: str) -> str:
    """The host name of a Host header (``[::1]:8080`` -> ``::1``, ``Example.COM.:80`` -> ``example.com``)."""
    value = value.strip().lower()
    if value.startswith("["):
        host = value[1 : value.index("]")] if "]" in value else value[1:]
    elif value.count(":") == 1:
        host = value.split(":", 1)[0]
    else:
        host = value
    return host.rstrip(".")


class SecurityPolicy:
    """What the config allows, computed once."""

    def __init__(self, config: ServerConfig) -> None:
        self.any_host = "*" in config.allowed_hosts
        hosts = set(LOOPBACK_HOSTS) | {h.lower().strip("[]").rstrip(".") for h in config.allowed_hosts}
        hosts |= {h.lower().strip("[]") for h in config.host if h not in _WILDCARD_BINDS}
        self.allowed_hosts = frozenset(hosts)
        self.api_keys = tuple(k.encode() for k in config.api_keys())
        self.trusted_origins = frozenset(o.lower().rstrip("/") for o in config.trusted_origins)
        self.cors_wildcard = CORS_ANY in config.cors_origins
        self.cors_localhost = CORS_LOCALHOST in config.cors_origins
        self.cors_origins = frozenset(
            o.lower().rstrip("/") for o in config.cors_origins if o not in (CORS_ANY, CORS_LOCALHOST)
        )

    def cors_listed(self, origin: str | None) -> bool:
        """An Origin configured by name (or a loopback one with ``localhost``): answered as the peer does."""
        if not origin:
            return False
        origin = origin.strip().lower().rstrip("/")
        if origin in self.cors_origins:
            return True
        try:
            host = urlsplit(origin).hostname
        except ValueError:
            return False
        return self.cors_localhost and host in LOOPBACK_HOSTS

    def host_allowed(self, host_header: str | None) -> bool:
        if not host_header:
            return False
        return self.any_host or split_host_header(host_header) in self.allowed_hosts

    def key_valid(self, req: falcon.Request) -> bool:
        candidates = []
        authorization = req.get_header("Authorization")
        if authorization:
            scheme, _, rest = authorization.strip().partition(" ")
            candidates.append(rest.strip() if scheme.lower() == "bearer" and rest else authorization.strip())
        x_api_key = req.get_header("X-Api-Key")
        if x_api_key:
            candidates.append(x_api_key.strip())
        return any(hmac.compare_digest(c.encode(), k) for c in candidates for k in self.api_keys)

    def origin_trusted(self, req: falcon.Request) -> bool:
        """No Origin, the server's own origin (the Host that passed the check), or a trusted one."""
        origin = req.get_header("Origin")
        if origin is None:
            return True
        origin = origin.strip().lower().rstrip("/")
        own = {
            f"http://{req.get_header('Host', default='').strip().lower()}",
            f"https://{req.get_header('Host', default='').strip().lower()}",
        }
        return origin in own or origin in self.trusted_origins


class SecurityMiddleware:
    def __init__(self, policy: SecurityPolicy, engine: EngineClient) -> None:
        self.policy = policy
        self.engine = engine

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        host = req.get_header("Host")
        if not self.policy.host_allowed(host):
            # DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends Host: evil.example.
            raise ApiError(
                ErrorType.PERMISSION,
                f"Invalid Host header: {host!r} is not an allowed host "
                "(loopback names, the bound address, --allowed-hosts)"
                if host
                else "Missing Host header",
            )
        if req.method == "OPTIONS":
            resp.status = 200
            resp.set_header("Access-Control-Allow-Methods", CORS_METHODS)
            requested = req.get_header("Access-Control-Request-Headers")
            listed = self.policy.cors_listed(req.get_header("Origin"))
            resp.set_header("Access-Control-Allow-Headers", "*" if listed or not requested else requested)
            resp.set_header("Access-Control-Max-Age", "600")
            resp.content_length = 0
            resp.complete = True
            return
        public = req.path in PUBLIC_PATHS or (req.path in PAGE_PATHS and req.method in PAGE_METHODS)
        if not public and self.engine.status().state is not EngineState.READY:
            status = self.engine.status()
            raise EngineUnavailable(status.message if status.state is EngineState.FAILED else "Loading model")
        if self.policy.api_keys and not public and not self.policy.key_valid(req):
            raise ApiError(ErrorType.AUTHENTICATION, "Invalid API Key")

    def process_response(
        self, req: falcon.Request, resp: falcon.Response, resource: object, req_succeeded: bool
    ) -> None:
        origin = req.get_header("Origin")
        if origin is not None and self.policy.cors_listed(origin):
            # A configured origin gets the peer's answer: echoed, with credentials.
            resp.set_header("Access-Control-Allow-Origin", origin)
            resp.set_header("Access-Control-Allow-Credentials", "true")
            resp.append_header("Vary", "Origin")
        elif self.policy.cors_wildcard:
            # Never credentials with a wildcard (the peer echoes any Origin with credentials on).
            resp.set_header("Access-Control-Allow-Origin", "*")


def check_origin(req: falcon.Request, policy: SecurityPolicy, what: str) -> None:
    """What reads or writes files: refuse cross-site requests a browser can send blindly."""
    if not policy.origin_trusted(req):
        raise ApiError(
            ErrorType.PERMISSION,
            f"Origin {req.get_header('Origin')!r} may not use {what}; "
            "only the server's own origin or one listed in --trusted-origins",
        )


def check_slot_action(req: falcon.Request, policy: SecurityPolicy, *, bodyless_ok: bool = False) -> None:
    """Slot actions write and read files: refuse cross-site requests a browser can send blindly. With
    `bodyless_ok` (erase, which reads no body: llama-server takes it without one) a request with no body at
    all passes the Content-Type rule; a body must still be JSON."""
    check_origin(req, policy, "slot actions")
    check_json_body(req, "slot actions", bodyless_ok=bodyless_ok)


def check_json_body(req: falcon.Request, what: str, *, bodyless_ok: bool = False) -> None:
    """A JSON body: a cross-site form cannot send one without a preflight."""
    media = (req.content_type or "").split(";", 1)[0].strip().lower()
    if bodyless_ok and not media and not req.content_length:
        return
    if media != "application/json":
        raise ApiError(
            ErrorType.INVALID_REQUEST,
            f"{what} need Content-Type: application/json (got {req.content_type or 'none'})",
            status=415,
        )
