"""Sample the server over time: RSS and CPU time of ``tritonserver`` and its Python stub processes (psutil),
Triton's ``nv_cpu_utilization`` gauge, and, where ``nvidia-smi`` exists, GPU memory.

A :class:`ServerSampler` runs in a thread of the runner; figures are taken afterwards over any time window
(the measured part of a Locust run, without its ramp-up), from the recorded series.
"""

from __future__ import annotations

import logging
import math
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

import psutil

from .metrics import counter_total, scrape

log = logging.getLogger(__name__)

__all__ = ["ProcessTreeSample", "ServerSampler", "gpu_memory_mb", "process_tree"]


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants that are alive now."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@dataclass(frozen=True)
class ProcessTreeSample:
    time: float
    rss_bytes: int  # sum over the tree (shared pages count once per process, as RSS does)
    cpu_seconds: float  # user + system of the processes alive now, since they started
    processes: int
    pids: tuple[int, ...] = ()


def sample_tree(pid: int) -> ProcessTreeSample:
    rss, cpu, pids = 0, 0.0, []
    for p in process_tree(pid):
        try:
            with p.oneshot():
                rss += p.memory_info().rss
                t = p.cpu_times()
                cpu += t.user + t.system
                pids.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return ProcessTreeSample(time.time(), rss, cpu, len(pids), tuple(pids))


def gpu_memory_mb(pids: set[int] | None = None) -> tuple[float, float] | None:
    """(MiB used by ``pids`` on all GPUs, MiB used on all GPUs) from ``nvidia-smi``; None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        apps = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10, check=True).stdout
        total = subprocess.run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed: %s", exc)
        return None
    mine, seen = 0.0, False
    for line in apps.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and (pids is None or int(parts[0]) in pids):
            try:
                mine += float(parts[1])
                seen = True
            except ValueError:
                continue
    used = sum(float(x) for x in total.split() if x.replace(".", "", 1).isdigit())
    # in some containers nvidia-smi lists no process (pid namespaces): then only the device figure is known
    return (mine if seen else math.nan), used


@dataclass
class ServerSampler:
    """Record, every ``interval`` s until :meth:`stop`: the process tree of ``pid``; every ``metrics_every`` s
    Triton's ``nv_cpu_utilization`` from ``metrics_url``; with ``gpu``, GPU memory from ``nvidia-smi``."""

    pid: int
    metrics_url: str | None = None
    interval: float = 0.25
    metrics_every: float = 1.0
    gpu: bool = False
    tree: list[ProcessTreeSample] = field(default_factory=list)
    cpu_util: list[tuple[float, float]] = field(default_factory=list)  # (time, fraction of all cores)
    gpu_mb: list[tuple[float, float, float]] = field(default_factory=list)  # (time, server MiB, device MiB)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ServerSampler:
        self._thread = threading.Thread(target=self._loop, name="server-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> ServerSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        next_metrics = 0.0
        while not self._stop.is_set():
            s = sample_tree(self.pid)
            if s.processes:
                self.tree.append(s)
            now = time.monotonic()
            if self.metrics_url and now >= next_metrics:
                next_metrics = now + self.metrics_every
                try:
                    samples = scrape(self.metrics_url, timeout=2.0)
                    if any(x.name == "nv_cpu_utilization" for x in samples):
                        self.cpu_util.append((time.time(), counter_total(samples, "nv_cpu_utilization")))
                except Exception as exc:  # the server may be busy or stopping: note it, keep sampling
                    if len(self.errors) < 20:
                        self.errors.append(f"metrics: {exc}")
                if self.gpu:
                    g = gpu_memory_mb(set(s.pids))
                    if g is not None:
                        self.gpu_mb.append((time.time(), *g))
            self._stop.wait(self.interval)

    # ------------------------------------------------------------------------------------------ figures

    def peak_rss_mb(self, t0: float = -math.inf, t1: float = math.inf) -> float:
        vals = [s.rss_bytes for s in self.tree if t0 <= s.time <= t1]
        return max(vals) / 2**20 if vals else math.nan

    def process_cpu(self, t0: float, t1: float) -> float:
        """Mean CPU use of the server's processes over [t0, t1], as a fraction of all cores (psutil)."""
        inside = [s for s in self.tree if t0 <= s.time <= t1]
        if len(inside) < 2 or inside[-1].time <= inside[0].time:
            return math.nan
        first, last = inside[0], inside[-1]
        busy = max(0.0, last.cpu_seconds - first.cpu_seconds)
        return busy / (last.time - first.time) / (psutil.cpu_count() or 1)

    def mean_cpu_utilization(self, t0: float, t1: float) -> float:
        """Mean of Triton's ``nv_cpu_utilization`` (whole machine, 0..1) sampled inside [t0, t1]."""
        vals = [v for t, v in self.cpu_util if t0 <= t <= t1]
        return sum(vals) / len(vals) if vals else math.nan

    def peak_gpu_mb(self, t0: float = -math.inf, t1: float = math.inf) -> tuple[float, float]:
        """(peak MiB of the server's processes, peak MiB of the devices) inside [t0, t1]; NaN without GPU."""
        vals = [(a, b) for t, a, b in self.gpu_mb if t0 <= t <= t1]
        if not vals:
            return math.nan, math.nan
        mine = [a for a, _ in vals if not math.isnan(a)]
        return (max(mine) if mine else math.nan), max(b for _, b in vals)
