"""The whole comparison: prepare the model, render a repository per column, serve each in turn, load it with
Locust (both protocols, then a concurrency sweep), run perf_analyzer on the ensemble, and write the report.

Per column, one ``tritonserver`` (:class:`~cosyvoice_triton.serving.launch.server.TritonServer`, free ports, stopped at
the end whatever happens) with a :class:`~.sampler.ServerSampler` on it. Before the measured runs, each protocol
converts a few sources sequentially (warm-up) and one conversion is profiled: the increase of every model's success
counter gives the calls one conversion makes, for the cross-check. Each Locust run is a subprocess
(``locust -f loadtest/locustfile.py --headless``) described by a :class:`~.recording.RunConfig` file; it writes a
:class:`~.recording.RunResult` that is summarised here with the sampler's figures over the measured window.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import COLUMNS, PROTOCOLS, TTS_COLUMNS
from .recording import RunConfig, RunResult
from .report import RunSummary, render_markdown, summarize_run, write_report
from .sampler import ServerSampler, sample_tree
from .setup import (  # noqa: F401  (LOCUSTFILE, INTEGRATED_TUNABLES: this module's names for its users)
    CONFIGS,
    FIXTURES,
    INTEGRATED_TUNABLES,
    LOCUSTFILE,
    SWEEP,
    Options,
    _versions,
    ensure_assets,
    integrated_precision,
    locust_command,
    machine,
    render,
    run_locust,
    server_figures,
    warm_up,
)
from .workload import Workload, cached_workload, load_workload

log = logging.getLogger(__name__)

__all__ = ["CONFIGS", "Options", "main", "run", "run_tts"]

#: Models whose time contains other models' (left out when naming the slowest stage).
COMPOSITE = ("cosyvoice_vc", "flow", "hift")


# ------------------------------------------------------------------------------------------- preparation


# ----------------------------------------------------------------------------------------------- running


def check_model(column: str) -> str:
    """The model whose success counter counts the conversions: the ensemble, or the plain client's last call."""
    if column == "integrated":
        from ..shapes import VC_MODEL

        return VC_MODEL
    from ..clients.plain import PLAIN_MODELS

    return PLAIN_MODELS[-1]


def run_column(column: str, opts: Options, workload_path: Path, workload: Workload) -> dict[str, Any]:
    from ..serving.launch.server import TritonServer

    work = Path(opts.out_dir) / column
    work.mkdir(parents=True, exist_ok=True)
    repo, rendered = render(column, opts, work / "model_repository")
    out: dict[str, Any] = {"rendered": rendered, "runs": [], "sweep": [], "perf": [], "latencies": {}}
    print(f"== {column}: starting tritonserver", flush=True)
    # absolute: TritonServer runs tritonserver inside work_dir, so a relative one would not be found there
    # perf_analyzer sends no headers over gRPC (its -H is HTTP only) and reads the model config and statistics:
    # those two stay open on this loopback benchmark server; the other admin APIs need the admin key as usual
    server = TritonServer(repo, work_dir=(work / "triton").resolve(), exit_timeout=10,
                          restricted_apis=("shared-memory", "model-repository", "trace", "logging"))
    server.start(timeout=opts.startup_timeout_s)
    with server:
        server_start = server.start_seconds
        print(f"   ready in {server_start:.1f} s (http {server.http_url}, grpc {server.grpc_url})", flush=True)
        urls = {"http": server.http_url, "grpc": server.grpc_url}
        sampler = ServerSampler(server.process.pid, server.metrics_url, gpu=opts.device != "cpu").start()
        try:
            idle_rss = sample_tree(server.process.pid).rss_bytes / 2**20
            target = check_model(column)
            profile: dict[str, float] = {}
            for protocol in opts.protocols:
                profile = warm_up(column, protocol, urls[protocol], server.http_url, server.metrics_url, workload,
                                  opts.model_dir)
            out["calls_per_conversion"] = profile
            calls = round(profile.get(target, 1))
            print(f"   calls per conversion: {profile}", flush=True)

            def one(protocol: str, users: int, requests: int) -> tuple[RunSummary, RunResult]:
                cfg = RunConfig(column=column, protocol=protocol, url=urls[protocol], http_url=server.http_url,
                                metrics_url=server.metrics_url, workload=str(workload_path),
                                out=str(work / f"result_{protocol}_u{users}.json"), users=users,
                                target_requests=requests, warmup_requests=users if users != opts.users
                                else opts.warmup, seed=opts.seed, check_model=target, calls_per_request=calls,
                                model_dir=str(opts.model_dir))
                result = run_locust(cfg, work, opts.max_run_s)
                t0, t1 = result.window
                summary = summarize_run(result, server=server_figures(sampler, t0, t1))
                if not result.target_reached:
                    opts.notes.append(f"{column} {protocol} x{users}: stopped at --max-run-s {opts.max_run_s:.0f} "
                                      f"with {len(result.records)} of {requests} requests")
                return summary, result

            for protocol in opts.protocols:
                summary, result = one(protocol, opts.users, opts.requests)
                out["runs"].append(summary)
                out["latencies"][f"{column} {protocol}"] = [r.latency_s for r in result.records if r.ok]
            if opts.sweep_protocol in urls:
                for users in opts.sweep:
                    done = next((s for s in out["runs"] if s.users == users and s.protocol == opts.sweep_protocol),
                                None)
                    if done is None:
                        done, _ = one(opts.sweep_protocol, users, max(opts.sweep_requests, 3 * users))
                    out["sweep"].append(done)
            if column == "integrated":
                out["perf"] = run_perf(opts, urls, workload, work)
            out["server"] = {"start_s": server_start, "idle_rss_mb": idle_rss,
                             "peak_rss_mb": sampler.peak_rss_mb(), "sampler_errors": sampler.errors[:5]}
        finally:
            sampler.stop()
    return out


