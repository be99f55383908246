"""Triton's Prometheus metrics and per-model statistics: parse, snapshot, and take the difference of two snapshots.

Only the standard library is used (plain HTTP), so a Locust user process can snapshot the server at the exact
moment it resets its statistics without a second client library.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Sample", "Snapshot", "counter_total", "parse_prometheus", "scrape", "settled_snapshot", "stats_delta",
           "take_snapshot"]

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?\s*')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def _unescape(text: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], text)


def parse_prometheus(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition (comments skipped). Raises ``ValueError`` on a line that is
    neither a comment nor a well-formed sample, so that a changed format is noticed rather than misread."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError(f"metrics line {n} is not a sample: {raw!r}")
        name, _, label_text, value = m.group(1), m.group(2), m.group(3) or "", m.group(4)
        labels: dict[str, str] = {}
        pos = 0
        while pos < len(label_text):
            lm = _LABEL.match(label_text, pos)
            if not lm:
                raise ValueError(f"metrics line {n}: malformed labels {label_text!r}")
            labels[lm.group(1)] = _unescape(lm.group(2))
            pos = lm.end()
        try:
            v = float(value)  # also "+Inf", "-Inf", "NaN"
        except ValueError as exc:
            raise ValueError(f"metrics line {n}: value {value!r} is not a number") from exc
        out.append(Sample(name, labels, v))
    return out


def counter_total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0 when there are none)."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _get(url: str, timeout: float, headers: dict[str, str] | None = None) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
        return resp.read()


def scrape(metrics_url: str, timeout: float = 5.0) -> list[Sample]:
    """The samples of ``http://host:port/metrics``."""
    return parse_prometheus(_get(metrics_url, timeout).decode())


def fetch_statistics(http_url: str, timeout: float = 10.0) -> dict:
    """Triton's per-model statistics (``GET /v2/models/stats``) from ``host:port`` of its HTTP endpoint."""
    from ..admin import admin_headers

    base = http_url if http_url.startswith("http") else f"http://{http_url}"
    return json.loads(_get(f"{base}/v2/models/stats", timeout, admin_headers("http")))  # a restricted API


# Metric families kept in a snapshot (the others are dropped to keep the files small).
KEPT = ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
        "nv_inference_exec_count", "nv_cpu_utilization", "nv_cpu_memory_used_bytes", "nv_cpu_memory_total_bytes",
        "nv_gpu_memory_used_bytes", "nv_gpu_utilization")


@dataclass
class Snapshot:
    """The server's counters at one moment: wall time, kept metric samples, per-model statistics."""

    time: float
    samples: list[Sample] = field(default_factory=list)
    statistics: dict = field(default_factory=dict)

    def total(self, name: str, **labels: str) -> float:
        return counter_total(self.samples, name, **labels)

    def models(self) -> list[str]:
        return sorted({s.labels["model"] for s in self.samples if "model" in s.labels})

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time, "samples": [[s.name, dict(s.labels), s.value] for s in self.samples],
                "statistics": self.statistics}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Snapshot:
        return cls(float(d["time"]), [Sample(n, dict(lab), float(v)) for n, lab, v in d.get("samples", [])],
                   dict(d.get("statistics", {})))


def take_snapshot(http_url: str, metrics_url: str, *, statistics: bool = True) -> Snapshot:
    """Metrics first (the success counters the cross-check compares), then the statistics."""
    t = time.time()
    samples = [s for s in scrape(metrics_url) if s.name in KEPT]
    stats = fetch_statistics(http_url) if statistics else {}
    return Snapshot(t, samples, stats)


