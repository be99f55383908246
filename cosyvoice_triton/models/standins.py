"""Stand-ins for ``speech_tokenizer_v2.onnx`` (CosyVoice3: ``speech_tokenizer_v3.onnx``) and ``campplus.onnx`` for
the demo model folders.

The real weights cannot be redistributed with (or downloaded by) this project's demo, so the demo folder
holds graphs with the official input/output signatures (names, dtypes, ranks, the 128/80/192 sizes and a
dynamic time axis; see ``cosyvoice_triton.frontend.speech_models``) and small random weights drawn from a seeded
generator. Their outputs are deterministic noise that still depends on the input:

* tokenizer: zero the frames past ``feats_length``; two ``Conv1d(k=3, s=2, p=1)`` + tanh layers (the real
  front end's ``T -> ceil(T / 4)`` subsampling), each followed by re-masking to the subsampled length; add
  the masked mean over time (a stand-in for attention's utterance-wide context); project to 8 dims and
  quantise like the real FSQ head (``round(0.999 * tanh) + 1`` in {0, 1, 2}, digits of a base-3 number),
  so tokens lie in ``[0, 6561)`` and a padded batch gives exactly the per-utterance tokens;
* CAM++: ``Conv1d`` + ReLU over time, then mean and standard deviation over *all* frames (statistics
  pooling, like the real model, so padding changes the result) and a linear layer to 192 dims.

Whether the released graphs declare a fixed (1) or symbolic batch axis has not been verified, and the
official front end only ever feeds one utterance; ``dynamic_batch=False`` (the default) writes a batch
axis fixed to 1, ``True`` a symbolic one. Each graph carries ``cosyvoice_triton.standin`` metadata.

The v3 stand-in (``version="v3"``) has the v2 signature, which is the v3 one as far as the official code shows
(see :mod:`cosyvoice_triton.frontend.speech_models`; the names are v2's), and weights of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..frontend.speech_models import (
    FBANK_BINS,
    SPEAKER_EMBED_DIM,
    STANDIN_METADATA_KEY,
    WHISPER_MEL_BINS,
)

OPSET = 17
IR_VERSION = 8  # the IR version released with opset 17; readable by onnxruntime >= 1.13

_TOKENIZER_CHANNELS = 32
_CAMPPLUS_CHANNELS = 64
_FSQ_DIMS = 8


class _Graph:
    """Small helper around ``onnx.helper`` that names nodes and constants uniquely."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._n = 0

    def _name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, value: np.ndarray, hint: str = "const") -> str:
        name = self._name(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, output: str | None = None,
           **attrs) -> str:
        out = output or self._name(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self._name(op_type), **attrs))
        return out

    def model(self, name: str, inputs, outputs, note: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="cosyvoice_triton.models.standins",
            doc_string=f"Stand-in for {name}: official signature, random weights ({note}). Not a real model.",
        )
        model.ir_version = IR_VERSION
        helper.set_model_props(model, {STANDIN_METADATA_KEY: note})
        onnx.checker.check_model(model, full_check=True)
        return model


def _save(model: onnx.ModelProto, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, path)
    return path


def _mask(g: _Graph, x: str, lengths: str) -> str:
    """``x [B, C, T]`` with frames ``t >= lengths[b]`` set to zero (``lengths`` int64 ``[B]``)."""
    t = g.op("Shape", [x], "t", start=2, end=3)
    t_scalar = g.op("Squeeze", [t, g.const(np.array([0], dtype=np.int64))], "t_scalar")
    zero, one = g.const(np.array(0, dtype=np.int64)), g.const(np.array(1, dtype=np.int64))
    steps = g.op("Range", [zero, t_scalar, one], "steps")
    col = g.op("Unsqueeze", [lengths, g.const(np.array([1], dtype=np.int64))], "len_col")
    keep = g.op("Less", [steps, col], "keep")  # [B, T]
    keep = g.op("Cast", [keep], "keep_f", to=TensorProto.FLOAT)
    keep = g.op("Unsqueeze", [keep, g.const(np.array([1], dtype=np.int64))], "keep_3d")
    return g.op("Mul", [x, keep], "masked")


def _subsampled(g: _Graph, lengths: str) -> str:
    """``(n - 1) // 2 + 1``: frames left after ``Conv1d(k=3, s=2, p=1)`` (``n >= 1``)."""
    one = g.const(np.array(1, dtype=np.int64))
    two = g.const(np.array(2, dtype=np.int64))
    return g.op("Add", [g.op("Div", [g.op("Sub", [lengths, one]), two]), one], "len_sub")


def _batch_dim(dynamic_batch: bool) -> str | int:
    return "batch" if dynamic_batch else 1


_TOKENIZER_STREAMS = {"v2": 0x5EEC, "v3": 0x5EED}


