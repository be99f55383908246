"""The rollout scenario's report (``cosyvoice_triton.loadtest.rollout``) from recorded requests, without a server:
per-phase windows (the step, then the steady window), failures and latency percentiles, the markdown table and the
plot. The scenario itself runs with ``make rollout-demo`` (a live server and Locust; README, Rollouts)."""

from __future__ import annotations

import pytest

from cosyvoice_triton.loadtest import rollout


def _report(records):
    phases = [
        {"phase": "v1 alone", "start": 100.0, "step_end": 100.0, "end": 110.0, "step_s": 0.0,
         "split": {"1": 100.0}, "per_version": {"1": 5, "2": 0}},
        {"phase": "stage v2", "start": 110.0, "step_end": 130.0, "end": 140.0, "step_s": 20.0,
         "split": {"1": 100.0, "2": 0.0}, "per_version": {"1": 4, "2": 0}, "parity_db": 0.0},
        {"phase": "canary 50%", "start": 140.0, "step_end": 142.0, "end": 150.0, "step_s": 2.0,
         "split": {"1": 50.0, "2": 50.0}, "per_version": {"1": 2, "2": 3}},
    ]
    rollout.summarize(phases, records)
    return {"users": 2, "phase_requests": 5, "requests": len(records), "failures": sum(1 for r in records if r[2]),
            "errors": sorted({r[2] for r in records if r[2]}), "locust_requests": len(records), "locust_failures": 0,
            "duration_s": 60.0, "loadavg_before": [1.0, 1.0, 1.0], "loadavg_after": [2.0, 1.0, 1.0], "cpus": 2,
            "overall": rollout.window(records, 0, float("inf")), "phases": phases, "records": records}


def test_windows_split_each_phase_into_its_step_and_the_steady_part(tmp_path):
    records = [(101.0 + i, 1.0 + i / 10, "") for i in range(5)]  # v1 alone: 1.0 .. 1.4 s
    records += [(115.0, 3.0, ""), (125.0, 5.0, "VCError: boom")]  # during the stage
    records += [(131.0 + i, 2.0, "") for i in range(4)]  # after it
    records += [(141.0, 2.5, ""), (143.0, 1.5, ""), (149.9, 1.5, ""), (150.0, 9.0, "")]  # 150.0: after the end
    report = _report(records)
    alone, stage, canary = report["phases"]
    assert alone["step"] == {"requests": 0, "failures": 0, "p50_s": None, "p95_s": None}
    assert alone["steady"]["requests"] == 5 and alone["steady"]["p50_s"] == pytest.approx(1.2)
    assert alone["steady"]["p95_s"] == pytest.approx(1.38)
    assert stage["step"] == {"requests": 2, "failures": 1, "p50_s": 4.0, "p95_s": pytest.approx(4.9)}
    assert stage["steady"]["requests"] == 4 and stage["steady"]["failures"] == 0
    assert canary["step"]["requests"] == 1 and canary["steady"]["requests"] == 2
    md = rollout.render_markdown(report)
    assert "| stage v2 | 100% / 0% | 20.0 | 2 | 1 | 4 | 0 | 2000 | 2000 | 4 | 0 |" in md
    assert "| v1 alone | 100% / 0% | 0.0 | 0 | 0 | 5 | 0 | 1200 | 1380 | 5 | 0 |" in md
    assert "**1 failed**" in md and "- VCError: boom" in md and "stage v2: 0.000 dB" in md
    png = rollout.plot(report, tmp_path / "rollout.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_scenario_goes_through_every_step_and_promotes_unless_told_not_to():
    steps = [s for _, s in rollout.PHASES + rollout.PROMOTE_PHASES]
    assert steps == [None, ("stage", 2), ("canary", 10), ("canary", 50), ("canary", 100), ("rollback",),
                     ("stage", 2), ("promote",)]
