"""Reduced precision of the exported graphs: INT8 Q/DQ (TensorRT), dynamic INT8 (CPU serving) and fp16.

Inputs are the verified fp32 graphs of :mod:`cosyvoice_triton.export.onnx_export` (``build/onnx/fp32``); outputs::

    build/onnx/int8/<graph>.onnx          # explicit Q/DQ, S8S8 symmetric, per-channel weights: TensorRT's INT8
    build/onnx/int8_cpu/<graph>.onnx      # onnxruntime CPU INT8 (recipe per graph, CPU_INT8): CPU serving
    build/onnx/fp16/<graph>.onnx          # fp16 weights and math, fp32 I/O, precision-sensitive nodes in fp32
    build/onnx/<precision>/manifest.json  # per graph: source file + sha256, method, calibration, kept-float nodes

The two INT8 forms differ because the targets differ. TensorRT 10/11 only takes explicit Q/DQ with signed,
symmetric int8 (zero point 0); onnxruntime's x86 kernels multiply unsigned activations by signed weights
(VNNI ``vpdpbusd``), so S8S8 Q/DQ runs *slower* than fp32 on a CPU, while dynamic MatMulInteger (flow) and
static U8S8 QLinearConv (HiFT) run faster. ``int8`` is therefore measured here for accuracy only (ORT executes
Q/DQ faithfully); its speed is a TensorRT matter. ``int8_cpu`` is what a CPU deployment serves.

**Calibration** runs the real pipeline (:class:`~cosyvoice_triton.pipeline.CosyVoice2`, fp32 PyTorch) over real
speech (:func:`cosyvoice_triton.export.speech_corpus.utterances`, espeak-ng in several languages, voices, speeds and
lengths) paired as voice conversion does (source i in the voice of prompt i+1) and captures each graph's
inputs where the served pipeline would feed them (:func:`collect_feeds`): ``flow_encoder`` (prompt + source
tokens, embedding, a mix of streaming / look-ahead items), ``flow_estimator`` at a few Euler steps per
utterance, rotating so that every step from t=0 to the last one is covered, and ``hift_decoder`` (the flow's
mel and its NSF source with the seeded noise). Only the recipe is in the repository; the speech is synthesised
on demand and the captured tensors are cached under ``build/``. :class:`FeedReader` is the
``onnxruntime.quantization.CalibrationDataReader`` over them.

**Per-layer decisions** are data: :data:`INT8_KEEP_FLOAT`, :data:`FP16_KEEP_FLOAT` (node-name patterns, each
with its reason and its basis: known numerics, a measured sensitivity, or no speed to gain) and
:data:`FP32_ONLY` (whole graphs). :func:`keep_float_nodes` resolves them against a graph and refuses a rule
that matches nothing (a renamed export must not silently quantize what was meant to stay float).
:func:`sensitivity` is the pass the INT8 rules come from: calibrate once, quantize one group of layers at a
time, measure the output error on held-out speech and the group's share of the fp32 time (ORT profiler).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import hashlib
import io
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader

from ..hashing import file_sha256
from ..shapes import GRAPHS

__all__ = [
    "CALIBRATION_METHODS",
    "CPU_INT8",
    "DEFAULT_CALIBRATION",
    "FP16_KEEP_FLOAT",
    "FP16_MASK_BIAS",
    "FP32_ONLY",
    "INT8_KEEP_FLOAT",
    "PRECISIONS",
    "QDQ_OP_TYPES",
    "QUANTIZED_GRAPHS",
    "SENSITIVITY_GROUPS",
    "CpuInt8Recipe",
    "FeedReader",
    "KeepFloat",
    "KernelEvent",
    "PairInfo",
    "PipelineFeeds",
    "QuantizeReport",
    "calibrate",
    "collect_feeds",
    "convert_fp16",
    "count_reduced",
    "feeds_cache_path",
    "keep_float_nodes",
    "kernel_events",
    "node_time_share",
    "profile_trace",
    "quantize_cpu_int8",
    "quantize_graphs",
    "quantize_qdq",
    "read_manifest",
    "rel_rms",
    "rules_table",
    "sensitivity",
    "session",
    "speech_pairs",
]

log = logging.getLogger(__name__)

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


# =============================================================================================== rules


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


# ============================================================================================ sessions


def session(model: onnx.ModelProto | str | Path | bytes, threads: int = 1, *, profile: str | None = None,
            spin: bool = False):
    """A CPU onnxruntime session (``threads`` intra-op threads; thread spinning off by default, which keeps
    timings sane on a shared machine)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    opts.intra_op_num_threads = int(threads)
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if profile:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else (
        str(model) if isinstance(model, (str, Path)) else model)
    return ort.InferenceSession(src, sess_options=opts, providers=["CPUExecutionProvider"])


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero, inf when only b is)."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    num, den = float(np.linalg.norm(a64 - b64)), float(np.linalg.norm(b64))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def rel_max(a: np.ndarray, b: np.ndarray) -> float:
    """max|a - b| / max|b| in float64."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a64.size == 0:
        return 0.0
    num, den = float(np.max(np.abs(a64 - b64))), float(np.max(np.abs(b64)))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


# ======================================================================================== calibration


@dataclass(frozen=True)
class PairInfo:
    """One voice-conversion pair of the corpus and how it was run."""

    index: int
    source: str  # "voice, wpm, seconds: text"
    prompt: str
    source_seconds: float
    prompt_seconds: float
    streaming: bool
    lookahead: int
    steps: tuple[int, ...]  # Euler steps whose estimator inputs were captured


class FeedReader(CalibrationDataReader):
    """``CalibrationDataReader`` over captured input dicts (one graph call each); supports ``len`` and
    ``set_range`` like onnxruntime's strided calibration expects."""

    def __init__(self, feeds: Sequence[Mapping[str, np.ndarray]], name: str = ""):
        self.feeds = list(feeds)
        self.name = name
        self._start, self._end = 0, len(self.feeds)
        self._pos = 0

    def __len__(self) -> int:
        return len(self.feeds)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return (dict(f) for f in self.feeds[self._start:self._end])

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._start + self._pos >= self._end:
            return None
        feed = dict(self.feeds[self._start + self._pos])
        self._pos += 1
        return feed

    def rewind(self) -> None:
        self._pos = 0

    def set_range(self, start_index: int, end_index: int) -> None:
        self._start, self._end = max(0, start_index), min(len(self.feeds), end_index)
        self._pos = 0


