"""The cost of going live: live voice conversion (source in pieces, :mod:`cosyvoice_triton.serving.stages.live_vc`)
against offline conversion of the same whole source, in process over the ONNX graphs.

For each source it prints: the share of live speech tokens equal to the whole-utterance tokenizer's, the log-mel
distance of the live output to the offline output (mean absolute difference of the 80-bin CosyVoice log-mel) beside
two yardsticks (the official streaming schedule on the whole source against offline, and offline with another NSF
seed against offline), and the seams between live chunks (largest sample step in each crossfade against the 99.9th
percentile elsewhere; 20 ms RMS in each crossfade against the median around it).

    python -m cosyvoice_triton.bench.live_vc --model-dir DIR --onnx-dir DIR/fp32 [--piece-seconds 0.2]

With the demo model the tokenizer is a stand-in with random weights whose every token depends on the mean over the
whole utterance (``cosyvoice_triton.models.standins``): its token agreement says how much the window edges move that
mean, not how the real tokenizer behaves (its attention context is also the whole utterance, but it was trained on
speech). The log-mel figures of a random-weight model compare noise with noise; they bound the machinery's effect,
not the audible quality.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ..frontend import features
from ..resources import path as resource_path
from ..serving.stages.live_vc import LiveSettings, LiveVC, LiveVCSession
from ..streaming import MEL_CACHE

CROSSFADE = MEL_CACHE * 480  # HiFT's crossfade at 24 kHz

__all__ = ["live_tokens", "log_mel_distance", "measure", "seams"]


def live_tokens(live: LiveVC, first: Mapping[str, np.ndarray], pieces: Sequence[np.ndarray]
                ) -> tuple[list[np.ndarray], np.ndarray]:
    """(output chunks, every committed source token) of one live session over ``pieces``."""
    session = live.open(first)
    committed: list[np.ndarray] = []
    commit = LiveVCSession._commit

    def recording(self, upto):
        before = self.committed
        commit(self, upto)
        committed.append(np.array(self.tokens[before - self.tokens_base:]))

    session._commit = recording.__get__(session)
    out = []
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        out.extend(live.piece(session, {"source_audio": np.asarray(p, np.float32)[None]}, first=i == 0, last=last))
    return out, np.concatenate(committed) if committed else np.zeros(0, np.int32)


def log_mel_distance(a: np.ndarray, b: np.ndarray, sample_rate: int = 24000) -> float:
    """Mean absolute difference of the CosyVoice log-mel of two waveforms (the shorter length)."""
    n = min(len(a), len(b))
    ma = features.cosyvoice_mel(np.asarray(a[:n], np.float32), sample_rate=sample_rate)
    mb = features.cosyvoice_mel(np.asarray(b[:n], np.float32), sample_rate=sample_rate)
    return float(np.mean(np.abs(ma - mb)))


def seams(y: np.ndarray, chunk_lengths: Sequence[int]) -> list[dict[str, float]]:
    """Per seam between chunks: the largest sample step in the crossfade over the 99.9th percentile of the steps
    elsewhere (``click``; the test's bar is 1.5), and the lowest / highest 20 ms RMS in the crossfade over the median
    RMS of the second around it (``level_low`` / ``level_high``; the bar is 0.5 / 2)."""
    import librosa

    y = np.asarray(y, np.float64)
    step = np.abs(np.diff(y))
    starts = np.cumsum(chunk_lengths)[:-1]
    mask = np.zeros(len(step), bool)
    for lo in starts:
        mask[max(lo - 1, 0): lo + CROSSFADE] = True
    bound = np.percentile(step[~mask], 99.9) if (~mask).any() else np.inf
    frame = 480
    rms = librosa.feature.rms(y=y, frame_length=frame, hop_length=frame, center=False)[0]
    out = []
    for lo in starts:  # a chunk's first CROSSFADE samples are crossfaded with the previous chunk's held-back tail
        a, b = lo, min(lo + CROSSFADE, len(y) - 1)
        around = np.concatenate([rms[max(a // frame - 50, 0): a // frame], rms[b // frame + 1: b // frame + 51]])
        level = float(np.median(around))
        inside = rms[a // frame: max(b // frame, a // frame + 1)]
        out.append({"at": int(lo), "click": float(step[max(a - 1, 0): b + 1].max() / bound),
                    "level_low": float(inside.min() / level), "level_high": float(inside.max() / level)})
    return out


def measure(pipeline, source: np.ndarray, source_sr: int, prompt: np.ndarray, prompt_sr: int, *,
            piece_seconds: float = 0.2, settings: LiveSettings | None = None, seed: int = 0,
            incremental=None, recompute: bool = True) -> dict:
    """The figures of one source (``pipeline``: a :class:`~cosyvoice_triton.serving.stages.local.LocalPipeline`).

    ``incremental``: an :class:`~cosyvoice_triton.serving.stages.stream_state.IncrementalFlow` (what the served
    model uses by default): the live figures are then the cached flow window's, and the recomputed window's are
    given beside them (``*_recompute``) with the distance between the two and each one's conversion time.
    ``recompute`` False (with ``incremental``): the cached window only, without the recomputed window and the
    official streaming yardstick (both cost many times the cached window at the real dims)."""
    import time

    from ..serving.stages.vc_stream import VCStreamer

    graphs = {k: v.run for k, v in pipeline.graphs.items()}
    streamer = VCStreamer(pipeline.pre, pipeline.flow, graphs)
    first = {"source_sample_rate": np.array([[source_sr]], np.int32), "prompt_audio": prompt[None],
             "prompt_sample_rate": np.array([[prompt_sr]], np.int32), "seed": np.array([[seed]], np.int64)}
    step = max(1, int(piece_seconds * source_sr))
    pieces = [source[i: i + step] for i in range(0, len(source), step)]
    recompute = recompute or incremental is None
    extra = {}
    if recompute:
        live = LiveVC(streamer, settings)
        start = time.perf_counter()
        chunks, tokens = live_tokens(live, first, pieces)
        recompute_s = time.perf_counter() - start
        recomputed = np.concatenate(chunks)
    if incremental is not None:
        live = LiveVC(VCStreamer(pipeline.pre, pipeline.flow, graphs, incremental=incremental), settings)
        start = time.perf_counter()
        chunks, tokens = live_tokens(live, first, pieces)
        extra["live_s"] = time.perf_counter() - start
    y = np.concatenate(chunks)
    if incremental is not None and recompute:
        extra.update(live_s_recompute=recompute_s, log_mel_cached_vs_recompute=log_mel_distance(y, recomputed))
    whole = streamer.tokens(pipeline.pre.source_features(source, source_sr))
    start = time.perf_counter()
    offline = pipeline.convert(source, source_sr, prompt, prompt_sr, seed=seed)
    extra["offline_s"] = time.perf_counter() - start
    other_seed = pipeline.convert(source, source_sr, prompt, prompt_sr, seed=seed + 1)
    req = {"source_audio": source[None], "source_sample_rate": np.array([[source_sr]], np.int32), **first}
    streamed = np.concatenate(list(streamer.stream(req))) if recompute else None
    n = min(len(tokens), len(whole))
    found = seams(y, [len(c) for c in chunks])
    return {
        "source_seconds": len(source) / source_sr, "piece_seconds": piece_seconds, "chunks": len(chunks),
        "tokens_live": len(tokens), "tokens_whole": len(whole),
        "tokens_equal_pct": float(100 * np.mean(tokens[:n] == whole[:n])) if n else 0.0,
        "samples_live": len(y), "samples_offline": len(offline),
        "log_mel_live_vs_offline": log_mel_distance(y, offline),
        **({"log_mel_recompute_vs_offline": log_mel_distance(recomputed, offline)}
           if incremental is not None and recompute else {}),
        "log_mel_streamed_vs_offline": log_mel_distance(streamed, offline) if recompute else None,
        "log_mel_other_seed_vs_offline": log_mel_distance(other_seed, offline),
        "seam_click_max": max((s["click"] for s in found), default=0.0),
        "seam_level_min": min((s["level_low"] for s in found), default=1.0),
        "seam_level_max": max((s["level_high"] for s in found), default=1.0),
        "latency_s": live.settings.latency_seconds, **extra,
    }


def _read(path: str) -> tuple[np.ndarray, int]:
    import soundfile as sf

    y, sr = sf.read(path, dtype="float32", always_2d=True)
    return np.ascontiguousarray(y.mean(axis=1), np.float32), int(sr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cosyvoice_triton.bench.live_vc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--onnx-dir", required=True, help="the fp32 graphs (<export>/fp32)")
    fixtures = resource_path("tests/fixtures")
    ap.add_argument("--source", action="append", help="source wav (repeatable; default: the bundled speech)")
    ap.add_argument("--prompt", default=str(fixtures / "prompt_en_3s.wav"))
    ap.add_argument("--piece-seconds", type=float, default=0.2)
    ap.add_argument("--chunk-tokens", type=int, default=LiveSettings.chunk_tokens)
    ap.add_argument("--tokenizer-context-tokens", type=int, default=LiveSettings.tokenizer_context_tokens)
    ap.add_argument("--tokenizer-lookahead-tokens", type=int, default=LiveSettings.tokenizer_lookahead_tokens)
    ap.add_argument("--flow-context-tokens", type=int, default=LiveSettings.flow_context_tokens)
    ap.add_argument("--no-state", action="store_true", help="only the recomputed flow window (without the served "
                    "default, the cached window of the stream state)")
    ap.add_argument("--no-recompute", action="store_true", help="the cached window only: without the recomputed "
                    "window and the official streaming yardstick (many times its cost at the real dims)")
    ap.add_argument("--threads", type=int, default=1, help="torch and onnxruntime intra-op threads (default 1, as "
                    "the served instances)")
    ap.add_argument("--json", action="store_true", help="one JSON object per source instead of the table")
    ns = ap.parse_args(argv)
    import torch

    torch.set_num_threads(ns.threads)
    from ..serving.stages.local import LocalPipeline

    settings = LiveSettings(chunk_tokens=ns.chunk_tokens, tokenizer_context_tokens=ns.tokenizer_context_tokens,
                            tokenizer_lookahead_tokens=ns.tokenizer_lookahead_tokens,
                            flow_context_tokens=ns.flow_context_tokens)
    pipeline = LocalPipeline(ns.model_dir, ns.onnx_dir, intra_op_threads=ns.threads)
    incremental = None
    if not ns.no_state:
        from ..serving.stages.stream_state import build_incremental

        incremental = build_incremental({}, ns.model_dir, pipeline.config)
    prompt, prompt_sr = _read(ns.prompt)
    sources = ns.source or [str(fixtures / "source_en_5s.wav"), str(fixtures / "speech_engb_16k.wav")]
    best, worst = settings.latency_seconds
    from ..loadtest.live import commit
    from ..loadtest.setup import machine

    print(f"commit {commit()}; {machine()}")
    print(f"live settings: {settings} (algorithmic latency {best:.2f}-{worst:.2f} s); {ns.threads} thread(s)")
    for k, path in enumerate(sources):
        src, sr = _read(path)
        if k == 0:  # warm-up: every graph session and the torch flow once, so that no figure carries a first call
            measure(pipeline, src[: 2 * sr], sr, prompt, prompt_sr, piece_seconds=ns.piece_seconds,
                    settings=settings, incremental=incremental, recompute=False)
        r = measure(pipeline, src, sr, prompt, prompt_sr, piece_seconds=ns.piece_seconds, settings=settings,
                    incremental=incremental, recompute=not ns.no_recompute)
        if ns.json:
            print(json.dumps({"source": path, **r}))
            continue
        print(f"{Path(path).name}: {r['source_seconds']:.2f} s in {ns.piece_seconds:g} s pieces, {r['chunks']} chunks")
        print(f"  tokens equal to the whole-utterance tokenizer: {r['tokens_equal_pct']:.1f}% "
              f"({r['tokens_live']} live, {r['tokens_whole']} whole)")
        streamed = r["log_mel_streamed_vs_offline"]
        print(f"  log-mel distance to offline: live {r['log_mel_live_vs_offline']:.3f}, official streaming "
              f"{'-' if streamed is None else f'{streamed:.3f}'}, offline with another seed "
              f"{r['log_mel_other_seed_vs_offline']:.3f}")
        secs = r["source_seconds"]
        if "live_s_recompute" in r:
            print(f"  cached flow window: log-mel distance to the recomputed window "
                  f"{r['log_mel_cached_vs_recompute']:.3f} (recomputed window to offline "
                  f"{r['log_mel_recompute_vs_offline']:.3f}); recomputed window {r['live_s_recompute']:.2f} s "
                  f"(RTF {r['live_s_recompute'] / secs:.2f})")
        if "live_s" in r:
            print(f"  conversion: live (cached window) {r['live_s']:.2f} s (RTF {r['live_s'] / secs:.2f}), offline "
                  f"(whole source) {r['offline_s']:.2f} s (RTF {r['offline_s'] / secs:.2f}): live / offline "
                  f"{r['live_s'] / r['offline_s']:.2f}x, for {secs:.2f} s of source")
        print(f"  seams: largest step {r['seam_click_max']:.2f}x the 99.9th percentile elsewhere (bar 1.5), RMS "
              f"{r['seam_level_min']:.2f}-{r['seam_level_max']:.2f}x around (bar 0.5-2)")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
