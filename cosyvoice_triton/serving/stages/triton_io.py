"""What every ``model.py`` adapter needs, with Triton's ``triton_python_backend_utils`` passed in as ``pb``.

The library never imports ``triton_python_backend_utils`` (it exists only inside a Python-backend stub); the
adapters hand it over, so this module is tested with a stand-in (``tests/test_triton_io.py``).

* :func:`read_inputs`: a request's input tensors as numpy (``None`` for an absent optional input);
  :func:`requested_outputs`: the outputs it asks for.
* :func:`responses`: one :class:`~.batching.ItemResult` per request to one ``InferenceResponse`` each; an
  error becomes ``TritonError(message, INVALID_ARG)`` when it is the client's (a
  :class:`~cosyvoice_triton.errors.CosyVoiceError`: HTTP 400 / gRPC INVALID_ARGUMENT), ``INTERNAL`` otherwise.
* :class:`BlsGraph`: a :data:`~.flow.GraphFn` that runs a graph model by BLS, shaping the rank-1 tensors of
  :data:`~cosyvoice_triton.shapes.ALL_GRAPHS` as the configs' ``dims: [1]`` + ``reshape: []`` want them, and
  raising :class:`BlsError` (with the callee's error code) when the call fails.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import CosyVoiceError
from ...shapes import ALL_GRAPHS, GraphSpec
from .batching import ItemResult

log = logging.getLogger(__name__)

__all__ = [
    "MAX_ERROR_CHARS",
    "BlsError",
    "BlsGraph",
    "error_response",
    "from_request",
    "read_inputs",
    "request_parameters",
    "requested_outputs",
    "responses",
    "to_request",
    "triton_error",
]


class BlsError(RuntimeError):
    """A BLS call that failed; ``invalid_argument`` when the callee blamed the request."""

    def __init__(self, model: str, message: str, invalid_argument: bool = False):
        super().__init__(f"{model}: {message}")
        self.invalid_argument = invalid_argument


class _InvalidBls(BlsError, CosyVoiceError):
    """A BLS failure the callee answered with INVALID_ARG: still the client's fault."""


def read_inputs(pb, request, names: Iterable[str]) -> dict[str, np.ndarray | None]:
    """``{name: array or None}`` of a request's inputs."""
    out = {}
    for name in names:
        t = pb.get_input_tensor_by_name(request, name)
        out[name] = None if t is None else t.as_numpy()
    return out


def requested_outputs(request) -> list[str] | None:
    """The output names the request asks for (Triton lists every output when the client named none; an ensemble
    step asks for the outputs of its ``output_map``); ``None`` where the stub cannot say."""
    try:
        names = request.requested_output_names()
    except Exception:  # a stand-in or an older stub without requested_output_names()
        return None
    return None if names is None else [str(n) for n in names]


def request_parameters(request) -> dict[str, Any]:
    """The request's parameters (the ``parameters`` of the HTTP/gRPC request; ensembles pass them on)."""
    try:
        raw = request.parameters()
        return json.loads(raw) if isinstance(raw, str) else dict(raw or {})
    except Exception:  # an older stub without parameters()
        return {}


#: The longest error message a response carries. gRPC sends the message as trailing metadata, which clients
#: refuse above 8 KiB (the stream is then lost as RESOURCE_EXHAUSTED instead of the error); a message that echoes
#: a client's long input is cut in the middle to this size.
MAX_ERROR_CHARS = 1024


def triton_error(pb, message: str, code: Any):
    """``pb.TritonError(message, code)`` with ``message`` cut to :data:`MAX_ERROR_CHARS`."""
    if len(message) > MAX_ERROR_CHARS:
        keep = MAX_ERROR_CHARS - len(f" ... [{len(message)} characters cut] ... ")
        head, tail = keep - keep // 4, keep // 4
        cut = f" ... [{len(message) - head - tail} characters cut] ... "
        message = message[:head] + cut + message[len(message) - tail:]
    return pb.TritonError(message, code)


def error_response(pb, exc: BaseException):
    """``InferenceResponse`` carrying ``exc``: INVALID_ARG for the client's errors, INTERNAL for ours."""
    client = isinstance(exc, CosyVoiceError) or getattr(exc, "invalid_argument", False)
    code = pb.TritonError.INVALID_ARG if client else pb.TritonError.INTERNAL
    message = str(exc) if client else f"internal error: {type(exc).__name__}: {exc}"
    if not client:
        log.error("request failed: %s\n%s", message, getattr(exc, "traceback_text", ""))
    return pb.InferenceResponse(error=triton_error(pb, message, code))


