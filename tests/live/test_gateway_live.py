"""The gateway process (``python -m cosyvoice_triton.gateway``) in front of a real tritonserver (the session's
``triton_server``: local flavor, tiny demo model), with OpenAI's own Python client: every response format decoded
back and equal to what Triton answers directly (within 16-bit rounding for the lossless formats), streams (raw
audio and server-sent events) equal to Triton's own stream, Triton's refusals by status code (plain and streamed),
and the limits (oversize, deep JSON, gzip body, bad key, too many requests) with innocent requests around them.
CosyVoice's own API (the official FastAPI server's form routes, and ``/inference_vc``) with real clients: ``curl``
and the official ``runtime/python/fastapi/client.py`` itself, unchanged (from ``$COSYVOICE_OFFICIAL_GIT``, a git
folder of FunAudioLLM/CosyVoice; skipped without it), on a second
gateway without keys: each answer equal to Triton's own stream for the same request."""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, PATIENT_TEST_S, gateway_process, official_git, wait_until

openai = pytest.importorskip("openai")

VOICE = "gateway_voice"
KEY = "sk-live-test"
TEXT = "Hello there, this is the gateway speaking."
LONG_TEXT = ("This is a much longer sentence that keeps the language model busy for a good while, so that a "
             "second request of the same key arrives while the first is still being answered.")
PROMPT_TEXT = "the prompt says hello"
SEED = 5
MAX_BODY = 300_000
OPEN_MAX_BODY = 1_000_000
INSTRUCT = "Speak slowly."
OFFICIAL_COMMIT = "ace7c47"

pytestmark = pytest.mark.timeout(PATIENT_TEST_S)


@pytest.fixture(scope="module")
def triton(triton_server):
    """VOICE registered on Triton directly: as it is (the public namespace of a gateway without keys) and in
    KEY's tenant (``t-<digest>.``, what the keyed gateway's own registration would store)."""
    from cosyvoice_triton.clients.client import VCClient
    from cosyvoice_triton.gateway.tenants import Namespace, key_tenant

    scoped = Namespace(key_tenant(KEY)).scoped(VOICE)
    with VCClient(triton_server.grpc_url, protocol="grpc", timeout=PATIENCE_S) as c:
        for voice in (VOICE, scoped):
            c.register_speaker(voice, str(FIXTURES / "prompt_en_3s.wav"), prompt_text=PROMPT_TEXT)
        yield c
        for voice in (VOICE, scoped):
            c.delete_speaker(voice)


@pytest.fixture(scope="module")
def gateway(triton, triton_server, tmp_path_factory):
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with gateway_process(triton_server, log, "--api-key", KEY, "--max-concurrency-per-key", "1", "--open-metrics",
                         "--max-body-bytes", str(MAX_BODY), "--max-json-depth", "8") as urls:
        yield urls.base, log


@pytest.fixture(scope="module")
def open_gateway(triton, triton_server, tmp_path_factory):
    """No API keys, as the official server (its client sends none)."""
    log = tmp_path_factory.mktemp("open_gateway") / "gateway.log"
    with gateway_process(triton_server, log, "--max-body-bytes", str(OPEN_MAX_BODY)) as urls:
        yield urls.base


@pytest.fixture(scope="module")
def client(gateway):
    with openai.OpenAI(base_url=gateway[0] + "/v1", api_key=KEY, max_retries=0, timeout=PATIENCE_S) as c:
        yield c


def _speak(client, **kw):
    return client.audio.speech.create(model="cosyvoice2", voice=VOICE, input=kw.pop("input", TEXT),
                                      extra_body={"seed": SEED, **kw.pop("extra_body", {})}, **kw)


def _innocent(client):
    wave, sr = sf.read(io.BytesIO(_speak(client, response_format="wav").read()), dtype="float32")
    assert sr == 24000 and wave.size > 0


@pytest.fixture(scope="module")
def direct(triton):
    res = triton.tts(TEXT, speaker_id=VOICE, seed=SEED)
    return res.waveform.reshape(-1)


def test_voices_list_the_registered_speaker(gateway):
    r = httpx.get(gateway[0] + "/v1/audio/voices", headers={"authorization": f"Bearer {KEY}"}, timeout=PATIENCE_S)
    assert r.status_code == 200 and VOICE in [v["id"] for v in r.json()["data"]]