def settled_snapshot(http_url: str, metrics_url: str, *, interval: float = 0.1, timeout: float = 5.0,
                     statistics: bool = True) -> Snapshot:
    """A snapshot once the success and failure counters have stopped moving: with nothing in flight, Triton still
    counts a request a little after its answer reached the client (the backend reports its statistics once
    ``execute`` has returned), so two reads ``interval`` apart must agree (at most ``timeout`` seconds)."""

    def counts(s: Snapshot) -> tuple[float, float]:
        return s.total("nv_inference_request_success"), s.total("nv_inference_request_failure")

    deadline = time.monotonic() + timeout
    time.sleep(interval)
    snap = take_snapshot(http_url, metrics_url, statistics=False)
    while True:
        time.sleep(interval)
        nxt = take_snapshot(http_url, metrics_url, statistics=statistics)
        if counts(nxt) == counts(snap) or time.monotonic() > deadline:
            return nxt
        snap = nxt


def success_delta(before: Snapshot, after: Snapshot, model: str | None = None) -> dict[str, float]:
    """``nv_inference_request_success`` increase per model (``model``: only that one)."""
    models = [model] if model else sorted(set(before.models()) | set(after.models()))
    return {m: after.total("nv_inference_request_success", model=m)
            - before.total("nv_inference_request_success", model=m) for m in models}


def failure_delta(before: Snapshot, after: Snapshot, model: str | None = None) -> dict[str, float]:
    models = [model] if model else sorted(set(before.models()) | set(after.models()))
    return {m: after.total("nv_inference_request_failure", model=m)
            - before.total("nv_inference_request_failure", model=m) for m in models}


def _by_model(stats: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    out: dict[str, Mapping[str, Any]] = {}
    for s in stats.get("model_stats", []):
        # one entry per version; the repository serves version 1 only, but add up to be safe
        out.setdefault(s["name"], {"entries": []})["entries"].append(s)  # type: ignore[index]
    return out


def _sum(entries: list[Mapping[str, Any]], *path: str) -> int:
    total = 0
    for e in entries:
        v: Any = e
        for p in path:
            v = v.get(p, {}) if isinstance(v, Mapping) else {}
        try:
            total += int(v)  # ints over HTTP, strings in gRPC's JSON
        except (TypeError, ValueError):
            continue
    return total


def stats_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per model, what happened between two ``/v2/models/stats`` answers.

    ``requests`` (successful requests), ``failures``, ``inferences`` (batch rows: ``inference_count``),
    ``executions`` (model executions: ``execution_count``), ``avg_batch`` (inferences / executions), and the
    mean per-request ``queue_ms``, ``compute_ms`` (input + infer + output) and ``request_ms`` (end to end in
    the server). Models with no activity in between are left out. A counter that went down (server restart)
    raises ``ValueError``.
    """
    b, a = _by_model(before), _by_model(after)
    out: dict[str, dict[str, float]] = {}
    for name in sorted(a):
        ea, eb = a[name]["entries"], b.get(name, {"entries": []})["entries"]

        def d(*path: str, ea=ea, eb=eb, name=name) -> int:
            v = _sum(ea, *path) - _sum(eb, *path)
            if v < 0:
                raise ValueError(f"statistics of {name}: {'.'.join(path)} went down ({v}): was the server restarted?")
            return v

        requests, executions = d("inference_stats", "success", "count"), d("execution_count")
        inferences, failures = d("inference_count"), d("inference_stats", "fail", "count")
        if not (requests or executions or failures):
            continue

        def mean_ms(key: str, n: int, d=d) -> float:
            return d("inference_stats", key, "ns") / n / 1e6 if n else math.nan

        compute_ns = sum(d("inference_stats", k, "ns") for k in ("compute_input", "compute_infer", "compute_output"))
        compute_n = d("inference_stats", "compute_infer", "count")
        out[name] = {
            "requests": requests, "failures": failures, "inferences": inferences, "executions": executions,
            "avg_batch": inferences / executions if executions else math.nan,
            "queue_ms": mean_ms("queue", d("inference_stats", "queue", "count")),
            "compute_ms": compute_ns / compute_n / 1e6 if compute_n else math.nan,
            "request_ms": mean_ms("success", requests),
        }
    return out
