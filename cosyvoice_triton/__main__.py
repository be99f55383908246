"""Command line: ``python -m cosyvoice_triton {vc,demo-model,bench,bench-preprocess} ...`` (``cosyvoice-triton``)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from .errors import CosyVoiceError


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from .demo import write_demo_model

    out = write_demo_model(args.out, size=args.size, seed=args.seed)
    print(f"demo model ({args.size}, random weights) written to {out}")
    return 0


def _cmd_vc(args: argparse.Namespace) -> int:
    import soundfile as sf
    import torch

    from .pipeline import CosyVoice2, StageTimer

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = CosyVoice2.from_pretrained(args.model_dir, device=args.device)
    load_s = time.perf_counter() - t0
    timer = StageTimer()
    t0 = time.perf_counter()
    wave = model.convert(args.source, args.prompt, stream=args.stream, seed=args.seed, timer=timer)
    total = time.perf_counter() - t0
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    sr = model.config.sample_rate
    sf.write(out, wave, sr, subtype="PCM_16")
    seconds = len(wave) / sr
    print(f"wrote {out}: {seconds:.2f} s at {sr} Hz (model load {load_s:.2f} s)")
    print(f"conversion {total:.2f} s, real-time factor {total / max(seconds, 1e-9):.3f}")
    for name, s in timer.seconds.items():
        print(f"  {name:<18} {s * 1000:9.1f} ms")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_core_bench

    run_core_bench(args.model_dir, source=args.source, prompt=args.prompt, threads=args.threads,
                   repeats=args.repeats)
    return 0


def _cmd_bench_preprocess(args: argparse.Namespace) -> int:
    from .bench import run_preprocess_bench

    run_preprocess_bench(args.model_dir, source=args.source, prompt=args.prompt, repeats=args.repeats,
                         warmup=args.warmup, threads=args.threads)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cosyvoice-triton", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo-model", help="write a random-weight model folder in the official layout")
    d.add_argument("--out", required=True, help="folder to write")
    d.add_argument("--size", choices=("tiny", "full"), default="tiny", help="tiny dims or CosyVoice2-0.5B dims")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_cmd_demo_model)

    v = sub.add_parser("vc", help="in-process voice conversion (the official VC path)")
    v.add_argument("--model-dir", required=True, help="CosyVoice2 folder (real CosyVoice2-0.5B or a demo)")
    v.add_argument("--source", required=True, help="speech whose content is kept (wav/flac/ogg)")
    v.add_argument("--prompt", required=True, help="speech of the target voice (wav/flac/ogg)")
    v.add_argument("-o", "--output", required=True, help="output wav (24 kHz, 16-bit)")
    v.add_argument("--stream", action="store_true", help="official streaming schedule (chunked flow + HiFT)")
    v.add_argument("--seed", type=int, default=0, help="seed of HiFT's source noise")
    v.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    v.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    v.set_defaults(func=_cmd_vc)

    b = sub.add_parser("bench", help="per-stage timings, GFLOP/s against a GEMM ceiling, peak memory")
    b.add_argument("--model-dir", required=True)
    b.add_argument("--source", default=None, help="default: the bundled 5 s sample")
    b.add_argument("--prompt", default=None, help="default: the bundled 3 s sample")
    b.add_argument("--threads", type=int, default=0)
    b.add_argument("--repeats", type=int, default=2, help="timed runs after one warm-up")
    b.set_defaults(func=_cmd_bench)

    bp = sub.add_parser("bench-preprocess", help="cost of the preprocess stage's optional VAD trim and prompt denoise")
    bp.add_argument("--model-dir", default=None, help="whose mel settings (default: the release's)")
    bp.add_argument("--source", default=None, help="default: the bundled 5 s sample")
    bp.add_argument("--prompt", default=None, help="default: the bundled 3 s sample")
    bp.add_argument("--repeats", type=int, default=20, help="timed calls per variant after the warm-up")
    bp.add_argument("--warmup", type=int, default=2)
    bp.add_argument("--threads", type=int, default=1, help="torch intra-op threads (Silero VAD runs on them)")
    bp.set_defaults(func=_cmd_bench_preprocess)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except CosyVoiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
