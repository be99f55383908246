"""CosyVoice3's vocoder served in onnxruntime's CPU INT8 (tunables ``cosyvoice3_onnx_dir`` and
``cosyvoice3_vocoder_precision=int8_cpu``) by a real ``tritonserver``: ``cosyvoice3_vc`` answers what the library
answers in process on the same graphs (the fp32 DiT estimator, the INT8 vocoder), its vocoder call reaches
``hift3_decoder``, and the answer is the INT8 graph's, not the fp32 one's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import PATIENCE_S, int8_vocoder_marked, served

ATOL = 1e-4  # another process, the same graphs and threads


@pytest.fixture(scope="module")
def onnx3(cv3_int8_vocoder, tmp_path_factory):
    return int8_vocoder_marked(cv3_int8_vocoder[0], tmp_path_factory.mktemp("cv3int8served") / "onnx3", True)


@pytest.fixture(scope="module")
def server(serving_assets, cv3_demo_dir, onnx3, tmp_path_factory):
    from cosyvoice_triton.serving.repository import render_repository

    repo = tmp_path_factory.mktemp("cv3int8repo") / "model_repository"
    report = render_repository("local", repo, model_dir=serving_assets["model_dir"],
                               onnx_dir=serving_assets["onnx_dir"], cosyvoice3_dir=str(cv3_demo_dir),
                               cosyvoice3_onnx_dir=str(onnx3), cosyvoice3_vocoder_precision="int8_cpu")
    assert report.models["hift3_decoder"] == "python (onnxruntime, int8_cpu)"
    with served(repo) as s:
        yield s


def _library(cv3_demo_dir, onnx3, vocoder_path):
    from cosyvoice_triton.serving.stages.cosyvoice3 import Cv3Service
    from cosyvoice_triton.serving.stages.cosyvoice3_graphs import (
        ESTIMATOR_GRAPHS,
        VOCODER_GRAPH,
        GraphDecoder,
        GraphEstimator,
    )
    from cosyvoice_triton.serving.stages.graphs import GraphRunner

    service = Cv3Service.load(cv3_demo_dir, tts=False)
    full, streaming = (GraphRunner(n, onnx_path=onnx3 / f"{n}.onnx").run for n in ESTIMATOR_GRAPHS)
    service.model.flow.estimator_fn = GraphEstimator(full, streaming, service.model.flow.decoder.estimator)
    hift = service.model.hift
    hift.decode_fn = GraphDecoder(GraphRunner(VOCODER_GRAPH, onnx_path=vocoder_path).run, hift.generate)
    return service


def _request(en_speech) -> dict[str, np.ndarray]:
    p, psr, s, ssr = en_speech
    return {"source_audio": s[None, :4 * ssr], "source_sample_rate": np.array([[ssr]], np.int32),
            "prompt_audio": p[None], "prompt_sample_rate": np.array([[psr]], np.int32)}


def _vocoder_calls(server) -> int:
    status, body = server.request("GET", "/v2/models/hift3_decoder/stats", admin=True, timeout=PATIENCE_S)
    assert status == 200, body
    return int(json.loads(body)["model_stats"][0]["inference_stats"]["success"].get("count", 0))


def test_the_served_conversion_runs_the_int8_vocoder(server, cv3_demo_dir, onnx3, en_speech):
    import tritonclient.http as httpclient

    before = _vocoder_calls(server)
    with httpclient.InferenceServerClient(server.http_url, network_timeout=PATIENCE_S,
                                          connection_timeout=PATIENCE_S) as client:
        inputs = []
        for name, arr in _request(en_speech).items():
            t = httpclient.InferInput(name, list(arr.shape), "FP32" if arr.dtype == np.float32 else "INT32")
            t.set_data_from_numpy(arr)
            inputs.append(t)
        got = client.infer("cosyvoice3_vc", inputs).as_numpy("waveform")
    assert _vocoder_calls(server) - before == 1
    int8 = _library(cv3_demo_dir, onnx3, onnx3 / "int8_cpu" / "hift3_decoder.onnx").convert(
        _request(en_speech))["waveform"]
    fp32 = _library(cv3_demo_dir, onnx3, onnx3 / "hift3_decoder.onnx").convert(_request(en_speech))["waveform"]
    assert got.shape == int8.shape == fp32.shape
    np.testing.assert_allclose(got, int8, atol=ATOL, rtol=0)
    assert np.abs(got - fp32).max() > 1e-3 * np.abs(fp32).max()  # the INT8 graph's answer, not the fp32 one's
