"""The seed's GPU scenario without Triton: N concurrent voice conversions at full dims, batched against one at a
time, per precision (``loadtest/gpu.sh``; ``DRY_RUN=1`` runs it tiny on the CPU).

    python -m cosyvoice_triton.bench.gpu [--size full] [--requests 10] [--seconds 5] [--precisions fp32,bf16,fp16]

Needs only torch (a CUDA build on the GPU machine), numpy and PyYAML (imported by ``cosyvoice_triton.config``;
``loadtest/gpu.sh`` installs it from carried wheels when missing): no model folder, no download, no Triton. The
flow and HiFT are built at the CosyVoice2-0.5B dims with random weights (the cost of a call does not depend on the
weights' values); each request is ``--seconds`` of source speech tokens against a ``--prompt-seconds`` prompt
(tokens, mel, speaker embedding), all drawn at random with a fixed seed.

Per precision (``fp32``; ``bf16`` / ``fp16``: ``torch.autocast`` over the whole token-to-waveform path, the
attention mask bias finite for fp16):

* ``sequential``: the requests one after the other (flow encoder, 10 Euler steps of the estimator with its CFG
  batch of 2, HiFT), as a server without batching serves N concurrent users: request i waits for the i-1 before
  it, so its latency is its completion time;
* ``batched``: the N requests as one batch through the same modules (the flow encoder on B=N, the estimator on
  2N rows per step, HiFT on N equal-length items), as the dynamic batcher would merge them.

Reported: mean / p50 / max latency, throughput (requests/s and audio seconds per second), peak GPU memory
(``torch.cuda.max_memory_allocated``), and the output's error against fp32 one at a time (mel rel RMS, waveform
rel RMS; the fp32 batched row shows that batching leaves the output as it was).
Every scenario is warmed up once.

Then streaming text-to-speech (:mod:`.gpu_tts`): the CosyVoice2 LM joins the flow and HiFT on the device, and
``--tts-concurrency`` requests at once (1, 4 and 10 by default) per ``--tts-precisions`` (fp32, bf16) report the
first audio chunk's latency (p50 / max), its breakdown (prefill, first hop's tokens, flow, HiFT), total time, RTF
and peak GPU memory. The LM needs transformers (4.5x or 5.x); when it cannot run, the report says why and the
voice-conversion figures stand.

Time: the voice-conversion part stops starting scenarios past ``--vc-time-limit-s``, the TTS part past
``--time-limit-s`` (both from the start; skipped scenarios are named in the report). ``--parts`` picks the
parts. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
TOKEN_RATE = 25


def build_models(size: str, device: torch.device, seed: int = 0):
    from ..config import ModelConfig
    from ..models.flow import CausalMaskedDiffWithXvec
    from ..models.hift import HiFTGenerator

    config = {"full": ModelConfig.full, "tiny": ModelConfig.tiny}[size]()
    torch.manual_seed(seed)
    flow = CausalMaskedDiffWithXvec(config.flow).eval()
    hift = HiFTGenerator(config.hift).eval()
    with torch.no_grad():  # random weights of a sensible scale (the default init of some layers is zero)
        for p in list(flow.parameters()) + list(hift.parameters()):
            if p.dim() > 1:
                p.copy_(torch.randn_like(p) / max(1.0, p[0].numel()) ** 0.5)
    hift.fold_weight_norm()
    return config, flow.to(device), hift.to(device)


def make_requests(n: int, seconds: float, prompt_seconds: float, config, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    vocab = config.flow.vocab_size
    ts, tp = round(seconds * TOKEN_RATE), round(prompt_seconds * TOKEN_RATE)
    return [{"tokens": torch.randint(0, vocab, (ts,), generator=g, dtype=torch.int32),
             "prompt_tokens": torch.randint(0, vocab, (tp,), generator=g, dtype=torch.int32),
             "prompt_mel": torch.randn(tp * config.token_mel_ratio, 80, generator=g) * 2 - 5,
             "embedding": torch.randn(192, generator=g)} for _ in range(n)]


def token2wav(flow, hift, reqs: list[dict], device: torch.device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests (equal lengths) as one batch: (mel [B, 80, T], waveform [B, 480 T]), float32."""
    stack = {k: torch.stack([r[k] for r in reqs]).to(device) for k in reqs[0]}
    autocast = (torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None
                else contextlib.nullcontext())
    with torch.inference_mode(), autocast:
        c = flow.condition(stack["tokens"], stack["prompt_tokens"], stack["prompt_mel"], stack["embedding"],
                           streaming=False, finalize=True)
        mel = flow.decoder(c.mu, c.mask, c.spks, c.cond, streaming=False)
        mel, _ = c.crop(mel)
        mel = mel.float()
        gen = torch.Generator(device=device).manual_seed(0)
        wave, _ = hift.inference(mel, generator=gen)
    return mel, wave.float()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_scenario(flow, hift, reqs, device, dtype, mode: str) -> dict:
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    latencies, mels, waves = [], [], []
    if mode == "batched":
        mel, wave = token2wav(flow, hift, reqs, device, dtype)
        _sync(device)
        latencies = [time.perf_counter() - t0] * len(reqs)
        mels, waves = list(mel), list(wave)
    else:
        for r in reqs:
            mel, wave = token2wav(flow, hift, [r], device, dtype)
            _sync(device)
            latencies.append(time.perf_counter() - t0)
            mels.append(mel[0])
            waves.append(wave[0])
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {"wall_s": wall, "latencies_s": latencies, "peak_gpu_mb": peak,
            "mel": torch.stack(mels).cpu(), "wave": torch.stack(waves).cpu()}


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(torch.sqrt(torch.mean((a - b) ** 2)) / torch.sqrt(torch.mean(b**2)).clamp(min=1e-30))


