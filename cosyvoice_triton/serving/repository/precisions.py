"""The precision each graph is served in (:func:`precision_plan`, the quality report's ``cpu-choice``) and the
ONNX files that serve it (fallback, I/O check, placement in the repository)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from ...export.trt import EXCLUDED
from ...export.trt import ONNX_FALLBACK as TRT_ONNX_FALLBACK
from ...export.trt import PRECISIONS as TRT_PRECISIONS
from ...shapes import (
    ALL_GRAPHS,
    GRAPHS,
)
from .templates import (
    RenderError,
)
from .tunables import (
    Tunables,
)

log = logging.getLogger(__name__)


FLAVORS = ("local", "onnx", "trt")


#: Precisions a graph can be served in: the TensorRT ones (:data:`cosyvoice_triton.export.trt.PRECISIONS`) and
#: ``int8_cpu``, onnxruntime's CPU INT8 kernels (``build/onnx/int8_cpu``: MatMulInteger, QLinearConv), which only
#: the ``local`` flavor serves (on a GPU, TensorRT takes the explicit Q/DQ ``int8`` graphs instead).
PRECISIONS = (*TRT_PRECISIONS, "int8_cpu")
FLAVOR_PRECISIONS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "local": PRECISIONS, "onnx": TRT_PRECISIONS, "trt": TRT_PRECISIONS})
#: ONNX folders tried, in order, when one precision is asked for every graph (an explicit per-graph choice
#: takes its own folder or fails). ``int8_cpu`` falls back to fp32 only: fp16 runs slower on a CPU.
ONNX_FALLBACK: Mapping[str, tuple[str, ...]] = MappingProxyType({**TRT_ONNX_FALLBACK, "int8_cpu": ("int8_cpu", "fp32")})
#: ``precision`` value that reads the CPU precision per graph from the quality report's decisions.
CPU_CHOICE = "cpu-choice"
DEFAULT_QUALITY_REPORT = "build/quality/report.json"
#: Graphs whose ONNX file is always the fp32 one, whatever the precision (phase accumulation in float64/32).
FP32_ONLY = ("hift_source",)
#: Graphs that ``runtime=torch`` (flavor local) runs as the checkpoint's PyTorch modules instead of ONNX.
TORCH_GRAPHS = ("flow_encoder", "flow_estimator", "hift_source", "hift_decoder")


@dataclass(frozen=True)
class PrecisionPlan:
    """The precision asked of each graph: ``graphs`` (graph -> precision); ``strict``: a per-graph choice, whose
    file must exist (no fallback); ``source``: where the choice comes from, for the configs' notes."""

    graphs: Mapping[str, str]
    strict: bool
    source: str

    def describe(self, graph: str) -> str:
        return f"{self.graphs[graph]} ({self.source})"


