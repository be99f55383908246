"""fp16 of one ONNX graph (:func:`convert_fp16`): fp16 weights and math, fp32 inputs and outputs, the
precision-sensitive nodes of :data:`~.quantize_rules.FP16_KEEP_FLOAT` in fp32."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from .quantize_int8 import _quiet_logging
from .quantize_manifest import _mark
from .quantize_rules import FP16_KEEP_FLOAT, FP16_MASK_BIAS, FP32_ONLY, keep_float_nodes


def fp16_estimator_fp32(model_dir: str | Path, out_path: str | Path) -> onnx.ModelProto:
    """Re-export ``flow_estimator`` in fp32 with the finite attention mask bias :data:`FP16_MASK_BIAS` (the
    fp16 conversion's input; exact in fp32 since exp(-1e4) underflows to 0 like exp(-1e10))."""
    from .onnx_export import EstimatorGraph, export_graph, load_source_models

    models = load_source_models(model_dir, flow=True, hift=False)
    est = copy.deepcopy(models.flow.decoder.estimator)
    est.mask_bias = FP16_MASK_BIAS
    return export_graph(EstimatorGraph(est).eval(), "flow_estimator", out_path)


def convert_fp16(fp32: str | Path | onnx.ModelProto, *, graph: str,
                 keep_float: Mapping[str, str] | None = None) -> onnx.ModelProto:
    """fp16 weights and activations with fp32 inputs/outputs; the :data:`FP16_KEEP_FLOAT` nodes of ``graph``
    stay fp32 (casts at their borders). Uses onnxruntime's ``float16`` converter (onnxconverter-common's
    mistypes the estimator's ``Cast`` nodes and fails on the encoder). ``hift_source`` is refused
    (:data:`FP32_ONLY`). The estimator must come from :func:`fp16_estimator_fp32` (finite mask bias)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    if graph in FP32_ONLY:
        raise ValueError(f"{graph} stays fp32: {FP32_ONLY[graph]}")
    model = fp32 if isinstance(fp32, onnx.ModelProto) else onnx.load(str(fp32))
    if graph == "flow_estimator":
        big = _large_constants(model, 1e5)
        if big:
            raise ValueError(f"flow_estimator has constants beyond fp16 range ({big[:3]}): export it with "
                             f"mask_bias={FP16_MASK_BIAS:g} (fp16_estimator_fp32) before converting")
    if keep_float is None:
        keep_float = keep_float_nodes(model, FP16_KEEP_FLOAT.get(graph, ()))
    with _quiet_logging(), _no_warnings():
        out = convert_float_to_float16(copy.deepcopy(model), keep_io_types=True, node_block_list=sorted(keep_float),
                                       max_finite_val=65504.0, min_positive_val=5.96e-08)
    _mark(out, graph, "fp16", {"kept_fp32_nodes": str(len(keep_float))})
    return out


@contextlib.contextmanager
def _no_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _const_arrays(model: onnx.ModelProto) -> Iterator[tuple[str, np.ndarray]]:
    for init in model.graph.initializer:
        yield init.name, numpy_helper.to_array(init)
    for n in model.graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    yield n.output[0], numpy_helper.to_array(a.t)


def _large_constants(model: onnx.ModelProto, limit: float) -> list[str]:
    out = []
    for name, a in _const_arrays(model):
        if (a.dtype.kind == "f" and a.size and not np.all(np.isfinite(a))) or (
                a.dtype.kind == "f" and a.size and float(np.max(np.abs(a[np.isfinite(a)]), initial=0.0)) > limit):
            out.append(name)
    return out
