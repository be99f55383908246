"""The graph model's cache of successful answers (``GraphRunner(cache_mb=...)``, tunable ``graph_cache_mb``), in
process: a repeated request is answered without a graph call and bit-identically; refused requests, failed calls and
answers of the fallback graph are never kept; batch-mates are unaffected; bounded by bytes; off at 0; rendered on
the prompt-side graphs of the local flavor only. Live: tests/live/test_prompt_cache_served.py."""

from __future__ import annotations

import shutil
import threading
import types

import numpy as np
import pb_standin
import pytest

from cosyvoice_triton.serving.repository import RESPONSE_CACHE_GRAPHS, graph_warmup_samples
from cosyvoice_triton.serving.stages import metrics as m
from cosyvoice_triton.serving.stages.batching import RequestError
from cosyvoice_triton.serving.stages.graphs import GraphRunner, result_key
from cosyvoice_triton.shapes import GRAPHS

GRAPH = "flow_encoder"  # pad policy: several requests share one call


def _items(n: int, start: int = 0) -> list[dict[str, np.ndarray]]:
    sample, _ = graph_warmup_samples(GRAPH)
    rank = {t.name: len(t.shape) for t in GRAPHS[GRAPH].inputs}
    items = []
    for k in range(start, start + n):
        item = {name: (arr[None] if arr.ndim < rank[name] else arr).copy() for name, arr in sample.items()}
        item["speech_tokens"] = (item["speech_tokens"] + k) % 100
        items.append(item)
    return items


def _bad() -> dict[str, np.ndarray]:
    bad = _items(1, 50)[0]
    bad["speech_token_len"] = np.array([10_000], np.int32)  # longer than its tokens: the request's own fault
    return bad


class Calls:
    """Counts the runner's graph calls (and the requests' rows in them); ``fail`` makes the next calls raise."""

    def __init__(self, runner: GraphRunner, monkeypatch):
        self.n, self.rows, self.fail, self._real = 0, 0, None, runner._call

        def call(feeds):
            self.n += 1
            self.rows += int(next(iter(feeds.values())).shape[0])
            if self.fail is not None:
                raise self.fail
            return self._real(feeds)

        monkeypatch.setattr(runner, "_call", call)


@pytest.fixture(scope="module")
def onnx(serving_assets):
    return serving_assets["onnx_dir"] / "fp32" / f"{GRAPH}.onnx"


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def test_a_repeated_request_is_answered_without_a_call_bit_identically(onnx, monkeypatch):
    plain = GraphRunner(GRAPH, onnx_path=onnx, fallback=None)
    heard = []
    runner = GraphRunner(GRAPH, onnx_path=onnx, fallback=None, cache_mb=4, on_cache=lambda r, n: heard.append((r, n)))
    calls = Calls(runner, monkeypatch)
    items = _items(3)
    want = [r.unwrap() for r in plain.run_items(items)]
    first = runner.run_items(items)
    assert calls.n == 1 and heard == [("miss", 3)]  # one batched call, as without the cache
    # the same bytes in other arrays, in another order
    again = runner.run_items([{n: a.copy() for n, a in x.items()} for x in items[::-1]])
    assert calls.n == 1 and heard[-1] == ("hit", 3)
    for got, w in zip([*first, *again[::-1]], want * 2, strict=True):
        assert got.ok and _equal(got.value, w)
    # answers are copies: the caller may write into them without changing the next hit
    again[0].value["mu"][...] = 0
    assert _equal(runner.run_items([items[2]])[0].value, want[2]) and calls.n == 1
    # a mix: hits answered, the misses batched into one call of their rows only
    mixed = runner.run_items([items[0], *_items(2, 10), items[1]])
    assert calls.n == 2 and calls.rows == 3 + 2
    want_new = [r.unwrap() for r in plain.run_items(_items(2, 10))]
    for got, w in zip(mixed, [want[0], *want_new, want[1]], strict=True):
        assert got.ok and _equal(got.value, w)
    s = runner.cache.stats()
    assert (s["hits"], s["misses"], s["entries"]) == (3 + 1 + 2, 3 + 2, 5)


def test_the_key_is_every_input_s_name_dtype_shape_and_bytes():
    spec = GRAPHS[GRAPH]
    item = _items(1)[0]
    k = result_key(GRAPH, spec, item)
    assert k == result_key(GRAPH, spec, {n: a.copy() for n, a in item.items()})
    assert k != result_key("flow_encoder_tts", spec, item)
    changed = dict(item, speech_tokens=item["speech_tokens"].copy())
    changed["speech_tokens"][0, -1] ^= 1
    assert k != result_key(GRAPH, spec, changed)
    emb = item["speaker_embedding"]
    assert k != result_key(GRAPH, spec, dict(item, speaker_embedding=emb.view(np.int32)))  # same bytes, other dtype
    assert k != result_key(GRAPH, spec, dict(item, speaker_embedding=emb.reshape(emb.shape[0], -1, 1)))  # other shape


