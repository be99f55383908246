"""INT8 of one ONNX graph: explicit Q/DQ, S8S8 symmetric with per-channel weights (:func:`quantize_qdq`,
TensorRT's INT8), and onnxruntime's CPU INT8 by the graph's recipe (:func:`quantize_cpu_int8`: dynamic
MatMulInteger or static U8S8 QLinearConv)."""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx

from .quantize_calibration import Ranges
from .quantize_manifest import _mark
from .quantize_rules import CPU_INT8, INT8_KEEP_FLOAT, QDQ_OP_TYPES, CpuInt8Recipe, keep_float_nodes


def _qdq_options() -> dict[str, Any]:
    return {
        "ActivationSymmetric": True,  # int8 activations with zero point 0 (TensorRT's only INT8 form)
        "WeightSymmetric": True,
        # Q/DQ on the inputs of the weighted layers only (TensorRT's recommended placement): their outputs stay
        # float, TensorRT fuses DQ -> Conv/MatMul (-> Q of the next layer) itself
        "OpTypesToExcludeOutputQuantization": list(QDQ_OP_TYPES),
        "QDQKeepRemovableActivations": True,
        "DedicatedQDQPair": False,
        # biases stay float: TensorRT takes no int32 DequantizeLinear, and adds a float bias after the int8 GEMM
        "QuantizeBias": False,
    }


def quantize_qdq(fp32: str | Path | onnx.ModelProto, ranges: Ranges, *, graph: str,
                 keep_float: Mapping[str, str] | None = None, nodes_to_quantize: Sequence[str] | None = None,
                 op_types: Sequence[str] = QDQ_OP_TYPES, per_channel: bool = True) -> onnx.ModelProto:
    """The explicit Q/DQ INT8 model: S8 weights (symmetric, per output channel), S8 activations (symmetric,
    per tensor, zero point 0), Q/DQ on the inputs of ``op_types`` nodes except those in ``keep_float``
    (default: :data:`INT8_KEEP_FLOAT` of ``graph``). ``nodes_to_quantize`` restricts to those nodes."""
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
    from onnxruntime.quantization.quant_utils import load_model_with_shape_infer

    model = fp32 if isinstance(fp32, onnx.ModelProto) else onnx.load(str(fp32))
    if keep_float is None:
        keep_float = keep_float_nodes(model, INT8_KEEP_FLOAT.get(graph, ()), op_types=op_types)
    with tempfile.TemporaryDirectory(prefix="cosyvoice-qdq-") as tmp:
        path = Path(tmp) / "in.onnx"
        onnx.save(model, str(path))
        inferred = load_model_with_shape_infer(path)
    quantizer = QDQQuantizer(inferred, per_channel, False, QuantType.QInt8, QuantType.QInt8,
                             ranges.tensors_data(), list(nodes_to_quantize or []), sorted(keep_float),
                             list(op_types), _qdq_options())
    with _quiet_logging():
        quantizer.quantize_model()
    out = quantizer.model.model
    _mark(out, graph, "int8", {"method": ranges.method, "format": "QDQ S8S8 symmetric, per-channel weights"})
    return out


def cpu_lacks_vnni(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True on an x86 CPU without VNNI (neither AVX512_VNNI nor AVX_VNNI): there onnxruntime's U8S8 kernels
    multiply through 16-bit intermediates that saturate, and 7-bit weights (``reduce_range``) avoid it. Measured on
    the tiny demo model's hift_decoder (static QLinearConv): 0.23 relative error with 8-bit weights on an AVX2 CPU,
    within 0.15 with 7-bit ones. False where the flags cannot be read or the CPU is not x86."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    if not flags or "sse2" not in flags:  # not x86 (or unreadable)
        return False
    return not ({"avx512_vnni", "avx_vnni"} & set(flags))


def quantize_cpu_int8(fp32: str | Path | onnx.ModelProto, *, graph: str, ranges: Ranges | None = None,
                      recipe: CpuInt8Recipe | None = None, keep_float: Mapping[str, str] | None = None,
                      reduce_range: bool = False) -> onnx.ModelProto:
    """onnxruntime CPU INT8 per :data:`CPU_INT8` (or ``recipe``): ``dynamic`` -> S8 weights, activations
    quantized per call to U8 (DynamicQuantizeLinear -> MatMulInteger), no calibration; ``static`` -> QLinearConv
    with S8 weights and calibrated asymmetric U8 activations (``ranges`` from ``calibrate(symmetric=False)``).
    The :data:`INT8_KEEP_FLOAT` layers stay fp32. ``reduce_range``: 7-bit weights, for x86 CPUs without VNNI
    where U8S8 products can saturate 16-bit intermediates."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
    from onnxruntime.quantization.quant_utils import QuantizationMode, load_model_with_shape_infer

    recipe = recipe or CPU_INT8[graph]
    ops = list(recipe.op_types)
    model = fp32 if isinstance(fp32, onnx.ModelProto) else onnx.load(str(fp32))
    if keep_float is None:
        keep_float = keep_float_nodes(model, INT8_KEEP_FLOAT.get(graph, ()), op_types=ops)
    with tempfile.TemporaryDirectory(prefix="cosyvoice-cpu-int8-") as tmp:
        src, dst = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
        onnx.save(model, str(src))
        if recipe.kind == "dynamic":
            with _quiet_logging():
                quantize_dynamic(src, dst, op_types_to_quantize=ops, per_channel=recipe.per_channel,
                                 reduce_range=reduce_range, weight_type=QuantType.QInt8,
                                 nodes_to_exclude=sorted(keep_float), extra_options={"MatMulConstBOnly": True})
            out = onnx.load(str(dst))
        else:
            if ranges is None:
                raise ValueError(f"{graph}: the static CPU INT8 recipe needs calibrated ranges (symmetric=False)")
            inferred = load_model_with_shape_infer(src)
            quantizer = ONNXQuantizer(inferred, recipe.per_channel, reduce_range, QuantizationMode.QLinearOps, True,
                                      QuantType.QInt8, QuantType.QUInt8, ranges.tensors_data(), [],
                                      sorted(keep_float), ops, {"WeightSymmetric": True})
            with _quiet_logging():
                quantizer.quantize_model()
            out = quantizer.model.model
    _mark(out, graph, "int8_cpu", {"recipe": f"{recipe.kind} {'/'.join(ops)}"})
    return out


@contextlib.contextmanager
def _quiet_logging():
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)
