"""Triton's KServe v2 gRPC API at the gateway (``inference.GRPCInferenceService``, the service
``tritonclient.grpc`` speaks), for the public models: liveness, readiness, server and model metadata,
``ModelInfer`` and ``ModelStreamInfer`` (the streaming and live models). Every request, each one of a stream too,
is checked by :mod:`.inference` before it goes on to Triton; the API key comes as ``authorization: Bearer <key>``
metadata and counts against the same concurrency and rate as HTTP. A bad request in a stream is answered in the
stream (its ``error_message``), or ends the stream with INVALID_ARGUMENT when the client asked for status codes
(``triton_grpc_error: true``, passed on to Triton too). A ``sequence_id`` names a sequence of the caller's
tenant (:mod:`.sessions`): Triton gets the gateway's id for it, the answers give the caller's back. The model
config, repository, shared-memory, trace, logging and statistics methods answer UNIMPLEMENTED (Triton keeps them
behind its admin key)."""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
from collections.abc import AsyncIterator
from functools import partial

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from .config import GatewayConfig
from .errors import GatewayError
from .inference import Tensor, bad, check_name, check_outputs, check_parameters, check_request
from .limits import KeyLimiter, KeyRing
from .sessions import Scope, SequenceIds, grpc_sequence
from .tenants import PUBLIC, Namespace
from .upstream import Upstream

log = logging.getLogger(__name__)

GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
              403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
              413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
              503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
ERROR_HEADER = "triton_grpc_error"
#: Triton's flag on each stream response that is a request's last, and the request parameter that has a decoupled
#: model's final flag sent as an empty response (otherwise it may never reach the stream).
FINAL, EMPTY_FINAL = "triton_final_response", "triton_enable_empty_final_response"
#: Which ``InferTensorContents`` field holds each datatype (FP16 and BF16 travel as raw bytes only).
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
            "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
            "FP64": "fp64_contents", "BYTES": "bytes_contents"}
_FIELDS = sorted(set(CONTENTS.values()))


def _parameters(params, where: str) -> dict:
    out = {}
    for k, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[k] = getattr(p, which) if which else None
    return check_parameters(out, where)