@dataclass
class PipelineFeeds:
    """Inputs of each graph captured from the real pipeline over corpus pairs (see :func:`collect_feeds`)."""

    split: str
    feeds: dict[str, list[dict[str, np.ndarray]]]
    pairs: list[PairInfo]
    model_dir: str = ""
    seconds: float = 0.0

    def reader(self, graph: str) -> FeedReader:
        if graph not in self.feeds or not self.feeds[graph]:
            raise KeyError(f"no {graph} inputs were captured (have {sorted(self.feeds)})")
        return FeedReader(self.feeds[graph], graph)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"split": self.split, "pairs": len(self.pairs),
                               "utterance_seconds": round(sum(p.source_seconds for p in self.pairs), 1),
                               "graphs": {}}
        for g, fs in self.feeds.items():
            spec = GRAPHS[g]
            first = spec.inputs[0].name
            lengths = [int(f[first].shape[-1]) for f in fs]
            out["graphs"][g] = {"samples": len(fs), "length_min": min(lengths, default=0),
                                "length_max": max(lengths, default=0)}
        return out

    def save(self, path: str | Path) -> None:
        arrays: dict[str, np.ndarray] = {}
        for g, fs in self.feeds.items():
            for k, f in enumerate(fs):
                for name, a in f.items():
                    arrays[f"{g}/{k}/{name}"] = a
        meta = {"split": self.split, "model_dir": self.model_dir, "seconds": self.seconds,
                "pairs": [asdict(p) for p in self.pairs], "counts": {g: len(fs) for g, fs in self.feeds.items()}}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> PipelineFeeds:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["__meta__"]).decode())
            feeds: dict[str, list[dict[str, np.ndarray]]] = {g: [{} for _ in range(n)]
                                                             for g, n in meta["counts"].items()}
            for key in z.files:
                if key == "__meta__":
                    continue
                g, k, name = key.split("/", 2)
                feeds[g][int(k)][name] = z[key]
        pairs = [PairInfo(**{**p, "steps": tuple(p["steps"])}) for p in meta["pairs"]]
        return cls(meta["split"], feeds, pairs, meta.get("model_dir", ""), meta.get("seconds", 0.0))


def speech_pairs(n: int, *, split: str = "calibration", seed: int = 0, max_seconds: float = 10.0):
    """``n`` (source, prompt) utterance pairs of a corpus split: source i speaks in the voice of utterance i+1
    (the next one, cyclically), so each utterance is a source once and a prompt once."""
    from .speech_corpus import utterances

    if n < 1:
        raise ValueError(f"need at least one utterance, got {n}")
    utts = utterances(n, split=split, seed=seed, max_seconds=max_seconds)
    return [(utts[i], utts[(i + 1) % n]) for i in range(n)]


def _describe(u) -> str:
    return f"{u.voice} {u.speed_wpm} wpm {u.seconds:.1f} s: {u.text[:40]}"


def euler_steps(index: int, per_utterance: int, n_steps: int = N_TIMESTEPS) -> tuple[int, ...]:
    """The Euler steps captured for pair ``index``: consecutive pairs take the next ``per_utterance`` steps
    in rotation, so a calibration set covers t = 0 to the last step evenly."""
    k = max(1, min(per_utterance, n_steps))
    return tuple(sorted({(index * k + j) % n_steps for j in range(k)}))


def encoder_feed(prompt_tokens: np.ndarray, source_tokens: np.ndarray, embedding: np.ndarray, *,
                 streaming: bool, lookahead: int) -> dict[str, np.ndarray]:
    """``flow_encoder`` inputs of one pair (batch 1): prompt then source tokens."""
    tokens = np.concatenate([np.asarray(prompt_tokens), np.asarray(source_tokens)]).astype(np.int32)[None]
    return {"speech_tokens": tokens, "speech_token_len": np.array([tokens.shape[1]], dtype=np.int32),
            "lookahead_len": np.array([lookahead], dtype=np.int32),
            "speaker_embedding": np.asarray(embedding, dtype=np.float32).reshape(1, -1),
            "streaming": np.array([streaming], dtype=bool)}