def responses(pb, results: Sequence[ItemResult[Any]], to_tensors: Callable[[Any], Mapping[str, np.ndarray]]):
    """One ``InferenceResponse`` per result, in order."""
    out = []
    for r in results:
        if r.ok:
            try:
                tensors = to_tensors(r.value)
                out.append(pb.InferenceResponse(output_tensors=[pb.Tensor(k, np.ascontiguousarray(v))
                                                                for k, v in tensors.items()]))
            except Exception as exc:  # a bug in one result must not take the batch down
                out.append(error_response(pb, exc))
        else:
            out.append(error_response(pb, r.error))
    return out


def answer_each(requests: Sequence[Any], answer: Callable[[Any], Any]) -> list[Any]:
    """``answer(request)`` for every request of a batch at once, one thread each (for models whose work is BLS
    calls that other models batch), the responses in the batch's order. ``answer`` returns its response and
    turns its own failures into error responses."""
    out: list[Any] = [None] * len(requests)

    def run(i: int) -> None:
        out[i] = answer(requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def to_request_shape(spec: GraphSpec, name: str, x: np.ndarray) -> np.ndarray:
    """Rank-1 ``[B]`` tensors of the spec travel as ``[B, 1]`` (config ``dims: [1]``, ``reshape: []``)."""
    t = spec.tensor(name)
    x = np.ascontiguousarray(x, dtype=t.dtype)
    return x.reshape(-1, 1) if len(t.shape) == 1 else x


def from_request_shape(spec: GraphSpec, name: str, x: np.ndarray) -> np.ndarray:
    """Back to the spec's rank (``[B, 1]`` -> ``[B]``)."""
    t = spec.tensor(name)
    return x.reshape(-1) if len(t.shape) == 1 else x


def from_request(spec: GraphSpec, tensors: Mapping[str, np.ndarray | None]) -> dict[str, np.ndarray | None]:
    """A graph model's request tensors in the spec's ranks (``[B, 1]`` -> ``[B]`` where the spec has ``[B]``)."""
    return {k: (None if v is None or k not in {t.name for t in spec.inputs} else from_request_shape(spec, k, v))
            for k, v in tensors.items()}


def to_request(spec: GraphSpec, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A graph's outputs in the config's ranks (``[B]`` -> ``[B, 1]``)."""
    return {k: to_request_shape(spec, k, v) for k, v in outputs.items()}


class BlsGraph:
    """Call the Triton model ``model`` (graph ``graph`` of :data:`~cosyvoice_triton.shapes.ALL_GRAPHS`) by BLS:
    ``fn(feeds) -> outputs``; ``version``: that numbered version of it (-1: the latest loaded)."""

    def __init__(self, pb, model: str, graph: str, *, timeout_us: int = 0, version: int = -1):
        self.pb, self.model, self.spec = pb, model, ALL_GRAPHS[graph]
        self.timeout_us = int(timeout_us)
        self.version = int(version)
        self.calls = 0

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        pb, spec = self.pb, self.spec
        inputs = [pb.Tensor(t.name, to_request_shape(spec, t.name, feeds[t.name])) for t in spec.inputs]
        kwargs = {"timeout": self.timeout_us} if self.timeout_us else {}
        if self.version >= 0:
            kwargs["model_version"] = self.version
        req = pb.InferenceRequest(model_name=self.model, inputs=inputs,
                                  requested_output_names=[t.name for t in spec.outputs], **kwargs)
        res = req.exec()
        self.calls += 1
        if res.has_error():
            err = res.error()
            code = err.code() if hasattr(err, "code") else None
            invalid = code is not None and code == pb.TritonError.INVALID_ARG
            cls = _InvalidBls if invalid else BlsError
            raise cls(self.model, err.message(), invalid)
        out = {}
        for t in spec.outputs:
            tensor = pb.get_output_tensor_by_name(res, t.name)
            if tensor is None:
                raise BlsError(self.model, f"response has no output {t.name!r}")
            out[t.name] = from_request_shape(spec, t.name, tensor.as_numpy())
        return out
