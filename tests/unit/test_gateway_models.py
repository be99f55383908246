"""OpenAI's ``GET /v1/models`` at the gateway (``gateway/model_list.py``), in process: the names ``model`` accepts,
in OpenAI's list format (checked by the OpenAI SDK's own types), behind the key."""

from __future__ import annotations

import time

import openai
import pytest
from test_gateway import GOOD, _client, _openai_error

KEY = {"authorization": "Bearer sk-a"}


def test_the_list_is_what_model_accepts_in_openais_format():
    t0 = int(time.time())
    client, _ = _client(api_keys=frozenset({"sk-a"}), models=("cosyvoice2", "tts-1"))
    r = client.get("/v1/models", headers=KEY)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"object", "data"} and body["object"] == "list"
    models = [openai.types.Model.model_validate(m) for m in body["data"]]
    assert [m.id for m in models] == ["cosyvoice2", "tts-1"]
    assert all(set(m) == {"id", "object", "created", "owned_by"} for m in body["data"])
    assert all(m.object == "model" and t0 - 1 <= m.created <= time.time() and m.owned_by for m in models)
    for m in models:  # each listed name is one /v1/audio/speech accepts
        assert client.post("/v1/audio/speech", json={**GOOD, "model": m.id}, headers=KEY).status_code == 200
    _openai_error(client.post("/v1/audio/speech", json={**GOOD, "model": "tts-1-hd"}, headers=KEY), 400,
                  code="model_not_found")
    one = client.get("/v1/models/tts-1", headers=KEY)
    assert one.status_code == 200 and one.json() == body["data"][1]
    _openai_error(client.get("/v1/models/tts-1-hd", headers=KEY), 404, code="model_not_found", param="model")


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-nope"}])
def test_behind_the_key(headers):
    client, _ = _client(api_keys=frozenset({"sk-a"}))
    for path in ("/v1/models", "/v1/models/cosyvoice2"):
        _openai_error(client.get(path, headers=headers), 401, code="invalid_api_key")


def test_open_without_keys_and_the_default_names():
    client, _ = _client()
    r = client.get("/v1/models")
    assert [m["id"] for m in r.json()["data"]] == ["cosyvoice2", "tts-1", "tts-1-hd", "gpt-4o-mini-tts"]
