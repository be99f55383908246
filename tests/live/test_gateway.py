"""The gateway (``cosyvoice_triton.gateway``) in process, on a fake speech backend: OpenAI's speech API, the error
shape, Triton's status codes, and every limit (body size incl. chunked bodies, JSON depth, compressed bodies, API
keys, per-key concurrency and rate, request ids, CORS, metrics). Framing (Content-Length with Transfer-Encoding)
needs a real HTTP parser: a uvicorn server on a free port, raw sockets."""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import json
import socket
import threading
import time

import grpc
import httpx2 as httpx
import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, wait_until
from standin_gateway import served_in_thread
from starlette.testclient import TestClient

from cosyvoice_triton.gateway import GatewayConfig, create_app
from cosyvoice_triton.gateway import audio as gw_audio
from cosyvoice_triton.gateway.backend import ConversionJob, SpeechJob, backend_error
from cosyvoice_triton.gateway.config import from_args
from cosyvoice_triton.gateway.limits import json_depth

SR = 24000
GOOD = {"model": "cosyvoice2", "input": "Hello there.", "voice": "alice", "response_format": "wav"}


class _RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def _wave(n: int, k: int = 0) -> np.ndarray:
    t = np.arange(n) / SR
    return (0.3 * np.sin(2 * np.pi * (220 + 55 * k) * t)).astype(np.float32)


def _bare(voice: str | None) -> str | None:
    """A voice id without its tenant's scope (``t-<tenant>.``): the faults below are the user's ids."""
    return voice.split(".", 1)[1] if voice and voice.startswith("t-") else voice


class FakeBackend:
    """Speaks a sine per chunk; ``voice`` picks a fault: ``unknown`` -> INVALID_ARGUMENT, ``busy`` -> UNAVAILABLE,
    ``broken`` -> INTERNAL, ``late-fault`` -> INVALID_ARGUMENT after the first chunk. ``hold`` (an asyncio-free
    threading.Event) keeps a request in flight until set; ``entered`` counts requests inside."""

    CHUNKS = 3

    def __init__(self):
        self.jobs: list[SpeechJob] = []
        self.request_ids: list[str] = []
        self.hold: threading.Event | None = None
        self.entered = 0
        self.closed_streams = 0

    def _fault(self, job: SpeechJob, stage: str):
        faults = {"unknown": grpc.StatusCode.INVALID_ARGUMENT, "busy": grpc.StatusCode.UNAVAILABLE,
                  "broken": grpc.StatusCode.INTERNAL}
        voice = _bare(job.voice)
        if stage == "start" and voice in faults:
            raise backend_error(_RpcError(faults[voice], f"fault {job.voice}"))
        if stage == "late" and voice == "late-fault":
            raise backend_error(_RpcError(grpc.StatusCode.INVALID_ARGUMENT, "late fault"))

    async def _held(self):
        self.entered += 1
        try:
            while self.hold is not None and not self.hold.is_set():
                await asyncio.sleep(0.01)
        finally:
            self.entered -= 1

    async def synthesize(self, job: SpeechJob, request_id: str = ""):
        self.jobs.append(job)
        self.request_ids.append(request_id)
        await self._held()
        self._fault(job, "start")
        return np.concatenate([_wave(4800, k) for k in range(self.CHUNKS)]), SR

    async def stream(self, job: SpeechJob, request_id: str = ""):
        self.jobs.append(job)
        self.request_ids.append(request_id)
        try:
            self._fault(job, "start")
            for k in range(self.CHUNKS):
                if k == 1:
                    self._fault(job, "late")
                    await self._held()
                yield _wave(4800, k), SR
        finally:
            self.closed_streams += 1

    async def convert_stream(self, job: ConversionJob, request_id: str = ""):
        self.jobs.append(job)
        self.request_ids.append(request_id)
        try:
            if _bare(job.voice) in ("unknown", "busy", "broken"):
                self._fault(job, "start")
            for k in range(self.CHUNKS):
                yield _wave(4800, k), SR
        finally:
            self.closed_streams += 1

    async def voices(self):
        return ["alice", "bob"]

    async def ready(self):
        return True

    async def close(self):
        pass


