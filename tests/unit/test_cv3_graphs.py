"""CosyVoice3's DiT estimator and vocoder generator as served graphs (``serving/stages/cosyvoice3_graphs.py``): the
flow's Euler steps on the exported graphs equal the DiT in process, each step on the graph of its attention variant;
a padded batch of steps equals each step alone; steps outside the graph's range run on the DiT; the vocoder on its
generator graph equals the vocoder in process, whole and streamed (the held frames, the bounded window); the render
serves the graphs behind the dynamic batcher and points every CosyVoice3 model at them, and refuses what cannot
work."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import rel_err

from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.serving.repository import render_repository
from cosyvoice_triton.serving.repository.templates import RenderError
from cosyvoice_triton.serving.stages.cosyvoice3 import Cv3Service
from cosyvoice_triton.serving.stages.cosyvoice3_graphs import (
    ESTIMATOR_GRAPHS,
    VOCODER_GRAPH,
    GraphDecoder,
    GraphEstimator,
)
from cosyvoice_triton.serving.stages.graphs import GraphRunner

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CV3_MODELS = ("cosyvoice3_vc", "cosyvoice3_tts_stream", "cosyvoice3_tts_live", "cosyvoice3_vc_live")


@pytest.fixture(scope="module")
def flow(cv3_demo_dir):
    return Cv3Service.load(cv3_demo_dir, tts=False).model.flow


@pytest.fixture(scope="module")
def runners(cv3_onnx_dir):
    return {name: GraphRunner(name, onnx_path=cv3_onnx_dir / f"{name}.onnx") for name in ESTIMATOR_GRAPHS}


def _inputs(flow, n_tokens=40, n_prompt=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = flow.dims
    tokens = torch.randint(0, d.vocab_size, (1, n_tokens), generator=g, dtype=torch.int32)
    prompt = torch.randint(0, d.vocab_size, (1, n_prompt), generator=g, dtype=torch.int32)
    feat = torch.randn(1, n_prompt * flow.token_mel_ratio, d.output_size, generator=g) * 0.5
    return tokens, prompt, feat, torch.randn(1, d.spk_embed_dim, generator=g)


@pytest.mark.parametrize("streaming", [False, True])
def test_the_flow_steps_on_the_graphs_equal_the_dit_in_process(flow, runners, streaming):
    """120 mel frames with the prompt (above the DiT's 50-frame attention chunk, so the variants differ): the mel of
    the flow with the graph estimator is the local one's; all 10 steps went to the variant ``streaming`` picks."""
    calls = {name: 0 for name in ESTIMATOR_GRAPHS}

    def on(name):
        def call(feeds):
            calls[name] += 1
            return runners[name].run(feeds)
        return call

    args = _inputs(flow)
    kw = {"streaming": streaming, "finalize": not streaming}
    local, _ = flow.inference(*args, **kw)
    est = GraphEstimator(on("flow3_estimator"), on("flow3_estimator_streaming"), flow.decoder.estimator)
    flow.estimator_fn = est
    try:
        served, _ = flow.inference(*args, **kw)
    finally:
        flow.estimator_fn = None
    err = rel_err(served, local)
    assert err < 1e-3, err
    used = ESTIMATOR_GRAPHS[1] if streaming else ESTIMATOR_GRAPHS[0]
    assert calls == {name: (10 if name == used else 0) for name in ESTIMATOR_GRAPHS}
    assert (est.graph_steps, est.local_steps) == (10, 0)
    other, _ = flow.inference(*args, streaming=not streaming, finalize=not streaming)
    assert rel_err(other, local) > 10 * err  # the variants differ here: the count above tells them apart


def _step(flow, frames, seed):
    g = torch.Generator().manual_seed(seed)
    d = flow.dims.output_size
    x, mu, cond = (torch.randn(2, d, frames, generator=g) for _ in range(3))
    return {"x": x.numpy(), "mask": np.ones((2, 1, frames), np.float32), "mu": mu.numpy(),
            "t": np.full(2, 0.3, np.float32), "spks": torch.randn(2, d, generator=g).numpy(), "cond": cond.numpy()}


@pytest.mark.parametrize("name", ESTIMATOR_GRAPHS)
def test_a_padded_batch_of_steps_equals_each_step_alone(flow, runners, name, monkeypatch):
    runner = runners[name]
    items = [_step(flow, 70, 1), _step(flow, 43, 2), _step(flow, 70, 3)]
    alone = [runner.run(item)["estimator_out"] for item in items]
    calls = []
    real = runner._call
    monkeypatch.setattr(runner, "_call", lambda feeds: calls.append(feeds["x"].shape) or real(feeds))
    results = runner.run_items(items)
    assert calls == [(6, 80, 70)]  # one call: the 43-frame request padded to 70
    for r, a in zip(results, alone, strict=True):
        assert r.error is None
        assert r.value["estimator_out"].shape == a.shape
        assert rel_err(r.value["estimator_out"], a) < 1e-5


def test_steps_outside_the_graphs_range_run_on_the_dit(flow):
    def refuse(feeds):
        raise AssertionError("the graph was called")

    est = GraphEstimator(refuse, refuse, flow.decoder.estimator)
    feeds = {k: torch.from_numpy(v) for k, v in _step(flow, 3, 4).items()}  # 3 frames: below the graph's 4
    args = (feeds["x"], feeds["mask"], feeds["mu"], feeds["t"], feeds["spks"], feeds["cond"])
    out = est(*args, False)
    assert (est.graph_steps, est.local_steps) == (0, 1)
    assert torch.equal(out, flow.decoder.estimator(*args, False))
    with pytest.raises(CosyVoiceError, match="one attention variant per call"):
        est(*args, torch.tensor([True, False]))


# --------------------------------------------------------------------------------------------------- vocoder
@pytest.fixture(scope="module")
def hift(cv3_demo_dir):
    return Cv3Service.load(cv3_demo_dir, tts=False).model.hift


def _mel(frames: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 80, frames, generator=g) * 2 - 5


def test_the_vocoder_on_its_generator_graph_equals_the_vocoder_in_process(hift, cv3_onnx_dir):
    """Whole (finalize) and held (finalize=False: the prefix of the graph's finalized decode) calls, and a stream on
    the bounded vocoder window, each within the graphs' fp32 bar of the vocoder in process; every call went to the
    graph."""
    from cosyvoice_triton.models.cosyvoice3.window import VocoderWindow

    runner = GraphRunner(VOCODER_GRAPH, onnx_path=cv3_onnx_dir / f"{VOCODER_GRAPH}.onnx")
    mel = _mel(130)
    local = {final: hift.inference(mel, finalize=final)[0] for final in (True, False)}
    window = VocoderWindow(hift)
    local_stream = np.concatenate([window(mel[:, :, lo:lo + 40], final=lo + 40 >= 130) for lo in range(0, 130, 40)])
    dec = GraphDecoder(runner.run, hift.generate)
    hift.decode_fn = dec
    try:
        served = {final: hift.inference(mel, finalize=final)[0] for final in (True, False)}
        window = VocoderWindow(hift)
        stream = np.concatenate([window(mel[:, :, lo:lo + 40], final=lo + 40 >= 130) for lo in range(0, 130, 40)])
    finally:
        hift.decode_fn = None
    for final in (True, False):
        assert served[final].shape == local[final].shape
        assert rel_err(served[final], local[final]) < 1e-4, final
    assert stream.shape == local_stream.shape and rel_err(stream, local_stream) < 1e-4
    assert dec.graph_calls == 2 + 4 and dec.local_calls == 0


def test_vocoder_calls_outside_the_graphs_range_run_in_process(hift):
    def refuse(feeds):
        raise AssertionError("the graph was called")

    dec = GraphDecoder(refuse, hift.generate)
    mel = _mel(3)  # below the graph's 4 frames
    source = hift.source_from_f0(hift.predict_f0(mel))
    out = dec(mel, source)
    assert (dec.graph_calls, dec.local_calls) == (0, 1)
    assert torch.equal(out, hift.decode(mel, source))


# ---------------------------------------------------------------------------------------------------- render
def _param(repo, model, key) -> str:
    text = (repo / model / "config.pbtxt").read_text()
    found = re.search(rf'key: "{key}"\s*value: \{{\s*string_value: "([^"]*)"', text)
    assert found, text[:2000]
    return found.group(1)


def _estimator_models(repo, model) -> str:
    return _param(repo, model, "estimator_models")


def _render(serving_assets, repo, flavor="local", **tunables):
    return render_repository(flavor, repo, model_dir=serving_assets["model_dir"],
                             onnx_dir=serving_assets["onnx_dir"], **tunables)


def test_the_render_serves_the_graphs_and_points_the_cosyvoice3_models_at_them(serving_assets, cv3_demo_dir,
                                                                               cv3_onnx_dir, tmp_path):
    report = _render(serving_assets, tmp_path / "graphs", cosyvoice3_dir=str(cv3_demo_dir),
                     cosyvoice3_onnx_dir=str(cv3_onnx_dir), instances={"flow3_estimator": 2})
    for name in (*ESTIMATOR_GRAPHS, VOCODER_GRAPH):
        assert report.models[name] == "python (onnxruntime, fp32)"
        text = (tmp_path / "graphs" / name / "config.pbtxt").read_text()
        assert "dynamic_batching {" in text
        assert f"max_batch_size: {16 if name == VOCODER_GRAPH else 32}\n" in text
        assert f'string_value: "{cv3_onnx_dir / name}.onnx"' in text
        assert (tmp_path / "graphs" / name / "1" / "model.py").is_file()
    assert "count: 2" in (tmp_path / "graphs" / "flow3_estimator" / "config.pbtxt").read_text()
    for model in CV3_MODELS:
        assert _estimator_models(tmp_path / "graphs", model) == ",".join(ESTIMATOR_GRAPHS)
        assert _param(tmp_path / "graphs", model, "vocoder_model") == VOCODER_GRAPH

    report = _render(serving_assets, tmp_path / "plain", cosyvoice3_dir=str(cv3_demo_dir))
    assert not {*ESTIMATOR_GRAPHS, VOCODER_GRAPH} & set(report.models)
    for model in CV3_MODELS:
        assert _estimator_models(tmp_path / "plain", model) == ""
        assert _param(tmp_path / "plain", model, "vocoder_model") == ""

    report = _render(serving_assets, tmp_path / "onnx", "onnx", cosyvoice3_dir=str(cv3_demo_dir),
                     cosyvoice3_onnx_dir=str(cv3_onnx_dir))
    for name in (*ESTIMATOR_GRAPHS, VOCODER_GRAPH):
        assert report.models[name] == "onnxruntime (fp32)"
        assert (tmp_path / "onnx" / name / "1" / "model.onnx").read_bytes() == (
            cv3_onnx_dir / f"{name}.onnx").read_bytes()
        assert 'backend: "onnxruntime"' in (tmp_path / "onnx" / name / "config.pbtxt").read_text()


def test_the_render_refuses_graphs_that_cannot_serve(serving_assets, cv3_demo_dir, cv3_onnx_dir, tmp_path):
    with pytest.raises(RenderError, match="cosyvoice3_onnx_dir needs cosyvoice3_dir"):
        _render(serving_assets, tmp_path / "a", cosyvoice3_onnx_dir=str(cv3_onnx_dir))
    with pytest.raises(RenderError, match="needs cosyvoice3_flow_precision=fp32"):
        _render(serving_assets, tmp_path / "b", cosyvoice3_dir=str(cv3_demo_dir),
                cosyvoice3_onnx_dir=str(cv3_onnx_dir), cosyvoice3_flow_precision="int8")
    other = tmp_path / "other"
    shutil.copytree(cv3_onnx_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["graphs"]["flow3_estimator"]["source"]["sha256"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RenderError, match="flow3_estimator of .* exported from another flow.pt"):
        _render(serving_assets, tmp_path / "c", cosyvoice3_dir=str(cv3_demo_dir), cosyvoice3_onnx_dir=str(other))
    manifest["graphs"]["flow3_estimator"]["source"]["sha256"] = manifest["graphs"]["flow3_estimator_streaming"][
        "source"]["sha256"]
    manifest["graphs"][VOCODER_GRAPH]["source"]["sha256"] = "1" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RenderError, match="hift3_decoder of .* exported from another hift.pt"):
        _render(serving_assets, tmp_path / "c2", cosyvoice3_dir=str(cv3_demo_dir), cosyvoice3_onnx_dir=str(other))
    (other / "flow3_estimator_streaming.onnx").unlink()
    with pytest.raises(RenderError, match="flow3_estimator_streaming.onnx not found"):
        _render(serving_assets, tmp_path / "d", cosyvoice3_dir=str(cv3_demo_dir), cosyvoice3_onnx_dir=str(other))
    assert not (tmp_path / "d").exists()  # refused before anything is written


def test_the_concurrency_tunable_reaches_every_cosyvoice3_model(serving_assets, cv3_demo_dir, tmp_path):
    """``cosyvoice3_concurrency``: every CosyVoice3 model's ``concurrency``; ``cosyvoice3_vc`` takes that many
    requests per execution (each in its own thread), the decoupled ones one (their workers run at once)."""
    _render(serving_assets, tmp_path / "r", cosyvoice3_dir=str(cv3_demo_dir), cosyvoice3_concurrency=3)
    for model in CV3_MODELS:
        text = (tmp_path / "r" / model / "config.pbtxt").read_text()
        assert re.search(r'key: "concurrency"\s*value: \{\s*string_value: "3"', text), model
        assert f"max_batch_size: {3 if model == 'cosyvoice3_vc' else 1}\n" in text, model
    with pytest.raises(RenderError, match="cosyvoice3_concurrency must be >= 1"):
        _render(serving_assets, tmp_path / "s", cosyvoice3_dir=str(cv3_demo_dir), cosyvoice3_concurrency=0)
