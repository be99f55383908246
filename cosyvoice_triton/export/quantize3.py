"""CosyVoice3's vocoder generator in onnxruntime's CPU INT8, calibrated on speech and judged by the quality bar.

The fp32 ``hift3_decoder`` graph of a CosyVoice3 export (:mod:`.onnx_export3`) becomes a static U8S8 QLinearConv
graph, CosyVoice2's ``hift_decoder`` recipe (:data:`VOCODER3_RECIPE`): S8 weights per output channel, U8
activations with asymmetric ranges calibrated (minmax) on what the graph is fed in the real pipeline. The same
layers stay float as in CosyVoice2's vocoder (the source STFT and the head from ``conv_post`` on; the node names
are the same in both exports) and, measured here, the last upsampling stage and the middle stage's source branch
(:data:`VOCODER3_KEEP_FLOAT`)::

    <onnx_dir>/hift3_decoder.onnx              # the fp32 export (input)
    <onnx_dir>/int8_cpu/hift3_decoder.onnx     # written here
    <onnx_dir>/int8_cpu/manifest.json          # its source graph and checkpoint digests, recipe, calibration,
                                               # held-out quality and speed, and the verdict

**Inputs** (:func:`capture_vocoder_feeds`): the fp32 PyTorch :class:`~..models.cosyvoice3.pipeline.CosyVoice3`
converts espeak-ng speech pairs (:func:`.quantize_calibration.speech_pairs`: source i in the voice of utterance
i+1) and every vocoder call's ``(mel, source)`` is recorded where the served graph would receive it
(:attr:`CausalHiFTGenerator.decode_fn`). The calibration split calibrates; the held-out split judges, drawn with
``seed + 1``, not the held-out pairs the kept layers were chosen on.

**Verdict** (:class:`Vocoder3Int8Report`): against the fp32 graph on the held-out calls, the quality report's bar
for a vocoder (:data:`.quality.BAR`: mean |log-mel difference| of the two waveforms <= 0.5 dB, the worst call
counted) and its speed rule (:data:`.quality.SPEEDUP_RULE`: the INT8 graph at least 1.25x faster than fp32,
median of interleaved runs on a 250-frame call). The served model takes the INT8 file only when both
hold (tunable ``cosyvoice3_vocoder_precision``; the render reads ``serve`` from the manifest).
"""

from __future__ import annotations

import functools
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ..hashing import file_sha256
from ..shapes import GRAPHS3
from .quantize_calibration import FeedReader, calibrate, rel_rms, session, speech_pairs
from .quantize_int8 import cpu_lacks_vnni, quantize_cpu_int8
from .quantize_manifest import _save, _write_manifest, count_reduced
from .quantize_rules import CPU_INT8, INT8_KEEP_FLOAT, CpuInt8Recipe, KeepFloat, keep_float_nodes

log = logging.getLogger(__name__)

VOCODER3 = "hift3_decoder"
#: The folder of a CosyVoice3 export that holds its CPU INT8 graphs.
INT8_CPU_DIR = "int8_cpu"
#: CosyVoice2's vocoder recipe: the same layer types (causal convolutions, the iSTFT's transposed ones kept float).
VOCODER3_RECIPE = CpuInt8Recipe(
    "static", CPU_INT8["hift_decoder"].op_types, True,
    "CosyVoice2's hift_decoder recipe (static U8S8 QLinearConv); its measurements on this graph are in the "
    "manifest's quality and speed entries")
#: Layers that stay fp32: CosyVoice2's vocoder's (the same node names, the same reasons), and two more found by
#: keeping one group of layers float at a time on the full-size demo graph (8 calibration calls, 3 held-out calls of
#: split "heldout" seed 0, worst log-mel distance against fp32; onnxruntime 2 threads, 149 frames): with CosyVoice2's
#: rules alone 1.82 dB at 1.60x fp32's speed, outside the bar; its quiet bands sit a few dB above INT8's broadband
#: error. No single group of the first two stages moved it below 1.4 dB.
VOCODER3_KEEP_FLOAT = (
    *INT8_KEEP_FLOAT["hift_decoder"],
    KeepFloat(r"^/(ups\.2|resblocks\.[678]|source_downs\.2|source_resblocks\.2)/",
              "the last upsampling stage (its upsampling conv, ResBlocks and source branch): its error reaches "
              "conv_post unfiltered; float: 0.50 dB at 1.43x", basis="measured"),
    KeepFloat(r"^/(source_downs\.1|source_resblocks\.1)/",
              "the middle stage's source branch (the sine excitation's STFT, downsampled): with the last stage "
              "float, 0.39 dB at 1.34x", basis="measured"),
)


