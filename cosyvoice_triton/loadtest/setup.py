"""What every load-test mode shares: the options, the model and ONNX files, each column's rendered repository,
one Locust run in a subprocess, the warm-up and call profile of a column, and the machine's description."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import resources
from . import COLUMNS, PROTOCOLS, TTS_COLUMNS
from .metrics import settled_snapshot, success_delta
from .recording import ENV_VAR, RunConfig, RunResult
from .sampler import ServerSampler
from .workload import Workload

__all__ = ["CONFIGS", "FIXTURES", "Options", "ensure_assets", "gateway", "locust_command", "locust_env", "machine",
           "render", "run_locust", "server_figures", "warm_up"]

LOCUSTFILE = resources.path("loadtest/locustfile.py")
#: the test recordings: the workload's speech where espeak-ng is missing
FIXTURES = resources.path("tests/fixtures")
SWEEP = (1, 2, 4, 8, 10, 16)
#: The integrated column's deployment tuning: the flow stage (BLS solver) and its estimator hold ~75% of the
#: compute, and one instance of each runs one batch at a time on one core (1 intra-op thread), leaving the other
#: core partly idle (70% CPU on 2 cores); two instances each let two batches run at once (tiny, HTTP, 10 users:
#: 1.98 -> 2.53 req/s). The plain column keeps Triton's default of one instance, as a plain deployment would.
INTEGRATED_TUNABLES = {"instances": {"flow": 2, "flow_estimator": 2}}


@dataclass
class Options:
    name: str = "tiny"
    model_dir: str = "models/cosyvoice2-demo-tiny"
    demo_size: str = "tiny"
    onnx_dir: str = "build/onnx"
    out_dir: str = "build/loadtest/tiny"
    columns: tuple[str, ...] = COLUMNS
    protocols: tuple[str, ...] = PROTOCOLS
    users: int = 10
    requests: int = 200  # measured requests per column and protocol at ``users``
    warmup_requests: int = -1  # completions left out at the start of each run (-1: as many as users)
    sweep: tuple[int, ...] = SWEEP
    sweep_protocol: str = "grpc"
    sweep_requests: int = 12  # measured requests per sweep level: at least this, and 3 per user
    perf_protocols: tuple[str, ...] = ("grpc",)
    perf_requests: int = 20  # perf_analyzer's requests per measurement window (3 windows at most)
    precision: str = "auto"  # integrated column: auto = the quality report's CPU choice if it fits, else fp32
    quality_report: str = "build/quality/report.json"
    #: integrated column: render tunables (cosyvoice_triton.serving.repository.Tunables); ``--set`` replaces them
    integrated_tunables: dict[str, Any] = field(default_factory=lambda: dict(INTEGRATED_TUNABLES))
    device: str = "cpu"  # cuda: both columns run the neural graphs as PyTorch modules on the GPU
    n_sources: int = 16
    max_run_s: float = 1800.0  # a Locust run stops here even short of its requests (noted in the report)
    startup_timeout_s: float = 600.0
    seed: int = 0
    dry_run: bool = False  # prepare and render, print what would run; no server
    profile: bool = True  # after the columns: profile the integrated column's slowest graph (profile.py)
    profile_only: bool = False  # only the profile, from an existing <out_dir>/report.json; rewrites the report
    profile_graph: str = ""  # the graph to profile (empty: the slowest of profile.PROFILED_GRAPHS)
    notes: list[str] = field(default_factory=list)
    #: vc: plain separate calls vs the integrated ensemble; tts: the TTS column (:func:`run_tts`)
    mode: str = "vc"
    tts_columns: tuple[str, ...] = TTS_COLUMNS
    tts_concurrency: tuple[int, ...] = (1, 2, 4)
    tts_requests: int = 8  # measured requests per TTS-column pipeline and concurrency: at least this, 1 per user
    perf_concurrency: tuple[int, ...] | None = None  # --mode tts: perf_analyzer's levels (None: tts_concurrency)
    tts_texts: tuple[str, ...] = ()  # --mode tts: what the TTS pipelines speak (empty: workload.TTS_TEXTS)
    #: --mode tts / mixed: extra tritonserver flags, e.g. --backend-config=python,stub-timeout-seconds=300 (a
    #: loaded machine: the Python backend's stubs must answer within that time or the server gives up on them)
    server_args: tuple[str, ...] = ()
    # --mode mixed (:mod:`.mixed`): steady high-priority users, the low-priority flood, the high class's measured
    # requests per run, and the servers (False: without the policy, True: with it)
    mixed_high_users: int = 1
    mixed_low_users: int = 6
    mixed_requests: int = 8
    mixed_policies: tuple[bool, ...] = (False, True)
    #: --mode prompt-cache (:mod:`.repeated`): distinct prompt recordings the requests draw from
    speakers: int = 4
    #: --mode stress (:mod:`.stress`): how long, innocent and hostile users, and the largest memory growth (a
    #: fraction: 0.1 is 10%) of Triton and of the gateway from the run's first window to its last
    stress_seconds: float = 600.0
    stress_users: int = 4
    stress_hostile_users: int = 8
    stress_max_growth: float = 0.10
    #: the hostile acts drawn and the innocent kinds taken in turn (empty: all), to isolate what a growth follows
    stress_acts: tuple[str, ...] = ()
    stress_kinds: tuple[str, ...] = ()

    @property
    def warmup(self) -> int:
        return self.users if self.warmup_requests < 0 else self.warmup_requests


CONFIGS = {
    "tiny": Options(),
    "full": Options(name="full", model_dir="models/cosyvoice2-demo-full", demo_size="full",
                    onnx_dir="build/onnx-full", out_dir="build/loadtest/full", requests=100, sweep_requests=8,
                    perf_requests=10, max_run_s=3600.0, quality_report="build/quality-full/report.json"),
}


# -------------------------------------------------------------------------------- preparation


def ensure_assets(opts: Options, graphs: Sequence[str]) -> None:
    """The model folder (the demo model is written when missing) and the fp32 ONNX files of ``graphs``."""
    from ..shapes import GRAPHS

    model_dir, onnx_dir = Path(opts.model_dir), Path(opts.onnx_dir)
    if not (model_dir / "flow.pt").is_file():
        if "demo" not in model_dir.name:
            raise FileNotFoundError(f"{model_dir}/flow.pt not found: point --model-dir at a CosyVoice2 folder")
        from ..models.demo import write_demo_model

        print(f"== writing the {opts.demo_size} demo model (random weights) to {model_dir}", flush=True)
        write_demo_model(model_dir, size=opts.demo_size)
    missing = [g for g in graphs if g in GRAPHS and not (onnx_dir / "fp32" / f"{g}.onnx").is_file()]
    if missing:
        from ..export.onnx_export import export_onnx

        print(f"== exporting fp32 ONNX of {', '.join(missing)} to {onnx_dir / 'fp32'}", flush=True)
        export_onnx(model_dir, onnx_dir / "fp32", graphs=missing, verify=False)


def integrated_precision(opts: Options) -> str:
    """``auto``: the quality report's CPU choice when the report is about this model and this export, else fp32."""
    if opts.precision != "auto":
        return opts.precision
    if opts.device != "cpu":
        opts.notes.append("integrated precision: fp32 PyTorch on the GPU (the CPU choice is for onnxruntime on CPU)")
        return "fp32"
    path = Path(opts.quality_report)
    try:
        doc = json.loads(path.read_text())
        same = (Path(doc["model_dir"]).resolve() == Path(opts.model_dir).resolve()
                and Path(doc["onnx_root"]).resolve() == Path(opts.onnx_dir).resolve())
    except (OSError, ValueError, KeyError, TypeError):
        same = False
    if same:
        return "cpu-choice"
    opts.notes.append(f"integrated precision: fp32 (no quality report for {opts.model_dir} / {opts.onnx_dir} at "
                      f"{path}: make quality, or make bench-export for the full dims, writes the CPU choice)")
    return "fp32"


