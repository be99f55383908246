"""``make bench-peer``: the official code, this library in process and the served pipeline, side by side.

    python -m cosyvoice_triton.bench.peer --model-dir models/cosyvoice2-demo-full [--official CHECKOUT]

The same weights (a CosyVoice2 folder: the full-size demo model by default) and the same inputs (the front end's
output for ``--source`` / ``--prompt``: speech tokens, prompt mel, speaker embedding, written once to
``<out>/inputs.npz``) go through token-to-waveform (flow encoder, 10 Euler steps of the estimator, HiFT) on:

* ``official``: the official ``CosyVoice2Model.token2wav`` (a checkout of FunAudioLLM/CosyVoice, its flow / HiFT
  dependencies from ``--official-deps``), in a worker process of its own;
* ``library``: :meth:`CosyVoice2.token2wav <cosyvoice_triton.pipeline.CosyVoice2.token2wav>` (PyTorch fp32), in a
  worker process of its own;
* ``library_onnx``: the library's other in-process path, :class:`~cosyvoice_triton.serving.stages.local.LocalPipeline`'s
  flow solver and HiFT runner on the exported fp32 onnxruntime graphs (what the served stages run, without a
  server), in a worker process of its own;
* ``served`` (and ``served_int8`` when ``<onnx>/int8_cpu`` exists): a live ``tritonserver`` on the rendered local
  repository, the ``flow`` and ``hift`` stage models called one after the other at concurrency 1 (gRPC).

Rounds interleave the sides (the order rotates every round), so that load from other processes hits every side
alike; medians and ratios come from the timed rounds after one warm-up round. Peak memory: each worker's peak RSS,
the server's process tree (tritonserver + Python stubs) sampled every 250 ms. A fp32 GEMM ceiling is measured in
this process with the same thread count, before and after the rounds, and each graph's achieved GFLOP/s (its
matmul / convolution FLOPs counted by torch over its measured time: the library's stage timers, Triton's
``compute_infer`` statistics) is set against it. The waveforms are compared too (same NSF noise seed), so a speed-up
is never bought with a different output. Figures, not assertions: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .. import resources

#: Where models/ and build/ are: the clone the package runs from, else the current folder (an installed wheel).
ROOT = resources.checkout() or Path.cwd()
FIXTURES = resources.path("tests/fixtures")
DEFAULT_MODEL_DIR = ROOT / "models" / "cosyvoice2-demo-full"
DEFAULT_OFFICIAL_DEPS = ROOT / "build" / "official-deps"
GRAPHS = ("flow_encoder", "flow_estimator", "hift")  # what the GFLOP/s are reported for (hift: source + decoder)
LIBRARY_STAGES = {"flow_encoder": "flow.encoder", "flow_estimator": "flow.solver", "hift": "hift"}
IN_PROCESS = ("library", "library_onnx")  # the sides the in-process target is judged on
SERVED_GRAPHS = {"flow_encoder": ("flow_encoder",), "flow_estimator": ("flow_estimator",),
                 "hift": ("hift_source", "hift_decoder")}

#: The issue's targets (full dims, this CPU, one run): name -> (what, threshold).
TARGETS = {
    "library_vs_official": ("in process (the faster library side), fp32 with parity: speed-up over the official "
                            "code", 1.5),
    "served_vs_official": ("served at concurrency 1, fp32: speed-up over the official code", 1.4),
    "served_int8_vs_official": ("served at concurrency 1, INT8 within the quality bar: speed-up over official", 2.0),
    "estimator_vs_ceiling": ("the whole estimator's GFLOP/s against the measured GEMM ceiling", 0.70),
}
PARITY_BAR = 1e-3  # max |a - b| / max |b| of the waveforms: fp32 sides must agree to this


# ------------------------------------------------------------------------------------------------- figures

def gemm_ceiling(threads: int, n: int = 2048, repeats: int = 5) -> float:
    """Best fp32 GFLOP/s of an n x n matmul with ``threads`` torch threads (:func:`.vc.gemm_ceiling`)."""
    import torch

    from .vc import gemm_ceiling as ceiling

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return ceiling(n, repeats)
    finally:
        torch.set_num_threads(before)


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    n = min(len(a), len(b))
    if n == 0 or len(a) != len(b):
        return float("inf")
    return float(np.max(np.abs(a[:n] - b[:n])) / max(np.max(np.abs(b[:n])), 1e-30))


def summarize(result: dict) -> dict:
    """Medians, ratios, GFLOP/s and the targets, from the raw figures of :func:`run_peer_bench` (pure: tested on
    made-up figures). ``result``: ``sides`` {name: {"seconds": [...], "peak_rss_mb", "graph_seconds": {graph:
    [...]}, ...}}, ``flops`` {graph: FLOPs of one request}, ``ceiling_gflops`` [..], ``parity`` {pair: rel diff},
    optional ``int8_quality_ok`` (bool or None) and ``notes``."""
    order = ("official", "library", "library_onnx", "served", "served_int8")
    sides = dict(sorted(result["sides"].items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 9))
    ceiling = max(result["ceiling_gflops"]) if result.get("ceiling_gflops") else float("nan")
    rows = {}
    for name, side in sides.items():
        secs = side.get("seconds") or []
        if not secs or side.get("skipped"):
            rows[name] = {"skipped": side.get("skipped", "not run")}
            continue
        row = {"median_s": statistics.median(secs), "min_s": min(secs), "runs": len(secs),
               "peak_rss_mb": side.get("peak_rss_mb"), "graphs": {}}
        for graph, times in (side.get("graph_seconds") or {}).items():
            if not times:
                continue
            t = statistics.median(times)
            flops = result.get("flops", {}).get(graph)
            g = {"median_s": t}
            if flops and t > 0:
                g["gflops_per_s"] = flops / t / 1e9
                g["of_ceiling"] = g["gflops_per_s"] / ceiling
            row["graphs"][graph] = g
        if side.get("model_seconds"):
            row["models"] = {m: statistics.median(v) for m, v in side["model_seconds"].items()}
        rows[name] = row
    official = rows.get("official", {}).get("median_s")
    for row in rows.values():
        if official and "median_s" in row:
            row["vs_official"] = official / row["median_s"]
    parity = result.get("parity", {})

    def target(key: str, value, met_extra: bool = True, why_extra: str = "") -> dict:
        what, bar = TARGETS[key]
        if value is None:
            return {"what": what, "target": bar, "value": None, "met": None, "reason": why_extra or "not measured"}
        met = bool(value >= bar and met_extra)
        if met:
            reason = "met"
        elif value < bar:
            reason = f"{value:.2f} < {bar:.2f}" + (f"; {why_extra}" if why_extra else "")
        else:
            reason = why_extra
        return {"what": what, "target": bar, "value": value, "met": met, "reason": reason}

    def speed(side: str) -> float | None:
        return rows.get(side, {}).get("vs_official")

    def why_speed(side: str) -> str:
        if not official:
            return "no official run (pass --official CHECKOUT)"
        row = rows.get(side, {})
        if "median_s" not in row:
            return f"{side}: {row.get('skipped', 'not run')}"
        graphs = row.get("graphs", {})
        total = sum(g["median_s"] for g in graphs.values()) or row["median_s"]
        parts = [f"{g} {v['median_s'] / row['median_s']:.0%} of the time"
                 + (f" at {v['of_ceiling']:.0%} of the ceiling" if "of_ceiling" in v else "")
                 for g, v in sorted(graphs.items(), key=lambda kv: -kv[1]["median_s"])]
        other = row["median_s"] - total
        if graphs and other > 0:
            parts.append(f"outside the graphs {other / row['median_s']:.0%}")
        return "; ".join(parts)

    measured = [side for side in IN_PROCESS if "median_s" in rows.get(side, {})]

    def at_parity(side: str) -> bool:
        value = parity.get(f"{side}_vs_official")
        return value is not None and value <= PARITY_BAR

    # the fastest in-process side at parity with the official output; else the fastest (reported as not at parity)
    candidates = [side for side in measured if at_parity(side)] or measured
    lib_side = min(candidates, key=lambda side: rows[side]["median_s"]) if candidates else "library"
    lib_parity = parity.get(f"{lib_side}_vs_official")
    lib_ok = at_parity(lib_side)
    targets = {
        "library_vs_official": target(
            "library_vs_official", speed(lib_side) if official else None, lib_ok,
            f"side {lib_side}: " + why_speed(lib_side)
            + ("" if lib_ok else f"; parity with the official output "
               f"{'not measured' if lib_parity is None else f'{lib_parity:.1e}'} (bar {PARITY_BAR:g})")),
        "served_vs_official": target("served_vs_official", speed("served") if official else None, True,
                                     why_speed("served")),
    }
    q = result.get("int8_quality_ok")
    int8_speed = speed("served_int8") if official else None
    targets["served_int8_vs_official"] = target(
        "served_int8_vs_official", int8_speed, bool(q),
        why_speed("served_int8") if "median_s" in rows.get("served_int8", {}) else
        rows.get("served_int8", {}).get("skipped", "not run"))
    if "median_s" in rows.get("served_int8", {}) and not q:
        targets["served_int8_vs_official"]["reason"] += ("; INT8 quality bar "
                                                         + ("not checked (no quality report)" if q is None
                                                            else "missed (quality report)"))
    est = [(side, rows[side]["graphs"]["flow_estimator"]["of_ceiling"]) for side in (*IN_PROCESS, "served")
           if "of_ceiling" in rows.get(side, {}).get("graphs", {}).get("flow_estimator", {})]
    best = max(est, key=lambda x: x[1]) if est else None
    targets["estimator_vs_ceiling"] = target(
        "estimator_vs_ceiling", best[1] if best else None, True,
        (f"best side {best[0]}; the GFLOP/s count only matmul / convolution work, so element-wise kernels "
         "(Mish, GELU, LayerNorm, softmax), attention's small GEMMs and padding lower it") if best else "")
    return {"rows": rows, "ceiling_gflops": ceiling, "parity": parity, "targets": targets,
            "notes": list(result.get("notes", []))}


def format_table(summary: dict) -> str:
    rows, ceiling = summary["rows"], summary["ceiling_gflops"]
    lines = [f"GEMM ceiling (fp32, 2048^3, this process, best of the before/after measures): {ceiling:.1f} GFLOP/s",
             "", f"{'side':<13}{'median s':>10}{'min s':>8}{'vs official':>13}{'peak RSS MB':>13}   "
             + "  ".join(f"{g} s (GFLOP/s, of ceiling)" for g in GRAPHS)]
    for name, row in rows.items():
        if "median_s" not in row:
            lines.append(f"{name:<13}skipped: {row['skipped']}")
            continue
        vs = f"{row['vs_official']:.2f}x" if "vs_official" in row else "-"
        rss = f"{row['peak_rss_mb']:.0f}" if row.get("peak_rss_mb") else "-"
        cells = []
        for g in GRAPHS:
            v = row["graphs"].get(g)
            if v is None:
                cells.append("-")
            elif "gflops_per_s" in v:
                cells.append(f"{v['median_s']:.2f} ({v['gflops_per_s']:.0f}, {v['of_ceiling']:.0%})")
            else:
                cells.append(f"{v['median_s']:.2f}")
        lines.append(f"{name:<13}{row['median_s']:>10.2f}{row['min_s']:>8.2f}{vs:>13}{rss:>13}   "
                     + "  ".join(cells))
    for name, row in rows.items():
        if row.get("models"):
            lines.append(f"{name}: Triton compute per request (median s): "
                         + ", ".join(f"{m} {v:.2f}" for m, v in sorted(row["models"].items(), key=lambda kv: -kv[1])))
    if summary["parity"]:
        lines += ["", "parity (max |a - b| / max |b| of the waveforms): "
                  + ", ".join(f"{k} {v:.1e}" for k, v in summary["parity"].items())]
    lines += ["", "targets:"]
    for t in summary["targets"].values():
        state = {True: "MET   ", False: "MISSED", None: "n/a   "}[t["met"]]
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"  {state} {t['what']}: {value} (target {t['target']:.2f}) - {t['reason']}")
    lines.append("  n/a    served throughput at 4 users >= 2x the plain column: a load test, not this benchmark "
                 "(make loadtest-full LOADTEST_ARGS=\"--sweep 4 ...\")")
    for note in summary["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- workers

class Worker:
    """A side running in its own process: one JSON line per command on its stdout."""

    def __init__(self, side: str, args: list[str], env: dict | None = None, log_path: Path | None = None,
                 module: str = "cosyvoice_triton.bench.peer"):
        self.side = side
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen([sys.executable, "-m", module, "--worker", side, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=ROOT)
        self.ready = self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"bench-peer: the {self.side} worker exited (rc {self.proc.wait()}); see its log")
            if line.startswith("{"):
                return json.loads(line)

    def call(self, command: str) -> dict:
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"bench-peer: the {self.side} worker exited (rc {self.proc.wait()}: -9 is a kill, "
                               "e.g. for memory); see its log") from None
        return self._read()

    def close(self) -> dict:
        try:
            out = self.call("quit")
        finally:
            self.proc.wait(timeout=60)
            if self.log is not subprocess.DEVNULL:
                self.log.close()
        return out


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _load_inputs(path: Path):
    from ..pipeline import VCInputs

    z = np.load(path)
    return VCInputs(source_tokens=z["source_tokens"], prompt_tokens=z["prompt_tokens"], prompt_mel=z["prompt_mel"],
                    embedding=z["embedding"])


def _library_flops(model, inputs) -> dict[str, int]:
    """Matmul / convolution FLOPs of one request per graph, counted by torch on the library's modules."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from .vc import estimator_flops

    tensors = model._tensors(inputs, inputs.source_tokens)
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        c = model.flow.condition(*tensors, streaming=False, finalize=True)
    encoder = counter.get_total_flops()
    frames = int(c.mu.shape[-1])
    steps = model.flow.decoder.config.n_timesteps
    mel = torch.randn(1, 80, frames - model.flow.token_mel_ratio * len(inputs.prompt_tokens))
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model.hift.inference(mel, generator=torch.Generator().manual_seed(0))
    return {"flow_encoder": encoder, "flow_estimator": estimator_flops(model, frames) * steps,
            "hift": counter.get_total_flops(), "mel_frames": frames}