def run_gpu_bench(*, size: str = "full", device: str = "cuda", requests: int = 10, seconds: float = 5.0,
                  prompt_seconds: float = 3.0, precisions: tuple[str, ...] = ("fp32", "bf16", "fp16"),
                  time_limit_s: float = 450.0, vc_time_limit_s: float | None = None,
                  parts: tuple[str, ...] = ("vc", "tts"), tts_precisions: tuple[str, ...] = ("fp32", "bf16"),
                  tts_concurrency: tuple[int, ...] = (1, 4, 10), tts_seconds: float = 5.0,
                  out_dir: str | Path = "build/loadtest/gpu-bench") -> dict:
    start = time.perf_counter()
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"bench-gpu: torch {torch.__version__} sees no CUDA device (use --device cpu for a dry run)")
    unknown = [p for p in (*precisions, *tts_precisions) if p not in PRECISIONS]
    if unknown:
        raise SystemExit(f"bench-gpu: unknown precision(s) {unknown}; known: {', '.join(PRECISIONS)}")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    print(f"bench-gpu: {size} dims on {name} (torch {torch.__version__}, numpy {np.__version__}); {requests} "
          f"requests of {seconds:g} s against a {prompt_seconds:g} s prompt", flush=True)
    config, flow, hift = build_models(size, dev)
    reqs = make_requests(requests, seconds, prompt_seconds, config)
    audio_s = requests * seconds
    vc_limit = time_limit_s if vc_time_limit_s is None else min(vc_time_limit_s, time_limit_s)
    rows, skipped, reference = [], [], None
    for prec in precisions if "vc" in parts else ():
        dtype = PRECISIONS[prec]
        flow.decoder.estimator.mask_bias = -1e4 if prec == "fp16" else -1e10  # -1e10 is -inf in fp16
        for mode in ("sequential", "batched"):
            elapsed = time.perf_counter() - start
            if rows and elapsed + 2.5 * max(r["wall_s"] for r in rows) > vc_limit:
                skipped.append(f"{prec} {mode}: not started at {elapsed:.0f} s (time limit {vc_limit:g} s)")
                print(f"  skipped {prec} {mode} (time limit)", flush=True)
                continue
            run_scenario(flow, hift, reqs if mode == "batched" else reqs[:1], dev, dtype, mode)  # warm-up (same shapes)
            r = run_scenario(flow, hift, reqs, dev, dtype, mode)
            lat = r["latencies_s"]
            row = {"precision": prec, "mode": mode, "wall_s": r["wall_s"], "mean_latency_s": statistics.mean(lat),
                   "p50_latency_s": statistics.median(lat), "max_latency_s": max(lat),
                   "requests_per_s": requests / r["wall_s"], "audio_s_per_s": audio_s / r["wall_s"],
                   "peak_gpu_mb": r["peak_gpu_mb"]}
            if prec == "fp32" and mode == "sequential":
                reference = r  # every row's error is against fp32 one at a time (batching must not change it)
            else:
                if reference is not None:
                    row["mel_rel_rms_vs_fp32"] = _rel_rms(r["mel"], reference["mel"])
                    row["wave_rel_rms_vs_fp32"] = _rel_rms(r["wave"], reference["wave"])
            rows.append(row)
            print(f"  {prec:<5} {mode:<10} wall {r['wall_s']:.2f} s, mean latency {row['mean_latency_s']:.2f} s, "
                  f"{row['requests_per_s']:.2f} req/s" + (f", peak {r['peak_gpu_mb']:.0f} MiB" if r["peak_gpu_mb"]
                                                          else ""), flush=True)
    result = {"device": name, "torch": torch.__version__, "numpy": np.__version__, "python": sys.version.split()[0],
              "size": size, "requests": requests, "seconds": seconds, "prompt_seconds": prompt_seconds,
              "rows": rows, "skipped": skipped, "total_s": time.perf_counter() - start}
    out = Path(out_dir)
    _write(result, out)  # the voice-conversion figures stand whatever happens to the TTS part
    if "tts" in parts:
        result["tts"] = _tts_part(size=size, device=dev, flow=flow, hift=hift, config=config,
                                  precisions=tts_precisions, concurrency=tts_concurrency, seconds=tts_seconds,
                                  prompt_seconds=prompt_seconds, deadline=start + time_limit_s)
        result["total_s"] = time.perf_counter() - start
        _write(result, out)
    print(format_report(result))
    print(f"written: {out / 'result.json'}, {out / 'report.md'}")
    return result


