"""Shared fixtures. The oracle lives in ../shared/reference (see its README); tests that need it skip
with a clear reason where a clone does not have it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DIR = ROOT.parent / "shared" / "reference"
TINY_DIR = REFERENCE_DIR / "cosyvoice2-tiny"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """``shared/reference`` (the full-size key lists live here)."""
    if not (REFERENCE_DIR / "README.md").is_file():
        pytest.skip(f"oracle folder {REFERENCE_DIR} is absent (it exists only inside the project workplace)")
    return REFERENCE_DIR


@pytest.fixture(scope="session")
def tiny_dir(reference_dir: Path) -> Path:
    """``shared/reference/cosyvoice2-tiny``: official-format random weights and official outputs."""
    if not (TINY_DIR / "flow.pt").is_file():
        pytest.skip(f"oracle model {TINY_DIR} is absent")
    return TINY_DIR


@pytest.fixture(scope="session")
def ref_npz(tiny_dir: Path):
    """``ref_npz("flow_nonstream")`` -> dict of numpy arrays from the oracle."""
    cache: dict[str, dict[str, np.ndarray]] = {}

    def load(name: str) -> dict[str, np.ndarray]:
        if name not in cache:
            with np.load(tiny_dir / f"{name}.npz", allow_pickle=False) as z:
                cache[name] = {k: z[k] for k in z.files}
        return cache[name]

    return load


def rel_err(actual, expected) -> float:
    """max|a - e| / max|e|, the oracle README's relative error."""
    a, e = (np.asarray(x.detach().cpu() if hasattr(x, "detach") else x, dtype=np.float64)
            for x in (actual, expected))
    assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
    return float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))