def worker_main(side: str, ns: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(ns.threads)
    out_dir = Path(ns.out_dir)
    t0 = time.perf_counter()
    if side == "library":
        from ..pipeline import CosyVoice2, StageTimer

        model = CosyVoice2.from_pretrained(ns.model_dir, onnx_threads=ns.threads, tts=False,
                                           threads=ns.threads)
        inputs_path = out_dir / "inputs.npz"
        if not inputs_path.is_file():
            x = model.frontend_vc(ns.source, ns.prompt)
            np.savez(inputs_path, source_tokens=x.source_tokens, prompt_tokens=x.prompt_tokens,
                     prompt_mel=x.prompt_mel, embedding=x.embedding)
        inputs = _load_inputs(inputs_path)
        ready = {"load_s": time.perf_counter() - t0, "flops": _library_flops(model, inputs)}

        def run() -> tuple[np.ndarray, dict]:
            timer = StageTimer()
            wave = model.token2wav(inputs, seed=0, timer=timer)
            return wave, {g: timer.seconds.get(stage, 0.0) for g, stage in LIBRARY_STAGES.items()}
    elif side == "library_onnx":
        from ..serving.stages.flow import FlowItem
        from ..serving.stages.local import LocalPipeline

        pipe = LocalPipeline(ns.model_dir, ns.onnx_dir, intra_op_threads=ns.threads)
        inputs = _load_inputs(out_dir / "inputs.npz")
        ready = {"load_s": time.perf_counter() - t0}
        spent: dict[str, float] = {}

        def timed(graph: str, name: str):
            fn = pipe.graphs[name].run

            def call(feeds):
                t = time.perf_counter()
                try:
                    return fn(feeds)
                finally:
                    spent[graph] = spent.get(graph, 0.0) + time.perf_counter() - t
            return call

        encoder, estimator = timed("flow_encoder", "flow_encoder"), timed("flow_estimator", "flow_estimator")
        source, decoder = timed("hift", "hift_source"), timed("hift", "hift_decoder")

        def run() -> tuple[np.ndarray, dict]:
            spent.clear()
            item = FlowItem.from_tensors({
                "source_speech_tokens": inputs.source_tokens.astype(np.int32),
                "prompt_speech_tokens": inputs.prompt_tokens.astype(np.int32),
                "prompt_mel": inputs.prompt_mel.astype(np.float32),
                "speaker_embedding": inputs.embedding.astype(np.float32)})
            mel = pipe.flow.run([item], encoder, estimator)[0].unwrap()
            wave = pipe.hift.run([mel], [0], source, decoder)[0].unwrap()
            return wave, dict(spent)
    elif side == "official":
        if ns.official_deps and Path(ns.official_deps).is_dir():
            sys.path.insert(0, str(Path(ns.official_deps).resolve()))
        from .official import official_vc_model

        model = official_vc_model(ns.official, ns.model_dir)
        inputs = _load_inputs(out_dir / "inputs.npz")
        ready = {"load_s": time.perf_counter() - t0}

        def tensor(a, dtype):
            return torch.as_tensor(a, dtype=dtype)[None]

        def run() -> tuple[np.ndarray, dict]:
            model.hift_cache_dict["bench"] = None
            torch.manual_seed(0)  # the NSF noise the library's seed=0 replays
            with torch.inference_mode():
                wave = model.token2wav(token=tensor(inputs.source_tokens, torch.int32),
                                       prompt_token=tensor(inputs.prompt_tokens, torch.int32),
                                       prompt_feat=tensor(inputs.prompt_mel, torch.float32),
                                       embedding=tensor(inputs.embedding, torch.float32),
                                       token_offset=0, uuid="bench", finalize=True)
            model.hift_cache_dict.pop("bench", None)
            return wave[0].numpy(), {}
    else:
        raise SystemExit(f"bench-peer: unknown worker side {side!r}")
    ready["peak_rss_mb"] = _peak_rss_mb()
    _emit(ready)
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        t0 = time.perf_counter()
        wave, graphs = run()
        seconds = time.perf_counter() - t0
        np.save(out_dir / f"{side}.npy", wave)
        _emit({"seconds": seconds, "graph_seconds": graphs, "samples": len(wave)})
    _emit({"peak_rss_mb": _peak_rss_mb()})
    return 0


# ------------------------------------------------------------------------------------------------- served

class ServedSide:
    """A live tritonserver on the rendered local repository; ``flow`` then ``hift`` at concurrency 1 (gRPC)."""

    def __init__(self, name: str, model_dir: Path, onnx_dir: Path, precision: str, threads: int, out_dir: Path):
        from ..clients.plain import PlainPipeline
        from ..loadtest.sampler import ServerSampler
        from ..serving.launch.server import TritonServer
        from ..serving.repository import render_repository

        self.name = name
        repo = out_dir / f"repository_{name}"
        render_repository("local", repo, model_dir=model_dir, onnx_dir=onnx_dir, precision=precision,
                          intra_op_threads=threads, torch_threads=threads, tts="off", max_queue_delay_us=0)
        t0 = time.perf_counter()
        self.server = TritonServer(repo, work_dir=out_dir / f"triton_{name}", exit_timeout=10).start(timeout=900)
        self.sampler = ServerSampler(self.server.process.pid).start()
        self.client = PlainPipeline(self.server.grpc_url, protocol="grpc", model_dir=model_dir, timeout_s=900)
        self.ready = {"load_s": time.perf_counter() - t0}
        self.inputs = _load_inputs(out_dir / "inputs.npz")
        self.out_dir = out_dir

    def _compute_ns(self) -> dict[str, int]:
        stats = self.client.statistics()
        out = {}
        for m in stats.get("model_stats", []):
            c = m.get("inference_stats", {}).get("compute_infer", {})
            out[m["name"]] = int(c.get("ns", 0))
        return out

    def call(self, command: str) -> dict:
        x = self.inputs
        before = self._compute_ns()
        t0 = time.perf_counter()
        mel = self.client.infer("flow", {
            "source_speech_tokens": x.source_tokens.astype(np.int32)[None],
            "prompt_speech_tokens": x.prompt_tokens.astype(np.int32)[None],
            "prompt_mel": x.prompt_mel.astype(np.float32)[None],
            "speaker_embedding": x.embedding.astype(np.float32)[None]})["mel"]
        wave = self.client.infer("hift", {"mel": mel, "seed": np.array([[0]], np.int64)})["waveform"][0]
        seconds = time.perf_counter() - t0
        after = self._compute_ns()
        graphs = {g: sum(after.get(m, 0) - before.get(m, 0) for m in models) / 1e9
                  for g, models in SERVED_GRAPHS.items()}
        models = {m: (after.get(m, 0) - before.get(m, 0)) / 1e9 for m in after if after.get(m, 0) != before.get(m, 0)}
        np.save(self.out_dir / f"{self.name}.npy", wave)
        return {"seconds": seconds, "graph_seconds": graphs, "model_seconds": models, "samples": len(wave)}

    def close(self) -> dict:
        self.sampler.stop()
        peak = self.sampler.peak_rss_mb()
        self.client.close()
        self.server.stop()
        return {"peak_rss_mb": peak}


def _int8_quality_ok(report: Path) -> bool | None:
    """Whether the quality report chose int8_cpu for every graph it judged (within the bar and >= 1.25x faster
    than fp32 there); None without a report."""
    from ..serving.repository import RenderError, read_cpu_choice

    try:
        return all(v == "int8_cpu" for v in read_cpu_choice(report).values())
    except RenderError:
        return None


def default_onnx_dir(model_dir: Path) -> Path:
    """Where ``make export`` / ``make bench-export`` put the graphs of the demo folders; else build/onnx-<name>."""
    return ROOT / "build" / {"cosyvoice2-demo-full": "onnx-full", "cosyvoice2-demo-tiny": "onnx"}.get(
        model_dir.name, f"onnx-{model_dir.name}")


def run_peer_bench(model_dir: str | Path = DEFAULT_MODEL_DIR, *, official: str | Path | None = None,
                   official_deps: str | Path = DEFAULT_OFFICIAL_DEPS, source: str | Path | None = None,
                   prompt: str | Path | None = None, rounds: int = 3, threads: int = 2, served: bool = True,
                   onnx_dir: str | Path | None = None, quality_report: str | Path | None = None,
                   out_dir: str | Path = "build/bench-peer") -> dict:
    if rounds < 1 or threads < 1:
        raise ValueError(f"bench-peer: rounds and threads must be >= 1, got {rounds}, {threads}")
    model_dir, out_dir = Path(model_dir), Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "inputs.npz").unlink(missing_ok=True)
    source = str(source or FIXTURES / "source_en_5s.wav")
    prompt = str(prompt or FIXTURES / "prompt_en_3s.wav")
    notes = [f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other processes slow "
             "every side alike: the rounds interleave)"]
    print(f"bench-peer: {model_dir}, {threads} threads per side, {rounds} timed rounds after 1 warm-up", flush=True)
    ceilings = [gemm_ceiling(threads)]
    print(f"  GEMM ceiling {ceilings[0]:.1f} GFLOP/s", flush=True)
    common = ["--model-dir", str(model_dir), "--threads", str(threads), "--out-dir", str(out_dir),
              "--source", source, "--prompt", prompt]
    sides: dict = {}
    runners: dict = {}
    dead: dict[str, str] = {}  # sides that failed: their reason (the finally below reads it even after a failed start)
    result = {"model_dir": str(model_dir), "threads": threads, "rounds": rounds, "source": source, "prompt": prompt,
              "sides": sides, "ceiling_gflops": ceilings, "notes": notes}
    try:
        print("  starting library worker", flush=True)
        runners["library"] = Worker("library", common, log_path=out_dir / "library.log")
        result["flops"] = runners["library"].ready["flops"]
        onnx_root = Path(onnx_dir) if onnx_dir else default_onnx_dir(model_dir)
        if not (onnx_root / "fp32" / "flow_estimator.onnx").is_file():
            from ..export.onnx_export import export_onnx

            print(f"  exporting fp32 ONNX to {onnx_root / 'fp32'} (once)", flush=True)
            export_onnx(model_dir, onnx_root / "fp32", verify=False)
        print("  starting library_onnx worker", flush=True)
        runners["library_onnx"] = Worker("library_onnx", [*common, "--onnx-dir", str(onnx_root / "fp32")],
                                         log_path=out_dir / "library_onnx.log")
        if official:
            print(f"  starting official worker ({official})", flush=True)
            runners["official"] = Worker("official", [*common, "--official", str(official), "--official-deps",
                                                      str(official_deps)], log_path=out_dir / "official.log")
        else:
            sides["official"] = {"skipped": "no checkout given (OFFICIAL=path / --official)"}
        if served:
            print("  starting tritonserver (fp32 graphs)", flush=True)
            runners["served"] = ServedSide("served", model_dir, onnx_root, "fp32", threads, out_dir)
            if (onnx_root / "int8_cpu").is_dir():
                print("  starting tritonserver (int8_cpu graphs)", flush=True)
                runners["served_int8"] = ServedSide("served_int8", model_dir, onnx_root, "int8_cpu", threads,
                                                    out_dir)
                result["int8_quality_ok"] = _int8_quality_ok(
                    Path(quality_report) if quality_report else ROOT / "build" / "quality-full" / "report.json")
            else:
                sides["served_int8"] = {"skipped": f"no {onnx_root / 'int8_cpu'} (make bench-export writes it)"}
        else:
            sides["served"] = {"skipped": "--no-served"}
        for name, r in runners.items():
            sides[name] = {"seconds": [], "graph_seconds": {}, "load_s": r.ready["load_s"]}
        names = list(runners)
        for i in range(rounds + 1):
            order = names[i % len(names):] + names[:i % len(names)]
            label = "warm-up" if i == 0 else f"round {i}"
            figures = []
            for name in order:
                if name in dead:
                    continue
                try:
                    out = runners[name].call("run")
                except Exception as exc:  # a side that dies (e.g. killed for memory) leaves the others running
                    dead[name] = f"failed in {label}: {exc}"
                    sides[name]["skipped"] = dead[name]
                    notes.append(f"{name}: {dead[name]}")
                    continue
                figures.append(f"{name} {out['seconds']:.2f} s")
                if i:
                    sides[name]["seconds"].append(out["seconds"])
                    for g, s in out["graph_seconds"].items():
                        sides[name]["graph_seconds"].setdefault(g, []).append(s)
                    for m, s in out.get("model_seconds", {}).items():
                        sides[name].setdefault("model_seconds", {}).setdefault(m, []).append(s)
                sides[name]["samples"] = out["samples"]
            print(f"  {label}: " + ", ".join(figures), flush=True)
    finally:
        for name, r in runners.items():
            if name in dead:
                continue
            try:
                sides.setdefault(name, {}).update(r.close())
            except Exception as exc:  # a worker that died already: its figures so far stay
                notes.append(f"{name}: closing failed ({exc})")
    ceilings.append(gemm_ceiling(threads))
    notes.append(f"load average at end {os.getloadavg()[0]:.1f}; GEMM ceiling before / after: "
                 f"{ceilings[0]:.1f} / {ceilings[1]:.1f} GFLOP/s")
    waves = {name: np.load(out_dir / f"{name}.npy") for name in sides if (out_dir / f"{name}.npy").is_file()}
    parity = {}
    for a, b in (("library", "official"), ("library_onnx", "official"), ("library_onnx", "library"),
                 ("served", "library"), ("served_int8", "library")):
        if a in waves and b in waves:
            parity[f"{a}_vs_{b}"] = rel_diff(waves[a], waves[b])
    result["parity"] = parity
    summary = summarize(result)
    result["summary"] = summary
    (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=float))
    print()
    print(format_table(summary))
    print(f"\n  written: {out_dir / 'result.json'}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyvoice_triton.bench.peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--official", default=None, help="checkout of FunAudioLLM/CosyVoice (else the side is skipped)")
    p.add_argument("--official-deps", default=str(DEFAULT_OFFICIAL_DEPS),
                   help="folder with the official flow/HiFT dependencies (pip install --target)")
    p.add_argument("--source", default=str(FIXTURES / "source_en_5s.wav"))
    p.add_argument("--prompt", default=str(FIXTURES / "prompt_en_3s.wav"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no-served", action="store_true")
    p.add_argument("--onnx-dir", default=None, help="export root (default build/onnx-<model folder name>)")
    p.add_argument("--quality-report", default=None)
    p.add_argument("--out-dir", default="build/bench-peer")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        return worker_main(ns.worker, ns)
    run_peer_bench(ns.model_dir, official=ns.official, official_deps=ns.official_deps, source=ns.source,
                   prompt=ns.prompt, rounds=ns.rounds, threads=ns.threads, served=not ns.no_served,
                   onnx_dir=ns.onnx_dir, quality_report=ns.quality_report, out_dir=ns.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
