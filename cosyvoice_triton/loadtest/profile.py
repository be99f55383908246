"""Where the time goes in the slowest stage of the integrated column, on this machine.

The load test's per-model statistics name the leaf graph with the most compute time (normally ``flow_estimator``)
and its average batch. This module runs the very ONNX file the integrated repository served, in an onnxruntime CPU
session with the served instance's intra-op threads, on inputs shaped like the load test's calls (rows = the
measured average batch, length = the workload's mean source + prompt), and measures:

- time per row at 2, 4, 8 and 16 rows (and the measured batch): whether batching amortises anything here;
- onnxruntime's profiler, aggregated by op type (share of kernel time) and the top nodes;
- the achieved GFLOP/s of the MatMul / Gemm / Conv kernels (FLOPs from the shapes the profiler records) next to a
  single-op GEMM ceiling measured in the same run (an onnxruntime MatMul of the heaviest node's size, and numpy's
  BLAS limited to the same threads when ``threadpoolctl`` is installed);

and concludes in a sentence or two generated from those numbers. :func:`profile_markdown` renders the report's
section from the JSON :func:`profile_stage` returns.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["PROFILED_GRAPHS", "ROWS", "gemm_ceiling", "gemm_dims", "graph_feeds", "graph_length", "kernel_flops",
           "measured_batch", "profile_markdown", "profile_stage", "served_onnx", "summarize_kernels",
           "time_per_row"]

#: The leaf graphs this profile supports (the ones that dominate the compute time).
PROFILED_GRAPHS = ("flow_estimator", "hift_decoder", "flow_encoder")
ROWS = (2, 4, 8, 16)
#: Matrix-multiply kernels: output [..., M, N], first input [..., M, K] (or transposed).
MATMUL_OPS = frozenset({"MatMul", "FusedMatMul", "Gemm", "FusedGemm", "MatMulInteger", "MatMulIntegerToFloat",
                        "DynamicQuantizeMatMul", "QLinearMatMul", "QGemm", "MatMulNBits", "TransposeMatMul"})
#: Convolutions: output [N, Cout, ...], weight [Cout, Cin / groups, *kernel] (input 3 of QLinearConv, else 1).
CONV_OPS = frozenset({"Conv", "FusedConv", "NhwcConv", "NhwcFusedConv", "QLinearConv", "ConvInteger"})
CONV_TRANSPOSE_OPS = frozenset({"ConvTranspose"})
GEMM_LIKE = MATMUL_OPS | CONV_OPS | CONV_TRANSPOSE_OPS
FLAT = 0.85  # per-row time at the most rows / at the fewest, above which batching "amortises nothing"
PEAK_GEMM = (1024, 1024, 1024)  # the square product whose GFLOP/s is the machine's GEMM peak in the report
COMPUTE_BOUND = 0.5  # fraction of the GEMM ceiling (and of kernel time in GEMM-like ops) for "compute-bound"
_ONNX_PATH = re.compile(r'key:\s*"onnx_path"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')
_THREADS = re.compile(r'key:\s*"intra_op_threads"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')


# ------------------------------------------------------------------------------------------ what to run


def served_onnx(repo: str | Path, graph: str) -> tuple[Path, str, int]:
    """The ONNX file the rendered repository ``repo`` serves for ``graph``, its precision (the marker's
    ``graph_precisions``) and the instance's onnxruntime intra-op threads: the Python backend's ``onnx_path``
    parameter, else the onnxruntime backend's ``1/model.onnx``. Raises when the graph is not served from ONNX."""
    from ..serving.marker import MARKER

    repo = Path(repo)
    marker = json.loads((repo / MARKER).read_text())
    precision = str(marker.get("graph_precisions", {}).get(graph) or marker.get("precision") or "fp32")
    threads = int(marker.get("tunables", {}).get("intra_op_threads", 1))
    config = repo / graph / "config.pbtxt"
    text = config.read_text() if config.is_file() else ""
    if (m := _THREADS.search(text)) and m.group(1).strip():
        threads = int(m.group(1))
    m = _ONNX_PATH.search(text)
    candidates = [Path(m.group(1))] if m and m.group(1) else []
    candidates.append(repo / graph / "1" / "model.onnx")
    for path in candidates:
        if path.is_file():
            return path, precision, threads
    raise FileNotFoundError(f"{repo / graph}: not served from an ONNX file (no onnx_path parameter, no 1/model.onnx)")


