"""What a numbered version of the served voice conversion is, shared by the render (which writes each version
into the repository, :mod:`.repository`) and the rollout (which stages and routes them, :mod:`.launch.rollout`):
:class:`VersionSpec`, the models that get a folder per version, the pipeline model of a version, the router's
parameters and the manifest each version carries.

A version is a CosyVoice2 folder with its export (the graphs and the BLS stages get the version's folder), or a
CosyVoice3 folder (its pipeline runs the folder in process, as ``cosyvoice3_vc``: no graphs); the family is the
folder's (:func:`~cosyvoice_triton.family.model_family`)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..family import COSYVOICE2, COSYVOICE3, FAMILY_YAML
from ..hashing import file_sha256
from ..shapes import GRAPHS, VC_MODEL
from .stages.params import Param

__all__ = ["CHECKPOINT_FILES", "FAMILY_CHECKPOINT_FILES", "MANIFEST_NAME", "ROUTER_PARAMS", "VERSIONED",
           "VersionSpec", "pipeline_model", "version_manifest"]

#: Models with one folder per version (the graphs and the BLS stages that call them).
VERSIONED = (*GRAPHS, "flow", "hift")
#: The manifest of a version, in its pipeline's model folder.
MANIFEST_NAME = "version.json"
#: The model folder's files a version records the digests of.
CHECKPOINT_FILES = ("cosyvoice2.yaml", "flow.pt", "hift.pt", "speech_tokenizer_v2.onnx", "campplus.onnx")
#: The same per family (a CosyVoice3 version converts with its own tokenizer).
FAMILY_CHECKPOINT_FILES = {COSYVOICE2: CHECKPOINT_FILES,
                           COSYVOICE3: ("cosyvoice3.yaml", "flow.pt", "hift.pt", "speech_tokenizer_v3.onnx",
                                        "campplus.onnx")}
#: The router's config parameters (``ensemble/cosyvoice_vc_router``).
ROUTER_PARAMS = (
    Param("split", str, None, "version:weight,... (e.g. 1:90,2:10): the share of requests of each version"),
    Param("live_version", int, None, "the version that serves when nothing is staged"),
    Param("candidate_version", int, 0, "the staged version (0: none)"),
    Param("target", str, "cosyvoice_vc_v{version}", "the pipeline model of a version"),
    Param("bls_timeout_us", int, 0, "timeout of each forwarded request in microseconds (0: none)"),
    Param("seedless_versions", str, "", "versions whose pipeline takes no seed, comma separated (CosyVoice3: its "
          "vocoder noise is the checkpoint's fixed buffer): the router leaves a request's seed out for them"),
)


def pipeline_model(version: int) -> str:
    """The Triton model of a version's pipeline (``cosyvoice_vc_v2``)."""
    return f"{VC_MODEL}_v{int(version)}"


@dataclass(frozen=True)
class VersionSpec:
    """One version to render: ``number`` (>= 1), the model folder, the export's root and the precision
    (anything :func:`~cosyvoice_triton.serving.repository.precision_plan` takes); ``family``: the folder's (empty
    until the render reads it; a CosyVoice3 version has no export: its ``onnx_dir`` is not read)."""

    number: int
    model_dir: Path
    onnx_dir: Path
    precision: str = "fp32"
    family: str = ""

    def __post_init__(self):
        if int(self.number) < 1:
            raise ValueError(f"a version number is >= 1, got {self.number}")

    @classmethod
    def parse(cls, text: str) -> VersionSpec:
        """``"N:MODEL_DIR:ONNX_DIR[:PRECISION]"``."""
        parts = text.split(":")
        if len(parts) not in (3, 4) or not parts[0].isdigit():
            raise ValueError(f"version {text!r}: expected N:MODEL_DIR:ONNX_DIR[:PRECISION]")
        return cls(int(parts[0]), Path(parts[1]), Path(parts[2]), *(parts[3:] or []))


def _export_source(onnx_dir: Path, graph: str, served: Path) -> dict[str, Any]:
    """What the export's manifest says of ``graph``: the file's digest and the checkpoint file it came from."""
    for manifest in (served.parent / "manifest.json", onnx_dir / "fp32" / "manifest.json"):
        try:
            entry = json.loads(manifest.read_text())["graphs"][graph]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        src = entry.get("source") or {}
        return {"export_manifest": str(manifest), "export_sha256": entry.get("sha256", ""),
                "source_file": src.get("file", ""), "source_sha256": src.get("sha256", "")}
    return {"export_manifest": "", "export_sha256": "", "source_file": "", "source_sha256": ""}


def version_manifest(spec: VersionSpec, served: Mapping[str, Path], precisions: Mapping[str, str], *,
                     flavor: str) -> dict[str, Any]:
    """The record of a rendered version: its family, checkpoint digests, each graph's served file with its digest,
    its precision and what its export says it was made from, and the model's settings (the family's yaml)."""
    from ..config import ModelConfig

    model_dir = Path(spec.model_dir).resolve()
    family = spec.family or COSYVOICE2
    checkpoint = {f: file_sha256(model_dir / f) for f in FAMILY_CHECKPOINT_FILES[family] if (model_dir / f).is_file()}
    yaml = model_dir / FAMILY_YAML[family]
    if not yaml.is_file():
        settings = {}
    elif family == COSYVOICE3:
        from ..models.cosyvoice3.config import read_cosyvoice3_yaml

        settings = _plain(read_cosyvoice3_yaml(yaml))
    else:
        settings = _plain(ModelConfig.from_yaml(yaml))
    graphs = {}
    for name, path in served.items():
        path = Path(path)
        graphs[name] = {"file": str(path), "sha256": file_sha256(path) if path.is_file() and path.stat().st_size
                        else "", "precision": precisions.get(name, ""),
                        **_export_source(Path(spec.onnx_dir).resolve(), name, path)}
    return {"version": int(spec.number), "pipeline": pipeline_model(spec.number), "family": family, "flavor": flavor,
            "model_dir": str(model_dir), "onnx_dir": str(Path(spec.onnx_dir).resolve()),
            "precision": spec.precision, "checkpoint": checkpoint, "settings": settings, "graphs": graphs,
            "rendered_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _plain(obj: Any) -> Any:
    from dataclasses import asdict, is_dataclass

    if is_dataclass(obj):
        return _plain(asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else str(obj)
