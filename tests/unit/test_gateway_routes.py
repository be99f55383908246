"""Which routes need the API key when keys are configured (docs/gateway.md's table), each with and without one:
/health and the listening page are open; the KServe routes (``/v2`` itself too) and ``/metrics`` need a key
(``--open-metrics`` leaves ``/metrics`` open for a scraper that cannot send one); FastAPI's docs are off."""

from __future__ import annotations

import pytest
from test_gateway import _client

KEY = {"authorization": "Bearer k1"}



@pytest.mark.parametrize("path", ["/v2", "/v2/", "/v2/health/ready", "/v2/models/cosyvoice_tts", "/metrics"])
def test_keyed_routes_refuse_without_a_key(path):
    client, _ = _client(api_keys=frozenset({"k1"}))
    r = client.get(path)
    assert r.status_code == 401, (path, r.status_code, r.text)
    r = client.get(path, headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401, (path, r.status_code)
    r = client.get(path, headers=KEY)
    assert r.status_code != 401, (path, r.status_code)  # on to the route (here without a Triton behind it)


def test_metrics_with_a_key_and_open_when_asked():
    client, _ = _client(api_keys=frozenset({"k1"}))
    r = client.get("/metrics", headers=KEY)
    assert r.status_code == 200 and "cosyvoice_gateway_" in r.text
    client, _ = _client(api_keys=frozenset({"k1"}), open_metrics=True)
    assert client.get("/metrics").status_code == 200


def test_health_and_page_stay_open():
    client, _ = _client(api_keys=frozenset({"k1"}))
    assert client.get("/health").status_code == 200
    assert client.get("/health", headers=KEY).status_code == 200
    assert client.get("/listen").status_code == 200


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
@pytest.mark.parametrize("keyed", [False, True])
def test_fastapi_docs_are_off(path, keyed):
    client, _ = _client(api_keys=frozenset({"k1"})) if keyed else _client()
    for headers in ({}, KEY):
        assert client.get(path, headers=headers).status_code == 404, path


def test_without_keys_everything_answers_as_before():
    client, _ = _client()
    assert client.get("/metrics").status_code == 200
    assert client.get("/health").status_code == 200