def render(column: str, opts: Options, out: Path) -> tuple[Path, dict[str, Any]]:
    """Render the column's repository into ``out``; returns it and what was rendered (for the report)."""
    from ..serving.repository import render_repository

    gpu = {"runtime": "torch", "device": opts.device} if opts.device != "cpu" else {}
    if column == "plain":
        report = render_repository("local", out, model_dir=opts.model_dir, onnx_dir=opts.onnx_dir, precision="fp32",
                                   profile="plain", **gpu)
        what = {"profile": "plain", "precision": "fp32", **gpu}
    else:
        precision = integrated_precision(opts)
        try:
            report = render_repository("local", out, model_dir=opts.model_dir, onnx_dir=opts.onnx_dir,
                                       precision=precision, quality_report=opts.quality_report,
                                       **opts.integrated_tunables, **gpu)
        except Exception as exc:  # e.g. a reduced-precision file the choice names is missing
            if precision == "fp32":
                raise
            opts.notes.append(f"integrated precision {precision} could not be rendered ({exc}); fp32 used")
            precision = "fp32"
            report = render_repository("local", out, model_dir=opts.model_dir, onnx_dir=opts.onnx_dir,
                                       precision=precision, **opts.integrated_tunables, **gpu)
        what = {"precision": precision, "dynamic_batching": True, **opts.integrated_tunables, **gpu}
    marker = json.loads((out / "cosyvoice_repository.json").read_text())
    what["models"] = report.models
    what["graph_precision"] = marker.get("precision")
    print(report.describe(), flush=True)
    return out, what


# ------------------------------------------------------------------------------------ running


