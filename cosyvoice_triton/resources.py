"""Where the files the package uses at run time are: the model repository's templates (``model_repository/``,
``ensemble/``), the scripts the command line runs (``export/``, ``model_repository/render.py``), the Locust files
(``loadtest/``) and the sample recordings (``tests/fixtures/*.wav``).

They live in the repository's top-level folders. In a clone (an editable install) they are read there; an installed
wheel carries them as package data under ``cosyvoice_triton/_data/``, laid out as in the clone (``setup.py`` maps
them there when the wheel is built). Every run-time path goes through :func:`path`, with the same relative path in
both cases (``path("tests/fixtures/source_en_5s.wav")``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["DATA", "checkout", "path", "root"]

#: the package's folder of shipped files in an installed wheel (absent in a clone)
DATA = "_data"


def _package_dir() -> Path:
    files = resources.files(__package__)
    if not isinstance(files, Path):  # a zip import: the files would need extracting, and tritonserver reads them
        raise RuntimeError(f"{__package__} is not installed as plain files ({files}): install it with pip")
    return files


def root() -> Path:
    """The folder that holds ``model_repository/``, ``ensemble/``, ``export/``, ``loadtest/`` and
    ``tests/fixtures/``: the package's ``_data/`` when installed from a wheel, else the clone it lives in."""
    package = _package_dir()
    data = package / DATA
    return data if data.is_dir() else package.parent


def path(rel: str) -> Path:
    """The run-time file or folder ``rel`` (a path relative to the repository's top, e.g. ``"model_repository"``,
    ``"export/quantize.py"``): in the clone, or as the wheel ships it."""
    return root() / rel


def checkout() -> Path | None:
    """The clone the package runs from (its git work tree: the load tests record its commit), or None for an
    installed wheel."""
    package = _package_dir()
    return None if (package / DATA).is_dir() else package.parent