@dataclass
class CallError:
    """One held-out vocoder call: INT8 against fp32 on the same ``(mel, source)``."""

    frames: int
    logmel_db: float
    waveform_rel_rms: float


@dataclass
class Vocoder3Int8Report:
    path: Path
    fp32_path: Path
    reduced_layers: int
    kept_float: dict[str, str]
    reduce_range: bool
    calibration_calls: int
    heldout: list[CallError]
    speed_frames: int
    fp32_ms: list[float]
    int8_ms: list[float]
    threads: int
    seconds: float
    bar_logmel_db: float
    speedup_rule: float
    pairs: dict[str, list[str]] = field(default_factory=dict)
    cpu: str = ""

    @property
    def worst_logmel_db(self) -> float:
        return max(c.logmel_db for c in self.heldout)

    @property
    def speedup(self) -> float:
        return statistics.median(self.fp32_ms) / statistics.median(self.int8_ms)

    @property
    def within_bar(self) -> bool:
        return self.worst_logmel_db <= self.bar_logmel_db

    @property
    def serve(self) -> bool:
        """Within the bar and fast enough: what the render accepts for tunable ``cosyvoice3_vocoder_precision``."""
        return self.within_bar and self.speedup >= self.speedup_rule

    def verdict(self) -> str:
        quality = (f"worst held-out log-mel distance {self.worst_logmel_db:.3f} dB "
                   f"({'within' if self.within_bar else 'OUTSIDE'} the bar, {self.bar_logmel_db:g} dB)")
        speed = (f"{self.speedup:.2f}x fp32 at {self.speed_frames} frames, {self.threads} threads "
                 f"({'meets' if self.speedup >= self.speedup_rule else 'misses'} the {self.speedup_rule:g}x rule)")
        return f"{quality}; {speed}: {'served' if self.serve else 'not served'}"

    def table(self) -> str:
        lines = ["| held-out call | mel frames | log-mel distance (dB) | waveform rel RMS |",
                 "| ---: | ---: | ---: | ---: |"]
        for k, c in enumerate(self.heldout, 1):
            lines.append(f"| {k} | {c.frames} | {c.logmel_db:.3f} | {c.waveform_rel_rms:.3e} |")
        f32, i8 = statistics.median(self.fp32_ms), statistics.median(self.int8_ms)
        lines += ["", f"speed at {self.speed_frames} mel frames ({self.speed_frames / 50:.1f} s of audio), "
                      f"onnxruntime {self.threads} threads, medians of {len(self.fp32_ms)} interleaved runs: "
                      f"fp32 {f32:.0f} ms (min {min(self.fp32_ms):.0f}), INT8 {i8:.0f} ms "
                      f"(min {min(self.int8_ms):.0f}), {f32 / i8:.2f}x"]
        return "\n".join(lines)

    def manifest_entry(self) -> dict[str, Any]:
        return {
            "file": self.path.name, "sha256": file_sha256(self.path),
            "fp32_file": str(self.fp32_path), "fp32_sha256": file_sha256(self.fp32_path),
            "format": "onnxruntime static INT8 (QOperator): S8 weights per channel, calibrated asymmetric U8 "
                      "activations (QLinearConv)",
            "recipe": asdict(VOCODER3_RECIPE), "reduce_range": self.reduce_range,
            "reduced_layers": self.reduced_layers, "kept_float": self.kept_float,
            "calibration": {"method": "minmax", "samples": self.calibration_calls, "pairs": self.pairs},
            "quality": {"bar_logmel_db": self.bar_logmel_db, "worst_logmel_db": self.worst_logmel_db,
                        "calls": [asdict(c) for c in self.heldout]},
            "speed": {"frames": self.speed_frames, "threads": self.threads, "fp32_ms": self.fp32_ms,
                      "int8_ms": self.int8_ms, "speedup": self.speedup, "rule": self.speedup_rule},
            "serve": self.serve, "verdict": self.verdict(), "cpu": self.cpu,
        }


