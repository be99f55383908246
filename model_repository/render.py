#!/usr/bin/env python3
"""Render build/model_repository from these templates: ``python model_repository/render.py --flavor local``.

A thin command line over :func:`cosyvoice_triton.serving.repository.render_repository`; ``--set NAME=VALUE`` sets a
tunable (see ``cosyvoice_triton.serving.repository.Tunables``; ``--set instances=flow:2,hift:2``; several:
``--set a=1,b=2``, ``--set a=1 b=2`` or ``--set`` repeated); ``--profile
plain`` (or ``--plain``) renders the baseline deployment of the load tests: no dynamic batching, PyTorch fp32
graphs (flavor local, precision fp32; ``cosyvoice_triton.serving.repository.PLAIN_TUNABLES``), for
``cosyvoice_triton.clients.plain.PlainPipeline``. ``--version N:MODEL_DIR:ONNX_DIR[:PRECISION]`` (repeated) renders
numbered versions for rollouts (``python -m cosyvoice_triton rollout``, ``cosyvoice_triton.serving.launch.rollout``).
"""

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from cosyvoice_triton.serving.repository import (  # noqa: E402
    CPU_CHOICE,
    DEFAULT_QUALITY_REPORT,
    FLAVORS,
    FP32_ONLY,
    PRECISIONS,
    PROFILES,
    SET_HELP,
    RenderError,
    TunableAction,
    render_repository,
)
from cosyvoice_triton.serving.versioning import VersionSpec  # noqa: E402


def version(text: str) -> VersionSpec:
    try:
        return VersionSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--flavor", choices=FLAVORS, default="local")
    p.add_argument("--out", default="build/model_repository")
    p.add_argument("--model-dir", default="models/cosyvoice2-demo-tiny")
    p.add_argument("--onnx-dir", default="build/onnx")
    p.add_argument("--engine-dir", default="build/engines")
    p.add_argument("--precision", default="fp32", metavar="PRECISION",
                   help=f"{', '.join(PRECISIONS)} (int8_cpu: local flavor only) for every graph "
                        f"({', '.join(FP32_ONLY)} stays fp32); {CPU_CHOICE}: the CPU precision per graph decided by "
                        "--quality-report (local flavor); or per graph, e.g. flow_encoder=int8_cpu,flow_estimator=fp32 "
                        "(graphs not named: fp32)")
    p.add_argument("--quality-report", default=DEFAULT_QUALITY_REPORT,
                   help=f"the quality report JSON that --precision {CPU_CHOICE} reads (make quality)")
    p.add_argument("--allow-missing", action="store_true", help="placeholders for missing ONNX/plan files")
    p.add_argument("--profile", choices=tuple(PROFILES), default="",
                   help="a named set of tunables (plain: no dynamic batching, PyTorch fp32 graphs)")
    p.add_argument("--plain", dest="profile", action="store_const", const="plain", help="same as --profile plain")
    p.add_argument("--set", dest="tunables", action=TunableAction, default=[], help=SET_HELP)
    p.add_argument("--version", dest="versions", action="append", type=version, default=[],
                   metavar="N:MODEL_DIR:ONNX_DIR[:PRECISION]",
                   help="a numbered version (repeat): the graphs, flow and hift of each, its pipeline cosyvoice_vc_vN, "
                        "and cosyvoice_vc as the router (cosyvoice_triton.serving.launch.rollout); --model-dir / "
                        "--onnx-dir / --precision are then the live version's; a CosyVoice3 folder is a version "
                        "whose pipeline is cosyvoice3_vc on it (ONNX_DIR not read)")
    p.add_argument("--live-version", type=int, default=0, help="the version served at start (default: the lowest)")
    args = p.parse_args(argv)
    try:
        report = render_repository(args.flavor, args.out, model_dir=args.model_dir, onnx_dir=args.onnx_dir,
                                   engine_dir=args.engine_dir, precision=args.precision, templates_dir=HERE,
                                   allow_missing=args.allow_missing, profile=args.profile,
                                   quality_report=args.quality_report, versions=args.versions,
                                   live_version=args.live_version, **dict(args.tunables))
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