def dry_run(opts: Options, workload_path: Path) -> dict[str, Any]:
    """Render each column's repository and print the runs that would follow (no server is started)."""
    plan: dict[str, Any] = {"rendered": {}, "runs": []}
    for column in opts.columns:
        work = Path(opts.out_dir) / column
        _, plan["rendered"][column] = render(column, opts, work / "model_repository")
        for protocol in opts.protocols:
            plan["runs"].append(f"{column} {protocol}: {opts.users} users, {opts.requests} measured requests")
        for users in opts.sweep:
            if users != opts.users or opts.sweep_protocol not in opts.protocols:
                plan["runs"].append(f"{column} {opts.sweep_protocol}: {users} users, "
                                    f"{max(opts.sweep_requests, 3 * users)} measured requests")
        cfg = RunConfig(column=column, protocol=opts.sweep_protocol, url="HOST:PORT", http_url="HOST:PORT",
                        metrics_url="http://HOST:PORT/metrics", workload=str(workload_path),
                        out=str(work / "result.json"), users=opts.users)
        plan["runs"].append("  " + " ".join(locust_command(work / "run.config.json", cfg.users, work / "locust",
                                                           opts.max_run_s)))
    if "integrated" in opts.columns:
        plan["runs"] += [f"perf_analyzer {p}: concurrency {opts.users}, 3 windows of {opts.perf_requests} requests"
                         for p in opts.perf_protocols]
    print("== dry run: would run\n" + "\n".join(plan["runs"]), flush=True)
    if opts.notes:
        print("notes: " + "; ".join(opts.notes))
    return plan


def run_perf(opts: Options, urls: dict[str, str], workload: Workload, work: Path) -> list[dict[str, Any]]:
    from .perf import input_data, run_perf_analyzer

    if not opts.perf_protocols:
        return []
    data = input_data(workload, work / "perf_analyzer_input.json", seed=opts.seed)
    out = []
    for protocol in opts.perf_protocols:
        print(f"   perf_analyzer {protocol} at concurrency {opts.users}", flush=True)
        r = run_perf_analyzer(urls[protocol], protocol, opts.users, data, work, requests_per_window=opts.perf_requests,
                              timeout_s=max(300.0, opts.max_run_s))
        print(f"   -> {r.get('throughput', 'n/a')} req/s, mean {r.get('mean_ms', 'n/a')} ms {r.get('note', '')}",
              flush=True)
        out.append(r)
    return out