def capture_vocoder_feeds(model, pairs: Iterable, *, progress: Callable[[str], None] | None = None
                          ) -> list[dict[str, np.ndarray]]:
    """Voice-convert each ``(source, prompt)`` utterance pair with ``model`` (a fp32
    :class:`~..models.cosyvoice3.pipeline.CosyVoice3`) and return every vocoder generator call's inputs, as the
    ``hift3_decoder`` graph's feeds (``mel [1, 80, T]``, ``source [1, 1, 480 T]``)."""
    names = [t.name for t in GRAPHS3[VOCODER3].inputs]
    hift, feeds = model.hift, []

    def record(mel, source):
        feeds.append({names[0]: mel.detach().float().cpu().numpy().copy(),
                      names[1]: source.detach().float().cpu().numpy().copy()})
        return hift.generate(mel, source, True)

    if hift.decode_fn is not None:
        raise ValueError("capture_vocoder_feeds: the model's vocoder already has a decode_fn")
    hift.decode_fn = record
    try:
        pairs = list(pairs)
        for k, (src, prompt) in enumerate(pairs, 1):
            model.vc(src.wave, prompt.wave, source_sr=src.sample_rate, prompt_sr=prompt.sample_rate)
            if progress:
                progress(f"  pair {k}/{len(pairs)}: {src.seconds:.1f} s in the voice of {prompt.voice}, "
                         f"{len(feeds)} vocoder calls so far")
    finally:
        hift.decode_fn = None
    return feeds


def _run(sess, feed: dict[str, np.ndarray]) -> np.ndarray:
    return sess.run(None, feed)[0]


def heldout_errors(fp32_sess, int8_sess, feeds: Sequence[dict[str, np.ndarray]], *, sample_rate: int
                   ) -> list[CallError]:
    """Per held-out call: the INT8 graph's waveform against the fp32 graph's (log-mel distance, rel RMS)."""
    from .quality import logmel_db

    out = []
    for feed in feeds:
        ref, got = _run(fp32_sess, feed)[0], _run(int8_sess, feed)[0]
        db, _ = logmel_db(got, ref, sample_rate=sample_rate)
        out.append(CallError(int(feed["mel"].shape[2]), float(db), rel_rms(got, ref)))
    return out


