"""What gets reduced precision and what stays float, and why: the precision folders, the graphs converted
and the fp32-only ones, the CPU INT8 recipe of each graph, the calibration defaults, the keep-float rules
(:data:`INT8_KEEP_FLOAT`, :data:`FP16_KEEP_FLOAT`: node-name patterns with their reason and basis) and
:func:`keep_float_nodes`, which resolves them against a graph and refuses a rule that matches nothing."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import onnx

#: Precision folders under the ONNX root, in report order.
PRECISIONS = ("fp32", "fp16", "int8", "int8_cpu")
#: Graphs that get reduced-precision files; the others stay fp32 (:data:`FP32_ONLY`).
QUANTIZED_GRAPHS = ("flow_encoder", "flow_estimator", "hift_decoder")

#: Whole graphs that are never converted, and why.
FP32_ONLY: Mapping[str, str] = MappingProxyType({
    "hift_source": "F0 predictor + NSF sine source: the phase is a float64 cumulative sum of f0 (~1e4 rad/s for the "
                   "upper harmonics, where one fp32 ulp is already ~1e-3 rad); any f0 rounding becomes phase drift "
                   "over the utterance. 0.3% of HiFT's time. fp32/float64 on onnxruntime, never TensorRT.",
    "speech_tokenizer": "shipped speech_tokenizer_v2.onnx, run as shipped: its output is discrete FSQ tokens, so a "
                        "rounding change flips tokens (content errors), and it runs once per request",
    "speaker_encoder": "shipped campplus.onnx, run as shipped: one short call per request (the prompt), nothing to "
                       "gain, and the x-vector sets the voice of every frame",
})

#: Op types that get Q/DQ on their inputs in the INT8 graphs (TensorRT's explicit-quantisation placement:
#: weighted layers only; everything between them runs in the graph's float type).
QDQ_OP_TYPES = ("Conv", "ConvTranspose", "Gemm", "MatMul")


@dataclass(frozen=True)
class CpuInt8Recipe:
    """How ``int8_cpu/<graph>.onnx`` is made: ``dynamic`` (S8 weights, activations quantized to U8 per call:
    DynamicQuantizeLinear -> MatMulInteger) or ``static`` (calibrated U8 activations, asymmetric, S8 weights:
    QLinearConv), on ``op_types``; ``why`` records the measurement that chose it."""

    kind: str
    op_types: tuple[str, ...]
    per_channel: bool
    why: str

    def __post_init__(self):
        if self.kind not in ("dynamic", "static"):
            raise ValueError(f"CpuInt8Recipe kind must be dynamic or static, got {self.kind!r}")


#: The CPU INT8 recipe of each graph (measured on the full-size graphs, onnxruntime 2 threads; README).
CPU_INT8: Mapping[str, CpuInt8Recipe] = MappingProxyType({
    "flow_encoder": CpuInt8Recipe(
        "dynamic", ("MatMul",), True,
        "same layer types as the estimator's transformer blocks (MatMul with constant weights)"),
    "flow_estimator": CpuInt8Recipe(
        "dynamic", ("MatMul",), True,
        "dynamic MatMulInteger 1.4-1.6x fp32 at B=2, T=400; INT8 convs add the most error (resnet convs are the "
        "most sensitive group) and ConvInteger is slower than fp32 (0.8x); S8S8 Q/DQ 1.07x"),
    "hift_decoder": CpuInt8Recipe(
        "static", ("Conv", "ConvTranspose"), True,
        "static U8S8 QLinearConv 1.6-1.9x fp32 at T=250; dynamic ConvInteger is 5x slower than fp32, S8S8 Q/DQ "
        "0.6-0.9x"),
})
CALIBRATION_METHODS = ("minmax", "percentile", "entropy")
#: Calibration method per graph as chosen by ``--calibration-method auto`` (lowest held-out error) on the
#: full-size demo graphs (methods compared on 24 captured calls, judged on 6 held-out pairs; output rel RMS
#: minmax / percentile / entropy: flow_encoder 6.6e-4 / 5.4e-4 / 6.2e-4, flow_estimator 2.31e-2 / 2.14e-2 /
#: 3.74e-2, hift_decoder 1.30e-2 / 1.16e-2 / 1.30e-2); ``--calibration-method recorded`` uses these without
#: comparing again (what the container's start script does).
DEFAULT_CALIBRATION: Mapping[str, str] = MappingProxyType({
    "flow_encoder": "percentile",
    "flow_estimator": "percentile",
    "hift_decoder": "percentile",
})
#: Attention bias of masked keys in the fp16 estimator (the official -1e10 is -inf in fp16, and
#: ``(1 - allowed) * -inf`` is NaN on the allowed keys); exp(-1e4) is 0 in fp32 and fp16 alike.
FP16_MASK_BIAS = -1.0e4
#: The Euler steps of one solve (``n_timesteps`` of the release config).
N_TIMESTEPS = 10


@dataclass(frozen=True)
class KeepFloat:
    """Nodes that stay in float (fp32) in a reduced-precision graph.

    ``pattern`` is a regular expression searched in node names. ``downstream``: also every node fed (directly
    or not) by a matched node. ``inputs``: also the producers of the matched nodes' inputs, up to that many
    levels, through elementwise/shape ops only (the argument of a ``Sin``). ``basis``: ``numerics`` (known
    precision-sensitive arithmetic), ``measured`` (the sensitivity pass) or ``speed`` (too little time to gain).
    """

    pattern: str
    reason: str
    basis: str = "numerics"
    downstream: bool = False
    inputs: int = 0

    def __post_init__(self):
        if self.basis not in ("numerics", "measured", "speed"):
            raise ValueError(f"KeepFloat basis must be numerics, measured or speed, got {self.basis!r}")
        re.compile(self.pattern)


_HIFT_HEAD = KeepFloat(
    r"^/conv_post/Conv$",
    "conv_post and everything after it: exp() of the log-magnitude turns an absolute error e into a relative "
    "error e of the spectrum (and clip at 100), sin() of the phase rows, the conv iSTFT (overlap-add of 16 "
    "frames divided by the window sum) and the output clamp; the head is <2% of HiFT's time",
    downstream=True)
_HIFT_STFT = KeepFloat(
    r"^/stft/Conv$",
    "source STFT: analyses the phase-carrying sine excitation (harmonics at 0.1 plus 0.003 noise: an int8 step "
    "of max/127 erases the noise floor); one conv with n_fft + 2 = 18 outputs, negligible time")

#: Layers that stay float in the INT8 Q/DQ graphs (and the dynamic ones), per graph.
INT8_KEEP_FLOAT: Mapping[str, tuple[KeepFloat, ...]] = MappingProxyType({
    "flow_encoder": (
        KeepFloat(r"/self_attn/MatMul(_\d+)?$",
                  "attention scores, position scores and probabilities x values multiply two activations; "
                  "softmax probabilities (~1/T for T keys) fall below the symmetric int8 step (max/127) and "
                  "round to 0"),
        KeepFloat(r"^/spk_embed_affine_layer/",
                  "speaker projection: one row per request (no time to gain) and it sets spks, the voice "
                  "condition of every frame", basis="speed"),
        KeepFloat(r"^/encoder_proj/",
                  "output projection to mu (80 channels): 0.1% of the encoder's time, alone 1.2e-2 of mu's error "
                  "(full dims), which goes straight into the ODE's condition", basis="measured"),
        KeepFloat(r"/(embed|up_embed)/out/",
                  "input linears of the two conformer stacks: 1.1% of the time, alone 1.5e-2 of mu's error (as much "
                  "as all other layers together)", basis="measured"),
        KeepFloat(r"/(pre_lookahead_layer|up_layer)/",
                  "look-ahead convs and the x2 upsampling conv: 6% of the time, alone 1.2e-2 of mu's error",
                  basis="measured"),
    ),
    "flow_estimator": (
        KeepFloat(r"/attn1/MatMul(_\d+)?$",
                  "attention Q x K^T and probabilities x V multiply two activations; softmax probabilities "
                  "(~1/T for T keys) fall below the symmetric int8 step (max/127) and round to 0"),
        KeepFloat(r"(^/estimator/time_mlp/|/mlp/mlp\.1/Gemm$)",
                  "time embedding MLP and the per-block time projections: one row per batch item (<0.1% of the "
                  "FLOPs) and t is the ODE's clock, added to every frame of every block", basis="speed"),
        KeepFloat(r"^/estimator/.*/Conv$",
                  "every convolution (the resnet blocks' causal k=3 convs and 1x1 res_conv, the first of which sees "
                  "concat(x, mu, spks, cond) with very different ranges per channel; the down/up tail convs; "
                  "final_block; final_proj to the velocity): 7% of the time, yet alone they give 3.4e-2 of the "
                  "velocity's error (full dims), more than the attention projections and feed-forward together "
                  "(46% of the time)", basis="measured"),
    ),
    "hift_decoder": (_HIFT_HEAD, _HIFT_STFT),
})

#: Nodes that stay fp32 in the fp16 graphs, per graph (every other float node is converted).
FP16_KEEP_FLOAT: Mapping[str, tuple[KeepFloat, ...]] = MappingProxyType({
    "flow_encoder": (
        KeepFloat(r"/pos_enc/(Sin|Cos)$",
                  "relative positional encoding: sin/cos of position x frequency up to 3000 rad, where fp16's "
                  "spacing is 2 rad", inputs=3),
    ),
    "flow_estimator": (
        KeepFloat(r"^/estimator/(Sin|Cos)$",
                  "sinusoidal time embedding: sin/cos of 1000 t f up to 1000 rad, where fp16's spacing is 0.5 rad",
                  inputs=3),
    ),
    "hift_decoder": (_HIFT_HEAD, _HIFT_STFT),
})

#: Groups of layers for the sensitivity pass (name -> node-name pattern), per graph.
SENSITIVITY_GROUPS: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "flow_encoder": MappingProxyType({
        "embed/up_embed linear": r"/(embed|up_embed)/out/",
        "pre-lookahead + upsample convs": r"/(pre_lookahead_layer|up_layer)/",
        "attention projections": r"/self_attn/linear_(q|k|v|pos|out)/",
        "attention score/context matmuls": r"/self_attn/MatMul(_\d+)?$",
        "feed-forward": r"/feed_forward/",
        "speaker projection": r"^/spk_embed_affine_layer/",
        "encoder_proj": r"^/encoder_proj/",
    }),
    "flow_estimator": MappingProxyType({
        "time MLP + time projections": r"(^/estimator/time_mlp/|/mlp/mlp\.1/Gemm$)",
        "first resnet (input concat)": r"^/estimator/down_blocks\.0\.0/(block1|res_conv)/",
        "resnet convs": r"/(block1|block2|res_conv)/.*Conv$",
        "down/up tail convs": r"^/estimator/(down|up)_blocks\.0\.2/Conv$",
        "attention projections": r"/attn1/to_(q|k|v|out\.0)/",
        "attention score/context matmuls": r"/attn1/MatMul(_\d+)?$",
        "feed-forward": r"/ff/net/",
        "final block conv": r"^/estimator/final_block/",
        "final_proj": r"^/estimator/final_proj/",
    }),
    "hift_decoder": MappingProxyType({
        "source STFT": r"^/stft/Conv$",
        "conv_pre": r"^/conv_pre/",
        "ups (transposed convs)": r"^/ups\.\d+/",
        "source_downs": r"^/source_downs\.\d+/",
        "source_resblocks": r"^/source_resblocks\.\d+/",
        "resblocks": r"^/resblocks\.\d+/",
        "conv_post": r"^/conv_post/",
        "iSTFT": r"^/istft/",
    }),
})

#: Held-out calls per graph the sensitivity pass measures on (it quantizes the graph once per group).
SENSITIVITY_CALLS = 8

_PASS_THROUGH_OPS = frozenset({"Mul", "Div", "Add", "Sub", "Neg", "Unsqueeze", "Reshape", "Cast", "Range", "Expand",
                               "Concat", "Squeeze", "Transpose"})


def _consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def keep_float_nodes(model: onnx.ModelProto, rules: Iterable[KeepFloat], *, op_types: Iterable[str] | None = None,
                     strict: bool = True) -> dict[str, str]:
    """Node name -> reason for every node the rules keep in float (only nodes of ``op_types`` when given).

    ``strict``: raise ``ValueError`` for a rule whose pattern matches no node of the graph.
    """
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    consumers = _consumers(model)
    wanted = set(op_types) if op_types is not None else None
    out: dict[str, str] = {}
    for rule in rules:
        rx = re.compile(rule.pattern)
        matched = [n for n in g.node if rx.search(n.name)]
        if not matched and strict:
            raise ValueError(f"keep-float rule {rule.pattern!r} matches no node of {g.name or 'the graph'}: was the "
                             "graph exported by this version of onnx_export?")
        chosen = {id(n): n for n in matched}
        if rule.downstream:
            stack = list(matched)
            while stack:
                for o in stack.pop().output:
                    for c in consumers.get(o, ()):
                        if id(c) not in chosen:
                            chosen[id(c)] = c
                            stack.append(c)
        if rule.inputs:
            frontier = list(matched)
            for _ in range(rule.inputs):
                nxt = []
                for n in frontier:
                    for i in n.input:
                        p = producer.get(i)
                        if p is not None and p.op_type in _PASS_THROUGH_OPS and id(p) not in chosen:
                            chosen[id(p)] = p
                            nxt.append(p)
                frontier = nxt
        for n in chosen.values():
            if (wanted is None or n.op_type in wanted) and n.name not in out:
                out[n.name] = rule.reason
    return out


def _group_nodes(model: onnx.ModelProto, pattern: str, op_types: Iterable[str]) -> list[str]:
    rx = re.compile(pattern)
    ops = set(op_types)
    return [n.name for n in model.graph.node if n.op_type in ops and rx.search(n.name)]


def rules_table(graphs: Iterable[str] = QUANTIZED_GRAPHS, fp32_dir: str | Path | None = None) -> str:
    """Markdown of every keep-float rule (and the fp32-only graphs) with its reason; with ``fp32_dir``, the
    number of nodes each rule matches in the exported graphs."""
    lines = ["| precision | graph | nodes kept float | matched | basis | why |",
             "| --- | --- | --- | ---: | --- | --- |"]
    models: dict[str, onnx.ModelProto] = {}
    for prec, table in (("int8", INT8_KEEP_FLOAT), ("fp16", FP16_KEEP_FLOAT)):
        for g in graphs:
            for rule in table.get(g, ()):
                matched = ""
                if fp32_dir is not None and (Path(fp32_dir) / f"{g}.onnx").is_file():
                    if g not in models:
                        models[g] = onnx.load(str(Path(fp32_dir) / f"{g}.onnx"), load_external_data=False)
                    ops = QDQ_OP_TYPES if prec == "int8" else None
                    matched = str(len(keep_float_nodes(models[g], [rule], op_types=ops, strict=False)))
                what = f"`{rule.pattern}`" + (" and everything after" if rule.downstream else "") + (
                    " and its argument" if rule.inputs else "")
                lines.append(f"| {prec} | {g} | {what} | {matched} | {rule.basis} | {rule.reason} |")
    for g, why in FP32_ONLY.items():
        lines.append(f"| all | {g} | whole graph | | numerics | {why} |")
    return "\n".join(lines)
