"""perf_analyzer on the ``cosyvoice_vc`` ensemble, next to Locust's figures; for the TTS column, its streaming mode
(``--streaming`` over gRPC) on the decoupled ``cosyvoice_tts_stream`` / ``cosyvoice_vc_stream``, whose first-response
latency comes from its ``--profile-export-file`` (every request's send time and response times).

The binary is the one in the ``tritonclient==2.51.0`` wheel (``<venv>/bin/perf_analyzer``; PyPI's
``perf-analyzer`` is an empty placeholder). It needs ``libb64.so.0d`` and ``libcudart.so.12``, which ship in the
``nvidia-pytriton`` wheel's ``nvidia_pytriton.libs`` under hashed names: :func:`library_dir` links them under
their own names into a folder for ``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..serving.launch.server import admin_headers, admin_key
from ..shapes import VC_MODEL
from .workload import Workload

__all__ = ["find_perf_analyzer", "input_data", "library_dir", "parse_csv", "parse_profile_export", "run_perf_analyzer",
           "tts_input_data"]

NEEDED = {"libb64.so.0d": "libb64-", "libcudart.so.12": "libcudart-"}


def find_perf_analyzer() -> Path | None:
    here = Path(sys.prefix) / "bin" / "perf_analyzer"
    if here.is_file():
        return here
    found = shutil.which("perf_analyzer")
    return Path(found) if found else None


def library_dir(out: str | Path) -> Path:
    """A folder with ``libb64.so.0d`` / ``libcudart.so.12`` linked from the nvidia-pytriton wheel's libraries."""
    from ..serving.launch.server import find_installation

    libs = find_installation().libs
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, prefix in NEEDED.items():
        candidates = sorted(libs.glob(f"{prefix}*"))
        link = out / name
        if candidates and not link.exists():
            link.symlink_to(candidates[0])
    return out


def input_data(workload: Workload, path: str | Path, *, items: int = 4, seed: int = 0) -> Path:
    """perf_analyzer's ``--input-data`` JSON: the first ``items`` sources of the workload with its prompt
    (shapes without the batch axis; the rates as ``[1]`` tensors)."""
    data = []
    for i in range(min(items, len(workload))):
        it = workload.item(i)
        data.append({
            "source_audio": {"content": np.round(it.source, 6).tolist(), "shape": [len(it.source)]},
            "source_sample_rate": {"content": [int(it.source_sr)], "shape": [1]},
            "prompt_audio": {"content": np.round(it.prompt, 6).tolist(), "shape": [len(it.prompt)]},
            "prompt_sample_rate": {"content": [int(it.prompt_sr)], "shape": [1]},
            "seed": {"content": [int(seed)], "shape": [1]},
        })
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"data": data}))
    return path


def tts_input_data(workload: Workload, path: str | Path, *, items: int = 4, seed: int = 0) -> Path:
    """``--input-data`` for ``cosyvoice_tts`` / ``cosyvoice_tts_stream``: the workload's first ``items`` texts,
    zero-shot in its prompt's voice with its prompt text (what the Locust users send)."""
    data = []
    for i in range(min(items, len(workload.texts))):
        it = workload.item(i)
        row = {"text": {"content": [it.text], "shape": [1]},
               "prompt_audio": {"content": np.round(it.prompt, 6).tolist(), "shape": [len(it.prompt)]},
               "prompt_sample_rate": {"content": [int(it.prompt_sr)], "shape": [1]},
               "seed": {"content": [int(seed)], "shape": [1]}}
        if it.prompt_text:
            row["prompt_text"] = {"content": [it.prompt_text], "shape": [1]}
        data.append(row)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"data": data}))
    return path


