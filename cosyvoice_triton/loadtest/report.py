"""Figures of a load test and the report: the comparison table (plain separate calls vs integrated, with the
change column), the cross-checks against Triton's own counters, per-stage statistics, the concurrency sweep and
perf_analyzer's figures; markdown (printed and written) and JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .metrics import stats_delta, success_delta
from .recording import RunResult

__all__ = ["ChunkCheck", "CrossCheck", "RunSummary", "change", "chunk_check", "comparison_table", "cross_check",
           "latency_summary", "render_markdown", "summarize_run", "tts_table"]

TOLERANCE = 0.01  # Locust's count against Triton's success counter


def latency_summary(latencies_s: Sequence[float]) -> dict[str, float]:
    """mean / p50 / p95 / p99 in ms (linear interpolation between order statistics); NaN when empty."""
    a = np.asarray(latencies_s, np.float64) * 1000.0
    if a.size == 0:
        return {"mean_ms": math.nan, "p50_ms": math.nan, "p95_ms": math.nan, "p99_ms": math.nan}
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"mean_ms": float(a.mean()), "p50_ms": float(p50), "p95_ms": float(p95), "p99_ms": float(p99)}


@dataclass
class CrossCheck:
    """Locust's successful conversions against the increase of Triton's ``nv_inference_request_success``."""

    model: str
    locust_ok: int
    calls_per_request: int
    triton_delta: float
    recorded_ok: int  # the locustfile's own records (the figures' source); must equal locust_ok

    @property
    def expected(self) -> int:
        return self.locust_ok * self.calls_per_request

    @property
    def difference(self) -> float:
        """(Triton - expected) / expected."""
        return (self.triton_delta - self.expected) / self.expected if self.expected else math.inf

    @property
    def passed(self) -> bool:
        return self.expected > 0 and abs(self.difference) <= TOLERANCE and self.recorded_ok == self.locust_ok

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "expected": self.expected, "difference": self.difference, "passed": self.passed}


def cross_check(run: RunResult) -> CrossCheck:
    cfg = run.config
    delta = math.nan
    if run.begin is not None and run.end is not None:
        delta = success_delta(run.begin, run.end, cfg.check_model)[cfg.check_model]
    return CrossCheck(cfg.check_model, run.locust_requests - run.locust_failures, cfg.calls_per_request, delta,
                      sum(r.ok for r in run.records))


@dataclass
class ChunkCheck:
    """Streams: audio chunks the clients received against the increase of the success counter of the model each
    chunk calls once (``hift_decoder``: one vocoder call per chunk); equal when nothing else calls it."""

    model: str
    chunks_received: int
    triton_delta: float

    @property
    def passed(self) -> bool:
        return self.chunks_received > 0 and self.triton_delta == self.chunks_received

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def chunk_check(run: RunResult) -> ChunkCheck | None:
    model = run.config.chunk_model
    if not model:
        return None
    delta = math.nan
    if run.begin is not None and run.end is not None:
        delta = success_delta(run.begin, run.end, model)[model]
    return ChunkCheck(model, sum(r.chunks for r in run.records if r.ok), delta)


@dataclass
class RunSummary:
    """The figures of one Locust run (one column, protocol and concurrency)."""

    column: str
    protocol: str
    users: int
    requests: int  # measured (after the warm-up)
    failures: int
    duration_s: float
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    req_per_s: float
    audio_s_per_s: float
    rtf: float  # mean over requests of latency / seconds of audio produced
    mean_audio_s: float
    peak_rss_mb: float = math.nan
    cpu_triton: float = math.nan  # mean nv_cpu_utilization (whole machine, 0..1)
    cpu_server: float = math.nan  # the server's processes (psutil), fraction of all cores
    peak_gpu_mb: float = math.nan  # the server's processes (nvidia-smi)
    peak_gpu_device_mb: float = math.nan  # the whole device(s)
    target_reached: bool = True
    errors: dict[str, int] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, dict[str, float]] = field(default_factory=dict)
    # streams (the TTS column): first-chunk latency over the successful requests, chunks per request
    first_mean_ms: float = math.nan
    first_p50_ms: float = math.nan
    first_p95_ms: float = math.nan
    chunks_per_request: float = math.nan
    chunk_check: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RunSummary:
        """From :meth:`to_json` or a written report (where NaN became null)."""
        return cls(**{k: math.nan if v is None else v for k, v in d.items()})


def summarize_run(run: RunResult, *, server: Mapping[str, float] | None = None) -> RunSummary:
    """Figures of ``run`` over its measured window; ``server``: peak_rss_mb, cpu_triton, cpu_server,
    peak_gpu_mb, peak_gpu_device_mb from the sampler."""
    ok = [r for r in run.records if r.ok]
    duration = run.duration_s
    lat = latency_summary([r.latency_s for r in ok])
    audio = sum(r.audio_s for r in ok)
    rtf = float(np.mean([r.latency_s / r.audio_s for r in ok if r.audio_s > 0])) if ok else math.nan
    errors: dict[str, int] = {}
    for r in run.records:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    stages = stats_delta(run.begin.statistics, run.end.statistics) if run.begin and run.end else {}
    good = duration > 0 and not math.isnan(duration)
    firsts = [r.first_chunk_s for r in ok if r.first_chunk_s is not None]
    first = latency_summary(firsts)
    chunks = chunk_check(run)
    return RunSummary(
        run.config.column, run.config.protocol, run.config.users, len(run.records), len(run.records) - len(ok),
        duration, lat["mean_ms"], lat["p50_ms"], lat["p95_ms"], lat["p99_ms"],
        len(ok) / duration if good else math.nan, audio / duration if good else math.nan, rtf,
        audio / len(ok) if ok else math.nan, **dict(server or {}), target_reached=run.target_reached,
        errors=errors, check=cross_check(run).to_json(), stages=stages, first_mean_ms=first["mean_ms"],
        first_p50_ms=first["p50_ms"], first_p95_ms=first["p95_ms"],
        chunks_per_request=float(np.mean([r.chunks for r in ok])) if ok else math.nan,
        chunk_check=chunks.to_json() if chunks else {})


# ------------------------------------------------------------------------------------------------ tables


def change(plain: float, integrated: float, *, points: bool = False) -> str:
    """The change column: relative change from plain to integrated (``+174%``), or the difference in
    percentage points of two fractions (``-30 pts``)."""
    if any(isinstance(x, float) and math.isnan(x) for x in (plain, integrated)):
        return "n/a"
    if points:
        return f"{(integrated - plain) * 100:+.0f} pts"
    if plain == 0:
        return "n/a"
    return f"{(integrated - plain) / abs(plain) * 100:+.0f}%"


def _num(v: Any) -> float:
    return math.nan if v is None else float(v)


def _fmt(v: float, digits: int = 0, unit: str = "") -> str:
    if isinstance(v, float) and math.isnan(v):
        return "n/a"
    return f"{v:,.{digits}f}{unit}"


#: (label, attribute, digits, unit, change in points)
ROWS = (
    ("end-to-end mean latency", "mean_ms", 0, " ms", False),
    ("p50 latency", "p50_ms", 0, " ms", False),
    ("p95 latency", "p95_ms", 0, " ms", False),
    ("p99 latency", "p99_ms", 0, " ms", False),
    ("throughput (audio s / s)", "audio_s_per_s", 2, "", False),
    ("throughput (requests / s)", "req_per_s", 2, "", False),
    ("real-time factor (latency / audio)", "rtf", 3, "", False),
    ("peak server memory (RSS, tritonserver + stubs)", "peak_rss_mb", 0, " MB", False),
    ("peak GPU memory (server processes, nvidia-smi)", "peak_gpu_mb", 0, " MB", False),
    ("peak GPU memory (whole device, nvidia-smi)", "peak_gpu_device_mb", 0, " MB", False),
    ("mean CPU utilisation (nv_cpu_utilization)", "cpu_triton", 0, "%", True),
    ("server processes' CPU (psutil, of all cores)", "cpu_server", 0, "%", True),
)


def comparison_table(plain: RunSummary | None, integrated: RunSummary | None) -> str:
    """The issue's table for one protocol: rows of metrics, columns plain / integrated / change."""
    cols = [s for s in (plain, integrated) if s is not None]
    if not cols:
        return ""
    lines = ["| metric | plain separate calls | integrated pipeline | change |", "|---|---|---|---|"]
    for label, attr, digits, unit, points in ROWS:
        vals = [getattr(s, attr) if s else math.nan for s in (plain, integrated)]
        if all(isinstance(v, float) and math.isnan(v) for v in vals):
            continue
        scale = 100.0 if points else 1.0
        cells = [_fmt(v * scale, digits, unit) for v in vals]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {change(vals[0], vals[1], points=points)} |")
    counts = [f"{s.requests} ({s.failures} failed)" if s else "n/a" for s in (plain, integrated)]
    lines.append(f"| measured requests (failed) | {counts[0]} | {counts[1]} | |")
    return "\n".join(lines)


