"""The load tests' stress mode (``loadtest/run.py --mode stress``), short: a real ``tritonserver`` (tiny model) and the
gateway in front of it, two innocent users beside three hostile ones (clients that vanish mid-request and
mid-answer, streams cancelled mid-way, live sequences without their start or their end, requests that time out)
for about a minute. Every innocent request succeeds, the server and the gateway are alive at the end, and the
memory figures (start, end, peak, growth) of both are in the report, their growth within a bound loose enough for a
minute on a shared machine (the long run's bound is 10 %). The long run: ``make loadtest-stress``."""

from __future__ import annotations

import json

import pytest
from conftest import PATIENT_TEST_S, require_live_loadtest

from cosyvoice_triton.loadtest.stress import HOSTILE_ACTS, memory_figures, memory_series, stress_markdown


def test_memory_figures_take_the_peaks_of_the_first_and_last_windows():
    samples = [(t, 100.0 + (t % 3) * 10, 50.0) for t in range(10)] + [(t, 130.0, 60.0) for t in range(10, 20)]
    m = memory_figures(samples, window_s=4.0)
    assert {k: v for k, v in m["triton"].items() if k != "slope_mb_s"} == \
        {"start_mb": 120.0, "end_mb": 130.0, "peak_mb": 130.0, "growth": pytest.approx(130 / 120 - 1)}
    assert m["triton"]["slope_mb_s"] > 0
    assert m["gateway"]["start_mb"] == 50.0 and m["gateway"]["growth"] == pytest.approx(0.2)
    assert memory_figures([], 4.0) == {}
    steady = memory_figures([(t, 100.0 + 0.5 * t, 80.0) for t in range(30)], window_s=5.0)
    assert steady["triton"]["slope_mb_s"] == pytest.approx(0.5)
    assert steady["gateway"]["slope_mb_s"] == pytest.approx(0.0)


def test_the_memory_series_keeps_each_stretchs_peak():
    samples = [(100.0 + t, 1000.0 + (50 if t == 7 else 0), 10.0 + t) for t in range(20)]
    series = memory_series(samples, points=5)
    assert [p[0] for p in series] == [0.0, 4.0, 8.0, 12.0, 16.0]
    assert series[0][1] == 1000.0 and series[1][1] == 1050.0  # the spike at t=7 is kept in its stretch (4-7)
    assert series[-1][2] == 29.0 and memory_series([]) == []


def test_the_runner_takes_the_stress_flags():
    from cosyvoice_triton.loadtest.runner import options_from_args, parser

    opts = options_from_args(parser().parse_args(["--mode", "stress", "--stress-seconds", "30", "--stress-users", "3",
                                                  "--stress-hostile-users", "5", "--stress-max-growth", "0.2"]))
    assert (opts.stress_seconds, opts.stress_users, opts.stress_hostile_users, opts.stress_max_growth) == \
        (30.0, 3, 5, 0.2)
    assert opts.stress_acts == () and opts.stress_kinds == ()
    picked = options_from_args(parser().parse_args(["--mode", "stress", "--stress-acts", "grpc_deadline,http_gives_up",
                                                    "--stress-kinds", "health"]))
    assert picked.stress_acts == ("grpc_deadline", "http_gives_up") and picked.stress_kinds == ("health",)
    with pytest.raises(SystemExit):
        parser().parse_args(["--mode", "stress", "--stress-acts", "not_an_act"])
    assert opts.out_dir.endswith("-stress")


@pytest.mark.timeout(PATIENT_TEST_S)
def test_short_stress_run_fails_no_innocent_request(serving_assets, tmp_path):
    require_live_loadtest()
    from cosyvoice_triton.loadtest.runner import Options, run

    out = tmp_path / "stress"
    opts = Options(name="smoke-stress", mode="stress", model_dir=str(serving_assets["model_dir"]),
                   onnx_dir=str(serving_assets["onnx_dir"]), out_dir=str(out), precision="fp32",
                   integrated_tunables={"max_queue_delay_us": 5000}, stress_seconds=60.0, stress_users=2,
                   stress_hostile_users=3, stress_max_growth=0.5,
                   # a loaded CI machine: give the Python backend's stubs time to answer
                   server_args=("--backend-config=python,stub-timeout-seconds=300",))
    report = run(opts)
    assert report["verdict"]["innocent_failures"] == 0, report["innocent_failures"]
    assert report["verdict"]["alive"] and report["verdict"]["hostile_key_freed"], report["verdict"]
    assert report["verdict"]["passed"], report["verdict"]
    assert set(report["innocent"]) == {"vc_http", "vc_grpc", "live", "health"}
    acts = {k.split(":")[0] for k in report["hostile"]}
    assert len(acts) >= 4 and acts <= set(HOSTILE_ACTS), report["hostile"]
    # a sequence without its start is refused as an unknown id, never answered
    assert not any(k.startswith("live_without_start: answered") for k in report["hostile"]), report["hostile"]
    for name in ("triton", "gateway"):
        m = report["memory"][name]
        assert 0 < m["start_mb"] <= m["peak_mb"] and 0 < m["end_mb"] <= m["peak_mb"], m
    assert json.loads((out / "report.json").read_text())["verdict"] == report["verdict"]
    md = (out / "report.md").read_text()
    assert md == stress_markdown(report) and "| gateway |" in md and "PASSED" in md
    assert (out / "memory.png").stat().st_size > 0 and len(report["memory_series"]) > 10
