"""The checks of a KServe v2 inference request against the model's declared inputs, shared by the HTTP
(:mod:`.kserve_http`) and gRPC (:mod:`.kserve_grpc`) entry points, before Triton sees a byte of it.

A request Triton's own parsers would take can still hurt the server behind them: a declared shape whose element
count overflows, data that does not match its shape, a dtype the model does not declare, a shared-memory region, a
request parameter of the wrong type. Each is a 400 / INVALID_ARGUMENT naming the input here. What passes is exactly
what the model declares: known names, each input once, the declared dtype and rank, fixed dims equal, and as many
elements (or bytes) as the shape says.
A ``speaker_id`` is moved into the caller's namespace (:mod:`.tenants`), as ``/v1/audio/speech`` does."""

from __future__ import annotations

import codecs
import math
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import shown
from .errors import GatewayError
from .tenants import Namespace

#: Bytes an element of each KServe datatype takes (BYTES: length-prefixed, variable).
ELEMENT_BYTES = {"BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2, "BF16": 2, "UINT32": 4,
                 "INT32": 4, "FP32": 4, "UINT64": 8, "INT64": 8, "FP64": 8, "BYTES": None}
_INT_RANGES = {"UINT8": (0, 2**8 - 1), "INT8": (-(2**7), 2**7 - 1), "UINT16": (0, 2**16 - 1),
               "INT16": (-(2**15), 2**15 - 1), "UINT32": (0, 2**32 - 1), "INT32": (-(2**31), 2**31 - 1),
               "UINT64": (0, 2**64 - 1), "INT64": (-(2**63), 2**63 - 1)}
_FLOAT_MAX = {"FP16": 65504.0, "BF16": 3.3895313892515355e38, "FP32": 3.4028234663852886e38, "FP64": math.inf}
#: The largest dim a shape may declare (Triton's int64 dims; the data bound the product anyway).
MAX_DIM = 2**31 - 1
SPEAKER_INPUT = "speaker_id"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_PARAMETER = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_PARAMETER_CHARS = 256
#: Request parameters Triton reads itself, with the type it needs.
_TRITON_PARAMETERS = {"priority": (0, 2**64 - 1), "timeout": (0, 2**63 - 1), "sequence_id": (0, 2**64 - 1)}
_FLAGS = ("sequence_start", "sequence_end", "binary_data_output")


def bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, code="invalid_value", param=param)


@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str  # KServe's name: FP32, INT32, BYTES ...
    dims: tuple[int, ...]  # the request's dims, the batch dim first when the model batches; -1: any


@dataclass(frozen=True)
class Signature:
    """What a served model accepts, from Triton's model metadata (which is open; the configuration is behind the
    admin key): names, datatypes and dims (-1: any, the batch dim included). Metadata do not say which inputs are
    optional nor the largest batch: Triton checks those itself, as plain comparisons."""

    model: str
    inputs: Mapping[str, InputSpec]
    outputs: frozenset[str]

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Signature:
        """From Triton's model metadata as JSON (``GET /v2/models/<m>``, or gRPC ``ModelMetadata`` through
        ``MessageToDict``, whose int64 dims are strings)."""
        inputs = {t["name"]: InputSpec(t["name"], str(t.get("datatype", "")), tuple(int(d) for d in t.get("shape", ())))
                  for t in meta.get("inputs", ())}
        return cls(str(meta.get("name", "")), inputs, frozenset(t["name"] for t in meta.get("outputs", ())))


@dataclass(frozen=True)
class Tensor:
    """One input as the request declares it: ``values`` (JSON data or gRPC contents, flattened) or ``raw``
    (binary data: the HTTP binary extension or gRPC ``raw_input_contents``)."""

    name: str
    datatype: str
    shape: tuple[Any, ...]
    values: Sequence[Any] | None = None
    raw: bytes | None = None


