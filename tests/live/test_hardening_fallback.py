"""A graph whose call fails for a reason that is not the input's is served once more on its fallback (the fp32
graph of the export, or the CPU), counted; bad input and a failing fallback are not hidden.

The count is exported as ``cosyvoice_fallbacks_total{model,version,graph,outcome}`` by the graph models: in
process on the stand-in of Triton's metrics API, and live: a versioned repository whose live version serves
``flow_encoder`` from a graph that loads but fails at run time (a Reshape no input size satisfies: an engine
error, not the input's), with the render's ``fallback.onnx`` beside it; the server answers with the fp32 graph's
output and its metrics port counts the request under that model, version and graph."""

from __future__ import annotations

import shutil
import types
import urllib.request

import numpy as np
import pb_standin
import pytest
from conftest import served

from cosyvoice_triton.loadtest.metrics import counter_total, parse_prometheus
from cosyvoice_triton.serving.repository import graph_warmup_samples
from cosyvoice_triton.serving.stages import graphs
from cosyvoice_triton.serving.stages import metrics as m
from cosyvoice_triton.serving.stages.batching import RequestError
from cosyvoice_triton.serving.stages.graphs import GraphRunner, fallback_counts
from cosyvoice_triton.serving.stages.triton_io import from_request_shape, to_request_shape
from cosyvoice_triton.shapes import GRAPHS

GRAPH = "flow_encoder"


@pytest.fixture(scope="module")
def export_dirs(serving_assets, tmp_path_factory):
    """``<root>/fp32/<graph>.onnx`` and a stand-in reduced precision ``<root>/int8_cpu/<graph>.onnx`` (a copy: what
    is tested is where a failed request goes, not the numerics of INT8)."""
    root = tmp_path_factory.mktemp("fallback")
    for prec in ("fp32", "int8_cpu"):
        (root / prec).mkdir()
        shutil.copy(serving_assets["onnx_dir"] / "fp32" / f"{GRAPH}.onnx", root / prec / f"{GRAPH}.onnx")
    return root


def _items(n: int) -> list[dict[str, np.ndarray]]:
    sample, _ = graph_warmup_samples(GRAPH)  # without the batch axis (a (1,) stands for a scalar per item)
    rank = {t.name: len(t.shape) for t in GRAPHS[GRAPH].inputs}
    items = []
    for k in range(n):
        item = {name: (arr[None] if arr.ndim < rank[name] else arr).copy() for name, arr in sample.items()}
        item["speech_tokens"] = (item["speech_tokens"] + k) % 100
        items.append(item)
    return items


def _broken(exc: Exception):
    def call(self, feeds):
        raise exc
    return call


def _delta(before: dict, key: tuple[str, str]) -> int:
    return fallback_counts().get(key, 0) - before.get(key, 0)


def test_a_failed_call_of_a_reduced_precision_graph_is_served_on_fp32(export_dirs, monkeypatch):
    primary = GraphRunner(GRAPH, onnx_path=export_dirs / "int8_cpu" / f"{GRAPH}.onnx")
    assert primary.fallback_path == export_dirs / "fp32" / f"{GRAPH}.onnx"
    reference = GraphRunner(GRAPH, onnx_path=export_dirs / "fp32" / f"{GRAPH}.onnx", fallback=None)
    items = _items(3)
    want = [r.unwrap() for r in reference.run_items(items)]
    before = fallback_counts()
    monkeypatch.setattr(primary, "_call", _broken(RuntimeError("Failed to allocate memory for requested buffer")).
                        __get__(primary))
    got = primary.run_items(items)
    assert all(r.ok for r in got), [r.error for r in got]
    for r, w in zip(got, want, strict=True):
        for name in w:
            np.testing.assert_array_equal(r.value[name], w[name])
    assert _delta(before, (GRAPH, "served")) == 3 and _delta(before, (GRAPH, "failed")) == 0


def test_bad_input_is_not_sent_to_the_fallback(export_dirs, monkeypatch):
    primary = GraphRunner(GRAPH, onnx_path=export_dirs / "int8_cpu" / f"{GRAPH}.onnx")
    before = fallback_counts()
    bad = _items(1)[0]
    bad["speech_token_len"] = np.array([10_000], np.int32)  # longer than its tokens: the request's own fault
    res = primary.run_items([bad])[0]
    assert isinstance(res.error, RequestError) and "speech_token_len" in str(res.error)
    monkeypatch.setattr(primary, "_call", _broken(RequestError("flow_encoder: refused")).__get__(primary))
    res = primary.run_items(_items(1))[0]
    assert isinstance(res.error, RequestError)
    assert fallback_counts() == before


