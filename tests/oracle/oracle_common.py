"""What the oracle scripts share: their command line's common options, the versions their metas record and the
writing of ``oracle_meta.json``."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
from pathlib import Path


def oracle_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first paragraph with ``--official``, ``--out`` and ``--official-commit``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--official", type=Path, required=True, help="checkout of FunAudioLLM/CosyVoice")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--official-commit", default=None, help="commit of the checkout when it is a git archive")
    return ap


def checkout_commit(official: Path, given: str | None) -> str:
    """``given``, else the checkout's HEAD, else a note that it is not a git checkout."""
    commit = subprocess.run(["git", "-C", str(official), "rev-parse", "HEAD"], capture_output=True, text=True)
    return given or commit.stdout.strip() or "unknown (not a git checkout)"


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_meta(out: Path, meta: dict) -> None:
    """``out/oracle_meta.json``, then the folder's size on stdout."""
    (out / "oracle_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({total / 1e6:.2f} MB)", flush=True)