def test_a_refused_request_is_not_kept_and_its_batch_mates_are_served(onnx, monkeypatch):
    plain = GraphRunner(GRAPH, onnx_path=onnx, fallback=None)
    runner = GraphRunner(GRAPH, onnx_path=onnx, fallback=None, cache_mb=4)
    calls = Calls(runner, monkeypatch)
    good = _items(2)
    want = [r.unwrap() for r in plain.run_items(good)]
    for round_ in range(3):  # the same bad bytes are refused every time, never answered from the cache
        res = runner.run_items([good[0], _bad(), good[1]])
        assert isinstance(res[1].error, RequestError) and "speech_token_len" in str(res[1].error), round_
        assert res[0].ok and res[2].ok and _equal(res[0].value, want[0]) and _equal(res[2].value, want[1])
    assert calls.n == 1 and len(runner.cache) == 2  # the good pair ran once; the bad request left no entry
    assert isinstance(runner.run_items([_bad()])[0].error, RequestError)


def test_a_failed_call_is_not_kept(onnx, monkeypatch):
    runner = GraphRunner(GRAPH, onnx_path=onnx, fallback=None, cache_mb=4)
    calls = Calls(runner, monkeypatch)
    items = _items(2)
    calls.fail = RuntimeError("Failed to allocate memory for requested buffer")
    res = runner.run_items(items)
    assert all(not r.ok and isinstance(r.error, RuntimeError) for r in res)
    assert calls.n == 3 and len(runner.cache) == 0  # the batch, then each alone: all failed, nothing kept
    calls.fail = None
    res = runner.run_items(items)  # the same requests run again (the failure was not replayed) and now succeed
    assert all(r.ok for r in res) and calls.n == 4 and len(runner.cache) == 2
    assert all(r.ok for r in runner.run_items(items)) and calls.n == 4


def test_an_answer_of_the_fallback_graph_is_not_kept(serving_assets, tmp_path, monkeypatch):
    for prec in ("fp32", "int8_cpu"):  # a stand-in reduced precision (a copy), its fp32 fallback beside it
        (tmp_path / prec).mkdir()
        shutil.copy(serving_assets["onnx_dir"] / "fp32" / f"{GRAPH}.onnx", tmp_path / prec / f"{GRAPH}.onnx")
    runner = GraphRunner(GRAPH, onnx_path=tmp_path / "int8_cpu" / f"{GRAPH}.onnx", cache_mb=4)
    assert runner.fallback_path is not None
    calls = Calls(runner, monkeypatch)
    calls.fail = RuntimeError("engine error")
    item = _items(1)[0]
    assert runner.run_items([item])[0].ok  # served on the fallback...
    assert len(runner.cache) == 0  # ...and not kept: the primary answers it once it works again
    calls.fail = None
    assert runner.run_items([item])[0].ok and calls.n == 2 and len(runner.cache) == 1


def test_bounded_by_bytes_least_recently_used_first(onnx, monkeypatch):
    probe = GraphRunner(GRAPH, onnx_path=onnx, fallback=None, cache_mb=4)
    probe.run_items(_items(1))
    entry = probe.cache.stats()["bytes"]
    runner = GraphRunner(GRAPH, onnx_path=onnx, fallback=None, cache_mb=(2.5 * entry) / (1 << 20))  # room for 2
    calls = Calls(runner, monkeypatch)
    a, b, c = _items(3)
    for x in (a, b):
        runner.run_items([x])
    runner.run_items([a])  # a is now the most recent: c evicts b
    runner.run_items([c])
    assert calls.n == 3 and len(runner.cache) == 2 and runner.cache.stats()["bytes"] <= runner.cache.max_bytes
    runner.run_items([a])
    assert calls.n == 3  # a kept
    runner.run_items([b])
    assert calls.n == 4  # b was evicted


def test_off_at_zero_and_by_default(onnx, monkeypatch):
    for runner in (GraphRunner(GRAPH, onnx_path=onnx, fallback=None),
                   GraphRunner(GRAPH, onnx_path=onnx, fallback=None, cache_mb=0, on_cache=lambda r, n: 1 / 0)):
        assert runner.cache is None
        calls = Calls(runner, monkeypatch)
        item = _items(1)[0]
        for _ in range(2):
            assert runner.run_items([item])[0].ok
        assert calls.n == 2
    with pytest.raises(ValueError, match="cache_mb"):
        GraphRunner(GRAPH, onnx_path=onnx, fallback=None, cache_mb=-1)


