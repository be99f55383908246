"""ONNX export of CosyVoice3's DiT flow estimator and causal vocoder, each graph verified with onnxruntime.

Four graphs, named and shaped as :data:`cosyvoice_triton.shapes.GRAPHS3`, opset 17, fp32, built with the
CosyVoice2 export's helpers (:mod:`.onnx_export`: the legacy exporter, the spec's I/O and dynamic axes, the
verification cases, rows, table and manifest):

* ``flow3_estimator`` / ``flow3_estimator_streaming`` (:class:`DiTEstimatorGraph`): one velocity evaluation of the
  DiT, ``x, mask, mu, t, spks, cond -> estimator_out``, the official export's tensor names and time axis
  (``seq_len``, dim 2), plus a dynamic batch axis (the official graph is traced at batch 2 and keeps it fixed).
  The attention variant is baked in, one graph each, as the official runtime keeps
  ``flow.decoder.estimator.fp32.onnx`` (traced with the estimator's default ``streaming=False``: full attention
  over the valid frames) beside ``flow.decoder.estimator.streaming.fp32.onnx`` (chunk-causal attention, chunks of
  ``static_chunk_size`` frames) and picks the file by mode. The official flow runs a stream's chunks with the
  streaming variant and its last call (``finalize=True``) with the full one.
* ``hift3_source`` (:class:`Hift3SourceGraph`): the causal F0 predictor and the NSF source
  (``mel, nsf_noise -> source``). The noise is an input: the vocoder's seeded buffer
  (:class:`~cosyvoice_triton.models.cosyvoice3.hift.CausalNsfNoise`), its first ``480 T`` rows per item. The F0
  predictor runs in float32 here (PyTorch and the official code run it in float64; onnxruntime has no float64
  convolution): f0 agrees to ~1e-7 relative, and the source's phase accumulation turns that into the same drift as
  CosyVoice2's ``hift_source``, gated the same way (f0 read out of the graph, the source given the graph's f0; the
  end-to-end row informs).
* ``hift3_decoder`` (:class:`Hift3DecoderGraph`): the causal generator (``mel, source -> waveform``), weight norm
  folded.

Finalize. Both vocoder graphs compute ``finalize=True`` on what they are given (zeros past the last frame, as the
official right padding). Only two layers look ahead (the F0 predictor's first convolution, 3 frames; ``conv_pre``,
``conv_pre_look_right`` frames) and every later one is causal, so a stream's ``finalize=False`` call is a prefix of
the finalized one on the same input, and :func:`vocode` composes it: the source graph on all ``T`` frames, its
first ``480 (T - 3)`` samples kept; the decoder on the first ``T - 3`` frames with that source, its first
``480 (T - 8)`` samples kept (:attr:`Hift3Dims.held_frames`). Verification checks both halves of that claim
against PyTorch's ``finalize=False`` (rows ``f0 held``; ``waveform held`` in the cases up to batch 4, a second
PyTorch decode each), and :func:`verify_chain` runs the two graphs end to end against
``CausalHiFTGenerator.inference`` in both modes.

Padding. The vocoder is causal, so in a padded batch an item's valid frames see its padding only through the
look-ahead of its last frames; :data:`HIFT3_PADDING_NOTE`. The graphs are compared with PyTorch on the same padded
batch (as CosyVoice2's HiFT graphs); the estimator graphs per row against a solo PyTorch run of the original DiT.
Bars: :data:`~.onnx_export.REL_TOL_FP32` (1e-4 relative) for every gating row, as CosyVoice2's.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import Tensor, nn

from ..config import MelConfig
from ..errors import ConfigError
from ..family import COSYVOICE3
from ..hashing import file_sha256
from ..models.cosyvoice3.config import read_cosyvoice3_yaml
from ..models.cosyvoice3.dit import DiT
from ..models.cosyvoice3.flow import CausalMaskedDiffWithDiT, load_flow3
from ..models.cosyvoice3.hift import CausalConvRNNF0Predictor, CausalHiFTGenerator, CausalNsfNoise, load_hift3
from ..shapes import GRAPHS3, SAMPLES_PER_MEL_FRAME
from .onnx_export import (
    HIFT_SOURCE_END_TO_END_BAR,
    MANIFEST_NAME,
    OPSET,
    PRECISION,
    REL_TOL_FP32,
    Case,
    CheckRow,
    ExportReport,
    GraphReport,
    HiftSourceGraph,
    VerificationError,
    _compare,
    _io_entry,
    _length_axis,
    _opset,
    _parse_graphs,
    _session,
    _with_output,
    _write_manifest,
    export_graph,
    export_sizes,
    sample_inputs,
    verification_cases,
    with_export_mish,
)

__all__ = [
    "ALL_GRAPHS3",
    "ESTIMATOR_GRAPHS",
    "HIFT3_PADDING_NOTE",
    "OFFICIAL_BATCH",
    "OFFICIAL_ESTIMATOR_FILES",
    "DiTEstimatorGraph",
    "Hift3DecoderGraph",
    "Hift3SourceGraph",
    "SourceModels3",
    "export_onnx3",
    "load_source_models3",
    "sample_inputs3",
    "verify_chain",
    "verify_onnx3",
    "vocode",
    "write_official_estimator",
]

log = logging.getLogger(__name__)

ALL_GRAPHS3: tuple[str, ...] = tuple(GRAPHS3)
#: graph -> the attention variant baked into it
ESTIMATOR_GRAPHS = {"flow3_estimator": False, "flow3_estimator_streaming": True}
#: graph -> the file name the official runtime loads for that variant (``token2wav_cosyvoice3.py``)
OFFICIAL_ESTIMATOR_FILES = {"flow3_estimator": "flow.decoder.estimator.fp32.onnx",
                            "flow3_estimator_streaming": "flow.decoder.estimator.streaming.fp32.onnx"}
_SOURCE_FILES = {"flow3_estimator": "flow.pt", "flow3_estimator_streaming": "flow.pt", "hift3_source": "hift.pt",
                 "hift3_decoder": "hift.pt"}
HIFT3_PADDING_NOTE = ("causal, but not padding-invariant at the tail: in a padded batch an item's last frames see its "
                      "padding through the F0 predictor's 3-frame and conv_pre's 4-frame look-ahead and the source "
                      "STFT's end; pad with zeros, or batch equal lengths, for a solo run's samples")


# ============================================================================================ wrappers


class DiTEstimatorGraph(nn.Module):
    """``flow3_estimator[_streaming]``: ``forward(x, mask, mu, t, spks, cond) -> estimator_out``, the DiT's
    ``forward`` with ``streaming`` fixed. ``fast_mish``: the conv position embedding's Mish exported as
    :class:`~.onnx_export.ExportMish` (a copy of the estimator; fp32 graphs)."""

    def __init__(self, estimator: DiT, *, streaming: bool, fast_mish: bool = True):
        super().__init__()
        self.estimator = with_export_mish(estimator) if fast_mish else estimator
        self.streaming = bool(streaming)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        return self.estimator(x, mask, mu, t, spks, cond, streaming=self.streaming)


def _folded_float(hift: CausalHiFTGenerator) -> CausalHiFTGenerator:
    """A copy of ``hift`` with weight norm folded and every parameter in float32 (its F0 predictor included)."""
    return copy.deepcopy(hift).fold_weight_norm().float()


class Hift3SourceGraph(HiftSourceGraph):
    """``hift3_source``: ``forward(mel [B, 80, T], nsf_noise [B, 480 T, 9]) -> source [B, 1, 480 T]``, the causal F0
    predictor (``finalize=True``, float32) then the NSF source. ``F0_NODE``: the node whose output is f0."""

    prepared = staticmethod(_folded_float)


class Hift3DecoderGraph(nn.Module):
    """``hift3_decoder``: ``forward(mel [B, 80, T], source [B, 1, 480 T]) -> waveform [B, 480 T]``: the causal
    generator's ``decode(finalize=True)``, weight norm folded."""

    def __init__(self, hift: CausalHiFTGenerator):
        super().__init__()
        self.hift = _folded_float(hift)

    def forward(self, mel: Tensor, source: Tensor) -> Tensor:
        return self.hift.decode(mel, source, finalize=True)


