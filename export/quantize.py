#!/usr/bin/env python3
"""Reduced-precision graphs from the fp32 export: INT8 Q/DQ (TensorRT), INT8 for onnxruntime CPU, fp16.

    python export/quantize.py --model-dir models/cosyvoice2-demo-tiny --onnx-root build/onnx \\
        [--precisions int8,int8_cpu,fp16] [--graphs flow_estimator,hift_decoder] \\
        [--calibration-utterances 50] [--calibration-method auto] [--sensitivity]
    python export/quantize.py --model-dir models/cosyvoice3-demo-tiny --onnx-root build/onnx3

A CosyVoice3 folder (its cosyvoice3.yaml) gets its vocoder graph in onnxruntime's CPU INT8: ONNX_ROOT is its
export (export-onnx --out ONNX_ROOT), ONNX_ROOT/int8_cpu/hift3_decoder.onnx is written with a manifest recording its
held-out quality and speed against the bar (cosyvoice_triton.export.quantize3).

Reads ONNX_ROOT/fp32/<graph>.onnx (or --fp32-dir) and writes ONNX_ROOT/{int8,int8_cpu,fp16}/<graph>.onnx with a
manifest.json each. INT8 is calibrated on activations of the real pipeline run over espeak-ng speech
(split "calibration"; inputs cached in --cache-dir); the calibration method is chosen per graph by the error
on held-out speech (split "heldout"). Layers kept in float and why: cosyvoice_triton.export.quantize.INT8_KEEP_FLOAT /
FP16_KEEP_FLOAT, printed at the end. The work is done by cosyvoice_triton.export.quantize; this script parses,
validates, logs and reports. Exit status: 0 ok, 1 failed, 2 bad arguments or input.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

try:
    from cosyvoice_triton.export.quantize import CALIBRATION_METHODS, FP32_ONLY, QUANTIZED_GRAPHS
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cosyvoice_triton.export.quantize import CALIBRATION_METHODS, FP32_ONLY, QUANTIZED_GRAPHS

log = logging.getLogger("quantize")
PRECISION_CHOICES = ("int8", "int8_cpu", "fp16")
MIN_CALIBRATION = 50
#: A CosyVoice3 folder: its vocoder only, each pair a whole voice conversion at the folder's dims (about a minute
#: each at the release's on two cores)
CV3_CALIBRATION, CV3_HELDOUT = 8, 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="quantize.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"graphs: {', '.join(QUANTIZED_GRAPHS)} (fp32 only: {', '.join(FP32_ONLY)})\n"
               "exit status: 0 ok, 1 failed, 2 bad arguments or input")
    p.add_argument("--model-dir", required=True, type=Path,
                   help="the model folder the fp32 graphs came from (CosyVoice2, or CosyVoice3: its vocoder graph)")
    p.add_argument("--onnx-root", type=Path, default=Path("build/onnx"),
                   help="root of the precision folders (default build/onnx); a CosyVoice3 folder: its export")
    p.add_argument("--fp32-dir", type=Path, default=None, help="fp32 graphs (default ONNX_ROOT/fp32)")
    p.add_argument("--precisions", default=",".join(PRECISION_CHOICES),
                   help=f"comma-separated subset of {', '.join(PRECISION_CHOICES)} (default all)")
    p.add_argument("--graphs", default=",".join(QUANTIZED_GRAPHS), help="comma-separated subset (default all three)")
    p.add_argument("--calibration-utterances", type=int, default=None,
                   help=f"utterance pairs of the calibration split (default {MIN_CALIBRATION}, CosyVoice3 "
                        f"{CV3_CALIBRATION}; fewer is for quick trials and is flagged)")
    p.add_argument("--heldout-utterances", type=int, default=None,
                   help="held-out pairs used to choose the calibration method and check each graph (default 6, "
                        f"CosyVoice3 {CV3_HELDOUT})")
    p.add_argument("--calibration-method", default="auto", choices=("auto", "recorded", *CALIBRATION_METHODS),
                   help="auto (default): calibrate with each method on --method-samples calls, keep the lowest "
                        "held-out error per graph, then calibrate it on every call; recorded: the method auto chose "
                        "on the full-size graphs (cosyvoice_triton.export.quantize.DEFAULT_CALIBRATION)")
    p.add_argument("--method-samples", type=int, default=24,
                   help="captured calls per graph on which auto compares the methods (default 24; 0: all)")
    p.add_argument("--steps-per-utterance", type=int, default=3,
                   help="Euler steps whose estimator inputs are captured per pair, rotating over the 10 (default 3)")
    p.add_argument("--max-seconds", type=float, default=10.0, help="longest corpus utterance (default 10 s)")
    p.add_argument("--sensitivity", action="store_true",
                   help="also run the per-layer-group sensitivity pass for the int8 graphs and print its table")
    p.add_argument("--reduce-range", action=argparse.BooleanOptionalAction, default=None,
                   help="7-bit weights in int8_cpu (x86 CPUs without VNNI, where U8S8 products can saturate); "
                        "default: on where this machine's CPU has no VNNI")
    p.add_argument("--threads", type=int, default=0, help="torch and onnxruntime threads (default 0: their defaults)")
    p.add_argument("--cache-dir", type=Path, default=Path("build/quantize"),
                   help="captured calibration / held-out inputs and calibrated ranges (default build/quantize)")
    p.add_argument("--no-cache", action="store_true", help="recompute everything, write no cache")
    p.add_argument("--seed", type=int, default=0, help="corpus seed (default 0)")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings only, then the tables")
    return p


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def validate(args: argparse.Namespace) -> str | None:
    """A message for the first invalid argument, else None."""
    if not args.model_dir.is_dir():
        return f"--model-dir {args.model_dir}: model folder not found"
    precisions = _names(args.precisions)
    bad = [x for x in precisions if x not in PRECISION_CHOICES]
    if bad or not precisions:
        return (f"--precisions: unknown {', '.join(bad) or repr(args.precisions)}; "
                f"choose from {', '.join(PRECISION_CHOICES)}")
    graphs = _names(args.graphs)
    bad = [g for g in graphs if g not in QUANTIZED_GRAPHS]
    if bad or not graphs:
        why = "; ".join(f"{g} stays fp32: {FP32_ONLY[g]}" for g in bad if g in FP32_ONLY)
        return (f"--graphs: {', '.join(bad) or repr(args.graphs)} cannot be converted"
                + (f" ({why})" if why else f"; choose from {', '.join(QUANTIZED_GRAPHS)}"))
    fp32 = args.fp32_dir or args.onnx_root / "fp32"
    missing = [g for g in graphs if not (fp32 / f"{g}.onnx").is_file()]
    if missing:
        return (f"{fp32}: no fp32 graph for {', '.join(missing)}; export first: python export/export_onnx.py "
                f"--model-dir {args.model_dir} --out {fp32}")
    for name in ("calibration_utterances", "heldout_utterances", "steps_per_utterance"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.method_samples < 0:
        return f"--method-samples {args.method_samples}: must be >= 0"
    if args.steps_per_utterance > 10:
        return f"--steps-per-utterance {args.steps_per_utterance}: the solver has 10 steps"
    if not 1.0 <= args.max_seconds <= 30.0:
        return f"--max-seconds {args.max_seconds}: must be between 1 and 30"
    if args.threads < 0:
        return f"--threads {args.threads}: must be >= 0"
    if args.onnx_root.exists() and not args.onnx_root.is_dir():
        return f"--onnx-root {args.onnx_root}: exists and is not a folder"
    return None


def _reported(work):
    """``(work(), 0)``, or ``(None, exit status)`` with the failure reported: 2 for bad input, 1 otherwise."""
    from cosyvoice_triton.errors import CosyVoiceError

    try:
        return work(), 0
    except (CosyVoiceError, FileNotFoundError, ValueError) as exc:
        print(f"quantize.py: error: {exc}", file=sys.stderr)
        return None, 2
    except Exception as exc:  # onnxruntime / onnx failures: report them plainly
        log.exception("quantization failed")
        print(f"quantize.py: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None, 1


def _is_cosyvoice3(model_dir: Path) -> bool:
    return (model_dir / "cosyvoice3.yaml").is_file()


#: Options of CosyVoice2's graphs that a CosyVoice3 folder does not take (its one graph has one recipe)
CV2_ONLY = ("calibration_method", "method_samples", "steps_per_utterance", "sensitivity", "cache_dir", "no_cache",
            "fp32_dir")


def validate3(args: argparse.Namespace) -> str | None:
    """:func:`validate` for a CosyVoice3 folder: its vocoder graph in onnxruntime's CPU INT8 only, read from and
    written beside its export at ``--onnx-root``."""
    defaults = build_parser().parse_args(["--model-dir", "."])
    given = [f"--{k.replace('_', '-')}" for k in CV2_ONLY if getattr(args, k) != getattr(defaults, k)]
    if given:
        return f"{', '.join(given)}: CosyVoice2's graphs only (a CosyVoice3 folder gets its vocoder graph, one recipe)"
    if set(_names(args.precisions)) - {"int8_cpu"} and args.precisions != defaults.precisions:
        return ("--precisions: a CosyVoice3 folder gets int8_cpu only (its vocoder graph; the DiT's INT8 is "
                "PyTorch's, tunable cosyvoice3_flow_precision=int8)")
    if _names(args.graphs) != ["hift3_decoder"] and args.graphs != defaults.graphs:
        return "--graphs: a CosyVoice3 folder gets hift3_decoder only"
    if not (args.onnx_root / "hift3_decoder.onnx").is_file():
        return (f"{args.onnx_root}: no hift3_decoder.onnx; export first: cosyvoice-triton export-onnx --model-dir "
                f"{args.model_dir} --out {args.onnx_root}")
    if args.calibration_utterances < 1 or args.heldout_utterances < 1:
        return "--calibration-utterances and --heldout-utterances must be >= 1"
    if not 1.0 <= args.max_seconds <= 30.0:
        return f"--max-seconds {args.max_seconds}: must be between 1 and 30"
    if args.threads < 0:
        return f"--threads {args.threads}: must be >= 0"
    return None


def main3(args: argparse.Namespace) -> int:
    """A CosyVoice3 folder: ``<onnx-root>/int8_cpu/hift3_decoder.onnx`` from its export at ``--onnx-root``."""
    from cosyvoice_triton.export.quantize3 import quantize_vocoder3

    report, rc = _reported(lambda: quantize_vocoder3(
        args.model_dir, args.onnx_root, calibration_pairs=args.calibration_utterances,
        heldout_pairs=args.heldout_utterances, max_seconds=args.max_seconds, threads=args.threads,
        reduce_range=args.reduce_range, seed=args.seed, progress=log.info))
    if rc:
        return rc
    print(report.table())
    print(f"\n{report.path}: {report.reduced_layers} INT8 kernels, {len(report.kept_float)} layers kept float; "
          f"{report.verdict()} ({report.seconds:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cv3 = args.model_dir.is_dir() and _is_cosyvoice3(args.model_dir)
    if args.calibration_utterances is None:
        args.calibration_utterances = CV3_CALIBRATION if cv3 else MIN_CALIBRATION
    if args.heldout_utterances is None:
        args.heldout_utterances = CV3_HELDOUT if cv3 else 6
    problem = validate3(args) if cv3 else validate(args)
    if problem:
        print(f"quantize.py: error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("cosyvoice_triton.models.checkpoint").setLevel(logging.WARNING)
    if cv3:
        return main3(args)
    if args.calibration_utterances < MIN_CALIBRATION:
        log.warning("calibrating on %d utterance pairs: fewer than the %d the release graphs are calibrated on "
                    "(fine for a trial)", args.calibration_utterances, MIN_CALIBRATION)

    from cosyvoice_triton.export import quantize as q

    start = time.perf_counter()
    report, rc = _reported(lambda: q.quantize_graphs(
        args.model_dir, args.onnx_root, fp32_dir=args.fp32_dir, precisions=_names(args.precisions),
        graphs=_names(args.graphs), calibration_utterances=args.calibration_utterances,
        heldout_utterances=args.heldout_utterances, method=args.calibration_method,
        method_samples=args.method_samples or None,
        steps_per_utterance=args.steps_per_utterance, max_seconds=args.max_seconds,
        run_sensitivity=args.sensitivity, threads=args.threads, reduce_range=args.reduce_range,
        cache_dir=None if args.no_cache else args.cache_dir, seed=args.seed, progress=log.info))
    if rc:
        return rc
    out = [report.table(), "", "Layers kept in float (cosyvoice_triton.export.quantize):", "",
           q.rules_table(_names(args.graphs), args.fp32_dir or args.onnx_root / "fp32")]
    if report.sensitivity:
        out += ["", "Sensitivity (INT8 Q/DQ of one layer group at a time, held-out output error):", "",
                q.format_sensitivity(report.sensitivity)]
    text = "\n".join(out)
    print(text)
    if not args.no_cache:
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        (args.cache_dir / "quantize-report.md").write_text(text + "\n", encoding="utf-8")
    cal = report.calibration
    if cal:
        print(f"\ncalibration: {cal['pairs']} pairs ({cal['utterance_seconds']} s of source speech), "
              + ", ".join(f"{g} {d['samples']} calls" for g, d in cal["graphs"].items()))
    print(f"{len(report.results)} graph(s) written under {args.onnx_root} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