def test_threads_share_the_cache_and_a_failing_counter_is_not_the_requests(onnx):
    def deaf(result, n):
        raise RuntimeError("metrics channel down")

    runner = GraphRunner(GRAPH, onnx_path=onnx, fallback=None, cache_mb=4, on_cache=deaf)
    items = _items(4)
    want = [r.unwrap() for r in GraphRunner(GRAPH, onnx_path=onnx, fallback=None).run_items(items)]
    errors = []

    def worker(seed):
        order = np.random.default_rng(seed).permutation(len(items))
        for _ in range(3):
            for i, r in zip(order, runner.run_items([items[i] for i in order]), strict=True):
                if not (r.ok and _equal(r.value, want[i])):
                    errors.append((seed, i, r.error))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(runner.cache) == 4
    s = runner.cache.stats()
    assert s["hits"] + s["misses"] == 4 * 3 * 4 and s["misses"] >= 4


def test_graph_cache_metrics_are_created_at_zero_and_count_by_result():
    pb = types.SimpleNamespace(MetricFamily=pb_standin.MetricFamily)
    gm = m.GraphCacheMetrics(pb, "speaker_encoder", 1)
    assert gm.family.name == m.GRAPH_CACHE.name == "cosyvoice_graph_cache_total" and gm.family.kind == "COUNTER"
    # not a family of every model: the live test wants every FAMILIES entry on every server and on the dashboard
    assert m.GRAPH_CACHE not in m.FAMILIES
    by = {x.labels["result"]: x for x in gm.family.metrics}
    assert set(by) == set(m.CACHE_RESULTS) == {"hit", "miss"}
    for result, x in by.items():
        assert x.labels == {"model": "speaker_encoder", "version": "1", "result": result} and x.value() == 0
    gm.record("miss", 3)
    gm.record("hit")
    gm.record("hit", 2)
    assert (by["hit"].value(), by["miss"].value()) == (3, 3)


def test_rendered_on_the_prompt_side_graphs_of_the_local_flavor(serving_assets, tmp_path):
    from cosyvoice_triton.serving.repository import Tunables, render_repository
    from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
    from cosyvoice_triton.serving.stages.params import read_parameters

    demo_dir = serving_assets["model_dir"]
    assert Tunables().graph_cache_mb == 16 and RESPONSE_CACHE_GRAPHS == ("speech_tokenizer", "speaker_encoder")
    line = 'parameters { key: "graph_cache_mb" value: { string_value: "%s" } }'

    def configs(out, **kw):
        repo = render_repository("local", out, model_dir=demo_dir, allow_missing=True, tts="off", **kw).out_dir
        return {g: (repo / g / "config.pbtxt").read_text() for g in GRAPHS}

    for kw, value in (({}, "16.0"), ({"graph_cache_mb": 0}, "0"), ({"graph_cache_mb": 2.5}, "2.5")):
        for g, text in configs(tmp_path / f"r{value}", **kw).items():
            assert (line % value in text) == (g in RESPONSE_CACHE_GRAPHS), (kw, g)
            assert ("graph_cache_mb" in text) == (g in RESPONSE_CACHE_GRAPHS), (kw, g)
    default = configs(tmp_path / "default")["speaker_encoder"]
    assert "response_cache" not in default  # the response cache stays the opt-in
    params = {"graph": {"string_value": "speaker_encoder"}, "graph_cache_mb": {"string_value": "16.0"}}
    assert read_parameters({"parameters": params}, MODEL_PARAMS["graph"])["graph_cache_mb"] == 16.0
    plain = configs(tmp_path / "plain", profile="plain")["speaker_encoder"]
    assert line % "0.0" in plain  # the plain baseline deploys no cache
    iso = render_repository("local", tmp_path / "iso", model_dir=demo_dir, allow_missing=True, tts="on",
                            task_isolation=True).out_dir
    for g in RESPONSE_CACHE_GRAPHS:  # the TTS copies get theirs
        assert line % "16.0" in (iso / f"{g}_tts" / "config.pbtxt").read_text()
    from cosyvoice_triton.serving.repository import RenderError

    with pytest.raises(RenderError, match="graph_cache_mb"):
        Tunables(graph_cache_mb=-1)
    for flavor in ("onnx", "trt"):  # native backends: no Python, no graph cache parameter
        repo = render_repository(flavor, tmp_path / flavor, model_dir=demo_dir, allow_missing=True, tts="off").out_dir
        assert all("graph_cache_mb" not in (repo / g / "config.pbtxt").read_text() for g in GRAPHS)
