"""The chat page's files (`GET /`, shipped in the wheel under static/, no build step) and the headers they are
served with. A leaf: the security middleware reads WEBUI_PATHS, resources/webui.py serves ASSETS."""

from __future__ import annotations

import attrs


@attrs.frozen
class Asset:
    file: str  # under strata_server/static/
    media: str


ASSETS: dict[str, Asset] = {
    "/": Asset("index.html", "text/html; charset=utf-8"),
    "/index.html": Asset("index.html", "text/html; charset=utf-8"),
    "/webui/app.js": Asset("app.js", "text/javascript; charset=utf-8"),
    "/webui/style.css": Asset("style.css", "text/css; charset=utf-8"),
}
WEBUI_PATHS = frozenset(ASSETS)

# No inline script or style, nothing from another origin, no plugins, no framing, no form posts.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS: dict[str, str] = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
