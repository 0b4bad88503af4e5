"""``GET /``: the chat page (llama-server's web UI's place; `--no-webui` turns it off). Files are read once from
the package, served with a strict Content-Security-Policy (webui.py)."""

from __future__ import annotations

from importlib import resources

import falcon

from ..context import ServerContext
from ..webui import ASSETS, HEADERS


def load_assets() -> dict[str, bytes]:
    static = resources.files("strata_server") / "static"
    return {asset.file: (static / asset.file).read_bytes() for asset in ASSETS.values()}


class WebUiResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.files = load_assets()

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        asset = ASSETS[req.path]
        resp.content_type = asset.media
        resp.set_headers(HEADERS)
        resp.data = self.files[asset.file]
