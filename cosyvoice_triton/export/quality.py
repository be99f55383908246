"""Quality report: error and CPU speed of each precision of the served graphs, against the fp32 pipeline.

For held-out speech (:func:`cosyvoice_triton.export.speech_corpus.utterances` split ``heldout``: sentences the
calibration never saw), paired as voice conversion (source i in the voice of utterance i+1), the token ->
mel -> waveform path runs with onnxruntime sessions swapped in for the PyTorch stages, with the pipeline's
noise (the flow's fixed CFM noise, HiFT's NSF noise seeded per pair), and is compared with the fp32 PyTorch
pipeline:

* one row per (precision, stage) with only that stage swapped (``flow_encoder`` -> mu/spks,
  ``flow_estimator`` as the solver's ``estimator_fn``, ``hift_decoder`` given the reference mel and source),
  and one ``all`` row with every stage swapped and ``hift_source`` on its fp32 ONNX graph (the served path);
  ``fp32`` rows are the ONNX export itself (sanity);
* errors: flow mel ``max|a-b| / max|b|`` and ``||a-b|| / ||b||``, waveform ``||a-b|| / ||b||``, and the
  phase-insensitive log-mel distance of the two waveforms (mean |dB| difference of their 80-bin mels, floored
  80 dB under the reference's peak). HiFT's sine source integrates f0 into phase, so a tiny mel change moves
  waveform samples a lot while the spectrum barely moves: the waveform rel RMS of a flow swap is reported,
  not judged. A context row gives the fp32 pipeline against itself with another HiFT noise seed (the official
  code draws fresh noise per call).
* speed: per stage, median (and min) wall time of onnxruntime CPU sessions of each precision at fixed
  shapes, runs interleaved across precisions so that background load hits them alike.

The rule (:func:`decide`): a reduced precision serves a stage on the CPU only when it is at least
:data:`SPEEDUP_RULE` times faster than fp32 (median) and its stage row is within :data:`BAR`.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..frontend import features
from .quantize import (
    FP32_ONLY,
    PRECISIONS,
    QUANTIZED_GRAPHS,
    encoder_feed,
    estimator_feed,
    load_pipeline,
    read_manifest,
    rules_table,
    session,
    speech_pairs,
)

__all__ = [
    "BAR",
    "SPEEDUP_RULE",
    "STAGES",
    "Bar",
    "Decision",
    "ErrorRow",
    "QualityReport",
    "SpeedRow",
    "decide",
    "logmel_db",
    "run_report",
]

log = logging.getLogger(__name__)

STAGES = QUANTIZED_GRAPHS  # flow_encoder, flow_estimator, hift_decoder
FLOW_SWAP_NOTE = (
    "Each stage is judged on its own output: a flow swap on the mel it produces, `hift_decoder` on its waveform's "
    "log-mel. A flow swap's waveform distance is reported, not judged: *via source only* (the reference mel decoded "
    "with the source built from the new mel's f0) shows how much of it is the NSF source's phase drift (f0 is "
    "integrated into phase over the whole utterance), against *via mel only*; the *HiFT noise seed* row is the "
    "official pipeline against itself with fresh NSF noise.")
SPEEDUP_RULE = 1.25
DB_PER_NEPER = 20.0 / math.log(10.0)  # the CosyVoice mel is a natural log of magnitudes
LOGMEL_FLOOR_DB = 80.0


@dataclass(frozen=True)
class Bar:
    """What a reduced-precision stage must stay within, against the fp32 pipeline on held-out speech, each
    stage judged on its own output with only that stage swapped (README: "The bar").

    Flow stages (their output is the 80-bin log-mel): ``mel_rel_rms`` (``||a-b|| / ||b||``) and ``mel_db``
    (mean |difference| of the log-mel, in dB). ``hift_decoder``: ``logmel_db``, the mean |difference| of the
    output waveforms' log-mels in dB (phase-insensitive: HiFT's sample values move with tiny phase changes).
    0.5 dB is half the ~1 dB level difference a listener just notices, so a flow stage and the vocoder both
    at the bar stay under it together; random weights make perceptual scores (MOS, speaker similarity, WER)
    meaningless, so the bar is numeric.
    """

    mel_rel_rms: float = 0.05
    mel_db: float = 0.5
    logmel_db: float = 0.5

    def check(self, stage: str, row: ErrorRow) -> tuple[bool, str]:
        problems = []
        if stage == "hift_decoder":
            if not row.logmel_db <= self.logmel_db:
                problems.append(f"log-mel {row.logmel_db:.2f} dB > {self.logmel_db:g} dB")
        else:
            if not row.mel_rel_rms <= self.mel_rel_rms:
                problems.append(f"mel rel RMS {row.mel_rel_rms:.2e} > {self.mel_rel_rms:g}")
            if not row.mel_mae_db <= self.mel_db:
                problems.append(f"mel {row.mel_mae_db:.2f} dB > {self.mel_db:g} dB")
        return (not problems, "; ".join(problems) or "within the bar")

    def describe(self) -> str:
        return (f"flow stages: mel rel RMS <= {self.mel_rel_rms:g} and mel mean |error| <= {self.mel_db:g} dB; "
                f"hift_decoder: waveform log-mel distance <= {self.logmel_db:g} dB; each with only that stage "
                "swapped")


BAR = Bar()


# ============================================================================================ metrics


def logmel_db(a: np.ndarray, b: np.ndarray, *, sample_rate: int = 24000, floor_db: float = LOGMEL_FLOOR_DB
              ) -> tuple[float, int]:
    """(mean |dB difference|, number of bins) of the 80-bin CosyVoice log-mels of waveforms ``a`` and ``b``
    (``b`` the reference), both floored ``floor_db`` under ``b``'s peak bin."""
    a = np.asarray(a, dtype=np.float32).reshape(-1)
    b = np.asarray(b, dtype=np.float32).reshape(-1)
    n = min(a.size, b.size)
    ma = features.cosyvoice_mel(a[:n], sample_rate=sample_rate).astype(np.float64) * DB_PER_NEPER
    mb = features.cosyvoice_mel(b[:n], sample_rate=sample_rate).astype(np.float64) * DB_PER_NEPER
    floor = float(mb.max()) - floor_db
    d = np.abs(np.maximum(ma, floor) - np.maximum(mb, floor))
    return float(d.mean()), int(d.size)