def test_a_failing_fallback_returns_the_first_error_and_is_counted(export_dirs, monkeypatch):
    primary = GraphRunner(GRAPH, onnx_path=export_dirs / "int8_cpu" / f"{GRAPH}.onnx")
    before = fallback_counts()
    monkeypatch.setattr(GraphRunner, "_call", _broken(MemoryError("out of memory")))
    res = primary.run_items(_items(2))
    assert all(isinstance(r.error, MemoryError) for r in res), res
    assert _delta(before, (GRAPH, "failed")) == 2 and _delta(before, (GRAPH, "served")) == 0


def test_fp32_on_the_cpu_has_no_fallback(export_dirs, monkeypatch):
    primary = GraphRunner(GRAPH, onnx_path=export_dirs / "fp32" / f"{GRAPH}.onnx")
    assert primary.fallback_path is None
    before = fallback_counts()
    monkeypatch.setattr(primary, "_call", _broken(RuntimeError("engine error")).__get__(primary))
    res = primary.run_items(_items(1))[0]
    assert isinstance(res.error, RuntimeError) and fallback_counts() == before
    assert graphs.FALLBACK_COUNTS is not None  # the counter the metrics export reads


def test_on_fallback_hears_each_outcome_and_its_failure_is_not_the_requests(export_dirs, monkeypatch):
    heard: list[str] = []
    primary = GraphRunner(GRAPH, onnx_path=export_dirs / "int8_cpu" / f"{GRAPH}.onnx", on_fallback=heard.append)
    monkeypatch.setattr(primary, "_call", _broken(RuntimeError("engine error")).__get__(primary))
    assert all(r.ok for r in primary.run_items(_items(2)))
    assert heard == ["served", "served"]

    def deaf(outcome):
        raise OSError("metrics channel closed")

    primary.on_fallback = deaf
    assert primary.run_items(_items(1))[0].ok
    monkeypatch.setattr(GraphRunner, "_call", _broken(MemoryError("out of memory")))  # the fallback's too
    primary.on_fallback = heard.append
    assert isinstance(primary.run_items(_items(1))[0].error, RuntimeError)  # the primary's error
    assert heard == ["served", "served", "failed"]


def test_fallback_metrics_are_created_at_zero_and_count_by_outcome():
    pb = types.SimpleNamespace(MetricFamily=pb_standin.MetricFamily)
    fm = m.FallbackMetrics(pb, "flow_encoder", 2, "flow_encoder")
    assert fm.family.name == m.FALLBACKS.name == "cosyvoice_fallbacks_total" and fm.family.kind == "COUNTER"
    assert m.FALLBACKS in m.FAMILIES  # the live metrics test checks every family is exposed and on the dashboard
    by_outcome = {x.labels["outcome"]: x for x in fm.family.metrics}
    assert set(by_outcome) == set(m.FALLBACK_OUTCOMES) == {"served", "failed"}
    for outcome, x in by_outcome.items():
        assert x.labels == {"model": "flow_encoder", "version": "2", "graph": "flow_encoder", "outcome": outcome}
        assert x.value() == 0
    fm.record("served")
    fm.record("served")
    fm.record("failed")
    assert (by_outcome["served"].value(), by_outcome["failed"].value()) == (2, 1)


# ------------------------------------------------------------------------------------------------ live


