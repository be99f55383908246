"""The mixed load (``loadtest/run.py --mode mixed``, ``make loadtest-mixed``): two tasks sharing one server.

A steady high-priority class (by default 1 user streaming TTS back to back) runs alone, then the low-priority flood
(by default 6 users converting through ``cosyvoice_vc``) alone, then both at once; and the reverse (a steady VC
user against a flood of TTS streams). Each class is one Locust subprocess of the same locustfile (its own
:class:`~.recording.RunConfig`, its own cross-check against its public model's success counter). In the mixed run
the flood starts first and runs until the steady class has its measured requests; it is then stopped with SIGTERM,
and its users finish the request they are in, so every low-priority request that started is answered and counted.

This is run on servers in turn: ``without`` (the integrated repository as it is; both scenarios) and, per scenario,
``with`` the deployment policy for that scenario's high class (:func:`policy`: priority levels, the TTS task's own
copies of the shared stages, the rate limiter's quota of one leaf execution at a time on the low class, the low
class's processes at a higher niceness).

Figures per class: latency percentiles (first chunk for streams) alone and mixed, the ratio of the mixed p95 to the
alone p95 (target for the high class: <= 1.5), the longest wait of any low-priority request (its end-to-end
latency: bounded = no starvation), every low request answered; machine: requests completed and audio seconds produced
per second by both classes together, mean CPU (``nv_cpu_utilization``, the whole machine) and the server
processes' CPU (psutil, fraction of all cores).
"""

from __future__ import annotations

import functools
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .recording import ENV_VAR, RunConfig, RunResult
from .report import RunSummary, _fmt, finish_markdown, summarize_run

__all__ = ["POLICY", "SCENARIOS", "mixed_markdown", "run_mixed"]

#: (name, high class, low class): the columns of :mod:`.callers`.
SCENARIOS = (("TTS streams over a VC flood", "tts_stream", "integrated"),
             ("VC over a flood of TTS streams", "integrated", "tts_stream"))
#: The public model whose success counter counts each class's requests, and the model each chunk calls once.
CHECK = {"tts_stream": ("cosyvoice_tts_stream", "hift_decoder"), "integrated": ("cosyvoice_vc", ""),
         "vc_stream": ("cosyvoice_vc_stream", "hift_decoder"), "tts": ("cosyvoice_tts", "")}
#: Request priorities (Triton: 1 is the highest level).
HIGH, LOW = 1, 2


def policy(high: str) -> dict[str, Any]:
    """The deployment policy of a ``with`` server whose high class is column ``high`` (render tunables of
    :class:`cosyvoice_triton.serving.repository.Tunables`): two priority levels (the high task's models level 1),
    the TTS task's own copies of the graphs, flow and hift (``task_isolation``: BLS calls carry no priority in
    Triton 2.51, so a shared stage would serve both tasks in arrival order), and the low task's leaf models (its
    graphs; for VC also preprocess / postprocess) under the rate limiter with one unit of ``task_quota``: the low
    task runs one leaf execution at a time (onnxruntime: 1 thread), the other core is the high task's; and the low
    task's processes at niceness 10 (``task_nice``), so the kernel prefers the high task's when both want a core
    (the LM loop of TTS and the time outside ``execute`` are not the rate limiter's)."""
    return {"priority_levels": 2, "high_task": "tts" if high.startswith("tts") else "vc", "task_isolation": True,
            "task_quota": 1, "task_nice": 10}


#: The policy with TTS as the high class (the first scenario's).
POLICY: dict[str, Any] = policy("tts_stream")
#: tritonserver flags of the ``with`` servers (the quota of 1 unit needs no --rate-limit-resource).
POLICY_SERVER_ARGS: tuple[str, ...] = ("--rate-limit=execution_count",)


def _start_locust(cfg: RunConfig, work: Path, max_run_s: float) -> tuple[subprocess.Popen, Path]:
    from .setup import locust_command, locust_env

    tag = Path(cfg.out).stem
    cfg_path = cfg.save(work / f"{tag}.config.json")
    Path(cfg.out).unlink(missing_ok=True)
    log = work / f"locust_{tag}.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen(locust_command(cfg_path, cfg.users, work / f"locust_{tag}", max_run_s), stdout=logf,
                                stderr=subprocess.STDOUT, env=locust_env(**{ENV_VAR: str(cfg_path)}))
    return proc, log