@dataclass
class _Acc:
    """Pooled error accumulator over pairs."""

    sq_err: float = 0.0
    sq_ref: float = 0.0
    max_err: float = 0.0
    max_ref: float = 0.0
    abs_err: float = 0.0
    count: int = 0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        a64, b64 = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
        d = a64 - b64
        self.sq_err += float(d @ d)
        self.sq_ref += float(b64 @ b64)
        self.max_err = max(self.max_err, float(np.max(np.abs(d), initial=0.0)))
        self.max_ref = max(self.max_ref, float(np.max(np.abs(b64), initial=0.0)))
        self.abs_err += float(np.abs(d).sum())
        self.count += d.size

    @property
    def rel_rms(self) -> float:
        return math.sqrt(self.sq_err / self.sq_ref) if self.sq_ref > 0 else (0.0 if self.sq_err == 0 else math.inf)

    @property
    def rel_max(self) -> float:
        return self.max_err / self.max_ref if self.max_ref > 0 else (0.0 if self.max_err == 0 else math.inf)

    @property
    def mae(self) -> float:
        return self.abs_err / self.count if self.count else 0.0


@dataclass
class ErrorRow:
    """Errors of one (precision, swapped stage) over every held-out pair, pooled."""

    precision: str
    swapped: str  # a stage, "all", or a context label
    pairs: int
    mel_rel_max: float
    mel_rel_rms: float
    mel_mae_db: float
    wave_rel_rms: float
    logmel_db: float
    note: str = ""
    #: flow swaps only: the log-mel distance when only the mel reaches HiFT's decoder (source from the reference
    #: mel) and when only the source does (f0 -> phase drift), which splits ``logmel_db`` into its two paths
    logmel_mel_only_db: float | None = None
    logmel_source_only_db: float | None = None


@dataclass
class SpeedRow:
    stage: str
    precision: str
    shape: str
    median_s: float
    min_s: float
    runs: int
    speedup: float  # fp32 median / this median


@dataclass
class Decision:
    stage: str
    cpu_precision: str
    reason: str
    candidates: list[str] = field(default_factory=list)
    gpu_note: str = ""


# ============================================================================================ running