def flatten(data: Any, rank: int, name: str) -> list[Any]:
    """KServe's JSON ``data``: flat, or nested row-major at most ``rank`` deep."""
    out: list[Any] = []
    stack = [iter(data if isinstance(data, list) else [data])]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) >= max(rank, 1):
                    raise bad(f"input {name!r}: data is nested deeper than its {rank} dims", name)
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def bytes_elements(raw: bytes, name: str) -> list[bytes]:
    """The elements of a BYTES tensor's binary form: each a 4-byte little-endian length, then its bytes."""
    out, at = [], 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise bad(f"input {name!r}: binary BYTES data ends inside an element's 4-byte length", name)
        (n,) = struct.unpack_from("<I", raw, at)
        if at + 4 + n > len(raw):
            raise bad(f"input {name!r}: a BYTES element of {n} bytes runs past the end of the data", name)
        out.append(raw[at + 4: at + 4 + n])
        at += 4 + n
    return out


def is_text(name: str) -> bool:
    """Whether a BYTES input holds text (UTF-8) rather than an encoded file (``*audio_bytes``)."""
    return not name.endswith("audio_bytes")


def _check_text_value(name: str, v: str | bytes) -> None:
    """A JSON string must be encodable (no lone surrogate); bytes must be UTF-8, but for a character cut at either
    end (a live model's text pieces may split one between two requests)."""
    if isinstance(v, str):
        try:
            v.encode()
        except UnicodeEncodeError as exc:
            raise bad(f"input {name!r}: not valid text (a lone surrogate at character {exc.start})", name) from None
        return
    head = 0
    while head < min(3, len(v)) and 0x80 <= v[head] <= 0xBF:  # the end of a character the piece before began
        head += 1
    try:
        codecs.getincrementaldecoder("utf-8")().decode(v[head:], final=False)  # a cut character at the end passes
    except UnicodeDecodeError as exc:
        raise bad(f"input {name!r}: not UTF-8 text ({exc.reason} at byte {head + exc.start})", name) from None


