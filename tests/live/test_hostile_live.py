"""Hostile input against a live ``tritonserver`` (local flavor, tiny demo model): both protocols, the ensemble and
every member model called directly, encoded-audio bombs, bad neighbours, memory before and after.

Each kind of bad request must get INVALID_ARG (HTTP 400 / gRPC INVALID_ARGUMENT) with a message naming what is
wrong, quickly; good requests sent at the same time must get the answer they get alone; refused requests must
not leave memory behind; and after all of it the server must still be ready and serve. The figures (kinds tried,
crashes, hangs, corrupted neighbours, memory growth) are printed (``pytest -s``) and collected in ``FIGURES``.

Small by default (a few minutes on 2 cores); ``HOSTILE_SCALE=N`` multiplies the concurrent and memory rounds.
"""

from __future__ import annotations

import io
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, wait_until

from cosyvoice_triton.clients.client import VCError

SCALE = max(1, int(os.environ.get("HOSTILE_SCALE", "1")))
TIMEOUT = PATIENCE_S  # a busy machine's ceiling on one request
FIGURES: dict[str, object] = {"kinds": 0, "refused_as_invalid": 0, "wrong_status": [], "hangs": 0, "crashes": 0,
                              "corrupted_neighbours": 0}


@pytest.fixture(scope="module")
def speech():
    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return src[: int(1.5 * ssr)], ssr, prm[: int(1.2 * psr)], psr


def _client(server, protocol):
    if protocol == "http":
        import tritonclient.http as mod

        return mod, mod.InferenceServerClient(server.http_url, connection_timeout=TIMEOUT, network_timeout=TIMEOUT,
                                              concurrency=8)
    import tritonclient.grpc as mod

    return mod, mod.InferenceServerClient(server.grpc_url)


_DT = {np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64", np.dtype(np.int32): "INT32",
       np.dtype(np.int64): "INT64", np.dtype(bool): "BOOL", np.dtype(object): "BYTES"}


def infer(server, protocol, model, tensors: dict[str, np.ndarray], outputs=None):
    """``(outputs dict or None, VCError or None, seconds)``."""
    mod, client = _client(server, protocol)
    inputs = []
    for name, arr in tensors.items():
        t = mod.InferInput(name, list(arr.shape), _DT[arr.dtype])
        t.set_data_from_numpy(arr)
        inputs.append(t)
    t0 = time.perf_counter()
    try:
        kw = {"client_timeout": TIMEOUT} if protocol == "grpc" else {}
        res = client.infer(model, inputs, **kw)
        names = outputs or [o["name"] for o in (res.get_response()["outputs"] if protocol == "http"
                                                else [{"name": o.name} for o in res.get_response().outputs])]
        return {n: res.as_numpy(n) for n in names}, None, time.perf_counter() - t0
    except Exception as exc:  # InferenceServerException: the server's message and status
        return None, VCError.from_exception(exc), time.perf_counter() - t0
    finally:
        client.close()


def _col(x, dtype):  # the configs' rank-1 tensors travel as [B, 1]
    return np.asarray(x, dtype).reshape(-1, 1)


def _enc(n, *, length=None, fill=1, emb=0.1):
    return {"speech_tokens": np.full((1, n), fill, np.int32), "speech_token_len": _col([length or n], np.int32),
            "lookahead_len": _col([0], np.int32), "speaker_embedding": np.full((1, 192), emb, np.float32),
            "streaming": _col([False], bool)}


def _est(t, rows=2, mu=0.1):
    return {"x": np.full((rows, 80, t), 0.1, np.float32), "mask": np.ones((rows, 1, t), np.float32),
            "mu": np.full((rows, 80, t), mu, np.float32), "t": _col([0.3] * rows, np.float32),
            "spks": np.zeros((rows, 80), np.float32), "cond": np.zeros((rows, 80, t), np.float32),
            "streaming": _col([False] * rows, bool)}


def _encode(fmt, subtype, channels, rate, frames, value=0.0):
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", samplerate=rate, channels=channels, format=fmt, subtype=subtype) as f:
        f.write(np.full((frames, channels), value, np.float32))
    return buf.getvalue()


def _vc(speech, **override):
    src, ssr, prm, psr = speech
    base = {"source_audio": src[None].astype(np.float32), "source_sample_rate": np.array([[ssr]], np.int32),
            "prompt_audio": prm[None].astype(np.float32), "prompt_sample_rate": np.array([[psr]], np.int32)}
    base.update(override)
    return {k: v for k, v in base.items() if v is not None}


