"""CosyVoice's own gRPC service (the official ``runtime/python/grpc`` server's ``cosyvoice.CosyVoice``, rpc
``Inference``) on the gateway's gRPC port, beside the KServe service, so that the official client runs unchanged.

A call carries one request of four kinds and is answered with the speech as a stream of ``Response`` messages,
each a piece of raw signed 16-bit little-endian mono PCM at the model's rate (24 kHz), sent as Triton produces it:

- ``sft_request`` (``spk_id``, ``tts_text``): one of the caller's voices (``/v1/audio/voices``), as
  ``/inference_sft``;
- ``zero_shot_request`` (``tts_text``, ``prompt_text``, ``prompt_audio``) and ``cross_lingual_request``
  (``tts_text``, ``prompt_audio``): the prompt is 16-bit PCM at 16 kHz, as the official client sends it;
- ``instruct_request`` (``tts_text``, ``spk_id``, ``instruct_text``): CosyVoice 2's instruct mode in one of the
  caller's voices (``<|endofprompt|>`` is appended when missing).

The message classes come from ``cosyvoice.proto`` beside this module, compiled by grpcio-tools' protoc when the
service is first added, into a descriptor pool of their own (a client's generated ``cosyvoice_pb2`` in the same
process does not clash). The API key (``authorization`` metadata), the caller's tenant, the per-key limits and the
fair gate are the gateway's, as for its other routes; a refusal ends the call with INVALID_ARGUMENT,
UNAUTHENTICATED, RESOURCE_EXHAUSTED, ... naming what is wrong."""

from __future__ import annotations

import functools
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from ..frontend.audio import MAX_SECONDS
from .audio import pcm16
from .backend import SpeechJob, instruction
from .compat import form_text, voice_id
from .config import GatewayConfig
from .errors import GatewayError
from .kserve_grpc import GRPC_CODES, Undecodable, caller, lenient
from .limits import KeyLimiter, KeyRing

PROTO = Path(__file__).with_name("cosyvoice.proto")
PACKAGE, SERVICE, METHOD = "cosyvoice", "CosyVoice", "Inference"
ROUTE = f"/{PACKAGE}.{SERVICE}/{METHOD}"  # the call's path, and its label in the gateway's metrics
PROMPT_RATE = 16000  # the official client's prompt_audio: 16-bit PCM at 16 kHz
KINDS = ("sft_request", "zero_shot_request", "cross_lingual_request", "instruct_request")


def compile_proto(proto: Path) -> descriptor_pb2.FileDescriptorProto:
    """``proto`` compiled by grpcio-tools' protoc (its descriptor; imports are not followed)."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        rc = protoc.main(["protoc", f"-I{proto.parent}", f"--descriptor_set_out={out}", proto.name])
        if rc != 0 or not out.is_file():
            raise RuntimeError(f"protoc could not compile {proto} (exit {rc})")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]


@functools.cache
def messages() -> tuple[type, type]:
    """The ``Request`` and ``Response`` message classes of :data:`PROTO`, in a descriptor pool of their own."""
    pool = descriptor_pool.DescriptorPool()
    pool.Add(compile_proto(PROTO))
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
                 for name in ("Request", "Response"))


def prompt_samples(data: bytes, name: str) -> np.ndarray:
    """float32 samples of a prompt sent as 16-bit PCM at 16 kHz; 400 naming ``name`` when it is not that."""
    if not data:
        raise GatewayError(400, f"{name}: empty; send the prompt as 16-bit PCM at {PROMPT_RATE} Hz",
                           param=name, code="invalid_audio")
    if len(data) % 2:
        raise GatewayError(400, f"{name}: {len(data)} bytes is not a whole number of 16-bit samples", param=name,
                           code="invalid_audio")
    seconds = len(data) / 2 / PROMPT_RATE
    if seconds > MAX_SECONDS:
        raise GatewayError(400, f"{name}: {seconds:.1f} s at {PROMPT_RATE} Hz; at most {MAX_SECONDS:g} s",
                           param=name, code="invalid_audio")
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


def speech_job(request, config: GatewayConfig, ns) -> SpeechJob:
    """The job of one ``Request`` (a voice id in ``ns``, the caller's namespace); 400 naming the field."""
    kind = request.WhichOneof("RequestPayload")
    if kind is None:
        raise GatewayError(400, f"request: give one of {', '.join(KINDS)}", param="request", code="invalid_value")
    r = getattr(request, kind)
    text = form_text(r.tts_text, f"{kind}.tts_text", config)
    if kind == "sft_request":
        return SpeechJob(text=text, voice=voice_id(ns, r.spk_id, f"{kind}.spk_id"))
    if kind == "instruct_request":
        how = form_text(r.instruct_text, f"{kind}.instruct_text", config)
        return SpeechJob(text=text, voice=voice_id(ns, r.spk_id, f"{kind}.spk_id"), instruct=instruction(how),
                         mode="instruct")
    prompt = prompt_samples(r.prompt_audio, f"{kind}.prompt_audio")
    if kind == "zero_shot_request":
        return SpeechJob(text=text, reference_audio=prompt, reference_rate=PROMPT_RATE, mode="zero_shot",
                         reference_text=form_text(r.prompt_text, f"{kind}.prompt_text", config))
    return SpeechJob(text=text, reference_audio=prompt, reference_rate=PROMPT_RATE, mode="cross_lingual")


class OfficialService:
    """``Inference`` on ``backend()`` (the app's speech backend, made at its startup), behind ``keys`` and
    ``limiter`` (the per-key limits, then the fair gate: one slot for the whole call)."""

    def __init__(self, backend: Callable[[], object], keys: KeyRing, limiter: KeyLimiter, config: GatewayConfig,
                 metrics=None):
        self.backend, self.keys, self.limiter, self.config, self.metrics = backend, keys, limiter, config, metrics

    async def Inference(self, request, context) -> AsyncIterator:
        t0 = time.perf_counter()
        try:
            if isinstance(request, Undecodable):
                raise GatewayError(400, request.message)
            who, ns = caller(self.keys, context)
            job = speech_job(request, self.config, ns)
            await self.limiter.admit(who)
        except GatewayError as exc:
            await context.abort(GRPC_CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)
            return
        _, response = messages()
        seconds = 0.0
        chunks = self.backend().stream(job, uuid.uuid4().hex)
        try:
            async for wave, sr in chunks:
                seconds += len(wave) / sr
                yield response(tts_audio=pcm16(wave).tobytes())
        except GatewayError as exc:
            if self.metrics is not None:
                self.metrics.backend_errors.labels(str(exc.status)).inc()
            # Triton names the scoped voice id: the caller sees its own
            await context.abort(GRPC_CODES.get(exc.status, grpc.StatusCode.INTERNAL), ns.unscoped(exc.message))
        finally:
            await chunks.aclose()
            self.limiter.leave(who)
            if self.metrics is not None:
                self.metrics.audio_seconds.labels("pcm").inc(seconds)
                self.metrics.latency.labels(ROUTE).observe(time.perf_counter() - t0)


def add_service(service: OfficialService, server) -> None:
    """``cosyvoice.CosyVoice`` on ``server`` (a ``grpc.aio`` server); bytes that are not a ``Request`` are refused
    with INVALID_ARGUMENT."""
    request, response = messages()
    handler = grpc.unary_stream_rpc_method_handler(
        service.Inference, request_deserializer=lenient(request.FromString, f"{PACKAGE}.Request"),
        response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(f"{PACKAGE}.{SERVICE}",
                                                                          {METHOD: handler}),))