def checked_request(upstream: Upstream, sig, request: service_pb2.ModelInferRequest,
                    ns: Namespace) -> service_pb2.ModelInferRequest:
    """A copy of ``request`` that Triton may get (a speaker_id scoped to ``ns``); 400 otherwise."""
    upstream.public(request.model_name)
    if request.model_version and (not request.model_version.isdigit() or len(request.model_version) > 19):
        raise bad(f"model_version {request.model_version[:20]!r} must be a number")
    if len(request.id) > 128:
        raise bad("id: at most 128 characters", "id")
    _parameters(request.parameters, "request")
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise bad(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give one for each input")
    tensors = []
    for i, t in enumerate(request.inputs):
        name = check_name("input name", t.name)
        if _parameters(t.parameters, f"input {name!r}"):
            raise bad(f"input {name!r}: input parameters are not accepted", name)
        given = [f for f in _FIELDS if len(getattr(t.contents, f))]
        if raw:
            if given:
                raise bad(f"input {name!r}: both contents and raw_input_contents", name)
            tensors.append(Tensor(name, t.datatype, tuple(t.shape), raw=raw[i]))
        else:
            want = CONTENTS.get(t.datatype)
            if given and given != [want]:
                raise bad(f"input {name!r}: {t.datatype} data goes in {want or 'raw_input_contents'}, got "
                          f"{', '.join(given)}", name)
            values = list(getattr(t.contents, want)) if want else []
            tensors.append(Tensor(name, t.datatype, tuple(t.shape), values=values))
    for o in request.outputs:
        p = _parameters(o.parameters, f"output {o.name[:64]!r}")
        if set(p) - {"binary_data"}:
            raise bad(f"output {o.name[:64]!r}: output parameters are not accepted")
    check_outputs(sig, [o.name for o in request.outputs])
    checked = check_request(sig, tensors, ns)
    out = service_pb2.ModelInferRequest()
    out.CopyFrom(request)
    for i, (before, after) in enumerate(zip(tensors, checked, strict=True)):
        if after is before:
            continue
        if raw:
            out.raw_input_contents[i] = after.raw
        else:
            field = getattr(out.inputs[i].contents, CONTENTS[after.datatype])
            del field[:]
            field.extend(v.encode() if isinstance(v, str) else v for v in after.values)
    return out


def _headers(context) -> dict[str, str]:
    """The call's text metadata, by lower-case key."""
    return {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def caller(keys: KeyRing, context) -> tuple[str, Namespace]:
    """Who makes a gRPC call (a key's id from its ``authorization`` metadata, or the peer's address without keys)
    and its namespace; 401 for a missing or bad key."""
    if keys.enabled:
        who = keys.identify(_headers(context).get("authorization"))
        return who, Namespace(keys.tenant_of(who))
    peer = context.peer() or "anonymous"
    return peer.rsplit(":", 1)[0], PUBLIC


class KServeProxy(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, upstream: Upstream, keys: KeyRing, limiter: KeyLimiter, sequences: SequenceIds | None = None):
        self.upstream, self.keys, self.limiter, self.sequences = upstream, keys, limiter, sequences

    async def _fail(self, context, exc: GatewayError):
        await context.abort(GRPC_CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)

    def _identify(self, context) -> tuple[str, Namespace]:
        return caller(self.keys, context)

    def _metadata(self, context) -> list[tuple[str, str]]:
        return [(ERROR_HEADER, "true")] if _headers(context).get(ERROR_HEADER, "").lower() == "true" else []

    def _timeout(self, context) -> float:
        left = context.time_remaining()
        return self.upstream.timeout_s if left is None else min(left, self.upstream.timeout_s)

    async def _unary(self, method: str, request, context, model: str | None = None, *, infer: bool = False):
        """One call on to Triton: admitted, the model public, an inference request checked first."""
        try:
            who, ns = self._identify(context)
            scope = Scope(self.sequences, ns.tenant)
            wait, counted = admission(scope, request) if infer else (True, True)
            if infer:  # work for Triton: its turn at the fair gate when the service is full
                await self.limiter.admit(who, wait=wait, counted=counted)
            else:
                self.limiter.acquire(who)
        except GatewayError as exc:
            return await self._fail(context, exc)
        done = partial(self.limiter.leave, counted=counted) if infer else self.limiter.release
        held = False
        try:
            kw = {}
            if infer:
                request, kw = await self._checked(request, ns, scope), {"metadata": self._metadata(context)}
                # Triton 2.51's gRPC server can crash when an inference it runs is cancelled (a client's deadline
                # passed on, or a client gone; triton-inference-server/server#8034; the stress mode crashed it so):
                # once sent, an inference runs to its end under the gateway's own ceiling, and the key's slot stays
                # held until Triton answers, so a client that leaves early frees nothing before the work is done
                call = asyncio.ensure_future(self.upstream.stub.ModelInfer(request, timeout=self.upstream.timeout_s,
                                                                           **kw))
                try:
                    answer = await asyncio.shield(call)
                except asyncio.CancelledError:
                    held = True
                    call.add_done_callback(lambda answered: (answered.cancelled() or answered.exception(),
                                                             done(who)))
                    raise
                return scope.grpc_response(answer)
            if model is not None:
                self.upstream.public(model)
            return await getattr(self.upstream.stub, method)(request, timeout=self._timeout(context), **kw)
        except GatewayError as exc:
            await self._fail(context, exc)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), scope.names.text(exc.details() or ""))
        finally:
            if not held:
                done(who)

    async def ServerLive(self, request, context):
        return await self._unary("ServerLive", request, context)

    async def ServerReady(self, request, context):
        return await self._unary("ServerReady", request, context)

    async def ServerMetadata(self, request, context):
        return await self._unary("ServerMetadata", request, context)

    async def ModelReady(self, request, context):
        return await self._unary("ModelReady", request, context, request.name)

    async def ModelMetadata(self, request, context):
        return await self._unary("ModelMetadata", request, context, request.name)

    async def _checked(self, request, ns: Namespace, scope: Scope):
        """The copy of ``request`` Triton gets: checked, its speaker_id and sequence_id the caller's tenant's."""
        sig = await self.upstream.signature(request.model_name)
        checked = await asyncio.to_thread(checked_request, self.upstream, sig, request, ns)
        scope.grpc_request(checked)
        return checked

    async def ModelInfer(self, request, context):
        return await self._unary("ModelInfer", request, context, infer=True)

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator:
        """Each request of the stream counts against the key's concurrency and rate as a call would: its slot is
        taken when it goes on to Triton and given back with its final response (``triton_final_response``; the
        gateway asks Triton for the empty final response of a decoupled model and keeps it from a client that did
        not ask for it) or its error. A request beyond the limit is refused in the stream, naming the limit."""
        try:
            who, ns = self._identify(context)
        except GatewayError as exc:
            await self._fail(context, exc)
            return
        codes = bool(self._metadata(context))
        scope = Scope(self.sequences, ns.tenant)  # the stream's sequence ids, and the answers back
        out: asyncio.Queue = asyncio.Queue()
        onward: asyncio.Queue = asyncio.Queue()
        end = object()
        # slots taken for requests Triton has not finished (each: whether it counts against the key), answered in
        # the order they were sent
        held: collections.deque[bool] = collections.deque()
        state = {"client_empty_final": False}

        def release_one() -> None:
            if held:
                self.limiter.leave(who, counted=held.popleft())

        async def requests():
            while True:
                item = await onward.get()
                if item is end:
                    return
                yield item

        async def refuse(req, exc: GatewayError) -> bool:
            """Answer ``exc`` in the stream; False when it ends the stream (the client asked for status codes)."""
            if codes:
                await out.put(exc)
                return False
            await out.put(service_pb2.ModelStreamInferResponse(
                error_message=exc.message,
                infer_response=service_pb2.ModelInferResponse(model_name=req.model_name[:128], id=req.id[:128])))
            return True

        async def read_client():
            try:
                async for req in request_iterator:
                    if isinstance(req, Undecodable):  # no model, no id to answer in the stream: the stream ends
                        await out.put(GatewayError(400, req.message))
                        return
                    wait, counted = admission(scope, req)
                    try:  # a piece of an open session is neither refused nor kept waiting (limits.py, fair.py)
                        await self.limiter.admit(who, wait=wait, counted=counted)
                    except GatewayError as exc:
                        if await refuse(req, exc):
                            continue
                        return
                    try:
                        checked = await self._checked(req, ns, scope)
                    except GatewayError as exc:
                        self.limiter.leave(who, counted=counted)
                        if await refuse(req, exc):
                            continue
                        return
                    except BaseException:  # the stream ended (cancelled) during the check: not held yet, give it back
                        self.limiter.leave(who, counted=counted)
                        raise
                    empty = checked.parameters.get(EMPTY_FINAL)
                    if empty is not None and empty.bool_param:
                        state["client_empty_final"] = True
                    else:
                        checked.parameters[EMPTY_FINAL].bool_param = True
                    held.append(counted)
                    await onward.put(checked)
            finally:
                await onward.put(end)

        call = self.upstream.stub.ModelStreamInfer(requests(), metadata=self._metadata(context))

        async def read_triton():
            try:
                async for answer in call:
                    final = answer.infer_response.parameters.get(FINAL)
                    if answer.error_message or final is None or final.bool_param:
                        release_one()
                    if final is not None and final.bool_param and _empty(answer) \
                            and not state["client_empty_final"]:
                        continue  # asked for by the gateway, not the client
                    await out.put(scope.grpc_stream_answer(answer))
                await out.put(end)
            except grpc.aio.AioRpcError as exc:
                await out.put(exc)

        tasks = [asyncio.ensure_future(read_client()), asyncio.ensure_future(read_triton())]
        try:
            while True:
                item = await out.get()
                if item is end:
                    return
                if isinstance(item, GatewayError):
                    await self._fail(context, item)
                    return
                if isinstance(item, grpc.aio.AioRpcError):
                    await context.abort(item.code(), scope.names.text(item.details() or ""))
                    return
                yield item
        finally:
            for t in tasks:
                t.cancel()
            call.cancel()
            while held:
                release_one()


