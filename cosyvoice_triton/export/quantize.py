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

The work is split by concern, each re-exported here: :mod:`.quantize_rules` (what is converted, what stays float
and why), :mod:`.quantize_calibration` (captured inputs and ranges), :mod:`.quantize_int8` (Q/DQ and CPU INT8),
:mod:`.quantize_fp16`, :mod:`.quantize_sensitivity` and :mod:`.quantize_manifest`. This module is the driver,
:func:`quantize_graphs` (``export/quantize.py``), and its report.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx

from ..hashing import file_sha256
from .quantize_calibration import (
    ENTROPY_MAX_CALLS,
    PERCENTILE_BINS,
    FeedReader,
    PairInfo,
    PipelineFeeds,
    Ranges,
    _cached_ranges,
    cached_feeds,
    calibrate,
    collect_feeds,
    encoder_feed,
    estimator_feed,
    euler_steps,
    feeds_cache_key,
    feeds_cache_path,
    load_pipeline,
    rel_max,
    rel_rms,
    session,
    speech_pairs,
)
from .quantize_fp16 import convert_fp16, fp16_estimator_fp32
from .quantize_int8 import cpu_lacks_vnni, quantize_cpu_int8, quantize_qdq
from .quantize_manifest import _save, _write_manifest, count_reduced, read_manifest
from .quantize_rules import (
    CALIBRATION_METHODS,
    CPU_INT8,
    DEFAULT_CALIBRATION,
    FP16_KEEP_FLOAT,
    FP16_MASK_BIAS,
    FP32_ONLY,
    INT8_KEEP_FLOAT,
    N_TIMESTEPS,
    PRECISIONS,
    QDQ_OP_TYPES,
    QUANTIZED_GRAPHS,
    SENSITIVITY_CALLS,
    SENSITIVITY_GROUPS,
    CpuInt8Recipe,
    KeepFloat,
    keep_float_nodes,
    rules_table,
)
from .quantize_sensitivity import (
    GroupSensitivity,
    KernelEvent,
    _outputs,
    format_sensitivity,
    kernel_events,
    node_time_share,
    output_error,
    profile_trace,
    sensitivity,
)

__all__ = [
    "CALIBRATION_METHODS",
    "CPU_INT8",
    "DEFAULT_CALIBRATION",
    "ENTROPY_MAX_CALLS",
    "FP16_KEEP_FLOAT",
    "FP16_MASK_BIAS",
    "FP32_ONLY",
    "INT8_KEEP_FLOAT",
    "N_TIMESTEPS",
    "PERCENTILE_BINS",
    "PRECISIONS",
    "QDQ_OP_TYPES",
    "QUANTIZED_GRAPHS",
    "SENSITIVITY_CALLS",
    "SENSITIVITY_GROUPS",
    "CpuInt8Recipe",
    "FeedReader",
    "GraphResult",
    "GroupSensitivity",
    "KeepFloat",
    "KernelEvent",
    "PairInfo",
    "PipelineFeeds",
    "QuantizeReport",
    "Ranges",
    "cached_feeds",
    "calibrate",
    "collect_feeds",
    "convert_fp16",
    "count_reduced",
    "cpu_lacks_vnni",
    "encoder_feed",
    "estimator_feed",
    "euler_steps",
    "feeds_cache_key",
    "feeds_cache_path",
    "format_sensitivity",
    "fp16_estimator_fp32",
    "keep_float_nodes",
    "kernel_events",
    "load_pipeline",
    "node_time_share",
    "output_error",
    "profile_trace",
    "quantize_cpu_int8",
    "quantize_graphs",
    "quantize_qdq",
    "read_manifest",
    "rel_max",
    "rel_rms",
    "rules_table",
    "sensitivity",
    "session",
    "speech_pairs",
]

log = logging.getLogger(__name__)


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