def _finish(proc: subprocess.Popen, cfg: RunConfig, log: Path, timeout: float, grace: float = 30.0) -> RunResult:
    """Wait for the flood's Locust to write its result and exit; a process still alive ``grace`` seconds after its
    result is written is killed (a TTS-stream flood's Locust hung on exit after SIGTERM, its result saved)."""
    deadline, written = time.monotonic() + timeout, None
    while proc.poll() is None and time.monotonic() < deadline:
        if written is None and Path(cfg.out).is_file():
            written = time.monotonic()
        if written is not None and time.monotonic() - written > grace:
            break
        time.sleep(0.5)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if not Path(cfg.out).is_file():
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"Locust run {cfg.out} wrote no result (exit code {proc.returncode}):\n" + "\n".join(tail))
    return RunResult.load(cfg.out)


def _config(column: str, users: int, requests: int, out: Path, urls: dict[str, str], workload: str,
            opts, warmup: int | None = None, alone: bool = True, isolated: bool = False) -> RunConfig:
    model, chunk_model = CHECK[column]
    if isolated and column.startswith("tts") and chunk_model:  # TTS calls its own copy (task_isolation)
        chunk_model += "_tts"
    if not alone:  # the other class calls hift_decoder too: chunks are checked only when a class runs alone
        chunk_model = ""
    return RunConfig(column=column, protocol="grpc", url=urls["grpc"], http_url=urls["http"],
                     metrics_url=urls["metrics"], workload=workload, out=str(out), users=users,
                     target_requests=requests, warmup_requests=users if warmup is None else warmup,
                     seed=opts.seed, check_model=model, calls_per_request=1, model_dir=str(opts.model_dir),
                     chunk_model=chunk_model)


def _flood_count(metrics_url: str, model: str) -> float:
    from .metrics import scrape

    return sum(x.value for x in scrape(metrics_url)
               if x.name == "nv_inference_request_success" and x.labels.get("model") == model)


def _wait_for_flood(metrics_url: str, model: str, proc: subprocess.Popen, *, timeout: float, n: int = 1,
                    start: float | None = None) -> None:
    """Until the flood has finished ``n`` requests since ``start`` (its public model's success counter; default:
    from now). Before the steady class: ``n`` = its users, whose first requests the flood's measuring waits for,
    so the steady class's window starts with the flood measured; after it: the flood's users again, so every class
    has measured requests even when the steady class is much quicker than one flood request."""
    start = _flood_count(metrics_url, model) if start is None else start
    deadline = time.monotonic() + timeout
    while _flood_count(metrics_url, model) < start + n:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the flood ({model}) finished fewer than {n} requests (Locust exit code "
                               f"{proc.poll()})")
        time.sleep(0.5)


def _class_figures(s: RunSummary, result: RunResult) -> dict[str, Any]:
    ok = [r for r in result.records if r.ok]
    return {**s.to_json(), "longest_s": max((r.latency_s for r in ok), default=math.nan),
            "answered": len(ok), "started": len(result.records)}


def run_scenarios(opts, server, sampler, work: Path, workload_path: Path, *, priorities: bool,
                  out: list[dict] | None = None, done: Callable[[], None] = lambda: None,
                  scenarios=SCENARIOS) -> list[dict]:
    """The scenarios on one running server: high alone, low alone, both at once. A scenario that fails (the
    server died, a run wrote nothing) is kept as ``{"error": ...}`` and the next one is tried; ``done()`` is called
    after each scenario has been appended to ``out``."""
    out = [] if out is None else out
    for name, high, low in scenarios:
        try:
            res = _scenario(opts, server, sampler, work, workload_path, name, high, low, priorities)
        except Exception as exc:  # reported: the scenarios that ran stand
            res = {"scenario": name, "high": high, "low": low, "priorities": priorities,
                   "error": f"{type(exc).__name__}: {str(exc)[-600:]}"}
            print(f"   {name}: FAILED {res['error']}", flush=True)
        out.append(res)
        done()
    return out


