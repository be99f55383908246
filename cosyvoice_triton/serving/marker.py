"""The marker file every rendered repository carries: what was rendered (models, tunables, graph precisions), read
by the launchers and the load tests, and checked before a folder is deleted and rendered anew."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["MARKER", "read_marker"]

MARKER = "cosyvoice_repository.json"


def read_marker(model_repository: str | Path) -> dict:
    """The marker of a rendered repository; raises OSError / ValueError for a folder that cosyvoice_triton did
    not render."""
    return json.loads((Path(model_repository) / MARKER).read_text())