def parse_profile_export(doc: dict[str, Any]) -> dict[str, float]:
    """perf_analyzer's ``--profile-export-file`` JSON (timestamps in ns) -> first-response and last-response
    latency (mean / p50 / p95 ms) over the requests of the measurement windows that got a response, and how many
    responses each got. Requests sent outside ``window_boundaries`` (warm-up, the tail) are left out."""
    from .report import latency_summary

    firsts, totals, responses = [], [], []
    for exp in doc.get("experiments", []):
        bounds = [int(b) for b in exp.get("window_boundaries", [])]
        lo, hi = (bounds[0], bounds[-1]) if len(bounds) >= 2 else (-math.inf, math.inf)
        for req in exp.get("requests", []):
            ts, resp = int(req["timestamp"]), [int(t) for t in req.get("response_timestamps", [])]
            if not resp or not lo <= ts <= hi:
                continue
            firsts.append((resp[0] - ts) / 1e9)
            totals.append((resp[-1] - ts) / 1e9)
            responses.append(len(resp))
    if not firsts:
        raise ValueError("the profile export has no request with a response inside the measurement windows")
    first, total = latency_summary(firsts), latency_summary(totals)
    return {"requests": len(firsts), "responses_per_request": float(np.mean(responses)),
            **{f"first_{k}": v for k, v in first.items()}, "mean_ms": total["mean_ms"], "p50_ms": total["p50_ms"],
            "p95_ms": total["p95_ms"], "p99_ms": total["p99_ms"]}


#: The CSV's parts of a request's latency (their sum is the client's average latency, which the CSV lacks).
LATENCY_PARTS = ("Client Send", "Network+Server Send/Recv", "Server Queue", "Server Compute Input",
                 "Server Compute Infer", "Server Compute Output", "Client Recv")