def estimator_feed(x, mask, mu, t, spks, cond, streaming) -> dict[str, np.ndarray]:
    """``flow_estimator`` inputs from the solver's tensors (``streaming``: bool or a [B] tensor)."""
    f = lambda a: np.ascontiguousarray(a.detach().cpu().numpy(), dtype=np.float32)
    b = x.shape[0]
    flags = np.asarray(streaming.detach().cpu().numpy() if hasattr(streaming, "detach") else streaming, dtype=bool)
    return {"x": f(x), "mask": f(mask), "mu": f(mu), "t": f(t.reshape(-1).expand(b)), "spks": f(spks),
            "cond": f(cond), "streaming": np.broadcast_to(flags, (b,)).copy()}


def load_pipeline(model_dir: str | Path, threads: int = 0):
    """``CosyVoice2.from_pretrained`` with quiet stand-in warnings and the given torch thread count."""
    import torch

    from ..pipeline import CosyVoice2

    if threads:
        torch.set_num_threads(threads)
    logging.getLogger("cosyvoice_triton.frontend.speech_models").setLevel(logging.ERROR)
    return CosyVoice2.from_pretrained(model_dir)


def collect_feeds(model, n: int = 50, *, split: str = "calibration", seed: int = 0, steps_per_utterance: int = 3,
                  max_seconds: float = 10.0, graphs: Iterable[str] = QUANTIZED_GRAPHS, threads: int = 0,
                  progress: Callable[[str], None] | None = None) -> PipelineFeeds:
    """Run the fp32 PyTorch pipeline over ``n`` corpus pairs and capture the inputs of ``graphs``.

    ``model``: a :class:`~cosyvoice_triton.pipeline.CosyVoice2` or a model folder. Pair i runs with
    ``streaming = i odd`` (chunk-causal attention in encoder and estimator); every fourth pair's encoder call
    also has the 3 look-ahead tokens of a non-final streaming chunk. The estimator's inputs are captured at
    :func:`euler_steps` (``steps_per_utterance`` per pair), HiFT's with the pipeline's seeded noise (seed i).
    """
    import torch

    graphs = [g for g in graphs]
    unknown = [g for g in graphs if g not in GRAPHS]
    if unknown:
        raise ValueError(f"unknown graph(s) {unknown}")
    start = time.perf_counter()
    model_dir = ""
    if isinstance(model, (str, Path)):
        model_dir = str(model)
        model = load_pipeline(model, threads)
    say = progress or log.info
    pairs = speech_pairs(n, split=split, seed=seed, max_seconds=max_seconds)
    feeds: dict[str, list[dict[str, np.ndarray]]] = {g: [] for g in graphs}
    infos: list[PairInfo] = []
    flow, hift = model.flow, model.hift
    for i, (src, prm) in enumerate(pairs):
        t0 = time.perf_counter()
        streaming = i % 2 == 1
        lookahead = flow.pre_lookahead_len if i % 4 == 3 else 0
        steps = euler_steps(i, steps_per_utterance)
        inputs = model.frontend_vc(src.wave, prm.wave, source_sr=src.sample_rate, prompt_sr=prm.sample_rate)
        if "flow_encoder" in feeds:
            feeds["flow_encoder"].append(encoder_feed(inputs.prompt_tokens, inputs.source_tokens, inputs.embedding,
                                                      streaming=streaming, lookahead=lookahead))
        need_flow = "flow_estimator" in feeds or "hift_decoder" in feeds or "hift_source" in feeds
        if need_flow:
            with torch.inference_mode():
                c = flow.condition(*model._tensors(inputs, inputs.source_tokens), streaming=streaming,
                                   finalize=lookahead == 0)
                calls = [0]

                def record(x, mask, mu, t, spks, cond, stream, _steps=steps, _calls=calls):
                    if "flow_estimator" in feeds and _calls[0] in _steps:
                        feeds["flow_estimator"].append(estimator_feed(x, mask, mu, t, spks, cond, stream))
                    _calls[0] += 1
                    return flow.decoder.estimator(x, mask, mu, t, spks, cond, stream)

                mel = flow.decoder(c.mu, c.mask, c.spks, c.cond, streaming=streaming, estimator_fn=record)
                mel, _ = c.crop(mel)
                if "hift_decoder" in feeds or "hift_source" in feeds:
                    gen = torch.Generator().manual_seed(i)
                    noise = hift.draw_noise(1, mel.shape[2], gen)
                    if "hift_source" in feeds:
                        feeds["hift_source"].append({"mel": mel.numpy().astype(np.float32),
                                                     "nsf_noise": noise.numpy().astype(np.float32)})
                    if "hift_decoder" in feeds:
                        source = hift.source_from_f0(hift.f0_predictor(mel), noise)
                        feeds["hift_decoder"].append({"mel": mel.numpy().astype(np.float32),
                                                      "source": source.numpy().astype(np.float32)})
        infos.append(PairInfo(i, _describe(src), _describe(prm), round(src.seconds, 2), round(prm.seconds, 2),
                              streaming, lookahead, steps if "flow_estimator" in feeds else ()))
        say(f"{split} {i + 1}/{n}: source {_describe(src)} | prompt {prm.voice} {prm.seconds:.1f} s | "
            f"{'streaming' if streaming else 'offline'}{', look-ahead' if lookahead else ''} | steps "
            f"{','.join(map(str, steps))} | {time.perf_counter() - t0:.1f} s")
    return PipelineFeeds(split, feeds, infos, model_dir, time.perf_counter() - start)


