"""Soak test (``make soak``; not in CI): a supervised server under steady load for a long time, judged on failures
and memory growth.

``users`` threads (default 20: twice the load tests' 10 Locust users) convert back to back through
``cosyvoice_vc``, half over HTTP and half over gRPC, with the clients' default retry policy; sources of 2-5 s cut
from the bundled speech at seeded random offsets, one 3 s prompt. The server's process tree (``tritonserver`` and
its Python stubs) is sampled every few seconds. Verdict:

* failures: requests that failed after the client's retries: must be 0 (retries are reported next to them);
* memory growth: the peak RSS of the last window of the run against the peak of the window after a warm-in
  (until every user has had two requests answered on average, and at least the first 10% of the run or 30 s: the
  allocators' arenas grow to the largest padded batch seen, and that takes some requests); a window is 10% of the
  run and at least 1.5 p99 latencies long. Peaks, not means: the users fall into step, so RSS rises and falls with
  each wave of requests, and a mean over a window measures the phase of a wave (a 5 min run here read -25%); the
  peak of a window that holds a whole wave does not. Must be under ``max_growth`` (5%); a run too short to leave
  both windows apart has no growth figure and fails;
* the supervisor must have had nothing to do (no stub died, no server restart).

Writes ``<out>/report.json``, ``<out>/report.md`` and ``<out>/soak.png`` (RSS and latency over time); exits 1
when the verdict fails.

    python -m cosyvoice_triton.loadtest.soak --minutes 30 --users 20 --out build/soak
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .. import resources

log = logging.getLogger(__name__)

__all__ = ["SoakResult", "main", "memory_growth", "run_soak"]

SOURCE = resources.path("tests/fixtures/source_en_5s.wav")
PROMPT = resources.path("tests/fixtures/prompt_en_3s.wav")


@dataclass
class SoakResult:
    minutes: float
    users: int
    requests: int = 0
    failures: int = 0
    retries: int = 0
    failure_kinds: dict[str, int] = field(default_factory=dict)
    latency_p50_s: float = math.nan
    latency_p99_s: float = math.nan
    latency_max_s: float = math.nan
    throughput_rps: float = math.nan
    audio_seconds: float = 0.0
    rss_baseline_mb: float = math.nan
    rss_end_mb: float = math.nan
    rss_peak_mb: float = math.nan
    memory_growth: float = math.nan
    queue_s_per_request: float = math.nan  # seconds queued in the stages per cosyvoice_vc request (Triton metrics)
    compute_s_per_request: float = math.nan
    supervisor_events: list[str] = field(default_factory=list)
    max_growth: float = 0.05
    warm_in_s: float = math.nan  # when 2 x users requests had been answered (the baseline starts after it)

    @property
    def passed(self) -> bool:
        return (self.requests > 0 and self.failures == 0 and self.memory_growth < self.max_growth
                and not self.supervisor_events)


def memory_growth(samples: list[tuple[float, float]], t0: float, t1: float, warm_in: float = 0.1,
                  warm_until: float = -math.inf, min_window: float = 0.0) -> tuple[float, float, float]:
    """``(baseline, end, growth)`` of ``(time, rss)`` samples of a run from ``t0`` to ``t1``: with the warm-in
    ``w = max(30 s, warm_in x duration, warm_until - t0)`` and the window ``v = max(10% of the run, min_window)``,
    the baseline is the peak over ``[t0 + w, t0 + w + v]``, the end the peak of the last ``v``; growth = end /
    baseline - 1 (NaN when the windows overlap or are empty)."""
    span = t1 - t0
    w = max(30.0, warm_in * span, warm_until - t0)
    v = max(0.1 * span, min_window)
    base = [r for t, r in samples if t0 + w <= t <= t0 + w + v]
    end = [r for t, r in samples if t1 - v <= t <= t1]  # not the stragglers answered after the end
    if not base or not end or t0 + w + v > t1 - v:
        return math.nan, math.nan, math.nan
    b, e = float(np.max(base)), float(np.max(end))
    return b, e, e / b - 1.0


def _speech():
    import soundfile as sf

    src, ssr = sf.read(SOURCE, dtype="float32")
    prm, psr = sf.read(PROMPT, dtype="float32")
    return src, ssr, prm, psr


def _queue_compute(metrics_url: str, before: list, model: str = "cosyvoice_vc") -> tuple[float, float]:
    from .metrics import counter_total, scrape

    after = scrape(metrics_url, timeout=10)

    def delta(name: str, **labels) -> float:
        return counter_total(after, name, **labels) - counter_total(before, name, **labels)

    n = delta("nv_inference_request_success", model=model)
    if n <= 0:
        return math.nan, math.nan
    return delta("nv_inference_queue_duration_us") / 1e6 / n, delta("nv_inference_compute_infer_duration_us") / 1e6 / n


def run_soak(server, *, minutes: float, users: int, seed: int = 0, sample_every: float = 5.0,
             max_growth: float = 0.05, progress_every: float = 60.0) -> tuple[SoakResult, dict]:
    """Load the running ``server`` (a started :class:`~cosyvoice_triton.serving.launch.server.TritonServer`) for
    ``minutes``; returns the result and the series for the plot."""
    from ..clients.client import CosyVoiceClient, VCError
    from .metrics import scrape
    from .sampler import ServerSampler

    src, ssr, prm, psr = _speech()
    result = SoakResult(minutes=minutes, users=users, max_growth=max_growth)
    outcomes: list[tuple[float, float, float, str]] = []  # (end time, latency, audio s, "ok" | error)
    lock = threading.Lock()
    stop = threading.Event()
    retries = [0]

    def user(k: int) -> None:
        rng = np.random.default_rng(seed + k)
        protocol = "http" if k % 2 == 0 else "grpc"
        url = server.http_url if protocol == "http" else server.grpc_url
        with CosyVoiceClient(url, protocol=protocol, timeout=300) as client:
            while not stop.is_set():
                n = int(rng.uniform(2.0, 5.0) * ssr)
                start = int(rng.integers(0, max(1, len(src) - n)))
                t0 = time.monotonic()
                try:
                    res = client.convert(src[start:start + n], prm, source_sr=ssr, prompt_sr=psr,
                                         seed=int(rng.integers(0, 2**31)))
                    what, audio = "ok", res.seconds
                except VCError as exc:
                    what, audio = f"{exc.status}: {exc.message[:160]}", 0.0
                with lock:
                    outcomes.append((time.time(), time.monotonic() - t0, audio, what))
            with lock:
                retries[0] += client.retries

    before = scrape(server.metrics_url, timeout=10)
    sampler = ServerSampler(server.process.pid, interval=sample_every)
    threads = [threading.Thread(target=user, args=(k,), daemon=True, name=f"soak-user-{k}") for k in range(users)]
    t_start = time.time()
    with sampler:
        for t in threads:
            t.start()
        end = time.monotonic() + minutes * 60
        next_note = time.monotonic() + progress_every
        while time.monotonic() < end:
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
            if time.monotonic() >= next_note:
                next_note += progress_every
                with lock:
                    done, bad = len(outcomes), sum(o[3] != "ok" for o in outcomes)
                rss = sampler.tree[-1].rss_bytes / 2**20 if sampler.tree else math.nan
                print(f"soak: {(time.time() - t_start) / 60:5.1f} / {minutes:g} min, {done} requests, {bad} failed, "
                      f"server RSS {rss:,.0f} MB", flush=True)
        t_end = time.time()
        stop.set()
        for t in threads:
            t.join(timeout=600)
    result.retries = retries[0]
    measured = [o for o in outcomes if o[0] <= t_end]
    result.requests = len(measured)
    bad = [o[3] for o in measured if o[3] != "ok"]
    result.failures = len(bad)
    for b in bad:
        result.failure_kinds[b] = result.failure_kinds.get(b, 0) + 1
    lat = [o[1] for o in measured if o[3] == "ok"]
    if lat:
        result.latency_p50_s = float(np.percentile(lat, 50))
        result.latency_p99_s = float(np.percentile(lat, 99))
        result.latency_max_s = float(max(lat))
    result.throughput_rps = len(lat) / max(1e-9, t_end - t_start)
    result.audio_seconds = float(sum(o[2] for o in measured))
    rss = [(s.time, s.rss_bytes / 2**20) for s in sampler.tree]
    ends = sorted(o[0] for o in measured)
    warm_until = ends[2 * users - 1] if len(ends) >= 2 * users else math.inf
    result.rss_baseline_mb, result.rss_end_mb, result.memory_growth = memory_growth(
        rss, t_start, t_end, warm_until=warm_until, min_window=1.5 * result.latency_p99_s if lat else 0.0)
    result.warm_in_s = warm_until - t_start
    result.rss_peak_mb = max((r for _, r in rss), default=math.nan)
    try:
        result.queue_s_per_request, result.compute_s_per_request = _queue_compute(server.metrics_url, before)
    except Exception as exc:  # the figures are extra; the verdict does not need them
        log.warning("could not read Triton's queue / compute counters: %s", exc)
    series = {"rss": rss, "latency": [(o[0], o[1], o[3] == "ok") for o in measured], "t0": t_start}
    return result, series


def plot(series: dict, result: SoakResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = series["t0"]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    if series["rss"]:
        a.plot([(t - t0) / 60 for t, _ in series["rss"]], [r for _, r in series["rss"]], lw=1)
    a.axhline(result.rss_baseline_mb, color="gray", ls="--", lw=0.8, label="peak after the warm-in")
    a.axvline(result.minutes, color="gray", ls=":", lw=0.8, label="end of the load")
    a.set_ylabel("server RSS (MB)")
    a.set_title(f"soak: {result.users} users, {result.minutes:g} min, {result.requests} requests, "
                f"{result.failures} failed, memory {result.memory_growth:+.1%}")
    a.legend(loc="lower right")
    ok = [(t, v) for t, v, good in series["latency"] if good]
    failed = [(t, v) for t, v, good in series["latency"] if not good]
    b.plot([(t - t0) / 60 for t, _ in ok], [v for _, v in ok], ".", ms=2, label="served")
    if failed:
        b.plot([(t - t0) / 60 for t, _ in failed], [v for _, v in failed], "rx", ms=5, label="failed")
    b.set_xlabel("minutes")
    b.set_ylabel("latency (s)")
    b.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_md(result: SoakResult, command: str) -> str:
    verdict = "PASSED" if result.passed else "FAILED"
    rows = [("requests", f"{result.requests:,}"), ("failed (after the client's retries)", str(result.failures)),
            ("retries", str(result.retries)), ("throughput", f"{result.throughput_rps:.2f} req/s"),
            ("audio converted", f"{result.audio_seconds:,.0f} s"),
            ("latency p50 / p99 / max", f"{result.latency_p50_s:.2f} / {result.latency_p99_s:.2f} / "
                                        f"{result.latency_max_s:.2f} s"),
            ("server RSS: peak after the warm-in / peak at the end / peak of the run",
             f"{result.rss_baseline_mb:,.0f} / {result.rss_end_mb:,.0f} / {result.rss_peak_mb:,.0f} MB"),
            (f"memory growth (bar < {result.max_growth:.0%})",
             f"{result.memory_growth:+.2%}" if not math.isnan(result.memory_growth) else
             "no figure: the run is too short for a warm-in and two separate windows of 1.5 x p99 latency"),
            ("warm-in (2 requests per user answered)", f"{result.warm_in_s:.0f} s"),
            ("queue / compute s per cosyvoice_vc request (all stages)",
             f"{result.queue_s_per_request:.2f} / {result.compute_s_per_request:.2f}"),
            ("supervisor events", ", ".join(result.supervisor_events) or "none")]
    lines = [f"# Soak: {verdict}", "", f"`{command}`: {result.users} users for {result.minutes:g} min.", "",
             "| figure | value |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in rows], ""]
    if result.failure_kinds:
        lines += ["Failures:", "", *[f"- {n} x {k}" for k, n in result.failure_kinds.items()], ""]
    lines += ["![soak](soak.png)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..serving.launch.serve import DEFAULT_MODEL_DIR, prepare
    from ..serving.launch.server import TritonServer
    from ..serving.launch.supervisor import Supervisor
    from ..serving.repository import SET_HELP, TunableAction

    p = argparse.ArgumentParser(prog="python -m cosyvoice_triton.loadtest.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--onnx-dir", default="build/onnx")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--users", type=int, default=20, help="concurrent users (default: twice the load tests' 10)")
    p.add_argument("--max-growth", type=float, default=0.05)
    p.add_argument("--out", default="build/soak")
    p.add_argument("--set", dest="tunables", action=TunableAction, default=[], help=SET_HELP)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tunables = dict(args.tunables)
    tunables.setdefault("tts", "off")  # the soak loads voice conversion; TTS models would only take memory
    repo = prepare(args.model_dir, onnx_dir=args.onnx_dir, repository=out / "model_repository", **tunables)
    server = TritonServer(repo, work_dir=out / "triton", model_control="explicit", load_models=["*"], exit_timeout=60)
    sup = Supervisor(server, start_timeout=900)
    command = "python -m cosyvoice_triton.loadtest.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    with sup:
        print(f"soak: serving on http {server.http_url}, grpc {server.grpc_url}; {args.users} users for "
              f"{args.minutes:g} min", flush=True)
        result, series = run_soak(server, minutes=args.minutes, users=args.users, max_growth=args.max_growth)
        result.supervisor_events = [f"{e.kind}: {e.detail.splitlines()[0][:100]}" for e in sup.events
                                    if e.kind not in ("warmed-up",)]
    (out / "report.json").write_text(json.dumps({**asdict(result), "passed": result.passed,
                                                 "command": command}, indent=2) + "\n")
    (out / "series.json").write_text(json.dumps(series) + "\n")  # to recompute or re-plot the figures
    plot(series, result, out / "soak.png")
    text = report_md(result, command)
    (out / "report.md").write_text(text)
    print(text)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
