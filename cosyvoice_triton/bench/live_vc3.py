"""``make bench-live-cv3``: what a live CosyVoice3 conversion costs per chunk as the stream grows, at full dims.

    python -m cosyvoice_triton.bench.live_vc3 --model-dir models/cosyvoice3-demo-full --seconds 20

The source (the bundled 5 s recording, repeated to ``--seconds``) goes through two paths of the same CosyVoice3
folder in process, on ``--threads`` torch threads, chunk by chunk (25 speech tokens, 1 s of audio):

* ``live``: :class:`~cosyvoice_triton.serving.stages.cosyvoice3_live_vc.Cv3LiveVC` (what ``cosyvoice3_vc_live``
  serves), fed 200 ms pieces as fast as it takes them: tokenizer windows, the sliding flow window
  (``flow_context_tokens``) and the bounded vocoder window. Its time per chunk should stay flat.
* ``recompute``: the official streaming token-to-wav (``Token2Wav3.token2wav_stream``: every token so far through
  the flow and every mel frame so far through the vocoder at each chunk) on the whole source's tokens at the same
  25-token chunks. Its time per chunk grows with the stream.

For each path: the time of each chunk's compute (the live one includes its tokenizer window), its real-time factor
(compute over the chunk's audio, below 1 keeps up), the first and the last chunks', and the process's peak RSS after
each path. Figures, not
assertions: nothing fails on a slow machine; the load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import numpy as np

from .. import resources
from . import load_average, write_result

ROOT = resources.checkout() or Path.cwd()
FIXTURES = resources.path("tests/fixtures")
DEFAULT_MODEL_DIR = ROOT / "models" / "cosyvoice3-demo-full"


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _figures(times: list[float], audio: list[float]) -> dict:
    rtf = [t / a for t, a in zip(times, audio, strict=True) if a > 0]
    return {"chunks": len(times), "first_s": times[0], "last_full_s": times[-2] if len(times) > 1 else times[0],
            "median_s": float(np.median(times)), "max_s": max(times), "total_s": sum(times),
            "audio_s": sum(audio), "rtf_total": sum(times) / max(sum(audio), 1e-9),
            "rtf_median": float(np.median(rtf)), "rtf_max": max(rtf), "times_s": times}


def live_path(service, source: np.ndarray, sr: int, prompt: np.ndarray, psr: int, *, piece_ms: float = 200.0,
              flow_context_tokens: int = 100) -> dict:
    """The live session's compute per chunk (time from the piece that completed the chunk to the chunk)."""
    from ..serving.stages.cosyvoice3_live_vc import Cv3LiveVC
    from ..serving.stages.live_vc import LiveSettings

    live = Cv3LiveVC(service, LiveSettings(flow_context_tokens=flow_context_tokens))
    first = {"source_sample_rate": np.array([[sr]], np.int32), "prompt_audio": prompt[None],
             "prompt_sample_rate": np.array([[psr]], np.int32)}
    session = live.open(first)
    n = max(1, int(sr * piece_ms / 1000))
    requests = [{"source_audio": source[None, i: i + n]} for i in range(0, len(source), n)] + [{}]  # {}: the END
    times, audio = [], []
    for k, tensors in enumerate(requests):
        t = time.perf_counter()
        for chunk in live.piece(session, tensors, first=k == 0, last=k == len(requests) - 1):
            times.append(time.perf_counter() - t)
            audio.append(len(chunk) / live.sample_rate)
            t = time.perf_counter()
    return _figures(times, audio)