def admission(scope: Scope, request) -> tuple[bool, bool]:
    """``(wait, counted)`` for a request: whether it waits its turn at the fair gate, whether it counts against
    its key's concurrency and rate. A piece of a sequence the tenant holds open does neither: a live session is one
    request of its key, counted at its start, so it is not cut halfway by its own pieces nor crowds out the key's
    other requests (the live model bounds its pending pieces, the tenant's share its sessions). Without tenants
    (no keys: no table of ids) a piece is known by its shape alone: it does not wait, and it counts."""
    if scope.continues(request):
        return False, False
    seq = None if scope.active else grpc_sequence(request)
    return not (seq is not None and not seq[1]), True


def _empty(answer: service_pb2.ModelStreamInferResponse) -> bool:
    """A decoupled model's empty final response: no error, no outputs."""
    r = answer.infer_response
    return not answer.error_message and not r.outputs and not r.raw_output_contents


class Undecodable:
    """What a request that is not the method's protobuf message deserializes to (grpc's server would answer
    UNKNOWN naming the parser's exception): the method answers INVALID_ARGUMENT."""

    def __init__(self, what: str, exc: Exception):
        self.message = f"the request is not a valid {what} message ({type(exc).__name__})"


def lenient(deserialize, what: str):
    """``deserialize`` that returns an :class:`Undecodable` for bytes it cannot parse, instead of raising."""
    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # protobuf's DecodeError, or any parser fault: the client's bytes
            return Undecodable(what, exc)
    return parse


