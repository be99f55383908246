"""Clients of the served models over HTTP or gRPC (``tritonclient``): voice conversion, text to speech, their
streams, the speech tokens and speaker embedding, registered speakers. :class:`CosyVoiceClient` (synchronous,
:mod:`.sync_client`) and :class:`AsyncCosyVoiceClient` (asyncio, :mod:`.async_client`) share their inputs, results,
errors and priority check (:mod:`.wire`); this module re-exports all of them. ``VCClient`` / ``TTSClient`` and
``AsyncVCClient`` / ``AsyncTTSClient`` are the classes' older names, kept as aliases.

    with CosyVoiceClient("127.0.0.1:8000") as client:                       # one connection, reused
        result = client.convert("source.wav", "prompt.wav")           # paths, bytes, or (samples, rate)
        result.write("out.wav")
        results = client.convert_many([("a.wav", "p.wav"), ("b.wav", "p.wav")])   # concurrently

    async with AsyncCosyVoiceClient("127.0.0.1:8001", protocol="grpc") as client:
        result = await client.convert(samples, prompt, source_sr=16000, prompt_sr=22050)

Audio is decoded here (``soundfile``: wav/flac/ogg from a path or bytes; float or int PCM arrays with their
rate), mixed to mono and sent as float32 samples with their rate (:data:`~cosyvoice_triton.shapes.VC_INPUTS`);
with ``encoded=True`` files are sent as they are (``*_audio_bytes``) and the server decodes them. The server
resamples. A request the server refuses raises
:class:`VCError` carrying the server's own message and status (HTTP 400 / gRPC ``INVALID_ARGUMENT`` for bad
input); ``convert_many`` returns such errors in place of the failed items instead of raising. Calls that failed
for a reason worth another try (server unavailable or overloaded, a timeout, a lost connection) are sent again
with capped, jittered backoff (``retry=``, :mod:`~cosyvoice_triton.clients.retry`; ``retries`` counts them);
bad input never is, nor a stream once it has started.

Streams (``convert_stream``, ``tts_stream``) run over a gRPC stream (``tritonclient``) or, with
``protocol="http"``, over Triton's HTTP ``generate_stream`` endpoint (server-sent events; ``requests`` /
``aiohttp``, as tritonclient has no HTTP streaming call): the same chunks either way. Over HTTP the inputs travel
as JSON fields, so encoded files (``encoded=True``) are decoded here first, and closing a stream early closes its
connection.

The stand-alone speech services: ``speech_tokens(audio)`` (the ``speech_tokens`` model: int32 [T], 25 Hz) and
``speaker_embedding(audio)`` (the ``speaker_embedding`` model: float32 [192], CAM++).

Priorities: every call takes ``priority`` (``None``: the model's default level; 1 is the highest level), passed to
Triton as the request's priority. Triton 2.51 does not refuse a priority beyond a model's ``priority_levels`` (nor
one sent to a model without levels): it serves the request at the model's default level. So the client checks the
priority against the levels the model's config declares (an ensemble: its steps'), once per model, when it can
read the config (a restricted API: it needs the admin key, ``admin_key=`` or ``$COSYVOICE_TRITON_ADMIN_KEY``;
``check_priority=False`` turns the check off), and raises :class:`PriorityError` before sending; without the key
the priority goes as it is. HTTP ``generate_stream`` cannot carry a priority in Triton 2.51 (a ``priority`` field
there becomes a plain request parameter), so an HTTP stream with a priority raises :class:`PriorityError`: use
gRPC.
"""

from __future__ import annotations

from .async_client import AsyncCosyVoiceClient, AsyncTTSClient, AsyncVCClient
from .sync_client import CosyVoiceClient, TTSClient, VCClient
from .wire import (
    DEFAULT_URLS,
    PROTOCOLS,
    SPEAKERS_MODEL,
    VC_STREAM_MODEL,
    JsonFields,
    Pair,
    PriorityError,
    StreamChunk,
    StreamStats,
    VCError,
    VCResult,
    build_inputs,
    build_speaker_inputs,
    build_tts_inputs,
    config_priority_levels,
    connect,
    inference_statistics,
    load_input,
)

__all__ = ["DEFAULT_URLS", "PROTOCOLS", "SPEAKERS_MODEL", "VC_STREAM_MODEL", "AsyncCosyVoiceClient", "AsyncTTSClient",
           "AsyncVCClient", "CosyVoiceClient", "JsonFields", "Pair", "PriorityError", "StreamChunk", "StreamStats",
           "TTSClient", "VCClient", "VCError", "VCResult", "build_inputs", "build_speaker_inputs", "build_tts_inputs",
           "config_priority_levels", "connect", "inference_statistics", "load_input"]
