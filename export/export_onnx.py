#!/usr/bin/env python3
"""Export the graphs of a CosyVoice2 or CosyVoice3 folder to verified fp32 ONNX (one file per graph + manifest.json).

    python export/export_onnx.py --model-dir models/cosyvoice2-demo-tiny --out build/onnx/fp32 \\
        [--graphs flow_estimator,hift_decoder] [--no-verify] [--max-length N]

The family comes from the folder (its cosyvoice2.yaml or cosyvoice3.yaml): CosyVoice2's graphs are
``shapes.GRAPHS`` (``cosyvoice_triton.export.onnx_export``), CosyVoice3's ``shapes.GRAPHS3`` (the DiT estimator in
its two attention variants and the causal vocoder's two parts, ``cosyvoice_triton.export.onnx_export3``);
``--official-estimator-files`` also writes CosyVoice3's estimators under the official runtime's file names.

Every graph is checked with onnxruntime against PyTorch (or, for the two shipped graphs, against the file
as shipped) at batch sizes and lengths other than the export's, up to the longest length of the shape spec;
the script exits 1 when a check fails (bar: 1e-4 relative for fp32), 2 for a bad argument or model folder.
The work is done by ``cosyvoice_triton.export.onnx_export``; this script parses, validates, logs and reports.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

try:
    from cosyvoice_triton.shapes import GRAPHS, GRAPHS3
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cosyvoice_triton.shapes import GRAPHS, GRAPHS3

log = logging.getLogger("export_onnx")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="export_onnx.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"graphs: CosyVoice2 {', '.join(GRAPHS)}; CosyVoice3 {', '.join(GRAPHS3)}\n"
               "exit status: 0 ok, 1 verification failed, 2 bad arguments or input")
    p.add_argument("--model-dir", required=True, type=Path,
                   help="CosyVoice2 model folder (cosyvoice2.yaml, flow.pt, hift.pt, speech_tokenizer_v2.onnx, "
                        "campplus.onnx) or CosyVoice3 folder (cosyvoice3.yaml, flow.pt, hift.pt)")
    p.add_argument("--out", required=True, type=Path, help="output folder, e.g. build/onnx/fp32")
    p.add_argument("--graphs", default=None,
                   help="comma-separated subset of the graphs (default: all)")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
    p.add_argument("--no-verify", action="store_true", help="export only, skip the onnxruntime checks")
    p.add_argument("--max-length", type=int, default=None,
                   help="cap the verification lengths (default: each graph's maximum in the shape spec)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch and onnxruntime intra-op threads (default 0: their defaults)")
    p.add_argument("--official-estimator-files", action="store_true",
                   help="CosyVoice3: also write the estimators as the official runtime names them "
                        "(flow.decoder.estimator[.streaming].fp32.onnx, batch fixed to 2 as its TensorRT profile)")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings only, then the table")
    return p


def family_graphs(model_dir: Path) -> tuple[str, dict]:
    """The folder's family and its graph specs; a ConfigError (CosyVoiceError) for a folder of no family or of
    CosyVoice (1), which has no graphs here."""
    from cosyvoice_triton.errors import ConfigError
    from cosyvoice_triton.family import COSYVOICE2, COSYVOICE3, model_family

    family = model_family(model_dir)
    if family not in (COSYVOICE2, COSYVOICE3):
        raise ConfigError(f"{model_dir}: a {family} folder; graphs are exported for cosyvoice2 and cosyvoice3")
    return family, dict(GRAPHS3 if family == COSYVOICE3 else GRAPHS)


def validate(args: argparse.Namespace) -> str | None:
    """A message for the first invalid argument, else None."""
    if not args.model_dir.exists():
        return f"--model-dir {args.model_dir}: model folder not found"
    if not args.model_dir.is_dir():
        return f"--model-dir {args.model_dir}: not a folder"
    if args.out.exists() and not args.out.is_dir():
        return f"--out {args.out}: exists and is not a folder"
    from cosyvoice_triton.errors import CosyVoiceError

    try:
        family, graphs = family_graphs(args.model_dir)
    except CosyVoiceError as exc:
        return str(exc)
    if args.graphs is not None:
        names = [g.strip() for g in args.graphs.split(",") if g.strip()]
        unknown = [g for g in names if g not in graphs]
        if unknown or not names:
            bad = ", ".join(unknown) or repr(args.graphs)
            return f"--graphs: unknown {family} graph(s) {bad}; choose from {', '.join(graphs)}"
    if args.official_estimator_files and family != "cosyvoice3":
        return "--official-estimator-files: only for a cosyvoice3 folder"
    if not 17 <= args.opset <= 20:
        return f"--opset {args.opset}: supported are 17 to 20 (the legacy exporter's range with LayerNormalization)"
    if args.max_length is not None and args.max_length < 1:
        return f"--max-length {args.max_length}: must be >= 1"
    if args.threads < 0:
        return f"--threads {args.threads}: must be >= 0"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = validate(args)
    if problem:
        print(f"export_onnx.py: error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")

    import torch

    from cosyvoice_triton.errors import CosyVoiceError
    from cosyvoice_triton.export.onnx_export import VerificationError, export_onnx, spec_summary
    from cosyvoice_triton.export.onnx_export3 import export_onnx3

    if args.threads:
        torch.set_num_threads(args.threads)
    family, graphs = family_graphs(args.model_dir)
    names = [g.strip() for g in args.graphs.split(",")] if args.graphs else list(graphs)
    log.info("%s model %s -> %s, opset %d, fp32, verify %s, max length %s", family, args.model_dir, args.out,
             args.opset, "no" if args.no_verify else "yes", args.max_length or "spec maximum")
    for name in graphs:
        if name in names:
            for line in spec_summary(name, graphs[name]):
                log.info("%s", line)
    start = time.perf_counter()
    try:
        if family == "cosyvoice3":
            report = export_onnx3(args.model_dir, args.out, graphs=names, opset=args.opset,
                                  verify=not args.no_verify, max_length=args.max_length, threads=args.threads,
                                  official_estimator_files=args.official_estimator_files)
        else:
            report = export_onnx(args.model_dir, args.out, graphs=names, opset=args.opset,
                                 verify=not args.no_verify, max_length=args.max_length, threads=args.threads)
    except VerificationError as exc:
        if exc.report is not None:
            print(exc.report.table())
        print(f"export_onnx.py: FAILED: {exc}", file=sys.stderr)
        return 1
    except (CosyVoiceError, FileNotFoundError) as exc:  # a wrong or incomplete model folder
        print(f"export_onnx.py: error: {exc}", file=sys.stderr)
        return 2
    if report.verified:
        print(report.table())
    print(f"{len(report.graphs)} graph(s) in {args.out} ({report.manifest.name}), "
          f"{'verified' if report.verified else 'NOT verified'}, {time.perf_counter() - start:.1f} s")
    for g in report.graphs.values():
        print(f"  {g.path.name:<24} {g.bytes / 1e6:9.1f} MB  batch {'dynamic' if g.batch_dynamic else 'fixed 1'}"
              f"  export {g.export_seconds:6.1f} s" + (f"  verify {g.verify_seconds:6.1f} s" if g.verified else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
