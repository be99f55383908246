"""Triton's KServe v2 HTTP API at the gateway (``/v2/...``), for the clients that already speak it
(``tritonclient.http``, curl, perf_analyzer): health, server and model metadata, readiness and ``infer`` of the
public models, JSON or with the binary tensor extension. Each ``infer`` is checked by :mod:`.inference` and sent on
to Triton re-encoded (what Triton parses is the gateway's own JSON, never the client's bytes), its ``sequence_id``
the gateway's id for the caller's tenant's sequence (:mod:`.sessions`; the answer names the caller's again; Triton
serves no decoupled model, so no live model, over HTTP). Refusals are in KServe's shape, ``{"error": "..."}``.
Not served here: the model config, repository, shared-memory, trace, logging and statistics APIs (Triton keeps
them behind its admin key) and ``generate`` / ``generate_stream`` (streams: the gRPC entry point,
:mod:`.kserve_grpc`)."""

from __future__ import annotations

import heapq
import json
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from .errors import ErrorResponse, GatewayError
from .inference import Signature, Tensor, bad, check_name, check_outputs, check_parameters, check_request, flatten
from .limits import bounded_loads
from .sessions import Scope, SequenceIds
from .tenants import Namespace, namespace
from .upstream import Upstream

PREFIX = "/v2"
HEADER_LENGTH = "inference-header-content-length"
_REQUEST_KEYS = {"id", "parameters", "inputs", "outputs"}
_INPUT_KEYS = {"name", "shape", "datatype", "parameters", "data"}
_OUTPUT_KEYS = {"name", "parameters"}
_PASSED_HEADERS = ("content-type", HEADER_LENGTH)
MAX_TENSORS = 64
_SHOWN_NAMES = 100  # unknown fields named in a refusal: more than its 200 characters hold


def _kserve_error(exc: GatewayError) -> JSONResponse:
    return ErrorResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)


def _list(value: Any, what: str, most: int = MAX_TENSORS) -> list:
    if not isinstance(value, list) or len(value) > most:
        raise bad(f"{what} must be a list of at most {most}")
    return value


def _object(value: Any, keys: set[str], what: str) -> dict:
    if not isinstance(value, dict):
        raise bad(f"{what} must be an object")
    extra = set(value) - keys
    if extra:  # the first names only: sorting a million of them would hold the GIL for a second
        raise bad(f"{what}: unknown field(s) {', '.join(heapq.nsmallest(_SHOWN_NAMES, map(str, extra)))[:200]}")
    return value


def checked_body(sig: Signature, body: bytes, header_length: str | None, ns: Namespace,
                 max_depth: int, scope: Scope | None = None) -> tuple[bytes, dict[str, str]]:
    """The body Triton gets for a client's ``infer`` body, with its headers; 400 for anything :mod:`.inference`
    refuses. ``scope``: the caller's sequence ids (a ``sequence_id`` parameter becomes the gateway's)."""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise bad(f"Inference-Header-Content-Length {header_length[:20]!r} is not a length within the body")
        split = int(header_length)
        header, binary = body[:split], body[split:]
    else:
        header, binary = body, b""
    req = _object(bounded_loads(header, max_depth), _REQUEST_KEYS, "the request")
    out: dict[str, Any] = {}
    if "id" in req:
        if not isinstance(req["id"], str) or len(req["id"]) > 128:
            raise bad("id must be a string of at most 128 characters", "id")
        out["id"] = req["id"]
    params = check_parameters(req.get("parameters"))
    tensors, at = [], 0
    for i, item in enumerate(_list(req.get("inputs"), "inputs")):
        item = _object(item, _INPUT_KEYS, f"inputs[{i}]")
        name = check_name("input name", item.get("name"))
        shape = tuple(_list(item.get("shape"), f"input {name!r}: shape", 16))
        p = check_parameters(item.get("parameters"), f"input {name!r}")
        size = p.pop("binary_data_size", None)
        if p:
            raise bad(f"input {name!r}: unknown parameter(s) {', '.join(sorted(p))}", name)
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= len(binary) - at:
                raise bad(f"input {name!r}: binary_data_size {size!r} does not fit the binary data", name)
            if "data" in item:
                raise bad(f"input {name!r}: give data or binary_data_size, not both", name)
            tensors.append(Tensor(name, item.get("datatype"), shape, raw=binary[at: at + size]))
            at += size
        else:
            if "data" not in item:
                raise bad(f"input {name!r} has no data", name)
            tensors.append(Tensor(name, item.get("datatype"), shape, values=flatten(item["data"], len(shape), name)))
    if at != len(binary):
        raise bad(f"{len(binary) - at} bytes of binary data follow the inputs that no input claims")
    outputs = []
    for i, item in enumerate(_list(req.get("outputs", []), "outputs")):
        item = _object(item, _OUTPUT_KEYS, f"outputs[{i}]")
        p = check_parameters(item.get("parameters"), f"output {item.get('name')!r}")
        if set(p) - {"binary_data"}:
            raise bad(f"output {item.get('name')!r}: only the binary_data parameter is accepted")
        outputs.append({"name": item.get("name"), **({"parameters": p} if p else {})})
    check_outputs(sig, [o["name"] for o in outputs])
    tensors = check_request(sig, tensors, ns)
    if scope is not None:  # last: a refused request opens or ends no sequence
        params = scope.json_parameters(sig.model, params)
    raws = []
    inputs = []
    for t in tensors:
        entry: dict[str, Any] = {"name": t.name, "shape": list(t.shape), "datatype": t.datatype}
        if t.raw is not None:
            entry["parameters"] = {"binary_data_size": len(t.raw)}
            raws.append(t.raw)
        else:
            entry["data"] = [v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else v for v in t.values]
        inputs.append(entry)
    out.update({"inputs": inputs, **({"parameters": params} if params else {}),
                **({"outputs": outputs} if outputs else {})})
    head = json.dumps(out, allow_nan=False).encode()  # ASCII: a lone surrogate the client escaped stays escaped
    if not raws:
        return head, {"content-type": "application/json"}
    return head + b"".join(raws), {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(head))}


