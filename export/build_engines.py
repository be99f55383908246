"""Build the TensorRT engines of the exported graphs (or print the trtexec commands with --dry-run).

    python export/build_engines.py --precision int8 --dry-run
    python export/build_engines.py --precision fp16 --graphs flow_estimator hift_decoder

Reads build/onnx/{fp32,fp16,int8}/<graph>.onnx, writes build/engines/<precision>/<graph>.plan with its
layer report (<graph>.layers.json) and build log. Real builds run inside the NGC Triton container
(Dockerfile.triton); the library is cosyvoice_triton.export.trt.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from cosyvoice_triton.export.trt import BUILDERS, EXCLUDED, PRECISIONS, BuildOptions, EngineBuildError, build_engines
from cosyvoice_triton.shapes import GRAPHS

log = logging.getLogger("build_engines")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--onnx-dir", type=Path, default=Path("build/onnx"),
                   help="folder with fp32/, fp16/, int8/ ONNX subfolders (default: build/onnx)")
    p.add_argument("--engine-dir", type=Path, default=Path("build/engines"),
                   help="engines go to <engine-dir>/<precision>/ (default: build/engines)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp16",
                   help="ONNX precision to build from; graphs without that file fall back to fp32 (default: fp16)")
    excluded = ", ".join(f"{g} ({'never' if not e.overridable else 'only when named'})" for g, e in EXCLUDED.items())
    p.add_argument("--graphs", nargs="+", metavar="GRAPH",
                   help=f"graphs to build (default: all of {', '.join(GRAPHS)} except {excluded})")
    p.add_argument("--builder", choices=BUILDERS, default="trtexec",
                   help="trtexec command line or the TensorRT Python API (default: trtexec)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, build nothing")
    p.add_argument("--opt-level", type=int, choices=range(6), default=3, metavar="0-5",
                   help="--builderOptimizationLevel (default: 3)")
    p.add_argument("--workspace-mib", type=_positive, default=8192, help="workspace memory pool (default: 8192)")
    p.add_argument("--iterations", type=int, default=0,
                   help="timed inference iterations at the opt shapes after the build (default: 0, --skipInference)")
    p.add_argument("--weak-fp16", action="store_true",
                   help="fp16 for graphs without an fp16 ONNX: fp32 file + --fp16 (weak typing, deprecated "
                        "in TensorRT 10, removed in 11)")
    p.add_argument("--quiet", action="store_true", help="no --verbose in the build logs")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.iterations < 0:
        parser.error("--iterations must be >= 0")
    if args.graphs:
        unknown = [g for g in args.graphs if g not in GRAPHS]
        if unknown:
            parser.error(f"unknown graph(s) {', '.join(unknown)}; choose from {', '.join(GRAPHS)}")
        never = [g for g in args.graphs if g in EXCLUDED and not EXCLUDED[g].overridable]
        if never:
            parser.error("; ".join(f"{g} stays off TensorRT: {EXCLUDED[g].reason}" for g in never))
    options = BuildOptions(opt_level=args.opt_level, workspace_mib=args.workspace_mib, verbose=not args.quiet,
                           iterations=args.iterations, weak_fp16=args.weak_fp16)
    log.info("TensorRT engines: precision %s, builder %s%s", args.precision, args.builder,
             " (dry run)" if args.dry_run else "")
    try:
        results = build_engines(args.onnx_dir, args.engine_dir, precision=args.precision, graphs=args.graphs,
                                builder=args.builder, dry_run=args.dry_run, options=options, log=log.info)
    except EngineBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.dry_run:
        log.info("built %d engine(s) in %s", len(results), args.engine_dir / args.precision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
