"""Live: a repeated prompt skips the prompt-side graphs in the served VC paths, and the audio stays bit-identical.

One tritonserver (tiny demo model, explicit model control): ``cosyvoice_vc`` reaches ``speech_tokenizer`` /
``speaker_encoder`` through Triton's response cache (tunable ``response_cache_mb``; ``TritonServer`` passes
``--cache-config``), ``cosyvoice_vc_stream`` through its own prompt cache. Counted with Triton's statistics API:
inference counts of the two graphs, and their response-cache hits. Then the graphs are reloaded with the response
cache disabled (a config override) and the same request is computed by them: the same waveform, bit for bit.
The server is rendered with ``graph_cache_mb=0`` so that what these counts see is the response cache alone.

The graph models' own cache of successful answers (tunable ``graph_cache_mb``, on by default for the local flavor):
the two graphs are reloaded as the default render configures them (response cache off, ``graph_cache_mb`` of the
default tunables); a repeated prompt's ``speaker_encoder`` request is then answered from that cache (its
``cosyvoice_graph_cache_total{result="hit"}`` grows, ``miss`` does not), and the audio equals, bit for bit, that of
the graphs reloaded with ``graph_cache_mb=0``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import served, speech_pair

from cosyvoice_triton.clients.client import VCClient
from cosyvoice_triton.loadtest.metrics import counter_total, scrape
from cosyvoice_triton.serving.stages.metrics import GRAPH_CACHE

GRAPHS = ("speech_tokenizer", "speaker_encoder")


@pytest.fixture(scope="module")
def server(serving_assets, tmp_path_factory):
    from cosyvoice_triton.serving.repository import render_repository

    repo = tmp_path_factory.mktemp("prompt_cache_served") / "model_repository"
    render_repository(
        "local",
        repo,
        model_dir=serving_assets["model_dir"],
        onnx_dir=serving_assets["onnx_dir"],
        tts="off",
        max_queue_delay_us=2000,
        response_cache_mb=8,
        graph_cache_mb=0,  # the response cache alone (the graph cache: test_the_graph_cache_...)
    )
    for g in GRAPHS:  # rendered with the response cache; the other graphs without
        assert "response_cache { enable: true }" in (repo / g / "config.pbtxt").read_text()
    assert "response_cache" not in (repo / "flow_encoder" / "config.pbtxt").read_text()
    with served(repo, model_control="explicit", load_models=["*"]) as srv:
        assert any(a.startswith("--cache-config=local,size=") for a in srv.command())
        yield srv


def _counts(client: VCClient) -> dict[str, tuple[int, int, int]]:
    """Per graph: (inferences run, response-cache hits, response-cache misses)."""
    out = {}
    for g in GRAPHS:
        s = client.statistics(g)["model_stats"][0]
        st = s["inference_stats"]
        out[g] = (int(s["inference_count"]), int(st["cache_hit"]["count"]), int(st["cache_miss"]["count"]))
    return out


def _delta(before, after) -> dict[str, tuple[int, ...]]:
    return {g: tuple(b - a for a, b in zip(before[g], after[g], strict=True)) for g in GRAPHS}


def test_repeated_prompt_skips_the_prompt_graphs_bit_identically(server):
    src, ssr, prm, psr = speech_pair(2.5, 1.5)
    other = src[: int(2.0 * ssr)]
    with (
        VCClient(server.http_url, timeout=300) as http,
        VCClient(server.grpc_url, protocol="grpc", timeout=300) as grpc,
    ):

        def vc(source):
            return http.convert(source, prm, source_sr=ssr, prompt_sr=psr, seed=7).waveform

        c0 = _counts(http)
        vc(src)  # the prompt's first request: both graphs run on it
        c1 = _counts(http)
        assert _delta(c0, c1)["speaker_encoder"] == (1, 0, 1)
        assert _delta(c0, c1)["speech_tokenizer"][0] == 2  # source and prompt
        hit = vc(other)  # a new source, the same prompt
        c2 = _counts(http)
        assert _delta(c1, c2)["speaker_encoder"] == (0, 1, 0)  # answered by the cache, CAM++ not run
        assert _delta(c1, c2)["speech_tokenizer"] == (1, 1, 1)  # the source ran (a miss), the prompt hit

        # cosyvoice_vc_stream: its prompt cache answers a repeated prompt without calling either graph
        def stream():
            return [c.waveform for c in grpc.convert_stream(other, prm, source_sr=ssr, prompt_sr=psr, seed=7)]

        first = stream()
        c3 = _counts(http)
        assert _delta(c2, c3)["speaker_encoder"] == (0, 1, 0)  # its BLS call: a response-cache hit (same fbank)
        again = stream()
        c4 = _counts(http)
        assert _delta(c3, c4)["speaker_encoder"] == (0, 0, 0)  # no request reached it at all
        assert len(again) == len(first) and all(np.array_equal(a, b) for a, b in zip(again, first, strict=True))

        # the graphs without the response cache: the same request is computed by them, to the same bits
        admin = server.admin_headers("http")
        import tritonclient.http as th

        ctl = th.InferenceServerClient(server.http_url)
        for g in GRAPHS:
            cfg = ctl.get_model_config(g, headers=admin)
            cfg["response_cache"] = {"enable": False}
            ctl.load_model(g, headers=admin, config=json.dumps(cfg))
        ctl.close()
        c5 = _counts(http)
        computed = vc(other)
        c6 = _counts(http)
        assert _delta(c5, c6)["speaker_encoder"] == (1, 0, 0)
        assert _delta(c5, c6)["speech_tokenizer"][0] == 2
        assert computed.dtype == hit.dtype and np.array_equal(computed, hit)


def _reload(server, **params: float) -> None:
    """Reload the two prompt-side graphs without the response cache and with these config ``parameters``."""
    import tritonclient.http as th

    admin = server.admin_headers("http")
    ctl = th.InferenceServerClient(server.http_url)
    try:
        for g in GRAPHS:
            cfg = ctl.get_model_config(g, headers=admin)
            cfg["response_cache"] = {"enable": False}
            cfg.setdefault("parameters", {}).update({k: {"string_value": str(v)} for k, v in params.items()})
            ctl.load_model(g, headers=admin, config=json.dumps(cfg))
    finally:
        ctl.close()


def _graph_cache(server) -> dict[str, dict[str, float]]:
    """Per graph: hits and misses of its ``cosyvoice_graph_cache_total`` series (version 1)."""
    samples = scrape(server.metrics_url, timeout=30)
    return {g: {r: counter_total(samples, GRAPH_CACHE.name, model=g, version="1", result=r) for r in ("hit", "miss")}
            for g in GRAPHS}


def test_the_graph_cache_answers_a_repeated_prompt_without_the_graph_bit_identically(server):
    from cosyvoice_triton.serving.repository import Tunables

    default = Tunables()
    assert default.response_cache_mb == 0 and default.graph_cache_mb > 0  # what the default render serves
    src, ssr, prm, psr = speech_pair(2.5, 1.5)
    first_src, second_src = src[: int(1.8 * ssr)], src[int(0.5 * ssr):]
    _reload(server, graph_cache_mb=default.graph_cache_mb)
    with VCClient(server.http_url, timeout=300) as http:

        def vc(source):
            return http.convert(source, prm, source_sr=ssr, prompt_sr=psr, seed=11).waveform

        c0 = _graph_cache(server)
        vc(first_src)  # a new prompt: both graphs run on it (misses) and keep the answers
        c1 = _graph_cache(server)
        assert c1["speaker_encoder"]["miss"] - c0["speaker_encoder"]["miss"] == 1
        assert c1["speaker_encoder"]["hit"] == c0["speaker_encoder"]["hit"]
        assert c1["speech_tokenizer"]["miss"] - c0["speech_tokenizer"]["miss"] == 2  # source and prompt
        hit = vc(second_src)  # a new source, the same prompt
        c2 = _graph_cache(server)
        assert c2["speaker_encoder"] == {"hit": c1["speaker_encoder"]["hit"] + 1,
                                         "miss": c1["speaker_encoder"]["miss"]}  # CAM++ not run
        assert c2["speech_tokenizer"] == {"hit": c1["speech_tokenizer"]["hit"] + 1,
                                          "miss": c1["speech_tokenizer"]["miss"] + 1}  # the prompt hit, the source ran
        # the same request on the graphs without any cache: computed by them, to the same bits
        _reload(server, graph_cache_mb=0)
        c3 = _graph_cache(server)
        computed = vc(second_src)
        assert _graph_cache(server) == c3  # no cache: nothing looked up (the old series may outlive the reload)
        assert computed.dtype == hit.dtype and np.array_equal(computed, hit)
