"""``make bench-core``: where the time of one in-process VC utterance goes, on this machine; ``make
bench-preprocess``: what the optional clean-up of the ``preprocess`` stage (VAD trim, prompt denoise) costs.

Prints per-stage wall-clock times (median of the timed runs after one warm-up), the estimator's achieved
GFLOP/s next to a fp32 GEMM ceiling measured in the same process, the real-time factor and peak RSS.
Figures, not assertions: nothing here fails on a slow machine.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from ..frontend import audio
from ..pipeline import CosyVoice2, StageTimer
from ..resources import path as resource_path
from ..threads import configure

FIXTURES = resource_path("tests/fixtures")
STAGES = ("frontend", "tokenizer", "speaker_embedding", "flow.encoder", "flow.solver", "hift")


def gemm_ceiling(n: int = 2048, repeats: int = 5) -> float:
    """Best fp32 GFLOP/s of an n x n matmul with torch's current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def estimator_flops(model: CosyVoice2, mel_frames: int) -> int:
    """FLOPs of ONE estimator call on the CFG batch of 2 at ``mel_frames`` frames."""
    return estimator_call_flops(model.flow.decoder.estimator, mel_frames)


def estimator_call_flops(estimator: torch.nn.Module, mel_frames: int) -> int:
    """FLOPs of ONE call of a flow estimator (``x, mask, mu, t, spks, cond``: CosyVoice2's U-Net, CosyVoice3's DiT)
    on the CFG batch of 2 at ``mel_frames`` frames, counted by torch."""
    x = torch.randn(2, 80, mel_frames)
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        estimator(x, torch.ones(2, 1, mel_frames), x, torch.rand(2), torch.randn(2, 80), x)
    return counter.get_total_flops()


def _seconds(path: str | Path) -> float:
    y, sr = audio.decode_audio(path)
    return len(y) / sr


def run_core_bench(model_dir: str | Path, *, source: str | None = None, prompt: str | None = None,
                   threads: int = 0, repeats: int = 2, out_json: str | Path = "build/bench-core.json") -> dict:
    if repeats < 1:
        raise ValueError(f"bench: repeats must be at least 1 (timed runs after the warm-up), got {repeats}")
    configure(threads or None)
    source = source or str(FIXTURES / "source_en_5s.wav")
    prompt = prompt or str(FIXTURES / "prompt_en_3s.wav")
    print(f"bench-core: model {model_dir}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    t0 = time.perf_counter()
    model = CosyVoice2.from_pretrained(model_dir)
    load_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.flow.parameters()) + sum(p.numel() for p in model.hift.parameters())
    src_s, prm_s = _seconds(source), _seconds(prompt)
    print(f"  loaded in {load_s:.2f} s ({params / 1e6:.1f} M params in flow + HiFT); "
          f"source {src_s:.2f} s, prompt {prm_s:.2f} s")

    ceiling = gemm_ceiling()
    print(f"  fp32 GEMM ceiling (2048^3, this process): {ceiling:.1f} GFLOP/s")

    runs: list[dict[str, float]] = []
    totals: list[float] = []
    out_seconds = 0.0
    inputs = None
    for i in range(repeats + 1):
        timer = StageTimer()
        t0 = time.perf_counter()
        inputs = model.frontend_vc(source, prompt, timer=timer)
        wave = model.token2wav(inputs, seed=0, timer=timer)
        total = time.perf_counter() - t0
        out_seconds = len(wave) / model.config.sample_rate
        label = "warm-up" if i == 0 else f"run {i}"
        print(f"  {label}: {total:.2f} s")
        if i:
            runs.append(timer.seconds)
            totals.append(total)

    mel_frames = model.flow.token_mel_ratio * (len(inputs.prompt_tokens) + len(inputs.source_tokens))
    steps = model.flow.decoder.config.n_timesteps
    flops = estimator_flops(model, mel_frames) * steps
    stage_s = {name: statistics.median(r.get(name, 0.0) for r in runs) for name in STAGES}
    total_s = statistics.median(totals)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    print()
    print(f"  tokens: source {len(inputs.source_tokens)}, prompt {len(inputs.prompt_tokens)}; "
          f"mel frames through the flow: {mel_frames} (output {out_seconds:.2f} s)")
    print(f"  {'stage':<20}{'median ms':>12}{'share':>9}")
    for name in STAGES:
        print(f"  {name:<20}{stage_s[name] * 1000:>12.1f}{stage_s[name] / total_s:>9.1%}")
    print(f"  {'total':<20}{total_s * 1000:>12.1f}   RTF {total_s / out_seconds:.3f}")
    gflops = flops / 1e9 / stage_s["flow.solver"]
    print(f"  estimator: {flops / 1e9:.1f} GFLOP for {steps} steps (CFG batch 2) -> {gflops:.1f} GFLOP/s "
          f"= {gflops / ceiling:.0%} of the GEMM ceiling")
    print(f"  peak RSS: {peak_mb:.0f} MB")
    if model.tokenizer.standin or model.speaker.standin:
        print("  note: the tokenizer / CAM++ here are stand-ins; their times are not the real models' times")

    result = {
        "model_dir": str(model_dir), "threads": torch.get_num_threads(), "source_seconds": src_s,
        "prompt_seconds": prm_s, "mel_frames": mel_frames, "stage_seconds": stage_s, "total_seconds": total_s,
        "rtf": total_s / out_seconds, "estimator_gflop": flops / 1e9, "estimator_gflops_per_s": gflops,
        "gemm_ceiling_gflops_per_s": ceiling, "peak_rss_mb": peak_mb, "load_seconds": load_s,
        "standin_frontend_models": bool(model.tokenizer.standin or model.speaker.standin),
        "output_rms": float(np.sqrt(np.mean(wave.astype(np.float64) ** 2))),
    }
    out_json = Path(out_json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1))
    print(f"  written: {out_json}")
    return result