def feeds_cache_key(model_dir: str | Path, **params: Any) -> str:
    """A short key of the model folder's weights (size + mtime) and the collection parameters."""
    h = hashlib.sha256()
    for name in ("flow.pt", "hift.pt", "speech_tokenizer_v2.onnx", "campplus.onnx"):
        p = Path(model_dir) / name
        st = p.stat() if p.exists() else None
        h.update(f"{name}:{st.st_size if st else 0}:{int(st.st_mtime) if st else 0};".encode())
    h.update(json.dumps(params, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def feeds_cache_path(cache_dir: str | Path, model_dir: str | Path, n: int, *, split: str, seed: int = 0,
                     steps_per_utterance: int = 3, max_seconds: float = 10.0,
                     graphs: Iterable[str] = QUANTIZED_GRAPHS) -> Path:
    """Where :func:`cached_feeds` keeps the captured inputs of these parameters."""
    params = dict(n=n, split=split, seed=seed, steps=steps_per_utterance, max_seconds=max_seconds,
                  graphs=tuple(graphs))
    return Path(cache_dir) / f"{split}-{n}-{feeds_cache_key(model_dir, **params)}.npz"


def cached_feeds(model_dir: str | Path, cache_dir: str | Path | None, n: int, *, split: str, seed: int = 0,
                 steps_per_utterance: int = 3, max_seconds: float = 10.0, graphs: Iterable[str] = QUANTIZED_GRAPHS,
                 threads: int = 0, model=None, progress: Callable[[str], None] | None = None) -> PipelineFeeds:
    """:func:`collect_feeds`, read from / written to ``cache_dir`` (None: no cache)."""
    graphs = tuple(graphs)
    path = None
    if cache_dir is not None:
        path = feeds_cache_path(cache_dir, model_dir, n, split=split, seed=seed,
                                steps_per_utterance=steps_per_utterance, max_seconds=max_seconds, graphs=graphs)
        if path.is_file():
            try:
                got = PipelineFeeds.load(path)
                (progress or log.info)(f"{split} inputs: {len(got.pairs)} pairs from cache {path}")
                return got
            except (OSError, ValueError, KeyError) as exc:
                log.warning("ignoring unreadable cache %s: %s", path, exc)
    got = collect_feeds(model if model is not None else model_dir, n, split=split, seed=seed,
                        steps_per_utterance=steps_per_utterance, max_seconds=max_seconds, graphs=graphs,
                        threads=threads, progress=progress)
    got.model_dir = str(model_dir)
    if path is not None:
        got.save(path)
    return got


# ======================================================================================== int8 Q/DQ


def _method(name: str):
    from onnxruntime.quantization import CalibrationMethod

    table = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
             "entropy": CalibrationMethod.Entropy}
    if name not in table:
        raise ValueError(f"calibration method {name!r}: choose from {', '.join(CALIBRATION_METHODS)}")
    return table[name]


@dataclass
class Ranges:
    """Calibrated activation ranges of one graph: tensor name -> (lowest, highest)."""

    method: str
    ranges: dict[str, tuple[float, float]]
    samples: int
    seconds: float
    symmetric: bool = True

    def tensors_data(self):
        from onnxruntime.quantization.calibrate import TensorData, TensorsData

        return TensorsData(_method(self.method), {
            k: TensorData(lowest=np.float32(lo), highest=np.float32(hi)) for k, (lo, hi) in self.ranges.items()})

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "samples": self.samples, "seconds": round(self.seconds, 2),
                "symmetric": self.symmetric,
                "ranges": {k: [float(lo), float(hi)] for k, (lo, hi) in self.ranges.items()}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Ranges:
        return cls(d["method"], {k: (float(v[0]), float(v[1])) for k, v in d["ranges"].items()}, int(d["samples"]),
                   float(d.get("seconds", 0.0)), bool(d.get("symmetric", True)))


class _One(CalibrationDataReader):
    def __init__(self, feed: Mapping[str, np.ndarray]):
        self.feed: dict[str, np.ndarray] | None = dict(feed)

    def get_next(self):
        feed, self.feed = self.feed, None
        return feed


def calibrate(model_path: str | Path, reader: CalibrationDataReader, method: str = "minmax", *,
              op_types: Sequence[str] = QDQ_OP_TYPES, symmetric: bool = True, percentile: float = 99.999,
              progress: Callable[[str], None] | None = None) -> Ranges:
    """Activation ranges of the fp32 graph at ``model_path`` over ``reader`` (``symmetric`` as the Q/DQ graphs
    quantize activations; False for the asymmetric U8 of :data:`CPU_INT8`'s static recipe), one sample at a
    time (samples have different lengths; the histogram calibrators would otherwise hold every activation of
    every sample in memory)."""
    from onnxruntime.quantization.calibrate import create_calibrator

    start = time.perf_counter()
    items = list(reader) if isinstance(reader, FeedReader) else list(iter(reader.get_next, None))
    if not items:
        raise ValueError("calibrate: the data reader yielded nothing")
    if method == "percentile" and symmetric:
        ranges = _percentile_ranges(model_path, items, op_types, percentile, progress, start)
        return Ranges(method, ranges, len(items), time.perf_counter() - start, symmetric)
    options: dict[str, Any] = {"symmetric": symmetric}
    if method == "percentile":
        options["percentile"] = percentile
    with tempfile.TemporaryDirectory(prefix="cosyvoice-calib-") as tmp:
        calibrator = create_calibrator(Path(model_path), list(op_types),
                                       augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                                       calibrate_method=_method(method), extra_options=options,
                                       providers=["CPUExecutionProvider"])
        every = max(1, len(items) // 10)
        for k, feed in enumerate(items, 1):
            with contextlib.redirect_stdout(io.StringIO()):  # the histogram collectors print per call
                calibrator.collect_data(_One(feed))
            if progress and (k % every == 0 or k == len(items)):
                progress(f"  {method}: {k}/{len(items)} samples, {time.perf_counter() - start:.1f} s")
        with contextlib.redirect_stdout(io.StringIO()):
            data = calibrator.compute_data()
        del calibrator
    ranges = {}
    for name, td in data.data.items():
        lo, hi = td.range_value
        ranges[name] = (float(np.asarray(lo).reshape(-1)[0]), float(np.asarray(hi).reshape(-1)[0]))
    return Ranges(method, ranges, len(items), time.perf_counter() - start, symmetric)


PERCENTILE_BINS = 8192


def _percentile_ranges(model_path: str | Path, items: Sequence[Mapping[str, np.ndarray]], op_types: Sequence[str],
                       percentile: float, progress: Callable[[str], None] | None, start: float
                       ) -> dict[str, tuple[float, float]]:
    """Symmetric percentile ranges: per tensor the ``percentile`` of |x| over every value of every call, from a
    histogram of :data:`PERCENTILE_BINS` bins over [0, max|x|] (two passes: the max, then the histogram).

    Same definition as onnxruntime's ``PercentileCalibrater(symmetric=True)``, whose re-binning histogram
    collector takes minutes per call on the full-size graphs; this takes about two forward passes per call.
    The tensors are the ones onnxruntime's calibrators select (inputs and outputs of ``op_types`` nodes).
    """
    from onnxruntime.quantization.calibrate import MinMaxCalibrater

    with tempfile.TemporaryDirectory(prefix="cosyvoice-pct-") as tmp:
        selector = MinMaxCalibrater(Path(model_path), list(op_types), str(Path(tmp) / "unused.onnx"))
        model = selector.model
        names, _ = selector.select_tensors_to_calibrate(model)
    inputs = {i.name for i in model.graph.input}
    names = sorted(names)
    outputs = [n for n in names if n not in inputs]
    known = {o.name for o in model.graph.output}
    for n in outputs:
        if n not in known:
            model.graph.output.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, None))
    sess = session(model, 0)
    del model

    def values(feed: Mapping[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
        got = sess.run(outputs, dict(feed))
        yield from zip(outputs, got, strict=True)
        for n in names:
            if n in inputs:
                yield n, feed[n]

    amax = dict.fromkeys(names, 0.0)
    total = len(items) * 2
    for k, feed in enumerate(items, 1):
        for n, a in values(feed):
            amax[n] = max(amax[n], float(np.max(np.abs(a), initial=0.0)))
        if progress and (k % max(1, len(items) // 5) == 0):
            progress(f"  percentile pass 1 (max): {k}/{len(items)} calls, {time.perf_counter() - start:.1f} s")
    hist = {n: np.zeros(PERCENTILE_BINS, dtype=np.int64) for n in names}
    for k, feed in enumerate(items, 1):
        for n, a in values(feed):
            if amax[n] > 0:
                idx = (np.abs(a.ravel()) * (PERCENTILE_BINS / amax[n])).astype(np.int64)
                hist[n] += np.bincount(np.minimum(idx, PERCENTILE_BINS - 1), minlength=PERCENTILE_BINS)
        if progress and (k % max(1, len(items) // 5) == 0 or k == len(items)):
            progress(f"  percentile pass 2 (histogram): {k + len(items)}/{total} passes, "
                     f"{time.perf_counter() - start:.1f} s")
    out = {}
    for n in names:
        counts = hist[n]
        if amax[n] == 0 or counts.sum() == 0:
            out[n] = (0.0, 0.0)
            continue
        cdf = np.cumsum(counts) / counts.sum()
        edge = (int(np.searchsorted(cdf, percentile / 100.0)) + 1) * amax[n] / PERCENTILE_BINS
        t = min(edge, amax[n])
        out[n] = (-t, t)
    return out


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


def _mark(model: onnx.ModelProto, graph: str, precision: str, extra: Mapping[str, str]) -> None:
    props = {p.key: p.value for p in model.metadata_props}
    props.update({"cosyvoice_triton.graph": graph, "cosyvoice_triton.precision": precision, **extra})
    del model.metadata_props[:]
    helper.set_model_props(model, props)


# ============================================================================================== fp16


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


# ========================================================================================= sensitivity


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


# ============================================================================================ driver


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


def _write_manifest(folder: Path, precision: str, entries: Mapping[str, Any], common: Mapping[str, Any]) -> Path:
    """``folder/manifest.json``; entries of other graphs written earlier are kept while their file exists."""
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
           "fp32_only": dict(FP32_ONLY), "graphs": {g: graphs[g] for g in GRAPHS if g in graphs}}
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


@dataclass
class GraphResult:
    graph: str
    precision: str
    path: Path
    seconds: float
    kept_float: dict[str, str] = field(default_factory=dict)
    reduced_layers: int = 0
    heldout_rel_rms: float | None = None
    method: str = ""
    method_errors: dict[str, float] = field(default_factory=dict)
    note: str = ""


@dataclass
class QuantizeReport:
    onnx_root: Path
    results: list[GraphResult]
    calibration: dict[str, Any]
    sensitivity: list[GroupSensitivity]
    seconds: float

    def table(self) -> str:
        """Markdown: one row per written graph."""
        head = ("| graph | precision | layers reduced | kept float | held-out output rel RMS (vs fp32 graph) "
                "| calibration / recipe |")
        lines = [head, "| --- | --- | ---: | ---: | ---: | --- |"]
        for r in self.results:
            errs = ", ".join(f"{m} {e:.2e}" for m, e in r.method_errors.items())
            err = f"{r.heldout_rel_rms:.2e}" if r.heldout_rel_rms is not None else "n/a"
            how = r.method + (f" (held-out: {errs})" if errs else "") + (f"; {r.note}" if r.note else "")
            lines.append(f"| {r.graph} | {r.precision} | {r.reduced_layers} | {len(r.kept_float)} | {err} | {how} |")
        return "\n".join(lines)


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


def quantize_graphs(model_dir: str | Path, onnx_root: str | Path = "build/onnx", *, fp32_dir: str | Path | None = None,
                    precisions: Iterable[str] = ("int8", "int8_cpu", "fp16"),
                    graphs: Iterable[str] = QUANTIZED_GRAPHS, calibration_utterances: int = 50,
                    heldout_utterances: int = 6, method: str = "auto", method_samples: int | None = 24,
                    steps_per_utterance: int = 3,
                    max_seconds: float = 10.0, run_sensitivity: bool = False, threads: int = 0,
                    reduce_range: bool | None = None, cache_dir: str | Path | None = "build/quantize", seed: int = 0,
                    progress: Callable[[str], None] | None = None) -> QuantizeReport:
    """Write ``onnx_root/{int8,int8_cpu,fp16}/<graph>.onnx`` (+ ``manifest.json``) from the fp32 graphs.

    ``fp32_dir`` defaults to ``onnx_root/fp32``. Calibration and held-out inputs come from the real pipeline
    (:func:`collect_feeds`, cached in ``cache_dir``). ``method``: a calibration method; ``recorded``: the one
    :data:`DEFAULT_CALIBRATION` records per graph; ``auto``: calibrate with each of :data:`CALIBRATION_METHODS`
    on the first ``method_samples`` captured calls (None: all), keep per graph the one whose INT8 graph has the
    lowest output error on the held-out inputs, then calibrate it on every call. ``threads``: torch and
    onnxruntime threads (0: their defaults). ``reduce_range``: 7-bit weights in ``int8_cpu``; None: where this
    machine's CPU has no VNNI (:func:`cpu_lacks_vnni`; the graphs are meant for a CPU like it).
    """
    start = time.perf_counter()
    say = progress or log.info
    if reduce_range is None:
        reduce_range = cpu_lacks_vnni()
    root = Path(onnx_root)
    fp32_dir = Path(fp32_dir) if fp32_dir is not None else root / "fp32"
    precisions = [p for p in PRECISIONS if p in set(precisions)]
    bad = sorted(set(precisions) - {"int8", "int8_cpu", "fp16"})
    if bad or not precisions:
        raise ValueError(f"precision(s) {bad or 'none'}: choose from int8, int8_cpu, fp16")
    graphs = [g for g in QUANTIZED_GRAPHS if g in set(graphs)] + [g for g in graphs if g not in QUANTIZED_GRAPHS]
    bad = [g for g in graphs if g not in QUANTIZED_GRAPHS]
    if bad or not graphs:
        why = "; ".join(f"{g}: {FP32_ONLY[g]}" for g in bad if g in FP32_ONLY)
        raise ValueError(f"graph(s) {bad or 'none'} are not converted{': ' + why if why else ''} "
                         f"(choose from {', '.join(QUANTIZED_GRAPHS)})")
    if method not in ("auto", "recorded", *CALIBRATION_METHODS):
        raise ValueError(f"calibration method {method!r}: auto, recorded or one of {', '.join(CALIBRATION_METHODS)}")
    if calibration_utterances < 1 or heldout_utterances < 1:
        raise ValueError("calibration and held-out sets need at least one utterance each")
    missing = [g for g in graphs if not (fp32_dir / f"{g}.onnx").is_file()]
    if missing:
        raise FileNotFoundError(f"{fp32_dir}: no fp32 graph for {', '.join(missing)} (run export/export_onnx.py first)")
    ort_threads = threads or 0
    pipeline = load_pipeline(model_dir, threads)
    calib = None
    need_calibration = "int8" in precisions or ("int8_cpu" in precisions
                                               and any(CPU_INT8[g].kind == "static" for g in graphs))
    feed_args = dict(seed=seed, steps_per_utterance=steps_per_utterance, max_seconds=max_seconds, graphs=graphs,
                     model=pipeline, progress=say)
    if need_calibration:
        say(f"calibration set: {calibration_utterances} utterance pairs of split 'calibration' through the fp32 "
            "pipeline")
        calib = cached_feeds(model_dir, cache_dir, calibration_utterances, split="calibration", **feed_args)
    say(f"held-out set (method choice and checks): {heldout_utterances} pairs of split 'heldout'")
    held = cached_feeds(model_dir, cache_dir, heldout_utterances, split="heldout", **feed_args)
    results: list[GraphResult] = []
    sens_rows: list[GroupSensitivity] = []
    manifests: dict[str, dict[str, Any]] = {p: {} for p in precisions}
    for k, g in enumerate(graphs, 1):
        src = fp32_dir / f"{g}.onnx"
        say(f"[{k}/{len(graphs)}] {g} ({src})")
        fp32_model = onnx.load(str(src))
        src_entry = {"fp32_file": str(src), "fp32_sha256": file_sha256(src)}
        ref = _outputs(session(fp32_model, ort_threads), held.feeds[g])

        def heldout_error(m: onnx.ModelProto, _g=g, _ref=ref) -> float:
            return output_error(_ref, _outputs(session(m, ort_threads), held.feeds[_g]))

        if "int8" in precisions:
            t0 = time.perf_counter()
            keep = keep_float_nodes(fp32_model, INT8_KEEP_FLOAT.get(g, ()), op_types=QDQ_OP_TYPES)
            errors: dict[str, float] = {}
            compared = 0
            if method == "auto":
                sub = calib
                if method_samples is not None and len(calib.feeds[g]) > method_samples:
                    sub = PipelineFeeds(calib.split, {g: calib.feeds[g][:method_samples]}, calib.pairs)
                for m in CALIBRATION_METHODS:
                    say(f"  {g}: calibrating ({m}, symmetric) on {len(sub.feeds[g])} captured calls to choose a method")
                    r = _cached_ranges(cache_dir, src, sub, g, m, symmetric=True, progress=say)
                    errors[m] = heldout_error(quantize_qdq(fp32_model, r, graph=g, keep_float=keep))
                    say(f"  {g}: int8 Q/DQ with {m} ranges: held-out output rel RMS {errors[m]:.3e}")
                chosen = min(errors, key=errors.get)
                compared = len(sub.feeds[g])
            else:
                chosen = DEFAULT_CALIBRATION[g] if method == "recorded" else method
            say(f"  {g}: calibrating ({chosen}, symmetric) on all {len(calib.feeds[g])} captured calls")
            ranges = _cached_ranges(cache_dir, src, calib, g, chosen, symmetric=True, progress=say)
            q = quantize_qdq(fp32_model, ranges, graph=g, keep_float=keep)
            e = heldout_error(q)
            path = root / "int8" / f"{g}.onnx"
            _save(q, path)
            res = GraphResult(g, "int8", path, time.perf_counter() - t0, keep, count_reduced(q, "int8"), e, chosen,
                              errors if len(errors) > 1 else {})
            results.append(res)
            manifests["int8"][g] = {
                "file": path.name, "sha256": file_sha256(path), **src_entry,
                "format": "Q/DQ: S8 weights symmetric per output channel, S8 activations symmetric per tensor "
                          f"(zero point 0) on the inputs of {'/'.join(QDQ_OP_TYPES)}; biases float",
                "calibration": {"method": chosen, "chosen_by": (
                                    f"lowest held-out output rel RMS, methods compared on {compared} calls"
                                    if errors else method), "heldout_rel_rms": errors, "samples": ranges.samples,
                                "heldout_rel_rms_final": e, "data": calib.summary()},
                "reduced_layers": res.reduced_layers, "kept_float": keep}
            say(f"  {g}: wrote {path}: {res.reduced_layers} layers INT8, {len(keep)} kept float, calibration "
                f"{chosen}, held-out rel RMS {e:.2e} ({res.seconds:.1f} s)")
            if run_sensitivity:
                say(f"  {g}: sensitivity pass ({chosen} ranges)")
                sens_rows += sensitivity(g, src, ranges, held.feeds[g][:SENSITIVITY_CALLS], threads=ort_threads or 1,
                                         progress=say)
        if "int8_cpu" in precisions:
            t0 = time.perf_counter()
            recipe = CPU_INT8[g]
            keep = keep_float_nodes(fp32_model, INT8_KEEP_FLOAT.get(g, ()), op_types=recipe.op_types)
            ranges = None
            if recipe.kind == "static":
                say(f"  {g}: calibrating (minmax, asymmetric U8) for the static CPU recipe")
                ranges = _cached_ranges(cache_dir, src, calib, g, "minmax", symmetric=False, progress=say)
            q = quantize_cpu_int8(fp32_model, graph=g, ranges=ranges, recipe=recipe, keep_float=keep,
                                  reduce_range=reduce_range)
            path = root / "int8_cpu" / f"{g}.onnx"
            _save(q, path)
            how = f"{recipe.kind} {'/'.join(recipe.op_types)}" + (", 7-bit weights" if reduce_range else "")
            res = GraphResult(g, "int8_cpu", path, time.perf_counter() - t0, keep, count_reduced(q, "int8_cpu"),
                              heldout_error(q), how)
            results.append(res)
            manifests["int8_cpu"][g] = {
                "file": path.name, "sha256": file_sha256(path), **src_entry,
                "format": ("onnxruntime dynamic INT8: S8 weights, activations quantized to U8 per call "
                           "(DynamicQuantizeLinear -> MatMulInteger)" if recipe.kind == "dynamic" else
                           "onnxruntime static INT8 (QOperator): S8 weights per channel, calibrated asymmetric U8 "
                           "activations (QLinearConv)"),
                "recipe": asdict(recipe), "reduce_range": reduce_range, "reduced_layers": res.reduced_layers,
                "kept_float": keep, "heldout_rel_rms": res.heldout_rel_rms,
                **({"calibration": {"method": "minmax", "samples": ranges.samples}} if ranges else {})}
            say(f"  {g}: wrote {path}: {res.reduced_layers} INT8 kernels ({how}), held-out rel RMS "
                f"{res.heldout_rel_rms:.2e} ({res.seconds:.1f} s)")
        if "fp16" in precisions:
            t0 = time.perf_counter()
            base, note = fp32_model, ""
            if g == "flow_estimator":
                with tempfile.TemporaryDirectory(prefix="cosyvoice-fp16-") as tmp:
                    base = fp16_estimator_fp32(model_dir, Path(tmp) / "flow_estimator.onnx")
                note = f"re-exported with attention mask bias {FP16_MASK_BIAS:g} (the official -1e10 is -inf in fp16)"
            keep = keep_float_nodes(base, FP16_KEEP_FLOAT.get(g, ()))
            h = convert_fp16(base, graph=g, keep_float=keep)
            path = root / "fp16" / f"{g}.onnx"
            _save(h, path)
            try:
                e: float | None = heldout_error(h)
            except Exception as exc:  # an fp16 kernel that onnxruntime's CPU provider lacks
                e, note = None, "; ".join(x for x in (note, f"onnxruntime CPU cannot run it: {exc}"[:300]) if x)
            res = GraphResult(g, "fp16", path, time.perf_counter() - t0, keep, count_reduced(h, "fp16"), e,
                              "onnxruntime float16 converter", note=note)
            results.append(res)
            manifests["fp16"][g] = {"file": path.name, "sha256": file_sha256(path), **src_entry,
                                    "format": "fp16 weights and activations, fp32 inputs/outputs",
                                    "kept_fp32": keep, "note": note, "heldout_rel_rms": e}
            say(f"  {g}: wrote {path}: {len(keep)} nodes kept fp32, held-out rel RMS "
                + (f"{e:.2e}" if e is not None else "n/a") + f" ({res.seconds:.1f} s)")
    common = {"source_model_dir": str(Path(model_dir).resolve()), "fp32_dir": str(fp32_dir),
              "heldout": held.summary()}
    for p, entries in manifests.items():
        if entries:
            _write_manifest(root / p, p, entries, common)
    cal = calib.summary() if calib is not None else {}
    return QuantizeReport(root, results, cal, sens_rows, time.perf_counter() - start)


#: onnxruntime's entropy calibrator re-bins a histogram of every activation per call (minutes per call on the
#: full-size graphs): it sees at most this many calls, evenly spread over the calibration pairs.
ENTROPY_MAX_CALLS = 50


def _cached_ranges(cache_dir: str | Path | None, fp32_path: Path, calib: PipelineFeeds, graph: str, method: str, *,
                   symmetric: bool, progress: Callable[[str], None] | None = None) -> Ranges:
    """:func:`calibrate`, cached in ``cache_dir`` by the fp32 file, the data and the method."""
    feeds = calib.feeds[graph]
    if method == "entropy" and len(feeds) > ENTROPY_MAX_CALLS:
        step = len(feeds) / ENTROPY_MAX_CALLS
        feeds = [feeds[int(i * step)] for i in range(ENTROPY_MAX_CALLS)]
    size = sum(int(a.size) for f in feeds for a in f.values())
    text = f"{file_sha256(fp32_path)}:{method}:{symmetric}:{len(calib.pairs)}:{calib.split}:{size}"
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"ranges-{graph}-{method}-{key}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        with contextlib.suppress(OSError, ValueError, KeyError):
            return Ranges.from_json(json.loads(path.read_text()))
    ranges = calibrate(fp32_path, FeedReader(feeds, graph), method, symmetric=symmetric, progress=progress)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(ranges.to_json()))
    return ranges
