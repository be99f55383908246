"""A graph whose call fails for a reason that is not the input's is served once more on its fallback (the fp32
graph of the export, or the CPU), counted; bad input and a failing fallback are not hidden."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from cosyvoice_triton.serving import graphs
from cosyvoice_triton.serving.batching import RequestError
from cosyvoice_triton.serving.graphs import GraphRunner, fallback_counts
from cosyvoice_triton.serving.repository import graph_warmup_samples
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