def speed_feed(feeds: Sequence[dict[str, np.ndarray]], frames: int) -> dict[str, np.ndarray]:
    """A ``frames``-long vocoder call made of ``feeds`` one after another (repeated as needed): a fixed shape to
    time."""
    from .quality import tile_time

    mel = np.concatenate([f["mel"] for f in feeds], axis=2)
    source = np.concatenate([f["source"] for f in feeds], axis=2)
    return {"mel": tile_time(mel, frames), "source": tile_time(source, source.shape[2] // mel.shape[2] * frames)}


def quantize_vocoder3(model_dir: str | Path, onnx_dir: str | Path, *, calibration_pairs: int = 8,
                      heldout_pairs: int = 3, max_seconds: float = 10.0, threads: int = 2, speed_runs: int = 5,
                      speed_frames: int = 250,
                      reduce_range: bool | None = None, seed: int = 0,
                      progress: Callable[[str], None] | None = None) -> Vocoder3Int8Report:
    """Write ``onnx_dir/int8_cpu/hift3_decoder.onnx`` and its manifest from ``onnx_dir/hift3_decoder.onnx``, the
    export of ``model_dir`` (module docstring). ``threads``: torch's and onnxruntime's. Speed: ``speed_runs``
    interleaved runs of a ``speed_frames``-long call (:func:`speed_feed`; 250 frames, 5 s of audio, as CosyVoice2's
    quality report times its vocoder). ``reduce_range``: 7-bit
    weights; None: where this CPU has no VNNI (:func:`.quantize_int8.cpu_lacks_vnni`)."""
    from ..models.cosyvoice3.pipeline import CosyVoice3
    from .quality import BAR, SPEEDUP_RULE, cpu_description, interleaved_seconds

    start = time.perf_counter()
    say = progress or log.info
    if calibration_pairs < 1 or heldout_pairs < 1:
        raise ValueError("calibration and held-out sets need at least one pair each")
    model_dir, onnx_dir = Path(model_dir), Path(onnx_dir)
    fp32_path = onnx_dir / f"{VOCODER3}.onnx"
    if not fp32_path.is_file():
        raise FileNotFoundError(f"{fp32_path} not found (export-onnx --model-dir {model_dir} --out {onnx_dir})")
    _check_export_source(onnx_dir, model_dir)
    if reduce_range is None:
        reduce_range = cpu_lacks_vnni()
    import torch

    previous = torch.get_num_threads()
    try:
        model = CosyVoice3.from_pretrained(model_dir, tts=False, prompt_cache=False, threads=threads or None)
        say(f"calibration: {calibration_pairs} pairs of split 'calibration' through the fp32 pipeline")
        cal_pairs = speech_pairs(calibration_pairs, split="calibration", seed=seed, max_seconds=max_seconds)
        calib = capture_vocoder_feeds(model, cal_pairs, progress=say)
        say(f"held-out: {heldout_pairs} pairs of split 'heldout' drawn with seed {seed + 1} (other voices and "
            "speeds than the pairs the kept layers were chosen on)")
        held_pairs = speech_pairs(heldout_pairs, split="heldout", seed=seed + 1, max_seconds=max_seconds)
        held = capture_vocoder_feeds(model, held_pairs, progress=say)
        sample_rate = model.sample_rate
        del model
    finally:
        torch.set_num_threads(previous)

    say(f"calibrating (minmax, asymmetric U8) on {len(calib)} vocoder calls")
    ranges = calibrate(fp32_path, FeedReader(calib, VOCODER3), "minmax", op_types=VOCODER3_RECIPE.op_types,
                       symmetric=False, progress=say)
    fp32_model = onnx.load(str(fp32_path))
    keep = keep_float_nodes(fp32_model, VOCODER3_KEEP_FLOAT, op_types=VOCODER3_RECIPE.op_types)
    q = quantize_cpu_int8(fp32_model, graph=VOCODER3, ranges=ranges, recipe=VOCODER3_RECIPE, keep_float=keep,
                          reduce_range=reduce_range)
    path = onnx_dir / INT8_CPU_DIR / f"{VOCODER3}.onnx"
    _save(q, path)
    say(f"wrote {path}: {count_reduced(q, 'int8_cpu')} INT8 kernels, {len(keep)} layers kept float"
        + (", 7-bit weights" if reduce_range else ""))

    fp32_sess, int8_sess = session(fp32_model, threads), session(q, threads)
    errors = heldout_errors(fp32_sess, int8_sess, held, sample_rate=sample_rate)
    timed = speed_feed(held, speed_frames)
    say(f"timing fp32 and INT8 on {speed_frames} frames, {speed_runs} interleaved runs")
    times = interleaved_seconds({p: functools.partial(sess.run, None, timed)
                                 for p, sess in (("fp32", fp32_sess), ("int8", int8_sess))}, speed_runs)
    f32, i8 = ([1000.0 * x for x in times[p]] for p in ("fp32", "int8"))
    report = Vocoder3Int8Report(
        path, fp32_path, count_reduced(q, "int8_cpu"), keep, reduce_range, len(calib), errors,
        speed_frames, f32, i8, threads, time.perf_counter() - start, BAR.logmel_db, SPEEDUP_RULE,
        {"calibration": [_describe(p) for p in cal_pairs], "heldout": [_describe(p) for p in held_pairs]},
        "{} ({})".format(*cpu_description()))
    _write_manifest(path.parent, INT8_CPU_DIR, {VOCODER3: report.manifest_entry()},
                    {"family": "cosyvoice3", "source_model_dir": str(model_dir.resolve()),
                     "fp32_dir": str(onnx_dir.resolve()),
                     "source": {"file": "hift.pt", "sha256": file_sha256(model_dir / "hift.pt")}},
                    graph_names=tuple(GRAPHS3), fp32_only={})
    say(report.verdict())
    return report


def _describe(pair) -> str:
    src, prompt = pair
    return f"{src.voice} {src.seconds:.1f} s -> voice of {prompt.voice}: {src.text[:40]}"


def _check_export_source(onnx_dir: Path, model_dir: Path) -> None:
    """The fp32 export's manifest names ``model_dir``'s ``hift.pt`` as the vocoder's source."""
    try:
        entry = json.loads((onnx_dir / "manifest.json").read_text())["graphs"][VOCODER3]
        sha = entry["source"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{onnx_dir / 'manifest.json'} is not a CosyVoice3 export's manifest with "
                         f"{VOCODER3} ({exc})") from exc
    if sha != file_sha256(model_dir / "hift.pt"):
        raise ValueError(f"{onnx_dir / VOCODER3}.onnx was exported from another hift.pt than "
                         f"{model_dir / 'hift.pt'} (export again)")
