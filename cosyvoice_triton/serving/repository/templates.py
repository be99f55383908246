"""The templates and the config text blocks of the model repository: ``${name}`` substitution, the tensor,
``parameters`` and warm-up blocks of a ``config.pbtxt``, and the graphs' warm-up samples."""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ...resources import path as resource_path
from ...shapes import (
    GRAPHS,
    TensorSpec,
)

_PLACEHOLDER = re.compile(r"\$\{([a-z_][a-z0-9_]*)\}")
_DTYPES = {"float32": "TYPE_FP32", "int32": "TYPE_INT32", "int64": "TYPE_INT64", "uint64": "TYPE_UINT64",
           "bool": "TYPE_BOOL", "bytes": "TYPE_STRING"}
AUDIO_BYTES = TensorSpec("audio_bytes", "bytes", ("batch", 1))


class RenderError(ValueError):
    """A template, tunable or input file that does not allow rendering the repository."""


def default_templates_dir() -> Path:
    """``model_repository/``: the clone's, or the installed package's copy (:mod:`cosyvoice_triton.resources`);
    ``$COSYVOICE_TEMPLATES`` overrides."""
    env = os.environ.get("COSYVOICE_TEMPLATES")
    return Path(env) if env else resource_path("model_repository")


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