# ========================================================================================== the models


@dataclass
class SourceModels3:
    """A CosyVoice3 folder's flow and vocoder (weight norm folded; the F0 predictor in float64, as it runs)."""

    model_dir: Path
    mel: MelConfig
    flow: CausalMaskedDiffWithDiT | None = None
    hift: CausalHiFTGenerator | None = None

    def wrapper(self, name: str) -> nn.Module:
        if name in ESTIMATOR_GRAPHS:
            if self.flow is None:
                raise ValueError(f"{name}: flow.pt was not loaded")
            return DiTEstimatorGraph(self.flow.decoder.estimator, streaming=ESTIMATOR_GRAPHS[name]).eval()
        if self.hift is None:
            raise ValueError(f"{name}: hift.pt was not loaded")
        if name == "hift3_source":
            return Hift3SourceGraph(self.hift).eval()
        if name == "hift3_decoder":
            return Hift3DecoderGraph(self.hift).eval()
        raise ValueError(f"{name!r} is not a CosyVoice3 graph (one of {', '.join(ALL_GRAPHS3)})")


def load_source_models3(model_dir: str | Path, *, flow: bool = True, hift: bool = True) -> SourceModels3:
    """Load a CosyVoice3 folder's ``flow.pt`` / ``hift.pt`` at the dims of its ``cosyvoice3.yaml``."""
    model_dir = Path(model_dir)
    config = read_cosyvoice3_yaml(model_dir)
    models = SourceModels3(model_dir, config.mel)
    if flow:
        models.flow = load_flow3(model_dir / "flow.pt", config.flow)
    if hift:
        models.hift = load_hift3(model_dir / "hift.pt", config.hift).fold_weight_norm().eval()
    return models


