"""The mixed load (``loadtest/run.py --mode mixed``): a steady high-priority class under a low-priority flood, and
the reverse, on a real ``tritonserver`` (tiny model) rendered with the sharing policy (priority levels, the TTS task's
own copies of the shared stages, the rate limiter's quota on the low task's leaf models). Small size: the figures are
checked for where they come from, never for speed."""

from __future__ import annotations

import math
import os

import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, require_live_loadtest

from cosyvoice_triton.loadtest.mixed import POLICY, mixed_markdown, policy, targets
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


def test_rate_limit_only_on_leaf_models():
    from cosyvoice_triton.serving.repository import RenderError, Tunables

    assert Tunables(rate_limit={"flow_estimator": 1}).rate_limit == {"flow_estimator": 1}
    assert Tunables(rate_limit={"preprocess": 1}).rate_limit == {"preprocess": 1}  # calls nothing
    with pytest.raises(RenderError, match="not a graph"):
        Tunables(rate_limit={"flow": 1})  # a BLS stage holding the unit stalls Triton 2.51
    with pytest.raises(RenderError, match="priority_levels"):
        Tunables(priority_levels=1)
    with pytest.raises(RenderError, match="task_isolation"):
        Tunables(task_quota=1)  # without the copies the quota would bind both tasks
    with pytest.raises(RenderError, match="task_isolation"):
        Tunables(rate_limit={"flow_estimator_tts": 1})  # a copy that is not rendered


def _instance_group(repo, model):
    lines = (repo / model / "config.pbtxt").read_text().splitlines()
    return next((x for x in lines if x.startswith("instance_group")), "")  # an ensemble has none


@pytest.mark.parametrize("high", ["tts_stream", "integrated"])
def test_policy_renders_the_tts_copies_and_the_low_task_quota(tmp_path, high):
    from cosyvoice_triton.serving.repository import LEAF_MODELS, TASK_COPIES, render_repository
    from cosyvoice_triton.shapes import GRAPHS

    repo = tmp_path / "repo"
    report = render_repository("local", repo, model_dir=tmp_path / "none", onnx_dir=tmp_path / "none",
                               allow_missing=True, tts="on", **policy(high))
    assert set(TASK_COPIES) <= set(report.models)
    tts_stream = (repo / "cosyvoice_tts_stream" / "config.pbtxt").read_text()
    assert 'key: "stage_suffix" value: { string_value: "_tts" }' in tts_stream
    flow_tts = (repo / "flow_tts" / "config.pbtxt").read_text()
    assert '"flow_encoder_tts"' in flow_tts and '"flow_estimator_tts"' in flow_tts and 'name: "flow_tts"' in flow_tts
    assert '"hift_decoder_tts"' in (repo / "hift_tts" / "config.pbtxt").read_text()
    assert (repo / "flow_estimator_tts" / "1" / "model.py").is_file()
    tts_high = high.startswith("tts")
    low_leaves = ([*GRAPHS, "preprocess", "postprocess"] if tts_high else [f"{g}_tts" for g in GRAPHS])
    low_python = [*low_leaves, *(("flow", "hift") if tts_high else ("flow_tts", "hift_tts", "cosyvoice_tts_stream",
                                                                     "cosyvoice_tts"))]
    for model in report.models:
        limited = "rate_limiter" in _instance_group(repo, model)
        assert limited == (model in low_leaves), model
        assert not limited or model in LEAF_MODELS  # a model that calls others never holds the unit
        niced = 'key: "nice" value: { string_value: "10" }' in (repo / model / "config.pbtxt").read_text()
        assert niced == (model in low_python), model
    high_model = "cosyvoice_tts_stream" if tts_high else "flow"
    assert "default_priority_level: 1" in (repo / high_model / "config.pbtxt").read_text()
    assert "default_priority_level: 2" in (repo / ("flow" if tts_high else "flow_tts") / "config.pbtxt").read_text()


def test_every_launcher_turns_the_rate_limiter_on_for_a_rate_limited_repository(tmp_path):
    """Without --rate-limit Triton ignores the rendered rate_limiter blocks (the quota would silently be off under
    make serve or the supervisor); a quota above 1 needs the resource's count on the command line."""
    from cosyvoice_triton.serving.launch.server import TritonServer, rate_limit_flags
    from cosyvoice_triton.serving.repository import render_repository

    def render(name, **tunables):
        return render_repository("local", tmp_path / name, model_dir=tmp_path / "none", onnx_dir=tmp_path / "none",
                                 allow_missing=True, tts="on", **tunables).out_dir

    one = render("one", **policy("tts_stream"))
    two = render("two", **{**policy("tts_stream"), "task_quota": 2})
    by_hand = render("by_hand", rate_limit={"flow_estimator": 1})
    plain = render("plain")
    assert rate_limit_flags(one) == ["--rate-limit=execution_count"]
    assert rate_limit_flags(two) == ["--rate-limit=execution_count", "--rate-limit-resource=task_quota:2"]
    assert rate_limit_flags(by_hand) == ["--rate-limit=execution_count"]
    assert rate_limit_flags(plain) == [] and rate_limit_flags(tmp_path) == []
    try:
        cmd = TritonServer(two).command()
    except Exception as exc:  # no tritonserver installed: the flags above are what command() appends
        pytest.skip(f"no Triton installation to build a command line: {exc}")
    assert "--rate-limit=execution_count" in cmd and "--rate-limit-resource=task_quota:2" in cmd
    assert sum(a.startswith("--rate-limit=") for a in TritonServer(two, extra_args=["--rate-limit=off"]).command()) == 1