def test_every_format_decodes_to_tritons_answer(client, direct):
    from cosyvoice_triton.gateway.audio import pcm16

    want = pcm16(direct)
    out = {fmt: _speak(client, response_format=fmt).read() for fmt in ("wav", "flac", "mp3", "opus", "pcm")}
    np.testing.assert_array_equal(np.frombuffer(out["pcm"], "<i2"), want)
    for fmt in ("wav", "flac"):
        got, sr = sf.read(io.BytesIO(out[fmt]), dtype="int16")
        assert sr == 24000
        np.testing.assert_array_equal(got, want)
    for fmt in ("mp3", "opus"):  # lossy: the codec's delay and padding, the same loudness
        got, sr = sf.read(io.BytesIO(out[fmt]), dtype="float32")
        assert sr == 24000 and abs(len(got) - len(want)) < 0.1 * sr
        rms = np.sqrt(np.mean(direct ** 2))
        assert 0.5 * rms < np.sqrt(np.mean(got ** 2)) < 1.5 * rms


def test_streams_equal_tritons_stream(client, triton):
    from cosyvoice_triton.gateway.audio import pcm16

    chunks = list(triton.tts_stream(TEXT, speaker_id=VOICE, seed=SEED))
    assert len(chunks) >= 2
    want = pcm16(np.concatenate([c.waveform for c in chunks]))
    with client.audio.speech.with_streaming_response.create(
            model="cosyvoice2", voice=VOICE, input=TEXT, response_format="pcm", stream_format="audio",
            extra_body={"seed": SEED}) as r:
        assert r.headers["content-type"] == "audio/pcm" and "content-length" not in r.headers
        parts = list(r.iter_bytes())
    np.testing.assert_array_equal(np.frombuffer(b"".join(parts), "<i2"), want)
    with client.audio.speech.with_streaming_response.create(
            model="cosyvoice2", voice=VOICE, input=TEXT, response_format="wav", stream_format="sse",
            extra_body={"seed": SEED}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * len(chunks) + ["speech.audio.done"]
    data = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    got, sr = sf.read(io.BytesIO(data), dtype="int16", frames=len(want))  # a streamed wav: length unknown
    assert sr == 24000
    np.testing.assert_array_equal(got, want)


def test_tritons_refusals_by_status(client):
    for stream_format in (None, "audio", "sse"):
        extra = {} if stream_format is None else {"stream_format": stream_format}
        with pytest.raises(openai.BadRequestError) as info:  # unknown speaker: Triton's INVALID_ARGUMENT
            client.audio.speech.create(model="cosyvoice2", voice="nobody_registered", input=TEXT, **extra)
        assert info.value.body["code"] == "invalid_value" and info.value.body["message"]
    _innocent(client)


def test_zero_shot_from_reference_audio(client):
    ref = base64.b64encode((FIXTURES / "prompt_en_3s.wav").read_bytes()).decode()
    audio = _speak(client, response_format="wav", extra_body={"reference_audio": ref, "reference_text": PROMPT_TEXT})
    wave, sr = sf.read(io.BytesIO(audio.read()), dtype="float32")
    assert sr == 24000 and wave.size > 0
    with pytest.raises(openai.BadRequestError):  # not audio at all: refused by Triton's decoder
        _speak(client, extra_body={"reference_audio": base64.b64encode(b"not audio" * 10).decode()})


def test_bad_requests_and_innocent_ones_around_them(client, gateway):
    url = gateway[0] + "/v1/audio/speech"
    auth = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    body = {"model": "cosyvoice2", "voice": VOICE, "input": TEXT, "response_format": "pcm"}
    _innocent(client)
    with pytest.raises(openai.APIStatusError) as info:  # oversize
        _speak(client, extra_body={"reference_audio": "A" * (MAX_BODY + 10)})
    assert info.value.status_code == 413
    chunked = httpx.post(url, headers=auth, content=iter([json.dumps(body).encode()[:-1],
                                                          b', "pad": "' + b"x" * MAX_BODY + b'"}']),
                         timeout=PATIENCE_S)
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "body_too_large"
    with pytest.raises(openai.BadRequestError) as info:  # deep JSON
        _speak(client, extra_body={"x": json.loads("[" * 20 + "]" * 20)})
    assert info.value.body["code"] == "json_too_deep"
    r = httpx.post(url, headers={**auth, "content-encoding": "gzip"}, content=gzip.compress(json.dumps(body).encode()),
                   timeout=PATIENCE_S)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_content_encoding"
    with openai.OpenAI(base_url=gateway[0] + "/v1", api_key="sk-wrong", max_retries=0) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.audio.speech.create(model="cosyvoice2", voice=VOICE, input=TEXT)
    with pytest.raises(openai.BadRequestError) as info:  # speed changes whole answers only
        client.audio.speech.create(model="cosyvoice2", voice=VOICE, input=TEXT, speed=2.0,
                                   extra_body={"stream_format": "audio"})
    assert info.value.body["param"] == "speed"
    _innocent(client)
    assert "unsupported_content_encoding" in urllib.request.urlopen(gateway[0] + "/metrics").read().decode()


def _in_flight(url: str) -> float:
    """The gateway's requests in flight, this scrape included."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return float(re.search(r"^cosyvoice_gateway_in_flight (\S+)$", text, re.M).group(1))


def test_too_many_requests_of_one_key(client, gateway):
    """At most 1 request per key in flight: while a long one is being answered, the key's next request gets 429
    (OpenAI's client raises RateLimitError), and once it is done requests are answered again. The probes start
    once the long request is inside the gateway (else a probe may come first and the long one be refused)."""
    limited = None
    for _ in range(3):  # the long request may finish before a probe reaches the gateway on a loaded machine
        done, result = threading.Event(), {}

        def long(result=result, done=done):
            try:
                result["audio"] = _speak(client, input=LONG_TEXT, response_format="pcm").read()
            except Exception as exc:
                result["error"] = exc
            finally:
                done.set()

        threading.Thread(target=long, daemon=True).start()
        wait_until(lambda done=done: done.is_set() or _in_flight(gateway[0]) >= 2, "the long request in flight")
        while not done.is_set() and limited is None:
            try:
                _speak(client, response_format="pcm")  # answered only if the long one was already done
            except openai.RateLimitError as exc:
                limited = exc
        assert done.wait(PATIENCE_S) and "error" not in result, result
        assert len(result["audio"]) > 0
        if limited is not None:
            break
    assert limited is not None, "no probe ever arrived while the long request was in flight"
    assert limited.body["code"] == "concurrency_limit_exceeded" and limited.response.headers["retry-after"]
    _innocent(client)


def _llm_metric(server, what: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()
    pattern = rf'^cosyvoice_llm{{[^}}]*what="{what}"[^}}]*}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def test_a_client_that_leaves_cancels_tritons_stream(client, triton_server):
    before = _llm_metric(triton_server, "streams_cancelled")
    with client.audio.speech.with_streaming_response.create(
            model="cosyvoice2", voice=VOICE, input=LONG_TEXT, response_format="pcm", stream_format="audio") as r:
        assert next(r.iter_bytes())
    wait_until(lambda: _llm_metric(triton_server, "streams_cancelled") > before,
               "Triton's cosyvoice_llm streams_cancelled to count the stream the client left")
    _innocent(client)


def test_request_ids_reach_the_log(client, gateway):
    r = httpx.post(gateway[0] + "/v1/audio/speech", headers={"authorization": f"Bearer {KEY}",
                                                              "x-request-id": "live-rid-7"},
                   json={"model": "cosyvoice2", "voice": VOICE, "input": TEXT, "response_format": "pcm"},
                   timeout=PATIENCE_S)
    assert r.status_code == 200 and r.headers["x-request-id"] == "live-rid-7"
    wait_until(lambda: "[live-rid-7]" in gateway[1].read_text(), "the request id in the gateway's log")


# ------------------------------------------------------------------- CosyVoice's own API, with real clients


def _pcm16(chunks) -> np.ndarray:
    from cosyvoice_triton.gateway.audio import pcm16

    return pcm16(np.concatenate([c.waveform for c in chunks]))


@pytest.fixture(scope="module")
def expected(triton):
    """Triton's own stream for each official mode (the same prompt and text, the server's default seed)."""
    prompt = str(FIXTURES / "prompt_en_3s.wav")
    source = str(FIXTURES / "source_en_5s.wav")
    requests = {
        "sft": lambda: triton.tts_stream(TEXT, speaker_id=VOICE),
        "zero_shot": lambda: triton.tts_stream(TEXT, prompt=prompt, prompt_text=PROMPT_TEXT, mode="zero_shot"),
        "cross_lingual": lambda: triton.tts_stream(TEXT, prompt=prompt, mode="cross_lingual"),
        "instruct2": lambda: triton.tts_stream(TEXT, prompt=prompt, instruct=INSTRUCT + "<|endofprompt|>",
                                               mode="instruct"),
        "vc": lambda: triton.convert_stream(source, prompt),
        "vc_speaker": lambda: triton.convert_stream(source, speaker_id=VOICE),
    }
    done: dict[str, np.ndarray] = {}

    def get(mode: str) -> np.ndarray:
        if mode not in done:
            done[mode] = _pcm16(list(requests[mode]()))
        return done[mode]

    return get


def _curl(url: str, tmp_path: Path, *args: str) -> tuple[int, bytes, str]:
    """``curl`` itself: (status, body, headers); the body written as it streams in (``-N``)."""
    body, head = tmp_path / "curl.body", tmp_path / "curl.head"
    body.unlink(missing_ok=True)
    out = subprocess.run(["curl", "-sS", "-N", "--max-time", str(int(PATIENCE_S)), "-o", str(body), "-D", str(head),
                          "-w", "%{http_code}", *args, url], capture_output=True, text=True, timeout=PATIENCE_S + 30)
    status = int(out.stdout.strip()[-3:] or 0)
    assert status, f"curl got no answer: {out.stderr}"
    return status, body.read_bytes() if body.exists() else b"", head.read_text()


def _heard(status: int, body: bytes, head: str, want: np.ndarray) -> np.ndarray:
    assert status == 200, body[:300]
    assert re.search(r"^x-sample-rate: 24000\r?$", head, re.M | re.I), head
    assert len(body) % 2 == 0
    pcm = np.frombuffer(body, "<i2")
    assert pcm.size > 0.2 * 24000 and np.abs(pcm).max() > 100  # plausible length, not silence
    np.testing.assert_array_equal(pcm, want)
    return pcm


def _error(status: int, body: bytes, head: str, want: int, param=None, code=None) -> dict:
    assert status == want, body[:300]
    err = json.loads(body)["error"]
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_official_forms_with_curl(open_gateway, expected, tmp_path):
    prompt = f"prompt_wav=@{FIXTURES / 'prompt_en_3s.wav'}"
    # as the official client sends them: a multipart form in a GET
    _heard(*_curl(open_gateway + "/inference_sft", tmp_path, "-X", "GET", "-F", f"tts_text={TEXT}",
                  "-F", f"spk_id={VOICE}"), expected("sft"))
    _heard(*_curl(open_gateway + "/inference_sft", tmp_path, "--data-urlencode", f"tts_text={TEXT}",
                  "--data-urlencode", f"spk_id={VOICE}"), expected("sft"))  # a urlencoded POST
    _heard(*_curl(open_gateway + "/inference_zero_shot", tmp_path, "-F", f"tts_text={TEXT}",
                  "-F", f"prompt_text={PROMPT_TEXT}", "-F", prompt), expected("zero_shot"))
    _heard(*_curl(open_gateway + "/inference_cross_lingual", tmp_path, "-F", f"tts_text={TEXT}", "-F", prompt),
           expected("cross_lingual"))
    _heard(*_curl(open_gateway + "/inference_instruct2", tmp_path, "-F", f"tts_text={TEXT}",
                  "-F", f"instruct_text={INSTRUCT}", "-F", prompt), expected("instruct2"))


def test_voice_conversion_with_curl(open_gateway, expected, tmp_path):
    source = f"source_wav=@{FIXTURES / 'source_en_5s.wav'}"
    _heard(*_curl(open_gateway + "/inference_vc", tmp_path, "-F", source,
                  "-F", f"prompt_wav=@{FIXTURES / 'prompt_en_3s.wav'}"), expected("vc"))
    _heard(*_curl(open_gateway + "/inference_vc", tmp_path, "-F", source, "-F", f"spk_id={VOICE}"),
           expected("vc_speaker"))


def _official_client(tmp_path: Path) -> Path:
    official = official_git()
    client = tmp_path / "official" / "client.py"
    client.parent.mkdir()
    client.write_bytes(subprocess.run(["git", "-C", str(official), "show",
                                       f"{OFFICIAL_COMMIT}:runtime/python/fastapi/client.py"],
                                      capture_output=True, check=True).stdout)
    # PyPI's torchaudio does not load with the CPU torch here; the client uses it only to write its wav
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "torchaudio.py").write_text("import soundfile\n\n\ndef save(path, tensor, sample_rate):\n"
                                        "    soundfile.write(path, tensor.numpy().T, sample_rate, subtype='PCM_16')\n")
    return client


def test_the_official_client_unchanged(open_gateway, expected, tmp_path):
    client = _official_client(tmp_path)
    port = open_gateway.rsplit(":", 1)[1]
    prompt = str(FIXTURES / "prompt_en_3s.wav")
    modes = {"sft": ["--spk_id", VOICE], "zero_shot": ["--prompt_text", PROMPT_TEXT, "--prompt_wav", prompt],
             "cross_lingual": ["--prompt_wav", prompt]}
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "stub")}
    for mode, args in modes.items():
        out = tmp_path / f"{mode}.wav"
        run = subprocess.run([sys.executable, str(client), "--host", "127.0.0.1", "--port", port, "--mode", mode,
                              "--tts_text", TEXT, "--tts_wav", str(out), *args], capture_output=True, text=True,
                             env=env, timeout=PATIENCE_S)
        assert run.returncode == 0, run.stderr[-2000:]
        # the client writes its samples as they came (its header says 22050 Hz: its CosyVoice 1 default rate)
        got, _ = sf.read(out, dtype="int16")
        np.testing.assert_array_equal(got, expected(mode))


def test_official_forms_bad_inputs_and_innocent_ones_around_them(open_gateway, gateway, expected, tmp_path):
    sft = ["-F", f"tts_text={TEXT}", "-F", f"spk_id={VOICE}"]
    _heard(*_curl(open_gateway + "/inference_sft", tmp_path, *sft), expected("sft"))
    _error(*_curl(open_gateway + "/inference_sft", tmp_path, "-F", f"tts_text={TEXT}"), 400, param="spk_id")
    _error(*_curl(open_gateway + "/inference_zero_shot", tmp_path, "-F", f"tts_text={TEXT}",
                  "-F", f"prompt_wav=@{FIXTURES / 'prompt_en_3s.wav'}"), 400, param="prompt_text")
    big = tmp_path / "big.wav"
    big.write_bytes((FIXTURES / "prompt_en_3s.wav").read_bytes() * (OPEN_MAX_BODY // 100_000))
    _error(*_curl(open_gateway + "/inference_cross_lingual", tmp_path, "-F", f"tts_text={TEXT}",
                  "-F", f"prompt_wav=@{big}"), 413, code="body_too_large")
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"this is not audio at all\n" * 100)
    _error(*_curl(open_gateway + "/inference_cross_lingual", tmp_path, "-F", f"tts_text={TEXT}",
                  "-F", f"prompt_wav=@{junk}"), 400, param="prompt_wav", code="invalid_audio")
    _error(*_curl(open_gateway + "/inference_vc", tmp_path, "-F", f"source_wav=@{junk}", "-F", f"spk_id={VOICE}"),
           400, param="source_wav", code="invalid_audio")
    err = _error(*_curl(open_gateway + "/inference_sft", tmp_path, "-F", f"tts_text={TEXT}",
                        "-F", "spk_id=nobody_registered"), 400, code="invalid_value")  # Triton's INVALID_ARGUMENT
    assert "nobody_registered" in err["message"]
    _error(*_curl(open_gateway + "/inference_instruct", tmp_path, *sft, "-F", f"instruct_text={INSTRUCT}"), 400,
           code="unsupported_mode")
    _error(*_curl(gateway[0] + "/inference_sft", tmp_path, *sft), 401)  # a gateway with keys wants one here too
    _heard(*_curl(gateway[0] + "/inference_sft", tmp_path, *sft, "-H", f"authorization: Bearer {KEY}"),
           expected("sft"))
    _heard(*_curl(open_gateway + "/inference_sft", tmp_path, *sft), expected("sft"))


# ------------------------------------------------------------------------------------------------ tenants

TENANT_A, KEY_A, KEY_B = "acme", "sk-live-acme", "sk-live-other"


@pytest.fixture(scope="module")
def tenant_gateway(triton, triton_server, tmp_path_factory):
    """Two tenants from a keys file (one named, one a plain key), at most 2 voices each."""
    folder = tmp_path_factory.mktemp("tenant_gateway")
    (folder / "keys").write_text(f"{TENANT_A}:{KEY_A}\n{KEY_B}\n")
    with gateway_process(triton_server, folder / "gateway.log", "--api-key-file", str(folder / "keys"),
                         "--max-voices-per-tenant", "2") as urls:
        yield urls.base


def test_tenants_own_their_voices(tenant_gateway, triton, direct):
    """A registers alice (A's speech is VOICE's: the same prompt); B cannot list, speak with or delete it, and
    B's own alice leaves A's speech bit-identical; B's quota refuses its third voice while A still registers."""
    from cosyvoice_triton.gateway.audio import pcm16
    from cosyvoice_triton.gateway.tenants import key_tenant

    a, b = ({"authorization": f"Bearer {k}"} for k in (KEY_A, KEY_B))
    voices = tenant_gateway + "/v1/audio/voices"

    def register(who, voice, fixture, text=None):
        files = {"audio": (fixture, (FIXTURES / fixture).read_bytes(), "audio/wav")}
        return httpx.post(voices, data={"id": voice, **({"text": text} if text else {})}, files=files,
                          headers=who, timeout=PATIENCE_S)

    def speak(who, voice="alice"):
        return httpx.post(tenant_gateway + "/v1/audio/speech", headers=who, timeout=PATIENCE_S,
                          json={"model": "cosyvoice2", "voice": voice, "input": TEXT, "response_format": "pcm",
                                "seed": SEED})

    def ids(who):
        return [v["id"] for v in httpx.get(voices, headers=who, timeout=PATIENCE_S).json()["data"]]

    try:
        assert register(a, "alice", "prompt_en_3s.wav", PROMPT_TEXT).status_code == 201
        first = speak(a)
        assert first.status_code == 200
        np.testing.assert_array_equal(np.frombuffer(first.content, "<i2"), pcm16(direct))
        assert ids(a) == ["alice"] and ids(b) == []
        for voice in ("alice", f"t-{TENANT_A}.alice", VOICE):
            r = speak(b, voice)
            assert r.status_code == 400 and repr(voice) in r.json()["error"]["message"], r.text
        r = httpx.post(tenant_gateway + "/inference_sft", data={"tts_text": TEXT, "spk_id": "alice"}, headers=b,
                       timeout=PATIENCE_S)
        assert r.status_code == 400, r.text
        assert httpx.delete(voices + "/alice", headers=b, timeout=PATIENCE_S).status_code == 404
        assert register(b, "alice", "speech_engb_16k.wav").status_code == 201
        theirs = speak(b)
        assert theirs.status_code == 200 and theirs.content != first.content
        assert speak(a).content == first.content
        assert register(b, "bob", "source_en_5s.wav").status_code == 201
        r = register(b, "carol", "source_en_5s.wav")
        assert r.status_code == 403 and r.json()["error"]["code"] == "voice_quota_exceeded", r.text
        assert register(a, "bob", "source_en_5s.wav").status_code == 201
        assert ids(a) == ["alice", "bob"] and ids(b) == ["alice", "bob"]
        stored = set(triton.list_speakers())
        assert {f"t-{TENANT_A}.alice", f"t-{TENANT_A}.bob", f"t-{key_tenant(KEY_B)}.alice"} <= stored
        assert not any(KEY_B in s or KEY_A in s for s in stored)
    finally:
        for who in (a, b):
            for voice in ids(who):
                assert httpx.delete(f"{voices}/{voice}", headers=who, timeout=PATIENCE_S).status_code == 200
    assert ids(a) == [] and ids(b) == []
