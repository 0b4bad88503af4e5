"""The chat page's serving (falcon.testing, the fake engine): its files public (the page asks for the key),
with the strict CSP; `--no-webui` turns it off; `/conversations` answers 501 without a session store and is
behind the API key and the Origin rule. The page and the API with a real server and a browser:
tests/e2e/test_webui.py."""

from __future__ import annotations

import pytest
from strata_server.webui import ASSETS, CSP

from .checks import assert_error


@pytest.mark.parametrize("path", sorted(ASSETS))
def test_page_files_are_public_with_the_csp(make_api, path):
    client, _, _ = make_api(api_key=["k"])
    result = client.simulate_get(path)
    assert result.status_code == 200
    assert result.headers["Content-Security-Policy"] == CSP
    assert result.headers["X-Content-Type-Options"] == "nosniff"
    assert result.headers["Content-Type"] == ASSETS[path].media
    assert result.content


def test_no_webui(make_api):
    client, _, _ = make_api(webui=False)
    assert client.simulate_get("/").status_code == 404
    assert client.simulate_get("/webui/app.js").status_code == 404


def test_conversations_without_a_store(make_api):
    client, _, _ = make_api(api_key=["k"])
    assert_error(client.simulate_get("/conversations"), 401, "authentication_error", "Invalid API Key")
    key = {"Authorization": "Bearer k"}
    result = client.simulate_get("/conversations", headers=key)
    assert result.status_code == 501 and "--cache-disk" in result.json["error"]["message"]
    foreign = client.simulate_get("/conversations", headers={**key, "Origin": "http://evil.example"})
    assert foreign.status_code == 403