class _Sessions:
    """Lazily opened onnxruntime sessions of ``onnx_root/<precision>/<graph>.onnx``."""

    def __init__(self, root: Path, threads: int, fp32_dir: Path | None = None):
        self.root, self.threads = root, threads
        self.fp32_dir = fp32_dir or root / "fp32"
        self._cache: dict[tuple[str, str], Any] = {}

    def path(self, graph: str, precision: str) -> Path:
        return (self.fp32_dir if precision == "fp32" else self.root / precision) / f"{graph}.onnx"

    def has(self, graph: str, precision: str) -> bool:
        return self.path(graph, precision).is_file()

    def get(self, graph: str, precision: str):
        key = (graph, precision)
        if key not in self._cache:
            self._cache[key] = session(self.path(graph, precision), self.threads)
        return self._cache[key]


@dataclass
class _Pair:
    index: int
    label: str
    inputs: Any
    cond: Any  # FlowCondition of the reference
    mel: Any  # torch [1, 80, T] reference mel (cropped)
    noise: Any  # torch [1, 480 T, 9]
    source: Any  # torch [1, 1, 480 T]
    wave: np.ndarray  # [480 T]


def _torch():
    import torch

    return torch


def _reference(model, inputs, index: int, label: str) -> _Pair:
    torch = _torch()
    flow, hift = model.flow, model.hift
    with torch.inference_mode():
        c = flow.condition(*model._tensors(inputs, inputs.source_tokens), streaming=False, finalize=True)
        mel, _ = c.crop(flow.decoder(c.mu, c.mask, c.spks, c.cond, streaming=False))
        noise = hift.draw_noise(1, mel.shape[2], torch.Generator().manual_seed(index))
        source = hift.source_from_f0(hift.f0_predictor(mel), noise)
        wave = hift.decode(mel, source)[0].numpy()
    return _Pair(index, label, inputs, c, mel, noise, source, wave)


def _flow_mel(model, pair: _Pair, sessions: _Sessions, enc: str | None, est: str | None):
    """The cropped mel with the encoder and/or estimator of the given precisions (None: PyTorch)."""
    torch = _torch()
    from ..models.flow import FlowCondition

    if enc is None and est is None:
        return pair.mel
    flow, c = model.flow, pair.cond
    with torch.inference_mode():
        if enc is not None:
            inp = pair.inputs
            feed = encoder_feed(inp.prompt_tokens, inp.source_tokens, inp.embedding, streaming=False, lookahead=0)
            mu, mel_len, spks = sessions.get("flow_encoder", enc).run(["mu", "mel_len", "spks"], feed)
            t = c.mu.shape[2]
            if int(mel_len[0]) != int(c.mel_len[0]) or mu.shape[2] < t:
                raise RuntimeError(f"flow_encoder ({enc}) gives {int(mel_len[0])} mel frames, the pipeline "
                                   f"{int(c.mel_len[0])}")
            c = FlowCondition(mu=torch.from_numpy(np.ascontiguousarray(mu[:, :, :t])), mask=c.mask,
                              spks=torch.from_numpy(spks), cond=c.cond, mel_len=c.mel_len,
                              prompt_mel_len=c.prompt_mel_len)
        fn = None
        if est is not None:
            sess = sessions.get("flow_estimator", est)

            def fn(x, mask, mu, t, spks, cond, streaming, _s=sess):
                v = _s.run(["velocity"], estimator_feed(x, mask, mu, t, spks, cond, streaming))[0]
                return torch.from_numpy(v)

        mel, _ = c.crop(flow.decoder(c.mu, c.mask, c.spks, c.cond, streaming=False, estimator_fn=fn))
    return mel


def _hift_wave(model, pair: _Pair, mel, sessions: _Sessions, dec: str | None, onnx_source: bool) -> np.ndarray:
    torch = _torch()
    hift = model.hift
    with torch.inference_mode():
        if onnx_source:
            src = sessions.get("hift_source", "fp32").run(
                ["source"], {"mel": mel.numpy(), "nsf_noise": pair.noise.numpy()})[0]
            source = torch.from_numpy(src)
        elif mel is pair.mel:
            source = pair.source
        else:
            source = hift.source_from_f0(hift.f0_predictor(mel), pair.noise)
        if dec is None:
            return hift.decode(mel, source)[0].numpy()
        return sessions.get("hift_decoder", dec).run(["waveform"], {"mel": mel.numpy(),
                                                                     "source": source.numpy()})[0][0]


