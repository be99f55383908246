"""Render the Triton model repository (``build/model_repository``) from the templates in ``model_repository/``.

One source: ``model_repository/`` holds a template per kind of model (``graph/config.pbtxt.in`` for the six
exported graphs, ``stage/config.pbtxt.in`` for the Python stages, ``cosyvoice_vc/config.pbtxt.in`` for the
ensemble) and the thin ``model.py`` adapters. Everything else is derived here: tensor names, dtypes, dims and
max batch sizes from :data:`~cosyvoice_triton.shapes.GRAPHS` / :data:`~cosyvoice_triton.shapes.STAGES`, config
``parameters`` from :data:`~cosyvoice_triton.serving.model_params.MODEL_PARAMS` and the tunables.

Templates use ``${name}`` placeholders and are strict: a placeholder without a value, a value without a
placeholder, or a ``$`` that is not a well-formed placeholder is an error (:class:`RenderError`). The output
folder is rendered anew each time (a folder that this module did not write is never deleted).

Flavors:

* ``local``: every model on the Python backend; the graphs run on onnxruntime on the CPU from
  ``<onnx_dir>/<precision>`` (or, ``runtime="torch"``, as the checkpoint's PyTorch modules, e.g. on CUDA where
  there is a GPU but no TensorRT). Runs with the ``tritonserver`` of the ``nvidia-pytriton`` wheel.
* ``onnx``: the graphs on Triton's native ``onnxruntime`` backend (the NGC image), ONNX files copied in.
* ``trt``: the graphs on ``tensorrt_plan`` from ``<engine_dir>/<precision>/<graph>.plan``, except those
  :data:`cosyvoice_triton.trt.EXCLUDED` keeps on onnxruntime (``hift_source``: float64; ``speech_tokenizer``).

The stages (``preprocess``, ``flow``, ``hift``, ``postprocess``) and the ``cosyvoice_vc`` ensemble are the same
in every flavor; ``flow`` and ``hift`` reach the graphs by BLS.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from .serving.model_params import MODEL_PARAMS
from .shapes import GRAPHS, STAGES, VC_INPUTS, VC_MODEL, VC_OPTIONAL_INPUTS, VC_OUTPUTS, TensorSpec
from .trt import EXCLUDED, ONNX_FALLBACK, PRECISIONS

log = logging.getLogger(__name__)

__all__ = ["FLAVORS", "MARKER", "RenderError", "RenderReport", "Tunables", "default_templates_dir",
           "render_repository", "render_template"]

FLAVORS = ("local", "onnx", "trt")
MARKER = "cosyvoice_repository.json"  # written into every rendered repository (and read before deleting one)
STAGE_MODELS = ("preprocess", "flow", "hift", "postprocess")
#: Stages that call other models by BLS: no warm-up (their callees may not be loaded yet at that point).
BLS_STAGES = ("flow", "hift")
_PLACEHOLDER = re.compile(r"\$\{([a-z_][a-z0-9_]*)\}")
_DTYPES = {"float32": "TYPE_FP32", "int32": "TYPE_INT32", "int64": "TYPE_INT64", "bool": "TYPE_BOOL",
           "bytes": "TYPE_STRING"}
AUDIO_BYTES = TensorSpec("audio_bytes", "bytes", ("batch", 1))


class RenderError(ValueError):
    """A template, tunable or input file that does not allow rendering the repository."""


def default_templates_dir() -> Path:
    """``model_repository/`` of the source tree this package lives in (``$COSYVOICE_TEMPLATES`` overrides)."""
    env = os.environ.get("COSYVOICE_TEMPLATES")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "model_repository"


def render_template(text: str, values: Mapping[str, Any], *, source: str = "template") -> str:
    """Substitute ``${name}`` placeholders; every placeholder needs a value and every value a placeholder."""
    used = set(_PLACEHOLDER.findall(text))
    stray = [m.start() for m in re.finditer(r"\$", text) if not _PLACEHOLDER.match(text, m.start())]
    if stray:
        line = text.count("\n", 0, stray[0]) + 1
        raise RenderError(f"{source}:{line}: '$' that is not a ${{name}} placeholder (lower_snake names only)")
    missing = sorted(used - set(values))
    if missing:
        raise RenderError(f"{source}: no value for placeholder(s) {', '.join(missing)}")
    leftover = sorted(set(values) - used)
    if leftover:
        raise RenderError(f"{source}: value(s) {', '.join(leftover)} have no placeholder in the template")
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), text)


@dataclass(frozen=True)
class Tunables:
    """What a deployment may tune; each ends up in a config field or ``parameters`` entry."""

    max_queue_delay_us: int = 2000  # dynamic batcher: how long a request waits for others
    max_queue_size: int = 64  # per model: requests beyond are rejected at once (UNAVAILABLE)
    queue_timeout_us: int = 120_000_000  # a request queued longer is rejected (0: no timeout)
    instances: Mapping[str, int] = field(default_factory=dict)  # model -> instance count (default 1)
    instance_kind: str = ""  # graphs of onnx / trt: KIND_GPU by default; local: KIND_CPU
    intra_op_threads: int = 1  # onnxruntime threads per local graph instance
    torch_threads: int = 1
    runtime: str = "onnxruntime"  # local graphs: onnxruntime or torch
    device: str = "cpu"  # local graphs: cpu or cuda
    n_timesteps: int = 0  # flow Euler steps (0: the model's)
    min_seconds: float = 0.1
    max_seconds: float = 30.0
    vad_trim: bool = False  # preprocess: Silero VAD trim of source and prompt (needs silero-vad)
    denoise_prompt: bool = False  # preprocess: spectral-gating noise reduction of the prompt
    default_seed: int = 0
    output_sample_rate: int = 0
    loudness_lufs: float = 0.0
    peak_dbfs: float = -1.0
    output_format: str = ""
    bls_timeout_us: int = 0
    warmup: bool = True

    def __post_init__(self):
        for name in ("max_queue_delay_us", "max_queue_size", "queue_timeout_us", "intra_op_threads",
                     "torch_threads", "n_timesteps", "bls_timeout_us", "output_sample_rate", "default_seed"):
            if int(getattr(self, name)) < 0:
                raise RenderError(f"tunable {name} must be >= 0, got {getattr(self, name)}")
        if self.max_queue_size < 1:
            raise RenderError("tunable max_queue_size must be >= 1")
        if self.runtime not in MODEL_PARAMS["graph"][1].choices:
            raise RenderError(f"tunable runtime must be one of {MODEL_PARAMS['graph'][1].choices}, got "
                              f"{self.runtime!r}")
        if self.instance_kind not in ("", "KIND_CPU", "KIND_GPU"):
            raise RenderError(f"tunable instance_kind must be KIND_CPU or KIND_GPU, got {self.instance_kind!r}")
        if self.output_format not in ("", "wav", "flac"):
            raise RenderError(f"tunable output_format must be '', wav or flac, got {self.output_format!r}")
        for model, n in self.instances.items():
            if model not in (*GRAPHS, *STAGE_MODELS):
                raise RenderError(f"tunable instances: unknown model {model!r}")
            if int(n) < 1:
                raise RenderError(f"tunable instances[{model!r}] must be >= 1, got {n}")


@dataclass
class RenderReport:
    flavor: str
    out_dir: Path
    models: dict[str, str]  # model -> backend / platform
    files: list[Path]

    def describe(self) -> str:
        lines = [f"rendered {self.out_dir} (flavor {self.flavor}):"]
        lines += [f"  {m:<18} {b}" for m, b in self.models.items()]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------- pbtxt blocks


def _dims(t: TensorSpec) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in t.shape[1:]]


def _tensor_entry(t: TensorSpec, *, ragged: bool = False, optional: bool = False) -> str:
    dims = _dims(t)
    parts = [f'name: "{t.name}"', f"data_type: {_DTYPES[t.dtype]}"]
    if not dims:  # a [batch] tensor of the spec: [batch, 1] in requests, reshaped for the model
        parts += ["dims: [ 1 ]", "reshape: { shape: [ ] }"]
    else:
        parts.append(f"dims: [ {', '.join(map(str, dims))} ]")
    if ragged:
        parts.append("allow_ragged_batch: true")
    if optional:
        parts.append("optional: true")
    return "  { " + " ".join(parts) + " }"


def _io_block(kind: str, tensors: Iterable[TensorSpec], *, ragged: bool = False,
              optional: Iterable[str] = ()) -> str:
    optional = set(optional)
    entries = [_tensor_entry(t, ragged=ragged and kind == "input", optional=t.name in optional) for t in tensors]
    return f"{kind} [\n" + ",\n".join(entries) + "\n]"


def _parameters_block(params: Mapping[str, Any]) -> str:
    if not params:
        return ""
    lines = []
    for k, v in params.items():
        text = ("true" if v else "false") if isinstance(v, bool) else str(v)
        lines.append(f'parameters {{ key: "{k}" value: {{ string_value: {json.dumps(text)} }} }}')
    return "\n".join(lines)


def _warmup_block(samples: Mapping[str, np.ndarray], batch: int) -> str:
    inputs = []
    for name, arr in samples.items():
        dims = list(arr.shape) or [1]
        dtype = _DTYPES[str(arr.dtype) if arr.dtype != np.bool_ else "bool"]
        inputs.append(f'    inputs {{ key: "{name}" value: {{ data_type: {dtype} dims: [ {", ".join(map(str, dims))} ] '
                      f'input_data_file: "{name}" }} }}')
    return ("model_warmup [\n  {\n    name: \"sample\"\n    batch_size: " + str(batch) + "\n"
            + "\n".join(inputs) + "\n  }\n]")


def _write_warmup(model_dir: Path, samples: Mapping[str, np.ndarray]) -> list[Path]:
    out = model_dir / "warmup"
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for name, arr in samples.items():
        path = out / name
        path.write_bytes(np.ascontiguousarray(arr).tobytes())
        files.append(path)
    return files


def graph_warmup_samples(name: str) -> tuple[dict[str, np.ndarray], int]:
    """Deterministic warm-up inputs of a graph (one sample without batch axis, and the batch size): short
    lengths within the spec's ranges, lengths consistent with the data."""
    spec = GRAPHS[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    sizes = {axis: max(r.min, min(r.max, 64)) for axis, r in spec.axes.items()}
    batch = spec.axes["batch"].min
    samples = {}
    for t in spec.inputs:
        shape = spec.resolve(t, sizes)[1:]
        if t.dtype == "bool":
            arr = np.zeros(shape, bool)
        elif t.name == "lookahead_len":
            arr = np.zeros(shape or (1,), np.int32)
        elif t.name.endswith("_len"):
            axis = {"whisper_mel_len": "whisper_frames", "speech_token_len": "tokens"}[t.name]
            arr = np.full(shape or (1,), sizes[axis], np.int32)
        elif t.dtype == "int32":
            arr = rng.integers(0, 100, shape).astype(np.int32)
        elif t.name == "mask":
            arr = np.ones(shape, np.float32)
        elif t.name == "t":
            arr = np.full(shape or (1,), 0.5, np.float32)
        else:
            arr = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        samples[t.name] = arr
    return samples, batch


def stage_warmup_samples(name: str, seconds: float = 1.0) -> dict[str, np.ndarray] | None:
    """Warm-up inputs of the Python stages that do not call other models (None: no warm-up); ``seconds``: the
    length of the preprocess sample (at least the configured minimum, or the warm-up would be refused)."""
    if name == "preprocess":
        sr = 16000
        t = np.arange(int(sr * seconds)) / sr
        speech = (0.3 * np.sin(2 * np.pi * 150 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
        return {"source_audio": speech, "source_sample_rate": np.array([sr], np.int32),
                "prompt_audio": speech, "prompt_sample_rate": np.array([sr], np.int32)}
    if name == "postprocess":
        return {"waveform": (0.1 * np.sin(np.arange(12000) * 0.05)).astype(np.float32)}
    return None


# ------------------------------------------------------------------------------------------- rendering


def _onnx_file(onnx_dir: Path, graph: str, precision: str) -> Path:
    for p in ONNX_FALLBACK[precision]:
        path = onnx_dir / p / f"{graph}.onnx"
        if path.is_file():
            return path
    return onnx_dir / "fp32" / f"{graph}.onnx"


#: Graphs whose ONNX file is always the fp32 one, whatever the precision (phase accumulation in float64/32).
FP32_ONLY = ("hift_source",)
_ONNX_ELEM = {1: "float32", 6: "int32", 7: "int64", 9: "bool", 10: "float16"}


def check_onnx_io(path: Path, graph: str) -> None:
    """The file's input / output names and element types must be the spec's (a converted fp16 file must keep
    float32 I/O), or the Triton config rendered from the spec would not load it."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    spec = GRAPHS[graph]
    for kind, declared, values in (("input", spec.inputs, model.graph.input), ("output", spec.outputs,
                                                                               model.graph.output)):
        got = {v.name: _ONNX_ELEM.get(v.type.tensor_type.elem_type, str(v.type.tensor_type.elem_type))
               for v in values}
        for t in declared:
            if got.get(t.name) != t.dtype:
                raise RenderError(f"{path}: {kind} {t.name!r} is {got.get(t.name, 'absent')}, the spec says "
                                  f"{t.dtype} (convert with float32 I/O kept, e.g. keep_io_types=True)")


def _place(src: Path, dst: Path, allow_missing: bool) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not src.is_file():
        if not allow_missing:
            raise RenderError(f"{src} not found (make export / make engines first)")
        dst.write_bytes(b"")  # structural render: an empty placeholder where the file will be
        return dst
    try:
        os.link(src, dst)  # same file system: no copy of a large graph
    except OSError:
        shutil.copy2(src, dst)
    return dst


def _clean(out: Path) -> None:
    if out.exists():
        if any(out.iterdir()) and not (out / MARKER).is_file():
            raise RenderError(f"{out} exists and was not rendered by cosyvoice_triton ({MARKER} missing): "
                              "refusing to delete it")
        shutil.rmtree(out)
    out.mkdir(parents=True)


def render_repository(flavor: str, out_dir: str | Path, *, model_dir: str | Path,
                      onnx_dir: str | Path = "build/onnx", engine_dir: str | Path = "build/engines",
                      precision: str = "fp32", templates_dir: str | Path | None = None,
                      allow_missing: bool = False, **tunables: Any) -> RenderReport:
    """Render the repository of ``flavor`` into ``out_dir`` (deleted and rewritten).

    Args:
        flavor: ``local``, ``onnx`` or ``trt`` (see the module docstring).
        model_dir: the CosyVoice2 folder (the stages read its ``cosyvoice2.yaml``).
        onnx_dir: the export's root (``<onnx_dir>/<precision>/<graph>.onnx``, falling back like the engines).
        engine_dir: TensorRT plans (``<engine_dir>/<precision>/<graph>.plan``), flavor ``trt``.
        precision: ``fp32``, ``fp16`` or ``int8``.
        templates_dir: the ``model_repository/`` source (default: this source tree's).
        allow_missing: write empty placeholders for missing ONNX / plan files (structural checks only).
        tunables: fields of :class:`Tunables`.
    """
    if flavor not in FLAVORS:
        raise RenderError(f"flavor must be one of {', '.join(FLAVORS)}, got {flavor!r}")
    if precision not in PRECISIONS:
        raise RenderError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    known = {f.name for f in fields(Tunables)}
    unknown = sorted(set(tunables) - known)
    if unknown:
        raise RenderError(f"unknown tunable(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    tun = Tunables(**tunables)
    templates = Path(templates_dir) if templates_dir else default_templates_dir()
    model_dir = Path(model_dir).resolve()
    onnx_dir, engine_dir = Path(onnx_dir).resolve(), Path(engine_dir).resolve()
    if not (model_dir / "cosyvoice2.yaml").is_file() and not allow_missing:
        raise RenderError(f"{model_dir}/cosyvoice2.yaml not found: model_dir must be a CosyVoice2 folder")
    out = Path(out_dir)
    _clean(out)
    files: list[Path] = []
    models: dict[str, str] = {}
    note = ("generated by cosyvoice_triton.repository from {src} (flavor " + flavor
            + "): do not edit, edit the template and render again")

    def common(name: str) -> dict[str, Any]:
        return {"max_queue_delay_us": tun.max_queue_delay_us, "queue_timeout_us": tun.queue_timeout_us,
                "max_queue_size": tun.max_queue_size, "instance_count": int(tun.instances.get(name, 1))}

    def write(name: str, template: str, values: Mapping[str, Any]) -> None:
        src = templates / template
        if not src.is_file():
            raise RenderError(f"template {src} not found")
        text = render_template(src.read_text(), {"generated_note": note.format(src=f"model_repository/{template}"),
                                                 **values}, source=str(src))
        path = out / name / "config.pbtxt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n")
        files.append(path)

    def python_code(name: str, src_name: str) -> None:
        src = templates / src_name / "model.py"
        if not src.is_file():
            raise RenderError(f"{src} not found")
        dst = out / name / "1" / "model.py"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        files.append(dst)

    # --- the six graphs
    for name, spec in GRAPHS.items():
        onnx_path = _onnx_file(onnx_dir, name, "fp32" if name in FP32_ONLY else precision)
        if onnx_path.is_file() and not (flavor == "trt" and name not in EXCLUDED):
            check_onnx_io(onnx_path, name)
        params: dict[str, Any] = {}
        ragged = False
        if flavor == "local":
            backend, kind, ragged = 'backend: "python"', "KIND_CPU", True
            runtime = tun.runtime if name in ("flow_encoder", "flow_estimator", "hift_source",
                                              "hift_decoder") else "onnxruntime"
            if runtime == "onnxruntime" and not onnx_path.is_file() and not allow_missing:
                raise RenderError(f"{onnx_path} not found (make export first)")
            params = {"graph": name, "runtime": runtime, "onnx_path": str(onnx_path) if runtime == "onnxruntime"
                      else "", "model_dir": str(model_dir) if runtime == "torch" else "", "device": tun.device,
                      "intra_op_threads": tun.intra_op_threads, "torch_threads": tun.torch_threads}
            python_code(name, "graph")
            runtime_note = f"Python backend, {runtime} on {tun.device} (model_repository/graph/model.py)"
            models[name] = f"python ({runtime})"
        elif flavor == "trt" and name not in EXCLUDED:
            backend = 'platform: "tensorrt_plan"\ndefault_model_filename: "model.plan"'
            kind = tun.instance_kind or "KIND_GPU"
            files.append(_place(engine_dir / precision / f"{name}.plan", out / name / "1" / "model.plan",
                                allow_missing))
            runtime_note = f"TensorRT engine {engine_dir / precision / (name + '.plan')}"
            models[name] = "tensorrt_plan"
        else:
            backend = 'backend: "onnxruntime"\ndefault_model_filename: "model.onnx"'
            kind = tun.instance_kind or "KIND_GPU"
            files.append(_place(onnx_path, out / name / "1" / "model.onnx", allow_missing))
            why = f" ({EXCLUDED[name].reason})" if flavor == "trt" else ""
            runtime_note = f"onnxruntime backend, {onnx_path}{why}"
            models[name] = "onnxruntime"
        warmup = ""
        if tun.warmup:
            samples, batch = graph_warmup_samples(name)
            files += _write_warmup(out / name, samples)
            warmup = _warmup_block(samples, batch)
        write(name, "graph/config.pbtxt.in", {
            **common(name), "name": name, "graph": name, "graph_doc": spec.doc, "flavor": flavor,
            "runtime_note": runtime_note, "backend": backend, "max_batch_size": spec.max_batch_size,
            "inputs": _io_block("input", spec.inputs, ragged=ragged), "outputs": _io_block("output", spec.outputs),
            "instance_kind": kind, "parameters": _parameters_block(params), "warmup": warmup})

    # --- the Python stages
    stage_params: dict[str, dict[str, Any]] = {
        "preprocess": {"model_dir": str(model_dir), "min_seconds": tun.min_seconds, "max_seconds": tun.max_seconds,
                       "vad_trim": tun.vad_trim, "denoise_prompt": tun.denoise_prompt},
        "flow": {"model_dir": str(model_dir), "n_timesteps": tun.n_timesteps, "encoder_model": "flow_encoder",
                 "estimator_model": "flow_estimator", "bls_timeout_us": tun.bls_timeout_us,
                 "torch_threads": tun.torch_threads},
        "hift": {"source_model": "hift_source", "decoder_model": "hift_decoder", "default_seed": tun.default_seed,
                 "bls_timeout_us": tun.bls_timeout_us, "torch_threads": tun.torch_threads},
        "postprocess": {"model_sample_rate": _model_sample_rate(model_dir), "output_sample_rate":
                        tun.output_sample_rate, "loudness_lufs": tun.loudness_lufs, "peak_dbfs": tun.peak_dbfs,
                        "output_format": tun.output_format},
    }
    for name in STAGE_MODELS:
        stage = STAGES[name]
        declared = {p.name for p in MODEL_PARAMS[name]}
        assert set(stage_params[name]) <= declared, (name, set(stage_params[name]) - declared)
        outputs = list(stage.outputs) + ([AUDIO_BYTES] if name == "postprocess" and tun.output_format else [])
        warmup = ""
        seconds = min(max(1.0, tun.min_seconds), tun.max_seconds)
        samples = stage_warmup_samples(name, seconds) if tun.warmup and name not in BLS_STAGES else None
        if samples is not None:
            files += _write_warmup(out / name, samples)
            warmup = _warmup_block(samples, 1)
        write(name, "stage/config.pbtxt.in", {
            **common(name), "name": name, "stage_doc": f"{name}: {stage.doc}", "max_batch_size": stage.max_batch_size,
            "inputs": _io_block("input", stage.inputs, ragged=True, optional=stage.optional),
            "outputs": _io_block("output", outputs), "parameters": _parameters_block(stage_params[name]),
            "warmup": warmup})
        python_code(name, name)
        models[name] = "python"

    # --- the ensemble
    outputs = list(VC_OUTPUTS) + ([AUDIO_BYTES] if tun.output_format else [])
    extra = ('\n      output_map { key: "audio_bytes" value: "audio_bytes" }' if tun.output_format else "")
    write(VC_MODEL, f"{VC_MODEL}/config.pbtxt.in", {
        "name": VC_MODEL,
        "inputs": _io_block("input", (*VC_INPUTS, *VC_OPTIONAL_INPUTS),
                            optional=[t.name for t in (*VC_INPUTS, *VC_OPTIONAL_INPUTS)]),
        "outputs": _io_block("output", outputs), "postprocess_extra_outputs": extra})
    (out / VC_MODEL / "1").mkdir(parents=True, exist_ok=True)  # an ensemble needs an (empty) version folder
    models[VC_MODEL] = "ensemble"

    marker = {"flavor": flavor, "precision": precision, "model_dir": str(model_dir), "onnx_dir": str(onnx_dir),
              "engine_dir": str(engine_dir), "templates": str(templates.resolve()), "models": models,
              "tunables": {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in asdict(tun).items()}}
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    log.info("rendered %s (%s, %d models)", out, flavor, len(models))
    return RenderReport(flavor, out, models, files)


def _model_sample_rate(model_dir: Path) -> int:
    from .config import ModelConfig

    path = model_dir / "cosyvoice2.yaml"
    return ModelConfig.from_yaml(path).sample_rate if path.is_file() else 24000
