"""Served TTS (``cosyvoice_tts``, ``cosyvoice_tts_stream``) against a real ``tritonserver`` (local flavor, tiny demo).

One server for the module, rendered with a small LM queue (2 rows, 1 waiting) so the queue policy is reachable.
Parity: the served answer equals ``CosyVoice2.tts`` / ``tts_stream`` with the same seed within the fp32 bar
(1e-3: the served graphs run on onnxruntime, the in-process path on PyTorch; the LM runs on PyTorch in both and
samples the same tokens). In-flight batching and cancellation are read from the engine's custom metrics
(``cosyvoice_llm{what=...}`` on the metrics port).
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.request

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, rel_err, served, wait_until

TEXT = "Hello there, this is a test of the served pipeline."
LONG_TEXT = ("This is a much longer sentence that keeps the language model busy for a good while, so that a "
             "client can walk away in the middle of it and the server has to notice.")
PROMPT_TEXT = "the prompt says hello"
SEED = 5


@pytest.fixture(scope="module")
def prompt():
    wave, sr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return wave[: int(1.5 * sr)], sr


@pytest.fixture(scope="module")
def server(serving_assets, tmp_path_factory):
    from cosyvoice_triton.serving.repository import render_repository

    repo = tmp_path_factory.mktemp("tts") / "model_repository"
    report = render_repository("local", repo, model_dir=serving_assets["model_dir"],
                               onnx_dir=serving_assets["onnx_dir"], max_queue_delay_us=5000, max_active_requests=2,
                               max_waiting_requests=1, tts_wait_timeout_s=PATIENCE_S)
    assert report.models["cosyvoice_tts_stream"] == "python (decoupled)"
    with served(repo) as s:
        yield s


@pytest.fixture(scope="module")
def reference(serving_assets):
    from cosyvoice_triton.pipeline import CosyVoice2

    return CosyVoice2.from_pretrained(serving_assets["model_dir"])


def _inputs(mod, prompt, text=TEXT, **extra):
    wave, sr = prompt
    if not isinstance(text, np.ndarray):
        text = np.array([[text.encode() if isinstance(text, str) else text]], object)
    arrays = {"text": text,
              "prompt_audio": wave[None].astype(np.float32), "prompt_sample_rate": np.array([[sr]], np.int32),
              "prompt_text": np.array([[PROMPT_TEXT.encode()]], object), "seed": np.array([[SEED]], np.int64)}
    for k, v in extra.items():
        if v is None:
            arrays.pop(k, None)
        else:
            arrays[k] = v
    out = []
    for name, arr in arrays.items():
        dtype = "BYTES" if arr.dtype == object else {"float32": "FP32", "int32": "INT32", "int64": "INT64",
                                                     "bool": "BOOL"}[str(arr.dtype)]
        t = mod.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _bytes(s):
    return np.array([[s]], object)


def _stream(server, inputs_fn, *, model="cosyvoice_tts_stream", cancel_after=None, timeout=PATIENCE_S):
    """Run one gRPC stream: (chunks, error, final_seen)."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, inputs_fn(grpcclient), enable_empty_final_response=True)
    chunks, error, final = [], None, False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                result, err = results.get(timeout=1)
            except queue.Empty:
                continue
            if err is not None:
                error = err
                break
            wave = result.as_numpy("waveform")
            if wave is not None:
                index = result.as_numpy("chunk_index")  # absent from cosyvoice_tts
                chunks.append((-1 if index is None else int(index.reshape(-1)[0]), wave.reshape(-1)))
            if result.get_response().parameters["triton_final_response"].bool_param:
                final = True
                break
            if cancel_after is not None and len(chunks) >= cancel_after:
                break
        else:
            raise AssertionError(f"stream did not finish within {timeout} s")
    finally:
        client.stop_stream(cancel_requests=cancel_after is not None)
        client.close()
    return chunks, error, final


def _metrics(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^cosyvoice_llm\{([^}]*)\} (\S+)$', text, re.M):
        what = re.search(r'what="([^"]+)"', m.group(1)).group(1)
        out[what] = out.get(what, 0.0) + float(m.group(2))
    assert out, "no cosyvoice_llm metrics on the metrics port"
    return out


def _quiet_metrics(server) -> dict[str, float]:
    """The LM gauges once nothing is active and they hold still across several of the model's 0.1 s refreshes (a
    busy machine delays a refresh: one read may still miss a stream that has ended)."""
    def quiet():
        first = _metrics(server)
        time.sleep(0.5)
        second = _metrics(server)
        return second if second == first and second["active"] == 0 else None

    return wait_until(quiet, "the LM gauges quiet (nothing active, no change across 0.5 s)", interval=0.1)