def recompute_path(service, source: np.ndarray, sr: int, prompt: np.ndarray, psr: int) -> dict:
    """The official streaming token-to-wav on the whole source's tokens, 25-token chunks."""
    from ..streaming import StreamSchedule

    model = service.model
    inputs = model.frontend_vc(source, prompt, source_sr=sr, prompt_sr=psr)
    t2w = model.token2wav_model
    chunks = t2w.token2wav_stream(inputs.source_tokens.tolist(), inputs.prompt_tokens, inputs.prompt_mel,
                                  inputs.embedding, schedule=StreamSchedule(25, 1, 25))
    times, audio = [], []
    t = time.perf_counter()
    for chunk in chunks:
        times.append(time.perf_counter() - t)
        audio.append(len(chunk) / t2w.sample_rate)
        t = time.perf_counter()
    return _figures(times, audio)


def format_report(result: dict) -> str:
    meta = result["meta"]
    lines = [f"live CosyVoice3 voice conversion, {meta['seconds']:g} s source, 25-token chunks, {meta['threads']} "
             f"threads; commit {meta['commit']}; {meta['machine']}; load average at the end {meta['load_end']}", "",
             "| path | chunks | first chunk s | median chunk s | last whole chunk s | max chunk s | compute / audio "
             "(whole stream) | process peak RSS so far MB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, f in result["paths"].items():
        lines.append(f"| {name} | {f['chunks']} | {f['first_s']:.2f} | {f['median_s']:.2f} | {f['last_full_s']:.2f} "
                     f"| {f['max_s']:.2f} | {f['rtf_total']:.2f} | {f['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def run_bench(model_dir: str | Path = DEFAULT_MODEL_DIR, *, seconds: float = 20.0, threads: int = 2,
              paths: tuple[str, ...] = ("live", "recompute"), out_dir: str | Path = "build/bench-live-cv3") -> dict:
    import soundfile as sf
    import torch

    from ..loadtest.live import commit
    from ..loadtest.setup import machine
    from ..serving.stages.cosyvoice3 import Cv3Service

    torch.set_num_threads(threads)
    meta = {"commit": commit(), "machine": machine(), "threads": threads, "seconds": seconds,
            "model_dir": str(model_dir), "load_start": load_average()}
    print(f"bench-live-cv3: {model_dir}, {seconds:g} s source, {threads} threads; {meta['machine']}; load average "
          f"{meta['load_start']}", flush=True)
    src, sr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    source = np.tile(src, int(np.ceil(seconds * sr / len(src))))[: int(seconds * sr)]
    t = time.perf_counter()
    service = Cv3Service.load(model_dir, tts=False, torch_threads=threads, max_seconds=max(30.0, seconds + 1))
    print(f"  loaded in {time.perf_counter() - t:.1f} s", flush=True)
    live_path(service, source[: 2 * sr], sr, prm, psr)  # warm-up
    result = {"meta": meta, "paths": {}}
    for name in paths:
        run = live_path if name == "live" else recompute_path
        figures = run(service, source, sr, prm, psr)
        figures["peak_rss_mb"] = _peak_mb()
        result["paths"][name] = figures
        print(f"  {name}: {figures['chunks']} chunks, first {figures['first_s']:.2f} s, median "
              f"{figures['median_s']:.2f} s, last whole {figures['last_full_s']:.2f} s, compute / audio "
              f"{figures['rtf_total']:.2f}", flush=True)
    meta["load_end"] = load_average()
    write_result(out_dir, result, format_report(result))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cosyvoice-triton bench-live-cv3", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--seconds", type=float, default=20.0, help="source length (the bundled 5 s recording repeated)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--paths", default="live,recompute", help="comma-separated, of live, recompute")
    p.add_argument("--out-dir", default="build/bench-live-cv3")
    ns = p.parse_args(argv)
    paths = tuple(x for x in ns.paths.split(",") if x)
    unknown = sorted(set(paths) - {"live", "recompute"})
    if unknown or ns.seconds <= 0 or ns.threads < 1:
        p.error(f"paths of live, recompute (got {', '.join(unknown) or 'none unknown'}); seconds > 0; threads >= 1")
    run_bench(ns.model_dir, seconds=ns.seconds, threads=ns.threads, paths=paths, out_dir=ns.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