# ============================================================================================= inputs


def sample_inputs3(name: str, case: Case, *, hift: CausalHiFTGenerator | None = None, seed: int = 0,
                   mel_config: MelConfig | None = None) -> dict[str, np.ndarray]:
    """Deterministic inputs of a CosyVoice3 graph for ``case``, padded to the longest item: the estimators take
    CosyVoice2's estimator inputs (CFG layout, noise in the padding); the vocoder a speech-like mel padded with the
    mel of silence, the seeded causal noise buffer (one for the batch, as the vocoder uses it) and, for the
    decoder, ``hift``'s source of that mel (zero past each item)."""
    if name in ESTIMATOR_GRAPHS:
        feeds = sample_inputs("flow_estimator", case, seed=seed)
        feeds.pop("streaming")
        return feeds
    if name not in GRAPHS3:
        raise ValueError(f"unknown graph {name!r} (one of {', '.join(ALL_GRAPHS3)})")
    base = sample_inputs("hift_source", case, seed=seed, mel_config=mel_config or MelConfig(fmax=None))
    mel = base["mel"]
    t = mel.shape[2]
    noise = CausalNsfNoise(seed)(SAMPLES_PER_MEL_FRAME * t).expand(case.batch, -1, -1)
    noise = np.ascontiguousarray(noise.numpy(), dtype=np.float32)
    if name == "hift3_source":
        return {"mel": mel, "nsf_noise": noise}
    if hift is None:
        raise ValueError("sample_inputs3('hift3_decoder') needs the vocoder to build its source")
    with torch.inference_mode():
        source = hift.source_from_f0(hift.predict_f0(torch.from_numpy(mel)), torch.from_numpy(noise)).numpy()
    valid = np.arange(t)[None, :] < np.asarray(case.lengths)[:, None]
    source = source * np.repeat(valid, SAMPLES_PER_MEL_FRAME, axis=1)[:, None, :]
    return {"mel": mel, "source": np.ascontiguousarray(source, dtype=np.float32)}


def _example(name: str, models: SourceModels3) -> tuple[Tensor, ...]:
    b, t = export_sizes(name, GRAPHS3[name])
    lengths = tuple(max(GRAPHS3[name].axes["batch"].min, t - 7 * i) for i in range(b))
    feeds = sample_inputs3(name, Case("export", b, lengths), hift=models.hift, seed=1234, mel_config=models.mel)
    return tuple(torch.from_numpy(feeds[s.name]) for s in GRAPHS3[name].inputs)


# ===================================================================================== the vocoder chain


Runner = Callable[[np.ndarray, np.ndarray], np.ndarray]