def targets(plain: RunSummary | None, integrated: RunSummary | None) -> dict[str, Any]:
    """The issue's targets: integrated throughput >= 3x plain, mean latency >= 65% lower, no failed request."""
    if plain is None or integrated is None:
        return {}
    ratio = integrated.audio_s_per_s / plain.audio_s_per_s if plain.audio_s_per_s else math.nan
    reduction = 1.0 - integrated.mean_ms / plain.mean_ms if plain.mean_ms else math.nan
    failures = plain.failures + integrated.failures
    return {"throughput_ratio": ratio, "throughput_met": bool(ratio >= 3.0), "latency_reduction": reduction,
            "latency_met": bool(reduction >= 0.65), "failures": failures, "failures_met": failures == 0}


def _stage_table(stages: Mapping[str, Mapping[str, float]]) -> str:
    lines = ["| model | requests | executions | avg batch | queue ms | compute ms | request ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in sorted(stages.items()):
        lines.append(f"| {name} | {s['requests']:.0f} | {s['executions']:.0f} | {_fmt(s['avg_batch'], 2)} | "
                     f"{_fmt(s['queue_ms'], 1)} | {_fmt(s['compute_ms'], 1)} | {_fmt(s['request_ms'], 1)} |")
    return "\n".join(lines)


def slowest_stage(stages: Mapping[str, Mapping[str, float]], exclude: Sequence[str] = ()) -> tuple[str, float]:
    """The model with the most compute time in total (compute ms x requests), leaving out ``exclude`` (the
    ensemble and the BLS stages, whose time contains their callees'); with its share of the total."""
    totals = {m: s["compute_ms"] * s["requests"] for m, s in stages.items()
              if m not in exclude and not math.isnan(s["compute_ms"])}
    if not totals or sum(totals.values()) <= 0:
        return "", math.nan
    name = max(totals, key=totals.__getitem__)
    return name, totals[name] / sum(totals.values())


def finish_markdown(out: list[str], report: Mapping[str, Any]) -> str:
    """``out`` (markdown lines) with the report's plots and notes appended, as one text."""
    plots = report.get("plots", [])
    if plots:
        out = [*out, "## Plots", "", *[f"![{Path(p).stem}]({Path(p).name})" for p in plots], ""]
    notes = report.get("notes", [])
    if notes:
        out = [*out, "## Notes", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(out).rstrip() + "\n"


#: The TTS column's rows, in this order.
TTS_LABELS = {"tts_stream": "streaming TTS (cosyvoice_tts_stream)", "tts": "offline TTS (cosyvoice_tts)",
              "vc_stream": "streaming VC (cosyvoice_vc_stream)"}


def tts_table(runs: Sequence[RunSummary]) -> str:
    """The TTS column: per pipeline and concurrency, first-chunk latency (streams), end-to-end latency, RTF."""
    lines = ["| pipeline | concurrency | requests (failed) | first chunk mean / p50 / p95 ms | "
             "total mean / p50 / p95 ms | RTF | audio s / request | chunks / request | requests / s | "
             "CPU (whole machine) |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    order = list(TTS_LABELS)
    for s in sorted(runs, key=lambda s: (order.index(s.column) if s.column in order else 99, s.users)):
        first = ("-" if math.isnan(s.first_mean_ms) else
                 f"{_fmt(s.first_mean_ms)} / {_fmt(s.first_p50_ms)} / {_fmt(s.first_p95_ms)}")
        lines.append(f"| {TTS_LABELS.get(s.column, s.column)} | {s.users} | {s.requests} ({s.failures}) | {first} | "
                     f"{_fmt(s.mean_ms)} / {_fmt(s.p50_ms)} / {_fmt(s.p95_ms)} | {_fmt(s.rtf, 2)} | "
                     f"{_fmt(s.mean_audio_s, 2)} | {_fmt(s.chunks_per_request, 1)} | {_fmt(s.req_per_s, 3)} | "
                     f"{_fmt(s.cpu_triton * 100, 0, '%')} |")
    return "\n".join(lines)


def _perf_stream_table(perf: Sequence[Mapping[str, Any]], runs: Sequence[RunSummary]) -> list[str]:
    out = ["| model | concurrency | perf_analyzer first response mean / p50 / p95 ms | Locust first chunk mean / p50 / "
           "p95 ms | perf_analyzer total mean / p95 ms | Locust total mean / p95 ms | perf_analyzer req/s | Locust "
           "req/s | note |", "|---|---:|---|---|---|---|---:|---:|---|"]
    for p in perf:
        col = {"cosyvoice_tts_stream": "tts_stream", "cosyvoice_vc_stream": "vc_stream",
               "cosyvoice_tts": "tts"}.get(p.get("model", ""), "")
        loc = next((s for s in runs if s.column == col and s.users == p["concurrency"]), None)

        def g(key, p=p):
            return _num(p.get(key))

        pf = f"{_fmt(g('first_mean_ms'))} / {_fmt(g('first_p50_ms'))} / {_fmt(g('first_p95_ms'))}"
        lf = (f"{_fmt(loc.first_mean_ms)} / {_fmt(loc.first_p50_ms)} / {_fmt(loc.first_p95_ms)}" if loc else "n/a")
        out.append(f"| {p.get('model', '')} | {p['concurrency']} | {pf} | {lf} | {_fmt(g('mean_ms'))} / "
                   f"{_fmt(g('p95_ms'))} | {f'{_fmt(loc.mean_ms)} / {_fmt(loc.p95_ms)}' if loc else 'n/a'} | "
                   f"{_fmt(g('throughput'), 3)} | {_fmt(loc.req_per_s, 3) if loc else 'n/a'} | {p.get('note', '')} |")
    return out


def render_tts_markdown(report: Mapping[str, Any]) -> str:
    """The TTS column's report (``--mode tts``)."""
    out = [f"# Load test: the TTS column, streaming TTS / offline TTS / streaming VC ({report.get('config_name', '')})",
           ""]
    setup = report.get("setup", {})
    if setup:
        out += ["## Set-up", ""] + [f"- {k}: {v}" for k, v in setup.items()] + [""]
    runs = [RunSummary.from_json(r) for r in report.get("runs", [])]
    if runs:
        out += ["## Streaming and offline latency (gRPC)", "", tts_table(runs), "",
                "First chunk: from sending the request to the first audio chunk in the client. Total: to the last "
                "response. RTF: mean over requests of total latency / seconds of audio received.", ""]
        out += ["## Cross-check: Locust against Triton's counters", "",
                "| run | Locust ok | model | Triton delta | | chunks received | chunk model | Triton delta | |",
                "|---|---:|---|---:|---|---:|---|---:|---|"]
        for s in runs:
            c, k = s.check, s.chunk_check
            chunk_cells = (f"{k['chunks_received']} | {k['model']} | {_fmt(_num(k['triton_delta']))} | "
                           f"{'ok' if k['passed'] else 'MISMATCH'}") if k else "- | - | - | -"
            out.append(f"| {s.column} x{s.users} | {c.get('locust_ok', 'n/a')} | {c.get('model', '')} | "
                       f"{_fmt(_num(c.get('triton_delta')))} | {'ok' if c.get('passed') else 'MISMATCH'} | "
                       f"{chunk_cells} |")
        out.append("")
    perf = report.get("perf_analyzer", [])
    if perf:
        out += ["## perf_analyzer (gRPC, --streaming for the decoupled models) next to Locust", ""]
        out += [*_perf_stream_table(perf, runs), ""]
    top = max((s for s in runs if s.column == "tts_stream" and s.stages), key=lambda s: s.users, default=None)
    if top is not None:
        out += [f"## Per-model statistics: streaming TTS at concurrency {top.users} (delta over the window)", "",
                _stage_table(top.stages), ""]
    return finish_markdown(out, report)


def render_markdown(report: Mapping[str, Any]) -> str:
    """The markdown report from the JSON report (see :func:`cosyvoice_triton.loadtest.runner.run`)."""
    if report.get("mode") == "tts":
        return render_tts_markdown(report)
    if report.get("mode") == "mixed":
        raise ValueError("a mixed-mode report is rendered by cosyvoice_triton.loadtest.mixed.mixed_markdown")
    out = [f"# Load test: plain separate calls vs integrated pipeline ({report.get('config_name', '')})", ""]
    setup = report.get("setup", {})
    if setup:
        out += ["## Set-up", ""] + [f"- {k}: {v}" for k, v in setup.items()] + [""]
    runs = [RunSummary.from_json(r) for r in report.get("runs", [])]
    users = report.get("users")
    for protocol in report.get("protocols", []):
        by = {s.column: s for s in runs if s.protocol == protocol and s.users == users}
        if not by:
            continue
        out += [f"## {protocol.upper()}, {users} concurrent users", "",
                comparison_table(by.get("plain"), by.get("integrated")), ""]
        t = targets(by.get("plain"), by.get("integrated"))
        if t:
            out.append(f"Targets (integrated vs plain): throughput x{t['throughput_ratio']:.2f} (target >= 3: "
                       f"{'met' if t['throughput_met'] else 'missed'}), mean latency "
                       f"{-t['latency_reduction'] * 100:+.0f}% (target <= -65%: "
                       f"{'met' if t['latency_met'] else 'missed'}), failed requests {t['failures']} "
                       f"({'met' if t['failures_met'] else 'missed'}).")
            out.append("")
    checks = [(s, s.check) for s in runs if s.check]
    if checks:
        out += ["## Cross-check: Locust against Triton's nv_inference_request_success", "",
                "| run | Locust ok | model | calls / conversion | expected | Triton delta | difference | |",
                "|---|---:|---|---:|---:|---:|---:|---|"]
        for s, c in checks:
            out.append(f"| {s.column} {s.protocol} x{s.users} | {c['locust_ok']} | {c['model']} | "
                       f"{c['calls_per_request']} | {c['expected']} | {_fmt(_num(c['triton_delta']))} | "
                       f"{_fmt(_num(c['difference']) * 100, 2)}% | {'ok' if c['passed'] else 'MISMATCH'} |")
        out.append("")
    for s in runs:
        if s.users != users or not s.stages:
            continue
        out += [f"## Per-model statistics: {s.column}, {s.protocol} (delta over the measured window)", "",
                _stage_table(s.stages), ""]
        name, share = slowest_stage(s.stages, exclude=report.get("composite_models", ()))
        if name:
            out += [f"Most compute time: `{name}` ({share * 100:.0f}% of the compute time of the leaf models).", ""]
    sweep = [RunSummary.from_json(r) for r in report.get("sweep", [])]
    if sweep:
        out += ["## Concurrency sweep", "", "| column | protocol | users | requests | req/s | audio s/s | mean ms | "
                "p95 ms | failed |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for s in sorted(sweep, key=lambda s: (s.column, s.protocol, s.users)):
            out.append(f"| {s.column} | {s.protocol} | {s.users} | {s.requests} | {_fmt(s.req_per_s, 2)} | "
                       f"{_fmt(s.audio_s_per_s, 2)} | {_fmt(s.mean_ms)} | {_fmt(s.p95_ms)} | {s.failures} |")
        out.append("")
    perf = report.get("perf_analyzer", [])
    if perf:
        out += ["## perf_analyzer on the ensemble, next to Locust", "",
                "| protocol | concurrency | perf_analyzer req/s | Locust req/s | perf_analyzer mean ms | "
                "Locust mean ms | perf_analyzer p95 ms | Locust p95 ms | note |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for p in perf:
            loc = next((s for s in runs if s.column == "integrated" and s.protocol == p["protocol"]
                        and s.users == p["concurrency"]), None)
            out.append(f"| {p['protocol']} | {p['concurrency']} | {_fmt(p.get('throughput', math.nan), 2)} | "
                       f"{_fmt(loc.req_per_s, 2) if loc else 'n/a'} | {_fmt(p.get('mean_ms', math.nan))} | "
                       f"{_fmt(loc.mean_ms) if loc else 'n/a'} | {_fmt(p.get('p95_ms', math.nan))} | "
                       f"{_fmt(loc.p95_ms) if loc else 'n/a'} | {p.get('note', '')} |")
        out.append("")
    if report.get("profile"):
        from .profile import profile_markdown

        out += profile_markdown(report["profile"])
    return finish_markdown(out, report)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return _jsonable(x.item())
    if isinstance(x, Path):
        return str(x)
    return x


def write_report(report: Mapping[str, Any], out_dir: str | Path, *, markdown: str | None = None) -> tuple[Path, Path]:
    """``report.md`` (``markdown``, else :func:`render_markdown`) and ``report.json`` in ``out_dir`` (NaN written as
    null)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    md.write_text(render_markdown(report) if markdown is None else markdown)
    js = out / "report.json"
    js.write_text(json.dumps(_jsonable(report), indent=2) + "\n")
    return md, js