def graph_length(graph: str, source_s: float, prompt_s: float) -> int:
    """The length-axis size of ``graph`` for a source of ``source_s`` seconds and a prompt of ``prompt_s``: the
    flow sees prompt + source (mel frames for the estimator, tokens for the encoder), HiFT the source's frames."""
    from ..frontend.audio import MEL_SR
    from ..shapes import GRAPHS, SAMPLES_PER_MEL_FRAME

    mel_per_s = MEL_SR / SAMPLES_PER_MEL_FRAME  # 50 mel frames per second
    if graph == "flow_estimator":
        return max(1, round((source_s + prompt_s) * mel_per_s))
    if graph == "flow_encoder":
        mel_per_token = GRAPHS["flow_encoder"].tensor("mu").shape[2][1]  # mu: ("tokens", 2)
        return max(1, round((source_s + prompt_s) * mel_per_s / mel_per_token))
    if graph in ("hift_decoder", "hift_source"):
        return max(1, round(source_s * mel_per_s))
    raise ValueError(f"no length rule for graph {graph!r} (profiled: {PROFILED_GRAPHS})")


def _stage_runs(report: Mapping[str, Any], column: str = "integrated") -> list[Mapping[str, Any]]:
    users = report.get("users")
    return [r for r in report.get("runs", []) if r.get("column") == column and r.get("users") == users
            and r.get("stages")]


def measured_batch(report: Mapping[str, Any], graph: str, column: str = "integrated") -> float:
    """Average rows per execution of ``graph`` over ``column``'s runs at the report's concurrency (weighted by
    executions); NaN when the report has no statistics for it."""
    rows = execs = 0.0
    for r in _stage_runs(report, column):
        s = r["stages"].get(graph)
        if s and s.get("executions") and s.get("avg_batch") is not None:
            rows += float(s["executions"]) * float(s["avg_batch"])
            execs += float(s["executions"])
    return rows / execs if execs else math.nan


def slowest_graph(report: Mapping[str, Any], candidates: Sequence[str] = PROFILED_GRAPHS,
                  column: str = "integrated") -> tuple[str, str]:
    """(the candidate graph with the most compute time over ``column``'s runs, the slowest leaf model overall)."""
    composite = set(report.get("composite_models", ()))
    totals: dict[str, float] = {}
    for r in _stage_runs(report, column):
        for m, s in r["stages"].items():
            c = s.get("compute_ms")
            if m not in composite and c is not None and not math.isnan(float(c)):
                totals[m] = totals.get(m, 0.0) + float(c) * float(s.get("requests") or 0)
    if not totals:
        return candidates[0], ""
    overall = max(totals, key=totals.__getitem__)
    graphs = [g for g in candidates if g in totals]
    return (max(graphs, key=totals.__getitem__) if graphs else candidates[0]), overall