def encode_bytes(items: Iterable[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def _check_shape(spec: InputSpec, shape: Sequence[Any]) -> int:
    name = spec.name
    if len(shape) != len(spec.dims):
        raise bad(f"input {name!r}: shape {shown(list(shape))} has {len(shape)} dims; the model declares "
                  f"{len(spec.dims)} ({list(spec.dims)})", name)
    for i, (d, want) in enumerate(zip(shape, spec.dims, strict=True)):
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= MAX_DIM:
            raise bad(f"input {name!r}: dim {i} of the shape is {shown(d)}; each dim must be an integer in "
                      f"0..{MAX_DIM}", name)
        if want >= 0 and d != want:
            raise bad(f"input {name!r}: dim {i} is {d}; the model declares {want}", name)
    return math.prod(shape)


def _check_values(t: Tensor, count: int) -> None:
    values = t.values
    if len(values) != count:
        raise bad(f"input {t.name!r}: shape {list(t.shape)} has {count} elements; the data has {len(values)}", t.name)
    kind = t.datatype
    if kind == "BYTES":
        if not all(isinstance(v, (str, bytes)) for v in values):
            raise bad(f"input {t.name!r}: BYTES data must be strings", t.name)
        if is_text(t.name):
            for v in values:
                _check_text_value(t.name, v)
    elif kind == "BOOL":
        if not all(isinstance(v, bool) for v in values):
            raise bad(f"input {t.name!r}: BOOL data must be true or false", t.name)
    elif kind in _INT_RANGES:
        lo, hi = _INT_RANGES[kind]
        if not all(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi for v in values):
            raise bad(f"input {t.name!r}: {kind} data must be integers in {lo}..{hi}", t.name)
    else:
        top = _FLOAT_MAX[kind]
        for v in values:  # abs() of an int compares exactly: a 400-digit JSON integer is out of range, not an error
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not
                                                                        math.isfinite(v)) or abs(v) > top:
                raise bad(f"input {t.name!r}: {kind} data must be finite numbers within the type's range "
                          f"(got {shown(v)})", t.name)


def _check_raw(t: Tensor, count: int) -> None:
    size = ELEMENT_BYTES[t.datatype]
    if size is None:
        elements = bytes_elements(t.raw, t.name)
        n = len(elements)
        if is_text(t.name):
            for v in elements:
                _check_text_value(t.name, v)
        if n != count:
            raise bad(f"input {t.name!r}: shape {list(t.shape)} has {count} elements; the binary data holds {n}",
                      t.name)
    elif len(t.raw) != count * size:
        raise bad(f"input {t.name!r}: shape {list(t.shape)} of {t.datatype} is {count * size} bytes; the binary "
                  f"data is {len(t.raw)}", t.name)


def _scoped(t: Tensor, ns: Namespace) -> Tensor:
    def scope(v: str | bytes) -> str:
        try:
            text = v.decode() if isinstance(v, bytes) else v
        except UnicodeDecodeError:
            raise bad(f"input {t.name!r}: not UTF-8", t.name) from None
        return ns.scoped(text, param=t.name)

    if t.raw is not None:
        return replace(t, raw=encode_bytes(scope(v).encode() for v in bytes_elements(t.raw, t.name)))
    return replace(t, values=[scope(v) for v in t.values])


def check_request(sig: Signature, tensors: Sequence[Tensor], ns: Namespace) -> list[Tensor]:
    """``tensors`` if they are what ``sig`` accepts (a ``speaker_id`` scoped to ``ns``), else a 400."""
    seen: set[str] = set()
    out = []
    for t in tensors:
        if not isinstance(t.name, str) or t.name not in sig.inputs:
            raise bad(f"model {sig.model!r} has no input {shown(t.name)}; its inputs: {', '.join(sig.inputs)}")
        if t.name in seen:
            raise bad(f"input {t.name!r} is given twice", t.name)
        seen.add(t.name)
        spec = sig.inputs[t.name]
        if t.datatype != spec.datatype:
            raise bad(f"input {t.name!r}: datatype {shown(t.datatype)}; the model declares {spec.datatype}", t.name)
        count = _check_shape(spec, t.shape)
        if (t.raw is None) == (t.values is None):
            raise bad(f"input {t.name!r}: give its data once, as data or as binary data", t.name)
        if t.raw is not None:
            _check_raw(t, count)
        else:
            _check_values(t, count)
        out.append(_scoped(t, ns) if t.name == SPEAKER_INPUT and t.datatype == "BYTES" else t)
    return out


def check_outputs(sig: Signature, names: Iterable[Any]) -> None:
    for name in names:
        if not isinstance(name, str) or name not in sig.outputs:
            raise bad(f"model {sig.model!r} has no output {shown(name)}; its outputs: {', '.join(sorted(sig.outputs))}")


def check_parameters(params: Any, where: str = "request") -> dict[str, Any]:
    """A request's ``parameters``: names of ``[A-Za-z0-9_.-]``, scalar values, Triton's own with their types;
    a shared-memory region is refused (the public entry point does not serve shared memory)."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise bad(f"{where} parameters must be an object")
    for k, v in params.items():
        if not isinstance(k, str) or _PARAMETER.fullmatch(k) is None:
            raise bad(f"{where} parameter name {shown(k)} is invalid")
        if k.startswith("shared_memory"):
            raise bad(f"{where} parameter {k!r}: shared memory is not served at this entry point", k)
        if k in _TRITON_PARAMETERS:
            lo, hi = _TRITON_PARAMETERS[k]
            if k == "sequence_id" and isinstance(v, str) and 0 < len(v) <= 128:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise bad(f"{where} parameter {k!r} must be an integer in {lo}..{hi} (got {shown(v)})", k)
        elif k in _FLAGS:
            if not isinstance(v, bool):
                raise bad(f"{where} parameter {k!r} must be true or false (got {shown(v)})", k)
        elif isinstance(v, str):
            if len(v) > MAX_PARAMETER_CHARS:
                raise bad(f"{where} parameter {k!r}: {len(v)} characters; at most {MAX_PARAMETER_CHARS}", k)
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise bad(f"{where} parameter {k!r} must be finite", k)
        elif not isinstance(v, (bool, int)) or (isinstance(v, int) and not -(2**63) <= v < 2**64):
            raise bad(f"{where} parameter {k!r} must be a string, number or boolean (got {shown(v)})", k)
    return dict(params)


def check_name(kind: str, value: Any) -> str:
    if not isinstance(value, str) or _NAME.fullmatch(value) is None:
        raise bad(f"{kind} {shown(value)} is invalid")
    return value
