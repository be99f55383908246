"""The FastAPI app: OpenAI's ``POST /v1/audio/speech``, the caller's voices (``/v1/audio/voices``: :mod:`.voices`,
in its tenant's namespace: :mod:`.tenants`), ``GET /health``,
``GET /metrics``, behind :class:`~.middleware.GatewayMiddleware` (and CORS when origins are configured).

The speech request is OpenAI's (``model``, ``input``, ``voice``, ``instructions``, ``response_format``, ``speed``,
``stream_format``) plus CosyVoice's extras: ``reference_audio`` (a wav / flac / ogg file as base64, or a ``data:``
URL) with ``reference_text`` (its transcript: zero-shot; without it cross-lingual) to speak in that voice instead of
a registered one, and ``seed``. ``instructions`` are CosyVoice's instruct text. Without ``stream_format`` the answer
is one whole file; ``audio`` streams the encoded audio as Triton produces it, ``sse`` sends it as server-sent
events (``speech.audio.delta`` with base64 audio, then ``speech.audio.done``).

CosyVoice's own HTTP API (the official server's ``/inference_*`` form routes) and ``/inference_vc``: :mod:`.compat`;
its gRPC service, on the gRPC port beside KServe's: :mod:`.official_grpc`; OpenAI's ``GET /v1/models``:
:mod:`.model_list`."""

from __future__ import annotations

import base64
import contextlib
import json
import time
from typing import Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import shown
from . import audio, compat, kserve_grpc, kserve_http, live_ws, model_list, official_grpc, page, voices
from .backend import SpeechJob, TritonBackend, instruction
from .config import GatewayConfig
from .errors import GatewayError, check_text, error_body, install_handlers
from .fair import FairGate
from .limits import KeyLimiter, KeyRing, bounded_loads
from .metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from .middleware import GatewayMiddleware
from .sessions import SequenceIds
from .tenants import PUBLIC, Namespace, namespace
from .upstream import Upstream

SPEECH_PATH, VOICES_PATH = "/v1/audio/speech", voices.VOICES_PATH
ROUTES = frozenset({SPEECH_PATH, VOICES_PATH, model_list.MODELS_PATH, "/health", "/metrics", *compat.PATHS})


class VoiceRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str
    voice: str | VoiceRef | None = None
    instructions: str | None = None
    response_format: Literal["mp3", "opus", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] | None = None
    reference_audio: str | None = None
    reference_text: str | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)


def _param_error(exc: ValidationError) -> GatewayError:
    first = exc.errors()[0]
    loc = first.get("loc", ())
    param = str(loc[0]) if loc else None  # the request's field (a union's member or a nested key is not a param)
    return GatewayError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param, code="invalid_value")


def served_families(config: GatewayConfig) -> tuple[str, ...]:
    """The model families the gateway speaks with: CosyVoice2, and CosyVoice3 where ``cosyvoice3`` is one of
    ``models``."""
    return ("cosyvoice2", "cosyvoice3") if "cosyvoice3" in config.models else ("cosyvoice2",)


def speech_job(req: SpeechRequest, config: GatewayConfig, ns: Namespace = PUBLIC) -> SpeechJob:
    """The request's checks that need no model, then the job for the backend (a registered voice by its id in
    ``ns``, the caller's namespace)."""
    if req.model not in config.models:
        raise GatewayError(400, f"model {shown(req.model)} is not served here; one of {', '.join(config.models)}",
                           param="model", code="model_not_found")
    family = "cosyvoice3" if req.model == "cosyvoice3" else "cosyvoice2"  # OpenAI's names: the default family
    for name in ("input", "instructions", "reference_text"):
        check_text(getattr(req, name), name)
    if isinstance(req.voice, str):
        check_text(req.voice, "voice")
    elif req.voice is not None:
        check_text(req.voice.id, "voice")
    if not req.input.strip():
        raise GatewayError(400, "input: empty text", param="input", code="invalid_value")
    if len(req.input) > config.max_input_chars:
        raise GatewayError(400, f"input: {len(req.input)} characters; at most {config.max_input_chars}",
                           param="input", code="invalid_value")
    if req.speed != 1.0 and req.stream_format is not None:  # as the official code: the whole mel is stretched
        raise GatewayError(400, "speed: only whole answers change speed; leave stream_format out, or speed at 1.0",
                           param="speed", code="unsupported_value")
    if req.stream_format is not None and req.response_format not in audio.STREAM_FORMATS:
        raise GatewayError(400, f"response_format {req.response_format} cannot be streamed; stream one of "
                           f"{', '.join(audio.STREAM_FORMATS)} or leave stream_format out", param="response_format",
                           code="unsupported_value")
    voice = req.voice.id if isinstance(req.voice, VoiceRef) else req.voice
    if req.reference_audio is None:
        if not voice:
            raise GatewayError(400, "voice: a registered voice (GET /v1/audio/voices) or reference_audio is required",
                               param="voice", code="invalid_value")
        if req.reference_text is not None:
            raise GatewayError(400, "reference_text needs reference_audio", param="reference_text",
                               code="invalid_value")
        voice = ns.scoped(voice)
    reference = None if req.reference_audio is None else audio.reference_bytes(req.reference_audio)
    return SpeechJob(text=req.input, voice=voice, instruct=instruction(req.instructions), seed=req.seed,
                     reference_audio=reference, reference_text=req.reference_text, speed=req.speed, family=family)