class _RowAcc:
    def __init__(self, precision: str, swapped: str, note: str = ""):
        self.precision, self.swapped, self.note = precision, swapped, note
        self.mel, self.wave = _Acc(), _Acc()
        self.logmel = {"both": [0.0, 0], "mel": [0.0, 0], "source": [0.0, 0]}
        self.pairs = 0

    def _logmel(self, key: str, wave: np.ndarray, wave_ref: np.ndarray) -> None:
        d, n = logmel_db(wave, wave_ref)
        self.logmel[key][0] += d * n
        self.logmel[key][1] += n

    def add(self, mel, mel_ref, wave: np.ndarray, wave_ref: np.ndarray, *, mel_only: np.ndarray | None = None,
            source_only: np.ndarray | None = None) -> None:
        self.mel.add(np.asarray(mel), np.asarray(mel_ref))
        self.wave.add(wave, wave_ref)
        self._logmel("both", wave, wave_ref)
        if mel_only is not None:
            self._logmel("mel", mel_only, wave_ref)
        if source_only is not None:
            self._logmel("source", source_only, wave_ref)
        self.pairs += 1

    def row(self) -> ErrorRow:
        mean = lambda k: self.logmel[k][0] / self.logmel[k][1] if self.logmel[k][1] else None
        return ErrorRow(self.precision, self.swapped, self.pairs, self.mel.rel_max, self.mel.rel_rms,
                        self.mel.mae * DB_PER_NEPER, self.wave.rel_rms, mean("both") or 0.0, self.note,
                        mean("mel"), mean("source"))


def _split_paths(model, pair: _Pair, mel) -> tuple[np.ndarray, np.ndarray]:
    """HiFT (PyTorch) waveforms with only the new mel reaching the decoder (the source from the reference mel)
    and with only the new source (from the new mel's f0) reaching it."""
    torch = _torch()
    hift = model.hift
    with torch.inference_mode():
        mel_only = hift.decode(mel, pair.source)[0].numpy()
        source_only = hift.decode(pair.mel, hift.source_from_f0(hift.f0_predictor(mel), pair.noise))[0].numpy()
    return mel_only, source_only