# ------------------------------------------------------------------------------------------------ report


def run(opts: Options) -> dict[str, Any]:
    """Run the comparison described by ``opts``; write ``report.md`` / ``report.json`` and the plots into
    ``opts.out_dir``, print the markdown, and return the report."""
    from ..serving.repository import PLAIN_TUNABLES, TORCH_GRAPHS
    from ..shapes import GRAPHS
    from .plots import plot_latency_cdf, plot_sweep

    for c in opts.columns:
        if c not in COLUMNS:
            raise ValueError(f"column must be one of {COLUMNS}, got {c!r}")
    for p in (*opts.protocols, *opts.perf_protocols):
        if p not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {p!r}")
    if opts.mode == "tts":
        return run_tts(opts)
    if opts.mode == "mixed":
        from .mixed import run_mixed

        return run_mixed(opts)
    if opts.mode == "prompt-cache":
        from .repeated import run_prompt_cache

        return run_prompt_cache(opts)
    if opts.mode == "stress":
        from .stress import run_stress

        return run_stress(opts)
    if opts.mode != "vc":
        raise ValueError(f"mode must be vc, tts, mixed, prompt-cache or stress, got {opts.mode!r}")
    out_dir = Path(opts.out_dir)
    if opts.profile_only:
        return profile_only(opts)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    setup = {"machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))}
    # the graphs served from ONNX: all of them for the integrated column on the CPU; on a GPU both columns run the
    # TORCH_GRAPHS from the checkpoint (so does the plain column on the CPU)
    all_onnx = opts.device == "cpu" and "integrated" in opts.columns
    onnx_graphs = [g for g in GRAPHS if all_onnx or g not in TORCH_GRAPHS]
    ensure_assets(opts, onnx_graphs)
    wl_path = out_dir / "workload.npz"
    workload = cached_workload(wl_path, n_sources=opts.n_sources, seed=opts.seed, fixtures=FIXTURES)
    if workload.descriptions and workload.descriptions[0].startswith("fixture"):
        opts.notes.append("workload: no speech synthesiser (the espeakng-loader wheel), so the test fixtures' "
                          "speech was used (install the package's dependencies for the 3-7 s multilingual sources)")
    print(f"== workload: {workload.describe()}", flush=True)
    if opts.dry_run:
        return dry_run(opts, wl_path)

    columns: dict[str, dict[str, Any]] = {}
    for column in opts.columns:
        columns[column] = run_column(column, opts, wl_path, workload)

    runs = [s for c in columns.values() for s in c["runs"]]
    sweep = [s for c in columns.values() for s in c["sweep"]]
    plots = [plot_latency_cdf({k: v for c in columns.values() for k, v in c["latencies"].items()},
                              out_dir / "latency_cdf.png",
                              title=f"Latency CDF, {opts.users} concurrent users ({opts.name} config)")]
    if sweep:
        plots.append(plot_sweep(sweep, out_dir / "concurrency.png",
                                title=f"Throughput and p95 against concurrency ({opts.sweep_protocol}, {opts.name})"))
    setup.update({
        "config": opts.name, "model": f"{opts.model_dir} ({opts.demo_size} dims; random weights, real shapes)"
        if "demo" in Path(opts.model_dir).name else opts.model_dir,
        "workload": workload.describe(), "users": f"{opts.users} (all spawned at once; the first {opts.warmup} "
        "completions and the ramp-up left out)", "requests per column and protocol": opts.requests,
        "device": opts.device, "versions": ", ".join(f"{k} {v}" for k, v in _versions().items()),
        "plain column": f"client-side preprocessing + {', '.join(_plain_models())} one request each; repository "
        f"profile plain ({dict(PLAIN_TUNABLES)})",
        "integrated column": f"one request to cosyvoice_vc; dynamic batching; graph precision "
        f"{columns.get('integrated', {}).get('rendered', {}).get('graph_precision', 'n/a')}; tunables "
        f"{opts.integrated_tunables or 'the defaults'}",
        "duration": f"{time.time() - started:.0f} s",
    })
    notes = list(dict.fromkeys(opts.notes))
    notes += [
        "Locust runs on the same machine as the server and takes CPU time from it (the plain column's client-side "
        "preprocessing too); nv_cpu_utilization is Triton's whole-machine figure, so other processes count in it.",
        "Peak server memory: the largest sum of RSS over tritonserver and its Python stub processes, sampled every "
        "0.25 s over the measured window (shared pages count once per process).",
        "The cross-check compares Locust's successful conversions with the increase of the checked model's "
        "nv_inference_request_success between the snapshots taken when Locust's statistics were reset and after "
        "the last user finished.",
    ]
    for column, c in columns.items():
        if "calls_per_conversion" in c:
            notes.append(f"{column}: one conversion = " + ", ".join(
                f"{m} x{n:.0f}" for m, n in sorted(c["calls_per_conversion"].items())) + " (successful requests, BLS "
                "calls included)")
        if c.get("server"):
            s = c["server"]
            notes.append(f"{column}: server ready in {s['start_s']:.1f} s, RSS at start {s['idle_rss_mb']:.0f} MB, "
                         f"peak over the whole column {s['peak_rss_mb']:.0f} MB")
    report = {
        "config_name": opts.name, "setup": setup, "users": opts.users, "protocols": list(opts.protocols),
        "columns": list(opts.columns), "options": asdict(opts),
        "rendered": {k: v["rendered"] for k, v in columns.items()},
        "calls_per_conversion": {k: v.get("calls_per_conversion", {}) for k, v in columns.items()},
        "runs": [s.to_json() for s in runs], "sweep": [s.to_json() for s in sweep],
        "perf_analyzer": [p for c in columns.values() for p in c["perf"]],
        "composite_models": list(COMPOSITE), "plots": [str(p) for p in plots], "notes": notes,
    }
    if opts.profile:
        report["profile"] = run_profile(opts, report, workload)
    md, js = write_report(report, out_dir)
    print(render_markdown(report))
    print(f"wrote {md}, {js}, " + ", ".join(str(p) for p in plots), flush=True)
    return report


# -------------------------------------------------------------------------------------------- TTS column

#: The TTS column's pipelines: the public model each request calls (its success counter counts the requests) and
#: the model each streamed chunk calls exactly once (its success counter counts the chunks).
TTS_CHECKS = {"tts_stream": ("cosyvoice_tts_stream", "hift_decoder"), "tts": ("cosyvoice_tts", ""),
              "vc_stream": ("cosyvoice_vc_stream", "hift_decoder")}


def tts_requests(opts: Options, users: int) -> int:
    return max(opts.tts_requests, users)


def run_tts(opts: Options) -> dict[str, Any]:
    """The TTS column: one integrated server (TTS rendered) measured with Locust over gRPC, one pipeline after the
    other (streaming TTS, offline TTS, streaming VC), each at every ``tts_concurrency``; then perf_analyzer's
    streaming mode on ``cosyvoice_tts_stream`` at the same concurrencies. Writes report.md / report.json and
    ``first_chunk.png`` into ``opts.out_dir``."""
    from ..serving.launch.server import TritonServer
    from .plots import plot_first_chunk

    bad = [c for c in opts.tts_columns if c not in TTS_COLUMNS]
    if bad:
        raise ValueError(f"TTS columns must be among {TTS_COLUMNS}, got {bad}")
    out_dir = Path(opts.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    setup = {"machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))}
    from ..shapes import GRAPHS

    ensure_assets(opts, list(GRAPHS))
    if not (Path(opts.model_dir) / "llm.pt").is_file():
        raise FileNotFoundError(f"{opts.model_dir}/llm.pt not found: the TTS column needs the LM")
    wl_path = out_dir / "workload.npz"
    workload = cached_workload(wl_path, n_sources=opts.n_sources, seed=opts.seed, fixtures=FIXTURES)
    if opts.tts_texts and tuple(opts.tts_texts) != workload.texts:
        workload = replace(workload, texts=tuple(opts.tts_texts))
        workload.save(wl_path)  # what the Locust processes load
    print(f"== workload: {workload.describe()}; {len(workload.texts)} TTS texts", flush=True)
    work = out_dir / "tts"
    work.mkdir(parents=True, exist_ok=True)
    tunables = {"tts": "on", **opts.integrated_tunables}
    saved, opts.integrated_tunables = opts.integrated_tunables, tunables
    try:
        repo, rendered = render("integrated", opts, work / "model_repository")
    finally:
        opts.integrated_tunables = saved
    if opts.dry_run:
        plan = [f"{c} grpc: {u} users, {tts_requests(opts, u)} measured requests" for c in opts.tts_columns
                for u in opts.tts_concurrency]
        print("== dry run: would run\n" + "\n".join(plan), flush=True)
        return {"rendered": rendered, "runs": plan}
    print("== TTS column: starting tritonserver", flush=True)
    server = TritonServer(repo, work_dir=(work / "triton").resolve(), exit_timeout=10,
                          restricted_apis=("shared-memory", "model-repository", "trace", "logging"),
                          extra_args=opts.server_args)
    server.start(timeout=opts.startup_timeout_s)
    runs: list[RunSummary] = []
    perf: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    with server:
        print(f"   ready in {server.start_seconds:.1f} s (grpc {server.grpc_url})", flush=True)
        sampler = ServerSampler(server.process.pid, server.metrics_url, gpu=opts.device != "cpu").start()
        try:
            idle_rss = sample_tree(server.process.pid).rss_bytes / 2**20
            for column in opts.tts_columns:
                profiles[column] = warm_up(column, "grpc", server.grpc_url, server.http_url, server.metrics_url,
                                           workload, opts.model_dir, n=0)  # the profiled call warms up
                print(f"   {column}: calls per request {profiles[column]}", flush=True)
                model, chunk_model = TTS_CHECKS[column]
                for users in opts.tts_concurrency:
                    n = tts_requests(opts, users)
                    cfg = RunConfig(column=column, protocol="grpc", url=server.grpc_url, http_url=server.http_url,
                                    metrics_url=server.metrics_url, workload=str(wl_path),
                                    out=str(work / f"result_{column}_u{users}.json"), users=users, target_requests=n,
                                    warmup_requests=users if opts.warmup_requests < 0 else opts.warmup_requests,
                                    seed=opts.seed, check_model=model, calls_per_request=1,
                                    model_dir=str(opts.model_dir), chunk_model=chunk_model)
                    result = run_locust(cfg, work, opts.max_run_s)
                    t0, t1 = result.window
                    runs.append(summarize_run(result, server=server_figures(sampler, t0, t1)))
                    if not result.target_reached:
                        opts.notes.append(f"{column} x{users}: stopped at --max-run-s {opts.max_run_s:.0f} with "
                                          f"{len(result.records)} of {n} requests")
            if "grpc" in opts.perf_protocols:
                perf = run_perf_streaming(opts, server.grpc_url, workload, work)
            server_info = {"start_s": server.start_seconds, "idle_rss_mb": idle_rss,
                           "peak_rss_mb": sampler.peak_rss_mb()}
        finally:
            sampler.stop()
    plots = [plot_first_chunk(runs, out_dir / "first_chunk.png", perf=perf,
                              title=f"TTS column: first-chunk latency against concurrency ({opts.name})")]
    setup.update({
        "config": opts.name, "model": f"{opts.model_dir} ({opts.demo_size} dims; random weights, real shapes)"
        if "demo" in Path(opts.model_dir).name else opts.model_dir,
        "workload": f"{workload.describe()}; TTS: {len(workload.texts)} English sentences of "
        f"{min(len(t.split()) for t in workload.texts)}-{max(len(t.split()) for t in workload.texts)} words in "
        "turn, zero-shot in the prompt's voice",
        "protocol": "gRPC (streams: one gRPC stream per request)",
        "concurrency": ", ".join(str(u) for u in opts.tts_concurrency) + " users per pipeline, all spawned at once; "
        + ("the first <users> completions left out" if opts.warmup_requests < 0 else
           f"the first {opts.warmup_requests} completions left out") + "; before them, one request per pipeline "
        "alone (warm-up and the calls-per-request profile)",
        "requests per level": f"at least {opts.tts_requests}, 1 per user (users finish the request they are in)",
        "repository": f"local flavor, graph precision {rendered.get('graph_precision')}, tunables {tunables}",
        "versions": ", ".join(f"{k} {v}" for k, v in _versions().items()),
        "duration": f"{time.time() - started:.0f} s",
    })
    notes = list(dict.fromkeys(opts.notes))
    notes += [
        "The demo models have random weights: how much audio the LM produces for a text (between 2x and 20x its "
        "text tokens, until it samples end-of-speech) is whatever the random LM samples; audio seconds are measured.",
        "Locust and perf_analyzer run on the same machine as the server and take CPU time from it.",
        "Cross-check: each request's public model counts it once (nv_inference_request_success); each streamed "
        "chunk calls hift_decoder exactly once, so the chunks the clients received equal hift_decoder's increase "
        "(the offline cosyvoice_tts calls the stream model inside, so its chunks are not checked).",
        f"server ready in {server_info['start_s']:.1f} s, RSS at start {server_info['idle_rss_mb']:.0f} MB, "
        f"peak {server_info['peak_rss_mb']:.0f} MB",
    ] + [f"{c}: one request = " + ", ".join(f"{m} x{v:.0f}" for m, v in sorted(p.items())) + " (warm-up profile)"
         for c, p in profiles.items()]
    report = {"mode": "tts", "config_name": opts.name, "setup": setup, "options": asdict(opts),
              "rendered": {"tts": rendered}, "calls_per_request": profiles, "runs": [s.to_json() for s in runs],
              "perf_analyzer": perf, "plots": [str(p) for p in plots], "notes": notes}
    md, js = write_report(report, out_dir)
    print(render_markdown(report))
    print(f"wrote {md}, {js}, " + ", ".join(str(p) for p in plots), flush=True)
    return report


def run_perf_streaming(opts: Options, url: str, workload: Workload, work: Path) -> list[dict[str, Any]]:
    """perf_analyzer ``--streaming`` on ``cosyvoice_tts_stream`` at each TTS concurrency (gRPC): 3 windows of as
    many requests as Locust measures at that level."""
    from ..shapes import TTS_STREAM_MODEL
    from .perf import run_perf_analyzer, tts_input_data

    if "tts_stream" not in opts.tts_columns:
        return []
    data = tts_input_data(workload, work / "perf_analyzer_tts_input.json", seed=opts.seed)
    out = []
    for users in opts.tts_concurrency if opts.perf_concurrency is None else opts.perf_concurrency:
        print(f"   perf_analyzer --streaming {TTS_STREAM_MODEL} at concurrency {users}", flush=True)
        r = run_perf_analyzer(url, "grpc", users, data, work, model=TTS_STREAM_MODEL, streaming=True,
                              requests_per_window=tts_requests(opts, users),
                              timeout_s=max(300.0, opts.max_run_s))
        print(f"   -> first response p50 {r.get('first_p50_ms', 'n/a')} ms, {r.get('throughput', 'n/a')} req/s "
              f"{r.get('note', '')}", flush=True)
        out.append(r)
    return out


def run_profile(opts: Options, report: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """The profile of the integrated column's slowest graph (:mod:`.profile`), run with the servers stopped; a
    failure becomes ``{"error": ...}`` in the report rather than losing the columns' figures."""
    from .profile import profile_stage

    if "integrated" not in report.get("columns", []):
        return {"error": "no integrated column in this report"}
    if opts.device != "cpu":
        return {"error": f"device {opts.device}: the graphs are served by PyTorch, not from ONNX files on the CPU"}
    repo = Path(opts.out_dir) / "integrated" / "model_repository"
    try:
        return profile_stage(repo, report, source_s=float(np.mean(workload.source_seconds)),
                             prompt_s=workload.prompt_seconds, graph=opts.profile_graph or None)
    except Exception as exc:  # reported: the load test's figures stand
        log.warning("profile failed", exc_info=True)
        return {"error": f"{type(exc).__name__}: {exc}"}


def profile_only(opts: Options) -> dict[str, Any]:
    """``--profile-only``: the profile for an existing ``<out_dir>/report.json`` (its rendered integrated
    repository and workload); the report is rewritten with the new section, which is printed."""
    from .profile import profile_markdown

    out_dir = Path(opts.out_dir)
    path = out_dir / "report.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the load test first (make loadtest)")
    report = json.loads(path.read_text())
    opts.device = report.get("options", {}).get("device", opts.device)
    report["profile"] = run_profile(opts, report, load_workload(out_dir / "workload.npz"))
    md, js = write_report(report, out_dir)
    print("\n".join(profile_markdown(report["profile"])))
    print(f"wrote {md}, {js}", flush=True)
    return report


def _plain_models() -> tuple[str, ...]:
    try:
        from ..clients.plain import PLAIN_MODELS

        return PLAIN_MODELS
    except ImportError:
        return ()


# --------------------------------------------------------------------------------------------------- CLI


def _csv(kind, choices=None):
    def parse(text: str):
        items = tuple(kind(x) for x in text.split(",") if x.strip())
        if choices:
            bad = [x for x in items if x not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"{bad} not in {choices}")
        return items
    return parse


def parser() -> argparse.ArgumentParser:
    from ..serving.repository import TunableAction

    p = argparse.ArgumentParser(prog="loadtest/run.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny",
                   help="tiny: the small demo model (make loadtest); full: CosyVoice2-0.5B dims (make loadtest-full)")
    p.add_argument("--model-dir")
    p.add_argument("--onnx-dir")
    p.add_argument("--out-dir")
    p.add_argument("--columns", type=_csv(str, COLUMNS))
    p.add_argument("--protocols", type=_csv(str, PROTOCOLS))
    p.add_argument("--users", type=int)
    p.add_argument("--requests", type=int, help="measured requests per column and protocol")
    p.add_argument("--warmup-requests", type=int)
    p.add_argument("--sweep", type=_csv(int), help="concurrency levels (empty: no sweep)")
    p.add_argument("--sweep-protocol", choices=PROTOCOLS)
    p.add_argument("--sweep-requests", type=int)
    p.add_argument("--perf-protocols", type=_csv(str, PROTOCOLS), help="perf_analyzer on these (empty: none)")
    p.add_argument("--perf-requests", type=int)
    p.add_argument("--precision", help="integrated column: auto, fp32, int8_cpu, cpu-choice, GRAPH=PRECISION,...")
    p.add_argument("--quality-report")
    p.add_argument("--set", dest="integrated_tunables", action=TunableAction,
                   help="the integrated column's render tunables, NAME=VALUE (repeat --set, or --set A=1,B=2 or "
                        "--set A=1 B=2): instances=flow:2,flow_estimator:2")
    p.add_argument("--device", choices=("cpu", "cuda"))
    p.add_argument("--max-run-s", type=float, help="cap of each Locust run (a capped run is noted)")
    p.add_argument("--startup-timeout-s", type=float, help="how long a server may take to load its models")
    p.add_argument("--n-sources", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--dry-run", action="store_true", default=None,
                   help="prepare the model, render the repositories and print the runs; start no server")
    p.add_argument("--no-profile", dest="profile", action="store_false", default=None,
                   help="skip the profile of the integrated column's slowest graph after the columns")
    p.add_argument("--profile-only", action="store_true", default=None,
                   help="only profile, from an existing <out-dir>/report.json (rewrites report.md / report.json)")
    p.add_argument("--mode", choices=("vc", "tts", "mixed", "prompt-cache", "stress"), help="vc: plain vs integrated "
                   "voice conversion (default); tts: the TTS column: streaming TTS first-chunk latency and RTF, "
                   "offline TTS, streaming VC; mixed: a steady high-priority class under a low-priority flood (and "
                   "the reverse), without and with the sharing policy; prompt-cache: repeated speakers, the integrated "
                   "pipeline with the prompt caches on vs off (--speakers, --requests per mode, --users); stress: "
                   "innocent users beside hostile ones (vanishing clients, sequences without start or end, timeouts) "
                   "through the gateway: 0 failed innocent requests, memory growth bounded (exit 1 otherwise)")
    p.add_argument("--stress-seconds", type=float, help="--mode stress: how long the users run (default 600)")
    p.add_argument("--stress-users", type=int, help="--mode stress: innocent users (default 4)")
    p.add_argument("--stress-hostile-users", type=int, help="--mode stress: hostile users (default 8)")
    p.add_argument("--stress-max-growth", type=float, help="--mode stress: the largest memory growth of Triton and of "
                   "the gateway from the first window to the last, a fraction (default 0.10)")
    from .stress import HOSTILE_ACTS, INNOCENT_KINDS

    p.add_argument("--stress-acts", type=_csv(str, HOSTILE_ACTS), help="--mode stress: the hostile acts drawn "
                   f"(default all: {','.join(HOSTILE_ACTS)})")
    p.add_argument("--stress-kinds", type=_csv(str, INNOCENT_KINDS), help="--mode stress: the innocent requests "
                   f"taken in turn (default all: {','.join(INNOCENT_KINDS)})")
    p.add_argument("--speakers", type=int, help="--mode prompt-cache: distinct prompt recordings the requests draw "
                   "from (default 4)")
    p.add_argument("--mixed-high-users", type=int, help="--mode mixed: users of the steady high-priority class")
    p.add_argument("--mixed-low-users", type=int, help="--mode mixed: users of the low-priority flood")
    p.add_argument("--mixed-requests", type=int, help="--mode mixed: measured requests of each run")
    p.add_argument("--mixed-policies", type=_csv(lambda x: x.strip().lower() in ("1", "true", "with", "on")),
                   help="--mode mixed: servers to run: without,with (default both)")
    p.add_argument("--tts-columns", type=_csv(str, TTS_COLUMNS),
                   help=f"--mode tts: pipelines ({','.join(TTS_COLUMNS)})")
    p.add_argument("--tts-concurrency", type=_csv(int), help="--mode tts: concurrency levels (default 1,2,4)")
    p.add_argument("--tts-requests", type=int, help="--mode tts: measured requests per pipeline and level (at "
                   "least 1 per user)")
    p.add_argument("--tts-text", dest="tts_texts", action="append", help="--mode tts: a text the TTS pipelines "
                   "speak in turn (repeatable; default: six English sentences of 7-15 words)")
    p.add_argument("--server-arg", dest="server_args", action="append", help="--mode tts / mixed: a tritonserver "
                   "flag (repeatable), e.g. --server-arg=--backend-config=python,stub-timeout-seconds=300")
    p.add_argument("--perf-concurrency", type=_csv(int), help="--mode tts: perf_analyzer's concurrency levels "
                   "(default: --tts-concurrency)")
    p.add_argument("--profile-graph", help="the graph to profile (default: the slowest of flow_estimator, "
                   "hift_decoder, flow_encoder in the integrated column)")
    return p


def options_from_args(args: argparse.Namespace) -> Options:
    base = CONFIGS[args.config]
    overrides = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    if "integrated_tunables" in overrides:
        overrides["integrated_tunables"] = dict(overrides["integrated_tunables"])
    for key in ("tts_texts", "server_args"):
        if key in overrides:
            overrides[key] = tuple(overrides[key])
    opts = Options(**{**asdict(base), **overrides})
    opts.notes = []
    if opts.mode in ("tts", "mixed", "prompt-cache", "stress") and "out_dir" not in overrides:
        opts.out_dir = f"{base.out_dir}-{opts.mode}"
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    opts = options_from_args(args)
    report = run(opts)
    return 1 if report.get("verdict", {}).get("passed") is False else 0


if __name__ == "__main__":
    sys.exit(main())