def _scenario(opts, server, sampler, work: Path, workload_path: Path, name: str, high: str, low: str,
              priorities: bool) -> dict:
    from .setup import run_locust, server_figures

    urls = {"grpc": server.grpc_url, "http": server.http_url, "metrics": server.metrics_url}
    tag = f"{high}_over_{low}"
    hu, lu = opts.mixed_high_users, opts.mixed_low_users
    n_high, n_low = opts.mixed_requests, max(opts.mixed_requests, lu)
    print(f"== {name} ({'with' if priorities else 'without'} priorities)", flush=True)
    res: dict[str, Any] = {"scenario": name, "high": high, "low": low, "priorities": priorities}
    for key, column, users, n in (("high_alone", high, hu, n_high), ("low_alone", low, lu, n_low)):
        cfg = _config(column, users, n, work / f"{tag}_{key}.json", urls, str(workload_path), opts,
                      isolated=priorities)
        r = run_locust(cfg, work, opts.max_run_s, tag=f"{tag}_{key}")
        t0, t1 = r.window
        res[key] = _class_figures(summarize_run(r, server=server_figures(sampler, t0, t1)), r)
    # both at once: the flood first (it runs until stopped; nothing left out, so its warm-up gate never pauses
    # it), then the steady class's measured run
    lcfg = _config(low, lu, 10**9, work / f"{tag}_low_mixed.json", urls, str(workload_path), opts, warmup=0,
                   alone=False)
    proc, log = _start_locust(lcfg, work, opts.max_run_s)
    try:
        _wait_for_flood(urls["metrics"], lcfg.check_model, proc, timeout=opts.max_run_s, n=lu)
        time.sleep(2.0)  # the flood's measuring starts once its statistics have settled
        hcfg = _config(high, hu, n_high, work / f"{tag}_high_mixed.json", urls, str(workload_path), opts,
                       alone=False)
        flood_at_start = _flood_count(urls["metrics"], lcfg.check_model)
        hr = run_locust(hcfg, work, opts.max_run_s, tag=f"{tag}_high_mixed")
        _wait_for_flood(urls["metrics"], lcfg.check_model, proc, timeout=opts.max_run_s, n=lu,
                        start=flood_at_start)
    finally:
        proc.send_signal(signal.SIGTERM)  # users finish the request they are in (--stop-timeout)
    lr = _finish(proc, lcfg, log, timeout=opts.max_run_s + 900)
    print(f"   flood: {len(lr.records)} measured requests ({sum(not r.ok for r in lr.records)} failed)", flush=True)
    t0, t1 = min(hr.window[0], lr.window[0]), max(hr.window[1], lr.window[1])
    machine = server_figures(sampler, t0, t1)
    res["high_mixed"] = _class_figures(summarize_run(hr, server=server_figures(sampler, *hr.window)), hr)
    res["low_mixed"] = _class_figures(summarize_run(lr, server=server_figures(sampler, *lr.window)), lr)
    audio = sum(r.audio_s for x in (hr, lr) for r in x.records if r.ok)
    done_n = sum(r.ok for x in (hr, lr) for r in x.records)
    span = t1 - t0 if t1 > t0 else math.nan
    res["machine"] = {**machine, "window_s": t1 - t0, "audio_s_per_s": audio / span,
                      "requests_per_s": sum(len(x.records) for x in (hr, lr)) / span,
                      "completed_per_s": done_n / span, "load_avg": os.getloadavg()}
    return res


def _p95(c: dict[str, Any]) -> float:
    """The class's headline latency: first-chunk p95 for streams, end-to-end p95 otherwise."""
    v = c.get("first_p95_ms")
    return c["p95_ms"] if v is None or (isinstance(v, float) and math.isnan(v)) else v


def targets(res: dict[str, Any]) -> dict[str, Any]:
    ratio = _p95(res["high_mixed"]) / _p95(res["high_alone"]) if _p95(res["high_alone"]) else math.nan
    low = res["low_mixed"]
    answered = low["failures"] == 0 and 0 < low.get("answered", 1) == low.get("started", low.get("answered", 1))
    return {"high_p95_ratio": ratio, "high_met": bool(ratio <= 1.5), "low_all_answered": answered,
            "low_longest_s": low["longest_s"]}