# ----------------------------------------------------------------------------------------------- parity


def test_non_streaming_http_and_grpc_equal_in_process(server, prompt, reference):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(server.http_url, network_timeout=PATIENCE_S) as c:
        res = c.infer("cosyvoice_tts", _inputs(httpclient, prompt))
    wave = res.as_numpy("waveform").reshape(-1)
    assert int(res.as_numpy("sample_rate").reshape(-1)[0]) == 24000
    g = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        res_grpc = g.infer("cosyvoice_tts", _inputs(grpcclient, prompt), client_timeout=PATIENCE_S)
        wave_grpc = res_grpc.as_numpy("waveform")
    finally:
        g.close()
    np.testing.assert_array_equal(wave_grpc.reshape(-1), wave)
    ref = reference.tts(TEXT, prompt_audio=prompt[0], prompt_sr=prompt[1], prompt_text=PROMPT_TEXT, seed=SEED)
    assert wave.shape == ref.shape
    assert rel_err(wave, ref) < 1e-3


def test_streamed_chunks_equal_in_process_chunks(server, prompt, reference):
    chunks, error, final = _stream(server, lambda mod: _inputs(mod, prompt))
    assert error is None and final
    ref = list(reference.tts_stream(TEXT, prompt_audio=prompt[0], prompt_sr=prompt[1], prompt_text=PROMPT_TEXT,
                                    seed=SEED, stream=True))
    assert [i for i, _ in chunks] == list(range(len(ref)))
    assert len(ref) >= 2  # the schedule really chunked this text
    for (_, got), want in zip(chunks, ref, strict=True):
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-3


def test_encoded_prompt_and_modes(server, prompt):
    data = (FIXTURES / "prompt_en_3s.wav").read_bytes()
    chunks, error, _ = _stream(server, lambda mod: _inputs(mod, prompt, prompt_audio=None, prompt_sample_rate=None,
                                                           prompt_audio_bytes=_bytes(data), prompt_text=None,
                                                           mode=_bytes(b"cross_lingual"), stream=np.array([[False]])))
    assert error is None and len(chunks) == 1 and chunks[0][1].size > 0
    chunks, error, _ = _stream(server, lambda mod: _inputs(mod, prompt, prompt_text=None,
                                                           instruct_text=_bytes(b"Speak slowly.<|endofprompt|>"),
                                                           stream=np.array([[False]])))
    assert error is None and chunks[0][1].size > 0


# ------------------------------------------------------------------------- in-flight batching, cancel


def test_overlapping_streams_decode_in_the_same_lm_steps(server, prompt):
    # Each request computes its prompt first (BLS), so on a loaded machine one may finish decoding before the
    # other joins: up to 3 rounds of 3 concurrent requests, and one round must show shared steps.
    rounds = []
    for _ in range(3):
        before = _quiet_metrics(server)
        out: list = [None] * 3
        start = threading.Barrier(3)

        def run(i, out=out, start=start):
            start.wait()
            out[i] = _stream(server, lambda mod: _inputs(mod, prompt, text=LONG_TEXT, seed=np.array([[i]], np.int64)))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PATIENCE_S + 60)
        assert all(o is not None and o[1] is None and o[2] for o in out), out
        # the metrics are refreshed every 0.1 s: wait for the refresh that has the three streams finished
        after = wait_until(lambda before=before: (now := _metrics(server))["streams_finished"]
                           >= before["streams_finished"] + 3 and now, "the three streams counted as finished")
        steps = after["steps"] - before["steps"]
        request_steps = after["request_steps"] - before["request_steps"]
        rounds.append((steps, request_steps))
        # requests decoded one after the other need request_steps steps; together they share steps
        if request_steps > steps:
            break
    assert rounds[-1][1] > rounds[-1][0], rounds
    assert after["max_batch"] >= 2


def test_cancelled_stream_frees_its_lm_row(server, prompt, reference):
    text = LONG_TEXT * 3
    segments = len(reference._text().tts_segments(text))
    assert segments >= 2
    before = _quiet_metrics(server)
    chunks, error, final = _stream(server, lambda mod: _inputs(mod, prompt, text=text), cancel_after=1)
    assert error is None and len(chunks) == 1 and not final
    now = wait_until(lambda: (m := _metrics(server))["streams_cancelled"] > before["streams_cancelled"]
                     and m["active"] == 0 and m, f"the cancelled stream stopped (before: {before})", interval=0.2)
    assert now["streams_finished"] == before["streams_finished"]  # it stopped before its natural end
    # its LM work stopped too: the segment decoding at the time left the batch, or the next ones never joined
    left_early = now["cancelled"] - before["cancelled"]
    joined = now["admitted"] - before["admitted"]
    assert left_early == 1 or joined < segments, (left_early, joined, segments)
    chunks, error, final = _stream(server, lambda mod: _inputs(mod, prompt, stream=np.array([[False]])))
    assert error is None and final and chunks  # and the server keeps serving


