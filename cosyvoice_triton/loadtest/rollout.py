"""The rollout scenario under load: ``python -m cosyvoice_triton.loadtest.rollout`` (``make rollout-demo``).

Renders a repository with two versions (v1 live; v2: the candidate, by default the same checkpoint re-served from
``--candidate-onnx-dir`` / ``--candidate-precision``), starts ``tritonserver`` with explicit model control, runs
Locust (``loadtest/rollout_locustfile.py``: users converting through the public ``cosyvoice_vc``, no client retries)
and, while it runs, goes through the phases: v1 alone, ``stage 2``, ``canary 10``, ``canary 50``, ``canary 100``,
``rollback``. Each phase lasts until ``--phase-requests`` requests completed after its step. Written to ``--out``:
``report.json``, ``report.md`` (per phase: the step's duration, requests and failures seen by Locust, requests per
version from Triton's statistics of each version's pipeline between the step's end and the next step) and
``rollout.png``.
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
from pathlib import Path

from ..serving.rollout import Rollout, VersionSpec, startup_models

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtest" / "rollout_locustfile.py"
PHASES = (("v1 alone", None), ("stage v2", ("stage", 2)), ("canary 10%", ("canary", 10)),
          ("canary 50%", ("canary", 50)), ("canary 100%", ("canary", 100)), ("rollback", ("rollback",)))


def _counts(ro: Rollout) -> dict[int, int]:
    out = {}
    for v in (1, 2):
        try:
            out[v] = ro.counts(v)[0]
        except Exception:  # not loaded
            out[v] = 0
    return out


def run(args: argparse.Namespace) -> dict:
    from ..serving.serve_demo import prepare
    from ..serving.server import TritonServer
    from .workload import cached_workload

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    repo = out / "model_repository"
    versions = [VersionSpec(1, Path(args.model_dir), Path(args.onnx_dir)),
                VersionSpec(2, Path(args.model_dir), Path(args.candidate_onnx_dir or args.onnx_dir),
                            args.candidate_precision)]
    prepare(args.model_dir, onnx_dir=args.onnx_dir, repository=repo, versions=versions, max_queue_delay_us=20000)
    workload_path = out / "workload.npz"
    workload = cached_workload(workload_path, fixtures=ROOT / "tests" / "fixtures", n_sources=8, min_seconds=2.0,
                               max_seconds=4.0)
    print(f"== workload: {workload.describe()}")
    phases = []
    with TritonServer(repo, model_control="explicit", load_models=startup_models(repo), exit_timeout=30) as server:
        from ..clients.client import VCClient

        with VCClient(server.http_url) as client:  # warm-up, one at a time (see the README: first requests at once
            for i in range(2):                     # into a fresh server crashed it twice here, Signal 11)
                item = workload.item(i)
                client.convert(item.source, item.prompt, source_sr=item.source_sr, prompt_sr=item.prompt_sr)
        config = out / "locust_config.json"
        records = out / "locust_records.json"
        records.unlink(missing_ok=True)
        config.write_text(json.dumps({"url": server.http_url, "workload": str(workload_path), "timeout_s": 600,
                                      "out": str(records)}))
        cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(args.users), "-r",
               str(args.users), "--run-time", "7200s", "--stop-timeout", "600", "--only-summary"]
        env = {**os.environ, "ROLLOUT_LOADTEST": str(config)}
        locust = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(out / "locust.log", "w"),  # noqa: SIM115
                                  stderr=subprocess.STDOUT)
        try:
            with Rollout(server.http_url, repo, admin_key=server.admin_key) as ro:
                for name, step in PHASES:
                    t0 = time.time()
                    if step is not None:
                        getattr(ro, step[0])(*step[1:])
                    t1 = time.time()
                    begin = _counts(ro)
                    while True:
                        now = _counts(ro)
                        if sum(now[v] - begin[v] for v in now) >= args.phase_requests:
                            break
                        if locust.poll() is not None:
                            raise RuntimeError(f"locust exited early (log: {out / 'locust.log'})")
                        time.sleep(0.5)
                    split = ro.status().split
                    phases.append({"phase": name, "start": t0, "step_s": round(t1 - t0, 2), "end": time.time(),
                                   "split": {str(v): p for v, p in split.items()},
                                   "per_version": {str(v): now[v] - begin[v] for v in now}})
                    print(f"== {name}: step {t1 - t0:.1f} s; requests per version {phases[-1]['per_version']}")
        finally:
            locust.send_signal(signal.SIGTERM)  # users finish the conversion they are in (--stop-timeout)
            locust.wait(timeout=900)
    result = json.loads(records.read_text())
    recs = result["records"]
    bounds = [p["start"] for p in phases] + [float("inf")]
    for i, p in enumerate(phases):
        inside = [r for r in recs if bounds[i] <= r[0] < bounds[i + 1]]
        p["requests"] = len(inside)
        p["failures"] = sum(1 for r in inside if r[2])
    report = {"users": args.users, "phase_requests": args.phase_requests, "model_dir": args.model_dir,
              "versions": {str(v.number): {"onnx_dir": str(v.onnx_dir), "precision": v.precision} for v in versions},
              "requests": len(recs), "failures": sum(1 for r in recs if r[2]),
              "errors": sorted({r[2] for r in recs if r[2]})[:10],
              "locust_requests": result["locust_requests"], "locust_failures": result["locust_failures"],
              "phases": phases}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(render_markdown(report))
    plot(report, out / "rollout.png")
    print(render_markdown(report))
    return report


def render_markdown(report: dict) -> str:
    lines = [f"# Rollout under load ({report['users']} Locust users, no client retries)", "",
             f"{report['requests']} requests, **{report['failures']} failed** (Locust: {report['locust_requests']} "
             f"requests, {report['locust_failures']} failures).", "",
             "| phase | step (s) | split v1 / v2 | requests (Locust) | failed | v1 requests | v2 requests |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for p in report["phases"]:
        split = " / ".join(f"{p['split'].get(v, 0):.0f}%" for v in ("1", "2"))
        lines.append(f"| {p['phase']} | {p['step_s']:.1f} | {split} | {p['requests']} | {p['failures']} | "
                     f"{p['per_version']['1']} | {p['per_version']['2']} |")
    lines += ["", "Requests (Locust): completed between this step's start and the next step's start. v1 / v2 "
              "requests: Triton's success counts of `cosyvoice_vc_v1` / `cosyvoice_vc_v2` from the end of the step "
              "until the phase ends (a step that loads models reloads the pipelines, which resets their counts)."]
    if report["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in report["errors"]]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p["phase"] for p in report["phases"]]
    v1 = [p["per_version"]["1"] for p in report["phases"]]
    v2 = [p["per_version"]["2"] for p in report["phases"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, v1, label="v1 (live)")
    ax.bar(names, v2, bottom=v1, label="v2 (candidate)")
    for i, p in enumerate(report["phases"]):
        ax.text(i, v1[i] + v2[i], f"{p['failures']} failed", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("requests per version (Triton statistics)")
    ax.set_title(f"cosyvoice_vc rollout under load: {report['requests']} requests, {report['failures']} failed")
    ax.legend()
    fig.autofmt_xdate(rotation=20)
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
    p.add_argument("--phase-requests", type=int, default=20, help="requests counted in each phase")
    p.add_argument("--out", default="build/loadtest/rollout")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = run(args)
    return 0 if report["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
