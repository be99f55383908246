"""Streaming text-to-speech on the bench's device: how long until the first audio chunk, with N requests at once
(the TTS part of ``python -m cosyvoice_triton.bench.gpu``).

The LM (:class:`~cosyvoice_triton.models.llm.Qwen2LM`, the Qwen2 config CosyVoice2-0.5B ships, random weights
as transformers initialises them), the flow and HiFT all sit on the device. Each request is zero-shot: random
text, prompt-text and prompt-speech token ids fed straight to the LM (no text front end), a random prompt mel and
speaker embedding for the flow, and exactly ``seconds`` of speech tokens (end-of-speech is masked until then and
the length is capped there). Concurrency N: N requests submitted at once to one
:class:`~cosyvoice_triton.serving.stages.lm_engine.LMEngine` (their tokens are sampled in one batched decode step), each
request's tokens turned into audio by :meth:`CosyVoice2.tokens2wav_stream
<cosyvoice_triton.pipeline.CosyVoice2.tokens2wav_stream>` in its own thread (the official chunk schedule: the
first chunk after 25 tokens plus the padding to the prompt's 25-token grid and 3 look-ahead tokens; incremental
flow), as the in-process service runs them.

Per request: first-chunk latency (submit to first audio chunk), total time, real-time factor (total / audio
seconds), and the first chunk's breakdown: ``prefill`` (submit to first token: the prompt's prefill and one
sampling, the other requests' prefills included), ``first hop`` (first token to the last token the first chunk
needs), ``flow`` and ``HiFT`` (the first chunk's flow and HiFT calls; on CUDA each stage is timed between device
synchronisations, so with N > 1 a stage also waits for the other requests' queued GPU work). Peak GPU memory:
``torch.cuda.max_memory_allocated`` over the scenario, the weights included. ``bf16``: the LM's weights cast to
bfloat16, the flow and HiFT under ``torch.autocast`` as in the voice-conversion part. Each precision is warmed up
by one request first.

Nothing of the audio front end runs: the packages only it uses (librosa, soundfile, soxr, kaldi-native-fbank)
may be absent on a bare GPU machine, and then placeholders that raise when used stand in for them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TOKEN_RATE = 25
TEXT_TOKENS, PROMPT_TEXT_TOKENS = 30, 20  # a typical zero-shot request
FRONTEND_PACKAGES = ("librosa", "soundfile", "soxr", "kaldi_native_fbank")


class _Absent(types.ModuleType):
    """An audio front-end package that is not installed (the bench never calls the front end)."""

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise ImportError(f"{self.__name__} is not installed (only the audio front end uses it)")


def _pipeline():
    for name in FRONTEND_PACKAGES:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = _Absent(name)
    from .. import pipeline

    return pipeline


@dataclass
class _NoGraph:
    """Where the speech tokenizer / CAM++ would be: tokens and prompt features are fed directly."""

    path: Path


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_tts(size: str, device: torch.device, flow, hift, config, work_dir: Path, seed: int = 0):
    """The LM at ``size`` on ``device`` and a :class:`~cosyvoice_triton.pipeline.CosyVoice2` around it and the
    given flow and HiFT."""
    from ..config import LLMConfig
    from ..models.llm import QWEN_DIR, Qwen2LM, write_qwen_config

    pipeline = _pipeline()
    qwen = write_qwen_config(work_dir / QWEN_DIR, size)
    torch.manual_seed(seed)
    with torch.device(device):
        lm = Qwen2LM.from_config(LLMConfig.full() if size == "full" else LLMConfig.tiny(), qwen).eval()
    stand_in = _NoGraph(qwen)
    model = pipeline.CosyVoice2(config, flow, hift, stand_in, stand_in, device=device, llm=lm, prompt_cache=None)
    return model, lm


def make_tts_requests(n: int, seconds: float, prompt_seconds: float, lm, config, seed: int = 2) -> list[dict]:
    from ..models.llm import LMRequest

    pipeline = _pipeline()
    g = torch.Generator().manual_seed(seed)
    n_tokens, n_prompt = round(seconds * TOKEN_RATE), round(prompt_seconds * TOKEN_RATE)
    ratio = (n_tokens + 0.5) / TEXT_TOKENS  # min_len = max_len = n_tokens
    out = []
    for _ in range(n):
        prompt_speech = torch.randint(0, lm.speech_token_size, (n_prompt,), generator=g, dtype=torch.int32)
        lm_request = LMRequest(torch.randint(0, lm.text_vocab_size, (TEXT_TOKENS,), generator=g),
                               torch.randint(0, lm.text_vocab_size, (PROMPT_TEXT_TOKENS,), generator=g),
                               prompt_speech, min_token_text_ratio=ratio, max_token_text_ratio=ratio)
        mel = (torch.randn(n_prompt * config.token_mel_ratio, 80, generator=g) * 2 - 5).numpy()
        inputs = pipeline.VCInputs(np.zeros(0, np.int32), prompt_speech.numpy(), mel,
                                   torch.randn(192, generator=g).numpy())
        out.append({"lm": lm_request, "flow": inputs, "n_tokens": n_tokens})
    return out


def run_tts_scenario(model, lm, reqs: list[dict], device: torch.device, dtype, deadline: float) -> dict:
    """The requests at once (one LM engine, a token-to-wav thread each); per-request timings. A run still going at
    ``deadline`` (time.perf_counter) is cancelled and raises TimeoutError."""
    from ..models.llm import LMRequest
    from ..serving.stages.lm_engine import LMEngine

    pipeline = _pipeline()

    class DeviceTimer(pipeline.StageTimer):
        @contextlib.contextmanager
        def stage(self, name):
            _sync(device)
            with super().stage(name):
                yield
                _sync(device)

    n = len(reqs)
    lookahead = model.flow.pre_lookahead_len
    first_needs = model.stream_schedule.first_chunk(len(reqs[0]["flow"].prompt_tokens)) + lookahead
    out: list[dict | BaseException | None] = [None] * n
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = LMEngine(lm, max_active=n, max_waiting=n, name="bench-lm")
    try:
        t0 = time.perf_counter()
        jobs = []
        for i, r in enumerate(reqs):
            req = r["lm"]
            jobs.append(engine.submit(LMRequest(req.text_tokens, req.prompt_text_tokens, req.prompt_speech_tokens,
                                                draws=torch.Generator().manual_seed(i),
                                                min_token_text_ratio=req.min_token_text_ratio,
                                                max_token_text_ratio=req.max_token_text_ratio)))

        def consume(i: int) -> None:
            try:
                timer, arrivals, samples, first = DeviceTimer(), [], 0, None

                def tokens():
                    for token in jobs[i].tokens():
                        arrivals.append(time.perf_counter())
                        yield token

                autocast = (torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None
                            else contextlib.nullcontext())
                with autocast:
                    for chunk in model.tokens2wav_stream(reqs[i]["flow"], tokens(), seed=i, timer=timer):
                        if first is None:
                            first, stages = time.perf_counter(), dict(timer.seconds)
                        samples += len(chunk)
                end = time.perf_counter()
                flow_s = sum(v for k, v in stages.items() if k.startswith("flow"))
                needed = min(first_needs, len(arrivals))  # a stream shorter than the first hop has one chunk
                out[i] = {"first_chunk_s": first - t0, "total_s": end - t0,
                          "audio_s": samples / model.config.sample_rate, "first_chunk_tokens": needed,
                          "prefill_s": arrivals[0] - t0, "first_hop_s": arrivals[needed - 1] - arrivals[0],
                          "flow_s": flow_s, "hift_s": stages.get("hift", 0.0), "tokens": len(arrivals)}
            except BaseException as exc:  # reported by the main thread
                out[i] = exc

        threads = [threading.Thread(target=consume, args=(i,), name=f"bench-t2w-{i}", daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.perf_counter()))
        if any(t.is_alive() for t in threads):
            for job in jobs:
                job.cancel()
            for t in threads:
                t.join(30)
            raise TimeoutError("still running at the time limit (cancelled)")
        wall = time.perf_counter() - t0
        stats = engine.snapshot()
    finally:
        engine.close()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {"wall_s": wall, "requests": out, "peak_gpu_mb": peak, "lm_max_batch": stats["max_batch"]}


def _row(prec: str, n: int, r: dict) -> dict:
    reqs = r["requests"]

    def p50(key: str) -> float:
        return statistics.median(x[key] for x in reqs)

    first = [x["first_chunk_s"] for x in reqs]
    return {"precision": prec, "concurrency": n, "lm_max_batch": r["lm_max_batch"],
            "first_chunk_tokens": max(x["first_chunk_tokens"] for x in reqs),
            "first_chunk_p50_s": statistics.median(first),
            "first_chunk_max_s": max(first), "prefill_p50_s": p50("prefill_s"), "first_hop_p50_s": p50("first_hop_s"),
            "flow_p50_s": p50("flow_s"), "hift_p50_s": p50("hift_s"), "total_p50_s": p50("total_s"),
            "total_max_s": max(x["total_s"] for x in reqs), "audio_s": p50("audio_s"),
            "rtf_p50": statistics.median(x["total_s"] / x["audio_s"] for x in reqs), "tokens": p50("tokens"),
            "wall_s": r["wall_s"], "peak_gpu_mb": r["peak_gpu_mb"]}


def run_tts_bench(*, size: str, device: torch.device, flow, hift, config, precisions: tuple[str, ...],
                  concurrency: tuple[int, ...], seconds: float, prompt_seconds: float, deadline: float,
                  dtypes: dict) -> dict:
    """Every (precision, concurrency) scenario that fits before ``deadline`` (time.perf_counter)."""
    start = time.perf_counter()
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-tts-") as work:
        model, lm = build_tts(size, device, flow, hift, config, Path(work))
        params = sum(p.numel() for p in lm.parameters()) / 1e6
        print(f"  TTS: LM built in {time.perf_counter() - start:.1f} s ({params:.0f} M parameters)", flush=True)
        reqs = make_tts_requests(max(concurrency), seconds, prompt_seconds, lm, config)
        last = None  # (concurrency, wall_s) of the last scenario run
        for prec in precisions:
            dtype = dtypes[prec]
            if dtype is not None:
                lm.to(dtype)
            for n in ("warm-up", *concurrency):
                k = 1 if n == "warm-up" else n
                now = time.perf_counter()
                guess = 0.0 if last is None else last[1] * max(1.0, k / last[0])
                if now + guess > deadline:
                    skipped.append(f"TTS {prec} concurrency {n}: not started at {now - start:.0f} s into the TTS part "
                                   f"(its time limit is {deadline - start:.0f} s)")
                    print(f"  skipped TTS {prec} {n} (time limit)", flush=True)
                    continue
                try:
                    r = run_tts_scenario(model, lm, reqs[:k], device, dtype, deadline)
                except TimeoutError as exc:
                    skipped.append(f"TTS {prec} concurrency {n}: {exc}")
                    print(f"  TTS {prec} {n}: {exc}", flush=True)
                    break
                last = (k, r["wall_s"])
                if n == "warm-up":
                    print(f"  TTS {prec:<5} warm-up {r['wall_s']:.2f} s", flush=True)
                    continue
                row = _row(prec, n, r)
                rows.append(row)
                print(f"  TTS {prec:<5} x{n:<3} first chunk p50 {row['first_chunk_p50_s'] * 1e3:.0f} ms / max "
                      f"{row['first_chunk_max_s'] * 1e3:.0f} ms, total p50 {row['total_p50_s']:.2f} s, RTF "
                      f"{row['rtf_p50']:.2f}" + (f", peak {row['peak_gpu_mb']:.0f} MiB" if row["peak_gpu_mb"] else ""),
                      flush=True)
        del model, lm
    return {"rows": rows, "skipped": skipped, "seconds": seconds, "prompt_seconds": prompt_seconds,
            "text_tokens": TEXT_TOKENS, "prompt_text_tokens": PROMPT_TEXT_TOKENS,
            "total_s": time.perf_counter() - start}


def format_tts(tts: dict) -> list[str]:
    """The report's TTS section (markdown lines)."""
    lines = ["", f"## Streaming TTS: first chunk, {tts.get('seconds', 0):g} s of speech per request", ""]
    if "error" in tts:
        return [*lines, f"Not run: {tts['error']}"]
    lines += [f"Zero-shot, {tts['text_tokens']} text tokens, a {tts['prompt_text_tokens']}-token prompt text and "
              f"{tts['prompt_seconds']:g} s of prompt speech; N requests decoded together by one LM engine, each "
              "turned into audio in its own thread. Breakdown: p50 over the requests of the first chunk's parts. "
              f"{tts['total_s']:.0f} s in all.", "",
              "| precision | concurrency | LM batch | first chunk p50 / max ms | prefill / first hop / flow / HiFT ms "
              "| total p50 / max s | RTF p50 | peak GPU MiB |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in tts["rows"]:
        peak = f"{r['peak_gpu_mb']:.0f}" if r["peak_gpu_mb"] else "-"
        lines.append(
            f"| {r['precision']} | {r['concurrency']} | {r['lm_max_batch']} | {r['first_chunk_p50_s'] * 1e3:.0f} / "
            f"{r['first_chunk_max_s'] * 1e3:.0f} | {r['prefill_p50_s'] * 1e3:.0f} / {r['first_hop_p50_s'] * 1e3:.0f} "
            f"({r['first_chunk_tokens']} tokens) / {r['flow_p50_s'] * 1e3:.0f} / {r['hift_p50_s'] * 1e3:.0f} | "
            f"{r['total_p50_s']:.2f} / {r['total_max_s']:.2f} | {r['rtf_p50']:.2f} | {peak} |")
    lines += [f"- skipped: {s}" for s in tts["skipped"]]
    return lines