def test_lm_engine_cancel_and_queue_policy(serving_assets):
    """In process: a cancelled job leaves the running batch at once; a full queue refuses; nothing hangs."""
    from cosyvoice_triton.config import ModelConfig
    from cosyvoice_triton.models.llm import LMRequest, load_llm
    from cosyvoice_triton.serving.stages.lm_engine import EngineBusy, JobCancelled, LMEngine

    md = serving_assets["model_dir"]
    lm = load_llm(md, ModelConfig.from_yaml(md / "cosyvoice2.yaml"))
    engine = LMEngine(lm, max_active=1, max_waiting=1, wait_timeout_s=PATIENCE_S)
    try:
        long = LMRequest(list(range(1, 60)), draws=1, min_token_text_ratio=20)  # at least 1180 tokens
        job = engine.submit(long)
        waiting = engine.submit(LMRequest([5, 6, 7], draws=2))
        with pytest.raises(EngineBusy, match="too many concurrent"):
            engine.submit(LMRequest([5, 6, 7], draws=3))
        tokens = job.tokens()
        first = [next(tokens) for _ in range(5)]
        assert len(first) == 5
        job.cancel()
        with pytest.raises(JobCancelled):
            list(tokens)
        assert len(list(waiting.tokens())) >= 6  # the freed row went to the waiting job
        snap = engine.snapshot()
        assert snap["cancelled"] == 1 and snap["finished"] == 1 and snap["refused"] == 1 and snap["active"] == 0
        assert snap["request_steps"] < 1180  # the long one stopped early
    finally:
        engine.close()


def test_too_many_streams_are_refused_not_hung(server, prompt):
    out: list = [None] * 5

    def run(i):
        out[i] = _stream(server, lambda mod: _inputs(mod, prompt, text=LONG_TEXT, seed=np.array([[i]], np.int64)),
                         timeout=2 * PATIENCE_S)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * PATIENCE_S + 30)
    errors = [str(o[1]) for o in out if o[1] is not None]
    assert all(o is not None for o in out)
    assert errors and all("too many concurrent TTS requests" in e for e in errors), errors
    assert sum(o[2] for o in out) >= 3  # 2 rows + 1 waiting always get through


# -------------------------------------------------------------------------------------------- bad input

BAD = [
    ({"text": _bytes(b"")}, "empty"),
    ({"text": _bytes(b"?!... ,")}, "only punctuation"),
    ({"text": _bytes(b"a" * 2001)}, "more than the maximum"),
    ({"text": _bytes(b"\xff\xfe hello")}, "UTF-8"),
    ({"text": _bytes(b"hello [nonsense_tag] world")}, "unknown control tag"),
    ({"prompt_audio": None, "prompt_sample_rate": None}, "without prompt audio"),
    ({"mode": _bytes(b"karaoke")}, "mode must be one of"),
    ({"mode": _bytes(b"instruct")}, "needs instruct_text"),
    ({"prompt_audio": None, "prompt_sample_rate": None, "prompt_text": None, "speaker_id": _bytes(b"nobody")},
     "speaker_id 'nobody'"),
    ({"prompt_sample_rate": np.array([[7]], np.int32)}, "sample"),
]


@pytest.mark.parametrize("extra, words", BAD, ids=[w for _, w in BAD])
def test_bad_input_http(server, prompt, extra, words):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    with httpclient.InferenceServerClient(server.http_url, network_timeout=PATIENCE_S) as c:
        with pytest.raises(InferenceServerException) as info:
            c.infer("cosyvoice_tts", _inputs(httpclient, prompt, **extra))
        assert info.value.status() == "400", (info.value.status(), info.value.message())
        assert words in info.value.message()
        assert c.is_server_live() and c.is_model_ready("cosyvoice_tts")


@pytest.mark.parametrize("extra, words", BAD, ids=[w for _, w in BAD])
def test_bad_input_grpc_stream(server, prompt, extra, words):
    chunks, error, _ = _stream(server, lambda mod: _inputs(mod, prompt, **extra), timeout=PATIENCE_S)
    assert error is not None and not chunks
    assert words in str(error), str(error)