def speech_request(raw: bytes, config: GatewayConfig, ns: Namespace = PUBLIC) -> tuple[SpeechRequest, SpeechJob]:
    """The request in a ``/v1/audio/speech`` body, checked (:func:`~.limits.bounded_loads`, the fields, then
    :func:`speech_job`), and its job; 400 otherwise."""
    body = bounded_loads(raw, config.max_json_depth)
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object", code="invalid_value")
    try:
        req = SpeechRequest.model_validate(body)
    except ValidationError as exc:
        raise _param_error(exc) from None
    return req, speech_job(req, config, ns)


def _sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def create_app(config: GatewayConfig | None = None, backend=None, live=None) -> FastAPI:
    """The gateway on ``backend`` (an object with ``synthesize``, ``stream``, ``voices``, ``ready``, ``close``;
    default: :class:`~.backend.TritonBackend` on ``config.triton_grpc``, made at startup); ``live``: what runs the
    live WebSocket sessions upstream (:class:`~.live_ws.LiveSockets`; default: an ``AsyncLiveClient`` on Triton)."""
    config = config or GatewayConfig()
    metrics = GatewayMetrics()
    keys = KeyRing(config.api_keys, dict(config.tenants))
    limiter = KeyLimiter(config.max_concurrency_per_key, config.rate_limit,
                         FairGate(config.max_in_flight, config.max_queue_s))
    metrics.waiting.set_function(lambda: limiter.gate.waiting)
    upstream = Upstream(config.triton_grpc, config.triton_http, config.kserve_models,
                        timeout_s=config.backend_timeout_s, max_message_bytes=config.max_body_bytes)
    # sequence ids (live sessions) per tenant; one tenant (no keys): passed through as they are
    sequences = SequenceIds(config.max_sequences, config.max_sequences_per_tenant, config.sequence_idle_s,
                            per_model=dict(config.live_sessions_per_tenant)) if keys.enabled else None
    if sequences is not None:
        metrics.sequences.set_function(sequences.open_count)
    sockets = live_ws.LiveSockets(config, keys, limiter, metrics, sequences, client=live)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        own = app.state.backend is None
        if own:
            app.state.backend = TritonBackend(config.triton_grpc, timeout=config.backend_timeout_s,
                                              families=served_families(config))
        await upstream.start()
        grpc_server = None
        if config.grpc_port:
            grpc_server = kserve_grpc.make_server(kserve_grpc.KServeProxy(upstream, keys, limiter, sequences),
                                                  f"{config.host}:{config.grpc_port}", config)
            # CosyVoice's own gRPC service on the same port
            official_grpc.add_service(official_grpc.OfficialService(lambda: app.state.backend, keys, limiter, config,
                                                                    metrics), grpc_server)
            await grpc_server.start()
        try:
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace=5)
            await upstream.close()
            await sockets.close()
            if own:
                await app.state.backend.close()

    # no /docs, /redoc, /openapi.json: the API is documented in docs/gateway.md, and they would be open routes
    app = FastAPI(title="cosyvoice-triton gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.config, app.state.metrics, app.state.backend = config, metrics, backend
    install_handlers(app)

    async def backend_call(awaitable, ns: Namespace | None = None):
        try:
            return await awaitable
        except GatewayError as exc:
            metrics.backend_errors.labels(str(exc.status)).inc()
            if ns is not None:  # Triton names the scoped id: the caller sees its own
                exc.message = ns.unscoped(exc.message)
            raise

    @app.post(SPEECH_PATH)
    async def speech(request: Request):
        t0 = time.perf_counter()
        ns = namespace(request)
        # off the event loop: linear in the body's size, but a body at the cap takes a while
        req, job = await run_in_threadpool(speech_request, await request.body(), config, ns)
        rid = getattr(request.state, "request_id", "")
        fmt = req.response_format
        if req.stream_format is None:
            wave, sr = await backend_call(request.app.state.backend.synthesize(job, rid), ns)
            data = await run_in_threadpool(audio.encode, wave, sr, fmt)
            metrics.audio_seconds.labels(fmt).inc(len(wave) / sr)
            metrics.latency.labels(SPEECH_PATH).observe(time.perf_counter() - t0)
            return Response(data, media_type=audio.CONTENT_TYPES[fmt])
        return await _streamed(request.app.state.backend.stream(job, rid), fmt, req.stream_format == "sse", t0,
                               ns=ns)

    async def _streamed(chunks, fmt: str, sse: bool, t0: float, route: str = SPEECH_PATH,
                        ns: Namespace | None = None) -> StreamingResponse:
        try:  # the first chunk before the answer starts: a refusal still gets its own status
            first = await backend_call(chunks.__anext__(), ns)
        except StopAsyncIteration:
            raise GatewayError(502, "speech backend: the stream ended without audio", code="backend_error") from None
        except BaseException:
            await chunks.aclose()
            raise

        async def body():
            encoder, seconds = audio.StreamEncoder(fmt, first[1]), 0.0
            try:
                wave, sr = first
                while True:
                    data = encoder.feed(wave)
                    if seconds == 0.0:
                        metrics.first_audio.observe(time.perf_counter() - t0)
                    seconds += len(wave) / sr
                    if data:
                        yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) \
                            if sse else data
                    try:
                        wave, sr = await backend_call(chunks.__anext__(), ns)
                    except StopAsyncIteration:
                        break
                tail = encoder.close()
                if sse:
                    if tail:
                        yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()})
                    # the gateway counts no tokens: OpenAI's usage fields are sent as 0
                    yield _sse({"type": "speech.audio.done",
                                "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}})
                elif tail:
                    yield tail
            except GatewayError as exc:
                if not sse:
                    raise  # the connection is dropped: a cut audio stream, not a complete-looking one
                yield _sse({"type": "error", **error_body(exc.status, exc.message, code=exc.code)})
            finally:
                metrics.audio_seconds.labels(fmt).inc(seconds)
                metrics.latency.labels(route).observe(time.perf_counter() - t0)
                await chunks.aclose()

        media = "text/event-stream" if sse else audio.CONTENT_TYPES[fmt]
        return StreamingResponse(body(), media_type=media, headers={"cache-control": "no-cache",
                                                                    "x-sample-rate": str(int(first[1]))})

    app.include_router(compat.router(config, _streamed))
    app.include_router(voices.router(config, backend_call))
    app.include_router(model_list.router(config))  # GET /v1/models
    app.include_router(page.router)  # GET /listen (and / redirecting to it): the page to listen
    app.include_router(kserve_http.router(upstream, config.max_json_depth, sequences))
    app.include_router(sockets.router())  # live sessions over WebSocket (the middleware passes them by)

    @app.get("/health")
    async def health(request: Request):
        ready = await request.app.state.backend.ready()
        return JSONResponse({"status": "ok" if ready else "unavailable", "triton": config.triton_grpc},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus():
        triton = await metrics.triton(config.triton_metrics) if config.triton_metrics else b""
        return Response(metrics.render() + triton, media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(GatewayMiddleware, keys=keys, limiter=limiter, metrics=metrics,
                       max_body_bytes=config.max_body_bytes, routes=ROUTES,
                       limited=("/v1/", compat.PREFIX, kserve_http.PREFIX + "/"),
                       limited_paths=frozenset({kserve_http.PREFIX} | (set() if config.open_metrics else {"/metrics"})))
    if config.cors_origins:  # outermost: refusals carry the CORS headers too, preflights skip the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                           allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["authorization", "content-type", "x-request-id"],
                           expose_headers=["x-request-id"])
    return app