def parse_csv(text: str) -> dict[str, float]:
    """perf_analyzer's ``-f`` CSV (latencies in microseconds) -> throughput (req/s) and latencies in ms of the
    first row; the mean latency is the sum of :data:`LATENCY_PARTS` (or the ``Avg latency`` column if any)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise ValueError("perf_analyzer wrote no measurement row")
    row = rows[0]

    def us(key: str) -> float:
        v = row.get(key)
        return float(v) / 1000.0 if v not in (None, "") else math.nan

    mean = us("Avg latency")
    if math.isnan(mean) and all(row.get(k) not in (None, "") for k in LATENCY_PARTS):
        mean = sum(float(row[k]) for k in LATENCY_PARTS) / 1000.0
    return {"concurrency": int(float(row["Concurrency"])), "throughput": float(row["Inferences/Second"]),
            "mean_ms": mean, "p50_ms": us("p50 latency"), "p90_ms": us("p90 latency"),
            "p95_ms": us("p95 latency"), "p99_ms": us("p99 latency"), "server_queue_ms": us("Server Queue"),
            "server_compute_ms": us("Server Compute Infer")}


def run_perf_analyzer(url: str, protocol: str, concurrency: int, data_file: str | Path, work_dir: str | Path, *,
                      model: str = VC_MODEL, requests_per_window: int = 20, max_trials: int = 3,
                      stability_percent: int = 999, timeout_s: float = 600.0, streaming: bool = False,
                      extra_args: Sequence[str] = (), model_version: str | None = None,
                      attempts: int = 2) -> dict[str, Any]:
    """Run perf_analyzer at one concurrency over ``max_trials`` windows of ``requests_per_window`` requests;
    returns its figures, or ``{"note": why}`` when it cannot run or measure (never raises for that).

    ``model_version``: the version measured (``-x``); by default the newest version the server reports ready.
    Without ``-x``, perf_analyzer 2.51 looks the model's server-side statistics up under an empty version and
    now and then ends a finished measurement with "failed to find the requested model version" and no CSV; a
    run that ends so is tried again, ``attempts`` times in all.

    perf_analyzer reports nothing unless its last 3 windows agree within ``stability_percent``; windows of a few
    seconds-long conversions rarely do on a busy CPU, so the default (999) turns that check off: its figures
    are then the last 3 windows' (the report says so).

    ``streaming``: gRPC streaming (a decoupled model); the latencies then come from the profile export (first
    response and last response of each request), the throughput from the CSV."""
    result: dict[str, Any] = {"protocol": protocol, "concurrency": concurrency, "model": model,
                              "streaming": streaming}
    if streaming and protocol != "grpc":
        return {**result, "note": "perf_analyzer streams over gRPC only"}
    binary = find_perf_analyzer()
    if binary is None:
        return {**result, "note": "no perf_analyzer binary (it ships in the tritonclient==2.51.0 wheel)"}
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    tag = f"{model}_{protocol}_c{concurrency}" if model != VC_MODEL else f"{protocol}_c{concurrency}"
    csv_path = work / f"perf_analyzer_{tag}.csv"
    csv_path.unlink(missing_ok=True)
    export = work / f"perf_analyzer_{tag}.profile.json"
    export.unlink(missing_ok=True)
    try:
        libs = library_dir(work / "pa_libs")
    except Exception as exc:
        return {**result, "note": f"cannot link the libraries perf_analyzer needs: {exc}"}
    version = model_version or ready_version(url, protocol, model)
    cmd = [str(binary), "-m", model, *(["-x", version] if version else []), "-u", url, "-i", protocol,
           "--concurrency-range", f"{concurrency}:{concurrency}",
           "--input-data", str(data_file), "--measurement-mode", "count_windows",
           "--measurement-request-count", str(requests_per_window), "--max-trials", str(max_trials),
           "-s", str(stability_percent), "-f", str(csv_path),
           # model config and statistics are restricted APIs: perf_analyzer sends the admin header with every call
           *[a for k, v in admin_headers(protocol).items() for a in ("-H", f"{k}:{v}")],
           *(["--streaming", "--profile-export-file", str(export)] if streaming else []), *extra_args]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(libs), *[p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]])
    result["command"] = " ".join(cmd).replace(admin_key(), "<admin key>")
    for attempt in range(1, max(1, attempts) + 1):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {**result, "note": f"perf_analyzer did not finish within {timeout_s:.0f} s"}
        except OSError as exc:
            return {**result, "note": f"perf_analyzer could not start: {exc}"}
        log = (proc.stdout or "") + (proc.stderr or "")
        (work / f"perf_analyzer_{tag}.log").write_text(log)
        if csv_path.is_file() or VERSION_LOOKUP_FAILED not in log:
            break
        result["retried"] = attempt
    if csv_path.is_file():
        result["note"] = f"{max_trials} windows of {requests_per_window} requests" + (
            ", stability check off" if stability_percent >= 999 else f", stable within {stability_percent}%")
        try:
            result.update(parse_csv(csv_path.read_text()))
        except (ValueError, KeyError) as exc:
            result["note"] = f"unreadable CSV: {exc}"
            return result
        if streaming:
            try:
                doc = json.loads(export.read_text())
                result.update(parse_profile_export(doc))
                result["note"] += "; latencies from the profile export"
                export.write_text(json.dumps(_timestamps_only(doc)))  # the audio in and out: tens of MB
            except (OSError, ValueError, KeyError) as exc:
                result["note"] += f"; no first-response latency ({exc})"
        if proc.returncode != 0:
            result["note"] += f"; exit code {proc.returncode}: {_last_error(log)}"
        return result
    return {**result, "note": f"no result (exit code {proc.returncode}): {_last_error(log)}"}


#: perf_analyzer's message when its statistics lookup misses the model (see :func:`run_perf_analyzer`).
VERSION_LOOKUP_FAILED = "failed to find the requested model version"


def ready_version(url: str, protocol: str, model: str) -> str | None:
    """The newest ready version of ``model`` on the server at ``url``, or None when the server does not say."""
    try:
        if protocol == "grpc":
            import tritonclient.grpc as client

            with client.InferenceServerClient(url) as c:
                versions = list(c.get_model_metadata(model, headers=admin_headers("grpc")).versions)
        else:
            import tritonclient.http as client

            with client.InferenceServerClient(url) as c:
                versions = list(c.get_model_metadata(model, headers=admin_headers("http")).get("versions", []))
    except Exception:  # the caller runs perf_analyzer without -x, as before
        return None
    numeric = sorted((v for v in versions if str(v).isdigit()), key=int)
    return str(numeric[-1]) if numeric else None


def _timestamps_only(doc: dict[str, Any]) -> dict[str, Any]:
    """The profile export without each request's inputs and outputs (what :func:`parse_profile_export` reads)."""
    keep = ("timestamp", "sequence_id", "response_timestamps")
    return {**doc, "experiments": [
        {**exp, "requests": [{k: r[k] for k in keep if k in r} for r in exp.get("requests", [])]}
        for exp in doc.get("experiments", [])]}


def _last_error(log: str) -> str:
    lines = [x.strip() for x in log.splitlines() if x.strip()]
    errors = [x for x in lines if "rror" in x or "ailed" in x or "nstable" in x]
    return (errors or lines or ["(no output)"])[-1][:300]