def test_wrong_protocol_for_the_model_kind(server, prompt):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    with httpclient.InferenceServerClient(server.http_url) as c, pytest.raises(InferenceServerException) as info:
        c.infer("cosyvoice_tts_stream", _inputs(httpclient, prompt))
    assert "decoupled" in info.value.message() or info.value.status() in ("400", "501")
    g = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            g.infer("cosyvoice_tts_stream", _inputs(grpcclient, prompt), client_timeout=60)
        assert "decoupled" in info.value.message()
    finally:
        g.close()
    # HTTP generate (one answer) on the decoupled model: Triton's message says to use generate_stream
    body = {"text": TEXT, "prompt_audio": prompt[0].tolist(), "prompt_sample_rate": prompt[1], "seed": SEED}
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/cosyvoice_tts_stream/generate",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=PATIENCE_S) as r:  # Triton 2.51 answers this error with status 200
        assert "use generate stream" in json.loads(r.read())["error"]
    # the reverse: Triton serves a non-decoupled model over a stream, as one final response, on both protocols
    chunks, error, final = _stream(server, lambda mod: _inputs(mod, prompt), model="cosyvoice_tts")
    assert error is None and final and len(chunks) == 1 and chunks[0][1].size > 0
    from cosyvoice_triton.clients.client import TTSClient

    with TTSClient(server.http_url, protocol="http", timeout=PATIENCE_S) as c:
        http_chunks = list(c.tts_stream(TEXT, prompt=prompt[0], prompt_sr=prompt[1], prompt_text=PROMPT_TEXT,
                                        seed=SEED, model="cosyvoice_tts"))
    assert len(http_chunks) == 1
    np.testing.assert_array_equal(http_chunks[0].waveform, chunks[0][1])


def test_http_generate_stream_serves_the_decoupled_model(server, prompt):
    """Triton 2.51 serves a decoupled Python model over HTTP's generate_stream (server-sent events): the same
    chunks as the gRPC stream."""
    wave, sr = prompt
    body = {"text": TEXT, "prompt_audio": wave.tolist(), "prompt_sample_rate": sr, "prompt_text": PROMPT_TEXT,
            "seed": SEED}
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/cosyvoice_tts_stream/generate_stream",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=PATIENCE_S) as r:
        events = [json.loads(line[len("data: "):]) for line in r.read().decode().splitlines()
                  if line.startswith("data: ")]
    chunks = [e for e in events if "waveform" in e]
    grpc_chunks, error, _ = _stream(server, lambda mod: _inputs(mod, prompt))
    assert error is None and [c["chunk_index"] for c in chunks] == [i for i, _ in grpc_chunks]
    for c, (_, g) in zip(chunks, grpc_chunks, strict=True):
        assert c["sample_rate"] == 24000
        np.testing.assert_allclose(np.asarray(c["waveform"], np.float32), g, atol=1e-6)


def test_registered_speaker_equals_its_prompt(server, prompt):
    """TTS by speaker_id (fetched from the speakers model by BLS) == TTS with the same prompt audio and text.

    A speaker's requests prefill the LM after the shared KV cache of sos + its transcript (lm_prefix_cache_mb):
    the first computes it, the second reuses it; both equal the prompt-audio request, which prefills all."""
    from cosyvoice_triton.clients.client import VCClient

    wave, sr = prompt
    with VCClient(server.http_url, timeout=PATIENCE_S) as c:
        c.register_speaker("tts_alice", wave, prompt_sr=sr, prompt_text=PROMPT_TEXT)
        try:
            by_id = c.tts(TEXT, speaker_id="tts_alice", seed=SEED)
            again = c.tts(TEXT, speaker_id="tts_alice", seed=SEED)
            by_audio = c.tts(TEXT, prompt=wave, prompt_sr=sr, prompt_text=PROMPT_TEXT, seed=SEED)
        finally:
            c.delete_speaker("tts_alice")
    np.testing.assert_allclose(by_id.waveform, by_audio.waveform, atol=1e-5)
    np.testing.assert_array_equal(again.waveform, by_id.waveform)


def test_the_client_example_runs(server, tmp_path):
    """clients/cosyvoice_client.py, the library's short example: register, streamed TTS, VC, delete."""
    import subprocess
    import sys

    root = FIXTURES.parent.parent
    proc = subprocess.run([sys.executable, str(root / "clients" / "cosyvoice_client.py"),
                           str(FIXTURES / "prompt_en_3s.wav"), PROMPT_TEXT, str(FIXTURES / "source_en_5s.wav"),
                           server.grpc_url], cwd=tmp_path, capture_output=True, text=True, timeout=PATIENCE_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "chunk 1:" in proc.stdout  # streamed: more than one chunk
    for name in ("example_tts.wav", "example_vc.wav"):
        wave, sr = sf.read(tmp_path / name)
        assert sr == 24000 and len(wave) > sr // 2 and np.abs(wave).max() > 0
