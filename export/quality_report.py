#!/usr/bin/env python3
"""Quality and CPU speed of every precision of the served graphs against the fp32 pipeline, on held-out speech.

    python export/quality_report.py --model-dir models/cosyvoice2-demo-tiny --onnx-root build/onnx --heldout 4 \\
        [--precisions fp32,fp16,int8,int8_cpu] [--stages flow_estimator,hift_decoder] [--threads 2]

For each precision found under ONNX_ROOT (fp32 ONNX as the sanity row, fp16, int8 Q/DQ, int8_cpu) the
token -> mel -> waveform path runs with the ONNX stages swapped in (hift_source stays fp32) on held-out pairs
with the pipeline's seeded noise, and per-stage onnxruntime CPU times are measured. The report states the bar,
applies the rule (a reduced precision serves a stage on the CPU only when >= 1.25x faster and within the bar)
and prints, per stage, the chosen CPU precision and why. Markdown goes to stdout and OUT/report.md, figures to
OUT/report.json. The work is done by cosyvoice_triton.export.quality. Exit status: 0 ok, 1 failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

try:
    from cosyvoice_triton.export.quality import STAGES
    from cosyvoice_triton.export.quantize import PRECISIONS
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cosyvoice_triton.export.quality import STAGES
    from cosyvoice_triton.export.quantize import PRECISIONS

log = logging.getLogger("quality_report")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="quality_report.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"precisions: {', '.join(PRECISIONS)}; stages: {', '.join(STAGES)}\n"
               "exit status: 0 ok, 1 failed, 2 bad arguments or input")
    p.add_argument("--model-dir", required=True, type=Path, help="CosyVoice2 model folder (the fp32 reference)")
    p.add_argument("--onnx-root", type=Path, default=Path("build/onnx"),
                   help="root of the precision folders (default build/onnx)")
    p.add_argument("--fp32-dir", type=Path, default=None, help="fp32 graphs (default ONNX_ROOT/fp32)")
    p.add_argument("--heldout", type=int, default=4, help="held-out VC pairs (default 4)")
    p.add_argument("--precisions", default=None,
                   help="comma-separated subset (default: every precision with files under ONNX_ROOT)")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of the stages (default all)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch and onnxruntime intra-op threads (default 0: their defaults)")
    p.add_argument("--timing-runs", type=int, default=5, help="timed runs per stage and precision (default 5)")
    p.add_argument("--estimator-frames", type=int, default=400, help="estimator timing length, B=2 (default 400)")
    p.add_argument("--hift-frames", type=int, default=250, help="HiFT timing length in mel frames (default 250 = 5 s)")
    p.add_argument("--encoder-tokens", type=int, default=250, help="flow encoder timing length (default 250)")
    p.add_argument("--max-seconds", type=float, default=8.0, help="longest held-out utterance (default 8 s)")
    p.add_argument("--out", type=Path, default=Path("build/quality"), help="report folder (default build/quality)")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings only, then the report")
    return p


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()]


def validate(args: argparse.Namespace) -> str | None:
    """A message for the first invalid argument, else None."""
    if not args.model_dir.is_dir():
        return f"--model-dir {args.model_dir}: model folder not found"
    if not args.onnx_root.is_dir():
        return f"--onnx-root {args.onnx_root}: not a folder (export and quantize first)"
    precs = _names(args.precisions)
    if precs is not None:
        bad = [x for x in precs if x not in PRECISIONS]
        if bad or not precs:
            return (f"--precisions: unknown {', '.join(bad) or repr(args.precisions)}; "
                    f"choose from {', '.join(PRECISIONS)}")
        absent = [x for x in precs if x != "fp32" and not (args.onnx_root / x).is_dir()]
        if absent:
            folders = ", ".join(str(args.onnx_root / x) for x in absent)
            return f"--precisions: no folder {folders} (run export/quantize.py)"
    stages = _names(args.stages)
    bad = [x for x in stages if x not in STAGES]
    if bad or not stages:
        return f"--stages: unknown {', '.join(bad) or repr(args.stages)}; choose from {', '.join(STAGES)}"
    fp32 = args.fp32_dir or args.onnx_root / "fp32"
    missing = [g for g in (*stages, "hift_source") if not (fp32 / f"{g}.onnx").is_file()]
    if missing:
        return f"{fp32}: missing {', '.join(g + '.onnx' for g in missing)} (run export/export_onnx.py)"
    for name in ("heldout", "timing_runs", "estimator_frames", "hift_frames", "encoder_tokens"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.estimator_frames > 3000 or args.hift_frames > 1508 or args.encoder_tokens > 1500:
        return "timing lengths beyond the shape spec (estimator 3000 frames, HiFT 1508 frames, encoder 1500 tokens)"
    if not 1.0 <= args.max_seconds <= 30.0:
        return f"--max-seconds {args.max_seconds}: must be between 1 and 30"
    if args.threads < 0:
        return f"--threads {args.threads}: must be >= 0"
    if args.out.exists() and not args.out.is_dir():
        return f"--out {args.out}: exists and is not a folder"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = validate(args)
    if problem:
        print(f"quality_report.py: error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    logging.getLogger("cosyvoice_triton.models.checkpoint").setLevel(logging.WARNING)

    from cosyvoice_triton.errors import CosyVoiceError
    from cosyvoice_triton.export.quality import run_report

    try:
        report = run_report(args.model_dir, args.onnx_root, fp32_dir=args.fp32_dir, heldout=args.heldout,
                            precisions=_names(args.precisions), stages=_names(args.stages), threads=args.threads,
                            timing_runs=args.timing_runs, estimator_frames=args.estimator_frames,
                            hift_frames=args.hift_frames, encoder_tokens=args.encoder_tokens,
                            max_seconds=args.max_seconds, out_dir=args.out, progress=log.info)
    except (CosyVoiceError, FileNotFoundError, ValueError) as exc:
        print(f"quality_report.py: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # onnxruntime failures: report them plainly
        log.exception("quality report failed")
        print(f"quality_report.py: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(report.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