def locust_command(cfg_path: Path, users: int, csv_prefix: Path, max_run_s: float,
                   locustfile: Path = LOCUSTFILE) -> list[str]:
    exe = Path(sys.executable).parent / "locust"
    base = [str(exe)] if exe.is_file() else [sys.executable, "-m", "locust"]
    return [*base, "-f", str(locustfile), "--headless", "-u", str(users), "-r", str(users),
            "--run-time", f"{max(1, int(max_run_s))}s", "--stop-timeout", "600", "--only-summary",
            "--csv", str(csv_prefix), "--exit-code-on-error", "0"]


def locust_env(**extra: str) -> dict[str, str]:
    """The environment of a Locust subprocess, with ``extra``: a clone's top in front of ``$PYTHONPATH``, so that
    its locustfile imports this package even where it is not installed (an installed wheel needs nothing)."""
    clone = resources.checkout()
    path = [*([str(clone)] if clone else []), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {**os.environ, **extra, **({"PYTHONPATH": os.pathsep.join(path)} if path else {})}


def run_locust(cfg: RunConfig, work: Path, max_run_s: float, tag: str = "") -> RunResult:
    """One Locust run in a subprocess; returns what the locustfile recorded (``tag`` names its files)."""
    tag = tag or f"{cfg.column}_{cfg.protocol}_u{cfg.users}"
    cfg_path = cfg.save(work / f"{tag}.config.json")
    Path(cfg.out).unlink(missing_ok=True)
    cmd = locust_command(cfg_path, cfg.users, work / f"locust_{tag}", max_run_s)
    t0 = time.time()
    with open(work / f"locust_{tag}.log", "wb") as logf:
        proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=locust_env(**{ENV_VAR: str(cfg_path)}),
                              timeout=max_run_s + 900, check=False)
    if not Path(cfg.out).is_file():
        tail = (work / f"locust_{tag}.log").read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"Locust run {tag} wrote no result (exit code {proc.returncode}):\n" + "\n".join(tail))
    result = RunResult.load(cfg.out)
    print(f"   {tag}: {len(result.records)} measured requests ({sum(not r.ok for r in result.records)} failed) in "
          f"{result.duration_s:.1f} s (run {time.time() - t0:.0f} s)", flush=True)
    return result


def server_figures(sampler: ServerSampler, t0: float, t1: float) -> dict[str, float]:
    gpu, device = sampler.peak_gpu_mb(t0, t1)
    return {"peak_rss_mb": sampler.peak_rss_mb(t0, t1), "cpu_triton": sampler.mean_cpu_utilization(t0, t1),
            "cpu_server": sampler.process_cpu(t0, t1), "peak_gpu_mb": gpu, "peak_gpu_device_mb": device}


def warm_up(column: str, protocol: str, url: str, http_url: str, metrics_url: str, workload: Workload,
            model_dir: str, n: int = 2) -> dict[str, float]:
    """Convert ``n`` sources one after the other (first calls load and warm the models), then profile one
    conversion: the increase of each model's success counter (calls per conversion)."""
    from .callers import make_converter

    conv = make_converter(column, protocol, url, model_dir=model_dir)
    try:
        for i in range(n):
            conv.convert(workload.item(i))
        before = settled_snapshot(http_url, metrics_url, statistics=False)
        conv.convert(workload.item(n))
        after = settled_snapshot(http_url, metrics_url, statistics=False)
    finally:
        conv.close()
    return {m: d for m, d in success_delta(before, after).items() if d > 0}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return f"{cpu}, {os.cpu_count()} logical CPUs, load average at start {load}"


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("locust", "tritonclient", "nvidia-pytriton", "torch", "onnxruntime"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


@contextlib.contextmanager
def gateway(server, work: Path, keys: dict[str, str], *args: str,
            patience_s: float = 300.0) -> Iterator[tuple[subprocess.Popen, str, str]]:
    """The gateway (``python -m cosyvoice_triton.gateway``) in front of ``server``, with ``keys`` (tenant -> key)
    and the extra flags ``args``, its log in ``work/gateway.log``: ``(process, "host:http_port",
    "host:grpc_port")`` once it answers ``/health``; stopped on the way out."""
    from ..serving.launch.server import free_ports

    port, grpc_port = free_ports(2)
    work.mkdir(parents=True, exist_ok=True)
    key_file = work / "keys"
    key_file.write_text("".join(f"{tenant}:{key}\n" for tenant, key in keys.items()))
    log_path = work / "gateway.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cosyvoice_triton.gateway", "--triton-grpc", server.grpc_url,
                                 "--triton-http", server.http_url, "--port", str(port), "--grpc-port",
                                 str(grpc_port), "--api-key-file", str(key_file), *args],
                                stdout=out, stderr=subprocess.STDOUT)
    http = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + patience_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"http://{http}/health", timeout=30).status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not answer /health")
            time.sleep(0.2)
        yield proc, http, f"127.0.0.1:{grpc_port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
