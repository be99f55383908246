"""The rollout scenario under load: ``python -m cosyvoice_triton.loadtest.rollout`` (``make rollout-demo``).

Renders a repository with two versions (v1 live; v2: the candidate, by default the same checkpoint re-served from
``--candidate-onnx-dir`` / ``--candidate-precision``), starts ``tritonserver`` with explicit model control, runs
Locust the way the load test does (a ``locust --headless`` subprocess, :func:`.setup.locust_command`;
``loadtest/rollout_locustfile.py``: users converting through the public ``cosyvoice_vc``, no client retries) and,
while it runs, goes through the steps of :data:`PHASES`: v1 alone, ``stage 2``, ``canary 10``, ``canary 50``,
``canary 100``, ``rollback``, then (unless ``--no-promote``) ``stage 2`` again and ``promote``.

Each phase has two windows: the step itself (from its start until the rollout call returns: loads, parity, drain)
and the steady window after it, which lasts until ``--phase-requests`` requests completed. Per window, from the
requests Locust recorded (by end time): requests, failures, latency p50 / p95; per steady window, the requests
each version's pipeline served (Triton's success counts of ``cosyvoice_vc_v1`` / ``cosyvoice_vc_v2``, read at
the window's start and end: the router sends each request, untouched, to one of them). Written to ``--out``:
``report.json``, ``report.md`` and ``rollout.png`` (requests per version per phase; every request's latency over
time with the steps shaded and failures marked). Exit status 1 when any request failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .. import resources
from ..serving.launch.rollout import Rollout, VersionSpec, startup_models

log = logging.getLogger(__name__)

LOCUSTFILE = resources.path("loadtest/rollout_locustfile.py")
#: (phase name, rollout step: method and arguments, or None)
PHASES: tuple[tuple[str, tuple | None], ...] = (
    ("v1 alone", None), ("stage v2", ("stage", 2)), ("canary 10%", ("canary", 10)), ("canary 50%", ("canary", 50)),
    ("canary 100%", ("canary", 100)), ("rollback", ("rollback",)))
PROMOTE_PHASES: tuple[tuple[str, tuple | None], ...] = (("stage v2 again", ("stage", 2)), ("promote", ("promote",)))


def _counts(ro: Rollout) -> dict[int, int]:
    """Successful requests of each version's pipeline (0 when it is not loaded)."""
    out = {}
    for v in (1, 2):
        try:
            out[v] = ro.counts(v)[0]
        except Exception:  # not loaded
            out[v] = 0
    return out


def window(records: Sequence[Sequence], start: float, end: float) -> dict:
    """Requests that ended within ``[start, end)`` (records: ``(end unix time, latency s, error)``): count,
    failures, latency p50 / p95 (seconds, None when there are none)."""
    inside = [r for r in records if start <= r[0] < end]
    lat = np.array([r[1] for r in inside], float)
    return {"requests": len(inside), "failures": sum(1 for r in inside if r[2]),
            "p50_s": float(np.percentile(lat, 50)) if lat.size else None,
            "p95_s": float(np.percentile(lat, 95)) if lat.size else None}


def summarize(phases: list[dict], records: Sequence[Sequence]) -> None:
    """Fill each phase's ``step`` and ``steady`` windows from the records (in place)."""
    for p in phases:
        p["step"] = window(records, p["start"], p["step_end"])
        p["steady"] = window(records, p["step_end"], p["end"])


