"""ONNX export of every stage of CosyVoice2 voice conversion, each graph verified with onnxruntime.

Six graphs, named and shaped exactly as :data:`cosyvoice_triton.shapes.GRAPHS` (tensor names, dtypes, ranks,
dynamic axes from :meth:`TensorSpec.dim_names`), opset 17, fp32:

* ``flow_encoder`` (:class:`FlowEncoderGraph`): token embedding, ``UpsampleConformerEncoder``,
  ``encoder_proj`` and the speaker projection. ``speech_tokens`` holds each item's prompt tokens followed by
  its source tokens, right-padded; ``lookahead_len`` (0 = finalize, 3 = the last 3 valid tokens are only
  look-ahead) and ``streaming`` are per item. ``mu`` keeps the 2T time axis of the batch (no data-dependent
  output size), zero past ``mel_len = 2 * (speech_token_len - lookahead_len)``. Checked per item against
  :meth:`CausalMaskedDiffWithXvec.condition`.
* ``flow_estimator`` (:class:`EstimatorGraph`): one velocity evaluation; ``streaming`` per row.
* ``hift_source`` (:class:`HiftSourceGraph`): F0 predictor + NSF sine source (float64 phase accumulation:
  fp32/float64 only, never lower precision).
* ``hift_decoder`` (:class:`HiftDecoderGraph`): the generator with the conv STFT/iSTFT, weight norm folded.
* ``speech_tokenizer`` / ``speaker_encoder``: the model folder's ``speech_tokenizer_v2.onnx`` /
  ``campplus.onnx`` with their inputs and outputs renamed to the project's names (:func:`rename_io`), the
  graph otherwise untouched. The batch axis is made symbolic only when a probe shows that a batch of 2 gives
  the two single-item results (:func:`probe_dynamic_batch`); otherwise it stays 1 and the manifest says so.

Verification (:func:`verify_onnx`) runs each graph in onnxruntime at batch sizes and lengths that differ from
the export example, including padded batches of different valid lengths, the largest batch and the longest
length of the shape spec, and compares the valid regions with PyTorch. The flow graphs are compared with
*per-item* PyTorch runs (``flow.condition`` / a single-row estimator call), so the check covers padding and
the per-item flags too; the HiFT graphs, whose non-causal convolutions let padding reach the last ~12 valid
frames (:data:`HIFT_PADDING_NOTE`), with PyTorch on the same padded batch; the shipped graphs with the
original file run one item at a time. The bar is 1e-4 relative error (max |ort - ref| / max |ref|) for fp32.

HiFT's source accumulates ``2 pi * 480 * sum(f0 * k / sr)`` radians, so float32 rounding noise in f0
(~1e-6 relative; ONNX Runtime's convolutions round differently from PyTorch's) moves the harmonic phases of
a long utterance by up to ~1e-2 rad. ``hift_source`` is therefore gated on two checks that are exact to
float32 precision: its internal ``f0`` against PyTorch's (the tensor is read out of the same graph), and its
``source`` against PyTorch's ``source_from_f0`` given ONNX Runtime's own f0. The end-to-end source error
is reported too, as an informational row that does not gate (:data:`HIFT_SOURCE_END_TO_END_BAR`).

``export_onnx`` writes ``manifest.json`` next to the graphs: per graph the file, sha256, inputs/outputs,
opset, precision, whether the batch axis is dynamic, the source model folder and files, and the
verification figures.
"""

from __future__ import annotations

import copy
import datetime
import io
import json
import logging
import os
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..config import MelConfig, ModelConfig
from ..errors import CheckpointError
from ..frontend import features
from ..frontend.speech_models import (
    CAMPPLUS_FILENAME,
    CAMPPLUS_INPUTS,
    CAMPPLUS_OUTPUTS,
    SPEECH_TOKEN_VOCAB,
    TOKENIZER_FILENAME,
    TOKENIZER_INPUTS,
    TOKENIZER_OUTPUTS,
    _check_signature,
    speech_token_count,
)
from ..hashing import file_sha256
from ..models.checkpoint import load_flow, load_into, normalize_keys, read_state_dict
from ..models.estimator import CausalConditionalDecoder
from ..models.flow import CausalMaskedDiffWithXvec
from ..models.hift import HiFTGenerator, fold_weight_norm
from ..shapes import GRAPHS, NSF_HARMONICS, SAMPLES_PER_MEL_FRAME, GraphSpec

__all__ = [
    "ALL_GRAPHS",
    "HIFT_PADDING_NOTE",
    "HIFT_SOURCE_END_TO_END_BAR",
    "MANIFEST_NAME",
    "NEURAL_GRAPHS",
    "OPSET",
    "REL_TOL_FP32",
    "SHIPPED_GRAPHS",
    "BatchProbe",
    "Case",
    "CheckRow",
    "EstimatorGraph",
    "ExportReport",
    "FlowEncoderGraph",
    "GraphReport",
    "HiftDecoderGraph",
    "HiftSourceGraph",
    "SourceModels",
    "VerificationError",
    "export_graph",
    "export_onnx",
    "export_sizes",
    "format_table",
    "load_source_models",
    "prepare_shipped_graph",
    "probe_dynamic_batch",
    "rename_io",
    "sample_inputs",
    "spec_summary",
    "verification_cases",
    "verify_onnx",
]

log = logging.getLogger(__name__)

OPSET = 17
PRECISION = "fp32"
REL_TOL_FP32 = 1e-4
#: Reporting bar of ``hift_source``'s end-to-end source error (see the module docstring). That row does not
#: gate: its size is f0 rounding noise accumulated into phase (measured 4.4e-3 at 1508 frames, full dims),
#: not an export error; the gating checks are f0 and the source given the same f0, both at 1e-4.
HIFT_SOURCE_END_TO_END_BAR = 1e-2
#: HiFT's convolutions are not causal: a padded item's tail sees the padding (measured on the full-size demo
#: model: waveform rel err 0.38 over the last frames, 1.8e-3 excluding 8, 6.9e-5 excluding 10, 6e-7 excluding 12).
HIFT_PADDING_NOTE = ("not padding-invariant: in a padded batch an item's last ~12 mel frames differ from a solo run "
                     "(non-causal convolutions see the padding); batch equal lengths, or pad with real context "
                     "and drop the tail")
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1

ALL_GRAPHS: tuple[str, ...] = tuple(GRAPHS)
NEURAL_GRAPHS = ("flow_encoder", "flow_estimator", "hift_source", "hift_decoder")
#: graph -> (file in the model folder, official input specs, official output specs)
SHIPPED_GRAPHS = {
    "speech_tokenizer": (TOKENIZER_FILENAME, TOKENIZER_INPUTS, TOKENIZER_OUTPUTS),
    "speaker_encoder": (CAMPPLUS_FILENAME, CAMPPLUS_INPUTS, CAMPPLUS_OUTPUTS),
}
_SOURCE_FILES = {"flow_encoder": "flow.pt", "flow_estimator": "flow.pt", "hift_source": "hift.pt",
                 "hift_decoder": "hift.pt", **{k: v[0] for k, v in SHIPPED_GRAPHS.items()}}
_ONNX_DTYPES = {"float32": TensorProto.FLOAT, "int32": TensorProto.INT32, "bool": TensorProto.BOOL,
                "int64": TensorProto.INT64}
_MEL_FLOOR = float(np.log(1e-5))  # the CosyVoice mel of silence: padding value of mel inputs


class VerificationError(RuntimeError):
    """A graph's onnxruntime output differs from PyTorch beyond the bar; ``report`` has every figure."""

    def __init__(self, message: str, report: ExportReport | None = None):
        super().__init__(message)
        self.report = report


# ============================================================================================ wrappers


def _folded(module: nn.Module) -> nn.Module:
    """``module`` itself when it has no weight-norm parametrization left, else a folded deep copy."""
    if any(parametrize.is_parametrized(m) for m in module.modules()):
        return fold_weight_norm(copy.deepcopy(module))
    return module