def speech_tokenizer_standin(*, seed: int = 0, dynamic_batch: bool = False, version: str = "v2") -> onnx.ModelProto:
    """The tokenizer stand-in (``version`` ``"v2"`` or ``"v3"``) as an in-memory ``ModelProto`` (see the module
    docstring)."""
    if version not in _TOKENIZER_STREAMS:
        raise ValueError(f"version must be one of {', '.join(_TOKENIZER_STREAMS)}, got {version!r}")
    rng = np.random.default_rng([seed, _TOKENIZER_STREAMS[version]])
    c = _TOKENIZER_CHANNELS
    g = _Graph()
    lengths = g.op("Cast", ["feats_length"], "len64", to=TensorProto.INT64)
    x = _mask(g, "feats", lengths)
    for layer, c_in in enumerate((WHISPER_MEL_BINS, c)):
        w = rng.normal(0.0, 1.5 / np.sqrt(3 * c_in), (c, c_in, 3)).astype(np.float32)
        b = rng.normal(0.0, 0.1, c).astype(np.float32)
        x = g.op("Conv", [x, g.const(w, f"conv{layer + 1}_w"), g.const(b, f"conv{layer + 1}_b")],
                 f"conv{layer + 1}", kernel_shape=[3], strides=[2], pads=[1, 1])
        x = g.op("Tanh", [x])
        lengths = _subsampled(g, lengths)
        x = _mask(g, x, lengths)
    # Utterance-wide context: masked mean over the valid token frames, added to every frame.
    total = g.op("ReduceSum", [x, g.const(np.array([2], dtype=np.int64))], "sum", keepdims=1)
    count = g.op("Cast", [lengths], "len_f", to=TensorProto.FLOAT)
    count = g.op("Reshape", [count, g.const(np.array([-1, 1, 1], dtype=np.int64))], "len_f3")
    x = g.op("Add", [x, g.op("Div", [total, count], "mean")], "with_context")
    x = g.op("Transpose", [x], "frames", perm=[0, 2, 1])  # [B, T_tok, C]
    proj_w = rng.normal(0.0, 2.0 / np.sqrt(c), (c, _FSQ_DIMS)).astype(np.float32)
    proj_b = rng.normal(0.0, 0.2, _FSQ_DIMS).astype(np.float32)
    h = g.op("MatMul", [x, g.const(proj_w, "project_down_w")])
    h = g.op("Add", [h, g.const(proj_b, "project_down_b")])
    h = g.op("Mul", [g.op("Tanh", [h]), g.const(np.array(0.999, dtype=np.float32))])
    digits = g.op("Add", [g.op("Round", [h]), g.const(np.array(1.0, dtype=np.float32))], "digits")
    powers = (3.0 ** np.arange(_FSQ_DIMS, dtype=np.float32)).reshape(_FSQ_DIMS, 1)
    index = g.op("MatMul", [digits, g.const(powers, "powers")], "index_f")  # [B, T_tok, 1]
    index = g.op("Squeeze", [index, g.const(np.array([2], dtype=np.int64))], "index_2d")
    g.op("Cast", [index], output="indices", to=TensorProto.INT32)

    batch = _batch_dim(dynamic_batch)
    inputs = [
        helper.make_tensor_value_info("feats", TensorProto.FLOAT, [batch, WHISPER_MEL_BINS, "T"]),
        helper.make_tensor_value_info("feats_length", TensorProto.INT32, [batch]),
    ]
    outputs = [helper.make_tensor_value_info("indices", TensorProto.INT32, [batch, "T_tok"])]
    return g.model(f"speech_tokenizer_{version}", inputs, outputs, f"random weights, seed={seed}")


def campplus_standin(*, seed: int = 0, dynamic_batch: bool = False) -> onnx.ModelProto:
    """The CAM++ stand-in as an in-memory ``ModelProto`` (see the module docstring)."""
    rng = np.random.default_rng([seed, 0xCA11])
    c = _CAMPPLUS_CHANNELS
    g = _Graph()
    x = g.op("Transpose", ["input"], "channels_first", perm=[0, 2, 1])  # [B, 80, T]
    w = rng.normal(0.0, 1.0 / np.sqrt(3 * FBANK_BINS), (c, FBANK_BINS, 3)).astype(np.float32)
    b = rng.normal(0.0, 0.1, c).astype(np.float32)
    x = g.op("Relu", [g.op("Conv", [x, g.const(w, "tdnn_w"), g.const(b, "tdnn_b")], "tdnn",
                           kernel_shape=[3], pads=[1, 1])])
    mean = g.op("ReduceMean", [x], "mean", axes=[2], keepdims=0)  # [B, C]
    mean_sq = g.op("ReduceMean", [g.op("Mul", [x, x])], "mean_sq", axes=[2], keepdims=0)
    var = g.op("Relu", [g.op("Sub", [mean_sq, g.op("Mul", [mean, mean])])], "var")
    std = g.op("Sqrt", [g.op("Add", [var, g.const(np.array(1e-5, dtype=np.float32))])], "std")
    stats = g.op("Concat", [mean, std], "stats", axis=1)  # [B, 2C]
    dense_w = rng.normal(0.0, 1.0 / np.sqrt(2 * c), (2 * c, SPEAKER_EMBED_DIM)).astype(np.float32)
    dense_b = rng.normal(0.0, 0.05, SPEAKER_EMBED_DIM).astype(np.float32)
    g.op("Gemm", [stats, g.const(dense_w, "dense_w"), g.const(dense_b, "dense_b")], output="output")

    batch = _batch_dim(dynamic_batch)
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, "T", FBANK_BINS])]
    outputs = [helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, SPEAKER_EMBED_DIM])]
    return g.model("campplus", inputs, outputs, f"random weights, seed={seed}")


def write_speech_tokenizer_standin(path: str | Path, *, seed: int = 0, dynamic_batch: bool = False,
                                   version: str = "v2") -> Path:
    """Write a ``speech_tokenizer_v2.onnx`` (``version="v3"``: ``speech_tokenizer_v3.onnx``) stand-in (official
    signature, random weights) to ``path``."""
    return _save(speech_tokenizer_standin(seed=seed, dynamic_batch=dynamic_batch, version=version), path)


def write_campplus_standin(path: str | Path, *, seed: int = 0, dynamic_batch: bool = False) -> Path:
    """Write a ``campplus.onnx`` stand-in (official signature, random weights) to ``path``."""
    return _save(campplus_standin(seed=seed, dynamic_batch=dynamic_batch), path)
