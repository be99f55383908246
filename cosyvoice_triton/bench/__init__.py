"""Benchmarks that print figures (never timed tests): each module is one ``cosyvoice-triton bench-*`` command."""

from __future__ import annotations

import json
import os
from pathlib import Path


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as printed beside every figure."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def write_result(out_dir: str | Path, result: dict, report: str) -> Path:
    """``result.json`` and ``report.md`` into ``out_dir``; prints the report; returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1, default=float))
    (out / "report.md").write_text(report + "\n")
    print("\n" + report + f"\n\n  written: {out / 'report.md'}, result.json")
    return out