class FlowEncoderGraph(nn.Module):
    """``flow_encoder``: tokens to ``mu`` / ``mel_len`` / ``spks``, every item with its own length, look-ahead
    and streaming flag.

    ``forward(speech_tokens [B, T] int32, speech_token_len [B] int32, lookahead_len [B] int32,
    speaker_embedding [B, 192] float32, streaming [B] bool) -> (mu [B, 80, 2T], mel_len [B] int32,
    spks [B, 80])``. Item b's tokens are ``speech_tokens[b, :speech_token_len[b]]`` (prompt, then source); its
    last ``lookahead_len[b]`` valid tokens (clamped to ``[0, pre_lookahead_len]``) only feed the encoder's
    look-ahead, as ``condition(finalize=False)`` does with its last ``pre_lookahead_len`` tokens. ``mu`` is
    zero past ``mel_len[b] = 2 * (speech_token_len[b] - lookahead_len[b])``. Token ids are clamped to the
    vocabulary, so padding values do not matter. ``lookahead_len`` must leave at least one token.
    """

    def __init__(self, flow: CausalMaskedDiffWithXvec):
        super().__init__()
        self.flow = flow  # only the embedding, speaker layer, encoder and encoder_proj end up in the graph
        self.vocab_size = flow.input_embedding.num_embeddings
        self.pre_lookahead_len = flow.pre_lookahead_len

    def forward(self, speech_tokens: Tensor, speech_token_len: Tensor, lookahead_len: Tensor,
                speaker_embedding: Tensor, streaming: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        flow, p = self.flow, self.pre_lookahead_len
        spks = flow.speaker_projection(speaker_embedding)
        total = speech_token_len.to(torch.int64)
        lookahead = lookahead_len.to(torch.int64).clamp(0, p)
        lens = total - lookahead  # [B] frames the encoder outputs (before the x2 upsampling)
        pos = torch.arange(speech_tokens.shape[1], device=speech_tokens.device).unsqueeze(0)
        emb = flow.input_embedding(speech_tokens.to(torch.int64).clamp(0, self.vocab_size - 1))
        emb = emb * (pos < total.unsqueeze(1)).unsqueeze(-1).to(emb.dtype)
        # the P tokens after each item's valid part (zeros beyond the batch's time axis); the encoder keeps
        # the first ``lookahead`` of them and places them right after the item's last frame
        ext = F.pad(emb, (0, 0, 0, p))
        idx = lens.unsqueeze(1) + torch.arange(p, device=emb.device).unsqueeze(0)  # [B, P]
        context = torch.gather(ext, 1, idx.unsqueeze(-1).expand(-1, -1, emb.shape[-1]))
        xs = emb * (pos < lens.unsqueeze(1)).unsqueeze(-1).to(emb.dtype)
        h, h_mask = flow.encoder(xs, lens, context=context, streaming=streaming.to(torch.bool),
                                 context_lens=lookahead)
        mask = h_mask.to(h.dtype)  # [B, 1, 2T]
        mu = flow.encoder_proj(h).transpose(1, 2) * mask
        mel_len = mask.sum(-1).squeeze(1).to(torch.int32)
        return mu, mel_len, spks


class ExportMish(nn.Module):
    """Mish for the exported fp32 graphs: ``x * tanh(softplus(x)) = x * n(n+2) / (n(n+2) + 2)`` with
    ``n = exp(min(x, 20))`` (above 20 both are x in float32). One Exp and five element-wise ops that onnxruntime
    vectorises, where its Softplus kernel is not: on a [2, 256, 400] tensor, 1 thread, about 1 ms against 8-20
    ms for Softplus -> Tanh -> Mul (README, Benchmark; the estimator has 28 of them per call). Equal to
    ``nn.Mish`` within float32 rounding. Not for fp16 (exp(20) overflows): the fp16 path exports ``nn.Mish``."""

    def forward(self, x: Tensor) -> Tensor:
        n = torch.exp(torch.clamp(x, max=20.0))
        a = n * (n + 2.0)
        return x * (a / (a + 2.0))


def with_export_mish(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with every ``nn.Mish`` replaced by :class:`ExportMish`."""
    module = copy.deepcopy(module)
    for parent in list(module.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Mish):
                setattr(parent, name, ExportMish())
    return module


class EstimatorGraph(nn.Module):
    """``flow_estimator``: ``forward(x, mask, mu, t, spks, cond, streaming [B] bool) -> velocity``, one
    streaming flag per row (the CFG rows of one utterance share it; rows of different requests may not).
    ``fast_mish``: export Mish as :class:`ExportMish` (a copy of the estimator; fp32 graphs)."""

    def __init__(self, estimator: CausalConditionalDecoder, *, fast_mish: bool = False):
        super().__init__()
        self.estimator = with_export_mish(estimator) if fast_mish else estimator

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: Tensor) -> Tensor:
        return self.estimator(x, mask, mu, t, spks, cond, streaming.to(torch.bool))


class HiftSourceGraph(nn.Module):
    """``hift_source``: ``forward(mel [B, 80, T], nsf_noise [B, 480T, 9]) -> source [B, 1, 480T]``.

    F0 predictor then NSF sine source. ``F0_NODE`` is the exported node whose output is f0 (the legacy
    exporter names nodes by module path, hence the attribute name ``f0_predictor``); verification reads f0
    out of the graph through it.
    """

    F0_NODE = "/f0_predictor/Abs"
    #: ``hift`` as the graph holds it (weight norm folded, on a copy when needed)
    prepared = staticmethod(_folded)

    def __init__(self, hift: HiFTGenerator):
        super().__init__()
        hift = self.prepared(hift)
        self.f0_predictor = hift.f0_predictor
        self.m_source = hift.m_source

    def forward(self, mel: Tensor, nsf_noise: Tensor) -> Tensor:
        return self.m_source(self.f0_predictor(mel), nsf_noise)


class HiftDecoderGraph(nn.Module):
    """``hift_decoder``: ``forward(mel [B, 80, T], source [B, 1, 480T]) -> waveform [B, 480T]``: source STFT,
    upsampling ResBlocks, exp (clip 100) / sin head, conv iSTFT, clamp. Weight norm is folded (on a copy
    when the given model still has it)."""

    def __init__(self, hift: HiFTGenerator):
        super().__init__()
        self.hift = _folded(hift)

    def forward(self, mel: Tensor, source: Tensor) -> Tensor:
        return self.hift.decode(mel, source)


# ========================================================================================= the models


@dataclass
class SourceModels:
    """What the graphs are exported from: the model folder, its config, flow and HiFT (weight norm folded)."""

    model_dir: Path
    config: ModelConfig
    flow: CausalMaskedDiffWithXvec | None = None
    hift: HiFTGenerator | None = None

    def wrapper(self, name: str) -> nn.Module:
        """The export wrapper of a neural graph."""
        if name in ("flow_encoder", "flow_estimator") and self.flow is None:
            raise ValueError(f"{name}: flow.pt was not loaded")
        if name in ("hift_source", "hift_decoder") and self.hift is None:
            raise ValueError(f"{name}: hift.pt was not loaded")
        if name == "flow_encoder":
            return FlowEncoderGraph(self.flow).eval()
        if name == "flow_estimator":
            return EstimatorGraph(self.flow.decoder.estimator, fast_mish=True).eval()
        if name == "hift_source":
            return HiftSourceGraph(self.hift).eval()
        if name == "hift_decoder":
            return HiftDecoderGraph(self.hift).eval()
        raise ValueError(f"{name!r} is not a neural graph (one of {', '.join(NEURAL_GRAPHS)})")


def _check_model_dir(model_dir: str | Path, files: Iterable[str]) -> Path:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: model folder not found")
    missing = [f for f in dict.fromkeys(files) if not (model_dir / f).is_file()]
    if missing:
        raise CheckpointError(f"{model_dir}: missing {', '.join(missing)} (a CosyVoice2 model folder has "
                              "cosyvoice2.yaml, flow.pt, hift.pt, speech_tokenizer_v2.onnx, campplus.onnx)")
    return model_dir


def load_source_models(model_dir: str | Path, *, flow: bool = True, hift: bool = True) -> SourceModels:
    """Load ``flow.pt`` / ``hift.pt`` of an official (or demo) folder as ``CosyVoice2.from_pretrained`` does."""
    files = ["cosyvoice2.yaml"] + (["flow.pt"] if flow else []) + (["hift.pt"] if hift else [])
    model_dir = _check_model_dir(model_dir, files)
    config = ModelConfig.from_yaml(model_dir / "cosyvoice2.yaml")
    models = SourceModels(model_dir, config)
    if flow:
        models.flow = load_flow(model_dir / "flow.pt", config.flow)
    if hift:
        path = model_dir / "hift.pt"
        models.hift = HiFTGenerator(config.hift)
        load_into(models.hift, normalize_keys(read_state_dict(path)), path)
        models.hift.fold_weight_norm().eval()
    return models


# ============================================================================================= shapes


@dataclass(frozen=True)
class Case:
    """One verification (or export) input: ``batch`` items of ``lengths`` along the graph's length axis;
    ``streaming`` / ``lookahead`` per item for the flow graphs."""

    label: str
    batch: int
    lengths: tuple[int, ...]
    streaming: tuple[bool, ...] = ()
    lookahead: tuple[int, ...] = ()

    @property
    def shape(self) -> str:
        return f"{self.batch}x{max(self.lengths)}"

    @property
    def name(self) -> str:
        return f"{self.label} {self.shape}"


def _length_axis(spec: GraphSpec) -> str:
    """The graph's length axis: the first non-batch axis among its inputs' dims."""
    for t in spec.inputs:
        for d in t.shape:
            axis = d if isinstance(d, str) else d[0] if isinstance(d, tuple) else None
            if axis is not None and axis != "batch":
                return axis
    raise ValueError(f"{spec.name}: no length axis")


def export_sizes(name: str, spec: GraphSpec | None = None) -> tuple[int, int]:
    """(batch, length) of the example a graph is traced with; verification avoids both. ``spec``: the graph's
    spec when it is not one of :data:`GRAPHS` (CosyVoice3's)."""
    spec = spec or GRAPHS[name]
    b, ax = spec.axes["batch"], spec.axes[_length_axis(spec)]
    return min(b.min + 2, b.max), min(ax.min + 33, ax.max)


def verification_cases(name: str, *, max_length: int | None = None, batch_dynamic: bool = True,
                       equal_lengths: bool | None = None, lookahead: int = 3,
                       spec: GraphSpec | None = None) -> list[Case]:
    """The checks of one graph, all within the spec's ranges and away from the export example:

    ``single`` (smallest batch), ``padded`` (different valid lengths down to the axis minimum, mixed
    streaming / look-ahead), ``long`` (batch 2, the axis maximum or ``max_length``), ``max-batch`` (the
    batch maximum, short lengths). A graph without a dynamic batch axis gets batch-1 cases only; with
    ``equal_lengths`` (default: only ``speaker_encoder``, which has no length input) every item of a case
    has the case's longest length, and ``padded`` becomes ``equal``. ``spec``: as :func:`export_sizes`.
    """
    spec = spec or GRAPHS[name]
    b, ax = spec.axes["batch"], spec.axes[_length_axis(spec)]
    lo, hi = ax.min, ax.max if max_length is None else max(ax.min, min(ax.max, int(max_length)))
    export_b, export_t = export_sizes(name, spec)
    clip = lambda n: max(lo, min(hi, int(n)))

    def avoid(lengths: list[int]) -> tuple[int, ...]:  # the longest item sets T: keep it off the export T
        top = max(lengths)
        if top == export_t:
            new = top + 1 if top + 1 <= hi else top - 1
            lengths = [new if n == top else min(n, new) for n in lengths]
        return tuple(max(lo, n) for n in lengths)

    def batch(n: int) -> int:
        n = max(b.min, min(b.max, n))
        return n if n != export_b else (n + 1 if n + 1 <= b.max else n - 1)

    specs: list[tuple[str, int, list[int]]] = []
    if batch_dynamic:
        nb = batch(b.min)
        specs.append(("single", nb, [clip(lo + 57)] * nb))
        nb = batch(b.min + 3)
        top = clip(lo + 150)
        specs.append(("padded", nb, [clip(top - (top - lo) * i / (nb - 1)) for i in range(nb)]))
        nb = batch(2)
        specs.append(("long", nb, [hi, clip(round(hi * 0.77))] + [clip(hi // 3)] * (nb - 2)))
        nb = batch(b.max)
        short = clip(lo + 60)
        specs.append(("max-batch", nb, [clip(lo + (i * 37) % (short - lo + 1)) for i in range(nb)]))
    else:
        specs += [("single", 1, [clip(lo + 57)]), ("single", 1, [lo]), ("long", 1, [hi])]
    if equal_lengths or (equal_lengths is None and name == "speaker_encoder"):  # no padding in one call
        specs = [("equal" if label == "padded" else label, nb, [max(lengths)] * nb) for label, nb, lengths in specs]
    cases = []
    for label, nb, lengths in specs:
        lengths = avoid(lengths)
        flags = tuple((i % 2 == 0) != (label == "long") for i in range(nb))
        la = tuple(lookahead if i % 3 == (0 if label != "long" else 1) and n > lookahead else 0
                   for i, n in enumerate(lengths))
        if name == "flow_encoder":
            cases.append(Case(label, nb, lengths, flags, la))
        elif name == "flow_estimator":
            cases.append(Case(label, nb, lengths, flags))
        else:
            cases.append(Case(label, nb, lengths))
    seen, unique = set(), []
    for c in cases:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique


# ============================================================================================= inputs


def _speech_like_mel(frames: int, rng: np.random.Generator, mel: MelConfig) -> np.ndarray:
    """A deterministic speech-like CosyVoice mel [80, frames]: voiced syllables with a gliding f0
    (80-300 Hz), decaying harmonics and a syllable envelope, unvoiced noise bursts, pauses."""
    sr, hop = mel.sampling_rate, mel.hop_size
    n = frames * hop
    t = np.arange(n) / sr
    seg = max(1, int(0.18 * sr))
    kinds = rng.choice(3, size=n // seg + 1, p=[0.7, 0.15, 0.15])  # voiced, unvoiced, pause
    kind = np.repeat(kinds, seg)[:n]
    base = rng.uniform(110, 200)
    f0 = base * np.exp(0.25 * np.sin(2 * np.pi * rng.uniform(0.2, 0.8) * t + rng.uniform(0, 6)))
    f0 = np.clip(f0 + 15 * np.sin(2 * np.pi * 3.1 * t), 80, 300)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    voiced = sum(np.sin(k * phase + rng.uniform(0, 6)) / k for k in range(1, 16))
    env = 0.3 + 0.7 * np.sin(np.pi * (np.arange(n) % seg) / seg) ** 2
    y = np.where(kind == 0, voiced, 0.0) + np.where(kind == 1, rng.normal(0, 0.8, n), 0.0)
    y = y * env + rng.normal(0, 0.003, n)
    y = (0.4 * y / max(np.max(np.abs(y)), 1e-9)).astype(np.float32)
    out = features.cosyvoice_mel(y, sample_rate=sr, config=mel)  # [frames, 80]
    return np.ascontiguousarray(out[:frames].T)


def sample_inputs(name: str, case: Case, *, module: nn.Module | None = None, seed: int = 0,
                  mel_config: MelConfig | None = None) -> dict[str, np.ndarray]:
    """Deterministic inputs of graph ``name`` for ``case`` (numpy, spec dtypes, padded to the longest item).

    Padding is filled with values a server might leave there (random tokens, noise, the mel of silence),
    so a graph that leaked padding into valid frames would fail. ``hift_decoder`` needs ``module`` (its
    :class:`HiftDecoderGraph`) to produce a realistic ``source``; ``flow_encoder`` reads the vocabulary size
    from it when given.
    """
    spec = GRAPHS[name]
    rng = np.random.default_rng([seed, ALL_GRAPHS.index(name), case.batch, *case.lengths])
    b, lengths = case.batch, np.asarray(case.lengths, dtype=np.int64)
    t = int(lengths.max())
    valid = np.arange(t)[None, :] < lengths[:, None]  # [B, T]
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)
    if name == "flow_encoder":
        vocab = module.vocab_size if isinstance(module, FlowEncoderGraph) else SPEECH_TOKEN_VOCAB
        feeds = {"speech_tokens": rng.integers(0, vocab, (b, t)).astype(np.int32),
                 "speech_token_len": lengths.astype(np.int32),
                 "lookahead_len": np.asarray(case.lookahead or [0] * b, dtype=np.int32),
                 "speaker_embedding": f32(rng.normal(0.0, 1.0, (b, spec.tensor("speaker_embedding").shape[1]))),
                 "streaming": np.asarray(case.streaming or [False] * b, dtype=bool)}
    elif name == "flow_estimator":
        c = spec.tensor("x").shape[1]  # mel bins
        m = valid[:, None, :].astype(np.float32)
        uncond = (np.arange(b) >= (b + 1) // 2)[:, None, None]  # CFG layout: [cond rows, uncond rows]
        prompt = (np.arange(t)[None, :] < (lengths // 3)[:, None])[:, None, :]
        feeds = {"x": f32(rng.normal(size=(b, c, t))), "mask": m,
                 "mu": f32(np.where(uncond, 0.0, rng.normal(size=(b, c, t)) * m)),
                 "t": f32(rng.uniform(0.0, 1.0, b)),
                 "spks": f32(np.where(uncond[:, :, 0], 0.0, rng.normal(size=(b, c)))),
                 "cond": f32(np.where(uncond | ~prompt, 0.0, rng.normal(size=(b, c, t)))),
                 "streaming": np.asarray(case.streaming or [False] * b, dtype=bool)}
    elif name in ("hift_source", "hift_decoder"):
        cfg = mel_config or MelConfig()
        if cfg.num_mels != spec.tensor("mel").shape[1] or cfg.hop_size != SAMPLES_PER_MEL_FRAME:
            raise ValueError(f"{name}: mel config {cfg} does not match the spec's mel (bins, hop)")
        mel = np.full((b, cfg.num_mels, t), _MEL_FLOOR, dtype=np.float32)
        for i, n in enumerate(lengths):
            mel[i, :, :n] = _speech_like_mel(int(n), rng, cfg)
        noise = f32(rng.standard_normal((b, t * SAMPLES_PER_MEL_FRAME, NSF_HARMONICS)))
        if name == "hift_source":
            feeds = {"mel": mel, "nsf_noise": noise}
        else:
            if not isinstance(module, HiftDecoderGraph):
                raise ValueError("sample_inputs('hift_decoder') needs the HiftDecoderGraph to build its source")
            with torch.inference_mode():
                hift = module.hift
                source = hift.source_from_f0(hift.f0_predictor(torch.from_numpy(mel)), torch.from_numpy(noise))
            source = source.numpy() * np.repeat(valid, SAMPLES_PER_MEL_FRAME, axis=1)[:, None, :]
            feeds = {"mel": mel, "source": f32(source)}
    elif name == "speech_tokenizer":
        bins = spec.tensor("whisper_mel").shape[1]
        feeds = {"whisper_mel": f32(rng.normal(0.0, 0.5, (b, bins, t)) * valid[:, None, :]),
                 "whisper_mel_len": lengths.astype(np.int32)}
    elif name == "speaker_encoder":
        bins = spec.tensor("fbank").shape[2]
        feeds = {"fbank": f32(rng.normal(0.0, 3.0, (b, t, bins)) * valid[:, :, None])}
    else:
        raise ValueError(f"unknown graph {name!r}")
    for ts in spec.inputs:  # the spec is the contract: fail here rather than in a session
        shape = spec.resolve(ts, {**{k: 0 for k in spec.axes}, "batch": b, _length_axis(spec): t})
        got = feeds[ts.name]
        if got.dtype != np.dtype(ts.dtype) or len(got.shape) != len(shape) or any(
                s and g != s for g, s in zip(got.shape, shape, strict=True)):
            raise AssertionError(f"{name}.{ts.name}: built {got.dtype} {got.shape}, spec {ts.dtype} {shape}")
    return feeds


# ============================================================================================= export


def _dynamic_axes(spec: GraphSpec, batch_dynamic: bool = True) -> dict[str, dict[int, str]]:
    return {t.name: {i: d for i, d in enumerate(t.dim_names())
                     if isinstance(d, str) and (batch_dynamic or d != "batch")}
            for t in (*spec.inputs, *spec.outputs)}


def _set_io(model: onnx.ModelProto, spec: GraphSpec, *, batch_dynamic: bool = True,
            check_dtypes: bool = True) -> None:
    """Set the graph's declared inputs and outputs to the spec: order, names, dims (dtype checked).

    A fixed size in the graph that contradicts the spec raises; a symbolic or unknown one is renamed. With
    ``batch_dynamic=False`` the batch axis is declared as 1.
    """
    g = model.graph
    for kind, values, specs in (("input", g.input, spec.inputs), ("output", g.output, spec.outputs)):
        inits = {i.name for i in g.initializer}
        real = [v for v in values if v.name not in inits]
        if [v.name for v in real] != [t.name for t in specs]:
            raise ValueError(f"{spec.name}: graph {kind}s {[v.name for v in real]} are not the spec's "
                             f"{[t.name for t in specs]}")
        for v, ts in zip(real, specs, strict=True):
            tt = v.type.tensor_type
            if check_dtypes and tt.elem_type != _ONNX_DTYPES[ts.dtype]:
                raise ValueError(f"{spec.name}.{ts.name}: graph dtype "
                                 f"{TensorProto.DataType.Name(tt.elem_type)}, spec {ts.dtype}")
            names = ts.dim_names()
            old = list(tt.shape.dim) if tt.HasField("shape") else []
            if old and len(old) != len(names):
                raise ValueError(f"{spec.name}.{ts.name}: graph rank {len(old)}, spec rank {len(names)}")
            for i, want in enumerate(names):
                if not old or not old[i].HasField("dim_value"):
                    continue  # symbolic or unknown: takes the spec's name
                have = old[i].dim_value
                if not (have == want if isinstance(want, int) else want == "batch" and have == 1):
                    raise ValueError(f"{spec.name}.{ts.name}: axis {i} is fixed to {have} in the graph, the spec "
                                     f"has {want!r}")
            tt.ClearField("shape")
            for want in names:
                d = tt.shape.dim.add()
                if want == "batch" and not batch_dynamic:
                    d.dim_value = 1
                elif isinstance(want, int):
                    d.dim_value = want
                else:
                    d.dim_param = want


def _save_model(model: onnx.ModelProto, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, path)


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), -1)


def _torch_example(name: str, module: nn.Module, seed: int = 1234) -> tuple[Tensor, ...]:
    b, t = export_sizes(name)
    spec = GRAPHS[name]
    lengths = tuple(max(spec.axes[_length_axis(spec)].min, t - 7 * i) for i in range(b))
    p = getattr(module, "pre_lookahead_len", 3)
    case = Case("export", b, lengths, tuple(i % 2 == 1 for i in range(b)),
                tuple(p if i % 2 == 0 else 0 for i in range(b)))
    feeds = sample_inputs(name, case, module=module, seed=seed)
    return tuple(torch.from_numpy(feeds[t.name]) for t in spec.inputs)


def export_graph(module: nn.Module, name: str, path: str | Path, *, opset: int = OPSET,
                 example: Sequence[Tensor] | None = None, spec: GraphSpec | None = None) -> onnx.ModelProto:
    """Export one wrapper with the legacy exporter (``dynamo=False``) to ``path``, I/O exactly as the spec.

    ``example`` defaults to :func:`export_sizes` (batch and length that verification never uses); a graph
    outside :data:`GRAPHS` passes its ``spec`` and its ``example``.
    """
    if spec is not None and example is None:
        raise ValueError(f"{name}: a graph given by its spec needs its example inputs")
    spec = spec or GRAPHS[name]
    example = tuple(example) if example is not None else _torch_example(name, module)
    buf = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer notices
        torch.onnx.export(module.eval(), example, buf, dynamo=False, opset_version=opset,
                          input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs],
                          dynamic_axes=_dynamic_axes(spec), do_constant_folding=True)
    model = onnx.load_from_string(buf.getvalue())
    _set_io(model, spec)
    model.doc_string = spec.doc
    helper.set_model_props(model, {"cosyvoice_triton.graph": name, "cosyvoice_triton.precision": PRECISION})
    onnx.checker.check_model(model)
    _save_model(model, Path(path))
    return model


# ===================================================================================== shipped graphs


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names = {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
    names |= {i.name for i in graph.initializer} | {i.values.name for i in graph.sparse_initializer}
    for node in graph.node:
        names.update(n for n in (*node.input, *node.output) if n)
        for attr in node.attribute:
            for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                names |= _all_names(sub)
    return names


def _rename_in_graph(graph: onnx.GraphProto, mapping: Mapping[str, str]) -> None:
    for v in (*graph.input, *graph.output, *graph.value_info):
        v.name = mapping.get(v.name, v.name)
    for init in graph.initializer:
        init.name = mapping.get(init.name, init.name)
    for sparse in graph.sparse_initializer:
        sparse.values.name = mapping.get(sparse.values.name, sparse.values.name)
    for ann in graph.quantization_annotation:
        ann.tensor_name = mapping.get(ann.tensor_name, ann.tensor_name)
    for node in graph.node:
        for i, n in enumerate(node.input):
            node.input[i] = mapping.get(n, n)
        for i, n in enumerate(node.output):
            node.output[i] = mapping.get(n, n)
        for attr in node.attribute:  # If/Loop/Scan bodies may read outer-scope names
            for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                _rename_in_graph(sub, mapping)


def rename_io(model: onnx.ModelProto, mapping: Mapping[str, str]) -> onnx.ModelProto:
    """A copy of ``model`` with graph inputs/outputs renamed (``{"feats": "whisper_mel", ...}``).

    Every reference is renamed with them: node inputs and outputs, value_info, initializers, subgraphs.
    Raises ``ValueError`` for a name that is not a graph input or output, or a new name already in use.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    io_names = {v.name for v in (*g.input, *g.output)}
    unknown = sorted(set(mapping) - io_names)
    if unknown:
        raise ValueError(f"rename_io: {unknown} are not inputs or outputs of the graph (it has {sorted(io_names)})")
    clash = sorted(set(mapping.values()) & (_all_names(g) - set(mapping)))
    if clash:
        raise ValueError(f"rename_io: {clash} already name tensors of the graph")
    if len(set(mapping.values())) != len(mapping):
        raise ValueError(f"rename_io: two names map to the same new name in {dict(mapping)}")
    _rename_in_graph(g, {k: v for k, v in mapping.items() if k != v})
    return out


@dataclass
class BatchProbe:
    """Result of :func:`probe_dynamic_batch`."""

    dynamic: bool
    padded_exact: bool | None  # a padded batch of different lengths gives the single results (None: no length input)
    note: str


def _session(model: onnx.ModelProto | str | Path | bytes, threads: int = 0):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.intra_op_num_threads = int(threads)
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else (
        str(model) if isinstance(model, (str, Path)) else model)
    return ort.InferenceSession(src, sess_options=options, providers=["CPUExecutionProvider"])


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    if not np.issubdtype(a.dtype, np.floating):
        return bool(np.array_equal(a, b))
    return _rel(a, b) <= REL_TOL_FP32


def _valid(name: str, arr: np.ndarray, i: int, n: int) -> np.ndarray:
    """Item ``i``'s valid region of a shipped graph's output for a valid input length ``n``."""
    if name == "speech_tokenizer":
        return arr[i, : int(speech_token_count(n))]
    return arr[i]


def _item(name: str, feeds: Mapping[str, np.ndarray], i: int, n: int) -> dict[str, np.ndarray]:
    """Item ``i`` of a shipped graph's batch alone, cut to its ``n`` valid frames (batch 1)."""
    spec = GRAPHS[name]
    x = spec.inputs[0].name
    if name == "speech_tokenizer":  # [B, 128, T] and its lengths
        return {x: feeds[x][i : i + 1, :, :n], spec.inputs[1].name: np.array([n], dtype=np.int32)}
    return {x: feeds[x][i : i + 1, :n]}  # speaker_encoder: [B, T, 80]


def probe_dynamic_batch(model: onnx.ModelProto, name: str, *, threads: int = 0) -> BatchProbe:
    """Whether a renamed shipped graph serves batches: run it at batch 2 with a symbolic batch axis and
    compare with two batch-1 runs (equal lengths; for a graph with a length input also different lengths,
    padding filled with noise). Any failure to load or run means "no"."""
    spec = GRAPHS[name]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    _set_io(probe, spec, batch_dynamic=True, check_dtypes=False)
    lo = spec.axes[_length_axis(spec)].min
    has_len = len(spec.inputs) > 1
    try:
        sess = _session(probe, threads)
        out_names = [t.name for t in spec.outputs]

        def run_pair(lengths: tuple[int, int], seed: int) -> bool:
            feeds = sample_inputs(name, Case("probe", 2, lengths), seed=seed)
            if name == "speech_tokenizer":  # padding filled with noise: a graph must ignore it
                x = spec.inputs[0].name
                noise = np.random.default_rng(seed).normal(0.0, 0.5, feeds[x].shape).astype(np.float32)
                valid = np.arange(feeds[x].shape[2])[None, None, :] < np.asarray(lengths)[:, None, None]
                feeds[x] = np.where(valid, feeds[x], noise)
            together = sess.run(out_names, feeds)
            for i, n in enumerate(lengths):
                alone = sess.run(out_names, _item(name, feeds, i, n))
                for a, t in zip(alone, together, strict=True):
                    if not _close(_valid(name, a, 0, n), _valid(name, t, i, n)):
                        return False
            return True

        equal = run_pair((lo + 96, lo + 96), 11)
        padded = run_pair((lo + 96, lo + 19), 12) if has_len and equal else None
    except Exception as exc:  # onnxruntime's own exception types: a baked batch size fails here
        return BatchProbe(False, None, f"batch 2 does not run: {type(exc).__name__}: {str(exc)[:300]}")
    if not equal:
        return BatchProbe(False, None, "batch 2 runs but differs from two batch-1 runs")
    if padded is False:
        return BatchProbe(True, False, "batch 2 equals two batch-1 runs for equal lengths only; padded "
                                       "items of different lengths differ (batch equal lengths)")
    if padded:
        return BatchProbe(True, True, "batch 2 equals two batch-1 runs, also padded to different lengths")
    return BatchProbe(True, None, "batch 2 equals two batch-1 runs of equal length; no length input, so "
                                  "only equal-length items may share a call")


def prepare_shipped_graph(original: onnx.ModelProto, name: str, *, threads: int = 0
                          ) -> tuple[onnx.ModelProto, BatchProbe, dict[str, str], list[str]]:
    """Rename a shipped graph's I/O from the official names (``speech_models``' signature constants) to the
    spec's, cast an integer output to the spec's integer type if needed (an int64 ``indices``), probe the
    batch axis and declare it (symbolic, or 1). The graph is otherwise left as it is.

    Returns (model, probe, mapping old -> new names, list of adaptations made beyond the renaming).
    """
    spec = GRAPHS[name]
    _, official_in, official_out = SHIPPED_GRAPHS[name]
    mapping = {o.name: t.name for o, t in zip((*official_in, *official_out), (*spec.inputs, *spec.outputs),
                                                strict=True)}
    model = rename_io(original, mapping)
    adaptations = []
    g = model.graph
    for out, ts in zip(g.output, spec.outputs, strict=True):
        have, want = out.type.tensor_type.elem_type, _ONNX_DTYPES[ts.dtype]
        if have == want:
            continue
        ints = (TensorProto.INT32, TensorProto.INT64)
        if have not in ints or want not in ints:
            raise CheckpointError(f"{name}: output {ts.name} is {TensorProto.DataType.Name(have)}, the spec "
                                  f"needs {ts.dtype}")
        inner = f"{ts.name}_{TensorProto.DataType.Name(have).lower()}"
        _rename_in_graph(g, {ts.name: inner})
        out.name = ts.name
        out.type.tensor_type.elem_type = want
        g.node.append(helper.make_node("Cast", [inner], [ts.name], name=f"{ts.name}_cast", to=want))
        adaptations.append(f"appended Cast {inner} ({TensorProto.DataType.Name(have)}) -> {ts.name} ({ts.dtype})")
    probe = probe_dynamic_batch(model, name, threads=threads)
    _set_io(model, spec, batch_dynamic=probe.dynamic)
    helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                   "cosyvoice_triton.graph": name,
                                   "cosyvoice_triton.renamed_io": json.dumps(mapping)})
    onnx.checker.check_model(model)
    return model, probe, mapping, adaptations


# ======================================================================================= verification


@dataclass
class CheckRow:
    """One comparison: ``rel = max_abs / max|ref|`` over the valid regions of every item of the case.
    ``bar`` 0 means exact (integers); ``gate`` False rows are reported but do not fail the export."""

    graph: str
    case: str
    output: str
    max_abs: float
    rel: float
    bar: float
    passed: bool
    gate: bool = True
    note: str = ""


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a64.size == 0:
        return 0.0
    err = float(np.max(np.abs(a64 - b64)))
    scale = float(np.max(np.abs(b64)))
    return err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))


def _compare(graph: str, case: Case, output: str, got: Sequence[np.ndarray], ref: Sequence[np.ndarray], *,
             bar: float, gate: bool = True, note: str = "") -> CheckRow:
    """Compare per-item valid regions (lists of arrays, one per item)."""
    a = np.concatenate([np.ravel(x).astype(np.float64) for x in got])
    b = np.concatenate([np.ravel(x).astype(np.float64) for x in ref])
    if a.shape != b.shape:
        return CheckRow(graph, case.name, output, float("inf"), float("inf"), bar, False, gate,
                        f"shape mismatch {a.shape} vs {b.shape}")
    max_abs = float(np.max(np.abs(a - b))) if a.size else 0.0
    rel = _rel(a, b)
    ok = bool(np.isfinite(a).all()) and (max_abs == 0.0 if bar == 0 else rel <= bar)
    return CheckRow(graph, case.name, output, max_abs, rel, bar, ok, gate, note)


def _with_output(model: onnx.ModelProto, node_name: str, alias: str) -> onnx.ModelProto:
    """A copy of ``model`` that also outputs the (first) output of node ``node_name`` as graph output."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    found = [n for n in out.graph.node if n.name == node_name]
    if len(found) != 1:
        raise VerificationError(f"cannot find node {node_name!r} in the graph to read f0 from")
    out.graph.output.append(helper.make_tensor_value_info(found[0].output[0], TensorProto.FLOAT, None))
    out.graph.output[-1].doc_string = alias
    return out


def _verify_case(name: str, case: Case, sess, reference, feeds: dict[str, np.ndarray], *, probe_sess=None,
                 original_sess=None, original_names: Sequence[str] = ()) -> list[CheckRow]:
    spec = GRAPHS[name]
    lengths = case.lengths
    out_names = [t.name for t in spec.outputs]
    got = dict(zip(out_names, sess.run(out_names, feeds), strict=True))
    tt = {k: torch.from_numpy(v) for k, v in feeds.items()}
    rows: list[CheckRow] = []
    s = SAMPLES_PER_MEL_FRAME

    if name == "flow_encoder":
        flow = reference.flow
        mu_ref, len_ref, spks_ref = [], [], []
        with torch.inference_mode():
            for i, n in enumerate(lengths):
                tok = tt["speech_tokens"][i, :n]
                k = n // 3  # any prompt/source split gives the same tokens to the encoder
                la = int(feeds["lookahead_len"][i])
                if la not in (0, reference.pre_lookahead_len):
                    raise ValueError(f"flow.condition can check lookahead 0 or {reference.pre_lookahead_len}, not {la}")
                c = flow.condition(tok[k:][None], tok[:k][None], torch.zeros(1, 0, got["mu"].shape[1]),
                                   tt["speaker_embedding"][i : i + 1], streaming=bool(feeds["streaming"][i]),
                                   finalize=la == 0)
                full = torch.zeros(got["mu"].shape[1:])
                full[:, : c.mu.shape[2]] = c.mu[0]
                mu_ref.append(full.numpy())
                len_ref.append(c.mel_len.numpy().astype(np.int32))
                spks_ref.append(c.spks[0].numpy())
        rows.append(_compare(name, case, "mu", list(got["mu"]), mu_ref, bar=REL_TOL_FP32,
                             note="per item vs condition()"))
        rows.append(_compare(name, case, "mel_len", [got["mel_len"]], [np.concatenate(len_ref)], bar=0))
        rows.append(_compare(name, case, "spks", list(got["spks"]), spks_ref, bar=REL_TOL_FP32))
    elif name == "flow_estimator":
        est = reference.estimator
        ref = []
        with torch.inference_mode():
            for i, n in enumerate(lengths):
                one = [tt[k][i : i + 1, ..., :n] if tt[k].ndim == 3 else tt[k][i : i + 1]
                       for k in ("x", "mask", "mu", "t", "spks", "cond")]
                v = est(*one, streaming=bool(feeds["streaming"][i]))[0]
                full = torch.zeros(got["velocity"].shape[1:])
                full[:, :n] = v
                ref.append(full.numpy())
        rows.append(_compare(name, case, "velocity", list(got["velocity"]), ref, bar=REL_TOL_FP32,
                             note="per row vs solo run"))
    elif name == "hift_source":
        with torch.inference_mode():
            reference_f0 = reference.f0_predictor(tt["mel"])
            ref_source = reference.m_source(reference_f0, tt["nsf_noise"]).numpy()
        f0_ort = probe_sess.run([probe_sess.get_outputs()[-1].name], feeds)[0]  # the same graph's f0
        with torch.inference_mode():
            given = reference.m_source(torch.from_numpy(f0_ort), tt["nsf_noise"]).numpy()
        src = got["source"]
        f0_ref = reference_f0.numpy()
        voiced = float(np.mean(np.concatenate([f0_ref[i, :n] > 10 for i, n in enumerate(lengths)])))
        rows.append(_compare(name, case, "f0 (internal)", [f0_ort[i, :n] for i, n in enumerate(lengths)],
                             [f0_ref[i, :n] for i, n in enumerate(lengths)], bar=REL_TOL_FP32,
                             note=f"voiced {voiced:.0%}"))
        rows.append(_compare(name, case, "source | same f0", [src[i, :, : n * s] for i, n in enumerate(lengths)],
                             [given[i, :, : n * s] for i, n in enumerate(lengths)], bar=REL_TOL_FP32,
                             note="torch given ORT's f0"))
        rows.append(_compare(name, case, "source (end to end)", [src[i, :, : n * s] for i, n in enumerate(lengths)],
                             [ref_source[i, :, : n * s] for i, n in enumerate(lengths)],
                             bar=HIFT_SOURCE_END_TO_END_BAR, gate=False, note="f0 rounding -> phase drift"))
    elif name == "hift_decoder":
        with torch.inference_mode():
            ref = reference(tt["mel"], tt["source"]).numpy()
        wav = got["waveform"]
        rows.append(_compare(name, case, "waveform", [wav[i, : n * s] for i, n in enumerate(lengths)],
                             [ref[i, : n * s] for i, n in enumerate(lengths)], bar=REL_TOL_FP32))
    else:  # shipped graphs: the renamed graph against the original, one item per call
        alone: dict[str, list[np.ndarray]] = {o: [] for o in out_names}
        got_valid: dict[str, list[np.ndarray]] = {o: [] for o in out_names}
        in_orig, out_orig = original_names
        for i, n in enumerate(lengths):
            one = _item(name, feeds, i, n)
            res = original_sess.run(list(out_orig), {o: one[t.name] for o, t in zip(in_orig, spec.inputs,
                                                                                     strict=True)})
            for o, r in zip(out_names, res, strict=True):
                alone[o].append(_valid(name, r, 0, n).astype(got[o].dtype))
                got_valid[o].append(_valid(name, got[o], i, n))
        for o in out_names:
            exact = not np.issubdtype(got[o].dtype, np.floating)
            rows.append(_compare(name, case, o, got_valid[o], alone[o], bar=0 if exact else REL_TOL_FP32,
                                 note="vs shipped file, per item"))
    return rows


def verify_onnx(name: str, onnx_path: str | Path, reference: nn.Module | str | Path, *,
                max_length: int | None = None, batch_dynamic: bool = True, equal_lengths: bool | None = None,
                seed: int = 0,
                cases: Sequence[Case] | None = None, mel_config: MelConfig | None = None,
                threads: int = 0) -> list[CheckRow]:
    """Run graph ``name`` (``onnx_path``) in onnxruntime on :func:`verification_cases` and compare with
    ``reference``: its export wrapper (neural graphs) or the original shipped ONNX file (renamed graphs).
    ``batch_dynamic`` / ``equal_lengths``: see :func:`verification_cases` (a shipped graph that batches only
    equal lengths is checked that way). Returns one :class:`CheckRow` per (case, output); nothing is raised
    for a failing row."""
    model = onnx.load(str(onnx_path))
    sess = _session(model, threads)
    probe_sess = original_sess = None
    original_names: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    if name == "hift_source":
        probe_sess = _session(_with_output(model, HiftSourceGraph.F0_NODE, "f0"), threads)
    if name in SHIPPED_GRAPHS:
        original_sess = _session(Path(reference), threads)
        _, official_in, official_out = SHIPPED_GRAPHS[name]
        original_names = (tuple(s.name for s in official_in), tuple(s.name for s in official_out))
    p = getattr(reference, "pre_lookahead_len", 3)
    cases = list(cases) if cases is not None else verification_cases(
        name, max_length=max_length, batch_dynamic=batch_dynamic, equal_lengths=equal_lengths, lookahead=p)
    rows: list[CheckRow] = []
    module = reference if isinstance(reference, nn.Module) else None
    for k, case in enumerate(cases, 1):
        start = time.perf_counter()
        feeds = sample_inputs(name, case, module=module, seed=seed, mel_config=mel_config)
        new = _verify_case(name, case, sess, reference, feeds, probe_sess=probe_sess,
                           original_sess=original_sess, original_names=original_names)
        rows += new
        worst = max([r for r in new if r.gate] or new,
                    key=lambda r: r.rel / r.bar if r.bar else (0.0 if r.passed else float("inf")))
        log.info("  verify %s %d/%d %-18s worst %s rel %.2e (bar %s) %s  %.1f s", name, k, len(cases), case.name,
                 worst.output, worst.rel, _bar(worst.bar), "ok" if all(r.passed for r in new) else "FAIL",
                 time.perf_counter() - start)
    return rows


def _bar(bar: float) -> str:
    return "exact" if bar == 0 else f"{bar:.0e}"


def format_table(rows: Sequence[CheckRow]) -> str:
    """Plain-text table: graph, case, output, max-abs err, rel err, bar, result, note. Rows marked ``(info)``
    are reported but do not gate."""
    head = ("graph", "case (batch x length)", "output", "max-abs err", "rel err", "bar", "result", "note")
    body = [(r.graph, r.case, r.output, f"{r.max_abs:.2e}", f"{r.rel:.2e}", _bar(r.bar),
             ("pass" if r.passed else "FAIL") + ("" if r.gate else " (info)"), r.note) for r in rows]
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    right = {3, 4, 5}
    fmt = lambda x: "  ".join(v.rjust(w) if i in right else v.ljust(w)
                              for i, (v, w) in enumerate(zip(x, widths, strict=True))).rstrip()
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths)), *map(fmt, body)])


# ========================================================================================== the driver


@dataclass
class GraphReport:
    name: str
    path: Path
    sha256: str
    bytes: int
    opset: int
    batch_dynamic: bool
    export_seconds: float
    verify_seconds: float | None = None
    rows: list[CheckRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return self.verify_seconds is not None

    @property
    def passed(self) -> bool:
        """True when verified and every gating row passed (False when not verified)."""
        return self.verified and all(r.passed for r in self.rows if r.gate)


@dataclass
class ExportReport:
    model_dir: Path
    out_dir: Path
    manifest: Path
    graphs: dict[str, GraphReport]
    seconds: float

    @property
    def rows(self) -> list[CheckRow]:
        return [r for g in self.graphs.values() for r in g.rows]

    @property
    def passed(self) -> bool:
        """Every verified graph passed (True when nothing was verified: check ``verified``)."""
        return all(g.passed for g in self.graphs.values() if g.verified)

    @property
    def verified(self) -> bool:
        return all(g.verified for g in self.graphs.values())

    def table(self) -> str:
        return format_table(self.rows)


def _io_entry(model: onnx.ModelProto) -> dict[str, list[dict[str, Any]]]:
    def one(v) -> dict[str, Any]:
        tt = v.type.tensor_type
        dims = [d.dim_param if d.HasField("dim_param") else d.dim_value for d in tt.shape.dim]
        return {"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name, "shape": dims}

    inits = {i.name for i in model.graph.initializer}
    return {"inputs": [one(v) for v in model.graph.input if v.name not in inits],
            "outputs": [one(v) for v in model.graph.output]}


def _parse_graphs(graphs: str | Iterable[str] | None, registry: Mapping[str, GraphSpec] = GRAPHS) -> list[str]:
    """The names of ``graphs`` (a list, a comma-separated string, None: all) in ``registry``'s order."""
    if graphs is None:
        return list(registry)
    names = [g.strip() for g in (graphs.split(",") if isinstance(graphs, str) else graphs) if g.strip()]
    unknown = [g for g in names if g not in registry]
    if unknown or not names:
        raise ValueError(f"unknown graph(s) {unknown or names}: choose from {', '.join(registry)}")
    return [g for g in registry if g in names]  # spec order, no duplicates


def export_onnx(model_dir: str | Path, out_dir: str | Path, *, graphs: str | Iterable[str] | None = None,
                opset: int = OPSET, verify: bool = True, max_length: int | None = None, seed: int = 0,
                threads: int = 0, strict: bool = True) -> ExportReport:
    """Export (and verify) the graphs of a CosyVoice2 model folder into ``out_dir`` with ``manifest.json``.

    Args:
        graphs: subset of :data:`ALL_GRAPHS` (names or a comma-separated string); default all.
        verify: run :func:`verify_onnx` on each graph after exporting it.
        max_length: cap of the verification cases' length axis (default: the spec's maximum).
        threads: onnxruntime intra-op threads (0 = its default).
        strict: raise :class:`VerificationError` (after writing everything) when a gating check fails.
    """
    start = time.perf_counter()
    names = _parse_graphs(graphs)
    if opset < 17:
        raise ValueError(f"opset {opset}: at least 17 is needed (LayerNormalization)")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    need = [_SOURCE_FILES[n] for n in names]
    model_dir = _check_model_dir(model_dir, ["cosyvoice2.yaml", *need])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    need_flow = any(n in ("flow_encoder", "flow_estimator") for n in names)
    need_hift = any(n in ("hift_source", "hift_decoder") for n in names)
    t0 = time.perf_counter()
    models = load_source_models(model_dir, flow=need_flow, hift=need_hift)
    if need_flow or need_hift:
        log.info("loaded %s in %.1f s", model_dir, time.perf_counter() - t0)
    source_hashes: dict[str, dict[str, Any]] = {}

    def source_entry(file: str) -> dict[str, Any]:
        if file not in source_hashes:
            p = model_dir / file
            source_hashes[file] = {"file": file, "sha256": file_sha256(p), "bytes": p.stat().st_size}
        return source_hashes[file]

    reports: dict[str, GraphReport] = {}
    entries: dict[str, dict[str, Any]] = {}
    for k, name in enumerate(names, 1):
        path = out_dir / f"{name}.onnx"
        log.info("[%d/%d] %s: %s", k, len(names), name, GRAPHS[name].doc)
        t0 = time.perf_counter()
        notes: list[str] = []
        extra: dict[str, Any] = {}
        equal_lengths = None
        if name in SHIPPED_GRAPHS:
            src = model_dir / SHIPPED_GRAPHS[name][0]
            _check_signature(src, _session(src, threads), SHIPPED_GRAPHS[name][1], SHIPPED_GRAPHS[name][2],
                             SHIPPED_GRAPHS[name][0])
            model, probe, mapping, adaptations = prepare_shipped_graph(onnx.load(str(src)), name, threads=threads)
            _save_model(model, path)
            batch_dynamic = probe.dynamic
            equal_lengths = probe.padded_exact is False or None
            notes.append(probe.note)
            notes += adaptations
            extra = {"exported_from": f"{SHIPPED_GRAPHS[name][0]} as shipped, I/O renamed", "renamed_io": mapping,
                     "adaptations": adaptations, "padded_batch_exact": probe.padded_exact,
                     "triton_max_batch_size": GRAPHS[name].max_batch_size if probe.dynamic else 0}
            reference: nn.Module | Path = src
            log.info("  batch axis %s: %s", "dynamic" if probe.dynamic else "fixed to 1", probe.note)
        else:
            module = models.wrapper(name)
            model = export_graph(module, name, path, opset=opset)
            batch_dynamic = True
            reference = module
            extra = {"exported_from": f"{_SOURCE_FILES[name]} via torch.onnx.export(dynamo=False) "
                                      f"{torch.__version__}", "export_example": dict(zip(
                                          ("batch", _length_axis(GRAPHS[name])), export_sizes(name), strict=True)),
                     "triton_max_batch_size": GRAPHS[name].max_batch_size}
            if name == "hift_source":
                notes.append("contains float64 Cast/CumSum (phase accumulation): fp32 only, no TensorRT fp16/int8")
            if name in ("hift_source", "hift_decoder"):
                notes.append(HIFT_PADDING_NOTE)
        export_s = time.perf_counter() - t0
        size = path.stat().st_size
        report = GraphReport(name, path, file_sha256(path), size, _opset(model), batch_dynamic, export_s, notes=notes)
        io_entry = _io_entry(model)
        log.info("  wrote %s: %.1f MB in %.1f s", path, size / 1e6, export_s)
        del model
        if verify:
            t0 = time.perf_counter()
            report.rows = verify_onnx(name, path, reference, max_length=max_length, batch_dynamic=batch_dynamic,
                                      equal_lengths=equal_lengths, seed=seed, mel_config=models.config.mel,
                                      threads=threads)
            report.verify_seconds = time.perf_counter() - t0
            worst = max((r.rel for r in report.rows if r.gate and r.bar), default=0.0)
            log.info("%s: %d checks, worst fp32 rel err %.2e, %s (export %.1f s, verify %.1f s, %.1f MB)", name,
                     len(report.rows), worst, "PASS" if report.passed else "FAIL", export_s,
                     report.verify_seconds, size / 1e6)
        else:
            log.info("%s: exported, not verified (export %.1f s, %.1f MB)", name, export_s, size / 1e6)
        reports[name] = report
        entries[name] = {
            "file": path.name, "sha256": report.sha256, "bytes": size, "opset": report.opset,
            "precision": PRECISION, **io_entry,
            "batch_dynamic": batch_dynamic, "source_model_dir": str(model_dir.resolve()),
            "source": source_entry(_SOURCE_FILES[name]), **extra, "export_seconds": round(export_s, 3),
            "notes": notes,
            "verification": None if not verify else {
                "passed": report.passed, "tolerance_rel": REL_TOL_FP32, "seconds": round(report.verify_seconds, 3),
                "max_length": max_length,
                "rows": [{k: v for k, v in asdict(r).items() if k != "graph"} for r in report.rows]},
        }
        _write_manifest(out_dir, model_dir, opset, entries)

    manifest = out_dir / MANIFEST_NAME
    result = ExportReport(model_dir, out_dir, manifest, reports, time.perf_counter() - start)
    if verify:
        log.info("verification:\n%s", result.table())
    if strict and verify and not result.passed:
        failed = sorted({r.graph for r in result.rows if r.gate and not r.passed})
        raise VerificationError(f"ONNX verification failed for {', '.join(failed)} (bar {REL_TOL_FP32:g} "
                                f"relative; figures in {manifest})", result)
    return result


def _write_manifest(out_dir: Path, model_dir: Path, opset: int, entries: Mapping[str, Any],
                    registry: Mapping[str, GraphSpec] = GRAPHS) -> None:
    """Write ``manifest.json``; entries of graphs exported earlier from the same folder are kept while their
    file is unchanged. ``registry``: the family's graphs (:data:`GRAPHS`, or CosyVoice3's), in manifest order."""
    path = out_dir / MANIFEST_NAME
    graphs: dict[str, Any] = {}
    src = str(model_dir.resolve())
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = {}
        for name, e in (old.get("graphs") or {}).items():
            f = out_dir / str(e.get("file", ""))
            if name in registry and name not in entries and e.get("source_model_dir") == src and f.is_file() \
                    and file_sha256(f) == e.get("sha256"):
                graphs[name] = e
    graphs.update(entries)
    import onnxruntime

    doc = {"format": MANIFEST_FORMAT, "source_model_dir": src, "opset": opset, "precision": PRECISION,
           "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
           "graphs": {n: graphs[n] for n in registry if n in graphs}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def stale_graphs(model_dir: str | Path, out_dir: str | Path, graphs: Iterable[str] = ALL_GRAPHS) -> dict[str, str]:
    """The graphs of ``out_dir`` that are not an export of ``model_dir`` as it is now -> why: missing, absent
    from the manifest, changed since it was written, or exported from other checkpoint bytes (the manifest's
    ``source`` digest against the folder's file). Nothing stale: ``{}``."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    try:
        entries = json.loads((out_dir / MANIFEST_NAME).read_text(encoding="utf-8")).get("graphs") or {}
    except (OSError, ValueError):
        entries = {}
    digests: dict[str, str] = {}
    stale: dict[str, str] = {}
    for name in graphs:
        path, entry = out_dir / f"{name}.onnx", entries.get(name) or {}
        source = entry.get("source") or {}
        file = _SOURCE_FILES[name]
        if not path.is_file():
            stale[name] = "missing"
        elif not entry:
            stale[name] = f"not in {out_dir / MANIFEST_NAME}"
        elif not (model_dir / file).is_file():
            stale[name] = f"{model_dir / file} not found"
        else:
            if file not in digests:
                digests[file] = file_sha256(model_dir / file)
            if source.get("sha256") != digests[file]:
                stale[name] = (f"exported from another {file} ({entry.get('source_model_dir', '?')}), not the one "
                               f"in {model_dir}")
            elif file_sha256(path) != entry.get("sha256"):
                stale[name] = "changed since its export"
    return stale


def spec_summary(name: str, spec: GraphSpec | None = None) -> list[str]:
    """Lines describing a graph's tensors and (min, opt, max) input shapes, for logs (``spec``: as
    :func:`export_sizes`)."""
    spec = spec or GRAPHS[name]
    fmt = lambda t: f"{t.name} {t.dtype}[{', '.join(map(str, t.dim_names()))}]"
    prof = spec.profile()
    lines = [f"{name}: {', '.join(fmt(t) for t in spec.inputs)} -> {', '.join(fmt(t) for t in spec.outputs)}"]
    lines += [f"    {t}: min {lo} opt {opt} max {hi}" for t, (lo, opt, hi) in prof.items()]
    return lines

