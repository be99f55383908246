#!/usr/bin/env python3
"""Render build/model_repository from these templates: ``python model_repository/render.py --flavor local``.

A thin command line over :func:`cosyvoice_triton.repository.render_repository`; ``--set NAME=VALUE`` sets a
tunable (see ``cosyvoice_triton.repository.Tunables``; ``--set instances=flow:2,hift:2``).
"""

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from cosyvoice_triton.repository import FLAVORS, RenderError, Tunables, render_repository  # noqa: E402


def tunable(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    types = {f.name: f.type for f in fields(Tunables)}
    if not sep or name not in types:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of {', '.join(sorted(types))}")
    kind = str(types[name])
    if "Mapping" in kind:
        return name, {k: int(v) for k, v in (p.split(":") for p in value.split(",") if p)}
    if kind == "bool":
        return name, value.lower() in ("1", "true", "yes", "on")
    if kind in ("int", "float"):
        return name, json.loads(value)
    return name, value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--flavor", choices=FLAVORS, default="local")
    p.add_argument("--out", default="build/model_repository")
    p.add_argument("--model-dir", default="models/cosyvoice2-demo-tiny")
    p.add_argument("--onnx-dir", default="build/onnx")
    p.add_argument("--engine-dir", default="build/engines")
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "int8"))
    p.add_argument("--allow-missing", action="store_true", help="placeholders for missing ONNX/plan files")
    p.add_argument("--set", dest="tunables", action="append", type=tunable, default=[], metavar="NAME=VALUE")
    args = p.parse_args(argv)
    try:
        report = render_repository(args.flavor, args.out, model_dir=args.model_dir, onnx_dir=args.onnx_dir,
                                   engine_dir=args.engine_dir, precision=args.precision, templates_dir=HERE,
                                   allow_missing=args.allow_missing, **dict(args.tunables))
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