def router(upstream: Upstream, max_depth: int, sequences: SequenceIds | None = None) -> APIRouter:
    """``sequences``: the tenants' sequence ids (None: ids pass through, a gateway without keys)."""
    r = APIRouter(prefix=PREFIX)

    async def forward(method: str, path: str, body: bytes | None = None,
                      headers: dict[str, str] | None = None, scope: Scope | None = None) -> Response:
        try:
            async with upstream.session.request(method, PREFIX + path, data=body, headers=headers) as answer:
                data = await answer.read()
                passed = {k: answer.headers[k] for k in _PASSED_HEADERS if k in answer.headers}
                if scope is not None and scope.names:
                    data, length = scope.http_answer(data, passed.get(HEADER_LENGTH))
                    if length is not None:
                        passed[HEADER_LENGTH] = length
                return Response(data, status_code=answer.status, headers=passed)
        except (OSError, TimeoutError) as exc:
            return _kserve_error(GatewayError(503, f"Triton did not answer: {type(exc).__name__}"))

    def version_path(model: str, version: str | None) -> str:
        upstream.public(model)
        if version is None:
            return f"/models/{model}"
        if not version.isdigit() or len(version) > 19:
            raise bad(f"model version {version[:20]!r} must be a number")
        return f"/models/{model}/versions/{version}"

    async def guarded(call):
        try:
            return await call()
        except GatewayError as exc:
            return _kserve_error(exc)

    @r.get("")
    async def server_metadata():
        return await forward("GET", "")

    @r.get("/health/{which}")
    async def health(which: str):
        if which not in ("live", "ready"):
            return _kserve_error(GatewayError(404, "health is /v2/health/live or /v2/health/ready"))
        return await forward("GET", f"/health/{which}")

    async def infer(request: Request, model: str, version: str | None):
        path = version_path(model, version)
        sig = await upstream.signature(model)
        body = await request.body()
        ns = namespace(request)
        scope = Scope(sequences, ns.tenant)
        data, headers = await run_in_threadpool(checked_body, sig, body, request.headers.get(HEADER_LENGTH),
                                                ns, max_depth, scope)
        return await forward("POST", path + "/infer", data, headers, scope)

    async def model_get(model: str, version: str | None, what: str):
        return await forward("GET", version_path(model, version) + what)

    @r.post("/models/{model}/infer")
    async def infer_latest(request: Request, model: str):
        return await guarded(lambda: infer(request, model, None))

    @r.post("/models/{model}/versions/{version}/infer")
    async def infer_version(request: Request, model: str, version: str):
        return await guarded(lambda: infer(request, model, version))

    def model_routes(suffix: str) -> None:  # what is the route's own, never a query parameter
        async def latest(model: str):
            return await guarded(lambda: model_get(model, None, suffix))

        async def versioned(model: str, version: str):
            return await guarded(lambda: model_get(model, version, suffix))

        r.add_api_route(f"/models/{{model}}{suffix}", latest, methods=["GET"])
        r.add_api_route(f"/models/{{model}}/versions/{{version}}{suffix}", versioned, methods=["GET"])

    for suffix in ("", "/ready"):
        model_routes(suffix)
    return r
