"""Numbered versions in a rendered repository: the checks of ``versions=``, one folder per version of the graphs
and BLS stages, each version's pipeline and manifest, and the router under the public name. A CosyVoice3 version's
pipeline is ``cosyvoice3_vc`` on its folder (in process; no graph or stage folders)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...export.trt import EXCLUDED
from ...family import COSYVOICE2, COSYVOICE3, model_family
from ...shapes import (
    CV3_VC_MODEL,
    SPEAKER_EMBEDDING_MODEL,
    SPEECH_TOKENS_MODEL,
    TTS_MODEL,
    TTS_STREAM_MODEL,
)
from ..stages.live_vc import LIVE_VC_MODEL
from ..stages.official_api import (
    OFFICIAL_MODEL,
)
from ..stages.vc_stream import VC_STREAM_MODEL
from ..versioning import MANIFEST_NAME as VERSION_MANIFEST
from ..versioning import ROUTER_PARAMS, VERSIONED, VersionSpec, version_manifest
from ..versioning import pipeline_model as _pipeline_model
from .precisions import (
    _check_plan,
    _onnx_file,
    _place,
    check_onnx_io,
    precision_plan,
)
from .served import (
    SERVED_MODELS,
    RenderContext,
    ServedModel,
    _cv3_params,
)
from .templates import (
    AUDIO_BYTES,
    RenderError,
    _io_block,
    _parameters_block,
)
from .tunables import (
    Tunables,
    _dynamic_batching_block,
)

#: Models left out of a versioned render: they call the graphs without a version (by BLS, or as ensemble steps of
#: ``model_version: -1``), so they would reach the newest loaded version (a staged candidate) whatever the router's
#: split says.
NOT_VERSIONED = (VC_STREAM_MODEL, LIVE_VC_MODEL, "speakers", TTS_STREAM_MODEL, TTS_MODEL, "tensorrt_llm",
                 SPEECH_TOKENS_MODEL, SPEAKER_EMBEDDING_MODEL, OFFICIAL_MODEL)


def _family(spec: VersionSpec, allow_missing: bool) -> str:
    if spec.family:
        return spec.family
    if allow_missing and not Path(spec.model_dir).is_dir():
        return COSYVOICE2
    try:
        family = model_family(spec.model_dir)
    except ConfigError as exc:
        raise RenderError(f"version {spec.number}: {exc}") from exc
    if family not in (COSYVOICE2, COSYVOICE3):
        raise RenderError(f"version {spec.number}: {spec.model_dir} is a {family} folder; a version is a "
                          "CosyVoice2 or CosyVoice3 one")
    return family


def _check_versions(versions: Sequence[VersionSpec], live: int, tunables: Mapping[str, Any],
                    allow_missing: bool = False) -> tuple[tuple[VersionSpec, ...], VersionSpec | None]:
    versions = tuple(sorted((dataclasses.replace(v, family=_family(v, allow_missing)) for v in versions),
                            key=lambda v: v.number))
    if not versions:
        if live:
            raise RenderError("live_version without versions")
        return versions, None
    numbers = [v.number for v in versions]
    if len(set(numbers)) != len(numbers):
        raise RenderError(f"versions: a number given twice ({numbers})")
    if tunables.get("runtime", "onnxruntime") != "onnxruntime":
        raise RenderError("versions: a version is an export; runtime=torch runs the checkpoint's modules instead")
    live = live or numbers[0]
    if live not in numbers:
        raise RenderError(f"live_version {live} is not one of the versions {numbers}")
    spec = next(v for v in versions if v.number == live)
    if spec.family != COSYVOICE2:
        raise RenderError(f"live_version {live} is a {spec.family} version: the rendered live version is a "
                          "CosyVoice2 one (its graphs and stages are the repository's); a CosyVoice3 version is "
                          "staged and promoted by the rollout")
    if tunables.get("output_format") and any(v.family == COSYVOICE3 for v in versions):
        raise RenderError("versions: a CosyVoice3 version answers no audio_bytes; leave output_format unset")
    return versions, spec


def exported_versions(versions: Sequence[VersionSpec]) -> list[VersionSpec]:
    """The versions with graphs and stages of their own (CosyVoice2's)."""
    return [v for v in versions if v.family != COSYVOICE3]


def _version_policy(path: Path, numbers: Iterable[int]) -> None:
    """Append the ``version_policy`` that loads ``numbers`` to a rendered config."""
    listed = ", ".join(str(n) for n in sorted(numbers))
    with open(path, "a") as f:
        f.write("# the versions served: `rollout stage` / `promote` / `rollback` rewrite this line and load the model\n"
                f"version_policy {{ specific {{ versions: [ {listed} ] }} }}\n")


def _graph_versions(model: Path, name: str, flavor: str, versions: Sequence[VersionSpec], engine_dir: Path,
                    quality_report: str | Path, tun: Tunables, allow_missing: bool,
                    served: dict[int, dict[str, tuple[Path, str]]]) -> list[Path]:
    """One folder per version with that version's file of graph ``name`` (replacing the single ``1/``)."""
    code = model / "1" / "model.py"
    code_text = code.read_bytes() if code.is_file() else None
    shutil.rmtree(model / "1")
    files: list[Path] = []
    for v in exported_versions(versions):
        plan = precision_plan(v.precision, flavor, quality_report=quality_report)
        onnx_dir = Path(v.onnx_dir).resolve()
        _check_plan(plan, flavor, onnx_dir, tun, allow_missing)
        asked = plan.graphs[name]
        folder = model / str(v.number)
        if flavor == "trt" and name not in EXCLUDED:
            src, dst, precision = Path(engine_dir) / asked / f"{name}.plan", folder / "model.plan", asked
        else:
            src = _onnx_file(onnx_dir, name, asked, strict=plan.strict)
            if not src.is_file() and not allow_missing:
                raise RenderError(f"version {v.number}: {src} not found (make export first)")
            if src.is_file():
                check_onnx_io(src, name)
            dst, precision = folder / "model.onnx", src.parent.name if src.is_file() else asked
            fp32 = onnx_dir / "fp32" / f"{name}.onnx"
            if flavor == "local" and precision != "fp32" and fp32.is_file():  # graphs.py's fallback, by version
                files.append(_place(fp32, folder / "fallback.onnx", allow_missing))
        files.append(_place(src, dst, allow_missing))
        if code_text is not None:
            (folder / "model.py").write_bytes(code_text)
            files.append(folder / "model.py")
        served[v.number][name] = (src, precision)
    return files


def _stage_versions(model: Path, versions: Sequence[VersionSpec]) -> list[Path]:
    """A BLS stage's code in every version's folder (version N calls the graphs' version N)."""
    code = (model / "1" / "model.py").read_bytes()
    files = []
    for v in exported_versions(versions):
        dst = model / str(v.number) / "model.py"
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(code)
        files.append(dst)
    if 1 not in [v.number for v in exported_versions(versions)]:
        shutil.rmtree(model / "1")
    return files


def _version_pipelines(out: Path, entry: ServedModel, versions: Sequence[VersionSpec], live: int,
                       served: Mapping[int, Mapping[str, tuple[Path, str]]], flavor: str, note: str,
                       write: Callable[..., None], source: Callable[[str], Path], ctx: RenderContext) -> list[Path]:
    """Per version its pipeline (the ensemble, graph and BLS steps pinned to the version) and manifest; the router
    under the public name with the live version at 100%; the live version's ``version_policy`` everywhere."""
    files: list[Path] = []
    outputs = list(entry.outputs) + ([AUDIO_BYTES] if ctx.tunables.output_format else [])
    values = {"inputs": _io_block("input", entry.inputs, optional=entry.optional),
              "outputs": _io_block("output", outputs), **(entry.values(ctx) if entry.values else {})}
    step = re.compile(r'(model_name: "(' + "|".join(VERSIONED) + r')"\s*\n\s*model_version: )-1')
    for v in versions:
        name = _pipeline_model(v.number)
        if v.family == COSYVOICE3:
            files += _cv3_pipeline(out, v, note, write, source, ctx)
            continue
        write(name, f"{entry.folder}/config.pbtxt.in", {"name": name, **values}, source(entry.folder) /
              "config.pbtxt.in")
        path = out / name / "config.pbtxt"
        text, pinned = step.subn(lambda m, n=v.number: m.group(1) + str(n), path.read_text())
        if pinned < 4:
            raise RenderError(f"{path}: the graph and BLS steps should pin version {v.number}; pinned {pinned}")
        path.write_text(text)
        (out / name / "1").mkdir(parents=True, exist_ok=True)
        manifest = version_manifest(v, {g: p for g, (p, _) in served[v.number].items()},
                                    {g: prec for g, (_, prec) in served[v.number].items()}, flavor=flavor)
        (out / name / VERSION_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        files += [path, out / name / VERSION_MANIFEST]
    router = source("ensemble/cosyvoice_vc_router")
    params = {p.name: p.default for p in ROUTER_PARAMS}
    params.update(split=f"{live}:100", live_version=live, candidate_version=0,
                  bls_timeout_us=ctx.tunables.bls_timeout_us,
                  seedless_versions=",".join(str(v.number) for v in versions if v.family == COSYVOICE3))
    write(entry.name, "ensemble/cosyvoice_vc_router/config.pbtxt.in", {
        "name": entry.name, "max_batch_size": 1,
        "inputs": _io_block("input", entry.inputs, ragged=True, optional=entry.optional),
        "outputs": _io_block("output", outputs),
        "instance_count": int(ctx.tunables.instances.get(entry.name, 4)),  # requests forwarded at once
        "parameters": _parameters_block(params)}, router / "config.pbtxt.in")
    dst = out / entry.name / "1" / "model.py"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(router / "model.py", dst)
    files += [out / entry.name / "config.pbtxt", dst]
    for model in VERSIONED:
        _version_policy(out / model / "config.pbtxt", [live])
    return files


def _cv3_pipeline(out: Path, v: VersionSpec, note: str, write: Callable[..., None], source: Callable[[str], Path],
                  ctx: RenderContext) -> list[Path]:
    """A CosyVoice3 version's pipeline: ``cosyvoice3_vc`` (its adapter, tensors and parameters) on the version's
    folder, under the version's pipeline name, with its manifest."""
    entry = next(m for m in SERVED_MODELS if m.name == CV3_VC_MODEL)
    name, tun = _pipeline_model(v.number), ctx.tunables
    params = _cv3_params(dataclasses.replace(ctx, cosyvoice3_dir=Path(v.model_dir).resolve(),
                                             cosyvoice3_graphs=False))
    count = int(tun.instances.get(name, tun.instances.get(CV3_VC_MODEL, entry.instances)))
    write(name, entry.template, {
        "name": name, "stage_doc": f"{name}: version {v.number}, CosyVoice3 ({v.model_dir}): {entry.doc}",
        "source": entry.folder, "max_batch_size": entry.max_batch_size,
        "inputs": _io_block("input", entry.inputs, ragged=True, optional=entry.optional),
        "outputs": _io_block("output", entry.outputs), "parameters": _parameters_block(params),
        "model_transaction_policy": "", "warmup": "", "instance_count": str(count),
        "dynamic_batching": _dynamic_batching_block(tun, name), **(entry.values(ctx) if entry.values else {})})
    code = out / name / "1" / "model.py"
    code.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source(entry.folder) / "model.py", code)
    manifest = version_manifest(v, {}, {}, flavor=ctx.flavor)
    (out / name / VERSION_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return [out / name / "config.pbtxt", code, out / name / VERSION_MANIFEST]