def _bytes(b):
    return np.array([[b]], dtype=object)


def _cases(speech):
    """model -> kind -> (tensors, words the message must contain)."""
    nan_mel = np.zeros((1, 80, 30), np.float32)
    nan_mel[0, 3, 4] = np.nan
    return {
        "flow_encoder": {
            "length 1000 > 5 tokens": (_enc(5, length=1000), ["speech_token_len", "1000"]),
            "token id 7000": (_enc(8, fill=7000), ["speech_tokens", "7000"]),
            "3000 tokens": (_enc(3000), ["tokens", "3000", "maximum 1500"]),
            "NaN embedding": (_enc(8, emb=np.nan), ["speaker_embedding", "NaN"]),
        },
        "flow_estimator": {
            "T 6000": (_est(6000), ["mel_frames", "6000", "maximum 3000"]),
            "NaN mu": (_est(20, mu=np.nan), ["'mu'", "NaN"]),
        },
        "hift_source": {"NaN mel": ({"mel": nan_mel, "nsf_noise": np.zeros((1, 480 * 30, 9), np.float32)},
                                    ["'mel'", "NaN"])},
        "hift_decoder": {"T 5000": ({"mel": np.zeros((1, 80, 5000), np.float32),
                                     "source": np.zeros((1, 1, 480 * 5000), np.float32)},
                                    ["mel_frames", "5000", "maximum 1508"])},
        "speech_tokenizer": {"length 80 > 50 frames": ({"whisper_mel": np.zeros((1, 128, 50), np.float32),
                                                         "whisper_mel_len": _col([80], np.int32)},
                                                        ["whisper_mel_len", "80"])},
        "speaker_encoder": {"Inf fbank": ({"fbank": np.full((1, 40, 80), np.inf, np.float32)}, ["fbank", "NaN/Inf"]),
                            "3001 frames": ({"fbank": np.zeros((1, 3001, 80), np.float32)}, ["3001", "maximum"])},
        "flow": {"token id 9999": ({"source_speech_tokens": np.full((1, 10), 9999, np.int32),
                                    "prompt_speech_tokens": np.ones((1, 5), np.int32),
                                    "prompt_mel": np.zeros((1, 10, 80), np.float32),
                                    "speaker_embedding": np.zeros((1, 192), np.float32)}, ["9999"]),
                 "NaN prompt mel": ({"source_speech_tokens": np.ones((1, 10), np.int32),
                                     "prompt_speech_tokens": np.ones((1, 5), np.int32),
                                     "prompt_mel": np.full((1, 10, 80), np.nan, np.float32),
                                     "speaker_embedding": np.zeros((1, 192), np.float32)}, ["prompt_mel", "NaN"])},
        "hift": {"NaN mel": ({"mel": nan_mel}, ["non-finite"]),
                 "T 5000": ({"mel": np.zeros((1, 80, 5000), np.float32)}, ["5000", "maximum"])},
        "postprocess": {"NaN waveform": ({"waveform": np.full((1, 480), np.nan, np.float32)}, ["NaN"])},
        "preprocess": {"rate 2**31-1": (_vc(speech, source_sample_rate=np.array([[2**31 - 1]], np.int32)),
                                        ["source_sample_rate", "outside"])},
        "cosyvoice_vc": {
            "OGG 255 channels": (_vc(speech, source_audio=None, source_sample_rate=None,
                                     source_audio_bytes=_bytes(_encode("OGG", "VORBIS", 255, 48000, 4800))),
                                 ["source_audio_bytes", "255 channels"]),
            "FLAC 655 kHz x 8": (_vc(speech, prompt_audio=None, prompt_sample_rate=None,
                                     prompt_audio_bytes=_bytes(_encode("FLAC", "PCM_16", 8, 655350, 65535))),
                                 ["prompt_audio_bytes", "655350 Hz", "outside"]),
            "WAV at 1 Hz": (_vc(speech, source_audio=None, source_sample_rate=None,
                                source_audio_bytes=_bytes(_encode("WAV", "PCM_16", 1, 1, 16000, 0.1))),
                            ["1 Hz", "outside"]),
            "rate 1 Hz": (_vc(speech, source_sample_rate=np.array([[1]], np.int32)), ["1 Hz", "outside"]),
            "rate -2**31": (_vc(speech, prompt_sample_rate=np.array([[-(2**31)]], np.int32)), ["positive"]),
            "NaN source": (_vc(speech, source_audio=np.full((1, 16000), np.nan, np.float32)), ["NaN"]),
            "FP64 audio": (_vc(speech, source_audio=np.zeros((1, 16000), np.float64)), ["FP64"]),
            "rank 3 audio": (_vc(speech, prompt_audio=np.zeros((1, 2, 8000), np.float32)), ["shape"]),
        },
    }