@pytest.mark.timeout(2400)  # 3 server starts and 9 short Locust runs: minutes, many more on a shared loaded machine
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
                   mixed_low_users=2, mixed_requests=2, mixed_policies=(True,), precision="fp32",
                   max_run_s=2 * PATIENCE_S,
                   integrated_tunables={"max_queue_delay_us": 5000},
                   # a loaded CI machine: give the Python backend's stubs time to answer
                   server_args=("--backend-config=python,stub-timeout-seconds=300",))
    report = run(opts)
    assert not [r["error"] for r in report["scenarios"] if "error" in r]
    # the policy was rendered: two priority levels, the TTS entry highest, the TTS copies, VC's quota
    repo = out / "with" / "tts_stream" / "model_repository"
    flow = (repo / "flow" / "config.pbtxt").read_text()
    assert f"priority_levels: {POLICY['priority_levels']}" in flow and "default_priority_level: 2" in flow
    assert "default_priority_level: 1" in (repo / "cosyvoice_tts_stream" / "config.pbtxt").read_text()
    assert "rate_limiter" in _instance_group(repo, "flow_estimator")
    assert "rate_limiter" not in _instance_group(repo, "flow_estimator_tts")
    assert report["policy"] == {"tts_stream": policy("tts_stream"), "integrated": policy("integrated")}
    assert [(r["high"], r["low"]) for r in report["scenarios"]] == [("tts_stream", "integrated"),
                                                                    ("integrated", "tts_stream")]
    for res in report["scenarios"]:
        for key in ("high_alone", "low_alone", "high_mixed", "low_mixed"):
            c = res[key]
            assert c["failures"] == 0, (key, c["errors"])
            # each class's requests are its public model's requests in Triton's counters
            assert c["check"]["passed"] and c["check"]["triton_delta"] == c["requests"], (key, c["check"])
            assert c["answered"] == c["started"] > 0 and 0 < c["longest_s"] < math.inf
        for key in ("high_alone", "low_alone"):  # alone, each streamed chunk is one call of TTS's hift_decoder_tts
            if res[key]["column"] == "tts_stream":  # (so the copies answer, and TTS calls them, not VC's graphs)
                assert res[key]["chunk_check"]["passed"], res[key]["chunk_check"]
                assert res[key]["chunk_check"]["model"] == "hift_decoder_tts", res[key]["chunk_check"]
        # the flood really ran while the steady class was measured
        tag = f"{res['high']}_over_{res['low']}"
        high = RunResult.load(out / "with" / res["high"] / f"{tag}_high_mixed.json")
        low = RunResult.load(out / "with" / res["high"] / f"{tag}_low_mixed.json")
        h0, h1 = high.window
        assert min(r.start for r in low.records) <= h0
        assert max(r.start + r.latency_s for r in low.records) >= h1
        assert res["low_mixed"]["longest_s"] == pytest.approx(max(r.latency_s for r in low.records if r.ok))
        assert res["machine"]["audio_s_per_s"] > 0 and res["machine"]["cpu_server"] > 0
    md = (out / "report.md").read_text()
    assert "## Per class: alone and mixed" in md and (out / "mixed.png").is_file()


def test_set_niceness_lowers_every_thread_of_the_process_never_raises_it():
    """task_nice's effect in a model process (here a child process, so this test's own priority is left alone):
    threads started before the call are reniced too, a later thread inherits it, and a lower value never raises
    the priority back."""
    script = (
        "import os, threading\n"
        "from cosyvoice_triton.serving.stages.params import set_niceness\n"
        "ready, stop, seen = threading.Event(), threading.Event(), {}\n"
        "def early():\n"
        "    seen['early_tid'] = threading.get_native_id(); ready.set(); stop.wait()\n"
        "t = threading.Thread(target=early); t.start(); ready.wait()\n"
        "set_niceness(7)\n"
        "seen['early'] = os.getpriority(os.PRIO_PROCESS, seen['early_tid'])\n"
        "seen['main'] = os.getpriority(os.PRIO_PROCESS, 0)\n"
        "later = threading.Thread(target=lambda: seen.__setitem__('later', os.getpriority(os.PRIO_PROCESS, 0)))\n"
        "later.start(); later.join()\n"
        "set_niceness(3)\n"
        "seen['after_lower_value'] = os.getpriority(os.PRIO_PROCESS, 0)\n"
        "stop.set(); t.join()\n"
        "print(seen['main'], seen['early'], seen['later'], seen['after_lower_value'])\n")
    import subprocess
    import sys

    base = os.getpriority(os.PRIO_PROCESS, 0)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    main, early, later, after = map(int, out.stdout.split())
    want = max(7, base)
    assert (main, early, later, after) == (want, want, want, want)