def _failing_at_run_time(good, out):
    """``good`` with its first output sent through Reshape(-1, 999983) and back: it loads, has the spec's inputs
    and outputs, and fails in onnxruntime for any input whose output size is not a multiple of that prime."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(good))
    g = model.graph
    name = g.output[0].name
    for node in g.node:
        node.output[:] = [f"{name}__raw" if o == name else o for o in node.output]
    g.initializer.append(numpy_helper.from_array(np.array([-1, 999983], np.int64), f"{name}__odd"))
    g.node.extend([helper.make_node("Reshape", [f"{name}__raw", f"{name}__odd"], [f"{name}__flat"]),
                   helper.make_node("Shape", [f"{name}__raw"], [f"{name}__shape"]),
                   helper.make_node("Reshape", [f"{name}__flat", f"{name}__shape"], [name])])
    onnx.save(model, str(out))


@pytest.fixture(scope="module")
def failing_version(serving_assets, tmp_path_factory):
    """A versioned repository: v1 the fp32 export, v2 (live) the same export with ``flow_encoder`` at "int8_cpu"
    where that file fails at run time; the render places v2's fp32 graph as ``flow_encoder/2/fallback.onnx``."""
    from cosyvoice_triton.serving.launch.rollout import VersionSpec
    from cosyvoice_triton.serving.repository import render_repository

    root = tmp_path_factory.mktemp("fallback_live")
    onnx_dir = root / "onnx"
    shutil.copytree(serving_assets["onnx_dir"] / "fp32", onnx_dir / "fp32")
    (onnx_dir / "int8_cpu").mkdir()
    _failing_at_run_time(onnx_dir / "fp32" / f"{GRAPH}.onnx", onnx_dir / "int8_cpu" / f"{GRAPH}.onnx")
    model_dir = serving_assets["model_dir"]
    repo = root / "model_repository"
    render_repository("local", repo, model_dir=model_dir, versions=[
        VersionSpec(1, model_dir, serving_assets["onnx_dir"]),
        VersionSpec(2, model_dir, onnx_dir, f"{GRAPH}=int8_cpu")], live_version=2)
    return {"repo": repo, "onnx_dir": onnx_dir}


def test_a_versioned_render_puts_the_fp32_graph_beside_a_reduced_precision_version(failing_version):
    repo, onnx_dir = failing_version["repo"], failing_version["onnx_dir"]
    assert (repo / GRAPH / "2" / "fallback.onnx").read_bytes() == (onnx_dir / "fp32" / f"{GRAPH}.onnx").read_bytes()
    assert (repo / GRAPH / "2" / "model.onnx").read_bytes() == (onnx_dir / "int8_cpu" / f"{GRAPH}.onnx").read_bytes()
    assert not (repo / GRAPH / "1" / "fallback.onnx").exists()  # v1 is fp32: nothing to fall back to on the CPU
    assert not (repo / "flow_estimator" / "2" / "fallback.onnx").exists()  # v2 serves it in fp32
    broken = GraphRunner(GRAPH, onnx_path=repo / GRAPH / "2" / "model.onnx", fallback=None)
    res = broken.run_items(_items(1))[0]
    assert res.error is not None and not isinstance(res.error, RequestError), res  # the engine's error


def _fallbacks(url: str, **labels) -> dict[str, float]:
    """Outcome -> value of the server's ``cosyvoice_fallbacks_total`` series with ``labels`` (one each)."""
    with urllib.request.urlopen(url, timeout=30) as r:
        samples = [x for x in parse_prometheus(r.read().decode()) if x.name == m.FALLBACKS.name
                   and all(x.labels.get(k) == v for k, v in labels.items())]
    outcomes = [x.labels["outcome"] for x in samples]
    assert sorted(outcomes) == sorted(m.FALLBACK_OUTCOMES), (labels, samples)
    return {o: counter_total(samples, m.FALLBACKS.name, outcome=o) for o in outcomes}


@pytest.mark.timeout(600)
def test_a_failing_primary_graph_is_served_on_the_fallback_and_counted_on_the_metrics_port(failing_version,
                                                                                           serving_assets):
    import tritonclient.http as http

    repo = failing_version["repo"]
    reference = GraphRunner(GRAPH, onnx_path=serving_assets["onnx_dir"] / "fp32" / f"{GRAPH}.onnx", fallback=None)
    item = _items(1)[0]
    want = reference.run_items([item])[0].unwrap()
    labels = {"model": GRAPH, "version": "2", "graph": GRAPH}
    with served(repo, model_control="explicit", load_models=[GRAPH]) as server:
        # Triton's model_warmup (when rendered) already went through the fallback at load: count from here
        before = _fallbacks(server.metrics_url, **labels)
        assert before["failed"] == 0, before
        client = http.InferenceServerClient(server.http_url.removeprefix("http://"), network_timeout=300)
        try:
            inputs = []
            for t in GRAPHS[GRAPH].inputs:
                arr = to_request_shape(GRAPHS[GRAPH], t.name, item[t.name])
                x = http.InferInput(t.name, list(arr.shape), http.np_to_triton_dtype(arr.dtype))
                x.set_data_from_numpy(arr)
                inputs.append(x)
            got = client.infer(GRAPH, inputs, model_version="2")
        finally:
            client.close()
        for name, arr in want.items():
            np.testing.assert_allclose(from_request_shape(GRAPHS[GRAPH], name, got.as_numpy(name)), arr, rtol=0,
                                       atol=1e-6)
        assert _fallbacks(server.metrics_url, **labels) == {"served": before["served"] + 1, "failed": 0}
