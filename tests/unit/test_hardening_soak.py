"""The soak's verdict arithmetic (``make soak`` itself is not in CI: 30 minutes)."""

from __future__ import annotations

import math

import pytest

from cosyvoice_triton.loadtest.soak import SoakResult, memory_growth, report_md


def _series(rss_of_t, minutes=30.0, every=5.0):
    n = int(minutes * 60 / every)
    return [(i * every, rss_of_t(i * every)) for i in range(n + 1)], 0.0, minutes * 60


def test_flat_memory_after_the_warm_in_is_no_growth():
    # allocators fill during the first minutes, then stay: that is not a leak
    samples, t0, t1 = _series(lambda t: 2000 + 300 * min(1.0, t / 120))
    base, end, growth = memory_growth(samples, t0, t1)
    assert base == pytest.approx(2300) and end == pytest.approx(2300) and abs(growth) < 1e-9


def test_steady_growth_is_measured():
    samples, t0, t1 = _series(lambda t: 2000 + t / 60 * 10)  # +10 MB a minute
    base, end, growth = memory_growth(samples, t0, t1)
    assert 0.08 < growth < 0.12 and end > base


def test_the_warm_in_waits_for_the_users_requests():
    samples, t0, t1 = _series(lambda t: 2000 if t > 600 else 1000, minutes=30)
    assert memory_growth(samples, t0, t1)[2] > 0.5  # a 3-minute warm-in would judge the slow start as growth
    assert abs(memory_growth(samples, t0, t1, warm_until=605.0)[2]) < 1e-9


def test_windows_span_the_waves_of_requests():
    # users in step: RSS rises and falls with a 60 s period; 10% of a 10 min run (60 s) can catch one phase
    samples, t0, t1 = _series(lambda t: 2000 + 400 * math.sin(2 * math.pi * t / 60), minutes=10, every=1.0)
    assert abs(memory_growth(samples, t0, t1, min_window=90.0)[2]) < 1e-3  # peaks of windows > one wave


def test_the_end_peak_is_compared_with_the_peak_after_the_warm_in():
    samples, t0, t1 = _series(lambda t: 2000 + 400 * math.sin(2 * math.pi * t / 60) + t / 60 * 10, every=1.0)
    assert 0.06 < memory_growth(samples, t0, t1, min_window=90.0)[2] < 0.12  # +10 MB a minute under the waves


def test_samples_after_the_end_do_not_count():
    samples, t0, t1 = _series(lambda t: 2000, minutes=30)
    samples.append((t1 + 30, 5000))  # the sampler runs on while the last requests are answered
    assert memory_growth(samples, t0, t1)[2] == 0.0


def test_a_run_too_short_has_no_growth_figure_and_fails():
    samples, t0, t1 = _series(lambda t: 2000, minutes=4)
    assert math.isnan(memory_growth(samples, t0, t1, warm_until=200.0)[2])
    result = SoakResult(minutes=4, users=20, requests=64, memory_growth=math.nan)
    assert not result.passed and "too short" in report_md(result, "soak")
    ok = SoakResult(minutes=30, users=20, requests=900, memory_growth=0.01)
    assert ok.passed and "PASSED" in report_md(ok, "soak")
    assert not SoakResult(minutes=30, users=20, requests=900, failures=1, memory_growth=0.01).passed
    assert not SoakResult(minutes=30, users=20, requests=900, memory_growth=0.06).passed
    assert not SoakResult(minutes=30, users=20, requests=900, memory_growth=0.0,
                          supervisor_events=["stub-died: flow"]).passed