def tile_time(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` repeated along its last axis and cut to ``n`` there: a fixed-length input made of real data."""
    reps = -(-n // a.shape[-1])
    return np.ascontiguousarray(np.concatenate([a] * reps, axis=-1)[..., :n])


def timing_feeds(pair: _Pair, model, *, estimator_frames: int = 400, hift_frames: int = 250,
                 encoder_tokens: int = 250) -> dict[str, tuple[str, dict[str, np.ndarray]]]:
    """Fixed-shape inputs per stage built from a held-out pair's real tensors (tiled along time):
    stage -> (shape label, feeds). Estimator: the CFG batch of 2 rows at step 0."""
    torch = _torch()
    inp, c = pair.inputs, pair.cond
    tokens = tile_time(np.concatenate([inp.prompt_tokens, inp.source_tokens]).astype(np.int32), encoder_tokens)
    enc = {"speech_tokens": tokens[None], "speech_token_len": np.array([encoder_tokens], dtype=np.int32),
           "lookahead_len": np.zeros(1, dtype=np.int32),
           "speaker_embedding": np.asarray(inp.embedding, dtype=np.float32)[None],
           "streaming": np.zeros(1, dtype=bool)}
    t = c.mu.shape[2]
    z = model.flow.decoder.noise(t)
    with torch.inference_mode():
        cfg = lambda a: torch.cat([a, torch.zeros_like(a)])  # rows [conditional, unconditional]
        est = estimator_feed(torch.cat([z, z]), torch.cat([c.mask, c.mask]), cfg(c.mu), torch.zeros(1), cfg(c.spks),
                             cfg(c.cond), False)
    est = {k: (tile_time(v, estimator_frames) if v.ndim == 3 else v) for k, v in est.items()}
    mel = tile_time(pair.mel.numpy(), hift_frames)
    dec = {"mel": mel, "source": tile_time(pair.source.numpy(), hift_frames * 480)}
    src = {"mel": mel, "nsf_noise": np.ascontiguousarray(
        np.resize(pair.noise.numpy(), (1, hift_frames * 480, pair.noise.shape[2])), dtype=np.float32)}
    return {"flow_encoder": (f"B=1, {encoder_tokens} tokens", enc),
            "flow_estimator": (f"B=2 (CFG), {estimator_frames} frames", est),
            "hift_source": (f"B=1, {hift_frames} frames", src),
            "hift_decoder": (f"B=1, {hift_frames} frames ({hift_frames / 50:g} s)", dec)}


def interleaved_seconds(calls: Mapping[str, Callable[[], Any]], runs: int) -> dict[str, list[float]]:
    """Wall seconds of each call, ``runs`` rounds after one warm-up each, interleaved so that background load hits
    every call alike."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(runs):
        for k, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[k].append(time.perf_counter() - t0)
    return times


def measure_speed(sessions: _Sessions, feeds: Mapping[str, tuple[str, Mapping[str, np.ndarray]]],
                  precisions: Sequence[str], *, runs: int = 5, progress: Callable[[str], None] | None = None
                  ) -> list[SpeedRow]:
    """Median/min seconds per call of every (stage, precision) file, runs interleaved across precisions."""
    say = progress or log.info
    rows: list[SpeedRow] = []
    for stage, (shape, feed) in feeds.items():
        precs = [p for p in precisions if sessions.has(stage, p)]
        if "fp32" not in precs:
            continue
        times = interleaved_seconds({p: functools.partial(sessions.get(stage, p).run, None, dict(feed))
                                     for p in precs}, runs)
        base = statistics.median(times["fp32"])
        for p in precs:
            med = statistics.median(times[p])
            rows.append(SpeedRow(stage, p, shape, med, min(times[p]), runs, base / med))
        say(f"speed {stage} ({shape}): " + ", ".join(f"{p} {statistics.median(times[p]) * 1e3:.0f} ms"
                                                      for p in precs))
    return rows


def decide(errors: Sequence[ErrorRow], speed: Sequence[SpeedRow], *, bar: Bar = BAR,
           rule: float = SPEEDUP_RULE) -> list[Decision]:
    """Per stage: the fastest reduced precision that is >= ``rule`` times faster than fp32 on this CPU and
    within ``bar`` (its own stage row), else fp32; with the reason, and a note for TensorRT on a GPU."""
    err = {(r.precision, r.swapped): r for r in errors}
    spd = {(r.stage, r.precision): r for r in speed}
    out = []
    for stage in STAGES:
        if ("fp32", stage) not in err and (stage, "fp32") not in spd:
            continue
        ok: list[tuple[float, str]] = []
        notes: list[str] = []
        gpu: list[str] = []
        for p in PRECISIONS:
            if p == "fp32" or (p, stage) not in err:
                continue
            within, why = bar.check(stage, err[(p, stage)])
            s = spd.get((stage, p))
            fast = s is not None and s.speedup >= rule
            notes.append(f"{p}: {s.speedup:.2f}x" if s else f"{p}: not timed")
            notes[-1] += f", {why}"
            if within and fast:
                ok.append((s.speedup, p))
            if p in ("fp16", "int8") and within:
                gpu.append(p)
        if ok:
            best = max(ok)[1]
            reason = f"{best} is >= {rule:g}x faster and within the bar ({'; '.join(notes)})"
        else:
            best = "fp32"
            reason = f"no reduced precision is >= {rule:g}x faster and within the bar ({'; '.join(notes) or 'none'})"
        gpu_note = ("TensorRT: " + (" or ".join(gpu) + " within the bar (speed to be measured on the GPU)"
                                    if gpu else "fp32 (no reduced precision within the bar)"))
        out.append(Decision(stage, best, reason, [p for _, p in sorted(ok, reverse=True)], gpu_note))
    return out


@dataclass
class QualityReport:
    model_dir: str
    onnx_root: str
    pairs: list[str]
    errors: list[ErrorRow]
    speed: list[SpeedRow]
    decisions: list[Decision]
    meta: dict[str, Any]
    bar: Bar = BAR
    rule: float = SPEEDUP_RULE

    def markdown(self) -> str:
        m = self.meta
        lines = [f"# Reduced-precision quality report: {Path(self.model_dir).name}", "",
                 f"Model `{self.model_dir}`, graphs `{self.onnx_root}/<precision>/`, {len(self.pairs)} held-out VC "
                 f"pairs (split `heldout`, sentences never used for calibration), onnxruntime {m.get('onnxruntime')} "
                 f"CPU, {m.get('threads')} intra-op thread(s), CPU {m.get('cpu')} ({m.get('cpu_flags')}). "
                 f"{m.get('date')}, {m.get('seconds', 0):.0f} s.", "",
                 "Random-weight demo models produce noise, not speech: perceptual scores (MOS, speaker similarity, "
                 "WER) would be meaningless, so the bar is numeric. Re-run on the real checkpoint before serving.",
                 "", f"**Bar**: {self.bar.describe()}. **Rule**: a reduced precision serves a stage on the CPU only "
                 f"when it is >= {self.rule:g}x faster than fp32 (median) and within the bar.", "",
                 "## Error against the fp32 PyTorch pipeline", "",
                 "| precision | swapped | pairs | mel rel max | mel rel RMS | mel MAE dB | wave rel RMS "
                 "| log-mel dist dB | via mel only | via source only | within bar |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in self.errors:
            verdict = ""
            if r.swapped in STAGES and not r.precision.startswith("fp32"):
                verdict = "yes" if self.bar.check(r.swapped, r)[0] else "NO"
            opt = lambda x: "" if x is None else f"{x:.3f}"
            lines.append(f"| {r.precision} | {r.swapped} | {r.pairs} | {r.mel_rel_max:.2e} | {r.mel_rel_rms:.2e} | "
                         f"{r.mel_mae_db:.3f} | {r.wave_rel_rms:.2e} | {r.logmel_db:.3f} | "
                         f"{opt(r.logmel_mel_only_db)} | {opt(r.logmel_source_only_db)} | {verdict}"
                         f"{' (' + r.note + ')' if r.note else ''} |")
        lines += ["", FLOW_SWAP_NOTE,
                  "", f"## Speed per stage (onnxruntime CPU, median of {self.speed[0].runs if self.speed else 0} "
                      "interleaved runs after a warm-up)", "",
                  "| stage | shape | precision | median ms | min ms | speedup vs fp32 |",
                  "| --- | --- | --- | ---: | ---: | ---: |"]
        for s in self.speed:
            lines.append(f"| {s.stage} | {s.shape} | {s.precision} | {s.median_s * 1e3:.1f} | {s.min_s * 1e3:.1f} | "
                         f"{s.speedup:.2f}x |")
        lines += ["", "`int8` (explicit Q/DQ, S8S8) is the TensorRT graph: onnxruntime runs it faithfully for the "
                      "error columns, but its CPU time is not representative of TensorRT.", "",
                  "## CPU precision per stage", "", "| stage | CPU precision | why | GPU (TensorRT) |",
                  "| --- | --- | --- | --- |"]
        for d in self.decisions:
            lines.append(f"| {d.stage} | **{d.cpu_precision}** | {d.reason} | {d.gpu_note} |")
        for g, why in FP32_ONLY.items():
            if g == "hift_source":
                lines.append(f"| {g} | **fp32** | {why} | onnxruntime |")
        lines += ["", "## Layers kept in float", "", m.get("rules", ""), ""]
        cal = m.get("calibration") or {}
        if cal:
            lines += ["## Calibration (int8 Q/DQ)", "", "| graph | method | held-out rel RMS per method | samples |",
                      "| --- | --- | --- | ---: |"]
            for g, c in cal.items():
                errs = ", ".join(f"{k} {v:.2e}" for k, v in (c.get("heldout_rel_rms") or {}).items())
                lines.append(f"| {g} | {c.get('method')} | {errs} | {c.get('samples')} |")
            lines.append("")
        lines += ["## Held-out pairs", ""] + [f"- {p}" for p in self.pairs] + [""]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"model_dir": self.model_dir, "onnx_root": self.onnx_root, "pairs": self.pairs,
                "bar": asdict(self.bar), "rule_speedup": self.rule,
                "errors": [asdict(r) for r in self.errors], "speed": [asdict(s) for s in self.speed],
                "decisions": [asdict(d) for d in self.decisions], "meta": self.meta}

    def write(self, out_dir: str | Path) -> tuple[Path, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        md, js = out / "report.md", out / "report.json"
        md.write_text(self.markdown(), encoding="utf-8")
        js.write_text(json.dumps(self.to_json(), indent=2, default=_json_default) + "\n", encoding="utf-8")
        return md, js


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return str(x)


def cpu_description() -> tuple[str, str]:
    """(model name, the SIMD features that matter for INT8) of this CPU."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", platform.machine(), platform.processor()):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    names = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "AVX512-VNNI", "avx_vnni": "AVX-VNNI",
             "amx_int8": "AMX-INT8", "avx512_fp16": "AVX512-FP16"}
    have = [v for k, v in names.items() if k in flags]
    return name, ", ".join(have) or "no AVX2"


def available_precisions(onnx_root: str | Path, stages: Iterable[str] = STAGES) -> list[str]:
    """Precisions with at least one stage's file under ``onnx_root`` (fp32 first)."""
    root = Path(onnx_root)
    return [p for p in PRECISIONS if any((root / p / f"{s}.onnx").is_file() for s in stages)]


def run_report(model_dir: str | Path, onnx_root: str | Path = "build/onnx", *, fp32_dir: str | Path | None = None,
               heldout: int = 4,
               precisions: Iterable[str] | None = None, stages: Iterable[str] = STAGES, threads: int = 0,
               timing_runs: int = 5, estimator_frames: int = 400, hift_frames: int = 250, encoder_tokens: int = 250,
               max_seconds: float = 8.0, seed: int = 0, out_dir: str | Path | None = "build/quality",
               bar: Bar = BAR, split_paths: bool = True, progress: Callable[[str], None] | None = None
               ) -> QualityReport:
    """Run the report (see the module docstring) and write ``out_dir/report.{md,json}``.

    Graphs are ``onnx_root/<precision>/<graph>.onnx`` (fp32 from ``fp32_dir`` when given). ``threads``: torch
    and onnxruntime intra-op threads (0: their defaults). ``heldout``: pairs of the held-out split; the timing
    shapes are fixed (``estimator_frames`` for the CFG batch of 2, ``hift_frames``, ``encoder_tokens``).
    ``split_paths``: for flow swaps, also the log-mel distance through each of HiFT's two inputs alone.
    """
    import onnxruntime

    start = time.perf_counter()
    say = progress or log.info
    root = Path(onnx_root)
    stages = [s for s in STAGES if s in set(stages)]
    if not stages:
        raise ValueError(f"no stage selected (choose from {', '.join(STAGES)})")
    if heldout < 1:
        raise ValueError(f"heldout must be >= 1, got {heldout}")
    fp32 = Path(fp32_dir) if fp32_dir is not None else root / "fp32"
    missing = [s for s in (*stages, "hift_source") if not (fp32 / f"{s}.onnx").is_file()]
    if missing:
        raise FileNotFoundError(f"{fp32}: missing {', '.join(m + '.onnx' for m in missing)} "
                                "(run export/export_onnx.py)")
    avail = ["fp32", *[p for p in available_precisions(root, stages) if p != "fp32"]]
    precs = avail if precisions is None else [p for p in PRECISIONS if p in set(precisions)]
    unknown = sorted(set(precisions or ()) - set(PRECISIONS))
    if unknown:
        raise ValueError(f"unknown precision(s) {unknown}: choose from {', '.join(PRECISIONS)}")
    if "fp32" not in precs:
        precs = ["fp32", *precs]
    absent = [p for p in precs if p not in avail]
    if absent:
        raise FileNotFoundError(f"no graphs for precision(s) {', '.join(absent)} under {root} "
                                "(run export/quantize.py)")
    sessions = _Sessions(root, threads, fp32)
    model = load_pipeline(model_dir, threads)
    say(f"{heldout} held-out pairs, precisions {', '.join(precs)}, stages {', '.join(stages)}")
    pairs = speech_pairs(heldout, split="heldout", seed=seed, max_seconds=max_seconds)
    accs: dict[tuple[str, str], _RowAcc] = {}

    def acc(p: str, swapped: str, note: str = "") -> _RowAcc:
        return accs.setdefault((p, swapped), _RowAcc(p, swapped, note))

    labels, refs = [], []
    for i, (src, prm) in enumerate(pairs):
        t0 = time.perf_counter()
        inputs = model.frontend_vc(src.wave, prm.wave, source_sr=src.sample_rate, prompt_sr=prm.sample_rate)
        label = (f"source {src.voice} {src.speed_wpm} wpm {src.seconds:.1f} s \"{src.text[:48]}\" in the voice of "
                 f"{prm.voice} ({prm.seconds:.1f} s prompt)")
        pair = _reference(model, inputs, i, label)
        labels.append(label)
        if i == 0:
            refs.append(pair)
        # context: the fp32 pipeline with another HiFT noise seed (the official code draws fresh noise per call)
        torch = _torch()
        with torch.inference_mode():
            noise2 = model.hift.draw_noise(1, pair.mel.shape[2], torch.Generator().manual_seed(10_000 + i))
            wave2 = model.hift.decode(pair.mel, model.hift.source_from_f0(model.hift.f0_predictor(pair.mel), noise2))
        acc("fp32 (PyTorch)", "HiFT noise seed", "context: official pipeline, fresh NSF noise").add(
            pair.mel, pair.mel, wave2[0].numpy(), pair.wave)
        for p in precs:
            have = {s: sessions.has(s, p) for s in STAGES}
            for stage, enc, est in (("flow_encoder", p, None), ("flow_estimator", None, p)):
                if stage in stages and have[stage]:
                    mel = _flow_mel(model, pair, sessions, enc, est)
                    mel_only, source_only = _split_paths(model, pair, mel) if split_paths else (None, None)
                    acc(p, stage).add(mel, pair.mel, _hift_wave(model, pair, mel, sessions, None, False), pair.wave,
                                      mel_only=mel_only, source_only=source_only)
            if "hift_decoder" in stages and have["hift_decoder"]:
                acc(p, "hift_decoder").add(pair.mel, pair.mel,
                                           _hift_wave(model, pair, pair.mel, sessions, p, False), pair.wave)
            use = {s: (p if have[s] else "fp32") for s in STAGES}
            fallback = [s for s in STAGES if not have[s]]
            note = f"fp32 for {', '.join(fallback)}" if fallback and p != "fp32" else ""
            mel = _flow_mel(model, pair, sessions, use["flow_encoder"], use["flow_estimator"])
            acc(p, "all", note).add(mel, pair.mel, _hift_wave(model, pair, mel, sessions, use["hift_decoder"], True),
                                    pair.wave)
        say(f"held-out {i + 1}/{heldout}: {label}: {time.perf_counter() - t0:.1f} s")
    errors = [a.row() for a in accs.values()]
    say(f"timing ({timing_runs} interleaved runs per precision)")
    feeds = timing_feeds(refs[0], model, estimator_frames=estimator_frames, hift_frames=hift_frames,
                         encoder_tokens=encoder_tokens)
    feeds = {s: feeds[s] for s in (*stages, "hift_source")}
    speed = measure_speed(sessions, feeds, precs, runs=timing_runs, progress=say)
    decisions = decide(errors, speed, bar=bar)
    chosen = {d.stage: d.cpu_precision for d in decisions}
    if any(v != "fp32" for v in chosen.values()):  # the served CPU mix, end to end
        row = _RowAcc("CPU choice", "all", ", ".join(f"{s} {chosen.get(s, 'fp32')}" for s in STAGES))
        for i, (src, prm) in enumerate(pairs):
            inputs = model.frontend_vc(src.wave, prm.wave, source_sr=src.sample_rate, prompt_sr=prm.sample_rate)
            pair = _reference(model, inputs, i, labels[i])
            use = {s: chosen.get(s, "fp32") for s in STAGES}
            mel = _flow_mel(model, pair, sessions, use["flow_encoder"], use["flow_estimator"])
            row.add(mel, pair.mel, _hift_wave(model, pair, mel, sessions, use["hift_decoder"], True), pair.wave)
        errors.append(row.row())
    cpu, flags = cpu_description()
    int8_manifest = read_manifest(root / "int8")
    meta = {"onnxruntime": onnxruntime.__version__, "threads": threads or "default", "cpu": cpu, "cpu_flags": flags,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "precisions": precs, "stages": stages, "seconds": time.perf_counter() - start,
            "rules": rules_table(stages, fp32),
            "calibration": {g: e.get("calibration", {}) | {"samples": e.get("calibration", {}).get("samples")}
                            for g, e in (int8_manifest.get("graphs") or {}).items()}}
    for c in meta["calibration"].values():
        c.pop("data", None)
    report = QualityReport(str(model_dir), str(root), labels, errors, speed, decisions, meta, bar)
    if out_dir is not None:
        md, js = report.write(out_dir)
        say(f"wrote {md} and {js}")
    return report