def run(args: argparse.Namespace) -> dict:
    from ..serving.launch.serve import prepare
    from ..serving.launch.server import TritonServer
    from .setup import FIXTURES, locust_command, locust_env
    from .workload import cached_workload

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    repo = out / "model_repository"
    versions = [VersionSpec(1, Path(args.model_dir), Path(args.onnx_dir)),
                VersionSpec(2, Path(args.model_dir), Path(args.candidate_onnx_dir or args.onnx_dir),
                            args.candidate_precision)]
    prepare(args.model_dir, onnx_dir=args.onnx_dir, repository=repo, versions=versions, max_queue_delay_us=20000)
    workload_path = out / "workload.npz"
    workload = cached_workload(workload_path, fixtures=FIXTURES, n_sources=8, min_seconds=2.0,
                               max_seconds=4.0)
    print(f"== workload: {workload.describe()}", flush=True)
    steps = PHASES + (() if args.no_promote else PROMOTE_PHASES)
    phases: list[dict] = []
    load_before = os.getloadavg()
    started = time.time()
    with TritonServer(repo, model_control="explicit", load_models=startup_models(repo), exit_timeout=30) as server:
        from ..clients.client import CosyVoiceClient

        # warm-up, one at a time (see the README: first requests at once into a fresh server crashed it twice
        # here, Signal 11)
        with CosyVoiceClient(server.http_url) as client:
            for i in range(2):
                item = workload.item(i)
                client.convert(item.source, item.prompt, source_sr=item.source_sr, prompt_sr=item.prompt_sr)
        config = out / "locust_config.json"
        records_path = out / "locust_records.json"
        records_path.unlink(missing_ok=True)
        config.write_text(json.dumps({"url": server.http_url, "workload": str(workload_path), "timeout_s": 600,
                                      "out": str(records_path)}))
        cmd = locust_command(config, args.users, out / "locust", max_run_s=7200, locustfile=LOCUSTFILE)
        with open(out / "locust.log", "wb") as locust_log:
            locust = subprocess.Popen(cmd, env=locust_env(ROLLOUT_LOADTEST=str(config)), stdout=locust_log,
                                      stderr=subprocess.STDOUT)
            try:
                with Rollout(server.http_url, repo, admin_key=server.admin_key) as ro:
                    for name, step in steps:
                        phases.append(_phase(ro, name, step, args.phase_requests, locust, out))
            finally:
                locust.send_signal(signal.SIGTERM)  # users finish the conversion they are in (--stop-timeout)
                locust.wait(timeout=900)
    if not records_path.is_file():
        raise RuntimeError(f"Locust wrote no records (log: {out / 'locust.log'})")
    result = json.loads(records_path.read_text())
    recs = result["records"]
    summarize(phases, recs)
    report = {"users": args.users, "phase_requests": args.phase_requests, "model_dir": str(args.model_dir),
              "versions": {str(v.number): {"onnx_dir": str(v.onnx_dir), "precision": v.precision} for v in versions},
              "requests": len(recs), "failures": sum(1 for r in recs if r[2]),
              "errors": sorted({r[2] for r in recs if r[2]})[:10],
              "locust_requests": result["locust_requests"], "locust_failures": result["locust_failures"],
              "duration_s": round(time.time() - started, 1), "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
              "overall": window(recs, 0, float("inf")), "phases": phases, "records": recs}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(render_markdown(report))
    plot(report, out / "rollout.png")
    print(render_markdown(report), flush=True)
    return report