def _all_ready(server):
    return server.is_ready() and all(server.is_model_ready(m) for m in MODELS)


MODELS = ("cosyvoice_vc", "preprocess", "speech_tokenizer", "speaker_encoder", "flow", "flow_encoder",
          "flow_estimator", "hift", "hift_source", "hift_decoder", "postprocess")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_model_refuses_each_kind_of_bad_input_quickly(triton_server, speech, protocol):
    failures = []
    for model, kinds in _cases(speech).items():
        for kind, (tensors, words) in kinds.items():
            FIGURES["kinds"] += 1
            cpu_before = _cpu_seconds(triton_server)
            _, err, seconds = infer(triton_server, protocol, model, tensors)
            cpu = _cpu_seconds(triton_server) - cpu_before  # the server's work on it, however busy the machine
            if (err is not None and "timed out" in err.message.lower()) or seconds > 30:
                FIGURES["hangs"] += 1
            if err is None or not err.invalid_argument:
                failures.append(f"{protocol} {model} {kind}: {'accepted' if err is None else err}")
                FIGURES["wrong_status"].append(f"{protocol} {model} {kind}")
                continue
            FIGURES["refused_as_invalid"] += 1
            missing = [w for w in words if w.lower() not in err.message.lower()]
            if missing:
                failures.append(f"{protocol} {model} {kind}: {missing} not in {err.message!r}")
            if cpu > 10:  # refused up front, not computed
                failures.append(f"{protocol} {model} {kind}: refused after {cpu:.1f} s of the server's CPU time "
                                f"({seconds:.1f} s)")
    if not triton_server.running:
        FIGURES["crashes"] += 1
    assert _all_ready(triton_server)
    assert not failures, "\n".join(failures)


def test_bad_direct_calls_do_not_fail_or_change_concurrent_ensemble_requests(triton_server, speech):
    """Direct flow_encoder / flow_estimator / hift_decoder calls with bad lengths and NaN, sent while ensemble
    requests run: each refused alone, and the ensemble answers equal the quiet run's (finding 3)."""
    good = _vc(speech, seed=np.array([[3]], np.int64))
    quiet, err, _ = infer(triton_server, "http", "cosyvoice_vc", good, ["waveform"])
    assert err is None, err
    n = 4 * SCALE
    bad = [("flow_encoder", _enc(5, length=1000)), ("flow_encoder", _enc(12, emb=np.nan)),
           ("flow_estimator", _est(30, mu=np.nan)), ("hift_decoder", {"mel": np.zeros((1, 80, 20), np.float32),
                                                                      "source": np.full((1, 1, 9600), np.inf,
                                                                                        np.float32)})]
    jobs = [("good", "cosyvoice_vc", good)] * n + [("bad", *bad[i % len(bad)]) for i in range(3 * n)]
    order = np.random.default_rng(0).permutation(len(jobs))
    with ThreadPoolExecutor(max_workers=min(16, len(jobs))) as pool:
        futs = [(jobs[i][0], pool.submit(infer, triton_server, ("http", "grpc")[k % 2], jobs[i][1], jobs[i][2],
                                         ["waveform"] if jobs[i][0] == "good" else None))
                for k, i in enumerate(order)]
        results = [(kind, f.result()) for kind, f in futs]
    exact = 0
    for kind, (out, err, _) in results:
        if kind == "bad":
            assert err is not None and err.invalid_argument, err
            continue
        if err is not None or out["waveform"].shape != quiet["waveform"].shape or \
                not np.allclose(out["waveform"], quiet["waveform"], atol=1e-5):
            FIGURES["corrupted_neighbours"] += 1
            continue
        exact += bool(np.array_equal(out["waveform"], quiet["waveform"]))
    FIGURES["neighbours"] = f"{n} good + {3 * n} bad concurrently: {exact} of {n} bit-identical to the quiet run"
    print(FIGURES["neighbours"])
    assert FIGURES["corrupted_neighbours"] == 0
    assert _all_ready(triton_server)


