"""The load-test library (``cosyvoice_triton.loadtest``): report math, metrics parsing, statistics deltas, the run
recorder and the sampler's figures on synthetic inputs; then one short live run of both columns against real
``tritonserver`` instances (tiny model) whose Locust counts must agree with Triton's success counters."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, PATIENT_TEST_S, require_live_loadtest

from cosyvoice_triton.loadtest.metrics import Snapshot, counter_total, parse_prometheus, stats_delta, success_delta
from cosyvoice_triton.loadtest.perf import parse_csv
from cosyvoice_triton.loadtest.recording import RequestRecord, RunConfig, RunRecorder, RunResult
from cosyvoice_triton.loadtest.report import (
    RunSummary,
    change,
    comparison_table,
    cross_check,
    latency_summary,
    render_markdown,
    summarize_run,
    targets,
    write_report,
)
from cosyvoice_triton.loadtest.sampler import ProcessTreeSample, ServerSampler
from cosyvoice_triton.loadtest.workload import Workload, load_workload

METRICS = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="cosyvoice_vc",version="1"} 212
nv_inference_request_success{model="flow",version="1"} 212
nv_inference_request_success{model="flow",version="2"} 3
nv_inference_request_failure{model="cosyvoice_vc",reason="REJECTED",version="1"} 2
nv_inference_request_failure{model="cosyvoice_vc",reason="BACKEND",version="1"} 1
# TYPE nv_cpu_utilization gauge
nv_cpu_utilization 0.4375
weird_metric{path="a\\"b\\\\c",x=""} NaN
inf_metric +Inf 1700000000000
"""


def test_parse_prometheus_labels_values_and_sums():
    samples = parse_prometheus(METRICS)
    assert len(samples) == 8
    assert counter_total(samples, "nv_inference_request_success", model="flow") == 215  # both versions
    assert counter_total(samples, "nv_inference_request_success", model="flow", version="2") == 3
    assert counter_total(samples, "nv_inference_request_failure", model="cosyvoice_vc") == 3
    assert counter_total(samples, "nv_cpu_utilization") == pytest.approx(0.4375)
    assert counter_total(samples, "nv_inference_request_success", model="absent") == 0
    weird = next(s for s in samples if s.name == "weird_metric")
    assert weird.labels == {"path": 'a"b\\c', "x": ""} and math.isnan(weird.value)
    assert next(s for s in samples if s.name == "inf_metric").value == math.inf  # timestamp ignored


@pytest.mark.parametrize("line", ["nv_x{model=\"a\" 1", "nv_x{model=a} 1", "nv_x one", "{model=\"a\"} 1"])
def test_parse_prometheus_refuses_malformed_lines(line):
    with pytest.raises(ValueError):
        parse_prometheus(line + "\n")


