"""The mixed load (``loadtest/run.py --mode mixed``): a steady high-priority class under a low-priority flood, and
the reverse, on a real ``tritonserver`` (tiny model) rendered with the sharing policy (priority levels, the rate
limiter's task quota on the VC stages). Small size: the figures are checked for where they come from, never for
speed."""

from __future__ import annotations

import math

import pytest
import soundfile as sf
from conftest import FIXTURES, require_live_loadtest

from cosyvoice_triton.loadtest.mixed import POLICY, mixed_markdown, targets
from cosyvoice_triton.loadtest.recording import RunResult
from cosyvoice_triton.loadtest.workload import Workload


def _cls(users, p95, first=None, failures=0, longest=1.0):
    return {"users": users, "p50_ms": p95 / 2, "p95_ms": p95, "first_p50_ms": None if first is None else first / 2,
            "first_p95_ms": first, "failures": failures, "answered": 3, "longest_s": longest}


def test_targets_use_first_chunk_for_streams_and_flag_failures():
    res = {"scenario": "s", "high": "tts_stream", "low": "integrated", "priorities": True,
           "high_alone": _cls(1, 4000, first=1000), "high_mixed": _cls(1, 9000, first=1400),
           "low_alone": _cls(4, 5000), "low_mixed": _cls(4, 8000, failures=1, longest=12.5),
           "machine": {"window_s": 10.0, "audio_s_per_s": 2.0, "requests_per_s": 0.5, "cpu_triton": 0.9,
                       "cpu_server": 0.8}}
    t = targets(res)
    assert t["high_p95_ratio"] == pytest.approx(1.4) and t["high_met"]  # first chunk, not the total
    assert not t["low_all_answered"] and t["low_longest_s"] == 12.5
    md = mixed_markdown({"scenarios": [res]})
    assert "| s | on | high: first chunk tts_stream | 1 | 500 / 1,000 | 700 / 1,400 | 1.40 | 3 (0) |" in md
    assert "| met (x1.40) | NO | 12.5 |" in md


@pytest.mark.timeout(1800)  # a server start and 6 short Locust runs: minutes, many more on a shared loaded machine
def test_rate_limit_only_on_graphs():
    from cosyvoice_triton.serving.repository import RenderError, Tunables

    assert Tunables(rate_limit={"flow_estimator": 1}).rate_limit == {"flow_estimator": 1}
    with pytest.raises(RenderError, match="not a graph"):
        Tunables(rate_limit={"flow": 1})  # a BLS stage holding the unit stalls Triton 2.51
    with pytest.raises(RenderError, match="priority_levels"):
        Tunables(priority_levels=1)


def test_live_mixed_load_with_the_policy(serving_assets, tmp_path):
    require_live_loadtest()
    from cosyvoice_triton.loadtest.runner import Options, run

    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    out = tmp_path / "mixed"
    Workload((src[: int(2.0 * ssr)],), (ssr,), prm[: int(1.5 * psr)], psr, texts=("Hello there, a short test.",),
             prompt_text="the prompt says hello").save(out / "workload.npz")
    opts = Options(name="smoke-mixed", mode="mixed", model_dir=str(serving_assets["model_dir"]),
                   onnx_dir=str(serving_assets["onnx_dir"]), out_dir=str(out), mixed_high_users=1,
                   mixed_low_users=2, mixed_requests=2, mixed_policies=(True,), precision="fp32", max_run_s=400,
                   integrated_tunables={"max_queue_delay_us": 5000},
                   # a loaded CI machine: give the Python backend's stubs time to answer
                   server_args=("--backend-config=python,stub-timeout-seconds=300",))
    report = run(opts)
    assert not [r["error"] for r in report["scenarios"] if "error" in r]
    # the policy was rendered: two priority levels, the TTS entry highest
    repo = out / "with" / "model_repository"
    flow = (repo / "flow" / "config.pbtxt").read_text()
    assert f"priority_levels: {POLICY['priority_levels']}" in flow and "default_priority_level: 2" in flow
    assert "default_priority_level: 1" in (repo / "cosyvoice_tts_stream" / "config.pbtxt").read_text()
    assert [(r["high"], r["low"]) for r in report["scenarios"]] == [("tts_stream", "integrated"),
                                                                    ("integrated", "tts_stream")]
    for res in report["scenarios"]:
        for key in ("high_alone", "low_alone", "high_mixed", "low_mixed"):
            c = res[key]
            assert c["failures"] == 0, (key, c["errors"])
            # each class's requests are its public model's requests in Triton's counters
            assert c["check"]["passed"] and c["check"]["triton_delta"] == c["requests"], (key, c["check"])
            assert c["answered"] == c["started"] > 0 and 0 < c["longest_s"] < math.inf
        for key in ("high_alone", "low_alone"):  # alone, each streamed chunk is one hift_decoder call
            if res[key]["column"] == "tts_stream":
                assert res[key]["chunk_check"]["passed"], res[key]["chunk_check"]
        # the flood really ran while the steady class was measured
        tag = f"{res['high']}_over_{res['low']}"
        high = RunResult.load(out / "with" / f"{tag}_high_mixed.json")
        low = RunResult.load(out / "with" / f"{tag}_low_mixed.json")
        h0, h1 = high.window
        assert min(r.start for r in low.records) <= h0
        assert max(r.start + r.latency_s for r in low.records) >= h1
        assert res["low_mixed"]["longest_s"] == pytest.approx(max(r.latency_s for r in low.records if r.ok))
        assert res["machine"]["audio_s_per_s"] > 0 and res["machine"]["cpu_server"] > 0
    md = (out / "report.md").read_text()
    assert "## Per class: alone and mixed" in md and (out / "mixed.png").is_file()