def _phase(ro: Rollout, name: str, step: tuple | None, phase_requests: int, locust: subprocess.Popen,
           out: Path) -> dict:
    """One rollout step under load, then its steady window of ``phase_requests`` requests."""
    t0 = time.time()
    detail = None
    if step is not None:
        detail = getattr(ro, step[0])(*step[1:])
    t1 = time.time()
    begin = _counts(ro)
    while True:
        now = _counts(ro)
        if sum(now[v] - begin[v] for v in now) >= phase_requests:
            break
        if locust.poll() is not None:
            raise RuntimeError(f"locust exited early (log: {out / 'locust.log'})")
        time.sleep(0.5)
    st = ro.status()
    phase = {"phase": name, "start": t0, "step_end": t1, "end": time.time(), "step_s": round(t1 - t0, 2),
             "split": {str(v): p for v, p in st.split.items()}, "live": st.live, "candidate": st.candidate,
             "per_version": {str(v): now[v] - begin[v] for v in now}}
    if isinstance(detail, dict) and "db" in detail:
        phase["parity_db"] = round(float(detail["db"]), 4)
    print(f"== {name}: step {t1 - t0:.1f} s; split {phase['split']}; requests per version {phase['per_version']}",
          flush=True)
    return phase


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def render_markdown(report: dict) -> str:
    o = report["overall"]
    lines = [f"# Rollout under load ({report['users']} Locust users, no client retries)", "",
             f"{report['requests']} requests, **{report['failures']} failed** (Locust: {report['locust_requests']} "
             f"requests, {report['locust_failures']} failures); latency p50 {_ms(o['p50_s'])} ms, p95 "
             f"{_ms(o['p95_s'])} ms; {report['duration_s']:.0f} s in all. Machine: {report['cpus']} CPUs, load "
             f"average {report['loadavg_before'][0]:.1f} before, {report['loadavg_after'][0]:.1f} after (1 min; "
             "shared with other work: latencies are noisy).", "",
             "| phase | split v1 / v2 | step (s) | requests during step | failed | requests after | failed | "
             "p50 (ms) | p95 (ms) | v1 requests | v2 requests |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in report["phases"]:
        split = " / ".join(f"{p['split'].get(v, 0):.0f}%" for v in ("1", "2"))
        s, w = p["step"], p["steady"]
        lines.append(f"| {p['phase']} | {split} | {p['step_s']:.1f} | {s['requests']} | {s['failures']} | "
                     f"{w['requests']} | {w['failures']} | {_ms(w['p50_s'])} | {_ms(w['p95_s'])} | "
                     f"{p['per_version']['1']} | {p['per_version']['2']} |")
    parity = [f"{p['phase']}: {p['parity_db']:.3f} dB" for p in report["phases"] if "parity_db" in p]
    lines += ["", "*step*: the rollout call (`stage`: checks, loads, parity smoke test; `canary`: the router's reload; "
              "`rollback` / `promote`: the router's reload, the drain, the unloads), with the load running; "
              "*requests during step*: Locust's requests that ended in it. *after*: from the step's end until "
              f"{report['phase_requests']} more requests were served (split as shown); Locust's requests that ended "
              "in that window, their failures and latency percentiles. *v1 / v2 requests*: Triton's success counts "
              "of `cosyvoice_vc_v1` / `cosyvoice_vc_v2` over the same window (the router forwards each request to "
              "one of them; requests in flight at the window's edges make the two counts differ by a few)."]
    if parity:
        lines += ["", "Parity smoke test at stage (mean |log-mel difference| against v1): " + ", ".join(parity) + "."]
    if report["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in report["errors"]]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = report["phases"]
    names = [p["phase"] for p in phases]
    v1 = np.array([p["per_version"]["1"] for p in phases])
    v2 = np.array([p["per_version"]["2"] for p in phases])
    fig, (ax, lx) = plt.subplots(2, 1, figsize=(10, 7))
    ax.bar(names, v1, label="v1")
    ax.bar(names, v2, bottom=v1, label="v2")
    for i, p in enumerate(phases):
        failed = p["step"]["failures"] + p["steady"]["failures"]
        ax.text(i, v1[i] + v2[i], f"{failed} failed", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(1, int((v1 + v2).max(initial=0))) * 1.2)  # room for the labels
    ax.set_ylabel("requests per version\n(Triton, after the step)")
    ax.set_title(f"cosyvoice_vc rollout under Locust: {report['requests']} requests, {report['failures']} failed")
    ax.legend()
    ax.tick_params(axis="x", labelrotation=15)
    t_zero = phases[0]["start"] if phases else 0.0
    recs = report["records"]
    ok = [(r[0] - t_zero, r[1]) for r in recs if not r[2]]
    bad = [(r[0] - t_zero, r[1]) for r in recs if r[2]]
    for p in phases:
        if p["step_end"] - p["start"] > 0.5:
            lx.axvspan(p["start"] - t_zero, p["step_end"] - t_zero, color="0.85")
            lx.text(p["start"] - t_zero, 0, p["phase"], rotation=90, fontsize=7, va="bottom")
    if ok:
        lx.plot(*zip(*ok, strict=True), ".", ms=4, label="served")
    if bad:
        lx.plot(*zip(*bad, strict=True), "rx", ms=6, label="failed")
    lx.set_xlabel("seconds since the first phase (grey: a rollout step running)")
    lx.set_ylabel("latency (s), at the request's end")
    lx.set_ylim(bottom=0)
    lx.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="models/cosyvoice2-demo-tiny")
    p.add_argument("--onnx-dir", default="build/onnx")
    p.add_argument("--candidate-onnx-dir", default="", help="v2's export (default: --onnx-dir)")
    p.add_argument("--candidate-precision", default="fp32", help="v2's precision (render.py --precision values)")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--phase-requests", type=int, default=20, help="requests counted after each step")
    p.add_argument("--no-promote", action="store_true", help="stop after the rollback (no second stage + promote)")
    p.add_argument("--out", default="build/loadtest/rollout")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = run(args)
    return 0 if report["failures"] == 0 and report["locust_failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