def vocode(run_source: Runner, run_decoder: Runner, mel: np.ndarray, noise: np.ndarray, *,
           finalize: bool = True, held_frames: int = 8) -> np.ndarray:
    """``CausalHiFTGenerator.inference(mel, finalize, noise)``'s speech from the two vocoder graphs.

    ``run_source(mel, nsf_noise) -> source`` and ``run_decoder(mel, source) -> waveform`` run ``hift3_source`` and
    ``hift3_decoder`` (an onnxruntime session, a TensorRT engine, the wrappers). ``mel`` [B, 80, T], ``noise``
    [B, >= 480 T, 9] (the buffer's first rows). ``finalize=False``: the last ``held_frames`` frames are look-ahead
    only, the speech is ``480 (T - held_frames)`` samples long (module docstring).
    """
    s, t = SAMPLES_PER_MEL_FRAME, mel.shape[2]
    look = CausalConvRNNF0Predictor.LOOK_AHEAD
    if not finalize and t <= held_frames:
        raise ValueError(f"finalize=False needs more than {held_frames} mel frames, got {t}")
    source = run_source(mel, np.ascontiguousarray(noise[:, : s * t]))
    if finalize:
        return run_decoder(mel, source)
    kept = t - look
    wave = run_decoder(np.ascontiguousarray(mel[:, :, :kept]), np.ascontiguousarray(source[:, :, : s * kept]))
    return wave[:, : s * (t - held_frames)]


# ======================================================================================= verification


def _valid_cut(arr: np.ndarray, lengths: Sequence[int], per: int = 1, limit: int | None = None) -> list[np.ndarray]:
    """Each item's first ``per * min(n, limit)`` positions along the last axis."""
    return [arr[i, ..., : per * (n if limit is None else min(n, limit))] for i, n in enumerate(lengths)]


def _verify_case3(name: str, case: Case, sess, models: SourceModels3, feeds: dict[str, np.ndarray], *,
                  probe_sess=None) -> list[CheckRow]:
    spec = GRAPHS3[name]
    out_names = [t.name for t in spec.outputs]
    got = dict(zip(out_names, sess.run(out_names, feeds), strict=True))
    tt = {k: torch.from_numpy(v) for k, v in feeds.items()}
    lengths, s = case.lengths, SAMPLES_PER_MEL_FRAME
    rows: list[CheckRow] = []
    if name in ESTIMATOR_GRAPHS:
        est, streaming = models.flow.decoder.estimator, ESTIMATOR_GRAPHS[name]
        ref = []
        with torch.inference_mode():
            for i, n in enumerate(lengths):
                one = [tt[k][i : i + 1, ..., :n] if tt[k].ndim == 3 else tt[k][i : i + 1]
                       for k in ("x", "mask", "mu", "t", "spks", "cond")]
                ref.append(est(*one, streaming=streaming)[0].numpy())
        rows.append(_compare(name, case, "estimator_out", _valid_cut(got["estimator_out"], lengths), ref,
                             bar=REL_TOL_FP32, note=f"per row vs solo DiT(streaming={streaming})"))
        return rows
    hift, t = models.hift, max(lengths)
    look = CausalConvRNNF0Predictor.LOOK_AHEAD
    if name == "hift3_source":
        noise = tt["nsf_noise"]
        f0_ort = probe_sess.run([probe_sess.get_outputs()[-1].name], feeds)[0]
        with torch.inference_mode():
            f0_ref = hift.predict_f0(tt["mel"])
            ref_source = hift.source_from_f0(f0_ref, noise).numpy()
            given = hift.source_from_f0(torch.from_numpy(f0_ort), noise).numpy()
            f0_held = hift.predict_f0(tt["mel"], finalize=False).numpy() if t > look else None
            given_held = hift.source_from_f0(torch.from_numpy(f0_ort[:, : t - look]), noise).numpy() \
                if t > look else None
        f0_ref = f0_ref.numpy()
        voiced = float(np.mean(np.concatenate([f0_ref[i, :n] > 10 for i, n in enumerate(lengths)])))
        rows.append(_compare(name, case, "f0 (internal)", _valid_cut(f0_ort, lengths), _valid_cut(f0_ref, lengths),
                             bar=REL_TOL_FP32, note=f"float32 vs float64, voiced {voiced:.0%}"))
        rows.append(_compare(name, case, "source | same f0", _valid_cut(got["source"], lengths, s),
                             _valid_cut(given, lengths, s), bar=REL_TOL_FP32, note="torch given ORT's f0"))
        if f0_held is not None:
            rows.append(_compare(name, case, "f0 held", _valid_cut(f0_ort, lengths, 1, t - look),
                                 _valid_cut(f0_held, lengths, 1, t - look), bar=REL_TOL_FP32,
                                 note="prefix vs predict_f0(finalize=False)"))
            rows.append(_compare(name, case, "source held | same f0", _valid_cut(got["source"], lengths, s, t - look),
                                 _valid_cut(given_held, lengths, s, t - look), bar=REL_TOL_FP32,
                                 note="prefix vs source of the held f0"))
        rows.append(_compare(name, case, "source (end to end)", _valid_cut(got["source"], lengths, s),
                             _valid_cut(ref_source, lengths, s), bar=HIFT_SOURCE_END_TO_END_BAR, gate=False,
                             note="f0 rounding -> phase drift"))
        return rows
    # hift3_decoder
    with torch.inference_mode():
        ref = hift.decode(tt["mel"], tt["source"], finalize=True).numpy()
    rows.append(_compare(name, case, "waveform", _valid_cut(got["waveform"], lengths, s),
                         _valid_cut(ref, lengths, s), bar=REL_TOL_FP32, note="same padded batch"))
    held = hift.dims.held_frames
    kept = t - look
    if kept >= spec.axes["mel_frames"].min and t > held and case.batch <= 4:  # the largest batch: one decode
        mel_k = np.ascontiguousarray(feeds["mel"][:, :, :kept])
        src_k = np.ascontiguousarray(feeds["source"][:, :, : s * kept])
        wave = sess.run(["waveform"], {"mel": mel_k, "source": src_k})[0]
        with torch.inference_mode():
            ref_held = hift.decode(torch.from_numpy(mel_k), torch.from_numpy(src_k), finalize=False).numpy()
        rows.append(_compare(name, case, "waveform held", _valid_cut(wave, lengths, s, t - held),
                             _valid_cut(ref_held, lengths, s, t - held), bar=REL_TOL_FP32,
                             note="prefix vs decode(finalize=False)"))
    return rows