def _check_allowed(graph: str, precision: str, flavor: str) -> None:
    if precision not in PRECISIONS:
        raise RenderError(f"precision of {graph}: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision not in FLAVOR_PRECISIONS[flavor]:
        raise RenderError(f"precision {precision} ({graph}): int8_cpu is onnxruntime's CPU INT8, served by the local "
                          f"flavor only; flavor {flavor} serves {', '.join(FLAVOR_PRECISIONS[flavor])} (int8: the "
                          "Q/DQ graphs)")


def _per_graph(choice: Mapping[str, str], flavor: str, source: str) -> PrecisionPlan:
    from ...export.quantize_rules import FP32_ONLY as NOT_CONVERTED  # why each graph has no reduced-precision file

    unknown = sorted(set(choice) - set(GRAPHS))
    if unknown:
        raise RenderError(f"precision ({source}): unknown graph(s) {', '.join(unknown)}; graphs: {', '.join(GRAPHS)}")
    for graph, p in choice.items():
        _check_allowed(graph, p, flavor)
        if p != "fp32" and (graph in FP32_ONLY or graph in NOT_CONVERTED):
            why = NOT_CONVERTED.get(graph, "float64 phase accumulation")
            raise RenderError(f"precision ({source}): {graph} is served in fp32 only, got {p} ({why})")
    return PrecisionPlan(MappingProxyType({g: choice.get(g, "fp32") for g in GRAPHS}), True, source)


def parse_precision_mapping(text: str) -> dict[str, str]:
    """``"flow_encoder=int8_cpu,flow_estimator=fp32"`` -> a dict (graphs not named: fp32)."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        graph, sep, p = (s.strip() for s in part.partition("="))
        if not sep or not graph or not p:
            raise RenderError(f"precision mapping {text!r}: expected GRAPH=PRECISION[,GRAPH=PRECISION...], got "
                              f"{part!r}")
        if graph in out and out[graph] != p:
            raise RenderError(f"precision mapping {text!r}: {graph} given twice")
        out[graph] = p
    if not out:
        raise RenderError(f"precision mapping {text!r} names no graph")
    return out


def read_cpu_choice(report: str | Path) -> dict[str, str]:
    """Graph -> CPU precision from a quality report's ``decisions`` (``export/quality_report.py``, ``make
    quality``: ``build/quality/report.json``)."""
    path = Path(report)
    if not path.is_file():
        raise RenderError(f"precision {CPU_CHOICE}: quality report {path} not found (make quality writes it, or "
                          "give --quality-report PATH, or name the precisions: GRAPH=PRECISION,...)")
    try:
        doc = json.loads(path.read_text())
        decisions = doc["decisions"]
        choice = {str(d["stage"]): str(d["cpu_precision"]) for d in decisions}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RenderError(f"precision {CPU_CHOICE}: {path} is not a quality report with decisions "
                          f"[{{stage, cpu_precision}}, ...] ({type(exc).__name__}: {exc})") from exc
    if not choice:
        raise RenderError(f"precision {CPU_CHOICE}: {path} has no decisions")
    return choice


def precision_plan(precision: str | Mapping[str, str], flavor: str, *,
                   quality_report: str | Path = DEFAULT_QUALITY_REPORT) -> PrecisionPlan:
    """What each graph is asked to be served in. ``precision``: one of :data:`PRECISIONS` for every graph (the
    :data:`FP32_ONLY` graphs stay fp32; a missing file falls back along :data:`ONNX_FALLBACK`); ``cpu-choice``:
    the quality report's CPU decision per graph (flavor ``local``); ``GRAPH=PRECISION,...`` or a mapping: those
    graphs in those precisions, the others fp32. Per-graph choices need their files."""
    if flavor not in FLAVOR_PRECISIONS:
        raise RenderError(f"flavor must be one of {', '.join(FLAVORS)}, got {flavor!r}")
    if isinstance(precision, Mapping):
        return _per_graph(dict(precision), flavor, "per graph")
    if precision == CPU_CHOICE:
        if flavor != "local":
            raise RenderError(f"precision {CPU_CHOICE} is the quality report's CPU choice (onnxruntime on the CPU, "
                              f"flavor local); flavor {flavor} runs the graphs on the GPU: give fp16 / int8 or "
                              "GRAPH=PRECISION,...")
        return _per_graph(read_cpu_choice(quality_report), flavor, f"{CPU_CHOICE} of {quality_report}")
    if "=" in precision:
        return _per_graph(parse_precision_mapping(precision), flavor, "per graph")
    if precision not in PRECISIONS:
        raise RenderError(f"precision must be one of {', '.join(PRECISIONS)}, {CPU_CHOICE} or GRAPH=PRECISION,..., "
                          f"got {precision!r}")
    _check_allowed("every graph", precision, flavor)
    return PrecisionPlan(MappingProxyType({g: "fp32" if g in FP32_ONLY else precision for g in GRAPHS}), False,
                         f"{precision} for every graph" + (f"; {', '.join(FP32_ONLY)} fp32 only" if precision != "fp32"
                                                           else ""))


def _check_plan(plan: PrecisionPlan, flavor: str, onnx_dir: Path, tun: Tunables, allow_missing: bool) -> None:
    """A per-graph choice needs its ONNX file (where the flavor reads one); ``runtime=torch`` graphs are fp32."""
    for name, asked in plan.graphs.items():
        torch_run = flavor == "local" and tun.runtime == "torch" and name in TORCH_GRAPHS
        if torch_run and asked != "fp32":
            raise RenderError(f"{name}: runtime=torch runs the checkpoint's fp32 modules; precision "
                              f"{plan.describe(name)} applies to ONNX graphs (runtime=onnxruntime)")
        path = _onnx_file(onnx_dir, name, asked, strict=True)
        needs_file = not torch_run and (flavor != "trt" or name in EXCLUDED)
        if plan.strict and needs_file and not allow_missing and not path.is_file():
            raise RenderError(f"{path} not found: {name} is to be served in {plan.describe(name)} "
                              f"({'make quantize' if asked != 'fp32' else 'make export'} first)")


def _onnx_file(onnx_dir: Path, graph: str, precision: str, *, strict: bool = False) -> Path:
    """``<onnx_dir>/<precision>/<graph>.onnx``; not strict: the first that exists along :data:`ONNX_FALLBACK`
    (else the fp32 path, missing)."""
    if strict:
        return onnx_dir / precision / f"{graph}.onnx"
    for p in ONNX_FALLBACK[precision]:
        path = onnx_dir / p / f"{graph}.onnx"
        if path.is_file():
            return path
    return onnx_dir / "fp32" / f"{graph}.onnx"


_ONNX_ELEM = {1: "float32", 6: "int32", 7: "int64", 9: "bool", 10: "float16"}


def check_onnx_io(path: Path, graph: str) -> None:
    """The file's input / output names and element types must be the spec's (a converted fp16 file must keep
    float32 I/O), or the Triton config rendered from the spec would not load it."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    spec = ALL_GRAPHS[graph]
    for kind, declared, values in (("input", spec.inputs, model.graph.input), ("output", spec.outputs,
                                                                               model.graph.output)):
        got = {v.name: _ONNX_ELEM.get(v.type.tensor_type.elem_type, str(v.type.tensor_type.elem_type))
               for v in values}
        for t in declared:
            if got.get(t.name) != t.dtype:
                raise RenderError(f"{path}: {kind} {t.name!r} is {got.get(t.name, 'absent')}, the spec says "
                                  f"{t.dtype} (convert with float32 I/O kept, e.g. keep_io_types=True)")


def _place(src: Path, dst: Path, allow_missing: bool) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not src.is_file():
        if not allow_missing:
            raise RenderError(f"{src} not found (make export / make engines first)")
        dst.write_bytes(b"")  # structural render: an empty placeholder where the file will be
        return dst
    try:
        os.link(src, dst)  # same file system: no copy of a large graph
    except OSError:
        shutil.copy2(src, dst)
    return dst


def _warn_foreign_report(report: str | Path, model_dir: Path, onnx_dir: Path) -> None:
    """Log a warning when the quality report behind ``cpu-choice`` judged another model or other graphs."""
    try:
        doc = json.loads(Path(report).read_text())
    except (OSError, ValueError):
        return
    for key, ours in (("model_dir", model_dir), ("onnx_root", onnx_dir)):
        theirs = doc.get(key)
        if theirs and Path(theirs).resolve() != ours:
            log.warning("precision %s: %s was measured with %s %s, this render uses %s: its decisions may not hold "
                        "for these graphs (make quality MODEL_DIR=... to measure them)", CPU_CHOICE, report, key,
                        theirs, ours)
