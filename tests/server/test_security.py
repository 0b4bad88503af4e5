"""Host, API key, CORS and OPTIONS rules through falcon.testing."""

from __future__ import annotations

import pytest

from .checks import assert_error

REBINDING_HOSTS = [
    "evil.example",
    "evil.example:8080",
    "localhost.evil.example",
    "127.0.0.1.nip.io",
    "127.0.0.1.evil.example:8080",
    "0.0.0.0:8080",
    "[::2]:8080",
    "10.0.0.7",
    "",
]


@pytest.mark.parametrize("host", REBINDING_HOSTS)
def test_foreign_host_refused_on_every_path(make_api, host):
    client, _, _ = make_api()
    for method, path in (
        ("GET", "/health"),
        ("GET", "/props"),
        ("POST", "/completion"),
        ("OPTIONS", "/props"),
    ):
        result = client.simulate_request(method, path, headers={"Host": host}, json={"prompt": "x"})
        error = assert_error(result, 403, "permission_error")
        assert "Host" in error["message"]


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "localhost:8080",
        "LOCALHOST:1",
        "127.0.0.1",
        "127.0.0.1:8080",
        "[::1]:8080",
        "[::1]",
        "localhost.",
    ],
)
def test_loopback_hosts_accepted(make_api, host):
    client, _, _ = make_api()
    assert client.simulate_get("/health", headers={"Host": host}).status_code == 200


def test_bound_address_and_allowed_hosts(make_api):
    client, _, _ = make_api(host="10.1.2.3", allowed_hosts="myhost.lan,Other.Lan")
    for host in ("10.1.2.3:8080", "myhost.lan", "other.lan:80", "localhost:8080"):
        assert client.simulate_get("/health", headers={"Host": host}).status_code == 200, host
    assert client.simulate_get("/health", headers={"Host": "10.1.2.4"}).status_code == 403
    wildcard_bind, _, _ = make_api(host="0.0.0.0")
    assert wildcard_bind.simulate_get("/health", headers={"Host": "0.0.0.0:8080"}).status_code == 403
    anything, _, _ = make_api(allowed_hosts="*")
    assert anything.simulate_get("/health", headers={"Host": "whatever.example"}).status_code == 200


def test_api_key_forms(make_api):
    client, _, _ = make_api(api_key="k1,k2")
    assert_error(client.simulate_get("/props"), 401, "authentication_error", "Invalid API Key")
    for headers in (
        {"Authorization": "Bearer k1"},
        {"Authorization": "k2"},
        {"X-Api-Key": "k1"},
        {"Authorization": "bearer k2"},
    ):
        assert client.simulate_get("/props", headers=headers).status_code == 200, headers
    for headers in (
        {"Authorization": "Bearer nope"},
        {"Authorization": "Bearer"},
        {"X-Api-Key": "k1x"},
        {"Authorization": "Basic azE6"},
    ):
        assert_error(client.simulate_get("/props", headers=headers), 401, "authentication_error")


def test_api_key_public_paths_and_protected_ones(make_api, tmp_path, slot_dir):
    key_file = tmp_path / "keys"
    key_file.write_text("\nfile-key\n", encoding="utf-8")
    client, _, _ = make_api(api_key_file=str(key_file), metrics=True, slot_save_path=str(slot_dir))
    assert client.simulate_get("/health").status_code == 200
    assert client.simulate_get("/v1/health").status_code == 200
    assert client.simulate_options("/completion").status_code == 200
    for method, path in (
        ("GET", "/props"),
        ("GET", "/v1/models"),
        ("GET", "/slots"),
        ("GET", "/metrics"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/completion"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/slots/0?action=erase"),
        ("GET", "/nope"),
        ("POST", "/"),
        ("GET", "/bundle.js"),  # llama-server b11549 answers 401 there too
        ("GET", "/bundle.css"),
    ):
        result = client.simulate_request(method, path, json={})
        assert_error(result, 401, "authentication_error", "Invalid API Key")
    for path in ("/", "/index.html"):  # the web page, exempt as llama-server b11549 exempts it
        assert client.simulate_get(path).status_code != 401, path
    ok = client.simulate_post("/tokenize", json={"content": "a"}, headers={"X-Api-Key": "file-key"})
    assert ok.status_code == 200


def test_slot_action_origin_rules_apply_with_a_key(make_api, slot_dir):
    client, _, _ = make_api(api_key="k", slot_save_path=str(slot_dir))
    headers = {"Authorization": "Bearer k", "Origin": "http://evil.example"}
    result = client.simulate_post(
        "/slots/0", params={"action": "save"}, json={"filename": "a.bin"}, headers=headers
    )
    assert_error(result, 403, "permission_error")


def test_cors_wildcard_without_credentials(make_api):
    client, _, _ = make_api()
    result = client.simulate_get("/health", headers={"Origin": "http://site.example"})
    assert result.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in result.headers
    preflight = client.simulate_options(
        "/v1/chat/completions",
        headers={
            "Origin": "http://site.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200 and preflight.text == ""
    assert preflight.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in preflight.headers
    error = client.simulate_get("/nope", headers={"Origin": "http://site.example"})
    assert error.headers["access-control-allow-origin"] == "*"


def test_cors_listed_origins(make_api):
    client, _, _ = make_api(cors_origins="http://app.example")
    ok = client.simulate_get("/health", headers={"Origin": "http://app.example"})
    assert ok.headers["access-control-allow-origin"] == "http://app.example"
    assert ok.headers["access-control-allow-credentials"] == "true"
    other = client.simulate_get("/health", headers={"Origin": "http://other.example"})
    assert "access-control-allow-origin" not in other.headers