def verify_onnx3(name: str, onnx_path: str | Path, models: SourceModels3, *, max_length: int | None = None,
                 seed: int = 0, cases: Sequence[Case] | None = None, threads: int = 0) -> list[CheckRow]:
    """Run a CosyVoice3 graph in onnxruntime on :func:`~.onnx_export.verification_cases` (or ``cases``) and
    compare with PyTorch (module docstring); one :class:`CheckRow` per (case, output), nothing raised."""
    model = onnx.load(str(onnx_path))
    sess = _session(model, threads)
    probe_sess = _session(_with_output(model, Hift3SourceGraph.F0_NODE, "f0"), threads) \
        if name == "hift3_source" else None
    cases = list(cases) if cases is not None else verification_cases(name, max_length=max_length,
                                                                     spec=GRAPHS3[name])
    rows: list[CheckRow] = []
    for k, case in enumerate(cases, 1):
        start = time.perf_counter()
        feeds = sample_inputs3(name, case, hift=models.hift, seed=seed, mel_config=models.mel)
        new = _verify_case3(name, case, sess, models, feeds, probe_sess=probe_sess)
        rows += new
        log.info("  verify %s %d/%d %-18s worst gating rel %.2e %s  %.1f s", name, k, len(cases), case.name,
                 max((r.rel for r in new if r.gate), default=0.0), "ok" if all(r.passed for r in new) else "FAIL",
                 time.perf_counter() - start)
    return rows


