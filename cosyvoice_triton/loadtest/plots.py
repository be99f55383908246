"""The report's plots (matplotlib, Agg backend, PNG): latency CDF per column, and throughput and p95 latency
against the number of concurrent users."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from .report import RunSummary

__all__ = ["plot_first_chunk", "plot_latency_cdf", "plot_memory", "plot_sweep"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdf(latencies: Mapping[str, Sequence[float]], path: str | Path, *, title: str = "") -> Path:
    """One CDF line per label (e.g. ``"integrated grpc"``), latencies in seconds."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in sorted(latencies.items()):
        x = np.sort(np.asarray(values, np.float64)) * 1000.0
        if x.size:
            ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=f"{label} (n={x.size})")
    ax.set_xlabel("end-to-end latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or "Latency CDF")
    return _save(plt, fig, path)


def _save(plt, fig, path: str | Path) -> Path:
    """Lay out ``fig``, write it as a PNG at ``path`` (folders made) and close it."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(summaries: Sequence[RunSummary], path: str | Path, *, title: str = "") -> Path:
    """Throughput (audio s/s) and p95 latency against concurrent users, one line per column and protocol."""
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[str, list[RunSummary]] = {}
    for s in summaries:
        groups.setdefault(f"{s.column} {s.protocol}", []).append(s)
    for label, runs in sorted(groups.items()):
        runs = sorted(runs, key=lambda s: s.users)
        users = [s.users for s in runs]
        a1.plot(users, [s.audio_s_per_s for s in runs], marker="o", label=label)
        a2.plot(users, [s.p95_ms for s in runs], marker="o", label=label)
    ticks = sorted({s.users for s in summaries})
    for ax, ylabel in ((a1, "throughput (audio seconds / second)"), (a2, "p95 latency (ms)")):
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(ylabel)
        ax.set_xticks(ticks)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title or "Throughput and p95 latency against concurrency")
    return _save(plt, fig, path)


def plot_first_chunk(summaries: Sequence[RunSummary], path: str | Path, *, perf: Sequence[Mapping] = (),
                     title: str = "") -> Path:
    """The TTS column: first-chunk latency (p50 and p95, with the mean dotted) against concurrency per streaming
    pipeline, perf_analyzer's first-response p50 as crosses; right: total latency and RTF of every pipeline."""
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[str, list[RunSummary]] = {}
    for s in summaries:
        groups.setdefault(s.column, []).append(s)
    for i, (column, runs) in enumerate(sorted(groups.items())):
        runs = sorted(runs, key=lambda s: s.users)
        users = [s.users for s in runs]
        color = f"C{i}"
        if any(not np.isnan(s.first_p50_ms) for s in runs):
            a1.plot(users, [s.first_p50_ms for s in runs], marker="o", color=color, label=f"{column} p50")
            a1.plot(users, [s.first_p95_ms for s in runs], marker="^", ls="--", color=color, label=f"{column} p95")
            pa = sorted((p["concurrency"], p["first_p50_ms"]) for p in perf
                        if p.get("first_p50_ms") is not None and p.get("model", "").endswith(column))
            if pa:
                a1.plot(*zip(*pa, strict=True), marker="x", ls="", ms=9, color=color,
                        label=f"{column} p50 (perf_analyzer)")
        a2.plot(users, [s.p50_ms for s in runs], marker="o", color=color, label=f"{column} total p50")
    ticks = sorted({s.users for s in summaries})
    for ax, ylabel in ((a1, "first-chunk latency (ms)"), (a2, "total latency p50 (ms)")):
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_xticks(ticks)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "First-chunk latency against concurrency")
    return _save(plt, fig, path)


def plot_memory(series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path, *, title: str = "",
                windows: Sequence[tuple[float, float]] = ()) -> Path:
    """Resident memory over a run, one panel per process (``series``: name -> (seconds, MB) points); ``windows``:
    the spans the start and end figures are taken over, shaded."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, max(1, len(series)), figsize=(5.5 * max(1, len(series)), 4), squeeze=False)
    for ax, (name, points) in zip(axes[0], sorted(series.items()), strict=False):
        if points:
            t, mb = zip(*points, strict=True)
            ax.plot(t, mb, lw=1)
        for a, b in windows:
            ax.axvspan(a, b, alpha=0.12, color="gray")
        ax.set_title(name)
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel("resident set (MB)")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or "Memory over the run")
    return _save(plt, fig, path)
