"""The sensitivity pass the INT8 rules come from (:func:`sensitivity`): calibrate once, quantize one group
of layers at a time, measure the output error on held-out speech and the group's share of the fp32 time
(onnxruntime's profiler: :func:`profile_trace`, :func:`kernel_events`, :func:`node_time_share`)."""

from __future__ import annotations

import json
import logging
import math
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .quantize_calibration import Ranges, rel_rms, session
from .quantize_int8 import quantize_qdq
from .quantize_rules import INT8_KEEP_FLOAT, QDQ_OP_TYPES, SENSITIVITY_GROUPS, _group_nodes, keep_float_nodes

log = logging.getLogger(__name__)

@dataclass
class GroupSensitivity:
    graph: str
    group: str
    nodes: int
    time_share: float  # fraction of the fp32 graph's node time spent in the group's nodes
    rel_rms: float  # graph output error with only this group in INT8
    kept_float: bool  # the group is (partly) kept float by INT8_KEEP_FLOAT


@dataclass(frozen=True)
class KernelEvent:
    """One node execution in an onnxruntime profile: the node (fused nodes under the fused name), its op type,
    the kernel time and the tensors' dtypes and shapes as the profiler records them (constant weights the
    kernel pre-packed are often left out of ``inputs``)."""

    name: str
    op_type: str
    dur_us: float
    inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    outputs: tuple[tuple[str, tuple[int, ...]], ...] = ()


def _shapes(items: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    out = []
    for item in items or ():
        for dtype, shape in dict(item).items():
            out.append((str(dtype), tuple(int(d) for d in shape)))
    return tuple(out)


def kernel_events(trace: Sequence[Mapping[str, Any]], *, skip_runs: int = 0) -> list[KernelEvent]:
    """The node kernel events of an onnxruntime profile trace (``SessionOptions.enable_profiling``), leaving out
    those of the first ``skip_runs`` runs (warm-up; runs are the ``model_run`` session events)."""
    ends = sorted(float(e.get("ts", 0)) + float(e.get("dur", 0)) for e in trace
                  if e.get("cat") == "Session" and e.get("name") == "model_run")
    start = ends[skip_runs - 1] if 0 < skip_runs <= len(ends) else -math.inf
    out = []
    for ev in trace:
        name = str(ev.get("name", ""))
        if ev.get("cat") != "Node" or not name.endswith("_kernel_time") or float(ev.get("ts", 0)) < start:
            continue
        args = ev.get("args") or {}
        out.append(KernelEvent(name[: -len("_kernel_time")], str(args.get("op_name", "")), float(ev.get("dur", 0)),
                               _shapes(args.get("input_type_shape")), _shapes(args.get("output_type_shape"))))
    return out


def profile_trace(model_path: str | Path, feeds: Sequence[Mapping[str, np.ndarray]], *, threads: int = 1,
                  runs: int = 2, warmup: int = 1) -> list[dict[str, Any]]:
    """The onnxruntime profile trace of ``warmup`` then ``runs`` passes over ``feeds`` (one session)."""
    with tempfile.TemporaryDirectory(prefix="cosyvoice-prof-") as tmp:
        sess = session(model_path, threads, profile=str(Path(tmp) / "p"))
        for _ in range(warmup + runs):
            for f in feeds:
                sess.run(None, dict(f))
        return json.loads(Path(sess.end_profiling()).read_text())


def node_time_share(model_path: str | Path, feeds: Sequence[Mapping[str, np.ndarray]], *, threads: int = 1,
                    runs: int = 2) -> dict[str, float]:
    """Fraction of the fp32 graph's kernel time spent in each node (onnxruntime profiler, ``runs`` calls per
    feed after one warm-up). Fused nodes report under the fused name; the MatMul/Conv names survive."""
    per: dict[str, float] = {}
    for ev in kernel_events(profile_trace(model_path, feeds, threads=threads, runs=runs)):
        per[ev.name] = per.get(ev.name, 0.0) + ev.dur_us
    total = sum(per.values()) or 1.0
    return {k: v / total for k, v in per.items()}


def _outputs(sess, feeds: Sequence[Mapping[str, np.ndarray]]) -> list[list[np.ndarray]]:
    return [sess.run(None, dict(f)) for f in feeds]


def output_error(ref: Sequence[Sequence[np.ndarray]], got: Sequence[Sequence[np.ndarray]]) -> float:
    """Relative RMS error of the first output over all samples (concatenated)."""
    a = np.concatenate([np.ravel(g[0]).astype(np.float64) for g in got])
    b = np.concatenate([np.ravel(r[0]).astype(np.float64) for r in ref])
    return rel_rms(a, b)


def sensitivity(graph: str, fp32_path: str | Path, ranges: Ranges, heldout: Sequence[Mapping[str, np.ndarray]], *,
                threads: int = 1, groups: Mapping[str, str] | None = None,
                progress: Callable[[str], None] | None = None) -> list[GroupSensitivity]:
    """Per layer group (``groups``, default :data:`SENSITIVITY_GROUPS` of ``graph``): the output error on
    ``heldout`` inputs when only that group is INT8 (Q/DQ, the given ranges), its share of the fp32 time (ORT
    profiler), and whether the rules keep it float. Rows ``all eligible`` (every weighted layer) and
    ``as shipped`` (all but :data:`INT8_KEEP_FLOAT`) come last."""
    model = onnx.load(str(fp32_path))
    say = progress or log.info
    ref = _outputs(session(model, threads), heldout)
    share = node_time_share(fp32_path, heldout[:2], threads=threads, runs=1)
    kept = keep_float_nodes(model, INT8_KEEP_FLOAT.get(graph, ()), op_types=QDQ_OP_TYPES)
    rows = []
    eligible = [n.name for n in model.graph.node if n.op_type in QDQ_OP_TYPES]

    def err(nodes: Sequence[str], keep: Mapping[str, str]) -> float:
        q = quantize_qdq(model, ranges, graph=graph, keep_float=keep, nodes_to_quantize=nodes)
        return output_error(ref, _outputs(session(q, threads), heldout))

    for group, pattern in (SENSITIVITY_GROUPS[graph] if groups is None else groups).items():
        nodes = _group_nodes(model, pattern, QDQ_OP_TYPES)
        if not nodes:
            continue
        e = err(nodes, {})
        t = sum(v for k, v in share.items() if re.search(pattern, k))
        rows.append(GroupSensitivity(graph, group, len(nodes), t, e, any(n in kept for n in nodes)))
        say(f"  sensitivity {graph} {group}: {len(nodes)} nodes, {t:.1%} of fp32 time, rel RMS {e:.2e}")
    t_all = sum(v for k, v in share.items() if k in set(eligible))
    rows.append(GroupSensitivity(graph, "all eligible", len(eligible), t_all, err(eligible, {}), False))
    shipped = [n for n in eligible if n not in kept]
    t_ship = sum(v for k, v in share.items() if k in set(shipped))
    rows.append(GroupSensitivity(graph, "as shipped (rules applied)", len(shipped), t_ship, err(shipped, kept), True))
    return rows


def format_sensitivity(rows: Sequence[GroupSensitivity]) -> str:
    head = "| graph | layer group | nodes | share of fp32 time | output rel RMS (only this group INT8) | kept float |"
    lines = [head, "| --- | --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {r.graph} | {r.group} | {r.nodes} | {r.time_share:.1%} | {r.rel_rms:.2e} | "
              f"{'yes' if r.kept_float else ''} |" for r in rows]
    return "\n".join(lines)
