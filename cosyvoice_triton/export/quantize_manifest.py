"""What a precision folder records and how it is read: ``<precision>/manifest.json`` (per graph: source file
and digest, method, calibration, kept-float nodes; :func:`read_manifest`) and the count of layers a graph runs in
reduced precision (:func:`count_reduced`)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, helper

from ..shapes import GRAPHS
from .quantize_rules import FP32_ONLY, QDQ_OP_TYPES


def count_reduced(model: onnx.ModelProto, precision: str) -> int:
    """Layers running in reduced precision: weighted layers fed by a DequantizeLinear (int8), integer /
    QLinear kernels (int8_cpu), nodes with an fp16 output (fp16)."""
    g = model.graph
    if precision == "int8":
        dq_out = {n.output[0] for n in g.node if n.op_type == "DequantizeLinear"}
        return sum(1 for n in g.node if n.op_type in QDQ_OP_TYPES and any(i in dq_out for i in n.input))
    if precision == "int8_cpu":
        return sum(1 for n in g.node if n.op_type in ("MatMulInteger", "ConvInteger", "QLinearConv", "QLinearMatMul",
                                                      "DynamicQuantizeMatMul", "QGemm", "QLinearConvTranspose"))
    if precision == "fp16":
        fp16 = {v.name for v in (*g.value_info, *g.output) if v.type.tensor_type.elem_type == TensorProto.FLOAT16}
        return sum(1 for n in g.node if any(o in fp16 for o in n.output))
    return 0


def _save(model: onnx.ModelProto, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, path)


def _write_manifest(folder: Path, precision: str, entries: Mapping[str, Any], common: Mapping[str, Any], *,
                    graph_names: Sequence[str] = tuple(GRAPHS), fp32_only: Mapping[str, str] = FP32_ONLY) -> Path:
    """``folder/manifest.json``; entries of other graphs written earlier are kept while their file exists.
    ``graph_names``: the family's graphs, in the order written; ``fp32_only``: the graphs never converted, and why."""
    path = folder / "manifest.json"
    old: dict[str, Any] = {}
    if path.is_file():
        with contextlib.suppress(OSError, ValueError):
            old = json.loads(path.read_text(encoding="utf-8")).get("graphs", {})
    graphs = {k: v for k, v in old.items() if (folder / str(v.get("file", ""))).is_file() and k not in entries}
    graphs.update(entries)
    import onnxruntime

    doc = {"format": 1, "precision": precision, **common,
           "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "versions": {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
           "fp32_only": dict(fp32_only), "graphs": {g: graphs[g] for g in graph_names if g in graphs}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """A precision folder's manifest (empty dict when there is none)."""
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _mark(model: onnx.ModelProto, graph: str, precision: str, extra: Mapping[str, str]) -> None:
    props = {p.key: p.value for p in model.metadata_props}
    props.update({"cosyvoice_triton.graph": graph, "cosyvoice_triton.precision": precision, **extra})
    del model.metadata_props[:]
    helper.set_model_props(model, props)
