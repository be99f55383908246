"""CosyVoice3's DiT estimator and vocoder generator served as graphs (tunable ``cosyvoice3_onnx_dir``) by a real
``tritonserver``: ``cosyvoice3_vc`` (two instances, two requests at a time each: ``cosyvoice3_concurrency=2``) answers
what the library answers with the same graphs in process, every Euler step goes to ``flow3_estimator`` and the
vocoder's generator to ``hift3_decoder``, and the steps of three
requests converted at once, in one instance and across both, share the graph's executions (Triton's dynamic batcher,
a 300 ms queue delay so that the requests' steps meet); two TTS streams at once on one ``cosyvoice3_tts_stream``
instance (its LM in-flight batch, the graphs) each stream what the library streams alone."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from conftest import PATIENCE_S, http_post, served

ATOL = 1e-4  # another process, the same graphs and threads: float32 sums in another order at most


@pytest.fixture(scope="module")
def server(serving_assets, cv3_demo_dir, cv3_onnx_dir, tmp_path_factory):
    from cosyvoice_triton.serving.repository import render_repository

    repo = tmp_path_factory.mktemp("cv3graphs") / "model_repository"
    report = render_repository("local", repo, model_dir=serving_assets["model_dir"],
                               onnx_dir=serving_assets["onnx_dir"], max_queue_delay_us=300_000,
                               cosyvoice3_dir=str(cv3_demo_dir), cosyvoice3_onnx_dir=str(cv3_onnx_dir),
                               instances={"cosyvoice3_vc": 2}, cosyvoice3_concurrency=2)
    assert report.models["flow3_estimator"] == report.models["flow3_estimator_streaming"] == \
        "python (onnxruntime, fp32)"
    with served(repo) as s:
        yield s


@pytest.fixture(scope="module")
def library(cv3_demo_dir, cv3_onnx_dir):
    """The library with the same graphs in process."""
    from cosyvoice_triton.serving.stages.cosyvoice3 import Cv3Service
    from cosyvoice_triton.serving.stages.cosyvoice3_graphs import (
        ESTIMATOR_GRAPHS,
        VOCODER_GRAPH,
        GraphDecoder,
        GraphEstimator,
    )
    from cosyvoice_triton.serving.stages.graphs import GraphRunner

    service = Cv3Service.load(cv3_demo_dir)
    full, streaming = (GraphRunner(n, onnx_path=cv3_onnx_dir / f"{n}.onnx").run for n in ESTIMATOR_GRAPHS)
    service.model.flow.estimator_fn = GraphEstimator(full, streaming, service.model.flow.decoder.estimator)
    hift = service.model.hift
    hift.decode_fn = GraphDecoder(GraphRunner(VOCODER_GRAPH, onnx_path=cv3_onnx_dir / f"{VOCODER_GRAPH}.onnx").run,
                                  hift.generate)
    return service


def _request(en_speech, seconds: float) -> dict[str, np.ndarray]:
    p, psr, s, ssr = en_speech
    return {"source_audio": s[None, :int(seconds * ssr)], "source_sample_rate": np.array([[ssr]], np.int32),
            "prompt_audio": p[None], "prompt_sample_rate": np.array([[psr]], np.int32)}


def _convert(server, arrays) -> np.ndarray:
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(server.http_url, network_timeout=PATIENCE_S,
                                          connection_timeout=PATIENCE_S) as client:
        inputs = []
        for name, arr in arrays.items():
            t = httpclient.InferInput(name, list(arr.shape), "FP32" if arr.dtype == np.float32 else "INT32")
            t.set_data_from_numpy(arr)
            inputs.append(t)
        return client.infer("cosyvoice3_vc", inputs).as_numpy("waveform")


def _stats(server, model) -> tuple[int, int]:
    """(requests served, executions) of ``model`` (a request is one Euler step: 2 rows of Triton's
    ``inference_count``)."""
    status, body = server.request("GET", f"/v2/models/{model}/stats", admin=True, timeout=PATIENCE_S)
    assert status == 200, body
    s = json.loads(body)["model_stats"][0]
    return int(s["inference_stats"]["success"].get("count", 0)), int(s.get("execution_count", 0))


def _at_once(calls) -> list:
    """Each call in its own thread, all started together: their results (or exceptions) in order."""
    out: list = [None] * len(calls)

    def run(i):
        try:
            out[i] = calls[i]()
        except Exception as exc:  # the caller asserts on it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PATIENCE_S)
    return out


def test_conversion_on_the_served_graphs_is_the_library_on_them(server, library, en_speech):
    before, vocoder = _stats(server, "flow3_estimator"), _stats(server, "hift3_decoder")
    got = _convert(server, _request(en_speech, 5.0))
    want = library.convert(_request(en_speech, 5.0))["waveform"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    after = _stats(server, "flow3_estimator")
    assert after[0] - before[0] == 10  # the 10 Euler steps, each one request of the graph
    assert _stats(server, "flow3_estimator_streaming")[0] == 0  # a whole conversion: full attention
    assert _stats(server, "hift3_decoder")[0] - vocoder[0] == 1  # one vocoder call, on the generator graph


def test_conversions_at_once_share_the_graphs_executions(server, library, en_speech):
    """Three requests of different lengths at once (two of them on one instance, whose execution gets both): each
    answers what it answers alone, and their 30 steps took fewer executions of the graph than requests (the dynamic
    batcher padded steps of several requests together)."""
    requests = [_request(en_speech, 5.0), _request(en_speech, 4.0), _request(en_speech, 3.0)]
    alone = [library.convert(r)["waveform"] for r in requests]
    before = _stats(server, "flow3_estimator")
    vc_before = _stats(server, "cosyvoice3_vc")
    answers = _at_once([lambda r=r: _convert(server, r) for r in requests])
    for got, want in zip(answers, alone, strict=True):
        assert isinstance(got, np.ndarray), got
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    steps, executions = (a - b for a, b in zip(_stats(server, "flow3_estimator"), before, strict=True))
    vc_requests, vc_executions = (a - b for a, b in zip(_stats(server, "cosyvoice3_vc"), vc_before, strict=True))
    print(f"\nflow3_estimator: {steps} steps of three conversions in {executions} executions; cosyvoice3_vc: "
          f"{vc_requests} requests in {vc_executions} executions")
    assert steps == 30 and vc_requests == 3
    assert executions < steps, "no two steps shared an execution of the graph"


def test_tts_streams_at_once_on_one_instance_are_each_the_library_stream(server, library, en_speech):
    from test_serving_cosyvoice3 import _stream

    p, psr, _, _ = en_speech
    texts = ["Hello there, this is CosyVoice3 on Triton.", "A second voice, speaking at the same time."]
    requests = [{"text": np.array([[t.encode()]], object), "prompt_audio": p[None],
                 "prompt_sample_rate": np.array([[psr]], np.int32),
                 "prompt_text": np.array([[b"the prompt says hello"]], object),
                 "seed": np.array([[i + 1]], np.int64)} for i, t in enumerate(texts)]
    want = [[c["waveform"][0] for c in library.responses(r)] for r in requests]
    vocoder = _stats(server, "hift3_decoder")[0]
    answers = _at_once([lambda r=r: _stream(server, "cosyvoice3_tts_stream", r) for r in requests])
    # every chunk's vocoder window ran on the generator graph
    assert _stats(server, "hift3_decoder")[0] - vocoder == sum(len(c) for c in want)
    for answer, chunks in zip(answers, want, strict=True):
        assert isinstance(answer, tuple), answer
        got, error, final = answer
        assert error is None and final
        assert [c.size for c in got] == [c.size for c in chunks]
        for g, w in zip(got, chunks, strict=True):
            np.testing.assert_allclose(g, w, atol=ATOL)


@pytest.mark.parametrize("case, match", [
    ("frames", "seq_len = 3001 exceeds the maximum 3000"),
    ("nan", "NaN/Inf"),
    ("rank", "unexpected shape for input 'mu'"),  # Triton's own check
])
def test_bad_requests_to_the_graphs_get_400_naming_what_is_wrong(server, case, match):
    """The estimator graphs are public models: a request outside the graph's range or with NaN is the client's
    error (400 naming it), and the server goes on answering."""
    frames = 3001 if case == "frames" else 10
    x = np.zeros((2, 80, frames), np.float32)
    if case == "nan":
        x[0, 0, 0] = np.nan
    tensors = {"x": x, "mask": np.ones((2, 1, frames), np.float32), "mu": np.zeros((2, 80, frames), np.float32),
               "t": np.full((2, 1), 0.5, np.float32), "spks": np.zeros((2, 80), np.float32),
               "cond": np.zeros((2, 80, frames), np.float32)}
    if case == "rank":
        tensors["mu"] = np.zeros((2, 80), np.float32)
    body = {"inputs": [{"name": k, "shape": list(v.shape), "datatype": "FP32",
                        "data": [None if np.isnan(f) else float(f) for f in v.reshape(-1)]}
                       for k, v in tensors.items()]}
    text = json.dumps(body).replace("null", "NaN")
    status, answer = http_post(server.http_url, "/v2/models/flow3_estimator_streaming/infer", text.encode())
    assert status == 400 and match in answer.decode(), (status, answer[:500])
    assert server.is_ready()


@pytest.mark.parametrize("case, match", [
    ("frames", "mel_frames = 1501 exceeds the maximum 1500"),
    ("nan", "NaN/Inf"),
])
def test_bad_requests_to_the_vocoder_graph_get_400_naming_what_is_wrong(server, case, match):
    frames = 1501 if case == "frames" else 10
    mel = np.zeros((1, 80, frames), np.float32)
    if case == "nan":
        mel[0, 0, 0] = np.nan
    tensors = {"mel": mel, "source": np.zeros((1, 1, 480 * frames), np.float32)}
    body = {"inputs": [{"name": k, "shape": list(v.shape), "datatype": "FP32",
                        "data": [None if np.isnan(f) else float(f) for f in v.reshape(-1)]}
                       for k, v in tensors.items()]}
    text = json.dumps(body).replace("null", "NaN")
    status, answer = http_post(server.http_url, "/v2/models/hift3_decoder/infer", text.encode())
    assert status == 400 and match in answer.decode(), (status, answer[:500])
    assert server.is_ready()