def _stub_rss(server, model):
    import psutil

    root = psutil.Process(server.process.pid)
    for p in root.children(recursive=True):
        try:
            if any(f"/{model}/" in a or a.endswith(f"/{model}") for a in p.cmdline()):
                return p.memory_info().rss
        except psutil.Error:
            continue
    raise AssertionError(f"no stub process of {model}")


def _cpu_seconds(server) -> float:
    """CPU time used so far by the server and its stubs (user + system)."""
    import psutil

    root = psutil.Process(server.process.pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _server_rss(server):
    import psutil

    root = psutil.Process(server.process.pid)
    return root.memory_info().rss, sum(p.memory_info().rss for p in root.children(recursive=True))


def test_refused_big_requests_leave_no_memory_behind(triton_server, speech):
    """Finding 4: the preprocess stub after N refused 20 MB requests stays within one request of its size after N
    valid 20 MB requests (before the fix each refused request kept ~40 MB in the stub)."""
    n = 6 * SCALE
    _, _, prm, psr = speech
    rng = np.random.default_rng(0)
    valid_rate, refused_rate = 384000, 16000
    samples = 5_000_000  # 20 MB of float32: 13 s at 384 kHz (valid), 312 s at 16 kHz (refused: too long)

    def req(rate):
        return {"source_audio": rng.uniform(-0.3, 0.3, (1, samples)).astype(np.float32),
                "source_sample_rate": np.array([[rate]], np.int32), "prompt_audio": prm[None].astype(np.float32),
                "prompt_sample_rate": np.array([[psr]], np.int32)}

    for _ in range(2):  # warm-up: allocator pools, shared-memory regions
        infer(triton_server, "http", "preprocess", req(valid_rate))
    for _ in range(n):
        _, err, _ = infer(triton_server, "grpc", "preprocess", req(valid_rate))
        assert err is None, err
    after_valid, (srv_valid, kids_valid) = _stub_rss(triton_server, "preprocess"), _server_rss(triton_server)
    for i in range(n):
        _, err, _ = infer(triton_server, ("http", "grpc")[i % 2], "preprocess", req(refused_rate))
        assert err is not None and err.invalid_argument and "too long" in err.message, err
    # what a refused request held is freed after its answer: read the memory once it is back under the bar (it
    # stays above it where the refused requests leak)
    wait_until(lambda: _stub_rss(triton_server, "preprocess") - after_valid < 60e6,
               "the preprocess stub's memory back within 60 MB of its size after the valid requests", interval=0.5)
    after_refused, (srv_refused, kids_refused) = _stub_rss(triton_server, "preprocess"), _server_rss(triton_server)
    growth = after_refused - after_valid
    server_growth, stubs_growth = (srv_refused - srv_valid) / 1e6, (kids_refused - kids_valid) / 1e6
    FIGURES["memory"] = (f"preprocess stub after {n} valid 20 MB requests {after_valid / 1e6:.0f} MB, after {n} "
                         f"refused {after_refused / 1e6:.0f} MB ({growth / 1e6:+.0f} MB); tritonserver "
                         f"{server_growth:+.0f} MB, all stubs {stubs_growth:+.0f} MB")
    print(FIGURES["memory"])
    assert growth < 60e6, FIGURES["memory"]  # before the fix: ~40 MB per refused request (240 MB)


def test_int32_rate_beyond_range_over_json(triton_server, speech):
    """Finding 8: a JSON INT32 of 2**32 + 16000. Our code never sees a value beyond INT32 (Triton converts the JSON
    number before the model): the request must be refused, or (if Triton wraps it) answer exactly as 16000 does.
    Either way nothing beyond INT32 is silently taken as a different valid rate by our code."""
    src, ssr, _, _ = speech
    x = np.full(16000, 0.1, np.float32)

    def body(rate):
        return json.dumps({"inputs": [
            {"name": "source_audio", "shape": [1, len(src)], "datatype": "FP32", "data": src.tolist()},
            {"name": "source_sample_rate", "shape": [1, 1], "datatype": "INT32", "data": [rate]},
            {"name": "prompt_audio", "shape": [1, len(x)], "datatype": "FP32", "data": x.tolist()},
            {"name": "prompt_sample_rate", "shape": [1, 1], "datatype": "INT32", "data": [16000]}],
            "outputs": [{"name": "waveform"}]}).encode()

    def post(rate):
        req = urllib.request.Request(f"http://{triton_server.http_url}/v2/models/cosyvoice_vc/infer", data=body(rate),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    status, answer = post(2**32 + ssr)
    FIGURES["int32 overflow over JSON"] = f"HTTP {status}: {str(answer)[:160]}"
    print(FIGURES["int32 overflow over JSON"])
    if status == 200:  # Triton wrapped it before the model: the documented limitation
        ref_status, ref = post(ssr)
        assert ref_status == 200 and ref["outputs"][0]["data"] == answer["outputs"][0]["data"]
    else:
        assert status == 400
    assert _all_ready(triton_server)


def test_zz_server_still_serves_after_all_of_it(triton_server, speech):
    out, err, _ = infer(triton_server, "grpc", "cosyvoice_vc", _vc(speech), ["waveform"])
    assert err is None and np.isfinite(out["waveform"]).all() and out["waveform"].size > 0
    assert triton_server.running and _all_ready(triton_server)
    print("hostile-input figures:", json.dumps(FIGURES, default=str))


# ------------------------------------------------------------------------------------ TTS: bounded, status by type


def _tts(speech, **override):
    _, _, prm, psr = speech
    base = {"text": _bytes(b"Hello there."), "prompt_audio": prm[None].astype(np.float32),
            "prompt_sample_rate": np.array([[psr]], np.int32), "seed": np.array([[1]], np.int64)}
    base.update(override)
    return {k: v for k, v in base.items() if v is not None}


def _tts_cases(speech):
    """kind -> (cosyvoice_tts tensors, words the message must contain)."""
    _, _, prm, _ = speech
    no_prompt = {"prompt_audio": None, "prompt_sample_rate": None}
    cases = {
        "2000 digits": (_tts(speech, text=_bytes(b"1" * 2000)), ["run of 2000 digits", "maximum 32"]),
        "600 numbers": (_tts(speech, text=_bytes(b"12 " * 600)), ["1200 digits", "maximum 256"]),
        "one unsplit segment of 1000 tokens": (  # a control tag: the official front end leaves it unsplit
            _tts(speech, text=_bytes(("<|endofprompt|> " + "hello world " * 150).encode())),
            ["text segment 1", "text tokens", "flow"]),
        "prompt amplitude 1e30": (_tts(speech, prompt_audio=np.full((1, prm.size), 1e30, np.float32)),
                                  ["prompt_audio"]),
        "prompt Inf": (_tts(speech, prompt_audio=np.full((1, prm.size), np.inf, np.float32)), ["prompt_audio"]),
        "prompt NaN": (_tts(speech, prompt_audio=np.full((1, prm.size), np.nan, np.float32)), ["prompt_audio"]),
    }
    for prefix in ("TTS busy: ", "internal error: ", "UNAVAILABLE: ", "Stub process 'x' is not healthy",
                   "Request for unknown model: 'x' has no available versions"):
        cases[f"speaker_id {prefix!r}"] = (_tts(speech, **no_prompt, speaker_id=_bytes(prefix.encode())),
                                           [prefix.strip()])
    return cases


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tts_refusals_are_bounded_and_their_status_comes_from_the_errors_type(triton_server, speech, protocol):
    from cosyvoice_triton.clients.retry import is_retryable

    failures, figures = [], {}
    for kind, (tensors, words) in _tts_cases(speech).items():
        cpu_before = _cpu_seconds(triton_server)
        _, err, seconds = infer(triton_server, protocol, "cosyvoice_tts", tensors)
        cpu = _cpu_seconds(triton_server) - cpu_before
        figures[kind] = round(seconds, 3)
        if err is None or not err.invalid_argument:
            failures.append(f"{protocol} {kind}: {'accepted' if err is None else (err.status, err.message)}")
            continue
        if is_retryable(err):
            failures.append(f"{protocol} {kind}: the client would send it again: {err.status} {err.message!r}")
        missing = [w for w in words if w.lower() not in err.message.lower()]
        if missing:
            failures.append(f"{protocol} {kind}: {missing} not in {err.message!r}")
        if cpu > 5:  # refused before the normaliser or the LM did the work
            failures.append(f"{protocol} {kind}: refused after {cpu:.1f} s of the server's CPU time")
    print(f"tts refusals over {protocol} (s, loaded machine):", figures)
    assert triton_server.is_model_ready("cosyvoice_tts") and _all_ready(triton_server)
    assert not failures, "\n".join(failures)


def _grpc_stream(server, model, tensors):
    """One gRPC stream: ``(chunks, error)``; the error a :class:`VCError` with the status read from the stream
    (Triton is asked for gRPC status codes on errors, as the gateway asks)."""
    import queue

    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, arr in tensors.items():
        t = grpcclient.InferInput(name, list(arr.shape), _DT[arr.dtype])
        t.set_data_from_numpy(arr)
        inputs.append(t)
    client.start_stream(callback=lambda result, error: results.put((result, error)),
                        headers={"triton_grpc_error": "true"})
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    chunks, error = 0, None
    try:
        while True:
            result, err = results.get(timeout=TIMEOUT)
            if err is not None:
                error = VCError.from_exception(err)
                break
            if result.as_numpy("waveform") is not None:
                chunks += 1
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    return chunks, error


@pytest.mark.parametrize("speaker_id", [b"nobody", b"TTS busy: nobody", b"\xff\xfe", b"", b"x" * 10000],
                         ids=["unknown", "busy-looking", "not UTF-8", "empty", "10 kB"])
def test_vc_stream_refuses_a_bad_speaker_id(triton_server, speech, speaker_id):
    tensors = _vc(speech, prompt_audio=None, prompt_sample_rate=None, speaker_id=_bytes(speaker_id))
    chunks, err = _grpc_stream(triton_server, "cosyvoice_vc_stream", tensors)
    assert chunks == 0 and err is not None
    assert err.invalid_argument, (err.status, err.message)
    assert "speaker" in err.message.lower(), err.message
    assert triton_server.is_model_ready("cosyvoice_vc_stream")


@pytest.mark.parametrize("priority", [-1, "abc", 1.5, 2**70])
def test_bad_http_priority_is_refused_by_tritons_parser_and_the_server_serves_on(triton_server, speech, priority):
    """Triton's HTTP front end parses ``parameters.priority`` (uint64) before any model sees the request, and
    answers 500 "Unable to parse 'priority'" itself: no model code can make it a 400 (gRPC's field is a uint64,
    so nothing else can be sent there; the gateway speaks gRPC). Documented; this pins what Triton answers."""
    src, ssr, prm, psr = speech
    body = {"parameters": {"priority": priority},
            "inputs": [{"name": "source_audio", "shape": [1, 400], "datatype": "FP32", "data": src[:400].tolist()},
                       {"name": "source_sample_rate", "shape": [1, 1], "datatype": "INT32", "data": [ssr]},
                       {"name": "prompt_audio", "shape": [1, 400], "datatype": "FP32", "data": prm[:400].tolist()},
                       {"name": "prompt_sample_rate", "shape": [1, 1], "datatype": "INT32", "data": [psr]}]}
    req = urllib.request.Request(f"http://{triton_server.http_url}/v2/models/cosyvoice_vc/infer",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            status, answer = r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, exc.read().decode()
    assert status in (400, 500), (status, answer[:300])
    assert "Unable to parse 'priority'" in answer, answer[:300]
    assert _all_ready(triton_server)
    out, err, _ = infer(triton_server, "http", "cosyvoice_vc", _vc(speech), ["waveform"])
    assert err is None and out["waveform"].size > 0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tags_whose_lm_limit_passes_the_flows_are_spoken_up_to_its_room(triton_server, speech, protocol):
    """A control tag keeps the text one segment (as officially): 180 tags are 181 text tokens, an LM limit of
    3620 speech tokens with the prompt's beside them, more than the flow's 1500. It is served, never more than
    the flow can give (the demo LM ends sooner; that its limit is the flow's room is tested in process:
    test_hostile_stages)."""
    from cosyvoice_triton.shapes import GRAPHS

    out, err, seconds = infer(triton_server, protocol, "cosyvoice_tts",
                              _tts(speech, text=_bytes(b"[laughter]" * 180)), ["waveform", "sample_rate"])
    assert err is None, (err.status, err.message)
    rate = int(out["sample_rate"].reshape(-1)[0])
    most = GRAPHS["flow_encoder"].axes["tokens"].max / 25  # seconds of speech the flow can give (25 tokens/s)
    assert 0 < out["waveform"].size <= most * rate and np.isfinite(out["waveform"]).all()
    print(f"{protocol}: {out['waveform'].size / rate:.1f} s of speech in {seconds:.1f} s (loaded machine)")
    assert _all_ready(triton_server)