def verify_chain(source_path: str | Path, decoder_path: str | Path, models: SourceModels3, cases: Iterable[Case],
                 *, seed: int = 0, threads: int = 0) -> list[CheckRow]:
    """The two vocoder graphs through :func:`vocode` against ``CausalHiFTGenerator.inference`` in both modes, on
    the same padded batch. Reporting rows (the source's phase drift, as ``source (end to end)``)."""
    src_sess, dec_sess = _session(source_path, threads), _session(decoder_path, threads)
    run_source = lambda mel, noise: src_sess.run(["source"], {"mel": mel, "nsf_noise": noise})[0]
    run_decoder = lambda mel, source: dec_sess.run(["waveform"], {"mel": mel, "source": source})[0]
    hift, held, s = models.hift, models.hift.dims.held_frames, SAMPLES_PER_MEL_FRAME
    rows = []
    for case in cases:
        feeds = sample_inputs3("hift3_source", case, seed=seed, mel_config=models.mel)
        t = max(case.lengths)
        for finalize in (True, False):
            if not finalize and t <= held + GRAPHS3["hift3_decoder"].axes["mel_frames"].min:
                continue
            got = vocode(run_source, run_decoder, feeds["mel"], feeds["nsf_noise"], finalize=finalize,
                         held_frames=held)
            ref, _ = hift.inference(torch.from_numpy(feeds["mel"]), finalize=finalize,
                                    noise=torch.from_numpy(feeds["nsf_noise"]))
            limit = None if finalize else t - held
            rows.append(_compare("hift3 chain", case, f"speech finalize={finalize}", _valid_cut(got, case.lengths, s,
                                 limit), _valid_cut(ref.numpy(), case.lengths, s, limit),
                                 bar=HIFT_SOURCE_END_TO_END_BAR, gate=False, note="vs inference(), same batch"))
    return rows


# =============================================================================== the official file layout

#: the batch the official runtime traces its estimator with and builds its TensorRT profile for (CFG: 2 rows)
OFFICIAL_BATCH = 2


