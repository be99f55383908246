"""Tenants in the gateway, in process on a fake backend that keeps a ``speakers`` store: each key's tenant (named by
the keys file, else a digest of the key) sees, speaks with and deletes only its own voices, stored under a scoped
id; the quotas (voices and bytes of prompt audio) per tenant; the public namespace of a gateway without keys."""

from __future__ import annotations

import grpc
import numpy as np
import soundfile as sf
from conftest import FIXTURES
from test_gateway import GOOD, FakeBackend, _client, _openai_error, _RpcError

from cosyvoice_triton.gateway.backend import backend_error
from cosyvoice_triton.gateway.config import from_args
from cosyvoice_triton.gateway.tenants import MAX_VOICE_CHARS, key_tenant

PROMPT = FIXTURES / "prompt_en_3s.wav"
PROMPT_S = sf.info(str(PROMPT)).duration


class StoreBackend(FakeBackend):
    """The fake speech backend with a speakers store (id -> prompt seconds); speech with an unknown voice is
    refused as Triton refuses it (INVALID_ARGUMENT naming the id)."""

    def __init__(self):
        super().__init__()
        self.store: dict[str, float] = {"admin_voice": 1.0}  # one registered on Triton directly

    def _known(self, job):
        if job.voice is not None and getattr(job, "reference_audio", None) is None and job.voice not in self.store:
            raise backend_error(_RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown speaker {job.voice!r}"))

    async def synthesize(self, job, request_id=""):
        self._known(job)
        return await super().synthesize(job, request_id)

    async def stream(self, job, request_id=""):
        self._known(job)
        async for chunk in super().stream(job, request_id):
            yield chunk

    async def convert_stream(self, job, request_id=""):
        self._known(job)
        async for chunk in super().convert_stream(job, request_id):
            yield chunk

    async def voices(self):
        return sorted(self.store)

    async def register_voice(self, voice, wave, sample_rate, text):
        assert len(voice) <= 64 and wave.dtype == np.float32
        self.store[voice] = len(wave) / sample_rate

    async def delete_voice(self, voice):
        del self.store[voice]

    async def voice_seconds(self, voice):
        return self.store[voice]


def _register(client, voice, headers, text="the prompt says hello", audio=None):
    files = {"audio": ("prompt.wav", PROMPT.read_bytes() if audio is None else audio, "audio/wav")}
    return client.post("/v1/audio/voices", data={"id": voice, **({} if text is None else {"text": text})},
                       files=files, headers=headers)


def _ids(client, headers):
    r = client.get("/v1/audio/voices", headers=headers)
    assert r.status_code == 200, r.text
    return [v["id"] for v in r.json()["data"]]


def _bearer(key):
    return {"authorization": f"Bearer {key}"}


def _tenants(tmp_path, *extra, **cfg):
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nacme:sk-a1\nacme:sk-a2\nsk-b\n")
    config = from_args(["--api-key-file", str(keys), *extra])
    assert config.api_keys == {"sk-a1", "sk-a2", "sk-b"}
    assert dict(config.tenants) == {"sk-a1": "acme", "sk-a2": "acme"}
    return _client(StoreBackend(), **{**config.__dict__, **cfg})


def test_keys_file_lines(tmp_path):
    from cosyvoice_triton.gateway.config import read_keys

    f = tmp_path / "keys"
    f.write_text("acme:sk:with:colons\nnot a name:sk-spaced\n  plain  \n# acme:sk-comment\n:sk-no-name\n")
    assert read_keys(f) == {"sk:with:colons": "acme", "not a name:sk-spaced": None, "plain": None,
                            ":sk-no-name": None}


def test_keys_file_names_tenants_and_a_plain_key_is_its_own(tmp_path):
    client, backend = _tenants(tmp_path)
    a1, a2, b = _bearer("sk-a1"), _bearer("sk-a2"), _bearer("sk-b")
    r = _register(client, "alice", a1)
    assert r.status_code == 201, r.text
    assert r.json() == {"id": "alice", "object": "voice", "name": "alice"}
    assert _ids(client, a2) == ["alice"]  # two keys, one tenant
    assert _ids(client, b) == []  # neither acme's voice nor the one registered on Triton directly
    assert _register(client, "alice", b, text=None).status_code == 201
    b_tenant = key_tenant("sk-b")
    assert set(backend.store) == {"admin_voice", "t-acme.alice", f"t-{b_tenant}.alice"}
    assert len(b_tenant) == 12 and "sk-b" not in b_tenant
    assert _ids(client, b) == ["alice"] and _ids(client, a1) == ["alice"]


def test_a_tenant_cannot_speak_with_list_or_delete_anothers_voice(tmp_path):
    client, backend = _tenants(tmp_path)
    a, b = _bearer("sk-a1"), _bearer("sk-b")
    assert _register(client, "alice", a).status_code == 201
    assert client.post("/v1/audio/speech", json=GOOD, headers=a).status_code == 200
    assert backend.jobs[-1].voice == "t-acme.alice"
    for voice in ("alice", "t-acme.alice", "admin_voice"):  # a raw scoped id is just an unknown id of B's
        err = _openai_error(client.post("/v1/audio/speech", json={**GOOD, "voice": voice}, headers=b), 400)
        assert repr(voice) in err["message"] and "t-" + key_tenant("sk-b") not in err["message"], err
    streamed = {**GOOD, "voice": "alice", "stream_format": "audio", "response_format": "pcm"}
    _openai_error(client.post("/v1/audio/speech", json=streamed, headers=b), 400)
    _openai_error(client.post("/inference_sft", data={"tts_text": "Hi.", "spk_id": "alice"}, headers=b), 400)
    source = {"source_wav": ("s.wav", (FIXTURES / "source_en_5s.wav").read_bytes(), "audio/wav")}
    _openai_error(client.post("/inference_vc", data={"spk_id": "alice"}, files=source, headers=b), 400)
    assert client.post("/inference_vc", data={"spk_id": "alice"}, files=source, headers=a).status_code == 200
    assert backend.jobs[-1].voice == "t-acme.alice"
    _openai_error(client.delete("/v1/audio/voices/alice", headers=b), 404, code="voice_not_found")
    _openai_error(client.delete("/v1/audio/voices/t-acme.alice", headers=b), 404, code="voice_not_found")
    assert "t-acme.alice" in backend.store
    r = client.delete("/v1/audio/voices/alice", headers=a)
    assert r.status_code == 200 and r.json() == {"id": "alice", "object": "voice.deleted", "deleted": True}
    assert "t-acme.alice" not in backend.store and _ids(client, a) == []


def test_voice_ids_and_bad_registrations(tmp_path):
    client, backend = _tenants(tmp_path)
    a = _bearer("sk-a1")
    longest = "v" * MAX_VOICE_CHARS
    assert _register(client, longest, a).status_code == 201
    assert max(len(v) for v in backend.store) <= 64
    _openai_error(_register(client, longest + "v", a), 400, param="id")
    _openai_error(_register(client, ".hidden", a), 400, param="id")
    _openai_error(_register(client, "x", a, audio=b"not audio at all"), 400, code="invalid_audio", param="audio")
    _openai_error(_register(client, "x", a, text="  "), 400, param="text")
    _openai_error(client.post("/v1/audio/voices", data={"id": "x"}, headers=a), 400)
    _openai_error(_register(client, "x", {}), 401)
    assert _ids(client, a) == [longest]


def test_quota_of_voices_per_tenant(tmp_path):
    client, _ = _tenants(tmp_path, "--max-voices-per-tenant", "2")
    a, b = _bearer("sk-a1"), _bearer("sk-b")
    assert [_register(client, v, b).status_code for v in ("one", "two")] == [201, 201]
    err = _openai_error(_register(client, "three", b), 403, code="voice_quota_exceeded")
    assert "at most 2" in err["message"]
    assert _register(client, "two", b).status_code == 201  # replacing one of its own is not one more
    assert _register(client, "one", a).status_code == 201  # another tenant's quota is its own
    assert _ids(client, b) == ["one", "two"] and _ids(client, a) == ["one"]
    assert client.delete("/v1/audio/voices/one", headers=b).status_code == 200
    assert _register(client, "three", b).status_code == 201


def test_quota_of_prompt_bytes_per_tenant(tmp_path):
    budget = int(1.5 * PROMPT_S * 32_000)  # one prompt fits, two do not
    client, _ = _tenants(tmp_path, "--max-voice-bytes-per-tenant", str(budget))
    a, b = _bearer("sk-a1"), _bearer("sk-b")
    assert _register(client, "one", b).status_code == 201
    err = _openai_error(_register(client, "two", b), 403, code="voice_quota_exceeded", param="audio")
    assert "MB" in err["message"]
    assert _register(client, "one", b).status_code == 201  # a replacement counts instead of the old prompt
    assert _register(client, "one", a).status_code == 201


def test_without_keys_one_public_namespace():
    client, backend = _client(StoreBackend())
    assert _register(client, "alice", {}).status_code == 201
    assert _register(client, "p" * 64, {}).status_code == 201  # unscoped: the store's own limit
    _openai_error(_register(client, "p" * 65, {}), 400, param="id")
    del backend.store["p" * 64]
    backend.store["t-acme.secret"] = 1.0  # a tenant's voice, from a gateway with keys on the same Triton
    assert _ids(client, {}) == ["admin_voice", "alice"]
    assert set(backend.store) == {"admin_voice", "alice", "t-acme.secret"}
    assert client.post("/v1/audio/speech", json={**GOOD, "voice": "admin_voice"}).status_code == 200
    _openai_error(client.post("/v1/audio/speech", json={**GOOD, "voice": "t-acme.secret"}), 400,
                  code="voice_not_found")
    _openai_error(_register(client, "t-acme.secret", {}), 400, param="id")
    _openai_error(client.delete("/v1/audio/voices/t-acme.secret"), 400)
    assert "t-acme.secret" in backend.store