def _refusing(behavior):
    async def unary(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)
    return unary


class _Handlers:
    """Collects the generated code's method handlers (it registers them on what it is given)."""

    def add_generic_rpc_handlers(self, handlers):
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict):
        self.service, self.handlers = service, handlers


def add_service(proxy: KServeProxy, server) -> None:
    """The service's methods on ``server``, each request's deserializer lenient: bytes that are not the method's
    message are refused with INVALID_ARGUMENT (in a stream: the stream ends with it)."""
    got = _Handlers()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(proxy, got)
    handlers = {}
    for name, h in got.handlers.items():
        what = getattr(h.request_deserializer, "__self__", None)
        what = getattr(what, "__name__", name)
        parse = lenient(h.request_deserializer, what)
        if h.unary_unary is not None and inspect.iscoroutinefunction(h.unary_unary):
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                _refusing(h.unary_unary), request_deserializer=parse, response_serializer=h.response_serializer)
        elif h.stream_stream is not None:  # ModelStreamInfer: its reader ends the stream on an Undecodable
            handlers[name] = grpc.stream_stream_rpc_method_handler(
                h.stream_stream, request_deserializer=parse, response_serializer=h.response_serializer)
        else:
            handlers[name] = h
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(got.service, handlers),))
    server.add_registered_method_handlers(got.service, handlers)


def server_options(config: GatewayConfig) -> list[tuple[str, int]]:
    """gRPC core's bounds for the port: the message size, the handshake's deadline, calls per connection, idle
    connections closed, dead clients found by keepalive pings, a connection's age (its calls in progress run to
    their end), and the connection cap (gRPC core's ``max_allowed_incoming_connections``)."""
    options = [("grpc.max_receive_message_length", config.max_body_bytes), ("grpc.max_send_message_length", -1),
               ("grpc.server_handshake_timeout_ms", int(config.header_timeout_s * 1000)),
               ("grpc.max_concurrent_streams", config.grpc_max_streams),
               ("grpc.max_connection_idle_ms", int(config.grpc_idle_s * 1000)),
               ("grpc.max_connection_age_ms", 3_600_000), ("grpc.keepalive_time_ms", 60_000),
               ("grpc.keepalive_timeout_ms", 20_000)]
    if config.max_connections:
        options.append(("grpc.max_allowed_incoming_connections", config.max_connections))
    return options


def make_server(proxy: KServeProxy, address: str, config: GatewayConfig) -> grpc.aio.Server:
    server = grpc.aio.server(options=server_options(config))
    add_service(proxy, server)
    server.add_insecure_port(address)
    return server