def graph_feeds(graph: str, rows: int, length: int, *, hift_source: str | Path | None = None,
                seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs of ``rows`` items of ``length`` (the export's :func:`~cosyvoice_triton.export.onnx_export.sample_inputs`;
    ``flow_estimator`` rows are CFG rows). ``hift_decoder``'s ``source`` comes from the ``hift_source`` ONNX file
    ``hift_source`` run on the same mel and noise."""
    from ..export.onnx_export import Case, sample_inputs
    from ..export.quantize_calibration import session

    case = Case("profile", rows, (length,) * rows)
    if graph != "hift_decoder":
        return sample_inputs(graph, case, seed=seed)
    if hift_source is None:
        raise ValueError("hift_decoder feeds need the hift_source ONNX file to build the source")
    src = sample_inputs("hift_source", case, seed=seed)
    source = session(hift_source, 1).run(["source"], src)[0]
    return {"mel": src["mel"], "source": np.ascontiguousarray(source, dtype=np.float32)}


# ---------------------------------------------------------------------------------------------- measuring


def time_per_row(model_path: str | Path, feeds_for: Callable[[int], Mapping[str, np.ndarray]],
                 rows: Iterable[int], *, threads: int = 1, repeats: int = 5, min_runs: int = 3,
                 budget_s: float = 3.0) -> list[dict[str, float]]:
    """Median wall time per call and per row of one session at each row count (one warm-up call each; at least
    ``min_runs`` and at most ``repeats`` timed calls, fewer than ``repeats`` once ``budget_s`` is spent)."""
    from ..export.quantize_calibration import session

    sess = session(model_path, threads)
    out = []
    for b in rows:
        feeds = dict(feeds_for(b))
        sess.run(None, feeds)
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < repeats and not (len(times) >= min_runs and time.perf_counter() - start > budget_s):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times) * 1e3
        out.append({"rows": int(b), "runs": len(times), "ms_per_call": med, "ms_per_row": med / b,
                    "min_ms_per_call": min(times) * 1e3})
    return out


def gemm_dims(op_type: str, inputs: Sequence[tuple[str, Sequence[int]]],
              outputs: Sequence[tuple[str, Sequence[int]]]) -> tuple[int, int, int] | None:
    """The (M, K, N) of a GEMM-like kernel from the shapes onnxruntime's profiler records (its FLOPs are
    ``2 M K N``); None when they do not say (e.g. a convolution whose pre-packed weight is not listed)."""
    if not outputs:
        return None
    out = tuple(int(d) for d in outputs[0][1])
    size = math.prod(out)
    if op_type in MATMUL_OPS:
        if not inputs or not out:
            return None
        a = tuple(int(d) for d in inputs[0][1])
        n = out[-1]
        if len(a) == 1:
            k = a[0]
        elif len(out) >= 2:
            k = a[-1] if a[-2] == out[-2] else a[-2]  # A [..., M, K], or transposed [..., K, M]
        else:
            return None
        return (size // n if n else 0), k, n
    if op_type in CONV_OPS:
        idx = 3 if op_type == "QLinearConv" else 1
        if len(inputs) <= idx or len(inputs[idx][1]) < 3 or len(out) < 3:
            return None
        w = tuple(int(d) for d in inputs[idx][1])
        return size // w[0], math.prod(w[1:]), w[0]
    if op_type in CONV_TRANSPOSE_OPS:
        if len(inputs) < 2 or len(inputs[0][1]) < 3 or len(inputs[1][1]) < 3:
            return None
        x, w = tuple(int(d) for d in inputs[0][1]), tuple(int(d) for d in inputs[1][1])
        return math.prod(x) // x[1], x[1], math.prod(w[1:])
    return None


def kernel_flops(op_type: str, inputs: Sequence[tuple[str, Sequence[int]]],
                 outputs: Sequence[tuple[str, Sequence[int]]]) -> float | None:
    """FLOPs (multiply and add counted apart; integer kernels' operations alike) of a GEMM-like kernel, else None."""
    d = gemm_dims(op_type, inputs, outputs)
    return None if d is None else 2.0 * d[0] * d[1] * d[2]


def summarize_kernels(events: Sequence[Any], runs: int, top: int = 5) -> dict[str, Any]:
    """Aggregate :class:`~cosyvoice_triton.export.quantize_sensitivity.KernelEvent` s of ``runs`` runs: kernel
    time per run, per op type (share, ms per run, nodes, GFLOP/s of the GEMM-like ones), the ``top`` nodes, and the
    GEMM-like kernels' FLOPs and achieved GFLOP/s (over the kernels whose FLOPs the shapes give) with the heaviest
    one's size."""
    runs = max(1, int(runs))
    total = sum(e.dur_us for e in events)
    ops: dict[str, dict[str, Any]] = {}
    nodes: dict[str, dict[str, Any]] = {}
    counted_us = counted_flops = uncounted_us = 0.0
    for e in events:
        o = ops.setdefault(e.op_type, {"op_type": e.op_type, "us": 0.0, "nodes": set(), "flops": 0.0, "flop_us": 0.0})
        o["us"] += e.dur_us
        o["nodes"].add(e.name)
        n = nodes.setdefault(e.name, {"node": e.name, "op_type": e.op_type, "us": 0.0, "dims": None})
        n["us"] += e.dur_us
        if e.op_type in GEMM_LIKE:
            dims = gemm_dims(e.op_type, e.inputs, e.outputs)
            if dims is None:
                uncounted_us += e.dur_us
            else:
                f = 2.0 * dims[0] * dims[1] * dims[2]
                o["flops"] += f
                o["flop_us"] += e.dur_us
                counted_flops += f
                counted_us += e.dur_us
                n["dims"] = dims
    share = (lambda us: us / total) if total > 0 else (lambda us: math.nan)
    by_op = [{"op_type": o["op_type"], "share": share(o["us"]), "ms_per_run": o["us"] / runs / 1e3,
              "nodes": len(o["nodes"]), "gflops": o["flops"] / o["flop_us"] / 1e3 if o["flop_us"] > 0 else math.nan}
             for o in sorted(ops.values(), key=lambda o: -o["us"])]
    top_nodes = [{"node": n["node"], "op_type": n["op_type"], "share": share(n["us"]),
                  "ms_per_run": n["us"] / runs / 1e3} for n in sorted(nodes.values(), key=lambda n: -n["us"])[:top]]
    heavy = max((n for n in nodes.values() if n["dims"]), key=lambda n: n["us"], default=None)
    gemm_us = counted_us + uncounted_us
    return {
        "runs": runs, "kernel_ms_per_run": total / runs / 1e3, "by_op": by_op, "top_nodes": top_nodes,
        "gemm": {"share": share(gemm_us), "ms_per_run": gemm_us / runs / 1e3,
                 "gflop_per_run": counted_flops / runs / 1e9,
                 "gflops": counted_flops / counted_us / 1e3 if counted_us > 0 else math.nan,
                 "uncounted_ms_per_run": uncounted_us / runs / 1e3,
                 "heaviest": {"node": heavy["node"], "op_type": heavy["op_type"], "m": heavy["dims"][0],
                              "k": heavy["dims"][1], "n": heavy["dims"][2]} if heavy else None},
    }


def _best_gflops(fn: Callable[[], Any], flops: float, min_time_s: float, min_runs: int = 3) -> float:
    fn()
    best, runs, start = math.inf, 0, time.perf_counter()
    while runs < min_runs or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return flops / best / 1e9


def gemm_ceiling(m: int, k: int, n: int, *, threads: int = 1, min_time_s: float = 0.5,
                 max_flops: float = 2e9) -> dict[str, Any]:
    """The best GFLOP/s of a float32 ``[m, k] x [k, n]`` product with ``threads`` threads: an onnxruntime MatMul
    (the same MLAS kernels the graph uses) and numpy's BLAS (only when ``threadpoolctl`` can limit its threads).
    ``m`` shrinks until one product is at most ``max_flops``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from ..export.quantize_calibration import session

    if math.isfinite(max_flops):
        m = min(int(m), int(max_flops // max(1, 2 * k * n)))
    m = max(1, int(m))
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    flops = 2.0 * m * k * n
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "gemm_ceiling",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [m, n])],
                              [numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 8)
    onnx.checker.check_model(model)
    sess = session(model, threads)
    out: dict[str, Any] = {"m": m, "k": k, "n": n, "threads": threads,
                           "onnxruntime_gflops": _best_gflops(lambda: sess.run(None, {"a": a}), flops, min_time_s)}
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        out["numpy_gflops"], out["numpy_note"] = math.nan, "threadpoolctl not installed: numpy BLAS not limited"
    else:
        with threadpool_limits(limits=threads, user_api="blas"):
            out["numpy_gflops"] = _best_gflops(lambda: a @ b, flops, min_time_s)
    vals = [v for v in (out["onnxruntime_gflops"], out["numpy_gflops"]) if not math.isnan(v)]
    out["gflops"] = max(vals)
    return out


# --------------------------------------------------------------------------------------------- the profile


def _server_rows(report: Mapping[str, Any], graph: str) -> list[dict[str, Any]]:
    """Triton's figures of ``graph`` in the load test, per run at the report's concurrency."""
    out = []
    users = report.get("users")
    for r in report.get("runs", []):
        s = (r.get("stages") or {}).get(graph)
        if r.get("users") != users or not s or not s.get("avg_batch"):
            continue
        conv = next((v.get("requests") for k, v in r["stages"].items() if k == "cosyvoice_vc"), None) or r.get(
            "requests")
        rows = float(s["executions"]) * float(s["avg_batch"])
        served = str(report.get("rendered", {}).get(r["column"], {}).get("models", {}).get(graph, ""))
        runtime = m.group(1) if (m := re.search(r"\((\w+)", served)) else ""
        out.append({"column": r["column"], "protocol": r["protocol"], "runtime": runtime,
                    "avg_batch": float(s["avg_batch"]),
                    "compute_ms": float(s["compute_ms"]), "ms_per_row": float(s["compute_ms"]) / float(s["avg_batch"]),
                    "rows_per_conversion": rows / conv if conv else math.nan,
                    "req_per_s": r.get("req_per_s")})
    return out


def conclusion(p: Mapping[str, Any]) -> str:
    """One or two sentences from the numbers of a profile (see :func:`profile_stage`)."""
    g = p["graph"]
    sweep = p.get("rows_sweep") or []
    parts = []
    flat = False
    if len(sweep) >= 2:
        lo, hi = sweep[0], sweep[-1]
        ratio = hi["ms_per_row"] / lo["ms_per_row"] if lo["ms_per_row"] > 0 else math.nan
        flat = ratio >= FLAT
        if flat:
            trend = "is flat" if ratio <= 1 / FLAT else "rises"
            parts.append(f"Per-row time of `{g}` {trend} from {lo['rows']} to {hi['rows']} rows "
                         f"({lo['ms_per_row']:.1f} -> {hi['ms_per_row']:.1f} ms per row, x{ratio:.2f}): batching "
                         f"amortises nothing on this CPU")
        else:
            parts.append(f"Per-row time of `{g}` falls from {lo['ms_per_row']:.1f} to {hi['ms_per_row']:.1f} ms "
                         f"({(ratio - 1) * 100:+.0f}%) from {lo['rows']} to {hi['rows']} rows: batching amortises "
                         f"part of each call")
    k = p.get("kernels") or {}
    gemm, same = k.get("gemm") or {}, p.get("ceiling") or {}
    ceil = p.get("peak") or same
    eff = gemm.get("gflops", math.nan) / ceil["gflops"] if ceil.get("gflops") else math.nan
    if not math.isnan(eff):
        share = gemm.get("share", math.nan)
        rate = (f"{gemm['gflops']:.1f} GFLOP/s, {eff * 100:.0f}% of the {ceil['threads']}-thread GEMM peak "
                f"measured here ({ceil['gflops']:.1f} GFLOP/s"
                + (f"; {same['gflops']:.1f} at the heaviest node's size)" if p.get("peak") and same.get("gflops")
                   else ")"))
        others = ", ".join([f"{o['op_type']} {o['share'] * 100:.0f}%" for o in k.get("by_op", [])
                            if o["op_type"] not in GEMM_LIKE][:3])
        if eff >= COMPUTE_BOUND and share >= COMPUTE_BOUND:
            parts.append(f"MatMul/Gemm/Conv take {share * 100:.0f}% of its kernel time at {rate}: the stage is "
                         f"compute-bound on its {ceil['threads']} thread(s)")
        elif eff >= COMPUTE_BOUND:
            parts.append(f"MatMul/Gemm/Conv run at {rate} but take only {share * 100:.0f}% of its kernel time; "
                         f"element-wise and other kernels take the rest ({others})")
        else:
            parts.append(f"MatMul/Gemm/Conv ({share * 100:.0f}% of its kernel time) run at only {rate}"
                         + (f"; other kernels: {others}" if others else ""))
    cap = p.get("capacity")
    if cap:
        parts.append(f"at {cap['rows_per_conversion']:.0f} rows per conversion it needs "
                     f"{cap['core_s_per_conversion']:.2f} core-s per conversion, so {cap['cores']} cores convert "
                     f"at most "
                     f"{cap['max_conversions_per_s']:.1f} per second from this stage alone (load test: "
                     f"{cap['measured_req_per_s']:.2f})")
    text = "; ".join(parts) + "." if parts else "No figures."
    if flat:
        text += (" With one thread per instance a call's time grows with its rows, so more rows per call cannot add "
                 "throughput on this CPU; batching pays where a call's time does not grow with its rows (a GPU).")
    return text[0].upper() + text[1:]


def profile_stage(repo: str | Path, report: Mapping[str, Any], *, source_s: float, prompt_s: float,
                  graph: str | None = None, rows: Sequence[int] = ROWS, profile_runs: int = 3,
                  ceiling_s: float = 0.5, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Profile the slowest graph of the integrated column (or ``graph``) as served from ``repo`` (the rendered
    integrated repository), shaped like the load test of ``report`` (the JSON report: per-model statistics)
    whose workload has mean source ``source_s`` and prompt ``prompt_s`` seconds. Returns the JSON section."""
    from ..export.quantize_sensitivity import kernel_events, profile_trace
    from ..shapes import GRAPHS

    t_start = time.time()
    chosen, overall = slowest_graph(report)
    if graph and graph not in PROFILED_GRAPHS:
        raise ValueError(f"profiled graphs: {PROFILED_GRAPHS}, got {graph!r}")
    notes = []
    if graph and graph != overall:
        notes.append(f"`{graph}` as asked; the slowest leaf model of the integrated column is `{overall or 'n/a'}`")
    elif not graph and overall and overall != chosen:
        notes.append(f"the slowest leaf model is `{overall}`; `{chosen}` is the slowest of the profiled graphs")
    graph = graph or chosen
    path, precision, threads = served_onnx(repo, graph)
    hift_source = served_onnx(repo, "hift_source")[0] if graph == "hift_decoder" else None
    spec = GRAPHS[graph]
    lo_b, hi_b = spec.axes["batch"].min, spec.axes["batch"].max
    avg = measured_batch(report, graph)
    batch = min(hi_b, max(lo_b, round(avg))) if not math.isnan(avg) else lo_b
    if math.isnan(avg):
        notes.append(f"no per-model statistics for `{graph}` in the report: {batch} rows profiled")
    length = graph_length(graph, source_s, prompt_s)
    cache: dict[int, dict[str, np.ndarray]] = {}

    def feeds_for(b: int) -> dict[str, np.ndarray]:
        if b not in cache:
            cache[b] = graph_feeds(graph, b, length, hift_source=hift_source)
        return cache[b]

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    progress(f"== profile: {graph} ({precision}, {path}), {threads} intra-op thread(s), {batch} rows x {length}")
    sweep_rows = sorted({b for b in (*rows, batch) if lo_b <= b <= hi_b})
    sweep = time_per_row(path, feeds_for, sweep_rows, threads=threads)
    progress("   per row: " + ", ".join(f"{s['rows']} rows {s['ms_per_row']:.1f} ms" for s in sweep))
    events = kernel_events(profile_trace(path, [feeds_for(batch)], threads=threads, runs=profile_runs, warmup=1),
                           skip_runs=1)
    kernels = summarize_kernels(events, profile_runs)
    heavy = kernels["gemm"]["heaviest"]
    ceiling = gemm_ceiling(heavy["m"], heavy["k"], heavy["n"], threads=max(1, threads), min_time_s=ceiling_s) \
        if heavy else {}
    peak = gemm_ceiling(*PEAK_GEMM, threads=max(1, threads), min_time_s=ceiling_s, max_flops=math.inf)
    at = next(s for s in sweep if s["rows"] == batch)
    server = _server_rows(report, graph)
    integ = [s for s in server if s["column"] == "integrated"]
    capacity = None
    if integ:
        rpc = float(np.mean([s["rows_per_conversion"] for s in integ]))
        core_s = rpc * at["ms_per_row"] / 1e3
        cores = os.cpu_count() or 1
        rps = [float(s["req_per_s"]) for s in integ if s.get("req_per_s") is not None]
        capacity = {"rows_per_conversion": rpc, "core_s_per_conversion": core_s, "cores": cores,
                    "max_conversions_per_s": cores / core_s if core_s > 0 else math.nan,
                    "measured_req_per_s": float(np.mean(rps)) if rps else math.nan}
    out = {
        "graph": graph, "onnx": str(path), "precision": precision, "threads": threads, "rows": batch,
        "measured_avg_batch": avg, "length": length, "length_axis": next(
            d if isinstance(d, str) else d[0] for d in spec.inputs[0].shape[1:] if not isinstance(d, int)),
        "input_shapes": {k: list(v.shape) for k, v in feeds_for(batch).items()},
        "source_s": source_s, "prompt_s": prompt_s, "rows_sweep": sweep, "kernels": kernels, "ceiling": ceiling,
        "peak": peak,
        "server": server, "capacity": capacity, "load_average": load, "notes": notes,
    }
    out["duration_s"] = time.time() - t_start
    out["conclusion"] = conclusion(out)
    return out


# ------------------------------------------------------------------------------------------------ markdown


def _f(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:,.{digits}f}"


def profile_markdown(p: Mapping[str, Any]) -> list[str]:
    """The report's section (markdown lines) from :func:`profile_stage`'s JSON (or ``{"error": ...}``)."""
    if not p:
        return []
    if p.get("error"):
        return ["## Profile of the slowest stage", "", f"Not profiled: {p['error']}", ""]
    g = p["graph"]
    shapes = ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in p.get("input_shapes", {}).items())
    out = [f"## Profile of the slowest stage: `{g}` (onnxruntime CPU, outside the server)", "",
           f"- file served by the integrated column: `{p['onnx']}` ({p['precision']}), {p['threads']} intra-op "
           f"thread(s) like the served instance",
           f"- inputs: {p['rows']} rows (measured average batch {_f(p.get('measured_avg_batch'), 2)}) x {p['length']} "
           f"{p.get('length_axis', '')} (workload mean source {_f(p.get('source_s'), 2)} s + prompt "
           f"{_f(p.get('prompt_s'), 2)} s): {shapes}",
           f"- load average (1 min) when profiled: {_f(p.get('load_average'), 2)}; profile took "
           f"{_f(p.get('duration_s'), 0)} s", ""]
    sweep = p.get("rows_sweep") or []
    if sweep:
        out += ["| rows | ms per call (median) | ms per row | calls timed |", "|---:|---:|---:|---:|"]
        out += [f"| {s['rows']} | {_f(s['ms_per_call'])} | {_f(s['ms_per_row'], 2)} | {s['runs']} |" for s in sweep]
        out.append("")
    server = p.get("server") or []
    if server:
        out.append("In the load test (Triton's compute time per execution): " + "; ".join(
            f"{s['column']} {s['protocol']}{' (' + s['runtime'] + ')' if s.get('runtime') else ''} "
            f"{_f(s['compute_ms'])} ms at {_f(s['avg_batch'], 2)} rows "
            f"({_f(s['ms_per_row'], 2)} ms per row)" for s in server) + ".")
        out.append("")
    k = p.get("kernels") or {}
    if k:
        wall = next((s["ms_per_call"] for s in sweep if s["rows"] == p["rows"]), None)
        out += [f"onnxruntime profiler, {p['rows']} rows, {k['runs']} runs after a warm-up: "
                f"{_f(k['kernel_ms_per_run'])} ms of kernel time per run"
                + (f" (wall time per call without the profiler: {_f(wall)} ms)." if wall else "."), "",
                "| op type | share of kernel time | ms per run | nodes | GFLOP/s |", "|---|---:|---:|---:|---:|"]
        out += [f"| {o['op_type']} | {_f(o['share'] * 100)}% | {_f(o['ms_per_run'], 2)} | {o['nodes']} | "
                f"{_f(o['gflops'])} |" for o in k["by_op"][:12]]
        if len(k["by_op"]) > 12:
            rest = k["by_op"][12:]
            out.append(f"| {len(rest)} other op types | {_f(sum(o['share'] for o in rest) * 100)}% | "
                       f"{_f(sum(o['ms_per_run'] for o in rest), 2)} | {sum(o['nodes'] for o in rest)} | |")
        out += ["", "| top node | op type | share of kernel time | ms per run |", "|---|---|---:|---:|"]
        out += [f"| `{n['node']}` | {n['op_type']} | {_f(n['share'] * 100)}% | {_f(n['ms_per_run'], 2)} |"
                for n in k["top_nodes"]]
        out.append("")
        gm, same, peak = k["gemm"], p.get("ceiling") or {}, p.get("peak") or {}
        line = (f"MatMul/Gemm/Conv kernels: {_f(gm['share'] * 100)}% of kernel time, {_f(gm['gflop_per_run'], 2)} "
                f"GFLOP per run at {_f(gm['gflops'])} GFLOP/s")
        if gm.get("uncounted_ms_per_run"):
            line += f" ({_f(gm['uncounted_ms_per_run'], 2)} ms per run whose shapes the profiler did not give left out)"
        out += [line + ".", ""]
        for label, c in (("the heaviest node's size", same), ("the peak", peak)):
            if c:
                out.append(f"- GEMM ceiling measured in the same run, {label}: [{c['m']} x {c['k']}] x [{c['k']} x "
                           f"{c['n']}], {c['threads']} thread(s): onnxruntime MatMul {_f(c['onnxruntime_gflops'])} "
                           f"GFLOP/s, numpy {_f(c['numpy_gflops'])} GFLOP/s"
                           + (f" ({c['numpy_note']})" if c.get("numpy_note") else ""))
        out.append("")
    out += [f"Conclusion: {p.get('conclusion') or conclusion(p)}", ""]
    out += [f"- {n}" for n in p.get("notes", [])]
    return out + ([""] if p.get("notes") else [])