# ------------------------------------------------------------------------------------ bench-preprocess

#: The ``preprocess`` variants timed by :func:`run_preprocess_bench`: label -> (vad_trim, denoise_prompt).
PREPROCESS_VARIANTS = {"plain": (False, False), "+vad": (True, False), "+denoise": (False, True),
                       "+vad+denoise": (True, True)}


def run_preprocess_bench(model_dir: str | Path | None = None, *, source: str | None = None,
                         prompt: str | None = None, repeats: int = 20, warmup: int = 2, threads: int = 1,
                         out_json: str | Path | None = "build/bench-preprocess.json") -> dict:
    """Wall time of the served ``preprocess`` stage (:class:`~cosyvoice_triton.serving.stages.frontend.Preprocessor`,
    one request: validation, resampling, Whisper log-mel, fbank, prompt mel) per variant of the optional
    clean-up (``vad_trim``, ``denoise_prompt``), median of ``repeats`` calls after ``warmup`` calls (the
    variants interleaved), plus the samples Silero VAD trims from each end of source and prompt. ``model_dir``:
    whose mel settings (default: the release's, which every CosyVoice2 folder shares). Figures, not assertions."""
    from ..config import ModelConfig
    from ..serving.stages.enhance import VadTrimmer, spectral_gate
    from ..serving.stages.frontend import Preprocessor

    if repeats < 1 or warmup < 0:
        raise ValueError(f"bench-preprocess: need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    configure(threads or None)
    config = ModelConfig.from_yaml(Path(model_dir) / "cosyvoice2.yaml") if model_dir else ModelConfig.full()
    source = source or str(FIXTURES / "source_en_5s.wav")
    prompt = prompt or str(FIXTURES / "prompt_en_3s.wav")
    src, src_sr = audio.decode_audio(source)
    prm, prm_sr = audio.decode_audio(prompt)
    request = {"source_audio": np.asarray(src, np.float32)[None], "source_sample_rate": np.array([[src_sr]], np.int32),
               "prompt_audio": np.asarray(prm, np.float32)[None], "prompt_sample_rate": np.array([[prm_sr]], np.int32)}
    print(f"bench-preprocess: source {len(src) / src_sr:.2f} s at {src_sr} Hz, prompt {len(prm) / prm_sr:.2f} s at "
          f"{prm_sr} Hz; torch {torch.get_num_threads()} thread(s); median of {repeats} after {warmup} warm-up")

    def timed(fn) -> list[float]:
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return times

    pres = {label: Preprocessor(config.mel, sample_rate=config.sample_rate, vad_trim=vad, denoise_prompt=denoise)
            for label, (vad, denoise) in PREPROCESS_VARIANTS.items()}
    times: dict[str, list[float]] = {label: [] for label in pres}
    for i in range(warmup + repeats):  # interleaved, so that background load hits every variant alike
        for label, pre in pres.items():
            t0 = time.perf_counter()
            pre.one(**request)
            if i >= warmup:
                times[label].append(time.perf_counter() - t0)
    rows = {label: {"median_ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3} for label, t in times.items()}
    base = rows["plain"]["median_ms"]
    # the pieces on their own
    vad = VadTrimmer()
    parts = {"vad source": timed(lambda: vad.speech_span(src, src_sr)),
             "vad prompt": timed(lambda: vad.speech_span(prm, prm_sr)),
             "denoise prompt": timed(lambda: spectral_gate(prm, prm_sr))}
    part_ms = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
    trimmed = {}
    for name, y, sr in (("source", src, src_sr), ("prompt", prm, prm_sr)):
        span = vad.speech_span(y, sr)
        start, end = span if span is not None else (len(y), len(y))
        trimmed[name] = {"samples": len(y), "sample_rate": sr, "lead": int(start), "tail": int(len(y) - end),
                         "kept_seconds": (end - start) / sr}

    print(f"  {'variant':<14}{'median ms':>11}{'min ms':>9}{'extra ms':>10}")
    for label, r in rows.items():
        print(f"  {label:<14}{r['median_ms']:>11.1f}{r['min_ms']:>9.1f}{r['median_ms'] - base:>+10.1f}")
    print("  alone: " + ", ".join(f"{k} {v:.1f} ms" for k, v in part_ms.items()))
    for name, t in trimmed.items():
        print(f"  VAD trims {name}: {t['lead']} samples at the start, {t['tail']} at the end "
              f"({t['lead'] / t['sample_rate'] * 1e3:.0f} + {t['tail'] / t['sample_rate'] * 1e3:.0f} ms of "
              f"{t['samples'] / t['sample_rate']:.2f} s at {t['sample_rate']} Hz; {t['kept_seconds']:.2f} s kept)")
    result = {"source": str(source), "prompt": str(prompt), "threads": torch.get_num_threads(), "repeats": repeats,
              "warmup": warmup, "variants": rows, "parts_median_ms": part_ms, "vad_trimmed": trimmed}
    if out_json:
        out_json = Path(out_json)
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(result, indent=1))
        print(f"  written: {out_json}")
    return result
