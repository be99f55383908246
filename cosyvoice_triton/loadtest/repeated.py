"""The repeated-speaker load test (``loadtest/run.py --mode prompt-cache --speakers K``, ``make
loadtest-prompt-cache``): the integrated pipeline with the prompt caches on against off, in one run.

Many requests share a target speaker. Each request converts a source into the voice of one of ``K`` distinct prompt
recordings, drawn at random (seeded), so after the first request of each speaker most requests repeat a prompt.
Every source is made unique per request (the workload's sources rotated and scaled by a per-request gain), so a hit
can only come from the prompt: a repeated source would hit Triton's response cache too and overstate the gain.

Two servers of the same repository render run side by side: ``on`` (``preprocess``'s prompt cache, on by default,
and Triton's response cache on ``speech_tokenizer`` / ``speaker_encoder``, opt-in: ``response_cache_mb=64``) and
``off`` (``prompt_cache_entries=0``, ``response_cache_mb=0``, ``graph_cache_mb=0``). Both get the same requests in
the same order, in four phases ``on, off, off, on`` (half of the requests each time), ``users`` requests in flight
(closed loop, HTTP), so load from elsewhere on the machine falls on both alike. Before the phases each server
converts two sources in the voice of a prompt that is not among the ``K`` (warm-up: the first requests load and warm
the models), so the measured window starts with every speaker unseen and includes the ``K`` misses.

Figures per mode: latency mean / p50 / p95, throughput (requests over the phases' wall time), and from Triton's
statistics API over the phases: inferences of ``speech_tokenizer`` and ``speaker_encoder`` per request, their
response-cache hits and misses (hit rate: ``speaker_encoder`` cache hits per request; each request sends it
exactly one, its prompt's; two requests of a new speaker in flight together both run CAM++, and Triton then counts
one miss: the second insert of the key is dropped), and
``preprocess``'s compute time per request. Each request's waveform is compared between the two servers (same
request, same seed): bit-identical expected.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..shapes import VC_MODEL
from .report import latency_summary

__all__ = ["MODES", "counts", "make_prompts", "plan_requests", "render_markdown", "run_prompt_cache"]

#: Render tunables of each server besides the integrated column's.
#: ``on`` turns Triton's response cache on, which answers a repeated prompt before the graph model (and its default
#: ``graph_cache_mb``) sees it, so Triton's statistics count the skipped graph runs; ``off`` turns every cache off.
MODES: dict[str, dict[str, Any]] = {"on": {"response_cache_mb": 64},
                                    "off": {"prompt_cache_entries": 0, "response_cache_mb": 0, "graph_cache_mb": 0}}
#: The models whose statistics the report reads.
COUNTED = ("speech_tokenizer", "speaker_encoder", "preprocess", VC_MODEL)


def make_prompts(
    k: int, *, seconds: float = 3.0, seed: int = 0, fixtures: Path | None = None
) -> list[tuple[np.ndarray, int]]:
    """``k`` distinct prompt recordings of ``seconds``: espeak-ng utterances in several voices, or without
    espeak-ng, cuts of the test fixtures' speech at different offsets."""
    from ..export.speech_corpus import espeak_available, utterances

    if espeak_available() or fixtures is None:
        found = utterances(k, split="heldout", seed=seed + 101, min_seconds=seconds, max_seconds=15.0)
        return [(u.wave[: round(seconds * u.sample_rate)].astype(np.float32), int(u.sample_rate)) for u in found]
    import soundfile as sf

    out = []
    for name in ("speech_engb_16k.wav", "source_en_5s.wav"):  # not prompt_en_3s.wav: the warm-up's prompt
        wave, sr = sf.read(Path(fixtures) / name, dtype="float32")
        n = round(min(seconds, len(wave) / sr) * sr)
        for off in range(0, max(1, len(wave) - n + 1), max(1, sr // 4)):
            out.append((wave[off : off + n], int(sr)))
    if len(out) < k:
        raise ValueError(f"the fixtures give {len(out)} distinct prompts, asked for {k}")
    return out[:k]


@dataclass(frozen=True)
class Request:
    index: int
    source: np.ndarray
    source_sr: int
    prompt: int  # index into the prompts


def plan_requests(n: int, speakers: int, sources: list[np.ndarray], rates: list[int], seed: int = 0) -> list[Request]:
    """``n`` requests: source ``i`` rotated by a per-request offset and scaled by ``1 - (i + 1) * 2**-16`` (a unique
    waveform per request), prompt drawn uniformly from ``speakers`` (seeded)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        src = sources[i % len(sources)]
        shifted = np.roll(src, (i // len(sources)) * 797)
        gain = np.float32(1.0 - (i + 1) * 2.0**-16)
        out.append(
            Request(i, (shifted * gain).astype(np.float32), int(rates[i % len(sources)]), int(rng.integers(speakers)))
        )
    return out


def counts(stats: dict) -> dict[str, dict[str, int]]:
    """Per counted model: inferences, executions, response-cache hits / misses, success count, compute ns."""
    out = {}
    for entry in stats.get("model_stats", []):
        name = entry["name"]
        if name not in COUNTED:
            continue
        st = entry["inference_stats"]
        row = out.setdefault(
            name, {"inferences": 0, "executions": 0, "cache_hits": 0, "cache_misses": 0, "success": 0, "compute_ns": 0}
        )
        row["inferences"] += int(entry.get("inference_count", 0))
        row["executions"] += int(entry.get("execution_count", 0))
        row["cache_hits"] += int(st.get("cache_hit", {}).get("count", 0))
        row["cache_misses"] += int(st.get("cache_miss", {}).get("count", 0))
        row["success"] += int(st["success"]["count"])
        row["compute_ns"] += sum(int(st[k]["ns"]) for k in ("compute_input", "compute_infer", "compute_output"))
    return out


def _diff(before: dict, after: dict) -> dict[str, dict[str, int]]:
    return {m: {k: after[m][k] - before.get(m, {}).get(k, 0) for k in after[m]} for m in after}


def _add(total: dict, delta: dict) -> None:
    for m, row in delta.items():
        acc = total.setdefault(m, {k: 0 for k in row})
        for k, v in row.items():
            acc[k] += v


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except OSError:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _phase(
    url: str, requests: list[Request], prompts: list[tuple[np.ndarray, int]], users: int, seed: int, timeout: float
) -> tuple[list[dict[str, Any]], float]:
    """The requests through ``users`` threads, each with its own client (no retries); (records, wall seconds)."""
    from ..clients.client import CosyVoiceClient
    from .callers import _no_retry

    todo: queue.Queue[Request] = queue.Queue()
    for r in requests:
        todo.put(r)
    records: list[dict[str, Any]] = []
    lock = threading.Lock()

    def user() -> None:
        with CosyVoiceClient(url, timeout=timeout, concurrency=1, **_no_retry()) as client:
            while True:
                try:
                    r = todo.get_nowait()
                except queue.Empty:
                    return
                wave, sr = prompts[r.prompt]
                t0 = time.perf_counter()
                try:
                    res = client.convert(r.source, wave, source_sr=r.source_sr, prompt_sr=sr, seed=seed)
                    rec = {
                        "index": r.index,
                        "latency_s": time.perf_counter() - t0,
                        "ok": True,
                        "waveform": res.waveform,
                    }
                except Exception as exc:  # counted: a load test reports failures, it does not stop on them
                    rec = {
                        "index": r.index,
                        "latency_s": time.perf_counter() - t0,
                        "ok": False,
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                    }
                with lock:
                    records.append(rec)

    threads = [threading.Thread(target=user, name=f"user{i}") for i in range(max(1, users))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def run_prompt_cache(opts) -> dict[str, Any]:
    """Run the comparison of :mod:`this module <.repeated>` for the runner's ``Options`` (``users``, ``requests``:
    per mode, ``speakers``, ``model_dir`` / ``onnx_dir``, ``integrated_tunables``, ``server_args``, ``seed``); write
    ``report.md`` / ``report.json`` into ``opts.out_dir`` and return the report."""
    from ..serving.launch.server import TritonServer
    from .metrics import fetch_statistics
    from .setup import FIXTURES, ensure_assets, machine, render
    from .workload import cached_workload

    k = int(opts.speakers)
    if k < 1 or opts.requests < 2:
        raise ValueError(f"--mode prompt-cache needs --speakers >= 1 and --requests >= 2, got {k}, {opts.requests}")
    out_dir = Path(opts.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from ..shapes import GRAPHS

    ensure_assets(opts, list(GRAPHS))
    fixtures = FIXTURES
    workload = cached_workload(out_dir / "workload.npz", n_sources=opts.n_sources, seed=opts.seed, fixtures=fixtures)
    prompts = make_prompts(k, seed=opts.seed, fixtures=fixtures)
    requests = plan_requests(opts.requests, k, list(workload.sources), list(workload.source_rates), seed=opts.seed)
    half = len(requests) // 2
    phases = [("on", requests[:half]), ("off", requests[:half]), ("off", requests[half:]), ("on", requests[half:])]
    setup = {
        "machine": machine(),
        "uptime at start": _uptime(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "workload": f"{len(requests)} requests per mode, {k} speakers (prompts of "
        f"{np.mean([len(w) / r for w, r in prompts]):.1f} s drawn uniformly, seed {opts.seed}); "
        f"sources: {workload.describe()}, each request's made unique",
        "users": f"{opts.users} requests in flight (HTTP), phases on, off, off, on",
    }
    if opts.dry_run:
        plan = [f"{m}: {len(rs)} requests at {opts.users} users" for m, rs in phases]
        print("== dry run: would run\n" + "\n".join(plan), flush=True)
        return {"setup": setup, "runs": plan}
    base = dict(opts.integrated_tunables)
    results: dict[str, Any] = {m: {"records": [], "wall_s": 0.0, "stats": {}} for m in MODES}
    rendered = {}
    with contextlib.ExitStack() as stack:
        servers = {}
        for mode, extra in MODES.items():
            saved = opts.integrated_tunables
            opts.integrated_tunables = {**base, "tts": "off", **extra}
            try:
                repo, rendered[mode] = render("integrated", opts, out_dir / mode / "model_repository")
            finally:
                opts.integrated_tunables = saved
            server = TritonServer(
                repo,
                work_dir=(out_dir / mode / "triton").resolve(),
                exit_timeout=10,
                extra_args=tuple(opts.server_args),
            )
            print(f"== {mode}: starting tritonserver", flush=True)
            server.start(timeout=opts.startup_timeout_s)
            stack.callback(server.stop)
            servers[mode] = server
            from ..clients.client import CosyVoiceClient

            with CosyVoiceClient(server.http_url, timeout=opts.max_run_s) as warm:  # load and warm; not a K prompt
                for i in range(2):
                    warm.convert(
                        workload.sources[i],
                        workload.prompt,
                        source_sr=workload.source_rates[i],
                        prompt_sr=workload.prompt_sr,
                        seed=opts.seed,
                    )
        for mode, rs in phases:
            server = servers[mode]
            before = counts(fetch_statistics(server.http_url))
            records, wall = _phase(server.http_url, rs, prompts, opts.users, opts.seed, opts.max_run_s)
            time.sleep(0.5)  # let the statistics settle
            after = counts(fetch_statistics(server.http_url))
            res = results[mode]
            res["records"] += records
            res["wall_s"] += wall
            _add(res["stats"], _diff(before, after))
            ok = sum(r["ok"] for r in records)
            print(f"   {mode}: {ok}/{len(records)} ok in {wall:.1f} s", flush=True)
    setup["uptime at end"] = _uptime()
    report = summarize(results, requests, k)
    report.update(
        {
            "mode": "prompt-cache",
            "setup": setup,
            "rendered": rendered,
            "speakers": k,
            "options": {
                "users": opts.users,
                "requests": opts.requests,
                "speakers": k,
                "seed": opts.seed,
                "integrated_tunables": base,
                "server_args": list(opts.server_args),
            },
        }
    )
    md = render_markdown(report)
    (out_dir / "report.md").write_text(md)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(md, flush=True)
    print(f"wrote {out_dir / 'report.md'}, {out_dir / 'report.json'}", flush=True)
    return report


def summarize(results: dict[str, Any], requests: list[Request], speakers: int) -> dict[str, Any]:
    """The report's figures from the phases' records and statistics deltas."""
    modes: dict[str, Any] = {}
    for mode, res in results.items():
        ok = [r for r in res["records"] if r["ok"]]
        n = max(len(res["records"]), 1)
        st = res["stats"]
        tok, spk = st.get("speech_tokenizer", {}), st.get("speaker_encoder", {})
        hits, misses = spk.get("cache_hits", 0), spk.get("cache_misses", 0)
        pre = st.get("preprocess", {})
        modes[mode] = {
            "requests": len(res["records"]),
            "failed": len(res["records"]) - len(ok),
            "errors": sorted({r["error"] for r in res["records"] if not r["ok"]})[:5],
            **latency_summary([r["latency_s"] for r in ok]),
            "throughput_rps": len(ok) / res["wall_s"] if res["wall_s"] else float("nan"),
            "wall_s": res["wall_s"],
            "tokenizer_inferences_per_request": tok.get("inferences", 0) / n,
            "speaker_encoder_inferences_per_request": spk.get("inferences", 0) / n,
            "tokenizer_cache_hits": tok.get("cache_hits", 0),
            "tokenizer_cache_misses": tok.get("cache_misses", 0),
            "speaker_encoder_cache_hits": hits,
            "speaker_encoder_cache_misses": misses,
            "prompt_hit_rate": hits / n,
            "preprocess_compute_ms_per_request": pre.get("compute_ns", 0) / max(pre.get("success", 0), 1) / 1e6,
            "tokenizer_compute_ms_per_request": tok.get("compute_ns", 0) / n / 1e6,
            "speaker_encoder_compute_ms_per_request": spk.get("compute_ns", 0) / n / 1e6,
            "statistics": st,
        }
    waves = {m: {r["index"]: r["waveform"] for r in res["records"] if r["ok"]} for m, res in results.items()}
    common = sorted(set(waves.get("on", {})) & set(waves.get("off", {})))
    differ = [i for i in common if not np.array_equal(waves["on"][i], waves["off"][i])]
    worst = 0.0
    for i in differ:
        a, b = waves["on"][i], waves["off"][i]
        if a.shape == b.shape:
            worst = max(worst, float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30)))
        else:
            worst = float("inf")
    distinct = len({r.prompt for r in requests})
    return {
        "modes": modes,
        "identical": {"compared": len(common), "differ": len(differ), "max_rel_err": worst},
        "expected_hit_rate": (len(requests) - distinct) / len(requests),
        "distinct_prompts": distinct,
    }


def _f(v: float, digits: int = 0) -> str:
    return "n/a" if v != v else f"{v:,.{digits}f}"


def render_markdown(report: dict[str, Any]) -> str:
    m = report["modes"]
    on, off = m.get("on", {}), m.get("off", {})
    lines = [f"# Repeated-speaker load test: prompt caches on vs off ({report.get('speakers')} speakers)", ""]
    lines += [f"- {k}: {v}" for k, v in report.get("setup", {}).items()]
    lines += ["", "| | cache on | cache off | on vs off |", "| --- | ---: | ---: | ---: |"]

    def row(name: str, key: str, digits: int = 0, ratio: bool = True) -> None:
        a, b = on.get(key, float("nan")), off.get(key, float("nan"))
        rel = f"{(a / b - 1) * 100:+.0f}%" if ratio and b and a == a and b == b else ""
        lines.append(f"| {name} | {_f(a, digits)} | {_f(b, digits)} | {rel} |")

    row("requests (failed)", "requests")
    lines[-1] = (
        f"| requests (failed) | {on.get('requests', 0)} ({on.get('failed', 0)}) | {off.get('requests', 0)} "
        f"({off.get('failed', 0)}) | |"
    )
    row("latency p50 (ms)", "p50_ms")
    row("latency p95 (ms)", "p95_ms")
    row("latency mean (ms)", "mean_ms")
    row("throughput (req/s)", "throughput_rps", 3)
    row("speech_tokenizer inferences / request", "tokenizer_inferences_per_request", 2, ratio=False)
    row("speaker_encoder inferences / request", "speaker_encoder_inferences_per_request", 2, ratio=False)
    row("prompt hit rate (speaker_encoder cache hits / requests)", "prompt_hit_rate", 3, ratio=False)
    row("preprocess compute per request (ms)", "preprocess_compute_ms_per_request", 1)
    row("speech_tokenizer compute per request (ms)", "tokenizer_compute_ms_per_request", 1)
    row("speaker_encoder compute per request (ms)", "speaker_encoder_compute_ms_per_request", 2)
    ident = report.get("identical", {})
    lines += [
        "",
        f"Expected hit rate with {report.get('distinct_prompts')} distinct prompts in the requests: "
        f"{report.get('expected_hit_rate', 0):.3f} (each speaker's first request misses).",
        f"Waveforms, same request on both servers: {ident.get('compared', 0)} compared, "
        f"{ident.get('differ', 0)} differ"
        + (f" (max rel err {ident.get('max_rel_err'):.2e})" if ident.get("differ") else " (bit-identical)")
        + ".",
        f"speaker_encoder response cache (on): {on.get('speaker_encoder_cache_hits', 0)} hits, "
        f"{on.get('speaker_encoder_cache_misses', 0)} misses counted by Triton; "
        f"speech_tokenizer: {on.get('tokenizer_cache_hits', 0)} hits, "
        f"{on.get('tokenizer_cache_misses', 0)} misses (the sources' requests miss: each source is unique).",
    ]
    for mode in ("on", "off"):
        if m.get(mode, {}).get("errors"):
            lines.append(f"{mode} errors: {m[mode]['errors']}")
    return "\n".join(lines) + "\n"