def mixed_markdown(report: dict[str, Any]) -> str:
    out = [f"# Load test: mixed load, two tasks on one server ({report.get('config_name', '')})", ""]
    setup = report.get("setup", {})
    if setup:
        out += ["## Set-up", ""] + [f"- {k}: {v}" for k, v in setup.items()] + [""]
    out += ["## Per class: alone and mixed", "",
            "| scenario | priorities | class | users | alone p50 / p95 ms | mixed p50 / p95 ms | p95 mixed / alone | "
            "answered (failed) | longest wait s |", "|---|---|---|---:|---|---|---:|---|---:|"]
    for res in _ok(report):
        for cls in ("high", "low"):
            a, m = res[f"{cls}_alone"], res[f"{cls}_mixed"]
            first = "first chunk " if not math.isnan(_num(a.get("first_p95_ms"))) else ""

            def pair(c, first=first):
                key = "first_" if first else ""
                return f"{_fmt(_num(c[f'{key}p50_ms']))} / {_fmt(_num(c[f'{key}p95_ms']))}"

            ratio = _p95(m) / _p95(a) if _p95(a) else math.nan
            out.append(f"| {res['scenario']} | {'on' if res['priorities'] else 'off'} | {cls}: {first}"
                       f"{res[cls]} | {a['users']} | {pair(a)} | {pair(m)} | {_fmt(ratio, 2)} | "
                       f"{m['answered']} ({m['failures']}) | {_fmt(_num(m['longest_s']), 1)} |")
    out += ["", "## Machine during the mixed runs", "",
            "| scenario | priorities | window s | audio s / s (both classes) | completed requests / s | "
            "CPU, whole machine (nv_cpu_utilization) | server processes' CPU (of all cores) | load average (1 min) | "
            "high p95 within 1.5x | every low answered | longest low wait s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for res in _ok(report):
        m, t = res["machine"], targets(res)
        done = m.get("completed_per_s", m["requests_per_s"])
        load = m.get("load_avg")
        out.append(f"| {res['scenario']} | {'on' if res['priorities'] else 'off'} | {_fmt(m['window_s'])} | "
                   f"{_fmt(_num(m['audio_s_per_s']), 2)} | {_fmt(_num(done), 3)} | "
                   f"{_fmt(_num(m['cpu_triton']) * 100, 0, '%')} | {_fmt(_num(m['cpu_server']) * 100, 0, '%')} | "
                   f"{_fmt(_num(load[0]), 1) if load else '-'} | "
                   f"{'met' if t['high_met'] else 'missed'} (x{_fmt(t['high_p95_ratio'], 2)}) | "
                   f"{'yes' if t['low_all_answered'] else 'NO'} | {_fmt(_num(t['low_longest_s']), 1)} |")
    out.append("")
    failed = [r for r in report.get("scenarios", []) if "error" in r]
    if failed:
        out += ["## Scenarios that did not complete", ""] + [
            f"- {r['scenario']} ({'with' if r['priorities'] else 'without'} the policy): {r['error']}" for r in failed]
        out.append("")
    return finish_markdown(out, report)


def _ok(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in report.get("scenarios", []) if "error" not in r]


def _num(v: Any) -> float:
    return math.nan if v is None else float(v)


def plot_mixed(report: dict[str, Any], path: Path) -> Path:
    """Per scenario: each class's p95 (first chunk for streams) alone and mixed, with and without the policy; below,
    the machine during the mixed run: audio s / s, completed requests / s, server CPU and the longest low wait."""
    from .plots import _pyplot, _save

    plt = _pyplot()
    scen = _ok(report)
    names = list(dict.fromkeys(r["scenario"] for r in scen))
    fig, axes = plt.subplots(2, max(1, len(names)), figsize=(6 * max(1, len(names)), 8.4), squeeze=False)
    for ax, name in zip(axes[1], names, strict=False):
        rows = [r for r in scen if r["scenario"] == name]
        keys = (("audio_s_per_s", "audio s / s"), ("completed_per_s", "completed req / s"),
                ("cpu_server", "server CPU (of all cores)"), ("longest", "longest low wait (s / 10)"))
        for k, r in enumerate(rows):
            m = r["machine"]
            vals = [_num(m.get("audio_s_per_s")), _num(m.get("completed_per_s", m.get("requests_per_s"))),
                    _num(m.get("cpu_server")), _num(r["low_mixed"]["longest_s"]) / 10]
            ax.bar([i + 0.4 * k for i in range(len(keys))], vals, width=0.4, color="C2" if r["priorities"] else "C3",
                   label=f"policy {'on' if r['priorities'] else 'off'}")
        ax.set_xticks([i + 0.2 for i in range(len(keys))], [label for _, label in keys], fontsize=7)
        ax.set_title(f"{name}: machine during the mixed run", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    for ax, name in zip(axes[0], names, strict=False):
        rows = [r for r in scen if r["scenario"] == name]
        labels, vals, colors = [], [], []
        for r in rows:
            for cls, color in (("high", "C0"), ("low", "C1")):
                for when in ("alone", "mixed"):
                    if when == "alone" and r["priorities"]:
                        continue  # alone is alone: shown once
                    labels.append(f"{cls} {when}" + ("" if when == "alone" else
                                                     f"\n(prio {'on' if r['priorities'] else 'off'})"))
                    vals.append(_p95(r[f"{cls}_{when}"]) / 1000.0)
                    colors.append(color if when == "alone" else ("C2" if r["priorities"] else "C3"))
        ax.bar(range(len(vals)), vals, color=colors)
        ax.set_xticks(range(len(vals)), labels, fontsize=7)
        ax.set_ylabel("p95 latency (s; first chunk for streams)")
        ax.set_title(name, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Mixed load: each class's p95 alone and under the other class's flood")
    return _save(plt, fig, path)


def _partial(out_dir: Path, scenarios: list[dict]) -> None:
    """The scenarios so far in ``partial.json`` (a crash later loses nothing measured)."""
    import json

    from .report import _jsonable

    (out_dir / "partial.json").write_text(json.dumps(_jsonable(scenarios), indent=1) + "\n")


def run_mixed(opts) -> dict[str, Any]:
    """Both servers (without, then with the policy), every scenario on each; report.md / report.json / mixed.png."""
    from ..serving.launch.server import TritonServer
    from ..shapes import GRAPHS
    from .report import write_report
    from .sampler import ServerSampler
    from .setup import FIXTURES, _versions, ensure_assets, machine, render
    from .workload import cached_workload

    out_dir = Path(opts.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    setup = {"machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))}
    ensure_assets(opts, list(GRAPHS))
    wl_path = out_dir / "workload.npz"
    workload = cached_workload(wl_path, n_sources=opts.n_sources, seed=opts.seed, fixtures=FIXTURES)
    scenarios: list[dict[str, Any]] = []
    rendered = {}
    # one server without the policy for every scenario; with it, one per scenario (the policy names the high class)
    servers = [(p, sc) for p in opts.mixed_policies for sc in ((SCENARIOS,) if not p else ((x,) for x in SCENARIOS))]
    policies: dict[str, dict[str, Any]] = {}
    for priorities, these in servers:
        label = f"with-{these[0][1]}" if priorities else "without"
        work = out_dir / "without" if not priorities else out_dir / "with" / these[0][1]
        work.mkdir(parents=True, exist_ok=True)
        chosen = policy(these[0][1]) if priorities else {}
        if priorities:
            policies[these[0][1]] = chosen
        tunables = {"tts": "on", **opts.integrated_tunables, **chosen}
        saved, opts.integrated_tunables = opts.integrated_tunables, tunables
        try:
            repo, rendered[label] = render("integrated", opts, work / "model_repository")
        finally:
            opts.integrated_tunables = saved
        print(f"== mixed load, {label} the policy: starting tritonserver", flush=True)
        server = TritonServer(repo, work_dir=(work / "triton").resolve(), exit_timeout=10,
                              restricted_apis=("shared-memory", "model-repository", "trace", "logging"),
                              extra_args=(*(POLICY_SERVER_ARGS if priorities else ()), *opts.server_args))
        try:
            server.start(timeout=opts.startup_timeout_s)
        except Exception as exc:
            scenarios += [{"scenario": n, "high": h, "low": lo, "priorities": priorities,
                           "error": f"server did not start: {type(exc).__name__}: {str(exc)[-400:]}"}
                          for n, h, lo in these]
            continue
        with server:
            sampler = ServerSampler(server.process.pid, server.metrics_url).start()
            try:
                from .setup import warm_up

                for column in ("tts_stream", "integrated"):
                    warm_up(column, "grpc", server.grpc_url, server.http_url, server.metrics_url, workload,
                            opts.model_dir, n=0)
                run_scenarios(opts, server, sampler, work, wl_path, priorities=priorities, out=scenarios,
                              done=functools.partial(_partial, out_dir, scenarios), scenarios=these)
            finally:
                sampler.stop()
    report = {"mode": "mixed", "config_name": opts.name, "setup": setup, "options": asdict(opts),
              "rendered": rendered, "scenarios": scenarios, "policy": policies,
              "policy_server_args": list(POLICY_SERVER_ARGS), "notes": list(dict.fromkeys(opts.notes))}
    report["plots"] = [str(plot_mixed(report, out_dir / "mixed.png"))]
    setup.update({"config": opts.name, "model": opts.model_dir, "workload": workload.describe(),
                  "high class users": opts.mixed_high_users, "low class (flood) users": opts.mixed_low_users,
                  "measured requests of the high class": opts.mixed_requests,
                  "versions": ", ".join(f"{k} {v}" for k, v in _versions().items()),
                  "duration": f"{time.time() - started:.0f} s"})
    text = mixed_markdown(report)
    md, js = write_report(report, out_dir, markdown=text)
    print(text)
    print(f"wrote {md}, {js}, {report['plots'][0]}", flush=True)
    return report