def _model(name, inferences, executions, success, queue_ns, compute_ns, request_ns, fail=0, as_str=False):
    conv = str if as_str else int

    def d(count, ns):
        return {"count": conv(count), "ns": conv(ns)}

    return {"name": name, "version": "1", "inference_count": conv(inferences), "execution_count": conv(executions),
            "inference_stats": {"success": d(success, request_ns), "fail": d(fail, 0), "queue": d(success, queue_ns),
                                "compute_input": d(success, compute_ns // 4),
                                "compute_infer": d(success, compute_ns // 2),
                                "compute_output": d(success, compute_ns // 4)}}


@pytest.mark.parametrize("as_str", [False, True], ids=["http-ints", "grpc-strings"])
def test_stats_delta_average_batch_and_times(as_str):
    before = {"model_stats": [_model("flow", 10, 10, 10, 0, 0, 0, as_str=as_str),
                              _model("idle", 5, 5, 5, 0, 0, 0, as_str=as_str)]}
    after = {"model_stats": [
        _model("flow", 10 + 40, 10 + 16, 10 + 40, 40 * 2_000_000, 40 * 8_000_000, 40 * 11_000_000, as_str=as_str),
        _model("idle", 5, 5, 5, 0, 0, 0, as_str=as_str),
        _model("new", 6, 2, 6, 6_000_000, 60_000_000, 70_000_000, fail=1, as_str=as_str)]}
    d = stats_delta(before, after)
    assert set(d) == {"flow", "new"}  # idle had nothing to do
    assert d["flow"]["requests"] == 40 and d["flow"]["executions"] == 16
    assert d["flow"]["avg_batch"] == pytest.approx(40 / 16)
    assert d["flow"]["queue_ms"] == pytest.approx(2.0)
    assert d["flow"]["compute_ms"] == pytest.approx(8.0)
    assert d["flow"]["request_ms"] == pytest.approx(11.0)
    assert d["new"]["avg_batch"] == pytest.approx(3.0) and d["new"]["failures"] == 1


def test_stats_delta_refuses_counters_that_went_down():
    before = {"model_stats": [_model("flow", 50, 20, 50, 0, 0, 0)]}
    after = {"model_stats": [_model("flow", 3, 3, 3, 0, 0, 0)]}
    with pytest.raises(ValueError, match="restarted"):
        stats_delta(before, after)


def test_latency_summary_percentiles():
    s = latency_summary([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s["mean_ms"] == pytest.approx(50.5)
    assert s["p50_ms"] == pytest.approx(50.5)
    assert s["p95_ms"] == pytest.approx(95.05)
    assert s["p99_ms"] == pytest.approx(99.01)
    assert all(math.isnan(v) for v in latency_summary([]).values())


def _snapshot(t, success, model="cosyvoice_vc", stats=None):
    samples = parse_prometheus(f'nv_inference_request_success{{model="{model}",version="1"}} {success}\n')
    return Snapshot(t, samples, stats or {"model_stats": []})


def _run(records, *, t0=100.0, t1=110.0, begin=50, end=None, locust=None, failures=0, calls=1, model="cosyvoice_vc"):
    cfg = RunConfig(column="integrated", protocol="grpc", url="x", http_url="x", metrics_url="x", workload="w",
                    out="o", users=4, target_requests=len(records), check_model=model, calls_per_request=calls)
    ok = sum(r.ok for r in records)
    end = begin + ok * calls if end is None else end
    return RunResult(cfg, records, _snapshot(t0, begin, model), _snapshot(t1, end, model),
                     locust_requests=len(records) if locust is None else locust, locust_failures=failures,
                     target_reached=True)


def test_summarize_run_throughput_rtf_and_failures():
    recs = [RequestRecord(100.0 + i, 0.5 + 0.1 * (i % 2), 5.0, True) for i in range(18)]
    recs += [RequestRecord(105.0, 0.2, 0.0, False, "VCError: boom")] * 2
    s = summarize_run(_run(recs, failures=2), server={"peak_rss_mb": 1234.0, "cpu_triton": 0.5})
    assert (s.requests, s.failures) == (20, 2)
    assert s.req_per_s == pytest.approx(18 / 10)
    assert s.audio_s_per_s == pytest.approx(18 * 5.0 / 10)
    assert s.mean_ms == pytest.approx(550.0)
    assert s.rtf == pytest.approx(0.55 / 5.0)
    assert s.mean_audio_s == pytest.approx(5.0)
    assert s.errors == {"VCError: boom": 2}
    assert s.peak_rss_mb == 1234.0 and s.cpu_triton == 0.5 and math.isnan(s.cpu_server)
    assert s.check["passed"] and s.check["expected"] == 18


@pytest.mark.parametrize(("delta", "passed"), [(200, True), (202, True), (198, True), (203, False), (196, False)])
def test_cross_check_tolerance_is_one_percent(delta, passed):
    recs = [RequestRecord(100.0, 0.1, 1.0, True)] * 200
    c = cross_check(_run(recs, end=50 + delta))
    assert c.expected == 200 and c.triton_delta == delta
    assert c.passed is passed


def test_cross_check_counts_calls_per_conversion_and_own_records():
    recs = [RequestRecord(100.0, 0.1, 1.0, True)] * 10
    c = cross_check(_run(recs, calls=2, model="speech_tokenizer"))
    assert (c.model, c.expected, c.triton_delta, c.passed) == ("speech_tokenizer", 20, 20, True)
    # Locust counted one more success than the locustfile recorded: a mismatch even if Triton agrees with Locust
    c = cross_check(_run(recs, locust=11, end=50 + 11))
    assert not c.passed


def test_success_delta_per_model():
    a = Snapshot(0, parse_prometheus(METRICS))
    b = Snapshot(1, parse_prometheus(METRICS.replace("} 212", "} 230")))
    assert success_delta(a, b) == {"cosyvoice_vc": 18, "flow": 18}
    assert success_delta(a, b, "flow") == {"flow": 18}


def test_change_column():
    assert change(850.0, 320.0) == "-62%"
    assert change(4.2, 11.5) == "+174%"
    assert change(0.75, 0.45, points=True) == "-30 pts"
    assert change(math.nan, 1.0) == "n/a" and change(0.0, 1.0) == "n/a"


def _summary(column, **kw):
    base = dict(column=column, protocol="grpc", users=10, requests=200, failures=0, duration_s=100.0, mean_ms=850.0,
                p50_ms=800.0, p95_ms=1200.0, p99_ms=1500.0, req_per_s=2.0, audio_s_per_s=4.2, rtf=0.17,
                mean_audio_s=5.0, peak_rss_mb=2200.0, cpu_triton=0.75)
    base.update(kw)
    return RunSummary(**base)


def test_comparison_table_and_targets():
    plain = _summary("plain")
    integ = _summary("integrated", mean_ms=320.0, audio_s_per_s=11.5, peak_rss_mb=1800.0, cpu_triton=0.45)
    table = comparison_table(plain, integ)
    assert "| end-to-end mean latency | 850 ms | 320 ms | -62% |" in table
    assert "| throughput (audio s / s) | 4.20 | 11.50 | +174% |" in table
    assert "| mean CPU utilisation (nv_cpu_utilization) | 75% | 45% | -30 pts |" in table
    assert "peak GPU memory" not in table  # no GPU figures: no row
    t = targets(plain, integ)
    assert t["throughput_ratio"] == pytest.approx(11.5 / 4.2) and not t["throughput_met"]
    assert t["latency_reduction"] == pytest.approx(1 - 320 / 850) and not t["latency_met"]
    assert t["failures_met"]


def test_report_markdown_and_json_round_trip(tmp_path):
    plain, integ = _summary("plain", protocol="http"), _summary("integrated", protocol="http", p99_ms=math.nan)
    report = {"config_name": "tiny", "users": 10, "protocols": ["http"], "runs": [plain.to_json(), integ.to_json()],
              "sweep": [_summary("plain", users=u).to_json() for u in (1, 2)],
              "perf_analyzer": [{"protocol": "http", "concurrency": 10, "throughput": 2.1, "mean_ms": 800.0,
                                 "p95_ms": 1100.0, "note": "3 windows"}], "notes": ["a note"]}
    md, js = write_report(report, tmp_path)
    text = md.read_text()
    assert "## HTTP, 10 concurrent users" in text and "| p99 latency | 1,500 ms | n/a | n/a |" in text
    assert "## Concurrency sweep" in text and "## perf_analyzer" in text and "- a note" in text
    loaded = json.loads(js.read_text())  # strict JSON: NaN written as null
    assert loaded["runs"][1]["p99_ms"] is None
    assert render_markdown(loaded) == text  # the JSON alone renders the same report


def test_run_recorder_warmup_target_and_restart():
    cfg = RunConfig(column="plain", protocol="http", url="", http_url="", metrics_url="", workload="", out="",
                    target_requests=3, warmup_requests=2)
    rec = RunRecorder(cfg)
    assert not rec.record(0.0, 1.0, 5.0, None) and not rec.warmed_up()
    rec.record(0.0, 1.0, 5.0, None)
    assert rec.warmed_up() and rec.records == []  # warm-up completions are not measured
    rec.start_measuring()
    rec.record(1.0, 1.0, 5.0, None)
    rec.start_measuring()  # the reset was taken again: what came before is dropped
    assert rec.records == [] and rec.warmup_completed == 3
    assert not rec.record(2.0, 1.0, 5.0, None)
    assert not rec.record(3.0, 2.0, 5.0, RuntimeError("x"))
    assert rec.record(4.0, 1.0, 5.0, None)  # target reached: stop, once
    assert not rec.record(5.0, 1.0, 5.0, None)  # users finishing their conversion still count
    result = rec.result(None, locust_requests=4, locust_failures=1)
    assert [r.ok for r in result.records] == [True, False, True, True]
    assert result.records[1].audio_s == 0.0 and result.records[1].error == "RuntimeError: x"
    assert result.target_reached


def test_run_result_json_round_trip(tmp_path):
    run = _run([RequestRecord(100.0, 0.5, 5.0, True), RequestRecord(101.0, 0.1, 0.0, False, "e")])
    path = run.save(tmp_path / "r.json")
    back = RunResult.load(path)
    assert back.records == run.records and back.config == run.config
    assert back.window == (100.0, 101.1)  # to the last completion
    assert back.begin.total("nv_inference_request_success") == 50


def test_sampler_figures_over_a_window():
    s = ServerSampler(pid=0)
    mib = 2**20
    s.tree = [ProcessTreeSample(t, rss * mib, cpu, 3) for t, rss, cpu in
              [(0.0, 100, 0.0), (1.0, 300, 0.5), (2.0, 200, 1.5), (3.0, 900, 3.5), (4.0, 150, 4.0)]]
    s.cpu_util = [(0.5, 0.2), (1.5, 0.4), (2.5, 0.6), (5.0, 1.0)]
    assert s.peak_rss_mb(0.5, 2.5) == pytest.approx(300)
    assert s.peak_rss_mb() == pytest.approx(900)
    import psutil

    assert s.process_cpu(1.0, 3.0) == pytest.approx((3.5 - 0.5) / 2.0 / (psutil.cpu_count() or 1))
    assert s.mean_cpu_utilization(1.0, 3.0) == pytest.approx(0.5)
    assert math.isnan(s.mean_cpu_utilization(10, 11)) and math.isnan(s.process_cpu(10, 11))
    assert all(math.isnan(x) for x in s.peak_gpu_mb())


def test_perf_analyzer_csv():
    text = ("Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
            "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency\n"
            "10,2.5,200,366355,2,2001,2365367,5262,4,2911976,3440424,3608385,3610730\n")
    r = parse_csv(text)
    assert r["concurrency"] == 10 and r["throughput"] == 2.5
    assert r["mean_ms"] == pytest.approx(2739.191)  # the sum of the parts
    assert r["p95_ms"] == pytest.approx(3608.385)
    with pytest.raises(ValueError):
        parse_csv(text.splitlines()[0] + "\n")


def test_workload_round_trip(tmp_path):
    wl = Workload((np.zeros(22050 * 3, np.float32), np.ones(16000 * 7, np.float32)), (22050, 16000),
                  np.full(24000 * 3, 0.5, np.float32), 24000, ("a", "b"))
    back = load_workload(wl.save(tmp_path / "w.npz"))
    assert back.source_seconds == pytest.approx([3.0, 7.0]) and back.prompt_seconds == pytest.approx(3.0)
    assert back.item(3).source_sr == 16000 and back.descriptions == ("a", "b")  # items cycle
    np.testing.assert_array_equal(back.item(0).prompt, wl.prompt)


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from cosyvoice_triton.loadtest.plots import plot_latency_cdf, plot_sweep

    a = plot_latency_cdf({"plain grpc": [0.8, 0.9, 1.2], "integrated grpc": [0.3, 0.35]}, tmp_path / "cdf.png")
    b = plot_sweep([_summary(c, users=u, audio_s_per_s=u * 0.5) for c in ("plain", "integrated") for u in (1, 2, 4)],
                   tmp_path / "sweep.png")
    for p in (a, b):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------- live run


@pytest.mark.timeout(PATIENT_TEST_S)  # 2 server starts, 4 short Locust runs and a profile, on a busy machine
def test_live_short_run_counts_agree_with_triton(serving_assets, tmp_path):
    """Both columns, both protocols, a few requests each: Locust's counts equal the locustfile's records and
    Triton's success counters; the report, its JSON and the plot are written; the servers are stopped."""
    require_live_loadtest()
    from cosyvoice_triton.loadtest.runner import Options, run

    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    out = tmp_path / "loadtest"
    # the fixtures as the workload (no espeak-ng needed): 2.5 s and 3.5 s sources, the 3 s prompt
    Workload((src[: int(2.5 * ssr)], src[: int(3.5 * ssr)]), (ssr, ssr), prm, psr).save(out / "workload.npz")
    opts = Options(name="smoke", model_dir=str(serving_assets["model_dir"]), onnx_dir=str(serving_assets["onnx_dir"]),
                   out_dir=str(out), users=2, requests=3, warmup_requests=1, sweep=(), perf_protocols=(),
                   precision="fp32", max_run_s=2 * PATIENCE_S)  # a ceiling: the run stops at its requests
    report = run(opts)
    runs = report["runs"]
    assert {(r["column"], r["protocol"]) for r in runs} == {(c, p) for c in ("plain", "integrated")
                                                           for p in ("http", "grpc")}
    for r in runs:
        assert r["failures"] == 0, r["errors"]
        assert r["requests"] >= 3
        assert r["check"]["passed"], r["check"]
        assert r["check"]["triton_delta"] == r["check"]["expected"] == r["requests"] * r["check"]["calls_per_request"]
        assert r["audio_s_per_s"] > 0 and r["peak_rss_mb"] > 100
    integ = next(r for r in runs if r["column"] == "integrated")
    assert integ["stages"]["cosyvoice_vc"]["requests"] == integ["requests"]
    plain = next(r for r in runs if r["column"] == "plain")
    assert "cosyvoice_vc" not in plain["stages"]  # the plain client never calls the ensemble
    assert all(s["avg_batch"] == pytest.approx(1.0) for m, s in plain["stages"].items() if m != "flow_estimator")
    assert (out / "report.md").is_file() and (out / "latency_cdf.png").is_file()
    assert "## Cross-check" in (out / "report.md").read_text()
    assert "## Profile of the slowest stage" in (out / "report.md").read_text()  # on by default, after the columns
    assert report["profile"].get("graph") == "flow_estimator", report["profile"]
    assert json.loads((out / "report.json").read_text())["runs"]


def test_runner_set_passes_tunables_to_the_integrated_column_only(tmp_path):
    from cosyvoice_triton.loadtest.runner import options_from_args, parser

    opts = options_from_args(parser().parse_args(["--set", "instances=flow:2", "--set", "max_queue_delay_us=500"]))
    assert opts.integrated_tunables == {"instances": {"flow": 2}, "max_queue_delay_us": 500}
    assert options_from_args(parser().parse_args([])).integrated_tunables == {"instances": {"flow": 2,
                                                                                         "flow_estimator": 2}}
    with pytest.raises(SystemExit):
        parser().parse_args(["--set", "no_such_tunable=1"])