def write_official_estimator(model: onnx.ModelProto, path: str | Path) -> Path:
    """A copy of an estimator graph whose batch axis is declared ``OFFICIAL_BATCH`` (2), written to ``path``.

    The official TensorRT build (``convert_onnx_to_trt`` with ``get_trt_kwargs``) gives a profile to ``x, mask, mu,
    cond`` only, at batch 2, so ``t`` and ``spks`` must have static shapes; the time axis stays ``seq_len``.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for v in (*out.graph.input, *out.graph.output):
        d = v.type.tensor_type.shape.dim[0]
        d.Clear()
        d.dim_value = OFFICIAL_BATCH
    onnx.checker.check_model(out)
    path = Path(path)
    onnx.save(out, str(path))
    return path


# ========================================================================================== the driver


def export_onnx3(model_dir: str | Path, out_dir: str | Path, *, graphs: str | Iterable[str] | None = None,
                 opset: int = OPSET, verify: bool = True, max_length: int | None = None, seed: int = 0,
                 threads: int = 0, strict: bool = True, official_estimator_files: bool = False) -> ExportReport:
    """Export (and verify) the graphs of a CosyVoice3 model folder into ``out_dir`` with ``manifest.json``; the
    arguments are :func:`~.onnx_export.export_onnx`'s (``graphs``: a subset of :data:`ALL_GRAPHS3`). With both
    vocoder graphs verified, :func:`verify_chain` adds its reporting rows. ``official_estimator_files``: each
    estimator graph also as :data:`OFFICIAL_ESTIMATOR_FILES` names it (:func:`write_official_estimator`), verified
    at batch 2 and listed in its manifest entry."""
    start = time.perf_counter()
    names = _parse_graphs(graphs, GRAPHS3)
    if opset < 17:
        raise ValueError(f"opset {opset}: at least 17 is needed (LayerNormalization)")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    model_dir = Path(model_dir)
    missing = [f for f in ["cosyvoice3.yaml", *dict.fromkeys(_SOURCE_FILES[n] for n in names)]
               if not (model_dir / f).is_file()]
    if missing:
        raise ConfigError(f"{model_dir}: missing {', '.join(missing)} (a CosyVoice3 model folder has "
                          "cosyvoice3.yaml, flow.pt, hift.pt)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    models = load_source_models3(model_dir, flow=any(n in ESTIMATOR_GRAPHS for n in names),
                                 hift=any(n not in ESTIMATOR_GRAPHS for n in names))
    reports: dict[str, GraphReport] = {}
    entries: dict[str, dict[str, Any]] = {}
    for k, name in enumerate(names, 1):
        spec, path = GRAPHS3[name], out_dir / f"{name}.onnx"
        log.info("[%d/%d] %s: %s", k, len(names), name, spec.doc)
        t0 = time.perf_counter()
        model = export_graph(models.wrapper(name), name, path, opset=opset, example=_example(name, models), spec=spec)
        export_s = time.perf_counter() - t0
        notes = []
        if name in ESTIMATOR_GRAPHS:
            notes.append(f"streaming={ESTIMATOR_GRAPHS[name]} baked in; the official runtime's file for this "
                         f"variant: {OFFICIAL_ESTIMATOR_FILES[name]}")
        else:
            notes.append("finalize=True on the given frames; a stream's held frames are cut by the caller (vocode)")
            notes.append(HIFT3_PADDING_NOTE)
        if name == "hift3_source":
            notes.append("F0 predictor in float32 (float64 in PyTorch); float64 Cast/CumSum (phase accumulation): "
                         "fp32 only")
        report = GraphReport(name, path, file_sha256(path), path.stat().st_size, _opset(model), True, export_s,
                             notes=notes)
        io_entry = _io_entry(model)
        official = None
        if official_estimator_files and name in ESTIMATOR_GRAPHS:
            official = write_official_estimator(model, out_dir / OFFICIAL_ESTIMATOR_FILES[name])
        del model
        if verify:
            t0 = time.perf_counter()
            report.rows = verify_onnx3(name, path, models, max_length=max_length, seed=seed, threads=threads)
            if official is not None:
                n = min(57, max_length or 57)
                case = Case(f"{official.name} batch", OFFICIAL_BATCH, (n, max(4, n - 13)))
                report.rows += verify_onnx3(name, official, models, cases=[case], seed=seed, threads=threads)
            report.verify_seconds = time.perf_counter() - t0
            log.info("%s: %d checks, %s (export %.1f s, verify %.1f s)", name, len(report.rows),
                     "PASS" if report.passed else "FAIL", export_s, report.verify_seconds)
        reports[name] = report
        entries[name] = {
            "file": path.name, "sha256": report.sha256, "bytes": report.bytes, "opset": report.opset,
            "precision": PRECISION, **io_entry, "batch_dynamic": True, "family": COSYVOICE3,
            "source_model_dir": str(model_dir.resolve()),
            "source": {"file": _SOURCE_FILES[name], "sha256": file_sha256(model_dir / _SOURCE_FILES[name])},
            "exported_from": f"{_SOURCE_FILES[name]} via torch.onnx.export(dynamo=False) {torch.__version__}",
            "export_example": dict(zip(("batch", _length_axis(spec)), export_sizes(name, spec), strict=True)),
            "triton_max_batch_size": spec.max_batch_size, "export_seconds": round(export_s, 3), "notes": notes,
            "official_file": None if official is None else {
                "file": official.name, "sha256": file_sha256(official), "batch": OFFICIAL_BATCH},
            "verification": None if not verify else {
                "passed": report.passed, "tolerance_rel": REL_TOL_FP32, "seconds": round(report.verify_seconds, 3),
                "max_length": max_length,
                "rows": [{k: v for k, v in asdict(r).items() if k != "graph"} for r in report.rows]},
        }
        _write_manifest(out_dir, model_dir, opset, entries, registry=GRAPHS3)
    result = ExportReport(model_dir, out_dir, out_dir / MANIFEST_NAME, reports, time.perf_counter() - start)
    if verify and "hift3_source" in reports and "hift3_decoder" in reports:
        # reporting rows: the cases up to batch 4 (the largest batch is gated per graph above)
        cases = [c for c in verification_cases("hift3_decoder", max_length=max_length, spec=GRAPHS3["hift3_decoder"])
                 if c.batch <= 4]
        chain = verify_chain(reports["hift3_source"].path, reports["hift3_decoder"].path, models, cases, seed=seed,
                             threads=threads)
        reports["hift3_decoder"].rows += chain
        entries["hift3_decoder"]["verification"]["rows"] += [{k: v for k, v in asdict(r).items() if k != "graph"}
                                                             for r in chain]
        _write_manifest(out_dir, model_dir, opset, entries, registry=GRAPHS3)
    if verify:
        log.info("verification:\n%s", result.table())
    if strict and verify and not result.passed:
        failed = sorted({r.graph for r in result.rows if r.gate and not r.passed})
        raise VerificationError(f"ONNX verification failed for {', '.join(failed)} (bar {REL_TOL_FP32:g} "
                                f"relative; figures in {result.manifest})", result)
    return result