def _tts_part(**kw) -> dict:
    print(f"bench-gpu: streaming TTS, concurrency {', '.join(map(str, kw['concurrency']))}, "
          f"{', '.join(kw['precisions'])}", flush=True)
    try:
        from .gpu_tts import run_tts_bench

        return run_tts_bench(**kw, dtypes=PRECISIONS)
    except Exception as exc:  # e.g. a transformers the LM cannot use: reported, the VC part stays
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": kw["seconds"]}


def _write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(format_report(result))


def format_report(result: dict) -> str:
    lines = [f"# {result['requests']} concurrent {result['seconds']:g} s voice conversions, {result['size']} dims",
             "", f"{result['device']}, torch {result['torch']}, numpy {result['numpy']}, Python {result['python']}; "
             f"{result['total_s']:.0f} s in all", "",
             "| precision | mode | wall s | mean / p50 / max latency s | req/s | audio s/s | peak GPU MiB | "
             "mel / wave rel RMS vs fp32 sequential |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    seq = {r["precision"]: r for r in result["rows"] if r["mode"] == "sequential"}
    for r in result["rows"]:
        peak = f"{r['peak_gpu_mb']:.0f}" if r["peak_gpu_mb"] else "-"
        err = (f"{r['mel_rel_rms_vs_fp32']:.1e} / {r['wave_rel_rms_vs_fp32']:.1e}"
               if "mel_rel_rms_vs_fp32" in r else "-")
        gain = ""
        if r["mode"] == "batched" and r["precision"] in seq:
            gain = f" ({r['requests_per_s'] / seq[r['precision']]['requests_per_s']:.1f}x)"
        lines.append(f"| {r['precision']} | {r['mode']} | {r['wall_s']:.2f} | {r['mean_latency_s']:.2f} / "
                     f"{r['p50_latency_s']:.2f} / {r['max_latency_s']:.2f} | {r['requests_per_s']:.2f}{gain} | "
                     f"{r['audio_s_per_s']:.1f} | {peak} | {err} |")
    lines += [f"- skipped: {s}" for s in result["skipped"]]
    if "tts" in result:
        from .gpu_tts import format_tts

        lines += format_tts(result["tts"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyvoice_triton.bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--prompt-seconds", type=float, default=3.0)
    p.add_argument("--precisions", default="fp32,bf16,fp16")
    p.add_argument("--time-limit-s", type=float, default=450.0)
    p.add_argument("--vc-time-limit-s", type=float, default=None, help="default: 45%% of --time-limit-s")
    p.add_argument("--parts", default="vc,tts")
    p.add_argument("--tts-precisions", default="fp32,bf16")
    p.add_argument("--tts-concurrency", default="1,4,10")
    p.add_argument("--tts-seconds", type=float, default=5.0)
    p.add_argument("--out-dir", default="build/loadtest/gpu-bench")
    ns = p.parse_args(argv)
    if ns.requests < 1 or ns.seconds <= 0 or ns.prompt_seconds <= 0 or ns.tts_seconds <= 0:
        p.error("--requests >= 1, --seconds, --prompt-seconds and --tts-seconds > 0")
    parts = tuple(x for x in ns.parts.split(",") if x)
    if not parts or set(parts) - {"vc", "tts"}:
        p.error("--parts: vc, tts or both (comma-separated)")
    try:
        concurrency = tuple(int(x) for x in ns.tts_concurrency.split(",") if x)
    except ValueError:
        concurrency = ()
    if not concurrency or min(concurrency) < 1:
        p.error("--tts-concurrency: comma-separated integers >= 1")
    run_gpu_bench(size=ns.size, device=ns.device, requests=ns.requests, seconds=ns.seconds,
                  prompt_seconds=ns.prompt_seconds, precisions=tuple(x for x in ns.precisions.split(",") if x),
                  time_limit_s=ns.time_limit_s,
                  vc_time_limit_s=0.45 * ns.time_limit_s if ns.vc_time_limit_s is None else ns.vc_time_limit_s,
                  parts=parts, tts_precisions=tuple(x for x in ns.tts_precisions.split(",") if x),
                  tts_concurrency=concurrency, tts_seconds=ns.tts_seconds, out_dir=ns.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