def _client(backend=None, **cfg):
    backend = backend or FakeBackend()
    return TestClient(create_app(GatewayConfig(**cfg), backend), raise_server_exceptions=False), backend


def _openai_error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


# ------------------------------------------------------------------------------------------------ speech API


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
def test_whole_file_formats_decode_to_the_backends_audio(fmt):
    client, backend = _client()
    r = client.post("/v1/audio/speech", json={**GOOD, "response_format": fmt})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == gw_audio.CONTENT_TYPES[fmt]
    got, sr = sf.read(io.BytesIO(r.content), dtype="float32")
    want = np.concatenate([_wave(4800, k) for k in range(3)])
    assert sr == SR
    if fmt in ("wav", "flac"):  # lossless at 16 bits: the same samples as pcm
        np.testing.assert_array_equal(sf.read(io.BytesIO(r.content), dtype="int16")[0], gw_audio.pcm16(want))
    else:  # lossy: the codec's delay and padding; the same tone, louder than silence
        assert abs(len(got) - len(want)) < 0.1 * SR
        assert 0.15 < np.sqrt(np.mean(got ** 2)) < 0.3
    assert backend.jobs[-1] == SpeechJob(text="Hello there.", voice="alice")


def test_pcm_is_raw_16_bit_and_default_format_is_mp3():
    client, _ = _client()
    r = client.post("/v1/audio/speech", json={**GOOD, "response_format": "pcm"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
    pcm = np.frombuffer(r.content, "<i2")
    np.testing.assert_array_equal(pcm, gw_audio.pcm16(np.concatenate([_wave(4800, k) for k in range(3)])))
    r = client.post("/v1/audio/speech", json={k: v for k, v in GOOD.items() if k != "response_format"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    assert sf.info(io.BytesIO(r.content)).format == "MP3"


def test_extras_reach_the_backend():
    client, backend = _client()
    ref = (FIXTURES / "prompt_en_3s.wav").read_bytes()
    r = client.post("/v1/audio/speech", json={**GOOD, "voice": {"id": "ignored"}, "seed": 7,
                                              "reference_audio": base64.b64encode(ref).decode(),
                                              "reference_text": "the prompt", "instructions": "Speak slowly."})
    assert r.status_code == 200, r.text
    job = backend.jobs[-1]
    assert job.reference_audio == ref and job.reference_text == "the prompt" and job.seed == 7
    assert job.instruct == "Speak slowly.<|endofprompt|>"
    r = client.post("/v1/audio/speech", json={**GOOD, "voice": {"id": "bob"},
                                              "reference_audio": "data:audio/wav;base64,"
                                              + base64.b64encode(ref).decode()})
    assert r.status_code == 200 and backend.jobs[-1].reference_audio == ref and backend.jobs[-1].voice == "bob"


def test_speed_reaches_the_backend_for_whole_answers():
    client, backend = _client()
    for speed in (0.25, 1.5, 4.0):
        assert client.post("/v1/audio/speech", json={**GOOD, "speed": speed}).status_code == 200
        assert backend.jobs[-1].speed == speed
    assert client.post("/v1/audio/speech", json=GOOD).status_code == 200 and backend.jobs[-1].speed == 1.0
    r = client.post("/v1/audio/speech", json={**GOOD, "speed": 1.5, "stream_format": "audio"})
    assert "only whole answers" in _openai_error(r, 400, param="speed")["message"]
    stream = client.post("/v1/audio/speech", json={**GOOD, "speed": 1.0, "stream_format": "audio"})
    assert stream.status_code == 200 and backend.jobs[-1].speed == 1.0


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3", "opus"])
def test_stream_audio_is_sent_as_produced(fmt):
    backend = FakeBackend()
    backend.hold = threading.Event()
    client, _ = _client(backend)
    want = np.concatenate([_wave(4800, k) for k in range(3)])
    with client.stream("POST", "/v1/audio/speech", json={**GOOD, "response_format": fmt,
                                                         "stream_format": "audio"}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == gw_audio.CONTENT_TYPES[fmt]
        assert "content-length" not in r.headers
        parts = r.iter_bytes()
        first = next(parts)  # the first chunk arrived while the backend still holds the second
        assert first and not backend.hold.is_set()
        wait_until(lambda: backend.entered == 1, "the stream waiting in the backend for its second chunk")
        backend.hold.set()
        data = first + b"".join(parts)
    if fmt == "pcm":
        np.testing.assert_array_equal(np.frombuffer(data, "<i2"), gw_audio.pcm16(want))
        return
    got, sr = sf.read(io.BytesIO(data), dtype="float32", frames=len(want) + SR if fmt == "wav" else -1)
    assert sr == SR
    if fmt == "wav":
        np.testing.assert_allclose(got, want, atol=1.0 / 32767 + 1e-6)
    else:
        assert abs(len(got) - len(want)) < 0.1 * SR and 0.15 < np.sqrt(np.mean(got ** 2)) < 0.3


def test_stream_sse_events():
    client, _ = _client()
    r = client.post("/v1/audio/speech", json={**GOOD, "response_format": "pcm", "stream_format": "sse"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * 3 + ["speech.audio.done"]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    np.testing.assert_array_equal(np.frombuffer(pcm, "<i2"),
                                  gw_audio.pcm16(np.concatenate([_wave(4800, k) for k in range(3)])))
    assert set(events[-1]["usage"]) == {"input_tokens", "output_tokens", "total_tokens"}


def test_stream_errors_before_and_after_the_first_chunk():
    client, backend = _client()
    for fmt in ("audio", "sse"):  # before any audio: the status code of the refusal
        r = client.post("/v1/audio/speech", json={**GOOD, "voice": "unknown", "stream_format": fmt})
        _openai_error(r, 400)
        _openai_error(client.post("/v1/audio/speech", json={**GOOD, "voice": "busy", "stream_format": fmt}), 503)
    r = client.post("/v1/audio/speech", json={**GOOD, "voice": "late-fault", "stream_format": "sse",
                                              "response_format": "pcm"})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta", "error"]
    assert events[-1]["error"]["message"] == "late fault"
    assert backend.closed_streams == 5
    assert client.post("/v1/audio/speech", json=GOOD).status_code == 200


def test_voices_health_and_metrics():
    client, _ = _client()
    assert [v["id"] for v in client.get("/v1/audio/voices").json()["data"]] == ["alice", "bob"]
    assert client.get("/health").status_code == 200
    client.post("/v1/audio/speech", json={**GOOD, "input": ""})
    text = client.get("/metrics").text
    assert 'cosyvoice_gateway_requests_total{route="/v1/audio/voices",status="200"} 1.0' in text
    assert 'cosyvoice_gateway_requests_total{route="/v1/audio/speech",status="400"} 1.0' in text


@pytest.mark.parametrize(("body", "param"), [
    ({**GOOD, "input": "  "}, "input"),
    ({**GOOD, "input": "x" * 5000}, "input"),
    ({**GOOD, "model": "whisper-1"}, "model"),
    ({**GOOD, "speed": 1.5, "stream_format": "audio"}, "speed"),
    ({**GOOD, "speed": 0.5, "stream_format": "sse"}, "speed"),
    ({**GOOD, "speed": 9}, "speed"),
    ({**GOOD, "speed": 0.2}, "speed"),
    ({**GOOD, "response_format": "aac"}, "response_format"),
    ({**GOOD, "response_format": "flac", "stream_format": "audio"}, "response_format"),
    ({**GOOD, "stream_format": "chunks"}, "stream_format"),
    ({k: v for k, v in GOOD.items() if k != "voice"}, "voice"),
    ({k: v for k, v in GOOD.items() if k != "input"}, "input"),
    ({**GOOD, "reference_text": "no audio"}, "reference_text"),
    ({**GOOD, "reference_audio": "not base64!"}, "reference_audio"),
    ({**GOOD, "seed": -1}, "seed"),
    ({**GOOD, "temperature": 0.3}, "temperature"),
    ({**GOOD, "input": ["a list"]}, "input"),
    ({**GOOD, "voice": 12}, "voice"),
    ({**GOOD, "voice": {"name": "alice"}}, "voice"),
])
def test_bad_requests_are_400_naming_the_field(body, param):
    client, backend = _client()
    _openai_error(client.post("/v1/audio/speech", json=body), 400, param=param)
    assert backend.jobs == []


def test_bad_json_and_not_an_object():
    client, _ = _client()
    for raw in (b"{", b"\xff\xfe", b"[1, 2]", b'"text"', b""):
        _openai_error(client.post("/v1/audio/speech", content=raw, headers={"content-type": "application/json"}),
                      400)


def test_triton_status_codes_map_by_code_not_text():
    from tritonclient.utils import InferenceServerException

    for code, status in ((grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.UNAVAILABLE, 503),
                         (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 502)):
        for exc in (_RpcError(code, "invalid argument: unavailable"),  # the text says otherwise: ignored
                    InferenceServerException("invalid argument", status=str(code))):
            assert backend_error(exc).status == status, (code, exc)
    assert backend_error(InferenceServerException("no status")).status == 503
    client, _ = _client()
    for voice, status in (("unknown", 400), ("busy", 503), ("broken", 502)):
        err = _openai_error(client.post("/v1/audio/speech", json={**GOOD, "voice": voice}), status)
        assert "fault" in err["message"]


# ------------------------------------------------------------------------------------------------- limits


def test_body_size_limit_content_length_and_chunked():
    client, backend = _client(max_body_bytes=2000)
    big = json.dumps({**GOOD, "input": "x" * 3000}).encode()
    _openai_error(client.post("/v1/audio/speech", content=big, headers={"content-type": "application/json"}), 413,
                  code="body_too_large")

    def chunks():
        for i in range(0, len(big), 500):
            yield big[i:i + 500]

    r = client.post("/v1/audio/speech", content=chunks(), headers={"content-type": "application/json"})
    _openai_error(r, 413, code="body_too_large")
    assert backend.jobs == []
    small = json.dumps(GOOD).encode()
    r = client.post("/v1/audio/speech", content=iter([small[:10], small[10:]]))  # chunked, within the limit
    assert r.status_code == 200, r.text


def test_json_depth_limit():
    client, backend = _client(max_json_depth=8)
    deep = {**GOOD, "voice": {"id": "alice"}}
    nested = "[" * 9 + "]" * 9
    raw = json.dumps(deep)[:-1] + f', "x": {nested}}}'
    _openai_error(client.post("/v1/audio/speech", content=raw), 400, code="json_too_deep")
    bomb = "[" * 100000 + "]" * 100000
    _openai_error(client.post("/v1/audio/speech", content=bomb), 400, code="json_too_deep")
    assert backend.jobs == []
    # brackets inside strings do not count; escaped quotes do not end a string
    assert json_depth(json.dumps({"a": "[[[[[[[[[[\\\"{{{{{{", "b": [[1]]}).encode()) == 3
    assert client.post("/v1/audio/speech", json={**GOOD, "input": "[[[[[[[[[[[[ hello"}).status_code == 200


def test_compressed_bodies_are_refused():
    client, backend = _client()
    for enc in ("gzip", "deflate", "br", "gzip, identity"):
        r = client.post("/v1/audio/speech", content=gzip.compress(json.dumps(GOOD).encode()),
                        headers={"content-encoding": enc, "content-type": "application/json"})
        _openai_error(r, 415, code="unsupported_content_encoding")
    assert backend.jobs == []
    r = client.post("/v1/audio/speech", content=json.dumps(GOOD), headers={"content-encoding": "identity"})
    assert r.status_code == 200


def test_api_keys_one_or_a_file(tmp_path):
    client, backend = _client(api_keys=frozenset({"sk-one"}))
    for headers in ({}, {"authorization": "Bearer sk-two"}, {"authorization": "Basic sk-one"},
                    {"authorization": "Bearer "}):
        r = client.post("/v1/audio/speech", json=GOOD, headers=headers)
        _openai_error(r, 401, code="invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
    assert backend.jobs == []
    assert client.post("/v1/audio/speech", json=GOOD, headers={"authorization": "Bearer sk-one"}).status_code == 200
    assert client.get("/v1/audio/voices").status_code == 401
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"authorization": "Bearer sk-one"}).status_code == 200
    keyfile = tmp_path / "keys"
    keyfile.write_text("# gateway keys\nsk-a\n\n  sk-b  \n")
    config = from_args(["--api-key-file", str(keyfile), "--api-key", "sk-c"])
    assert config.api_keys == {"sk-a", "sk-b", "sk-c"}
    client, _ = _client(api_keys=config.api_keys)
    for key in ("sk-a", "sk-b", "sk-c"):
        assert client.get("/v1/audio/voices", headers={"authorization": f"Bearer {key}"}).status_code == 200
    _openai_error(client.get("/v1/audio/voices", headers={"authorization": "Bearer # gateway keys"}), 401)


def test_config_reads_the_environment(monkeypatch):
    monkeypatch.setenv("COSYVOICE_GATEWAY_MAX_BODY_BYTES", "1234")
    monkeypatch.setenv("COSYVOICE_GATEWAY_API_KEY", "sk-env")
    monkeypatch.setenv("COSYVOICE_GATEWAY_CORS_ORIGINS", "https://a.example, https://b.example")
    config = from_args(["--port", "9999", "--rate-limit", "5/second"])
    assert (config.max_body_bytes, config.port, config.rate_limit) == (1234, 9999, "5/second")
    assert config.api_keys == {"sk-env"} and config.cors_origins == ("https://a.example", "https://b.example")


def test_per_key_concurrency_limit():
    backend = FakeBackend()
    backend.hold = threading.Event()
    client, _ = _client(backend, api_keys=frozenset({"sk-a", "sk-b"}), max_concurrency_per_key=1)
    a, b = {"authorization": "Bearer sk-a"}, {"authorization": "Bearer sk-b"}
    out = {}
    t = threading.Thread(target=lambda: out.update(first=client.post("/v1/audio/speech", json=GOOD, headers=a)))
    t.start()
    try:
        wait_until(lambda: backend.entered == 1, "the first request in the backend")
        r = client.post("/v1/audio/speech", json=GOOD, headers=a)
        err = _openai_error(r, 429, code="concurrency_limit_exceeded")
        assert err["type"] == "rate_limit_error" and r.headers["retry-after"]
        other = {}  # another key is not limited by a's request
        t2 = threading.Thread(target=lambda: other.update(r=client.post("/v1/audio/speech", json=GOOD, headers=b)))
        t2.start()
        wait_until(lambda: backend.entered == 2, "the other key's request in the backend")
    finally:
        backend.hold.set()
        t.join(60)
    t2.join(60)
    assert out["first"].status_code == 200 and other["r"].status_code == 200
    assert client.post("/v1/audio/speech", json=GOOD, headers=a).status_code == 200  # the slot came back
    assert 'reason="concurrency_limit_exceeded"' in client.get("/metrics", headers=b).text


def test_streams_hold_their_slot_until_done():
    backend = FakeBackend()
    backend.hold = threading.Event()
    client, _ = _client(backend, max_concurrency_per_key=1)
    stream = {**GOOD, "stream_format": "audio", "response_format": "pcm"}
    with client.stream("POST", "/v1/audio/speech", json=stream) as r:
        parts = r.iter_bytes()
        assert next(parts)
        _openai_error(client.post("/v1/audio/speech", json=GOOD), 429)
    # the client left mid-stream: the backend's stream is closed (cancelled) and the slot comes back
    wait_until(lambda: backend.closed_streams == 1, "the abandoned stream closed")
    backend.hold.set()
    assert client.post("/v1/audio/speech", json=GOOD).status_code == 200
    r = client.post("/v1/audio/speech", json=stream)
    assert r.status_code == 200 and len(r.content) == 3 * 4800 * 2 and backend.closed_streams == 2


def test_per_key_rate_limit():
    client, backend = _client(api_keys=frozenset({"sk-a", "sk-b"}), rate_limit="3/minute")
    a, b = {"authorization": "Bearer sk-a"}, {"authorization": "Bearer sk-b"}
    assert [client.get("/v1/audio/voices", headers=a).status_code for _ in range(3)] == [200] * 3
    r = client.post("/v1/audio/speech", json=GOOD, headers=a)
    _openai_error(r, 429, code="rate_limit_exceeded")
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert backend.jobs == []
    assert client.get("/v1/audio/voices", headers=b).status_code == 200


def test_request_ids_in_header_backend_and_logs(caplog):
    client, backend = _client()
    with caplog.at_level("INFO", logger="cosyvoice_triton.gateway.access"):
        r = client.post("/v1/audio/speech", json=GOOD)
        mine = client.post("/v1/audio/speech", json=GOOD, headers={"x-request-id": "client-id-1"})
        bad = client.post("/v1/audio/speech", json=GOOD, headers={"x-request-id": "no spaces\tor tabs"})
        refused = client.post("/v1/audio/speech", json={**GOOD, "input": ""})
    rid = r.headers["x-request-id"]
    assert len(rid) == 32 and backend.request_ids[0] == rid
    assert mine.headers["x-request-id"] == "client-id-1" and backend.request_ids[1] == "client-id-1"
    assert bad.headers["x-request-id"] != "no spaces\tor tabs" and refused.headers["x-request-id"]
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "cosyvoice_triton.gateway.access"]
    assert sum('"POST /v1/audio/speech" 200' in line for line in lines) == 3
    assert sum('"POST /v1/audio/speech" 400' in line for line in lines) == 1


def test_request_id_filter_puts_the_id_in_every_record(caplog):
    import logging

    from cosyvoice_triton.gateway.middleware import RequestIdFilter

    handler = logging.Handler()
    seen = []
    handler.emit = lambda record: seen.append(record.request_id)
    handler.addFilter(RequestIdFilter())
    logger = logging.getLogger("cosyvoice_triton.gateway")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        client, _ = _client()
        client.post("/v1/audio/speech", json=GOOD, headers={"x-request-id": "rid-42"})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    assert "rid-42" in seen


def test_cors_off_unless_configured():
    client, _ = _client()
    r = client.options("/v1/audio/speech", headers={"origin": "https://a.example",
                                                     "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in client.get("/health", headers={"origin": "https://a.example"}).headers
    client, _ = _client(cors_origins=("https://a.example",), api_keys=frozenset({"sk"}))
    r = client.options("/v1/audio/speech", headers={"origin": "https://a.example",
                                                     "access-control-request-method": "POST",
                                                     "access-control-request-headers": "authorization"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://a.example"
    r = client.post("/v1/audio/speech", json=GOOD, headers={"origin": "https://a.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://a.example"
    r = client.options("/v1/audio/speech", headers={"origin": "https://evil.example",
                                                     "access-control-request-method": "POST"})
    assert r.headers.get("access-control-allow-origin") != "https://evil.example"


def test_unknown_routes_and_methods_in_openai_shape():
    client, _ = _client()
    _openai_error(client.get("/v1/nothing"), 404)
    _openai_error(client.get("/v1/audio/speech"), 405)


# ------------------------------------------------------------------- CosyVoice's own API (official forms)


def _pcm(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/pcm" and r.headers["x-sample-rate"] == str(SR)
    return np.frombuffer(r.content, "<i2")


def test_official_forms_reach_the_backend_as_their_modes():
    client, backend = _client()
    ref = FIXTURES / "prompt_en_3s.wav"
    want, want_sr = sf.read(ref, dtype="float32")
    upload = {"prompt_wav": ("prompt_wav", ref.read_bytes(), "application/octet-stream")}
    pcm = gw_audio.pcm16(np.concatenate([_wave(4800, k) for k in range(3)]))
    for method in ("GET", "POST"):  # the official client sends its forms with GET
        np.testing.assert_array_equal(_pcm(client.request(method, "/inference_sft",
                                                          data={"tts_text": "Hi.", "spk_id": "alice"})), pcm)
        assert backend.jobs[-1] == SpeechJob(text="Hi.", voice="alice")
    cases = [("/inference_zero_shot", {"prompt_text": "the prompt"}, "zero_shot"),
             ("/inference_cross_lingual", {}, "cross_lingual"),
             ("/inference_instruct2", {"instruct_text": "Speak slowly."}, "instruct")]
    for path, fields, mode in cases:
        np.testing.assert_array_equal(_pcm(client.request("GET", path, data={"tts_text": "Hi.", **fields},
                                                          files=upload)), pcm)
        job = backend.jobs[-1]
        assert (job.text, job.mode, job.voice, job.reference_rate) == ("Hi.", mode, None, want_sr)
        np.testing.assert_array_equal(job.reference_audio, want)  # decoded at the file's own rate
        assert job.reference_text == fields.get("prompt_text")
        assert job.instruct == ("Speak slowly.<|endofprompt|>" if mode == "instruct" else None)


def test_voice_conversion_route():
    client, backend = _client()
    src, prompt = FIXTURES / "prompt_en_3s.wav", FIXTURES / "prompt_en_3s.wav"
    files = {"source_wav": ("s.wav", src.read_bytes()), "prompt_wav": ("p.wav", prompt.read_bytes())}
    assert len(_pcm(client.post("/inference_vc", files=files))) == 3 * 4800
    job = backend.jobs[-1]
    assert isinstance(job, ConversionJob) and job.voice is None and job.prompt is not None
    assert job.source_rate == sf.info(src).samplerate and len(job.source) == sf.info(src).frames
    assert len(_pcm(client.post("/inference_vc", files={"source_wav": files["source_wav"]},
                                data={"spk_id": "alice"}))) == 3 * 4800
    assert backend.jobs[-1].voice == "alice" and backend.jobs[-1].prompt is None
    for extra in ({}, {"data": {"spk_id": "alice"}, "files": files}):  # neither voice, or both
        _openai_error(client.post("/inference_vc", **({"files": {"source_wav": files["source_wav"]}} | extra)),
                      400, param="prompt_wav")
    _openai_error(client.post("/inference_vc", files={"source_wav": ("s", b"RIFF not really a wav")},
                              data={"spk_id": "alice"}), 400, code="invalid_audio", param="source_wav")


@pytest.mark.parametrize(("path", "data", "param"), [
    ("/inference_sft", {"spk_id": "alice"}, "tts_text"),
    ("/inference_sft", {"tts_text": "Hi."}, "spk_id"),
    ("/inference_sft", {"tts_text": "   ", "spk_id": "alice"}, "tts_text"),
    ("/inference_sft", {"tts_text": "x" * 5000, "spk_id": "alice"}, "tts_text"),
    ("/inference_zero_shot", {"tts_text": "Hi.", "prompt_text": "p"}, "prompt_wav"),
    ("/inference_zero_shot", {"tts_text": "Hi.", "prompt_wav": "a text field, not a file"}, "prompt_text"),
    ("/inference_instruct2", {"tts_text": "Hi."}, "instruct_text"),
])
def test_official_forms_missing_or_bad_fields_are_400_naming_them(path, data, param):
    client, backend = _client()
    _openai_error(client.post(path, data=data), 400, param=param)
    assert backend.jobs == []


def test_uploads_that_are_not_audio_and_the_instruct_mode_cosyvoice2_lacks():
    client, backend = _client()
    for junk in (b"not audio at all" * 20, b""):
        err = _openai_error(client.post("/inference_cross_lingual", data={"tts_text": "Hi."},
                                        files={"prompt_wav": ("p.wav", junk)}), 400, param="prompt_wav")
        assert err["code"] == "invalid_audio"
    err = _openai_error(client.post("/inference_instruct", data={"tts_text": "Hi.", "spk_id": "alice",
                                                                 "instruct_text": "x"}), 400, code="unsupported_mode")
    assert "/inference_instruct2" in err["message"] and "CosyVoice 1" in err["message"]
    assert backend.jobs == []


def test_official_forms_refusals_and_limits():
    client, _ = _client(max_body_bytes=50_000, api_keys=frozenset({"k"}))
    form = {"tts_text": "Hi.", "spk_id": "unknown"}
    _openai_error(client.post("/inference_sft", data=form), 401)  # the routes are behind the key
    auth = {"authorization": "Bearer k"}
    _openai_error(client.post("/inference_sft", data=form, headers=auth), 400, code="invalid_value")  # INVALID_ARG.
    big = {"prompt_wav": ("p.wav", b"\0" * 60_000)}
    for method in ("GET", "POST"):  # the size limit holds for a GET's body too
        _openai_error(client.request(method, "/inference_cross_lingual", data={"tts_text": "Hi."}, files=big,
                                     headers=auth), 413, code="body_too_large")
    assert len(_pcm(client.post("/inference_sft", data={**form, "spk_id": "alice"}, headers=auth))) == 3 * 4800
    text = client.get("/metrics", headers=auth).text
    assert 'cosyvoice_gateway_requests_total{route="/inference_sft",status="200"} 1.0' in text
    assert 'route="/inference_cross_lingual",status="413"' in text


def test_metrics_append_tritons_when_configured():
    import http.server

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'nv_inference_request_success{model="cosyvoice_tts"} 3'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        client, _ = _client(triton_metrics=url)
        text = client.get("/metrics").text
        assert 'nv_inference_request_success{model="cosyvoice_tts"} 3\n' in text
        assert "cosyvoice_gateway_triton_metrics_up 1.0" in text and "cosyvoice_gateway_requests_total" in text
    finally:
        server.shutdown()
        server.server_close()
    text = client.get("/metrics").text  # Triton's side gone: the gateway's own still answer, marked
    assert "cosyvoice_gateway_triton_metrics_up 0.0" in text and "nv_inference" not in text


# -------------------------------------------------------------------------------- framing, on a real server


@pytest.fixture(scope="module")
def live_gateway():
    backend = FakeBackend()
    with served_in_thread(create_app(GatewayConfig(max_body_bytes=4000), backend), lifespan="off") as port:
        yield port, backend


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        data = b""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                part = s.recv(65536)
            except TimeoutError:
                break
            if not part:
                return data  # the server closed the connection
            data += part
        raise AssertionError(f"the server kept the connection open; got {data[:200]!r}")


def test_ambiguous_framing_is_refused_and_the_connection_closed(live_gateway):
    port, backend = live_gateway
    body = json.dumps(GOOD).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    answer = _raw(port, b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
                        + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # a smuggled second request: never answered
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    assert json.loads(rest[: rest.index(b"}}") + 2])["error"]["code"] == "ambiguous_framing"
    assert answer.count(b"HTTP/1.1") == 1 and backend.jobs == []


def test_chunked_oversize_on_the_wire(live_gateway):
    port, backend = live_gateway
    request = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    request += b"".join(b"3e8\r\n" + b"x" * 1000 + b"\r\n" for _ in range(6)) + b"0\r\n\r\n"
    answer = _raw(port, request)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"body_too_large" in answer and backend.jobs == []
    ok = _raw(port, b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: "
              + str(len(json.dumps(GOOD))).encode() + b"\r\n\r\n" + json.dumps(GOOD).encode())
    assert ok.startswith(b"HTTP/1.1 200") and b"x-request-id" in ok.lower()


def test_a_fault_mid_stream_cuts_the_raw_audio_stream(live_gateway):
    port, _ = live_gateway
    body = {**GOOD, "voice": "late-fault", "stream_format": "audio", "response_format": "pcm"}
    with pytest.raises(httpx.RemoteProtocolError):  # an incomplete chunked body, not a complete-looking answer
        httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", json=body, timeout=60)
    assert httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", json=GOOD, timeout=60).status_code == 200


def test_bad_content_length_is_refused_by_h11(live_gateway):
    port, _ = live_gateway
    for cl in (b"Content-Length: -1", b"Content-Length: 12, 13", b"Content-Length: 1e3"):
        answer = _raw(port, b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n" + cl + b"\r\n\r\n{}")
        assert answer.startswith(b"HTTP/1.1 400"), (cl, answer[:200])
