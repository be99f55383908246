"""The render entry: :func:`render_repository` writes the whole repository of a flavor, with its marker."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ...export.trt import EXCLUDED
from ...family import COSYVOICE3
from ...shapes import (
    CV3_VC_MODEL,
    GRAPHS,
    GRAPHS3,
    VC_MODEL,
)
from ..marker import MARKER
from ..stages.cosyvoice3_graphs import VOCODER_GRAPH
from ..stages.model_params import MODEL_PARAMS
from ..versioning import VERSIONED, VersionSpec
from ..versioning import pipeline_model as _pipeline_model
from .precisions import (
    CPU_CHOICE,
    DEFAULT_QUALITY_REPORT,
    FLAVORS,
    TORCH_GRAPHS,
    PrecisionPlan,
    _check_plan,
    _onnx_file,
    _place,
    _warn_foreign_report,
    check_onnx_io,
    precision_plan,
)
from .served import (
    CV3_GRAPH_MODELS,
    ISOLATED_STAGES,
    NICE_MODELS,
    RESPONSE_CACHE_GRAPHS,
    SERVED_MODELS,
    TASK_COPIES,
    TASK_SUFFIX,
    RenderContext,
)
from .templates import (
    AUDIO_BYTES,
    RenderError,
    _io_block,
    _parameters_block,
    _warmup_block,
    _write_warmup,
    default_templates_dir,
    graph_warmup_samples,
    render_template,
)
from .tunables import (
    _PROFILE_NOTES,
    PROFILES,
    Tunables,
    _dynamic_batching_block,
    _instance_count,
    _nice,
    _response_cache_block,
)
from .versions import NOT_VERSIONED, _check_versions, _graph_versions, _stage_versions, _version_pipelines

log = logging.getLogger(__name__)


@dataclass
class RenderReport:
    flavor: str
    out_dir: Path
    models: dict[str, str]  # model -> backend / platform
    files: list[Path]
    profile: str = ""  # a name of PROFILES, or "" (the tunables as given)

    def describe(self) -> str:
        what = f"flavor {self.flavor}" + (f", profile {self.profile}: {_PROFILE_NOTES[self.profile]}"
                                          if self.profile else "")
        lines = [f"rendered {self.out_dir} ({what}):"]
        lines += [f"  {m:<18} {b}" for m, b in self.models.items()]
        return "\n".join(lines)


def _has_tts(model_dir: Path, tun: Tunables) -> bool:
    """Render the TTS models? ``tts=on`` always, ``off`` never, ``auto``: when the folder has the LM files (a
    voice-conversion-only folder still serves VC)."""
    if tun.tts != "auto":
        return tun.tts == "on"
    from ...pipeline import TTS_FILES

    return all((model_dir / f).is_file() for f in TTS_FILES)


def _cosyvoice3_dir(tun: Tunables, allow_missing: bool) -> Path | None:
    """Tunable ``cosyvoice3_dir`` resolved, after checking it is a complete CosyVoice3 folder; None when unset."""
    if not tun.cosyvoice3_dir:
        return None
    from ...errors import ConfigError
    from ...family import COSYVOICE3, check_model_folder

    path = Path(tun.cosyvoice3_dir).resolve()
    if not allow_missing:
        try:
            check_model_folder(path, COSYVOICE3)
        except ConfigError as exc:
            raise RenderError(f"tunable cosyvoice3_dir: {exc}") from exc
    return path


def _cv3_graph_files(tun: Tunables, cv3_dir: Path | None, allow_missing: bool) -> dict[str, Path]:
    """Tunable ``cosyvoice3_onnx_dir``: the served graphs' files by model name (the estimator's two, the vocoder's
    generator), checked (the spec's I/O; the export's manifest names the ``flow.pt`` / ``hift.pt`` of
    ``cosyvoice3_dir``); empty when unset."""
    if not tun.cosyvoice3_onnx_dir:
        return {}
    if cv3_dir is None:
        raise RenderError("tunable cosyvoice3_onnx_dir needs cosyvoice3_dir (the folder it was exported from)")
    onnx_dir = Path(tun.cosyvoice3_onnx_dir).resolve()
    files = {name: onnx_dir / f"{name}.onnx" for name in CV3_GRAPH_MODELS}
    if allow_missing:
        if tun.cosyvoice3_vocoder_precision == "int8_cpu":
            from ...export.quantize3 import INT8_CPU_DIR

            files[VOCODER_GRAPH] = onnx_dir / INT8_CPU_DIR / f"{VOCODER_GRAPH}.onnx"
        return files
    for name, path in files.items():
        if not path.is_file():
            raise RenderError(f"tunable cosyvoice3_onnx_dir: {path} not found (export-onnx --model-dir {cv3_dir} "
                              f"--out {onnx_dir})")
        check_onnx_io(path, name)
    from ...hashing import file_sha256

    manifest = onnx_dir / "manifest.json"
    try:
        entries = json.loads(manifest.read_text())["graphs"]
        sources = {name: entries[name]["source"]["sha256"] for name in CV3_GRAPH_MODELS}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RenderError(f"tunable cosyvoice3_onnx_dir: {manifest} is not an export's manifest ({exc})") from exc
    digests = {f: file_sha256(cv3_dir / f) for f in ("flow.pt", "hift.pt")}
    for name, sha in sources.items():
        checkpoint = "hift.pt" if name == VOCODER_GRAPH else "flow.pt"
        if sha != digests[checkpoint]:
            raise RenderError(f"tunable cosyvoice3_onnx_dir: {name} of {onnx_dir} was exported from another "
                              f"{checkpoint} than {cv3_dir / checkpoint} (export again from cosyvoice3_dir)")
    if tun.cosyvoice3_vocoder_precision == "int8_cpu":
        files[VOCODER_GRAPH] = _cv3_int8_vocoder(onnx_dir, files[VOCODER_GRAPH], cv3_dir)
    return files


def _cv3_int8_vocoder(onnx_dir: Path, fp32: Path, cv3_dir: Path) -> Path:
    """Tunable ``cosyvoice3_vocoder_precision=int8_cpu``: the INT8 vocoder graph, quantized from ``fp32`` (its
    manifest's digest) and recorded within the quality bar and faster than fp32 (``serve``)."""
    from ...export.quantize3 import INT8_CPU_DIR
    from ...hashing import file_sha256

    folder = onnx_dir / INT8_CPU_DIR
    path = folder / f"{VOCODER_GRAPH}.onnx"
    how = f"(quantize --model-dir {cv3_dir} --onnx-root {onnx_dir})"
    if not path.is_file():
        raise RenderError(f"tunable cosyvoice3_vocoder_precision=int8_cpu: {path} not found {how}")
    check_onnx_io(path, VOCODER_GRAPH)
    try:
        entry = json.loads((folder / "manifest.json").read_text())["graphs"][VOCODER_GRAPH]
        recorded, fp32_sha, serve = entry["sha256"], entry["fp32_sha256"], entry["serve"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RenderError(f"tunable cosyvoice3_vocoder_precision=int8_cpu: {folder / 'manifest.json'} is not a "
                          f"quantization manifest ({exc}) {how}") from exc
    if fp32_sha != file_sha256(fp32) or recorded != file_sha256(path):
        raise RenderError(f"tunable cosyvoice3_vocoder_precision=int8_cpu: {path} was not quantized from {fp32} "
                          f"(its manifest names other digests) {how}")
    if serve is not True:
        raise RenderError(f"tunable cosyvoice3_vocoder_precision=int8_cpu: {path} is not fit to serve: "
                          f"{entry.get('verdict', 'no verdict recorded')}")
    from ...export.quantize_int8 import cpu_lacks_vnni

    if not entry.get("reduce_range") and cpu_lacks_vnni():
        log.warning("cosyvoice3_vocoder_precision=int8_cpu: %s has 8-bit weights (quantized on %s) and this CPU has no "
                    "VNNI, where onnxruntime's U8S8 products can saturate: quantize again on this machine (7-bit "
                    "weights) unless it serves elsewhere", path, entry.get("cpu", "an unrecorded CPU"))
    return path


def _clean(out: Path) -> None:
    if out.exists():
        if any(out.iterdir()) and not (out / MARKER).is_file():
            raise RenderError(f"{out} exists and was not rendered by cosyvoice_triton ({MARKER} missing): "
                              "refusing to delete it")
        shutil.rmtree(out)
    out.mkdir(parents=True)


def render_repository(flavor: str, out_dir: str | Path, *, model_dir: str | Path,
                      onnx_dir: str | Path = "build/onnx", engine_dir: str | Path = "build/engines",
                      precision: str | Mapping[str, str] = "fp32", templates_dir: str | Path | None = None,
                      allow_missing: bool = False, profile: str = "",
                      quality_report: str | Path = DEFAULT_QUALITY_REPORT, ensemble_dir: str | Path | None = None,
                      versions: Sequence[VersionSpec] = (), live_version: int = 0,
                      **tunables: Any) -> RenderReport:
    """Render the repository of ``flavor`` into ``out_dir`` (deleted and rewritten).

    Args:
        flavor: ``local``, ``onnx`` or ``trt`` (see the module docstring).
        model_dir: the CosyVoice2 folder (the stages read its ``cosyvoice2.yaml``).
        onnx_dir: the export's root (``<onnx_dir>/<precision>/<graph>.onnx``, falling back like the engines).
        engine_dir: TensorRT plans (``<engine_dir>/<precision>/<graph>.plan``), flavor ``trt``.
        precision: ``fp32``, ``fp16``, ``int8`` or (flavor ``local``) ``int8_cpu`` for every graph (the
            :data:`FP32_ONLY` graphs stay fp32; a missing file falls back along :data:`ONNX_FALLBACK`);
            ``cpu-choice``: the CPU precision per graph of ``quality_report``'s decisions (flavor ``local``);
            ``"GRAPH=PRECISION,..."`` or a mapping: those graphs in those precisions, the others fp32. A
            per-graph choice needs its file. The configs' notes and the marker record what each graph got.
        quality_report: the quality report JSON that ``cpu-choice`` reads (``make quality``).
        templates_dir: the ``model_repository/`` source (default: this source tree's); the pipelines are read from
            ``ensemble/`` beside it (``ensemble_dir``, if given, must be that folder).
        allow_missing: write empty placeholders for missing ONNX / plan files (structural checks only).
        profile: a name of :data:`PROFILES` (``plain``: :data:`PLAIN_TUNABLES`, flavor ``local`` and precision
            ``fp32`` only); ``tunables`` may add to it but not contradict it.
        versions: numbered versions (:class:`~cosyvoice_triton.serving.versioning.VersionSpec`: model folder,
            export, precision) of the graphs and ``flow`` / ``hift``, each with its pipeline ``cosyvoice_vc_v<N>`` and
            manifest, and the router as ``cosyvoice_vc`` (:mod:`cosyvoice_triton.serving.launch.rollout`);
            ``model_dir`` / ``onnx_dir`` / ``precision`` are then the live version's (``live_version``, default the
            lowest), and the streaming VC, speakers and TTS models are not rendered (they would call the graphs'
            latest version).
        tunables: fields of :class:`Tunables`.
    """
    if flavor not in FLAVORS:
        raise RenderError(f"flavor must be one of {', '.join(FLAVORS)}, got {flavor!r}")
    versions, live_spec = _check_versions(versions, live_version, tunables, allow_missing)
    if live_spec is not None:
        model_dir, onnx_dir, precision = live_spec.model_dir, live_spec.onnx_dir, live_spec.precision
    plan = precision_plan(precision, flavor, quality_report=quality_report)
    known = {f.name for f in fields(Tunables)}
    unknown = sorted(set(tunables) - known)
    if unknown:
        raise RenderError(f"unknown tunable(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if profile:
        tunables = _apply_profile(profile, flavor, plan, tunables)
    tun = Tunables(**tunables)
    if tun.lm_backend == "tensorrtllm" and flavor == "local":
        raise RenderError("lm_backend=tensorrtllm needs a GPU flavor (onnx or trt): the TensorRT-LLM backend runs "
                          "on NVIDIA GPUs only")
    templates = Path(templates_dir) if templates_dir else default_templates_dir()
    root = templates.parent  # model_repository/ and ensemble/ side by side
    if ensemble_dir is not None and Path(ensemble_dir).resolve() != (root / "ensemble").resolve():
        raise RenderError(f"ensemble_dir {ensemble_dir} must be {root / 'ensemble'}: the pipelines' folder lies "
                          "beside model_repository/")
    model_dir = Path(model_dir).resolve()
    onnx_dir, engine_dir = Path(onnx_dir).resolve(), Path(engine_dir).resolve()
    if not (model_dir / "cosyvoice2.yaml").is_file() and not allow_missing:
        raise RenderError(f"{model_dir}/cosyvoice2.yaml not found: model_dir must be a CosyVoice2 folder")
    _check_plan(plan, flavor, onnx_dir, tun, allow_missing)  # before anything is deleted or written
    cv3_dir = _cosyvoice3_dir(tun, allow_missing)
    if tun.cosyvoice3_vocoder_precision != "fp32" and (flavor != "local" or tun.device != "cpu"):
        raise RenderError(f"tunable cosyvoice3_vocoder_precision={tun.cosyvoice3_vocoder_precision}: onnxruntime's "
                          f"CPU INT8, served by the local flavor on the CPU only (flavor {flavor}, device "
                          f"{tun.device})")
    cv3_graphs = _cv3_graph_files(tun, cv3_dir, allow_missing)
    if precision == CPU_CHOICE:
        _warn_foreign_report(quality_report, model_dir, onnx_dir)
    out = Path(out_dir)
    _clean(out)
    files: list[Path] = []
    models: dict[str, str] = {}
    note = ("generated by cosyvoice_triton.serving.repository from {src} (flavor " + flavor
            + (f", profile {profile}" if profile else "") + "): do not edit, edit the template and render again")

    def common(name: str) -> dict[str, Any]:
        original = name.removesuffix(TASK_SUFFIX) if name in TASK_COPIES else name  # a copy: as many by default
        default = next((m.instances for m in SERVED_MODELS if m.name == original), 1)
        default = tun.instances.get(original, default)
        return {"dynamic_batching": _dynamic_batching_block(tun, name),
                "instance_count": _instance_count(tun, name, int(tun.instances.get(name, default)))}

    def source(rel: str) -> Path:  # a path of the table (model_repository/... or ensemble/...) in this render
        head, _, rest = rel.partition("/")
        return templates / rest if head == "model_repository" else root / rel

    def write(name: str, template: str, values: Mapping[str, Any], src: Path | None = None) -> None:
        src = src or source(template)
        if not src.is_file():
            raise RenderError(f"template {src} not found")
        text = render_template(src.read_text(), {"generated_note": note.format(src=template), **values},
                               source=str(src))
        path = out / name / "config.pbtxt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n")
        files.append(path)

    def python_code(name: str, src_dir: Path) -> None:
        src = src_dir / "model.py"
        if not src.is_file():
            raise RenderError(f"{src} not found")
        dst = out / name / "1" / "model.py"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        files.append(dst)

    has_tts = _has_tts(model_dir, tun)
    isolate = tun.task_isolation
    if isolate and (versions or not has_tts):
        raise RenderError("task_isolation copies the stages TTS shares with VC: it needs the TTS models (tts=on or a "
                          "folder with llm.pt) and no versions (a versioned render has no TTS models)")

    def copy_for_tts(name: str, template: str, values: Mapping[str, Any], params: Mapping[str, Any],
                     src: Path | None = None) -> None:
        """The TTS task's copy of model ``name`` (``task_isolation``): its folder, config renamed, ``params`` with
        the copy's own ``nice``."""
        copy = f"{name}{TASK_SUFFIX}"
        shutil.copytree(out / name, out / copy)
        files.extend(p for p in (out / copy).rglob("*") if p.is_file() and p.name != "config.pbtxt")
        own = {k: v for k, v in params.items() if k != "nice"} | (_nice(tun, copy) if params else {})
        write(copy, template, {**values, **common(copy), "name": copy, "parameters": _parameters_block(own)}, src)
        models[copy] = f"{models[name]}, the TTS task's copy (task_isolation)"

    # --- the six graphs
    graph_precisions: dict[str, str] = {}
    served_graphs: dict[int, dict[str, tuple[Path, str]]] = {v.number: {} for v in versions}
    for name, spec in GRAPHS.items():
        asked = plan.graphs[name]
        onnx_path = _onnx_file(onnx_dir, name, asked, strict=plan.strict)
        served = onnx_path.parent.name if onnx_path.is_file() else asked
        if onnx_path.is_file() and not (flavor == "trt" and name not in EXCLUDED):
            check_onnx_io(onnx_path, name)
        params: dict[str, Any] = {}
        ragged = False
        if flavor == "local":
            backend, kind, ragged = 'backend: "python"', "KIND_CPU", True
            runtime = tun.runtime if name in TORCH_GRAPHS else "onnxruntime"
            if runtime == "onnxruntime" and not onnx_path.is_file() and not allow_missing:
                raise RenderError(f"{onnx_path} not found (make export first)")
            if runtime == "torch":
                served = "fp32 (torch)"
            params = {"graph": name, "runtime": runtime, "onnx_path": str(onnx_path) if runtime == "onnxruntime"
                      else "", "model_dir": str(model_dir) if runtime == "torch" else "", "device": tun.device,
                      "intra_op_threads": tun.intra_op_threads, "torch_threads": tun.torch_threads,
                      **({"graph_cache_mb": tun.graph_cache_mb} if name in RESPONSE_CACHE_GRAPHS else {}),
                      **_nice(tun, name)}
            if versions:
                params["onnx_path"] = "model.onnx"  # in each version's folder
            python_code(name, templates / "graph")
            runtime_note = (f"Python backend, {runtime} on {tun.device}, precision {served}"
                            + (f" of {onnx_path}" if runtime == "onnxruntime" else "")
                            + f" (asked: {plan.describe(name)}) (model_repository/graph/model.py)")
            models[name] = f"python ({runtime}, {served})"
        elif flavor == "trt" and name not in EXCLUDED:
            backend = 'platform: "tensorrt_plan"\ndefault_model_filename: "model.plan"'
            kind = tun.instance_kind or "KIND_GPU"
            served = asked
            files.append(_place(engine_dir / asked / f"{name}.plan", out / name / "1" / "model.plan",
                                allow_missing))
            runtime_note = f"TensorRT engine {engine_dir / asked / (name + '.plan')} (precision {plan.describe(name)})"
            models[name] = f"tensorrt_plan ({served})"
        else:
            backend = 'backend: "onnxruntime"\ndefault_model_filename: "model.onnx"'
            kind = tun.instance_kind or "KIND_GPU"
            files.append(_place(onnx_path, out / name / "1" / "model.onnx", allow_missing))
            why = f" ({EXCLUDED[name].reason})" if flavor == "trt" else ""
            runtime_note = f"onnxruntime backend, precision {served} of {onnx_path} (asked: {plan.describe(name)}){why}"
            models[name] = f"onnxruntime ({served})"
        graph_precisions[name] = served
        warmup = ""
        if tun.warmup:
            samples, batch = graph_warmup_samples(name)
            files += _write_warmup(out / name, samples)
            warmup = _warmup_block(samples, batch)
        values = {
            **common(name), "name": name, "graph": name, "graph_doc": spec.doc, "flavor": flavor,
            "runtime_note": runtime_note, "backend": backend, "max_batch_size": spec.max_batch_size,
            "inputs": _io_block("input", spec.inputs, ragged=ragged), "outputs": _io_block("output", spec.outputs),
            "instance_kind": kind, "parameters": _parameters_block(params), "warmup": warmup,
            "response_cache": _response_cache_block(tun, name)}
        template = templates / "graph" / "config.pbtxt.in"
        write(name, "model_repository/graph/config.pbtxt.in", values, template)
        if isolate:
            copy_for_tts(name, "model_repository/graph/config.pbtxt.in", values, params, template)
        if versions:
            files += _graph_versions(out / name, name, flavor, versions, engine_dir, quality_report, tun,
                                     allow_missing, served_graphs)

    # --- CosyVoice3's estimator and vocoder graphs (tunable cosyvoice3_onnx_dir), called by the CosyVoice3 models
    cv3_precisions: dict[str, str] = {}
    for name, path in cv3_graphs.items():
        spec = GRAPHS3[name]
        cv3_precision = tun.cosyvoice3_vocoder_precision if name == VOCODER_GRAPH else "fp32"
        cv3_precisions[name] = cv3_precision
        if flavor == "local":
            backend, kind, ragged = 'backend: "python"', "KIND_CPU", True
            params = {"graph": name, "onnx_path": str(path), "device": tun.device,
                      "intra_op_threads": tun.intra_op_threads, **_nice(tun, name)}
            python_code(name, templates / "graph")
            runtime_note = (f"Python backend, onnxruntime on {tun.device}, {cv3_precision} of {path} "
                            "(model_repository/graph/model.py)")
            models[name] = f"python (onnxruntime, {cv3_precision})"
        else:
            backend = 'backend: "onnxruntime"\ndefault_model_filename: "model.onnx"'
            kind, ragged, params = tun.instance_kind or "KIND_GPU", False, {}
            files.append(_place(path, out / name / "1" / "model.onnx", allow_missing))
            runtime_note = f"onnxruntime backend, fp32 of {path}" + (
                " (no TensorRT plan of CosyVoice3's DiT is built)" if flavor == "trt" else "")
            models[name] = "onnxruntime (fp32)"
        write(name, "model_repository/graph/config.pbtxt.in", {
            **common(name), "name": name, "graph": name, "graph_doc": spec.doc, "flavor": flavor,
            "runtime_note": runtime_note, "backend": backend, "max_batch_size": spec.max_batch_size,
            "inputs": _io_block("input", spec.inputs, ragged=ragged), "outputs": _io_block("output", spec.outputs),
            "instance_kind": kind, "parameters": _parameters_block(params), "warmup": "", "response_cache": ""},
            templates / "graph" / "config.pbtxt.in")

    # --- the served models of SERVED_MODELS: the stages (model_repository/) and the pipelines (ensemble/)
    ctx = RenderContext(flavor=flavor, tunables=tun, model_dir=model_dir, has_tts=has_tts, engine_dir=engine_dir,
                        cosyvoice3_dir=cv3_dir, cosyvoice3_graphs=bool(cv3_graphs))
    for entry in SERVED_MODELS:
        if not entry.enabled(ctx) or (versions and entry.name in NOT_VERSIONED):
            continue
        name = entry.name
        if versions and name == VC_MODEL:
            files += _version_pipelines(out, entry, versions, live_spec.number, served_graphs, flavor, note,
                                        write, source, ctx)
            models[name] = "python (router: " + ", ".join(_pipeline_model(v.number) for v in versions) + ")"
            models.update({_pipeline_model(v.number): "ensemble" if v.family != COSYVOICE3 else
                           f"python ({CV3_VC_MODEL} on {v.model_dir})" for v in versions})
            continue
        src_dir = source(entry.folder)
        if entry.kind in ("ensemble", "backend"):
            outputs = list(entry.outputs) + ([AUDIO_BYTES] if tun.output_format and name == VC_MODEL else [])
            write(name, f"{entry.folder}/config.pbtxt.in", {
                "name": name, "inputs": _io_block("input", entry.inputs, optional=entry.optional),
                "outputs": _io_block("output", outputs), **(entry.values(ctx) if entry.values else {})},
                  src_dir / "config.pbtxt.in")
            (out / name / "1").mkdir(parents=True, exist_ok=True)  # a version folder (empty: the config says all)
            models[name] = entry.kind if entry.kind == "ensemble" else entry.doc.split(":")[0]
            continue
        params = dict(entry.parameters(ctx)) if entry.parameters else {}
        if name in NICE_MODELS:
            params.update(_nice(tun, name))
        if versions and name in VERSIONED:
            params["pin_graph_version"] = True
        declared = {p.name for p in MODEL_PARAMS.get(entry.params_key or name, ())}
        if not set(params) <= declared:
            raise RenderError(f"{name}: parameters {sorted(set(params) - declared)} are not declared in "
                              f"MODEL_PARAMS[{entry.params_key or name!r}]")
        outputs = list(entry.outputs) + ([AUDIO_BYTES] if name == "postprocess" and tun.output_format else [])
        warmup = ""
        samples = entry.warmup(ctx) if tun.warmup and entry.warmup else None
        if samples is not None:
            files += _write_warmup(out / name, samples)
            warmup = _warmup_block(samples, 1)
        values = {
            **common(name), "name": name, "stage_doc": f"{name}: {entry.doc}", "source": entry.folder,
            "max_batch_size": entry.max_batch_size,
            "inputs": _io_block("input", entry.inputs, ragged=True, optional=entry.optional),
            "outputs": _io_block("output", outputs), "parameters": _parameters_block(params),
            "model_transaction_policy": ("model_transaction_policy { decoupled: true }" if entry.is_decoupled(ctx)
                                         else ""),
            "warmup": warmup, **(entry.values(ctx) if entry.values else {})}
        write(name, entry.template, values)
        python_code(name, src_dir)
        if versions and name in VERSIONED:
            files += _stage_versions(out / name, versions)
        models[name] = "python" + (" (decoupled)" if entry.is_decoupled(ctx) else "")
        if isolate and name in ISOLATED_STAGES:  # its callees: the TTS copies of the graphs
            callees = {k: f"{v}{TASK_SUFFIX}" for k, v in params.items() if k.endswith("_model")}
            copy_for_tts(name, entry.template, {
                **values, "stage_doc": f"{name}{TASK_SUFFIX}: the TTS task's copy of {name} (task_isolation): "
                                       f"{entry.doc}"}, {**params, **callees})

    marker = {"flavor": flavor, "profile": profile,
              "precision": dict(precision) if isinstance(precision, Mapping) else precision,
              "precision_source": plan.source, "graph_precisions": graph_precisions,
              "cosyvoice3_graph_precisions": cv3_precisions, "model_dir": str(model_dir),
              "onnx_dir": str(onnx_dir), "engine_dir": str(engine_dir), "templates": str(templates.resolve()),
              "models": models,
              "versions": {str(v.number): _pipeline_model(v.number) for v in versions},
              "live_version": live_spec.number if live_spec is not None else 0,
              "tunables": {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in asdict(tun).items()}}
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    log.info("rendered %s (%s, %d models)", out, flavor, len(models))
    return RenderReport(flavor, out, models, files, profile)


def _apply_profile(profile: str, flavor: str, plan: PrecisionPlan, tunables: Mapping[str, Any]) -> dict[str, Any]:
    """``tunables`` on top of the named profile; refuses a flavor, precision or tunable that contradicts it."""
    if profile not in PROFILES:
        raise RenderError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    not_fp32 = {g: p for g, p in plan.graphs.items() if p != "fp32"}
    if profile == "plain" and (flavor != "local" or not_fp32):
        raise RenderError(f"profile plain is the PyTorch fp32 deployment: flavor local and precision fp32 only, "
                          f"got flavor {flavor}" + (f", precision {plan.source}" if not_fp32 else ""))
    clash = sorted(k for k, v in PROFILES[profile].items() if k in tunables and tunables[k] != v)
    if clash:
        raise RenderError(f"profile {profile} sets {', '.join(f'{k}={PROFILES[profile][k]!r}' for k in clash)}; "
                          f"got {', '.join(f'{k}={tunables[k]!r}' for k in clash)}")
    return {**PROFILES[profile], **tunables}
